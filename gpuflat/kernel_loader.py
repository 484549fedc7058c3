"""The one loader of gpuflat's CUDA kernels (#3).

The kernels are CUDA C files shipped as package data (``gpuflat/kernels`` in
an installed wheel, ``kernels/`` next to the package in a checkout). This
module finds them, names the template instantiations the backends launch,
hashes every source and header into one cache key, and compiles them three
ways: NVRTC to PTX (a compile check that needs no GPU), ``cupy.RawModule``
for a real device, and the host emulator library for the ``emulated``
backend.

>>> "gpuflat_gather<float>" in name_expressions()
True
>>> len(cache_key()) == 64
True
"""
from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import re
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gpuflat.dtypes import CUDA_NAMES

# Compile options shared by every route. No fast-math: NaN and inf must
# survive the norm and clip kernels (#5). --fmad=false keeps a*b+c two
# roundings, as the host emulator computes it, so the emulated device gives
# the GPU's bits for gather, scatter, clip and the 1-, 2- and inf-norms (the
# order is fixed either way; only pow and hypot may differ by an ulp).
# -default-device makes the lambdas the kernels pass to their helpers device
# code under NVRTC.
OPTIONS = ("-std=c++17", "-default-device", "--fmad=false")

# Norm kinds, the template argument of the norm kernels (kernels/norms.cu).
NORM_KINDS = {"l1": 0, "l2": 1, "inf": 2, "p": 3}

SCALE_NAME = "gpuflat_scale"

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
    norm kind.

    >>> len(name_expressions()) == 2 * len(CUDA_NAMES) + 2 * len(NORM_KINDS) + 1
    True
    """
    names = []
    for dtype in CUDA_NAMES:
        names += [gather_name(dtype), scatter_name(dtype)]
    for kind in NORM_KINDS:
        names += [norm_partial_name(kind), norm_finish_name(kind)]
    names.append(SCALE_NAME)
    return names


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


def sources(directory: Path | None = None) -> dict[str, str]:
    """File name -> text of every ``*.cu`` and ``*.cuh`` in the kernel directory.

    >>> sorted(n for n in sources() if n.endswith(".cu"))
    ['gather_scatter.cu', 'norms.cu']
    """
    d = Path(directory) if directory is not None else kernel_dir()
    files = sorted(list(d.glob("*.cu")) + list(d.glob("*.cuh")))
    return {f.name: f.read_text() for f in files}


def cache_key(directory: Path | None = None) -> str:
    """SHA-256 over every file under the kernel directory, emulator header too.

    Hashing the files themselves, not just the top-level source text, means an
    edited header always yields a new compiled module (#3).
    """
    d = Path(directory) if directory is not None else kernel_dir()
    h = hashlib.sha256()
    h.update(repr(OPTIONS).encode())
    for f in sorted(p for p in d.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(f.relative_to(d).as_posix()).encode() + b"\0")
        h.update(f.read_bytes() + b"\0")
    return h.hexdigest()


def assembled_source(directory: Path | None = None) -> str:
    """One self-contained translation unit: the ``.cu`` files in sorted order,
    each local ``#include "..."`` expanded once in place.

    Expanding the headers ourselves makes the code string cover them, so
    CuPy's on-disk cache (keyed by the code string) can never serve a module
    built from an older header (#3).

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
    """The output of one NVRTC compile: PTX (or a cubin) and lowered names."""

    arch: str
    ptx: str
    cubin: bytes
    lowered: dict
    log: str


def nvrtc_library():
    """ctypes handle on libnvrtc: the ``nvidia-cuda-nvrtc-cu12`` wheel's copy, else
    the system's."""
    candidates = []
    try:
        import nvidia.cuda_nvrtc as pkg  # the wheel is a namespace package

        for base in pkg.__path__:
            candidates += sorted(Path(base, "lib").glob("libnvrtc.so*"))
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for c in candidates:
        if "alt" in Path(str(c)).name or "builtins" in Path(str(c)).name:
            continue
        try:
            return ctypes.CDLL(str(c))
        except OSError:
            continue
    raise OSError("libnvrtc not found: install nvidia-cuda-nvrtc-cu12")


def compile(arch: str = "sm_80", directory: Path | None = None, cubin: bool = False) -> Compiled:
    """Compile every kernel with NVRTC for ``arch`` (``"sm_70"``, ``"sm_80"``...).

    ``cubin=False`` stops at PTX for the virtual architecture (compute_XX);
    ``cubin=True`` runs the whole back end for the real one. No GPU is needed.
    Raises ``RuntimeError`` with the compiler log on failure.
    """
    lib = nvrtc_library()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(status, what, prog=None):
        if status != 0:
            log = _log(lib, prog) if prog is not None else ""
            raise RuntimeError(f"NVRTC {what}: {lib.nvrtcGetErrorString(status).decode()}\n{log}")

    prog = ctypes.c_void_p()
    code = assembled_source(directory).encode()
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), code, b"gpuflat.cu", 0, None, None), "create")
    try:
        names = name_expressions()
        for n in names:
            check(lib.nvrtcAddNameExpression(prog, n.encode()), f"name {n}")
        digits = arch.split("_")[-1]
        target = f"sm_{digits}" if cubin else f"compute_{digits}"
        opts = [o.encode() for o in OPTIONS + (f"--gpu-architecture={target}",)]
        arr = (ctypes.c_char_p * len(opts))(*opts)
        check(lib.nvrtcCompileProgram(prog, len(opts), arr), f"compile for {target}", prog)
        lowered = {}
        for n in names:
            out = ctypes.c_char_p()
            check(lib.nvrtcGetLoweredName(prog, n.encode(), ctypes.byref(out)), f"lowered name {n}")
            lowered[n] = out.value.decode()
        ptx, binary = "", b""
        size = ctypes.c_size_t()
        if cubin:
            check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
            buf = ctypes.create_string_buffer(size.value)
            check(lib.nvrtcGetCUBIN(prog, buf), "cubin")
            binary = buf.raw
        else:
            check(lib.nvrtcGetPTXSize(prog, ctypes.byref(size)), "ptx size")
            buf = ctypes.create_string_buffer(size.value)
            check(lib.nvrtcGetPTX(prog, buf), "ptx")
            ptx = buf.value.decode()
        return Compiled(arch, ptx, binary, lowered, _log(lib, prog))
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def compile_ptx(arch: str = "sm_80", directory: Path | None = None) -> Compiled:
    """PTX of every kernel for ``arch``; see :func:`compile`."""
    return compile(arch, directory, cubin=False)


def _log(lib, prog) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, buf)
    return buf.value.decode(errors="replace")


# ---------------------------------------------------------------- CuPy, emulator

_lock = threading.Lock()
_cupy_modules: dict = {}
_emulator_libraries: dict = {}


def cupy_module(device_id: int | None = None):
    """The compiled ``cupy.RawModule`` for a device, memoised per device.

    Fetch a kernel with ``cupy_module().get_function(gather_name(dtype))``.
    """
    import cupy

    device = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
    with _lock:
        module = _cupy_modules.get(device.id)
        if module is None:
            with device:
                module = cupy.RawModule(
                    code=assembled_source(), options=OPTIONS, name_expressions=name_expressions()
                )
            _cupy_modules[device.id] = module
        return module


def emulator_library():
    """The kernels built for the host emulator (``gpuflat.emulator``), memoised
    in this process and on disk under :func:`cache_key`."""
    from gpuflat import emulator

    key = cache_key()
    with _lock:
        lib = _emulator_libraries.get(key)
        if lib is None:
            lib = emulator.load_library(sources(), name_expressions(), key)
            _emulator_libraries[key] = lib
        return lib
