"""The one loader of gpuflat's CUDA kernels.

The kernels are CUDA C files shipped as package data (``gpuflat/kernels`` in
an installed wheel, ``kernels/`` next to the package in a checkout). This
module finds them, names the template instantiations the backends launch,
hashes every source and header into one cache key, and builds them two ways:
NVRTC (:func:`nvrtc_compile`: PTX for the compile checks, a cubin for a real
device; with CUDA 12's or 13's NVRTC, found by NVIDIA's ``cuda.pathfinder``)
and the host emulator library for the ``emulated`` backend.

A GPU runs the very cubin that :func:`nvrtc_compile` makes with
:data:`OPTIONS`, loaded with ``cupy.cuda.function.Module().load``, not a
``cupy.RawModule``: CuPy appends ``-ftz=true`` after the caller's options
(``_compile_with_cache_cuda`` in
https://github.com/cupy/cupy/blob/main/cupy/cuda/compiler.py) and the last
flag wins, so a RawModule would flush float32 subnormals to zero where the
compile checks and the emulator keep them.

>>> "gpuflat_gather<float>" in name_expressions()
True
>>> len(cache_key()) == 64
True
"""
from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from gpuflat._src import host_compiler
from gpuflat._src.dtypes import c_name
from gpuflat._src.layout import C_NAMES, NORM_KINDS, RULES, RULES_HEADER, norm_kind, written_headers

# NVRTC's options, for the compile checks and the GPU alike. No fast-math,
# and flush-to-zero off (NVRTC's default): NaN, inf and subnormals must
# survive the norm and clip kernels as they do on the host. --fmad=false
# keeps a*b+c two roundings, as the host emulator computes it
# (-ffp-contract=off), so the emulated device gives
# the GPU's bits for gather, scatter, clip and the 1-, 2- and inf-norms (the
# order is fixed either way; only pow and hypot may differ by an ulp).
# -default-device makes the lambdas the kernels pass to their helpers device
# code under NVRTC.
OPTIONS = ("-std=c++17", "-default-device", "--fmad=false")

# The kernels templated on a dtype, by its C++ name (gpuflat._src.layout.C_NAMES).
GATHER = "gpuflat_gather<{}>"
SCATTER = "gpuflat_scatter<{}>"
SCALE_NAME = "gpuflat_scale"
# The clip with max_norm in device memory.
SCALE_AT_NAME = "gpuflat_scale_at"

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)


def gather_name(dtype: Any) -> str:
    """Name expression of the gather kernel writing a flat buffer of ``dtype``.

    >>> gather_name(np.float32)
    'gpuflat_gather<float>'
    """
    return GATHER.format(c_name(dtype))


def scatter_name(dtype: Any) -> str:
    """Name expression of the scatter kernel reading a flat buffer of ``dtype``.

    >>> scatter_name(np.complex128)
    'gpuflat_scatter<c128>'
    """
    return SCATTER.format(c_name(dtype))


def norm_partial_name(kind: str) -> str:
    """Name expression of the first norm kernel for a kind of ``NORM_KINDS``.

    >>> norm_partial_name("l2")
    'gpuflat_norm_partial<1>'
    """
    return f"gpuflat_norm_partial<{NORM_KINDS[kind]}>"


def norm_finish_name(kind: str) -> str:
    """Name expression of the second (finishing) norm kernel.

    >>> norm_finish_name("inf")
    'gpuflat_norm_finish<2>'
    """
    return f"gpuflat_norm_finish<{NORM_KINDS[kind]}>"


def norm_one_name(kind: str) -> str:
    """Name expression of the one-launch norm (no per-leaf norms).

    >>> norm_one_name("l2")
    'gpuflat_norm_one<1>'
    """
    return f"gpuflat_norm_one<{NORM_KINDS[kind]}>"


def name_expressions() -> list[str]:
    """Every kernel instantiation the backends may launch.

    Gather and scatter are templated on the flat dtype (the leaf dtype is a
    runtime tag, so a mixed-dtype tree is one launch); the norm kernels (two
    launches, or one) on the norm kind; the clip takes max_norm by value or from device memory. Every
    dtype of gpuflat._src.dtypes is instantiated, whether or not the package that
    provides it (ml_dtypes, for bfloat16) is installed.

    >>> rules = sum(len(rule.kernel_names()) for rule in RULES.values())
    >>> len(name_expressions()) == 2 * len(C_NAMES) + 3 * len(NORM_KINDS) + 2 + rules + 2
    True
    >>> "gpuflat_gather<bf16>" in name_expressions()
    True
    """
    names = []
    for c in C_NAMES:
        names += [GATHER.format(c), SCATTER.format(c)]
    for kind in NORM_KINDS:
        names += [norm_partial_name(kind), norm_finish_name(kind), norm_one_name(kind)]
    names += [SCALE_NAME, SCALE_AT_NAME]
    names += [name for rule in RULES.values() for name in rule.kernel_names()]
    names += [COUNT_STEPS_NAME, ROW_STATS_NAME]
    return names


# The step counts of a tensor-list step, moved after its update.
COUNT_STEPS_NAME = "gpuflat_count_steps"
# Each row's update statistics from its items' partial sums (a step with stats).
ROW_STATS_NAME = "gpuflat_row_stats"


def kernel_dir() -> Path:
    """The directory holding the kernel sources.

    An installed wheel carries them as package data in ``gpuflat/kernels``;
    a checkout keeps them in ``kernels/`` beside the package.

    >>> (kernel_dir() / "norms.cu").is_file()
    True
    """
    here = Path(__file__).resolve().parent.parent  # the package, above _src
    for candidate in (here / "kernels", here.parent / "kernels"):
        if candidate.is_dir() and any(candidate.glob("*.cu")):
            return candidate
    raise FileNotFoundError(
        f"gpuflat kernel sources not found in {here / 'kernels'} or {here.parent / 'kernels'}"
    )


def emulator_header(directory: Path | None = None) -> Path:
    """The host emulator's header, ``emulator/cuda_host.h`` in the kernel directory.

    >>> emulator_header().name
    'cuda_host.h'
    """
    return (Path(directory) if directory is not None else kernel_dir()) / "emulator" / "cuda_host.h"


def sources(directory: Path | None = None) -> dict[str, str]:
    """File name -> text of every ``*.cu`` and ``*.cuh`` in the kernel
    directory, and of the headers written from the layout (``gpuflat_rules.h``
    and ``gpuflat_rule_includes.h``, :func:`gpuflat._src.layout.written_headers`).

    >>> sorted(n for n in sources() if n.endswith(".cu")), RULES_HEADER in sources()
    (['gather_scatter.cu', 'norms.cu', 'optim.cu'], True)
    """
    d = Path(directory) if directory is not None else kernel_dir()
    files = sorted(list(d.glob("*.cu")) + list(d.glob("*.cuh")))
    return {**{f.name: f.read_text() for f in files}, **written_headers()}


def cache_key(directory: Path | None = None) -> str:
    """SHA-256 over every file under the kernel directory, emulator header too,
    the headers written from the layout, and the NVRTC options.

    Hashing the files themselves, not just the top-level source text, means an
    edited header always yields a new compiled module.
    """
    d = Path(directory) if directory is not None else kernel_dir()
    return host_compiler.digest([*OPTIONS, host_compiler.tree_digest(d), *written_headers().values()])


def assembled_source(directory: Path | None = None) -> str:
    """One self-contained translation unit: the ``.cu`` files in sorted order,
    each local ``#include "..."`` expanded once in place.

    NVRTC gets one string with no include path, so the compile reads no file
    but the ones hashed by :func:`cache_key`.

    >>> "#include" in assembled_source()
    False
    """
    texts = sources(directory)
    done: set[str] = set()

    def expand(name: str) -> str:
        if name in done:
            return ""
        done.add(name)
        text = texts[name]
        text = re.sub(r"^[ \t]*#[ \t]*pragma[ \t]+once[ \t]*$", "", text, flags=re.M)

        def include(m: re.Match[str]) -> str:
            target = m.group(1)
            if target not in texts:
                raise FileNotFoundError(f"{name}: includes {target!r}, not among the kernel sources")
            return f"// ---- {target}\n" + expand(target)

        return _INCLUDE.sub(include, text)

    return "\n".join(f"// ==== {n}\n" + expand(n) for n in texts if n.endswith(".cu"))


# ---------------------------------------------------------------------- NVRTC

# The architectures each NVRTC major is checked for. CUDA 13 no longer
# targets Volta, sm_70 and sm_72
# (https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/); Blackwell's
# sm_100 is checked under CUDA 13, the major its machines come with.
CUDA_ARCHS = {12: ("sm_70", "sm_80", "sm_90"), 13: ("sm_75", "sm_80", "sm_90", "sm_100")}

# The NVRTC (major, minor) versions whose builds of the kernels the tests gate
# (registers, spills, SASS): what torch's CUDA 12.6 and 13.0 wheels pin, and
# the newest of each major. constraints.txt and constraints-nvrtc-latest.txt
# pin exactly these (a test holds them together); another version compiles
# the kernels with a warning that nothing checked its build.
GATED_NVRTC = ((12, 6), (12, 9), (13, 0), (13, 5))

# The PyPI wheel carrying each major's NVRTC: the cuda12 and cuda13 extras
# install them.
NVRTC_WHEELS = {12: "nvidia-cuda-nvrtc-cu12", 13: "nvidia-cuda-nvrtc"}

# A cubin build also has ptxas report each kernel's registers, stack frame
# and spills in the log, so the resource checks read the very build a GPU
# loads. It changes no byte of the cubin.
CUBIN_OPTIONS = ("--ptxas-options=-v",)


@dataclass(frozen=True)
class Compiled:
    """The output of one NVRTC compile: PTX (always), the cubin (for a real
    architecture), the lowered names and the log."""

    arch: str
    major: int
    ptx: str
    cubin: bytes
    lowered: dict
    log: str


def runtime_major() -> int:
    """CUDA major of CuPy's runtime (``12`` or ``13``): the NVRTC a GPU's
    kernels are compiled with, so the cubin is one its driver and runtime load."""
    import cupy

    return cupy.cuda.runtime.runtimeGetVersion() // 1000


def nvrtc_path(major: int) -> str:
    """The ``libnvrtc.so.<major>`` to load: the NVRTC that ``cuda.pathfinder``
    finds (NVIDIA's finder: its wheels, conda, the system, ``$CUDA_PATH``,
    and the one already loaded, e.g. by CuPy) when its major is ``major``,
    else the file that major's wheel (:data:`NVRTC_WHEELS`) installed.

    The finder gives one NVRTC per process; the wheel's own file list gives
    the other major beside it, so one process can compile with both.

    >>> Path(nvrtc_path(12)).name, Path(nvrtc_path(13)).name
    ('libnvrtc.so.12', 'libnvrtc.so.13')
    """
    from cuda import pathfinder

    try:
        found = pathfinder.load_nvidia_dynamic_lib("nvrtc").abs_path
    except pathfinder.DynamicLibNotFoundError:
        found = None
    if found and Path(os.path.realpath(found)).name.startswith(f"libnvrtc.so.{major}"):
        return found
    wheel = _wheel_file(NVRTC_WHEELS[major], f"libnvrtc.so.{major}")
    if wheel:
        return wheel
    raise OSError(f"no CUDA {major} NVRTC: cuda.pathfinder found {found or 'none'}, expected "
                  f"libnvrtc.so.{major}; install {NVRTC_WHEELS[major]} (the cuda{major} extra)")


def _wheel_file(distribution: str, name: str) -> str | None:
    """The absolute path of ``name`` among the files ``distribution`` installed."""
    try:
        files = importlib.metadata.distribution(distribution).files or []
    except importlib.metadata.PackageNotFoundError:
        return None
    return next((str(f.locate()) for f in files if f.name == name), None)


@functools.lru_cache(maxsize=None)
def nvrtc_library(major: int) -> ctypes.CDLL:
    """ctypes handle on CUDA ``major``'s NVRTC (:func:`nvrtc_path`), its
    ``libnvrtc-builtins`` loaded before it.

    NVRTC opens its builtins by soname when it compiles; CUDA 13.0's wheel
    NVRTC cannot find them beside itself and fails every compile with
    NVRTC_ERROR_BUILTIN_OPERATION_FAILURE. Loaded first, with RTLD_GLOBAL,
    they are found by soname among the libraries already loaded.

    >>> nvrtc_library(13) is nvrtc_library(13)
    True
    """
    path = Path(nvrtc_path(major))
    for builtins_lib in sorted(path.parent.glob(f"libnvrtc-builtins.so.{major}.*")):
        ctypes.CDLL(str(builtins_lib), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(str(path))
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    version = _loaded_version(lib)
    host_compiler.logger.info("NVRTC %d.%d loaded from %s", *version, path)
    if version not in GATED_NVRTC:
        host_compiler.logger.warning(
            "NVRTC %d.%d is not among the versions whose builds of the kernels are checked (%s): the kernels "
            "compile, but their registers and spills were not gated for it", *version,
            ", ".join(f"{a}.{b}" for a, b in GATED_NVRTC))
    return lib


def _loaded_version(lib: ctypes.CDLL) -> tuple[int, int]:
    found_major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(found_major), ctypes.byref(minor))
    return found_major.value, minor.value


def nvrtc_version(major: int) -> tuple[int, int]:
    """(major, minor) of the NVRTC :func:`nvrtc_library` loads for ``major``.

    >>> nvrtc_version(12)[0], nvrtc_version(13)[0]
    (12, 13)
    """
    return _loaded_version(nvrtc_library(major))


def nvrtc_compile(arch: str, major: int, directory: Path | None = None, cubin: bool = False,
                  options: tuple = OPTIONS) -> Compiled:
    """Compile every kernel with CUDA ``major``'s NVRTC for ``arch``
    (``"sm_70"``, ``"sm_90"``..., one of :data:`CUDA_ARCHS` for that major).

    ``cubin=False`` stops at PTX for the virtual architecture (compute_XY);
    ``cubin=True`` runs the whole back end for the real one (sm_XY), as a GPU
    loads it, with :data:`CUBIN_OPTIONS` (the PTX comes too). No GPU is
    needed. A warning about the code is an error (NVRTC has no option for
    that, so the log is checked; see :func:`code_warnings`): raises
    ``RuntimeError`` with the log.

    >>> out = nvrtc_compile("sm_80", 12)
    >>> out.ptx.count(".entry") == len(name_expressions()), out.log
    (True, '')
    """
    lib = nvrtc_library(major)
    digits = arch.split("_")[-1]
    target = f"sm_{digits}" if cubin else f"compute_{digits}"
    prog = ctypes.c_void_p()
    code = assembled_source(directory).encode()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), code, b"gpuflat.cu", 0, None, None), "create")
    try:
        names = name_expressions()
        for n in names:
            _check(lib, lib.nvrtcAddNameExpression(prog, n.encode()), f"name {n}")
        extra = CUBIN_OPTIONS if cubin else ()
        opts = [o.encode() for o in (*options, *extra, f"--gpu-architecture={target}")]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        log = _log(lib, prog)
        _check(lib, status, f"CUDA {major} compile for {target}", log)
        if code_warnings(log):
            raise RuntimeError(f"NVRTC {major} compile for {target}: warnings are errors here\n{log}")
        lowered = {n: _lowered_name(lib, prog, n) for n in names}
        binary = _output(lib, prog, "CUBIN").raw if cubin else b""
        return Compiled(arch, major, _output(lib, prog, "PTX").value.decode(), binary, lowered, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# NVRTC notes that old targets are deprecated (sm_70 under 12.9, sm_75 under
# 13), with no option to silence it; it concerns the target, not the code.
_TARGET_NOTICE = re.compile(r"Architectures prior to .* are deprecated")


def code_warnings(log: str) -> list[str]:
    """The lines of an NVRTC log that warn about the code (the deprecation
    notice for old targets aside).

    >>> code_warnings("t.cu(1): warning #177-D: variable never referenced\\n")
    ['t.cu(1): warning #177-D: variable never referenced']
    >>> code_warnings("nvrtc: warning: Architectures prior to '<compute/sm>_75' are deprecated\\n")
    []
    """
    return [line for line in log.splitlines()
            if "warning" in line.lower() and not _TARGET_NOTICE.search(line)]


def compile_ptx(arch: str, major: int, directory: Path | None = None) -> Compiled:
    """PTX of every kernel for ``arch`` with CUDA ``major``'s NVRTC; see
    :func:`nvrtc_compile`.

    >>> ".target sm_75" in compile_ptx("sm_75", 13).ptx
    True
    """
    return nvrtc_compile(arch, major, directory, cubin=False)


def _check(lib: ctypes.CDLL, status: int, what: str, log: str = "") -> None:
    if status != 0:
        raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(status).decode()}\n{log}")


def _lowered_name(lib: ctypes.CDLL, prog: ctypes.c_void_p, name: str) -> str:
    out = ctypes.c_char_p()
    _check(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)), f"lowered name {name}")
    lowered = out.value
    assert lowered is not None, "NVRTC gives the lowered name of a name expression it added"
    return lowered.decode()


def _output(lib: ctypes.CDLL, prog: ctypes.c_void_p, kind: str) -> ctypes.Array[ctypes.c_char]:
    """The compiled PTX or CUBIN of ``prog`` as a ctypes buffer."""
    size = ctypes.c_size_t()
    _check(lib, getattr(lib, f"nvrtcGet{kind}Size")(prog, ctypes.byref(size)), f"{kind} size")
    buf = ctypes.create_string_buffer(size.value)
    _check(lib, getattr(lib, f"nvrtcGet{kind}")(prog, buf), kind)
    return buf


def _log(lib: ctypes.CDLL, prog: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


# ---------------------------------------------------------------- a real device


def device_arch(device: Any) -> str:
    """``"sm_XY"`` of a ``cupy.cuda.Device``, from its compute capability ("90").

    >>> from types import SimpleNamespace
    >>> device_arch(SimpleNamespace(compute_capability="90"))
    'sm_90'
    """
    return f"sm_{device.compute_capability}"


def cubin_cache_path(arch: str, major: int) -> Path:
    """Where the cubin for ``arch`` under CUDA ``major`` is cached: named by
    a hash of everything that changes what it holds (the sources and
    options, :func:`cache_key`; the architecture; the NVRTC's version; and
    the sorted kernel names, as CuPy's compiler cache keys its own, so a
    build made with another list of kernels is never taken for this one).

    >>> cubin_cache_path("sm_90", 13).suffix
    '.cubin'
    """
    key = host_compiler.digest([cache_key(), arch, *CUBIN_OPTIONS, *map(str, nvrtc_version(major)),
                                *sorted(name_expressions())])[:24]
    return host_compiler.cache_root() / "cubin" / f"{arch}-{key}.cubin"


@functools.lru_cache(maxsize=None)
def _device_cubin(arch: str, major: int, key: str) -> Compiled:
    """The cubin for ``arch``, built once per machine and cached on disk
    (:func:`cubin_cache_path`) with its lowered names beside it."""
    cubin_file = cubin_cache_path(arch, major)
    names_file = cubin_file.with_suffix(".json")

    def build() -> None:
        compiled = nvrtc_compile(arch, major, cubin=True)
        for dest, data in ((names_file, json.dumps(compiled.lowered).encode()), (cubin_file, compiled.cubin)):
            tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, dest)  # the cubin lands last: a reader sees both files or neither

    host_compiler.build_once(f"the CUDA kernels for {arch} with NVRTC {'.'.join(map(str, nvrtc_version(major)))}",
                             cubin_file, build)
    return Compiled(arch, major, "", cubin_file.read_bytes(), json.loads(names_file.read_text()), "")


def device_cubin(arch: str, major: int) -> Compiled:
    """The cubin a GPU of ``arch`` runs under a CUDA ``major`` runtime:
    :func:`nvrtc_compile` with :data:`OPTIONS` (memoised, and cached on
    disk), with its lowered kernel names."""
    return _device_cubin(arch, major, cache_key())


def cupy_module(device: Any) -> tuple[Any, dict[str, str]]:
    """The kernels loaded on ``device`` (a ``cupy.cuda.Device``): the
    ``cupy.cuda.function.Module`` holding :func:`device_cubin` for its
    architecture, built by the NVRTC of CuPy's runtime major
    (:func:`runtime_major`), and the lowered name of each name expression.

    Fetch a kernel with ``module.get_function(lowered[gather_name(dtype)])``.
    """
    import cupy

    compiled = device_cubin(device_arch(device), runtime_major())
    module = cupy.cuda.function.Module()
    with device:
        module.load(compiled.cubin)
    return module, compiled.lowered
