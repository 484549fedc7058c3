"""The native host library: built once, loaded, and what it reads about NumPy arrays.

Two small C++ libraries do gpuflat's work on the host in native code:
``kernels/host/host_backend.cpp`` (the host backend's gather, scatter, norms
and clips, :func:`array_facts` and :func:`same_shapes`) and ``kernels/host/host_optim.cpp`` (the
optimizer update). Both compile the CUDA kernels' own arithmetic headers for
the host, with g++ on first use (``gpuflat._src.host_compiler``: cached on disk,
one build per machine), and are loaded once per process.

The host backend (``gpuflat._src.backends.host``) calls them; recorded trees
(``gpuflat._src.seen``) and the CUDA backend's table cache read
:func:`array_facts`, and recorded trees of CuPy arrays compare them with
:func:`same_shapes` (so a tree of CuPy arrays read again builds the host
library too). This module sits beneath the backends, so none of those
imports a backend for it.

Where a library cannot be built or loaded (no compiler, no Python headers, a
compiler error) its loader gives the reason instead, and warns once per
process with the compiler's first error line: NumPy arrays then take the
NumPy backend by default, array facts and CuPy arrays' shapes are read in
Python, and the host
backend's optimizer steps are the NumPy backend's. ``GPUFLAT_NATIVE=0`` turns
every native part off (without a warning). :func:`native_info` says which
parts are in use, and why any is not.

The C++ reads NumPy arrays through the few names of NumPy's C API in
:data:`NUMPY_API`, so that it builds against every NumPy from the floor to the
newest; what those cannot tell is decided in Python.

>>> lib, reason = host_library()
>>> (lib is None) == (reason is not None) == (not available())
True
"""
from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import platform
import sys
import sysconfig
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import numpy as np

from gpuflat._src import host_compiler
from gpuflat._src.dtypes import TAGS, when_registered
from gpuflat.errors import BuildError
from gpuflat._src.kernel_loader import kernel_dir, sources
from gpuflat._src.layout import DTYPES

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = ["NUMPY_API", "NativePart", "array_facts", "available", "host_library", "native_info", "optim_library",
           "same_shapes", "unavailable_reason"]

# The names of NumPy's C API that the native sources (kernels/host) may use,
# and the one descriptor field (``PyArray_DESCR->field``). Each is an inline
# read of NumPy's array struct, or a macro configuring the header, with the
# same meaning and place in every NumPy from the floor in pyproject.toml
# (1.24, numpy/core/include/numpy/ndarraytypes.h) to 2.5
# (numpy/_core/include/numpy/ndarraytypes.h), and none needs import_array().
# Others did not hold: PyArray_ISNOTSWAPPED calls npy_2_compat.h's
# PyDataType_BYTEORDER in 2.5, which needs import_array(); NPY_MAXDIMS went
# from 32 to 64 in 2.0; the item size moved out of the descriptor's first
# fields in 2.0. So type numbers come from Python (:data:`TAGS`), item sizes
# from the dtype tags, and byte order is judged by the tree walk.
# tests/test_native.py fails on a name outside this list.
NUMPY_API = frozenset({
    "NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION",  # the header without the deprecated direct field access
    "PyArrayObject", "PyArray_DATA", "PyArray_NDIM", "PyArray_DIMS", "PyArray_STRIDES",
    "PyArray_FLAGS", "NPY_ARRAY_ALIGNED", "PyArray_TYPE",  # the type number
    "PyArray_DESCR->byteorder",  # recorded by the facts reader, judged in Python
})

# The arithmetic must stay the kernels': no fast-math, and no contraction of
# a*b+c into one fma (the kernels are built with --fmad=false). -march=native
# lets the compiler use the machine's widest vectors; the cache key carries
# the CPU's identity, so a library is never loaded on a CPU it was not built for.
FLAGS = ("-O3", "-std=c++20", "-pthread", "-march=native", "-ffp-contract=off", "-fno-math-errno",
         "-fno-strict-aliasing", "-fvisibility=hidden")
# The libraries' names in the cache (and in host_compiler.obtained).
HOST_NAME, OPTIM_NAME = "gpuflat-host", "gpuflat-host-optim"


def available() -> bool:
    """Whether the host library builds and loads here.

    >>> isinstance(available(), bool)
    True
    """
    return host_library()[0] is not None


def unavailable_reason() -> str | None:
    """Why the host library cannot be used here (no Python headers, or the
    compiler's message), or None where it builds and loads.

    >>> (unavailable_reason() is None) == available()
    True
    """
    return host_library()[1]


# The slower paths taken where a library is not used, as its warning says.
HOST_INSTEAD = ('NumPy arrays take backend="numpy" (the same operations in NumPy, slower), and trees read '
                'again are compared in Python')
OPTIM_INSTEAD = 'the host backend\'s optimizer steps are backend="numpy"\'s (the same bits, slower)'


@functools.lru_cache(maxsize=None)
def host_library() -> tuple[ctypes.PyDLL, None] | tuple[None, str]:
    """(the loaded host backend library, None), or (None, why it is not
    used: off, or why it cannot be built or loaded); built on first use.

    >>> lib, reason = host_library()
    >>> lib is not None or isinstance(reason, str)
    True
    """
    off = host_compiler.native_disabled()
    if off:
        return None, off
    python_include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(python_include, "Python.h")):
        return None, host_compiler.warn_unbuilt("host library", f"no Python.h in {python_include}", HOST_INSTEAD)
    try:
        path = host_compiler.build_library(
            HOST_NAME, (kernel_dir() / "host" / "host_backend.cpp").read_text(),
            include_dirs=(python_include, np.get_include()), flags=FLAGS, files=_host_headers(), key_parts=(python_include, sys.version, np.__version__, _cpu_identity()))
        lib = host_compiler.load(path, ctypes.PyDLL)
    except (BuildError, OSError) as exc:
        return None, host_compiler.warn_unbuilt("host library", str(exc), HOST_INSTEAD)
    obj, i64, f64, c_int = ctypes.py_object, ctypes.c_longlong, ctypes.c_double, ctypes.c_int
    lib.gf_host_init.argtypes = [obj, ctypes.POINTER(c_int)]
    lib.gf_host_init.restype = None
    lib.gf_host_norms_rows.argtypes = [obj, obj, c_int, f64, c_int, obj, obj, obj]
    lib.gf_host_clip_rows.argtypes = [obj, obj, f64, f64, f64, c_int]
    lib.gf_host_clip_flat.argtypes = [obj, f64, f64, f64, c_int]
    lib.gf_host_facts.argtypes = [obj, obj]
    lib.gf_host_same_shapes.argtypes = [obj, obj, obj, obj]
    # The last argument of these four is a Recorded list's token (0: none).
    lib.gf_host_norms.argtypes = [*lib.gf_host_norms_rows.argtypes, i64]
    lib.gf_host_clip.argtypes = [*lib.gf_host_clip_rows.argtypes, i64]
    lib.gf_host_gather.argtypes = [obj, obj, obj, c_int, i64]
    lib.gf_host_scatter.argtypes = [obj, obj, obj, c_int, i64]
    for fn in (lib.gf_host_norms, lib.gf_host_gather, lib.gf_host_scatter, lib.gf_host_clip,
               lib.gf_host_clip_flat, lib.gf_host_norms_rows, lib.gf_host_clip_rows, lib.gf_host_facts,
               lib.gf_host_same_shapes):
        fn.restype = i64
    # A dtype from a package (ml_dtypes' bfloat16) is known by its number once it is imported.
    lib.gf_host_init(np.ndarray, _type_numbers())
    when_registered(lambda _: lib.gf_host_init(np.ndarray, _type_numbers()))
    return lib, None


def _host_headers() -> dict[str, str]:
    """The headers both host libraries build with: the kernels' (the rules'
    among them), the one written from the layout (``gpuflat_rules.h``) and
    the host's own (``kernels/host/*.h``).

    >>> sorted(n for n in _host_headers() if n.startswith(("host_", "gpuflat_rules")))
    ['gpuflat_rules.h', 'host_items.h', 'host_prelude.h']
    """
    files = {name: text for name, text in sources().items() if not name.endswith(".cu")}
    files.update({path.name: path.read_text() for path in sorted((kernel_dir() / "host").glob("*.h"))})
    return files


def _type_numbers() -> ctypes.Array[ctypes.c_int]:
    """The NumPy type number of each dtype tag (-1 for one not registered yet), as the library takes them.

    >>> list(_type_numbers())[2:4] == [np.dtype(np.float32).num, np.dtype(np.float64).num]
    True
    """
    nums = (ctypes.c_int * len(DTYPES))(*[-1] * len(DTYPES))
    for dtype, tag in TAGS.items():
        nums[tag] = dtype.num
    return nums


@functools.lru_cache(maxsize=None)
def optim_library() -> tuple[ctypes.CDLL, None] | tuple[None, str]:
    """(the loaded optimizer update library, None), or (None, why it cannot
    be built or loaded); built on first use. Its ``gf_host_optim_step``
    returns 0, or -1 for a dtype tag it has no update for.

    >>> lib, reason = optim_library()
    >>> lib is not None or isinstance(reason, str)
    True
    """
    off = host_compiler.native_disabled()
    if off:
        return None, off
    try:
        path = host_compiler.build_library(OPTIM_NAME, (kernel_dir() / "host" / "host_optim.cpp").read_text(),
                                           flags=FLAGS, files=_host_headers(), key_parts=(_cpu_identity(),))
        lib = host_compiler.load(path, ctypes.CDLL)
    except (BuildError, OSError) as exc:
        return None, host_compiler.warn_unbuilt("optimizer library", str(exc), OPTIM_INSTEAD)
    vp, i64, f64, c_int = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_double, ctypes.c_int
    lib.gf_host_optim_step.argtypes = [c_int, c_int, vp, i64, vp, vp, vp, vp, vp, vp, vp, vp, vp, f64, f64, vp, c_int]
    lib.gf_host_optim_step.restype = c_int
    lib.gf_host_optim_rows.argtypes = [c_int, c_int, vp, i64, vp, vp, i64, vp, f64, f64, vp, c_int, vp]
    lib.gf_host_optim_rows.restype = c_int
    return lib, None


def array_facts(arrays: Sequence[Any], words: int) -> npt.NDArray[np.int64] | None:
    """What NumPy lets change about ``arrays`` without a new object, with
    their identities, as one int64 array read in native code (at most
    ``words`` words: per array 4 and two per dim): identity, data address,
    dtype, flags, ndim, dims, strides. None where the library is not built,
    an item is not an ndarray or ``words`` is too few. Two equal results of
    living arrays mean the same arrays, unchanged.

    >>> a = np.ones((2, 3))
    >>> facts = array_facts([a], 8)
    >>> facts is None or (len(facts) == 8 and np.array_equal(facts, array_facts([a], 8)))
    True
    >>> a.flags.writeable = False
    >>> facts is None or not np.array_equal(facts, array_facts([a], 8))
    True
    """
    lib = host_library()[0]
    if lib is None:
        return None
    out = np.empty(words, np.int64)
    n = lib.gf_host_facts(arrays, out)
    return out[:n] if n >= 0 else None


def same_shapes(arrays: Sequence[Any], ids: list[int], alive: list[bool],
                shapes: list[tuple[int, ...]]) -> bool | None:
    """Whether ``arrays`` are the objects of identities ``ids`` and, while
    ``alive[0]`` holds (no array of those identities died meanwhile, so
    they are the same arrays), of shapes ``shapes``, read in native code:
    the identities first, and the shapes (through each array's ``shape``
    attribute: CuPy's, a Cython property) only then. None where the library
    is not built.

    >>> a, b = np.ones(2), np.ones((1, 3))
    >>> same = same_shapes([a, b], [id(a), id(b)], [True], [(2,), (1, 3)])
    >>> same is None or same
    True
    >>> same_shapes([a, b], [id(a), id(b)], [True], [(2,), (3,)]) in (None, False)
    True
    >>> same_shapes([b, a], [id(a), id(b)], [True], [(2,), (1, 3)]) in (None, False)
    True
    """
    lib = host_library()[0]
    if lib is None:
        return None
    return bool(lib.gf_host_same_shapes(arrays, ids, alive, shapes) == 1)


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiled for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


class NativePart(NamedTuple):
    """What :func:`native_info` says of one native part: whether it is in use, and why (or why not)."""

    in_use: bool
    why: str


def native_info() -> dict[str, NativePart]:
    """Which of gpuflat's native parts are in use in this process, and why
    any is not: ``"host"`` (the host backend's gather, scatter, norms and
    clips of NumPy arrays), ``"host optimizer"`` (its optimizer steps) and
    ``"tensor facts"`` (the reader of PyTorch tensors' metadata). A part in
    use says whether it was built now or loaded from the cache; one not in
    use says why: ``GPUFLAT_NATIVE=0``, no compiler, the compiler's message
    (remembered in the cache where an earlier build failed the same way),
    or PyTorch not installed. Parts not yet used are built (or loaded) now.

    >>> info = native_info()
    >>> sorted(info)
    ['host', 'host optimizer', 'tensor facts']
    >>> all(isinstance(part.in_use, bool) and part.why for part in info.values())
    True
    >>> info["host"].in_use == available()
    True
    """
    return {"host": _part(host_library()[1], HOST_NAME), "host optimizer": _part(optim_library()[1], OPTIM_NAME),
            "tensor facts": _tensor_facts_part()}


def _part(reason: str | None, name: str) -> NativePart:
    """The word on the part built as ``name``: not in use for ``reason``, else in use, and how it was come by."""
    return NativePart(True, host_compiler.obtained(name)) if reason is None else NativePart(False, reason)


def _tensor_facts_part() -> NativePart:
    if importlib.util.find_spec("torch") is None:
        return NativePart(False, "PyTorch is not installed")
    from gpuflat._src import tensor_facts

    return _part(tensor_facts.unavailable_reason(), tensor_facts.NAME)
