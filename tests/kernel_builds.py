"""NVRTC builds of every kernel, made once per test session and shared by
the files that check them (tests/test_kernel_loader.py: the compile checks;
tests/test_kernel_resources.py: the ptxas gates; tests/test_kernel_sass.py:
the SASS gates).

Each major's NVRTC is the one this environment installed. The gates hold for
the versions in gpuflat._src.kernel_loader.GATED_NVRTC, which constraints.txt pins
(12.6 and 13.0: what torch's CUDA 12.6 and 13.0 wheels, and so a GPU
environment with them, load) and, for a second environment,
constraints-nvrtc-latest.txt (12.9 and 13.5, the newest of each major): one
environment holds one NVRTC per major, and each ptxas allocates registers
its own way.

A whole-kernel build takes tens of seconds of CPU (ptxas most of it), so
each target is built once: PTX only where PTX is all that is checked, a
cubin (with ptxas's resource report, and the PTX too) where the gates read
registers, spills and SASS.
"""
from __future__ import annotations

import re
from functools import cache

from gpuflat._src import kernel_loader as kl

# Every (CUDA major, architecture) the kernels are compiled for.
TARGETS = [(major, arch) for major, archs in kl.CUDA_ARCHS.items() for arch in archs]
# The targets with the register, stack and spill gates: the H200's sm_90
# under both majors (a GPU's runtime major picks the NVRTC), and sm_100
# under CUDA 13 (the first NVRTC to reach it).
GATED = [(12, "sm_90"), (13, "sm_90"), (13, "sm_100")]


@cache
def build(major: int, arch: str) -> kl.Compiled:
    """Every kernel compiled for ``arch`` by CUDA ``major``'s NVRTC: a cubin
    for the :data:`GATED` targets, PTX for the others."""
    return kl.nvrtc_compile(arch, major, cubin=(major, arch) in GATED)


@cache
def resources(major: int, arch: str) -> dict:
    """Lowered entry name -> (registers, stack bytes, spill store bytes,
    spill load bytes), from ptxas's report in the log of a gated build.

    A kernel's stack is its cumulative stack (its own frame and those of the
    functions it calls), and its spills are its own and those of the
    functions it calls out of line (__noinline__), which ptxas lists after
    the kernel: a spill moved into a callee is still the kernel's. Each such
    function is a template instance of its one calling kernel.
    """
    found, entry, props = {}, None, None
    for line in build(major, arch).log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            entry, props = m.group(1), None
            found[entry] = [None, 0, 0, 0]
        elif m := re.search(r"Function properties for (\w+)", line):
            props = m.group(1)
        elif entry and (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                                       line)):
            stack, spill_st, spill_ld = map(int, m.groups())
            row = found[entry]
            if props == entry:
                row[1] = stack
            row[2] += spill_st
            row[3] += spill_ld
        elif entry and (m := re.search(r"Used (\d+) registers", line)):
            found[entry][0] = int(m.group(1))
            if cumulative := re.search(r"(\d+) bytes cumulative stack size", line):
                found[entry][1] = max(found[entry][1], int(cumulative.group(1)))
    return {name: tuple(row) for name, row in found.items()}
