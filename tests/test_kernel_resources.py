"""Resource gates of the hot kernels, from ptxas (no GPU needed).

The kernels are compiled by NVRTC with the project's options, exactly as the
CUDA backend builds them, and NVRTC's own ptxas reports each kernel's
registers, stack frame and spills (``-Xptxas -v``; a kernel's own and those
of the functions it calls), for sm_90 under CUDA 12 and 13 and sm_100 under
CUDA 13 (tests/kernel_builds.py). At most 64
registers (4 blocks of 256 threads per SM), no spills and no stack frame
keep the grid-stride kernels at full occupancy; several 16-byte loads per
lane per loop iteration keep enough bytes in flight to approach the memory
bandwidth.

Each NVRTC's ptxas allocates registers its own way, so the gates are held
for the NVRTCs pinned in constraints.txt (12.6 and 13.0, what CUDA 12.6 and
13.0 environments with torch load) and constraints-nvrtc-latest.txt (12.9
and 13.5, gated in a second environment): gpuflat._src.kernel_loader.GATED_NVRTC.
For sm_90, the H200's, no hot kernel spills or has a stack frame under any
of them but 13.5's 16-bit AdamW update (8 bytes, once per row); sm_100 and
that one keep the spill ceilings measured per NVRTC (SPILL_CEILINGS),
and a build by an NVRTC with no measurements fails rather than passing
unmeasured.
"""
from __future__ import annotations

import re

import kernel_builds
import pytest

from gpuflat._src import kernel_loader as kl
from gpuflat._src.backends import cuda
from gpuflat._src.dtypes import CUDA_NAMES
from gpuflat._src.layout import AMSGRAD_MIN_BLOCKS_PER_SM, BLOCK_THREADS, RULES

# The optimizers' updates over PyTorch's parameters (every rule's, the
# generic kernel's instantiations too) count for float32 and the 16-bit dtypes; float64's AdamW needs register pairs for every value and
# spills under every gated NVRTC, a dtype no model trains in on a GPU.
OPTIM_ROWS = [rule.rows_kernel(c) for rule in RULES.values() for c in ("float", "f16", "bf16")]
# The update of rows whose precision word is not 0 (states of their own
# dtypes, a master copy or a compensation), every rule's, one element per
# lane at a time: the gated NVRTCs give it 40 to 64 registers, no spills.
MIXED_ROWS = [rule.mixed_rows_kernel(c) for rule in RULES.values() for c in ("float", "f16", "bf16")]
HOT = ([kl.gather_name(d) for d in CUDA_NAMES] + [kl.scatter_name(d) for d in CUDA_NAMES]
       + [kl.norm_partial_name(k) for k in kl.NORM_KINDS] + [kl.norm_one_name(k) for k in kl.NORM_KINDS]
       + [kl.SCALE_NAME, kl.SCALE_AT_NAME] + OPTIM_ROWS
       + MIXED_ROWS)
MAX_REGISTERS = 64
# AMSGrad's row update (a fifth tensor, max_exp_avg_sq) runs at three blocks
# per SM: at four, ptxas spilled 40 to 48 bytes of its 16-bit rows; three
# leave each thread 85 registers, of which the gated NVRTCs use 58 to 78
# (float32 and 16-bit), spilling nothing.
AMSGRAD_ROWS = [RULES["adamw"].rows_kernel(c, "amsgrad") for c in ("float", "f16", "bf16")]
AMSGRAD_MAX_REGISTERS = 65536 // (BLOCK_THREADS * AMSGRAD_MIN_BLOCKS_PER_SM)
# (stack frame, spill store, spill load) bytes each hot kernel may have, by
# the NVRTC (major, minor) that built it and the architecture; a kernel not
# listed may have none. For sm_100, CUDA 13's ptxas keeps the p-norm within
# the 64 registers that __launch_bounds__ asks for by spilling values of the
# item loop (its index, the warp count) around the element loops, whose pow
# is a subroutine holding most registers: stored and loaded once per item,
# none inside the element loops; the one-launch p-norm (kernel 1's loop and
# the finishing block's pass over the partials, gpuflat_norm_one) spills
# nothing under 13.0 and, under 13.5, what kernel 1 stores, loaded again in
# more places. They are ceilings, so more spilling fails;
# a new NVRTC is measured and added here (and to GATED_NVRTC and the
# constraints files) before it is gated. CUDA 13.5's ptxas keeps the 16-bit
# AdamW update within its 64 registers by storing one value once per row
# and per kernel, outside the element loops (test_kernel_sass checks that
# no hot kernel's innermost loop touches local memory).
SPILL_CEILINGS = {
    ((12, 6), "sm_90"): {},
    ((12, 9), "sm_90"): {},
    ((13, 0), "sm_90"): {},
    ((13, 5), "sm_90"): {"gpuflat_adamw_rows<f16>": (8, 8, 8), "gpuflat_adamw_rows<bf16>": (8, 8, 8)},
    ((13, 0), "sm_100"): {"gpuflat_norm_partial<3>": (8, 8, 8)},
    ((13, 5), "sm_100"): {"gpuflat_norm_partial<3>": (24, 28, 28), "gpuflat_norm_one<3>": (24, 28, 72)},
}
# The instantiations with the update statistics (Rule.rows_kernel and
# Rule.mixed_rows_kernel with stats=True: kernels/optim.cu's gf_lane_stats)
# hold two float sums per lane and, through each rule's arithmetic, the
# value it started from: a few registers more than their twins, which keep
# the gates above untouched. They are gated as their twins are (64
# registers, AMSGrad's 85 at three blocks per SM), with spill ceilings of
# their own measured per NVRTC: none under CUDA 12.6, 12.9 and 13.0 for
# sm_90; the 16-bit AdamW rows under 13.5 (whose twins spill 8 bytes
# already), and a few of sm_100's. Double sums per lane spilled the 16-bit
# AdamW rows under every gated NVRTC (8 to 40 bytes). The finisher adding
# each row's items (gpuflat_row_stats) uses about 24 registers.
STATS_ROWS = ([rule.rows_kernel(c, stats=True) for rule in RULES.values() for c in ("float", "f16", "bf16")]
              + [rule.mixed_rows_kernel(c, stats=True) for rule in RULES.values() for c in ("float", "f16", "bf16")]
              + [kl.ROW_STATS_NAME])
STATS_AMSGRAD_ROWS = [RULES["adamw"].rows_kernel(c, "amsgrad", stats=True) for c in ("float", "f16", "bf16")]
_ADAMW_16 = [RULES["adamw"].rows_kernel(c, stats=True) for c in ("f16", "bf16")]
_AMSGRAD_16 = [RULES["adamw"].rows_kernel(c, "amsgrad", stats=True) for c in ("f16", "bf16")]
STATS_SPILL_CEILINGS = {
    ((12, 6), "sm_90"): {},
    ((12, 9), "sm_90"): {},
    ((13, 0), "sm_90"): {},
    ((13, 5), "sm_90"): {**dict.fromkeys(_ADAMW_16, (24, 32, 32)), **dict.fromkeys(_AMSGRAD_16, (8, 16, 32))},
    ((13, 0), "sm_100"): {RULES["adamw"].mixed_rows_kernel("bf16", stats=True): (16, 20, 20)},
    ((13, 5), "sm_100"): dict.fromkeys(_ADAMW_16, (48, 52, 52)),
}
# A 16-byte load in the PTX: four 32-bit words, or two 64-bit ones (double
# and complex128 leaves).
VECTOR_LOAD = re.compile(r"^\s*ld(?:\.global)?(?:\.nc)?\.(?:v4\.[bfsu]32|v2\.[bfsu]64)\b", re.M)


def _entry_ptx(major: int, arch: str, name: str) -> str:
    compiled = kernel_builds.build(major, arch)
    start = re.search(rf"^\.(?:visible|weak) \.entry {compiled.lowered[name]}\(", compiled.ptx, re.M).start()
    end = compiled.ptx.find("\n}\n", start)
    return compiled.ptx[start:end]


def _ceilings(major: int, arch: str) -> dict:
    """SPILL_CEILINGS of the NVRTC that built the (major, arch) target here;
    fails, naming it, where that NVRTC was never measured."""
    version = kl.nvrtc_version(major)
    if (version, arch) not in SPILL_CEILINGS:
        gated = ", ".join(f"{a}.{b}" for a, b in kl.GATED_NVRTC)
        pytest.fail(f"CUDA {major}, {arch}: NVRTC {version[0]}.{version[1]} is not a gated NVRTC, so its "
                    f"registers and spills have no measured ceilings; the gated versions ({gated}) are those "
                    "pinned in constraints.txt and constraints-nvrtc-latest.txt: install one of those pairs "
                    "(pip's -c), or measure this NVRTC and add it to SPILL_CEILINGS and the constraints")
    return SPILL_CEILINGS[(version, arch)]


def test_the_ceilings_cover_exactly_the_gated_nvrtcs():
    # One entry per gated NVRTC and gated target of its major: a version
    # pinned in the constraints but never measured fails here, not silently.
    expected = {(version, arch) for version in kl.GATED_NVRTC for major, arch in kernel_builds.GATED
                if version[0] == major}
    assert set(SPILL_CEILINGS) == expected


def test_sm_90_spills_only_the_16_bit_adamw_rows_under_13_5():
    # The H200's kernels keep every value in registers under every gated
    # NVRTC, but for CUDA 13.5's 16-bit AdamW rows (8 bytes, once per row).
    spilling = {(version, name) for (version, arch), ceilings in SPILL_CEILINGS.items() if arch == "sm_90"
                for name in ceilings}
    assert spilling == {((13, 5), RULES["adamw"].rows_kernel(c)) for c in ("f16", "bf16")}


def test_the_stats_ceilings_cover_exactly_the_gated_nvrtcs():
    assert set(STATS_SPILL_CEILINGS) == set(SPILL_CEILINGS)


@pytest.mark.parametrize("major,arch", kernel_builds.GATED)
def test_the_loaded_nvrtc_has_measured_ceilings(major, arch):
    _ceilings(major, arch)


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
    where = f"{name} (NVRTC %d.%d, {arch})" % kl.nvrtc_version(major)
    assert regs <= MAX_REGISTERS, f"{where}: {regs} registers, expected at most {MAX_REGISTERS}"
    ceiling = _ceilings(major, arch).get(name, (0, 0, 0))
    assert all(found <= most for found, most in zip((stack, spill_st, spill_ld), ceiling)), \
        f"{where}: stack {stack} B, spills {spill_st}/{spill_ld} B, expected at most {ceiling}"


@pytest.mark.parametrize("major,arch", kernel_builds.GATED)
@pytest.mark.parametrize("name", AMSGRAD_ROWS)
def test_amsgrad_rows_fit_three_blocks_per_sm_without_spills_or_stack(name, major, arch):
    lowered = kernel_builds.build(major, arch).lowered[name]
    regs, stack, spill_st, spill_ld = kernel_builds.resources(major, arch)[lowered]
    where = f"{name} (NVRTC %d.%d, {arch})" % kl.nvrtc_version(major)
    assert regs <= AMSGRAD_MAX_REGISTERS and (stack, spill_st, spill_ld) == (0, 0, 0), \
        f"{where}: {regs} registers, stack {stack} B, spills {spill_st}/{spill_ld} B, expected at most " \
        f"{AMSGRAD_MAX_REGISTERS} registers and none"


@pytest.mark.parametrize("major,arch", kernel_builds.GATED)
@pytest.mark.parametrize("name", STATS_ROWS + STATS_AMSGRAD_ROWS)
def test_stats_rows_fit_their_twins_registers_within_their_spill_ceilings(name, major, arch):
    lowered = kernel_builds.build(major, arch).lowered[name]
    regs, stack, spill_st, spill_ld = kernel_builds.resources(major, arch)[lowered]
    where = f"{name} (NVRTC %d.%d, {arch})" % kl.nvrtc_version(major)
    most = AMSGRAD_MAX_REGISTERS if name in STATS_AMSGRAD_ROWS else MAX_REGISTERS
    _ceilings(major, arch)  # a gated NVRTC
    ceiling = STATS_SPILL_CEILINGS[(kl.nvrtc_version(major), arch)].get(name, (0, 0, 0))
    assert regs <= most, f"{where}: {regs} registers, expected at most {most}"
    assert all(found <= at_most for found, at_most in zip((stack, spill_st, spill_ld), ceiling)), \
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
    where = f"{name} (NVRTC %d.%d, {arch})" % kl.nvrtc_version(major)
    assert regs <= 255 and (stack, spill_st, spill_ld) == (0, 0, 0), \
        f"{where}: {regs} registers, stack {stack} B, spills {spill_st}/{spill_ld} B, expected none"


@pytest.mark.parametrize("name", [kl.norm_partial_name(k) for k in ("l1", "l2", "inf")]
                         + [kl.gather_name(d) for d in CUDA_NAMES])
@pytest.mark.parametrize("major", [12, 13])
def test_hot_loops_keep_several_vector_loads_in_flight(name, major):
    # Each dtype branch unrolls its lane loop into four 16-byte loads (two
    # for the complex leaves of the 1- and inf-norms, see gf_norm_unroll),
    # and one more for the last vectors; the compiler merges a few identical
    # branches (f16 and bf16 load the same way), so ask for three per dtype.
    loads = len(VECTOR_LOAD.findall(_entry_ptx(major, "sm_90", name)))
    assert loads >= 3 * len(CUDA_NAMES), f"{name}: {loads} 16-byte loads, expected at least {3 * len(CUDA_NAMES)}"


def test_block_constants_mirror_the_header():
    header = kl.sources()["gpuflat_common.cuh"]
    defines = dict(re.findall(r"^#define (GF_\w+) (\d+)", header, re.M))
    assert int(defines["GF_BLOCK_THREADS"]) == cuda.BLOCK_THREADS
    assert int(defines["GF_BLOCK_THREADS"]) * int(defines["GF_MIN_BLOCKS_PER_SM"]) * MAX_REGISTERS == 65536
