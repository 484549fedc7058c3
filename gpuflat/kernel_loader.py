"""The one loader of gpuflat's CUDA kernels.

The kernels are CUDA C files shipped as package data (``gpuflat/kernels`` in
an installed wheel, ``kernels/`` next to the package in a checkout). This
module finds them, names the template instantiations the backends launch,
hashes every source and header into one cache key, and builds them two ways:
NVRTC (:func:`nvrtc_compile`: PTX for the compile checks, a cubin for a real
device) and the host emulator library for the ``emulated`` backend.

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
import ctypes.util
import functools
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuflat import host_compiler
from gpuflat.dtypes import CUDA_NAMES

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

# Norm kinds, the template argument of the norm kernels (kernels/norms.cu).
NORM_KINDS = {"l1": 0, "l2": 1, "inf": 2, "p": 3}

SCALE_NAME = "gpuflat_scale"
# The clip with max_norm in device memory.
SCALE_AT_NAME = "gpuflat_scale_at"

_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)


def gather_name(dtype) -> str:
    """Name expression of the gather kernel writing a flat buffer of ``dtype``.

    >>> gather_name(np.float32)
    'gpuflat_gather<float>'
    """
    return f"gpuflat_gather<{CUDA_NAMES[np.dtype(dtype)]}>"


def scatter_name(dtype) -> str:
    """Name expression of the scatter kernel reading a flat buffer of ``dtype``.

    >>> scatter_name(np.complex128)
    'gpuflat_scatter<c128>'
    """
    return f"gpuflat_scatter<{CUDA_NAMES[np.dtype(dtype)]}>"


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


def name_expressions() -> list[str]:
    """Every kernel instantiation the backends may launch.

    Gather and scatter are templated on the flat dtype (the leaf dtype is a
    runtime tag, so a mixed-dtype tree is one launch); the norm kernels on the
    norm kind; the clip takes max_norm by value or from device memory.

    >>> len(name_expressions()) == 2 * len(CUDA_NAMES) + 2 * len(NORM_KINDS) + 2 + 2 * 4
    True
    """
    names = []
    for dtype in CUDA_NAMES:
        names += [gather_name(dtype), scatter_name(dtype)]
    for kind in NORM_KINDS:
        names += [norm_partial_name(kind), norm_finish_name(kind)]
    names += [SCALE_NAME, SCALE_AT_NAME]
    names += [optim_name(rule, d) for rule in OPTIM_RULES for d in OPTIM_DTYPES]
    return names


# The flat optimizers' update kernels (kernels/optim.cu), templated on the
# buffer's dtype: every real floating dtype (complex parameters are refused).
OPTIM_RULES = ("adamw", "sgd")
OPTIM_DTYPES = ("f16", "bf16", "float", "double")


def optim_name(rule: str, c_name: str) -> str:
    """Name expression of an optimizer's update kernel over a buffer of C++ type ``c_name``.

    >>> optim_name("adamw", "float")
    'gpuflat_adamw<float>'
    """
    return f"gpuflat_{rule}<{c_name}>"


def kernel_dir() -> Path:
    """The directory holding the kernel sources.

    An installed wheel carries them as package data in ``gpuflat/kernels``;
    a checkout keeps them in ``kernels/`` beside the package.

    >>> (kernel_dir() / "norms.cu").is_file()
    True
    """
    here = Path(__file__).resolve().parent
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
    """File name -> text of every ``*.cu`` and ``*.cuh`` in the kernel directory.

    >>> sorted(n for n in sources() if n.endswith(".cu"))
    ['gather_scatter.cu', 'norms.cu', 'optim.cu']
    """
    d = Path(directory) if directory is not None else kernel_dir()
    files = sorted(list(d.glob("*.cu")) + list(d.glob("*.cuh")))
    return {f.name: f.read_text() for f in files}


def cache_key(directory: Path | None = None) -> str:
    """SHA-256 over every file under the kernel directory, emulator header too,
    and the NVRTC options.

    Hashing the files themselves, not just the top-level source text, means an
    edited header always yields a new compiled module.
    """
    d = Path(directory) if directory is not None else kernel_dir()
    return host_compiler.digest([*OPTIONS, host_compiler.tree_digest(d)])


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

        def include(m):
            target = m.group(1)
            if target not in texts:
                raise FileNotFoundError(f"{name}: includes {target!r}, not among the kernel sources")
            return f"// ---- {target}\n" + expand(target)

        return _INCLUDE.sub(include, text)

    return "\n".join(f"// ==== {n}\n" + expand(n) for n in texts if n.endswith(".cu"))


# ---------------------------------------------------------------------- NVRTC


@dataclass(frozen=True)
class Compiled:
    """The output of one NVRTC compile: PTX or a cubin, and the lowered names."""

    arch: str
    ptx: str
    cubin: bytes
    lowered: dict
    log: str


def nvrtc_candidates() -> list[str]:
    """Where libnvrtc may be, in the order tried: the ``nvidia-cuda-nvrtc-cu12``
    wheel (``nvidia/cuda_nvrtc/lib``), the CUDA 13 wheels (``nvidia/cu13/lib``),
    ``$CUDA_PATH``/``$CUDA_HOME``, ``/usr/local/cuda``, the linker's search
    path, then the bare sonames.

    The CUDA 12 wheel comes first because CUDA 13's NVRTC no longer targets
    sm_70, which the compile checks cover.

    >>> any("libnvrtc.so" in c for c in nvrtc_candidates())
    True
    """
    found = []
    try:
        import nvidia  # the wheels share this namespace package

        for base in nvidia.__path__:
            for sub in ("cuda_nvrtc/lib", "cu13/lib", "cu12/lib"):
                found += sorted(str(p) for p in Path(base, sub).glob("libnvrtc.so*"))
    except ImportError:
        pass
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    for root in filter(None, roots):
        found += sorted(str(p) for p in Path(root, "lib64").glob("libnvrtc.so*"))
    system = ctypes.util.find_library("nvrtc")
    found += [system] if system else []
    found += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    # libnvrtc-builtins and the alt variants are helpers, not the compiler.
    return [c for c in dict.fromkeys(found) if not re.search(r"builtins|alt", Path(c).name)]


@functools.lru_cache(maxsize=None)
def nvrtc_library():
    """ctypes handle on the first libnvrtc of :func:`nvrtc_candidates` that loads."""
    for candidate in nvrtc_candidates():
        try:
            lib = ctypes.CDLL(candidate)
        except OSError:
            continue
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        return lib
    raise OSError("libnvrtc not found: install nvidia-cuda-nvrtc-cu12 (or CUDA 13's nvidia-cuda-nvrtc), "
                  "or set CUDA_PATH")


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC :func:`nvrtc_library` loads.

    >>> nvrtc_version() >= (12, 0)
    True
    """
    major, minor = ctypes.c_int(), ctypes.c_int()
    nvrtc_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def nvrtc_compile(arch: str = "sm_80", directory: Path | None = None, cubin: bool = False,
                  options: tuple = OPTIONS) -> Compiled:
    """Compile every kernel with NVRTC for ``arch`` (``"sm_70"``, ``"sm_90"``...).

    ``cubin=False`` stops at PTX for the virtual architecture (compute_XY);
    ``cubin=True`` runs the whole back end for the real one (sm_XY), as a GPU
    loads it. No GPU is needed. A warning about the code is an error (NVRTC
    has no option for that, so the log is checked; see :func:`code_warnings`):
    raises ``RuntimeError`` with the log.

    >>> out = nvrtc_compile("sm_80")
    >>> out.ptx.count(".entry") == len(name_expressions()), out.log
    (True, '')
    """
    lib = nvrtc_library()
    digits = arch.split("_")[-1]
    target = f"sm_{digits}" if cubin else f"compute_{digits}"
    prog = ctypes.c_void_p()
    code = assembled_source(directory).encode()
    _check(lib, lib.nvrtcCreateProgram(ctypes.byref(prog), code, b"gpuflat.cu", 0, None, None), "create")
    try:
        names = name_expressions()
        for n in names:
            _check(lib, lib.nvrtcAddNameExpression(prog, n.encode()), f"name {n}")
        opts = [o.encode() for o in (*options, f"--gpu-architecture={target}")]
        status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        log = _log(lib, prog)
        _check(lib, status, f"compile for {target}", log)
        if code_warnings(log):
            raise RuntimeError(f"NVRTC compile for {target}: warnings are errors here\n{log}")
        lowered = {n: _lowered_name(lib, prog, n) for n in names}
        if cubin:
            return Compiled(arch, "", _output(lib, prog, "CUBIN").raw, lowered, log)
        return Compiled(arch, _output(lib, prog, "PTX").value.decode(), b"", lowered, log)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# NVRTC 12.9 notes that sm_70 is deprecated, with no option to silence it;
# it concerns the target, not the code.
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


def compile_ptx(arch: str = "sm_80", directory: Path | None = None) -> Compiled:
    """PTX of every kernel for ``arch``; see :func:`nvrtc_compile`.

    >>> ".target sm_70" in compile_ptx("sm_70").ptx
    True
    """
    return nvrtc_compile(arch, directory, cubin=False)


def _check(lib, status, what, log=""):
    if status != 0:
        raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(status).decode()}\n{log}")


def _lowered_name(lib, prog, name: str) -> str:
    out = ctypes.c_char_p()
    _check(lib, lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)), f"lowered name {name}")
    return out.value.decode()


def _output(lib, prog, kind: str):
    """The compiled PTX or CUBIN of ``prog`` as a ctypes buffer."""
    size = ctypes.c_size_t()
    _check(lib, getattr(lib, f"nvrtcGet{kind}Size")(prog, ctypes.byref(size)), f"{kind} size")
    buf = ctypes.create_string_buffer(size.value)
    _check(lib, getattr(lib, f"nvrtcGet{kind}")(prog, buf), kind)
    return buf


def _log(lib, prog) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


# ---------------------------------------------------------------- a real device


def device_arch(device) -> str:
    """``"sm_XY"`` of a ``cupy.cuda.Device``, from its compute capability ("90").

    >>> from types import SimpleNamespace
    >>> device_arch(SimpleNamespace(compute_capability="90"))
    'sm_90'
    """
    return f"sm_{device.compute_capability}"


@functools.lru_cache(maxsize=None)
def _device_cubin(arch: str, key: str) -> Compiled:
    """The cubin for ``arch``, cached on disk by the sources, options and NVRTC."""
    lib_key = host_compiler.digest([key, arch, *map(str, nvrtc_version())])[:24]
    path = host_compiler.cache_root() / "cubin" / f"{arch}-{lib_key}"
    cubin_file, names_file = path.with_suffix(".cubin"), path.with_suffix(".json")
    if cubin_file.is_file() and names_file.is_file():
        return Compiled(arch, "", cubin_file.read_bytes(), json.loads(names_file.read_text()), "")
    compiled = nvrtc_compile(arch, cubin=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    for dest, data in ((names_file, json.dumps(compiled.lowered).encode()), (cubin_file, compiled.cubin)):
        tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, dest)  # the cubin lands last: a reader sees both files or neither
    return compiled


def device_cubin(arch: str) -> Compiled:
    """The cubin a GPU of ``arch`` runs: :func:`nvrtc_compile` with :data:`OPTIONS`
    (memoised, and cached on disk), with its lowered kernel names."""
    return _device_cubin(arch, cache_key())


def cupy_module(device):
    """The kernels loaded on ``device`` (a ``cupy.cuda.Device``): the
    ``cupy.cuda.function.Module`` holding :func:`device_cubin` for its
    architecture, and the lowered name of each name expression.

    Fetch a kernel with ``module.get_function(lowered[gather_name(dtype)])``.
    """
    import cupy

    compiled = device_cubin(device_arch(device))
    module = cupy.cuda.function.Module()
    with device:
        module.load(compiled.cubin)
    return module, compiled.lowered
