"""The kernel loader: sources found, names, cache key, NVRTC found in every
wheel layout, and a real NVRTC compile of every kernel for sm_70, sm_80 and
sm_90 (no GPU needed) with no warning and no flush-to-zero."""
import builtins
import re
import shutil

import numpy as np
import pytest

from gpuflat import kernel_loader as kl
from gpuflat.backends import cuda
from gpuflat.dtypes import CUDA_NAMES


def test_sources_found():
    names = set(kl.sources())
    assert {"gather_scatter.cu", "norms.cu", "gpuflat_common.cuh"} <= names
    assert all(n.endswith((".cu", ".cuh")) for n in names)


def test_assembled_source_expands_each_header_once():
    code = kl.assembled_source()
    assert "#include" not in code
    assert code.count("struct LeafRef {") == 1


def test_name_expressions_cover_every_dtype_and_norm_kind():
    names = kl.name_expressions()
    assert len(names) == len(set(names))
    for c_name in CUDA_NAMES.values():
        assert f"gpuflat_gather<{c_name}>" in names
        assert f"gpuflat_scatter<{c_name}>" in names
    for k in kl.NORM_KINDS.values():
        assert f"gpuflat_norm_partial<{k}>" in names and f"gpuflat_norm_finish<{k}>" in names


def test_python_constants_mirror_the_header():
    header = kl.sources()["gpuflat_common.cuh"]
    defines = dict(re.findall(r"^#define (GF_\w+) (\d+)", header, re.M))
    assert int(defines["GF_MAX_DIMS"]) == cuda.MAX_DIMS
    assert int(defines["GF_FINISH_THREADS"]) == cuda.FINISH_THREADS
    assert int(defines["GF_SMALL_SLOT_ITEMS"]) == cuda.SMALL_SLOT_ITEMS
    # The item size keeps every item of a leaf as aligned as the leaf (16 bytes).
    assert cuda.ITEM % (32 * 8) == 0


@pytest.mark.parametrize("name", ["gpuflat_common.cuh", "norms.cu", "emulator/cuda_host.h"])
def test_cache_key_changes_when_any_file_changes(tmp_path, name):
    d = tmp_path / "kernels"
    shutil.copytree(kl.kernel_dir(), d, ignore=shutil.ignore_patterns("__pycache__"))
    before = kl.cache_key(d)
    assert before == kl.cache_key(d)
    target = d / name
    assert target.exists(), f"{name} not present"
    target.write_text(target.read_text() + "\n// edited\n")
    assert kl.cache_key(d) != before


def test_missing_include_is_reported(tmp_path):
    d = tmp_path / "kernels"
    d.mkdir()
    (d / "a.cu").write_text('#include "nowhere.cuh"\n')
    with pytest.raises(FileNotFoundError, match="nowhere.cuh"):
        kl.assembled_source(d)


@pytest.fixture(scope="module")
def nvrtc():
    return kl.nvrtc_library()  # the NVRTC wheel is a test dependency: no skip


# float32 (and the float32 math of complex64, bfloat16, float16) instructions
# that flush subnormals to zero: cvt.ftz.f32.f16, mul.rn.ftz.f32, ...
_FTZ_F32 = re.compile(r"^\s*(?:@%p\d+\s+)?[a-z]+(?:\.\w+)*\.ftz(?:\.\w+)*\.f32\b.*$", re.M)


def ftz_f32_instructions(ptx: str) -> list[str]:
    return [m.group(0).strip() for m in _FTZ_F32.finditer(ptx)]


def entry_params(ptx: str) -> dict:
    """Kernel entry -> the PTX types of its parameters."""
    entries = re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx)
    return {name: re.findall(r"\.param\s+\.(\w+)", params) for name, params in entries}


@pytest.mark.parametrize("arch", ["sm_70", "sm_80", "sm_90"])
def test_every_kernel_compiles_to_ptx(nvrtc, arch):
    out = kl.compile_ptx(arch)
    assert kl.code_warnings(out.log) == []
    assert set(out.lowered) == set(kl.name_expressions())
    params = entry_params(out.ptx)
    assert set(params) == set(out.lowered.values())
    assert ".target sm_" + arch.split("_")[1] in out.ptx
    # 64-bit indexing: every count, offset and pointer reaches the kernels as
    # 64 bits (a 32-bit integer parameter would cap the items at 2**31).
    for name, types in params.items():
        assert types and set(types) <= {"u64", "s64", "f64"}, (name, types)
    # Subnormals survive: no float32 instruction flushes to zero.
    assert ftz_f32_instructions(out.ptx) == []


def test_the_ftz_check_sees_cupys_flag(nvrtc):
    # CuPy's RawModule appends -ftz=true; the check above must notice it.
    out = kl.nvrtc_compile("sm_80", options=kl.OPTIONS + ("-ftz=true",))
    found = ftz_f32_instructions(out.ptx)
    assert any(line.startswith(("cvt", "mul")) for line in found), found[:5]


@pytest.fixture(scope="module")
def sm90_cubin(nvrtc):
    # The full back end (register allocation included) for one target.
    return kl.nvrtc_compile("sm_90", cubin=True)


def test_cubin_for_a_real_architecture(sm90_cubin):
    assert sm90_cubin.cubin[:4] == b"\x7fELF"
    assert set(sm90_cubin.lowered) == set(kl.name_expressions())


def test_device_cubin_is_the_checked_compile(sm90_cubin, tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(tmp_path))
    kl._device_cubin.cache_clear()
    try:
        built = kl.device_cubin("sm_90")
        kl._device_cubin.cache_clear()
        from_disk = kl.device_cubin("sm_90")
    finally:
        kl._device_cubin.cache_clear()
    assert from_disk.cubin == built.cubin == sm90_cubin.cubin
    assert from_disk.lowered == built.lowered == sm90_cubin.lowered
    assert len(list(tmp_path.rglob("*.cubin"))) == 1


def test_compile_error_carries_the_log(tmp_path, nvrtc):
    d = tmp_path / "kernels"
    d.mkdir()
    (d / "broken.cu").write_text("__global__ void broken() { undefined_thing(); }\n")
    with pytest.raises(RuntimeError, match="undefined_thing"):
        kl.compile_ptx("sm_80", d)


def test_a_warning_is_an_error(tmp_path, nvrtc, monkeypatch):
    d = tmp_path / "kernels"
    d.mkdir()
    (d / "warns.cu").write_text("__global__ void warns() { int unused; }\n")
    monkeypatch.setattr(kl, "name_expressions", lambda: ["warns"])
    with pytest.raises(RuntimeError, match=r"warnings are errors[\s\S]*unused"):
        kl.compile_ptx("sm_80", d)


def test_nvrtc_is_found_in_the_cuda_12_and_13_wheels_and_cuda_path(tmp_path, monkeypatch):
    import nvidia

    cu12 = tmp_path / "site" / "nvidia" / "cuda_nvrtc" / "lib"
    cu13 = tmp_path / "site" / "nvidia" / "cu13" / "lib"
    toolkit = tmp_path / "cuda" / "lib64"
    for d, name in ((cu12, "libnvrtc.so.12"), (cu13, "libnvrtc.so.13"), (toolkit, "libnvrtc.so.13")):
        d.mkdir(parents=True)
        (d / name).write_bytes(b"")
        (d / "libnvrtc-builtins.so.13").write_bytes(b"")
    monkeypatch.setattr(nvidia, "__path__", [str(tmp_path / "site" / "nvidia")])
    monkeypatch.setenv("CUDA_PATH", str(tmp_path / "cuda"))
    found = kl.nvrtc_candidates()
    expected = [str(cu12 / "libnvrtc.so.12"), str(cu13 / "libnvrtc.so.13"), str(toolkit / "libnvrtc.so.13")]
    assert found[:3] == expected
    assert not any("builtins" in c for c in found)


def test_gather_and_scatter_names_follow_the_dtype_table():
    assert kl.gather_name(np.float16) == "gpuflat_gather<f16>"
    assert kl.scatter_name(np.complex64) == "gpuflat_scatter<c64>"


def test_no_builtin_is_shadowed():
    public = {n for n in vars(kl) if not n.startswith("_")}
    assert public & set(dir(builtins)) == set()
