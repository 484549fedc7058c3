"""The kernel loader: sources found, names, cache key, CUDA 12's and 13's
NVRTC found (through cuda.pathfinder, or the wheel of the other major), and
a real compile of every kernel with both NVRTCs for every architecture each
supports (no GPU needed) with no warning and no flush-to-zero."""
import builtins
import re
import shutil
import subprocess
import sys
from types import SimpleNamespace

import cupy_stand_in
import kernel_builds
import numpy as np
import pytest

from gpuflat._src import kernel_loader as kl
from gpuflat._src.backends import cuda
from gpuflat._src.dtypes import CUDA_NAMES
from gpuflat._src.layout import written_headers


def test_sources_found():
    names = set(kl.sources())
    assert {"gather_scatter.cu", "norms.cu", "gpuflat_common.cuh"} <= names
    # The kernel directory's sources, and the headers written from the layout.
    assert all(n.endswith((".cu", ".cuh")) for n in names - set(written_headers()))


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


# float32 (and the float32 math of complex64, bfloat16, float16) instructions
# that flush subnormals to zero: cvt.ftz.f32.f16, mul.rn.ftz.f32, ...
_FTZ_F32 = re.compile(r"^\s*(?:@%p\d+\s+)?[a-z]+(?:\.\w+)*\.ftz(?:\.\w+)*\.f32\b.*$", re.M)


def ftz_f32_instructions(ptx: str) -> list[str]:
    return [m.group(0).strip() for m in _FTZ_F32.finditer(ptx)]


def entry_params(ptx: str) -> dict:
    """Kernel entry -> the PTX types of its parameters."""
    entries = re.findall(r"\.entry\s+(\w+)\s*\(([^)]*)\)", ptx)
    return {name: re.findall(r"\.param\s+\.(\w+)", params) for name, params in entries}


def test_each_major_is_checked_for_the_architectures_it_supports():
    assert kl.CUDA_ARCHS == {12: ("sm_70", "sm_80", "sm_90"), 13: ("sm_75", "sm_80", "sm_90", "sm_100")}
    assert set(kl.NVRTC_WHEELS) == set(kl.CUDA_ARCHS)


@pytest.mark.parametrize("major,arch", kernel_builds.TARGETS)
def test_every_kernel_compiles_to_ptx(major, arch):
    out = kernel_builds.build(major, arch)
    assert kl.code_warnings(out.log) == []
    assert set(out.lowered) == set(kl.name_expressions())
    params = entry_params(out.ptx)
    assert set(params) == set(out.lowered.values())
    assert ".target sm_" + arch.split("_")[1] in out.ptx
    # The PTX is the major's own: its banner names the CUDA release that wrote it.
    assert re.search(rf"^// Cuda compilation tools, release {major}\.", out.ptx, re.M)
    # 64-bit indexing: every count, offset and pointer reaches the kernels as
    # 64 bits (a 32-bit integer parameter would cap the items at 2**31).
    for name, types in params.items():
        assert types and set(types) <= {"u64", "s64", "f64"}, (name, types)
    # Subnormals survive: no float32 instruction flushes to zero.
    assert ftz_f32_instructions(out.ptx) == []


def test_the_ftz_check_sees_cupys_flag():
    # CuPy's RawModule appends -ftz=true; the check above must notice it.
    out = kl.nvrtc_compile("sm_80", 12, options=kl.OPTIONS + ("-ftz=true",))
    found = ftz_f32_instructions(out.ptx)
    assert any(line.startswith(("cvt", "mul")) for line in found), found[:5]


@pytest.mark.parametrize("major,arch", kernel_builds.GATED)
def test_cubin_for_a_real_architecture(major, arch):
    out = kernel_builds.build(major, arch)
    assert out.cubin[:4] == b"\x7fELF"
    assert set(out.lowered) == set(kl.name_expressions())
    # ptxas's report (CUBIN_OPTIONS) is in the log, and no warning.
    assert f"Compiling entry function '{out.lowered[kl.SCALE_NAME]}' for '{arch}'" in out.log
    assert kl.code_warnings(out.log) == []


def test_device_cubin_is_the_checked_compile_and_cached_on_disk(tmp_path, monkeypatch):
    # The device build is the gated build's compile call (same arguments, so
    # the session's build stands in for a second one), then read from disk.
    calls = []
    gated = kernel_builds.build(13, "sm_90")

    def compile_once(arch, major, directory=None, cubin=False, options=kl.OPTIONS):
        calls.append((arch, major, directory, cubin, options))
        return gated

    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kl, "nvrtc_compile", compile_once)
    kl._device_cubin.cache_clear()
    try:
        built = kl.device_cubin("sm_90", 13)
        kl._device_cubin.cache_clear()
        from_disk = kl.device_cubin("sm_90", 13)
    finally:
        kl._device_cubin.cache_clear()
    assert calls == [("sm_90", 13, None, True, kl.OPTIONS)]
    assert from_disk.cubin == built.cubin == gated.cubin
    assert from_disk.lowered == built.lowered == gated.lowered
    assert len(list(tmp_path.rglob("*.cubin"))) == 1


def test_cupy_module_takes_the_nvrtc_of_cupys_runtime(monkeypatch):
    # The stand-in reports CUDA 13 and accepts only the cubin of that major.
    cupy = cupy_stand_in.make_cupy(("90",))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    assert kl.runtime_major() == cupy_stand_in.RUNTIME_VERSION // 1000 == 13
    asked = []  # the session's build stands in for the disk cache
    monkeypatch.setattr(kl, "_device_cubin",
                        lambda arch, major, key: asked.append((arch, major)) or kernel_builds.build(major, arch))
    module, lowered = kl.cupy_module(cupy.cuda.Device(0))
    assert set(asked) == {("sm_90", 13)}
    assert lowered == kernel_builds.build(13, "sm_90").lowered


def test_compile_error_carries_the_log(tmp_path):
    d = tmp_path / "kernels"
    d.mkdir()
    (d / "broken.cu").write_text("__global__ void broken() { undefined_thing(); }\n")
    with pytest.raises(RuntimeError, match="undefined_thing"):
        kl.compile_ptx("sm_80", 13, d)


def test_a_warning_is_an_error(tmp_path, monkeypatch):
    d = tmp_path / "kernels"
    d.mkdir()
    (d / "warns.cu").write_text("__global__ void warns() { int unused; }\n")
    monkeypatch.setattr(kl, "name_expressions", lambda: ["warns"])
    with pytest.raises(RuntimeError, match=r"warnings are errors[\s\S]*unused"):
        kl.compile_ptx("sm_80", 12, d)


def test_pathfinders_nvrtc_is_taken_when_its_major_matches(monkeypatch):
    from cuda import pathfinder

    found = SimpleNamespace(abs_path="/opt/cuda/lib64/libnvrtc.so.13.2.51")
    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", lambda name: found)
    assert kl.nvrtc_path(13) == found.abs_path
    # The other major comes from its own wheel, installed here.
    assert kl.nvrtc_path(12).endswith("nvidia/cuda_nvrtc/lib/libnvrtc.so.12")


def test_a_missing_nvrtc_names_the_wheel_to_install(monkeypatch):
    from cuda import pathfinder

    def not_found(name):
        raise pathfinder.DynamicLibNotFoundError(f"{name} nowhere")

    monkeypatch.setattr(pathfinder, "load_nvidia_dynamic_lib", not_found)
    monkeypatch.setitem(kl.NVRTC_WHEELS, 13, "nvidia-cuda-nvrtc-not-installed")
    with pytest.raises(OSError, match=r"no CUDA 13 NVRTC: cuda.pathfinder found none, expected libnvrtc.so.13; "
                                      r"install nvidia-cuda-nvrtc-not-installed \(the cuda13 extra\)"):
        kl.nvrtc_path(13)


@pytest.mark.parametrize("major", [12, 13])
def test_nvrtc_builtins_are_loaded_before_the_first_compile(major):
    # CUDA 13.0's wheel NVRTC fails every compile unless its builtins are
    # already loaded; NVRTC itself would open them only at the first compile,
    # so a fresh process shows whether the loader did.
    code = ("from gpuflat._src import kernel_loader as kl\n"
            f"kl.nvrtc_library({major})\n"
            "print(open('/proc/self/maps').read())\n")
    maps = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert f"libnvrtc-builtins.so.{major}." in maps
    assert f"libnvrtc.so.{major}" in maps


def test_gather_and_scatter_names_follow_the_dtype_table():
    assert kl.gather_name(np.float16) == "gpuflat_gather<f16>"
    assert kl.scatter_name(np.complex64) == "gpuflat_scatter<c64>"


def test_no_builtin_is_shadowed():
    public = {n for n in vars(kl) if not n.startswith("_")}
    assert public & set(dir(builtins)) == set()


def test_the_disk_cache_is_keyed_by_the_kernel_list(tmp_path, monkeypatch):
    # A build made for one list of kernels is never taken for another: the
    # new list's kernels are built, and there.
    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(tmp_path))
    compiled = []

    def compile_listed(arch, major, directory=None, cubin=False, options=kl.OPTIONS):
        names = kl.name_expressions()
        compiled.append(names)
        return kl.Compiled(arch, major, "", b"cubin of " + ",".join(names).encode(), {n: n for n in names}, "")

    monkeypatch.setattr(kl, "nvrtc_compile", compile_listed)
    full = kl.name_expressions()
    fewer = [n for n in full if "bf16" not in n]
    kl._device_cubin.cache_clear()
    try:
        monkeypatch.setattr(kl, "name_expressions", lambda: fewer)
        assert set(kl.device_cubin("sm_90", 13).lowered) == set(fewer)
        kl._device_cubin.cache_clear()
        monkeypatch.setattr(kl, "name_expressions", lambda: full)
        built = kl.device_cubin("sm_90", 13)
    finally:
        kl._device_cubin.cache_clear()
    assert compiled == [fewer, full]
    assert "gpuflat_gather<bf16>" in built.lowered
    assert len(list(tmp_path.rglob("*.cubin"))) == 2


def test_bf16_kernels_are_listed_without_ml_dtypes():
    code = ("import sys; sys.modules['ml_dtypes'] = None\n"
            "from gpuflat._src import kernel_loader as kl, dtypes\n"
            "assert dtypes.bfloat16() is None\n"
            "print('gpuflat_gather<bf16>' in kl.name_expressions(), 'gpuflat_adamw<bf16>' in kl.name_expressions())")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.split() == ["True", "True"]


def _pins(name: str) -> dict:
    root = kl.kernel_dir().parent
    lines = (root / name).read_text().splitlines()
    return dict(line.split("==") for line in lines if line.startswith("nvidia-cuda-nvrtc"))


def test_the_gated_nvrtcs_are_the_pinned_ones():
    # constraints.txt pins the NVRTCs of `make test`, constraints-nvrtc-latest.txt
    # those of `make test-nvrtc-latest`; the loader's list of gated versions
    # is exactly theirs, and this environment loads one pinned pair.
    pinned = [_pins("constraints.txt"), _pins("constraints-nvrtc-latest.txt")]
    versions = {tuple(map(int, v.split(".")[:2])) for pins in pinned for v in pins.values()}
    assert versions == set(kl.GATED_NVRTC)
    loaded = {f"{a}.{b}" for a, b in (kl.nvrtc_version(12), kl.nvrtc_version(13))}
    assert any(loaded == {".".join(v.split(".")[:2]) for v in pins.values()} for pins in pinned), loaded


@pytest.mark.parametrize("major", [12, 13])
def test_the_loaded_nvrtc_is_logged_and_an_ungated_one_warned(major):
    code = ("import logging\n"
            "from gpuflat._src import kernel_loader as kl\n"
            "kl.GATED_NVRTC = () if %r else kl.GATED_NVRTC\n"
            "kl.nvrtc_library(%d)\n")
    gated = subprocess.run([sys.executable, "-c", code % (False, major)], capture_output=True, text=True, check=True)
    a, b = kl.nvrtc_version(major)
    assert re.search(rf"^gpuflat: NVRTC {a}\.{b} loaded from \S+libnvrtc\.so\.{major}", gated.stderr, re.M)
    assert "not among" not in gated.stderr
    ungated = subprocess.run([sys.executable, "-c", code % (True, major)], capture_output=True, text=True, check=True)
    assert ungated.stderr.count(f"gpuflat: NVRTC {a}.{b} is not among the versions") == 1
