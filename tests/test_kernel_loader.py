"""The kernel loader (#3): sources found, names, cache key, and a real NVRTC
compile of every kernel for sm_70, sm_80 and sm_90 (no GPU needed)."""
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


@pytest.mark.parametrize("arch", ["sm_70", "sm_80", "sm_90"])
def test_every_kernel_compiles_to_ptx(nvrtc, arch):
    out = kl.compile_ptx(arch)
    assert "error" not in out.log.lower()
    assert set(out.lowered) == set(kl.name_expressions())
    for lowered in out.lowered.values():
        assert re.search(rf"\.entry\s+{re.escape(lowered)}\s*\(", out.ptx), lowered
    # 64-bit indexing (#3): the item loop steps with 64-bit integers.
    assert ".target sm_" + arch.split("_")[1] in out.ptx


def test_cubin_for_a_real_architecture(nvrtc):
    # The full back end (register allocation included) for one target.
    out = kl.compile("sm_90", cubin=True)
    assert out.cubin[:4] == b"\x7fELF"


def test_compile_error_carries_the_log(tmp_path, nvrtc):
    d = tmp_path / "kernels"
    d.mkdir()
    (d / "broken.cu").write_text("__global__ void broken() { undefined_thing(); }\n")
    with pytest.raises(RuntimeError, match="undefined_thing"):
        kl.compile_ptx("sm_80", d)


def test_gather_and_scatter_names_follow_the_dtype_table():
    assert kl.gather_name(np.float16) == "gpuflat_gather<f16>"
    assert kl.scatter_name(np.complex64) == "gpuflat_scatter<c64>"
