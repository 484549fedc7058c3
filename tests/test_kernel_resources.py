"""Resource gates of the hot kernels, from ptxas for sm_90 (no GPU needed).

The kernels are compiled by NVRTC with the project's options, exactly as the
CUDA backend builds them, and the PTX goes through the ptxas of the
nvidia-cuda-nvcc-cu12 wheel with ``-v``. At most 64 registers (4 blocks of
256 threads per SM), no spills and no stack frame keep the grid-stride kernels
at full occupancy; several 16-byte loads per lane per loop iteration keep
enough bytes in flight to approach the memory bandwidth.
"""
from __future__ import annotations

import re
import subprocess
from functools import lru_cache
from pathlib import Path

import pytest

from gpuflat import kernel_loader as kl
from gpuflat.backends import cuda
from gpuflat.dtypes import CUDA_NAMES

HOT = ([kl.gather_name(d) for d in CUDA_NAMES] + [kl.scatter_name(d) for d in CUDA_NAMES]
       + [kl.norm_partial_name(k) for k in kl.NORM_KINDS] + [kl.SCALE_NAME, kl.SCALE_AT_NAME])
MAX_REGISTERS = 64
VECTOR_LOAD = re.compile(r"^\s*ld(?:\.global)?(?:\.nc)?\.v4\.", re.M)


def _ptxas() -> Path:
    import nvidia.cuda_nvcc as pkg  # the wheel is a namespace package

    for base in pkg.__path__:
        found = Path(base, "bin", "ptxas")
        if found.is_file():
            return found
    raise FileNotFoundError("ptxas not found in the nvidia-cuda-nvcc-cu12 wheel")


@lru_cache(maxsize=1)
def _compiled():
    compile_ = getattr(kl, "nvrtc_compile", None) or kl.compile
    return compile_("sm_90")


@lru_cache(maxsize=1)
def _resources() -> dict:
    """Lowered entry name -> (registers, stack bytes, spill store bytes, spill load bytes)."""
    ptx = Path("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp") / f"gpuflat-{id(_compiled())}.ptx"
    ptx.write_text(_compiled().ptx)
    try:
        log = subprocess.run([str(_ptxas()), "-arch=sm_90", "-v", str(ptx), "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    finally:
        ptx.unlink()
    found, entry, props = {}, None, None
    for line in log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            entry = m.group(1)
        elif m := re.search(r"Function properties for (\w+)", line):
            props = m.group(1)
        elif (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)) \
                and props == entry:
            frame = tuple(map(int, m.groups()))
        elif m := re.search(r"Used (\d+) registers", line):
            found[entry] = (int(m.group(1)),) + frame
    return found


def _entry_ptx(name: str) -> str:
    lowered = _compiled().lowered[name]
    ptx = _compiled().ptx
    start = re.search(rf"^\.(?:visible|weak) \.entry {lowered}\(", ptx, re.M).start()
    end = ptx.find("\n}\n", start)
    return ptx[start:end]


@pytest.mark.parametrize("name", HOT)
def test_hot_kernels_fit_64_registers_without_spills_or_stack(name):
    regs, stack, spill_st, spill_ld = _resources()[_compiled().lowered[name]]
    assert regs <= MAX_REGISTERS, f"{name}: {regs} registers, expected at most {MAX_REGISTERS}"
    assert (stack, spill_st, spill_ld) == (0, 0, 0), f"{name}: stack {stack} B, spills {spill_st}/{spill_ld} B"


@pytest.mark.parametrize("name", [kl.norm_partial_name(k) for k in ("l1", "l2", "inf")]
                         + [kl.gather_name(d) for d in CUDA_NAMES])
def test_hot_loops_keep_several_vector_loads_in_flight(name):
    # Each dtype branch unrolls its lane loop into four 16-byte loads (one per
    # branch before the unrolling); the compiler merges a few identical
    # branches (f16 and bf16 load the same way), so ask for three per dtype.
    loads = len(VECTOR_LOAD.findall(_entry_ptx(name)))
    assert loads >= 3 * len(CUDA_NAMES), f"{name}: {loads} 16-byte loads, expected at least {3 * len(CUDA_NAMES)}"


def test_block_constants_mirror_the_header():
    header = kl.sources()["gpuflat_common.cuh"]
    defines = dict(re.findall(r"^#define (GF_\w+) (\d+)", header, re.M))
    assert int(defines["GF_BLOCK_THREADS"]) == cuda.BLOCK_THREADS
    assert int(defines["GF_BLOCK_THREADS"]) * int(defines["GF_MIN_BLOCKS_PER_SM"]) * MAX_REGISTERS == 65536
