"""Instruction-count gates of the hot loops, from the sm_90 SASS (no GPU needed).

The kernels are compiled as an H200 loads them: the sm_90 cubin of CUDA 12's
NVRTC and of CUDA 13's, with the project's options (the builds
tests/kernel_builds.py shares; a GPU's runtime major picks one, see
gpuflat._src.kernel_loader.cupy_module), and disassembled with the nvdisasm of the
nvidia-cuda-nvdisasm wheel. Which NVRTC of each major runs the gates is
pinned: constraints.txt pins the builds that CUDA 12.6 and 13.0 environments
load, constraints-nvrtc-latest.txt the newest of each major, gated in a
second environment. A hot loop is a loop of the SASS (a backward branch)
holding several 16-byte loads; its static instruction count over the
elements one pass handles is what each element costs to issue. An H200
moves about 2e12 bfloat16 elements a second through a norm; at 32 lanes per
issued warp instruction and about 1e12 warp instructions a second over its
132 SMs, the loops below stay well under the issue rate the memory allows,
which the earlier kernels' 38 instructions per bfloat16 norm element (8 for
float32) did not.
"""
from __future__ import annotations

import re
import subprocess
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

from gpuflat._src import kernel_loader as kl
from gpuflat._src.dtypes import bfloat16
from gpuflat._src.layout import RULES

import kernel_builds

# Instructions per element of each hot loop, with what every gated NVRTC's
# build measures (CUDA 12 and 13 alike) in brackets: norm_partial l2
# (float32 3.5, bfloat16 5.0), gather with matching dtypes, a raw 16-byte
# copy (float32 3.1 to 3.4, bfloat16 2.9).
MAX_NORM_FLOAT32 = 4.5
MAX_NORM_BFLOAT16 = 6.0
MAX_COPY_FLOAT32 = 4.0
MAX_COPY_BFLOAT16 = 3.5
VECTOR_LOAD = re.compile(r"^LDG?\.E\.128")
VECTOR_STORE = re.compile(r"^STG?\.E\.128")
CONVERSION = re.compile(r"^(F2F|HADD2\.F32|F2FP|I2F|F2I)")


def _tool(name: str) -> Path:
    """A CUDA binary from the NVIDIA wheels (bin/ of nvidia/cuda_nvdisasm, or
    of nvidia/cu13 for the CUDA 13 wheels)."""
    import nvidia  # the wheels share this namespace package

    for base in nvidia.__path__:
        for found in sorted(Path(base).glob(f"*/bin/{name}")):
            return found
    raise FileNotFoundError(f"{name} not found in the NVIDIA wheels")


# The CUDA majors whose sm_90 cubin is gated: a CUDA 12 and a CUDA 13
# environment each load their own major's build.
MAJORS = [12, 13]


@lru_cache(maxsize=None)
def _sass(major: int) -> dict:
    """Lowered entry name -> its SASS instructions (opcode and operands) and
    labels, in CUDA ``major``'s sm_90 cubin."""
    compiled = kernel_builds.build(major, "sm_90")  # the cubin the resource gates read, built once
    tmp = Path("/dev/shm" if Path("/dev/shm").is_dir() else "/tmp")
    cubin = tmp / f"gpuflat-sass-{id(compiled)}.cubin"
    cubin.write_bytes(compiled.cubin)
    try:
        text = subprocess.run([str(_tool("nvdisasm")), "-c", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    finally:
        cubin.unlink(missing_ok=True)
    functions = {}
    for m in re.finditer(r"^\s*\.text\.(\w+):\n(.*?)(?=^\s*\.section|\Z)", text, re.M | re.S):
        instructions, labels = [], {}
        for line in m.group(2).splitlines():
            if label := re.match(r"^\s*(\.L_x_\d+):", line):
                labels[label.group(1)] = len(instructions)
            elif ins := re.match(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?(.*?)\s*;", line):
                instructions.append(ins.group(1))
        functions[m.group(1)] = (instructions, labels)
    return {name: functions[lowered] for name, lowered in compiled.lowered.items()}


def _loop_spans(major: int, name: str) -> list[tuple[int, int]]:
    """(first, last) instruction of every loop of kernel ``name``: a backward branch and its target."""
    instructions, labels = _sass(major)[name]
    spans = []
    for i, ins in enumerate(instructions):
        m = re.match(r"BRA `?\(?(\.L_x_\d+)", ins)
        if m and labels.get(m.group(1), i + 1) <= i:
            spans.append((labels[m.group(1)], i))
    return spans


def _loops(major: int, name: str) -> list[Counter]:
    """Opcode counts of every loop of kernel ``name``, with '' -> its length."""
    instructions, _ = _sass(major)[name]
    loops = []
    for first, last in _loop_spans(major, name):
        body = instructions[first : last + 1]
        ops = Counter(x.split()[0] for x in body)
        ops[""] = len(body)
        loops.append(ops)
    return loops


def _count(ops: Counter, pattern: re.Pattern) -> int:
    return sum(n for op, n in ops.items() if op and pattern.match(op))


def _norm_loops(major: int, values_per_vector: int, half: bool, name: str) -> list[float]:
    """Instructions per element of the l2 norm kernel ``name``'s hot loops
    whose 16-byte vectors hold ``values_per_vector`` reals (one DMUL squares
    each), float16 ones (HADD2.F32 widens them) told apart from bfloat16 by
    ``half``."""
    per = []
    for ops in _loops(major, name):
        loads = _count(ops, VECTOR_LOAD)
        if loads >= 4 and ops["DMUL"] == values_per_vector * loads and bool(ops["HADD2.F32"]) == half:
            per.append(ops[""] / ops["DMUL"])
    return per


def _copy_loops(major: int, dtype, itemsize: int) -> list[float]:
    """Instructions per element of gather<dtype>'s loops that copy 16-byte
    words unconverted (a source of the flat buffer's own dtype)."""
    per = []
    for ops in _loops(major, kl.gather_name(dtype)):
        loads, stores = _count(ops, VECTOR_LOAD), _count(ops, VECTOR_STORE)
        if loads >= 4 and stores == loads and not _count(ops, CONVERSION) and not ops["DMUL"] + ops["FMUL"]:
            per.append(ops[""] / (stores * 16 // itemsize))
    return per


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("what, per, limit", [
    ("l2 norm of float32 (and complex64) leaves", lambda m: _norm_loops(m, 4, False, kl.norm_partial_name("l2")),
     MAX_NORM_FLOAT32),
    ("l2 norm of bfloat16 leaves", lambda m: _norm_loops(m, 8, False, kl.norm_partial_name("l2")),
     MAX_NORM_BFLOAT16),
    # The one-launch norm runs kernel 1's loops.
    ("one-launch l2 norm of float32 (and complex64) leaves",
     lambda m: _norm_loops(m, 4, False, kl.norm_one_name("l2")), MAX_NORM_FLOAT32),
    ("one-launch l2 norm of bfloat16 leaves", lambda m: _norm_loops(m, 8, False, kl.norm_one_name("l2")),
     MAX_NORM_BFLOAT16),
    ("float32 gather of float32 leaves", lambda m: _copy_loops(m, np.float32, 4), MAX_COPY_FLOAT32),
    ("bfloat16 gather of bfloat16 leaves", lambda m: _copy_loops(m, bfloat16(), 2), MAX_COPY_BFLOAT16),
], ids=["norm-float32", "norm-bfloat16", "one-float32", "one-bfloat16", "copy-float32", "copy-bfloat16"])
def test_hot_loop_instructions_per_element(what, per, limit, major):
    found = per(major)
    assert found, f"{what}: no hot loop found in the CUDA {major} SASS"
    assert max(found) <= limit, \
        f"{what}: {max(found):.2f} SASS instructions per element (CUDA {major}), expected at most {limit}"


# The optimizers' update over PyTorch's parameters, per element of its
# 16-byte-vector loop, for float32, float16 and bfloat16 parameters alike.
# Measured (CUDA 12 and 13): AdamW float32 48.25, 16-bit 51.25 to 51.5; SGD
# float32 17.75, 16-bit 19.6 (72 before, AdamW float32 64, bfloat16 69).
# Most of AdamW's is the square root and the division by the denominator,
# IEEE operations whose order PyTorch fixes and gpuflat keeps for its bits:
# about 14 instructions each, their slow-path calls (taken for subnormal,
# huge, zero or special operands) included, since they sit in the loop.
MAX_OPTIM = 60.0
# The instantiations with the update statistics (Rule.rows_kernel with
# stats=True) add five operations per element (d = w - held, d * d, w * w
# and their two sums) and two per vector: AMSGrad's 16-bit loop measured
# 61.9 (CUDA 12) and 62.4 (CUDA 13).
MAX_OPTIM_STATS = MAX_OPTIM + 6.0
# These gates are the 16-byte-vector loops' of the plain row kernels
# (Rule.rows_kernel). The kernels of rows whose precision word is not 0
# (Rule.mixed_rows_kernel) have no such loop: a row's tensors have different
# widths (a bfloat16 parameter's float32 master copy and states), so a lane
# updates one element at a time, reading each state's dtype from the row,
# and a budget per element of a vector loop does not apply to them. They
# hold the register, spill and stack gates of test_kernel_resources (HOT)
# and the local-memory one below.
# Tensors read and written per element, by rule and flag state (the AMSGrad
# instantiation's vector loop for its groups: max_exp_avg_sq too).
TENSORS = {("adamw", None): (4, 3), ("adamw", "amsgrad"): (5, 4), ("sgd", None): (3, 2),
           # A generic rule's kernel reads the parameter, the gradient and its
           # states, and writes all but the gradient.
           **{(rule.name, None): (2 + len(rule.state_names), 1 + len(rule.state_names))
              for rule in RULES.values() if not rule.tuned}}
# A 16-bit element costs what a float32 one does besides its conversions,
# which no float32 element has, and those take one instruction each: one
# per element read (a shift or a mask for bfloat16, HADD2.F32 for float16)
# and one per pair written (F2FP). With them it costs more (AdamW 51.5
# against 48.25), which no loop shape avoids without slowing float32.
WIDENING = re.compile(r"^(HADD2\.F32|SHF\.L\.U32|IMAD\.U32|IMAD\.SHL\.U32|LOP3\.LUT|PRMT)")
NARROWING = re.compile(r"^F2FP")


def _optim_loop(major: int, rule: tuple, c_name: str, per_vector: int,
                stats: bool = False) -> tuple[Counter, int] | None:
    """The cheapest per element of the row update's (``rule``: a key of
    TENSORS; ``stats``: its instantiation with the update statistics) loops
    over 16-byte vectors of C++ type ``c_name`` (one load per tensor read,
    one store per tensor written), and the elements one pass of it updates."""
    read, written = TENSORS[rule]
    found = []
    for ops in _loops(major, RULES[rule[0]].rows_kernel(c_name, rule[1], stats)):
        loads, stores = _count(ops, VECTOR_LOAD), _count(ops, VECTOR_STORE)
        if loads and loads * written == stores * read:
            found.append((ops, loads // read * per_vector))
    return min(found, key=lambda f: f[0][""] / f[1], default=None)


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("stats", [False, True], ids=["", "stats"])
@pytest.mark.parametrize("rule", list(TENSORS), ids=lambda r: "-".join(filter(None, r)))
def test_the_optimizer_updates_read_vectors_and_16_bit_adds_only_its_conversions(rule, stats, major):
    # With the update statistics (stats): the same gates, a few more
    # instructions per element (d = w - held, d * d, w * w and their sums).
    loops = {name: _optim_loop(major, rule, c, n, stats)
             for name, c, n in (("float32", "float", 4), ("bfloat16", "bf16", 8), ("float16", "f16", 8))}
    assert all(loops.values()), f"CUDA {major}: no 16-byte vector loop in the {rule} update: {loops}"
    per = {name: ops[""] / n for name, (ops, n) in loops.items()}
    limit = MAX_OPTIM_STATS if stats else MAX_OPTIM
    for name, found in per.items():
        assert found <= limit, \
            f"{rule} {name} (CUDA {major}): {found:.2f} instructions per element, expected at most {limit}"
    read, written = TENSORS[rule]
    for name in ("bfloat16", "float16"):
        ops, n = loops[name]
        conversions = (_count(ops, WIDENING) + _count(ops, NARROWING)) / n
        assert conversions <= read + written / 2, \
            f"{rule} {name} (CUDA {major}): {conversions:.2f} conversion instructions per element, expected " \
            f"one per element read and one per pair written ({read + written / 2})"
        assert per[name] - conversions <= per["float32"], \
            f"{rule} {name} (CUDA {major}): {per[name] - conversions:.2f} instructions per element besides its " \
            f"conversions, against float32's {per['float32']:.2f}"


@pytest.mark.parametrize("major", MAJORS)
def test_no_hot_kernels_innermost_loop_touches_local_memory(major):
    # Where a gated NVRTC spills a hot kernel (test_kernel_resources'
    # ceilings), the value goes to local memory once per item or row, never
    # inside the loops over elements: an innermost loop (holding no other)
    # has no STL or LDL.
    from test_kernel_resources import AMSGRAD_ROWS, HOT, STATS_AMSGRAD_ROWS, STATS_ROWS

    allowed = STATS_LOOP_LOCAL.get(kl.nvrtc_version(major), {})
    for name in HOT + AMSGRAD_ROWS + STATS_ROWS + STATS_AMSGRAD_ROWS:
        instructions, _ = _sass(major)[name]
        spans = _loop_spans(major, name)
        for first, last in spans:
            if any(first <= a and b <= last and (a, b) != (first, last) for a, b in spans):
                continue  # holds another loop: per item or row
            local = [ins for ins in instructions[first : last + 1] if ins.startswith(("STL", "LDL"))]
            assert len(local) <= allowed.get(name, 0), f"{name} (CUDA {major}): {local} in an innermost loop"


# The local-memory instructions a gated NVRTC's build of an update-statistics
# instantiation may have in one innermost loop, where it spills inside them:
# CUDA 13.5's 16-bit AdamW rows (test_kernel_resources' STATS_SPILL_CEILINGS)
# reload two values per pass of their 8-element vector loop, and store and
# reload the lane's two sums per element of their element loop (AMSGrad's:
# two more loads). No other gated NVRTC's stats loops touch local memory.
STATS_LOOP_LOCAL = {(13, 5): {**{RULES["adamw"].rows_kernel(c, stats=True): 4 for c in ("f16", "bf16")},
                              **{RULES["adamw"].rows_kernel(c, "amsgrad", stats=True): 6 for c in ("f16", "bf16")}}}


def _first_block_loads(major: int, name: str) -> int:
    """Global loads of kernel ``name``'s straight-line code (no branch in
    between) around its first global load, an item's."""
    instructions, _ = _sass(major)[name]
    first = next(i for i, ins in enumerate(instructions) if ins.startswith("LDG"))
    branch = re.compile(r"^(BRA|EXIT)")
    start, end = first, first
    while start > 0 and not branch.match(instructions[start - 1]):
        start -= 1
    while end < len(instructions) and not branch.match(instructions[end]):
        end += 1
    return sum(ins.startswith("LDG") for ins in instructions[start:end])


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("name", [kl.norm_partial_name, kl.norm_one_name], ids=["partial", "one"])
@pytest.mark.parametrize("kind", ["l1", "l2", "p"])
def test_norm_partial_loads_the_leaf_with_the_item(kind, name, major):
    # The item's slot, start and len, then its leaf's data pointer, dtype tag
    # and ndim, all before the first branch: one load latency between the
    # item and its data, where reading each leaf field inside the branch the
    # one before chose made three.
    loads = _first_block_loads(major, name(kind))
    assert loads >= 6, f"{name(kind)} (CUDA {major}): {loads} loads before the first branch, expected at least 6"


# Block barriers of the norm finisher: three for each of its two block trees
# (the largest slots' and the total's; levels within a warp are shuffles),
# one between two of the largest slots and one after the big slots. Each tree
# with a barrier per level took 21 for the total's alone.
MAX_FINISH_BARRIERS = 8


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("kind", list(kl.NORM_KINDS))
def test_norm_finisher_barriers(kind, major):
    instructions, _ = _sass(major)[kl.norm_finish_name(kind)]
    barriers = sum(ins.startswith("BAR") for ins in instructions)
    assert barriers <= MAX_FINISH_BARRIERS, \
        f"norm_finish {kind} (CUDA {major}): {barriers} block barriers, expected at most {MAX_FINISH_BARRIERS}"


@pytest.mark.parametrize("major", MAJORS)
@pytest.mark.parametrize("kind", list(kl.NORM_KINDS))
def test_the_one_launch_norm_reads_the_partials_coherently(kind, major):
    # The block finishing gpuflat_norm_one reads partials other blocks wrote
    # in the same launch: after its ticket (the one atomic) they are plain
    # loads (LDG.E.64, two batches of GF_FINISH_SLOTS: the partials and the
    # flags), never through the read-only cache (.CONSTANT), which holds no
    # promise for memory written during the launch. The one read-only load
    # left is the first bad item's slot, from the items table.
    instructions, _ = _sass(major)[kl.norm_one_name(kind)]
    ticket = next(i for i, ins in enumerate(instructions) if ins.startswith("ATOMG.E.ADD.64"))
    loads = [ins.split()[0] for ins in instructions[ticket:] if ins.startswith("LDG")]
    assert loads.count("LDG.E.64") >= 16 and loads.count("LDG.E.64.CONSTANT") <= 1, \
        f"{kl.norm_one_name(kind)} (CUDA {major}): loads after the ticket {loads}"
