"""NVRTC builds of every kernel, made once per test session and shared by
the files that check them (tests/test_kernel_loader.py: the compile checks;
tests/test_kernel_resources.py: the ptxas gates).

A whole-kernel build takes tens of seconds of CPU (ptxas most of it), so
each target is built once: PTX only where PTX is all that is checked, a
cubin (with ptxas's resource report, and the PTX too) where the gates read
registers and spills.
"""
from __future__ import annotations

import re
from functools import cache

from gpuflat import kernel_loader as kl

# Every (CUDA major, architecture) the kernels are compiled for.
TARGETS = [(major, arch) for major, archs in kl.CUDA_ARCHS.items() for arch in archs]
# The targets with the register, stack and spill gates: the H200's sm_90
# under both majors, and sm_100 under CUDA 13 (the first NVRTC to reach it).
GATED = [(12, "sm_90"), (13, "sm_90"), (13, "sm_100")]


@cache
def build(major: int, arch: str) -> kl.Compiled:
    """Every kernel compiled for ``arch`` by CUDA ``major``'s NVRTC: a cubin
    for the :data:`GATED` targets, PTX for the others."""
    return kl.nvrtc_compile(arch, major, cubin=(major, arch) in GATED)


@cache
def resources(major: int, arch: str) -> dict:
    """Lowered entry name -> (registers, stack bytes, spill store bytes,
    spill load bytes), from ptxas's report in the log of a gated build."""
    found, entry, props, frame = {}, None, None, None
    for line in build(major, arch).log.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            entry, frame = m.group(1), None
        elif m := re.search(r"Function properties for (\w+)", line):
            props = m.group(1)
        elif (m := re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)) \
                and props == entry:
            # The entry's own frame; a called function's is listed under its own name.
            frame = tuple(map(int, m.groups()))
        elif (m := re.search(r"Used (\d+) registers", line)) and frame is not None:
            found[entry] = (int(m.group(1)),) + frame
    return found
