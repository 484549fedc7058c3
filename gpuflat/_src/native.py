"""The native host library: built once, loaded, and what it reads about NumPy arrays.

Two small C++ libraries do gpuflat's work on the host in native code:
``kernels/host/host_backend.cpp`` (the host backend's gather, scatter, norms
and clips, and :func:`array_facts`) and ``kernels/host/host_optim.cpp`` (the
optimizer update). Both compile the CUDA kernels' own arithmetic headers for
the host, with g++ on first use (``gpuflat._src.host_compiler``: cached on disk,
one build per machine), and are loaded once per process.

The host backend (``gpuflat._src.backends.host``) calls them; recorded trees
(``gpuflat._src.seen``) and the CUDA backend's table cache read
:func:`array_facts`. This module sits beneath the backends, so none of those
imports a backend for it.

Where a library cannot be built or loaded (no compiler, no Python headers, a
compiler error) its loader gives the reason instead: NumPy arrays then take
the NumPy backend by default, and array facts are read in Python.

>>> lib, reason = host_library()
>>> (lib is None) == (reason is not None) == (not available())
True
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import sysconfig

import numpy as np

from gpuflat._src import host_compiler
from gpuflat._src.dtypes import when_bfloat16
from gpuflat.errors import BuildError
from gpuflat._src.kernel_loader import kernel_dir

__all__ = ["array_facts", "available", "host_library", "optim_library", "unavailable_reason"]

# The arithmetic must stay the kernels': no fast-math, and no contraction of
# a*b+c into one fma (the kernels are built with --fmad=false). -march=native
# lets the compiler use the machine's widest vectors; the cache key carries
# the CPU's identity, so a library is never loaded on a CPU it was not built for.
FLAGS = ("-O3", "-std=c++20", "-pthread", "-march=native", "-ffp-contract=off", "-fno-math-errno",
         "-fno-strict-aliasing", "-fvisibility=hidden")
SHARED_HEADERS = ("gpuflat_common.cuh", "gpuflat_math.cuh")


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


@functools.lru_cache(maxsize=None)
def host_library():
    """(the loaded host backend library, None), or (None, why it cannot be
    built or loaded); built on first use.

    >>> lib, reason = host_library()
    >>> lib is not None or isinstance(reason, str)
    True
    """
    numpy_include = np.get_include()
    python_include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(python_include, "Python.h")):
        return None, f"no Python.h in {python_include}"
    kernels = kernel_dir()
    host = kernels / "host"
    files = {name: (kernels / name).read_text() for name in SHARED_HEADERS}
    files["host_prelude.h"] = (host / "host_prelude.h").read_text()
    try:
        path = host_compiler.build_library(
            "gpuflat-host", (host / "host_backend.cpp").read_text(), include_dirs=(python_include, numpy_include),
            flags=FLAGS, files=files, key_parts=(python_include, np.__version__, _cpu_identity()))
        lib = host_compiler.load(path, ctypes.PyDLL)
    except (BuildError, OSError) as exc:
        return None, str(exc)
    obj, i64, f64, c_int = ctypes.py_object, ctypes.c_longlong, ctypes.c_double, ctypes.c_int
    lib.gf_host_init.argtypes = [obj, c_int]
    lib.gf_host_init.restype = None
    lib.gf_host_norms_flat.argtypes = [obj, obj, c_int, f64, c_int, obj, obj, obj]
    lib.gf_host_norms_rows.argtypes = lib.gf_host_norms_flat.argtypes
    lib.gf_host_clip_rows.argtypes = [obj, obj, f64, f64, f64, c_int]
    lib.gf_host_clip_flat.argtypes = [obj, f64, f64, f64, c_int]
    lib.gf_host_facts.argtypes = [obj, obj]
    # The last argument of these four is a Recorded list's token (0: none).
    lib.gf_host_norms.argtypes = [*lib.gf_host_norms_flat.argtypes, i64]
    lib.gf_host_clip.argtypes = [*lib.gf_host_clip_rows.argtypes, i64]
    lib.gf_host_gather.argtypes = [obj, obj, obj, c_int, i64]
    lib.gf_host_scatter.argtypes = [obj, obj, obj, c_int, i64]
    for fn in (lib.gf_host_norms, lib.gf_host_norms_flat, lib.gf_host_gather, lib.gf_host_scatter, lib.gf_host_clip,
               lib.gf_host_clip_flat, lib.gf_host_norms_rows, lib.gf_host_clip_rows, lib.gf_host_facts):
        fn.restype = i64
    # bfloat16 is ml_dtypes' type, known by its number once it is imported.
    lib.gf_host_init(np.ndarray, -1)
    when_bfloat16(lambda dtype: lib.gf_host_init(np.ndarray, dtype.num))
    return lib, None


@functools.lru_cache(maxsize=None)
def optim_library():
    """(the loaded optimizer update library, None), or (None, why it cannot
    be built or loaded); built on first use. Its ``gf_host_optim_step``
    returns 0, or -1 for a dtype tag it has no update for.

    >>> lib, reason = optim_library()
    >>> lib is not None or isinstance(reason, str)
    True
    """
    kernels = kernel_dir()
    files = {name: (kernels / name).read_text() for name in ("gpuflat_common.cuh", "gpuflat_optim.cuh")}
    files["host_prelude.h"] = (kernels / "host" / "host_prelude.h").read_text()
    try:
        path = host_compiler.build_library("gpuflat-host-optim", (kernels / "host" / "host_optim.cpp").read_text(),
                                           flags=FLAGS, files=files, key_parts=(_cpu_identity(),))
        lib = host_compiler.load(path, ctypes.CDLL)
    except (BuildError, OSError) as exc:
        return None, str(exc)
    vp, i64, f64, c_int = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_double, ctypes.c_int
    lib.gf_host_optim_step.argtypes = [c_int, c_int, vp, i64, vp, vp, vp, vp, vp, vp, vp, vp, vp, f64, f64, vp, c_int]
    lib.gf_host_optim_step.restype = c_int
    lib.gf_host_optim_rows.argtypes = [c_int, c_int, vp, i64, vp, vp, i64, vp, f64, f64, vp, c_int]
    lib.gf_host_optim_rows.restype = c_int
    return lib, None


def array_facts(arrays, words: int):
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


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiled for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()
