"""Resource gates of the hot kernels, from ptxas (no GPU needed).

The kernels are compiled by NVRTC with the project's options, exactly as the
CUDA backend builds them, and NVRTC's own ptxas reports each kernel's
registers, stack frame and spills (``-Xptxas -v``), for sm_90 under CUDA 12
and 13 and sm_100 under CUDA 13 (tests/kernel_builds.py). At most 64
registers (4 blocks of 256 threads per SM), no spills and no stack frame
keep the grid-stride kernels at full occupancy (under CUDA 13 some kernels
spill: see SPILL_CEILINGS); several 16-byte loads per lane per loop
iteration keep enough bytes in flight to approach the memory bandwidth.
"""
from __future__ import annotations

import re

import kernel_builds
import pytest

from gpuflat import kernel_loader as kl
from gpuflat.backends import cuda
from gpuflat.dtypes import CUDA_NAMES

HOT = ([kl.gather_name(d) for d in CUDA_NAMES] + [kl.scatter_name(d) for d in CUDA_NAMES]
       + [kl.norm_partial_name(k) for k in kl.NORM_KINDS] + [kl.SCALE_NAME, kl.SCALE_AT_NAME])
MAX_REGISTERS = 64
# CUDA 13's ptxas (NVRTC 13.5) keeps these kernels within the 64 registers
# that __launch_bounds__ asks for by spilling to the stack, where CUDA 12's
# fits every one in registers: (stack frame, spill store, spill load) bytes,
# as the gated builds reported them. They are ceilings, so more spilling
# fails; bringing them to zero needs fewer live values in those loops under
# CUDA 13, and another CUDA 13 minor may need them measured again.
SPILL_CEILINGS = {
    (13, "sm_90"): {
        **{kl.scatter_name(d): (8, 16, 16) for d in CUDA_NAMES},
        "gpuflat_norm_partial<0>": (8, 8, 8),
        "gpuflat_norm_partial<1>": (8, 8, 8),
        "gpuflat_norm_partial<2>": (16, 16, 56),
    },
    (13, "sm_100"): {
        "gpuflat_gather<float>": (8, 8, 8),
        "gpuflat_gather<double>": (8, 12, 20),
        "gpuflat_gather<c64>": (16, 12, 12),
        "gpuflat_gather<c128>": (8, 8, 16),
        "gpuflat_scatter<float>": (8, 8, 16),
        "gpuflat_norm_partial<2>": (8, 8, 8),
        "gpuflat_norm_partial<3>": (16, 20, 68),
    },
}
VECTOR_LOAD = re.compile(r"^\s*ld(?:\.global)?(?:\.nc)?\.v4\.", re.M)


def _entry_ptx(major: int, arch: str, name: str) -> str:
    compiled = kernel_builds.build(major, arch)
    start = re.search(rf"^\.(?:visible|weak) \.entry {compiled.lowered[name]}\(", compiled.ptx, re.M).start()
    end = compiled.ptx.find("\n}\n", start)
    return compiled.ptx[start:end]


def test_every_gated_build_reports_every_kernel():
    # The gates below read ptxas's report: it must cover every entry.
    for major, arch in kernel_builds.GATED:
        lowered = set(kernel_builds.build(major, arch).lowered.values())
        assert set(kernel_builds.resources(major, arch)) == lowered, (major, arch)


@pytest.mark.parametrize("major,arch", kernel_builds.GATED)
@pytest.mark.parametrize("name", HOT)
def test_hot_kernels_fit_64_registers_without_spills_or_stack(name, major, arch):
    lowered = kernel_builds.build(major, arch).lowered[name]
    regs, stack, spill_st, spill_ld = kernel_builds.resources(major, arch)[lowered]
    where = f"{name} (CUDA {major}, {arch})"
    assert regs <= MAX_REGISTERS, f"{where}: {regs} registers, expected at most {MAX_REGISTERS}"
    ceiling = SPILL_CEILINGS.get((major, arch), {}).get(name, (0, 0, 0))
    assert all(found <= most for found, most in zip((stack, spill_st, spill_ld), ceiling)), \
        f"{where}: stack {stack} B, spills {spill_st}/{spill_ld} B, expected at most {ceiling}"


@pytest.mark.parametrize("major,arch", kernel_builds.GATED)
@pytest.mark.parametrize("name", [kl.norm_finish_name(k) for k in kl.NORM_KINDS])
def test_norm_finisher_keeps_its_slot_batches_in_registers(name, major, arch):
    # The finisher is one block of 256 threads, so each may use 255
    # registers; two batches of slot loads in flight take about 130 of them.
    # Spilled, they would go through local memory (CUDA 13's ptxas held the
    # inf-norm's to 128 registers for sm_100, and spilled, until the launch
    # bounds asked for one block per SM).
    lowered = kernel_builds.build(major, arch).lowered[name]
    regs, stack, spill_st, spill_ld = kernel_builds.resources(major, arch)[lowered]
    where = f"{name} (CUDA {major}, {arch})"
    assert regs <= 255 and (stack, spill_st, spill_ld) == (0, 0, 0), \
        f"{where}: {regs} registers, stack {stack} B, spills {spill_st}/{spill_ld} B, expected none"


@pytest.mark.parametrize("name", [kl.norm_partial_name(k) for k in ("l1", "l2", "inf")]
                         + [kl.gather_name(d) for d in CUDA_NAMES])
@pytest.mark.parametrize("major", [12, 13])
def test_hot_loops_keep_several_vector_loads_in_flight(name, major):
    # Each dtype branch unrolls its lane loop into four 16-byte loads (one per
    # branch before the unrolling); the compiler merges a few identical
    # branches (f16 and bf16 load the same way), so ask for three per dtype.
    loads = len(VECTOR_LOAD.findall(_entry_ptx(major, "sm_90", name)))
    assert loads >= 3 * len(CUDA_NAMES), f"{name}: {loads} 16-byte loads, expected at least {3 * len(CUDA_NAMES)}"


def test_block_constants_mirror_the_header():
    header = kl.sources()["gpuflat_common.cuh"]
    defines = dict(re.findall(r"^#define (GF_\w+) (\d+)", header, re.M))
    assert int(defines["GF_BLOCK_THREADS"]) == cuda.BLOCK_THREADS
    assert int(defines["GF_BLOCK_THREADS"]) * int(defines["GF_MIN_BLOCKS_PER_SM"]) * MAX_REGISTERS == 65536
