"""The native host backend: gather, scatter, norms and clipping in C++ on every core.

The NumPy backend pays for float64 accumulation with a conversion pass and
runs float16 arithmetic as scalar code. This backend runs the same operations
in one pass, in a small C++ library (``kernels/host/host_backend.cpp``) built
with g++ on first use and cached on disk. Its element arithmetic is the CUDA
kernels' own (``kernels/gpuflat_math.cuh``, compiled for the host) and its
summation order theirs (work items of ``ITEM`` elements, 32 lanes, the fixed
trees), so its norms are the same bits as the CUDA and emulated backends',
whatever the number of threads; gather, scatter and clip the same bits as
every backend. As there, norms and clips read a leaf that fills one dense
block of memory in another order than C's (transposed, channels_last,
reversed) as that block, contiguously, in memory order; any other leaf in its
logical order. Arrays are read in native code (no Python work per leaf), and
a resident model's norms read its one flat buffer at the plan's offsets.

Where no compiler (or no Python or NumPy headers) is found, every operation
runs on the NumPy backend instead; :func:`available` says which.

>>> import numpy as np, gpuflat as gf
>>> be = HostBackend()
>>> tree = {"w": np.ones((2, 3), np.float32), "b": np.full(2, 2.0)}
>>> plan, leaves = gf.plan(tree), gf.trainables(tree)
>>> r = be.norms(plan, leaves, 2, per_leaf=True)
>>> float(r.total) ** 2, r.per_leaf ** 2, int(r.first_nonfinite)
(14.0, array([6., 8.]), -1)
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import platform
import sysconfig

import numpy as np

from gpuflat import host_compiler
from gpuflat.dtypes import TAGS, when_bfloat16
from gpuflat.kernel_loader import kernel_dir
from gpuflat.layout import NORM_KINDS, norm_kind, rule_id

from .numpy_backend import HostMemory, NumpyBackend
from .protocol import LeafRows, NormResult, OneSourcePerSlot, Recorded

# The arithmetic must stay the kernels': no fast-math, and no contraction of
# a*b+c into one fma (the kernels are built with --fmad=false). -march=native
# lets the compiler use the machine's widest vectors; the cache key carries
# the CPU's identity, so a library is never loaded on a CPU it was not built for.
FLAGS = ("-O3", "-std=c++20", "-pthread", "-march=native", "-ffp-contract=off", "-fno-math-errno",
         "-fno-strict-aliasing", "-fvisibility=hidden")
SHARED_HEADERS = ("gpuflat_common.cuh", "gpuflat_math.cuh")


def available() -> bool:
    """Whether the native library builds and loads here (else NumPy runs everything).

    >>> isinstance(available(), bool)
    True
    """
    return _library() is not None


def unavailable_reason() -> str | None:
    """Why the native library is not used here (no Python headers, or the
    compiler's message), or None where it builds and loads.

    >>> (unavailable_reason() is None) == available()
    True
    """
    return _load()[1]


def _library():
    """The loaded library, built on first use; None where it cannot be built."""
    return _load()[0]


@functools.lru_cache(maxsize=None)
def _load():
    """(the loaded library, None), or (None, the reason it cannot be built or loaded)."""
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
    except (host_compiler.BuildError, OSError) as exc:
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
    lib = _library()
    if lib is None:
        return None
    out = np.empty(words, np.int64)
    n = lib.gf_host_facts(arrays, out)
    return out[:n] if n >= 0 else None


def _token(arrays) -> int:
    """The token under which the library may keep what it read from ``arrays``
    (a :class:`~gpuflat.backends.protocol.Recorded` list's), else 0.

    >>> _token([np.ones(2)])
    0
    """
    return getattr(arrays, "token", 0) if type(arrays) is Recorded else 0


def _cpu_identity() -> str:
    """The CPU model and feature flags (what -march=native compiled for)."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.machine() + platform.processor()


class HostBackend(HostMemory):
    """Whole-tree operations on NumPy arrays in native code on ``threads`` threads.

    ``threads`` defaults to the CPUs this process may run on; results never
    depend on it.
    """

    name = "host"
    xp = np

    def __init__(self, threads: int | None = None):
        self.threads = int(threads or len(os.sched_getaffinity(0)))
        self._numpy = NumpyBackend()

    @property
    def reads_rows(self) -> bool:
        """Whether ``norms`` and ``clip_`` take LeafRows (where the native library loads).

        >>> HostBackend().reads_rows == available()
        True
        """
        return available()

    def gather(self, plan, sources, out) -> None:
        """out[slot's range] = sum of the slot's sources, cast to ``plan.dtype``.

        >>> import numpy as np, gpuflat as gf
        >>> a, b = np.ones(2, np.float32), np.full(1, 3.0, np.float32)
        >>> plan, out = gf.plan([a, b]), np.empty(3, np.float32)
        >>> HostBackend().gather(plan, [[a, a], [b]], out)
        >>> out
        array([2., 2., 3.], dtype=float32)
        """
        lib = _library()
        if lib is None:
            return self._numpy.gather(plan, sources, out)
        # One array per slot passes as the arrays themselves (the library takes an array as a slot's one source).
        given = sources.arrays if isinstance(sources, OneSourcePerSlot) else sources
        bad = lib.gf_host_gather(given, plan.offsets, out, self.threads, _token(given))
        if bad >= 0:
            counts = np.cumsum([len(s) for s in sources])
            slot = int(np.searchsorted(counts, bad, side="right"))
            _refuse(plan, slot, [a for s in sources for a in s][bad])

    def scatter(self, plan, flat, leaves) -> None:
        """leaves[slot][...] = flat[slot's range], cast to the leaf's dtype, in place.

        >>> import numpy as np, gpuflat as gf
        >>> leaves = [np.zeros((1, 2), np.float32), np.zeros(1)]
        >>> HostBackend().scatter(gf.plan(leaves), np.array([1.0, 2.0, 3.0]), leaves)
        >>> leaves
        [array([[1., 2.]], dtype=float32), array([3.])]
        """
        lib = _library()
        if lib is None:
            return self._numpy.scatter(plan, flat, leaves)
        _check(plan, leaves, lib.gf_host_scatter(flat, leaves, plan.offsets, self.threads, _token(leaves)))

    def norms(self, plan, leaves, ord, per_leaf, flat=None) -> NormResult:
        """Total and per-leaf norms (always both) and the first non-finite slot, in
        the CUDA kernels' order (a dense-permuted leaf summed in memory order);
        with ``flat`` (the buffer the leaves are views of) every slot is read
        from it at the plan's offsets: the same bits, with no per-leaf Python
        work.

        >>> import numpy as np, gpuflat as gf
        >>> flat = np.array([3.0, 4.0, 12.0])
        >>> leaves = [flat[:2], flat[2:]]
        >>> plan = gf.plan(leaves)
        >>> r = HostBackend().norms(plan, leaves, 2, per_leaf=True, flat=flat)
        >>> float(r.total), r.per_leaf
        (13.0, array([ 5., 12.]))
        """
        lib = _library()
        if lib is None:
            return self._numpy.norms(plan, leaves, ord, per_leaf, flat=flat)
        p = float(ord)
        # totals[0] the norm, totals[1] the unrooted total it is the root of.
        per, totals, first = np.empty(len(plan.leaves)), np.empty(2), np.empty((), np.int64)
        args = (plan.offsets, NORM_KINDS[norm_kind(p)], p, self.threads, per, totals, first)
        if isinstance(leaves, LeafRows):
            _check(plan, leaves, lib.gf_host_norms_rows(leaves.words, *args))
        elif flat is None or lib.gf_host_norms_flat(flat, *args) >= 0:
            _check(plan, leaves, lib.gf_host_norms(leaves, *args, _token(leaves)))
        return NormResult(totals[:1].reshape(()), per, first, totals[1:].reshape(()))

    def clip_(self, plan, leaves, total, max_norm, eps, flat=None) -> None:
        """Every leaf *= min(1, max_norm / (total + eps)). ``flat``: the buffer
        the leaves are views of, zero outside them (a resident model's); a
        finite factor then scales the whole buffer in one pass (the zeros stay
        zero, and no per-leaf work is done), a NaN factor the leaves alone.

        >>> import numpy as np, gpuflat as gf
        >>> flat = np.array([3.0, 4.0, 0.0, 12.0])
        >>> leaves = [flat[:2], flat[3:]]
        >>> HostBackend().clip_(gf.plan(leaves), leaves, np.float64(13.0), 1.0, 0.0, flat=flat)
        >>> flat * 13
        array([ 3.,  4.,  0., 12.])
        >>> HostBackend().clip_(gf.plan(leaves), leaves, np.float64(np.nan), 1.0, 0.0, flat=flat)
        >>> flat
        array([nan, nan,  0., nan])
        """
        lib = _library()
        if lib is None:
            return self._numpy.clip_(plan, leaves, total, max_norm, eps)
        args = (float(total), float(max_norm), float(eps))
        if isinstance(leaves, LeafRows):
            return _check(plan, leaves, lib.gf_host_clip_rows(leaves.words, plan.offsets, *args, self.threads))
        if flat is not None and lib.gf_host_clip_flat(flat, *args, self.threads) < 0:
            return
        _check(plan, leaves, lib.gf_host_clip(leaves, plan.offsets, *args, self.threads, _token(leaves)))

    def on_device(self):
        """Host memory needs no device context.

        >>> with HostBackend().on_device():
        ...     pass
        """
        return contextlib.nullcontext()

    def to_host(self, x) -> np.ndarray:
        """``x`` as a NumPy array (it already is one).

        >>> HostBackend().to_host(np.float64(2.0))
        array(2.)
        """
        return np.asarray(x)

    def step_(self, rule, plan, params, grads, states, slot_group, hyper, steps, total, max_norm, eps, amp) -> None:
        """One optimizer update of a flat buffer in native code (see the protocol).

        >>> import numpy as np, gpuflat as gf
        >>> p, g, m, v = np.ones(3, np.float32), np.ones(3, np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32)
        >>> hyper = np.array([0.1, 0.0, 0.9, 0.999, 1e-8])
        >>> HostBackend().step_("adamw", gf.plan([p]), p, g, (m, v), np.zeros(1, np.int64), hyper,
        ...                     np.ones(1), None, 0.0, 0.0, np.array([1.0, 0.0]))
        >>> p.round(6)
        array([0.9, 0.9, 0.9], dtype=float32)
        """
        lib = _optim_library()
        if lib is None:
            return self._numpy.step_(rule, plan, params, grads, states, slot_group, hyper, steps, total,
                                     max_norm, eps, amp)
        ptr = _address
        tag = TAGS[params.dtype]
        s1 = ptr(states[1]) if len(states) > 1 else None
        lib.gf_host_optim_step(rule_id(rule), tag, ptr(plan.offsets), len(plan.leaves),
                               ptr(slot_group), ptr(hyper), ptr(steps), ptr(params), ptr(grads),
                               ptr(states[0]), s1, None if total is None else ptr(total),
                               float(max_norm), float(eps), ptr(amp), self.threads)


def _address(a) -> int:
    return np.asarray(a).ctypes.data


@functools.lru_cache(maxsize=None)
def _optim_library():
    """The native optimizer update (kernels/host/host_optim.cpp), built on
    first use; None where it cannot be built (NumPy serves then)."""
    kernels = kernel_dir()
    files = {name: (kernels / name).read_text() for name in ("gpuflat_common.cuh", "gpuflat_optim.cuh")}
    files["host_prelude.h"] = (kernels / "host" / "host_prelude.h").read_text()
    try:
        path = host_compiler.build_library("gpuflat-host-optim", (kernels / "host" / "host_optim.cpp").read_text(),
                                           flags=FLAGS, files=files, key_parts=(_cpu_identity(),))
        lib = host_compiler.load(path, ctypes.CDLL)
    except (host_compiler.BuildError, OSError):
        return None
    vp, i64, f64, c_int = ctypes.c_void_p, ctypes.c_longlong, ctypes.c_double, ctypes.c_int
    lib.gf_host_optim_step.argtypes = [c_int, c_int, vp, i64, vp, vp, vp, vp, vp, vp, vp, vp, f64, f64, vp, c_int]
    lib.gf_host_optim_step.restype = c_int
    return lib


def _check(plan, arrays, bad: int) -> None:
    if bad >= 0:
        _refuse(plan, bad, arrays[bad])


def _refuse(plan, slot: int, array) -> None:
    leaf = plan.leaves[slot]
    found = (f"{type(array).__module__}.{type(array).__name__} of shape {getattr(array, 'shape', '?')} "
             f"{getattr(array, 'dtype', '?')}")
    raise TypeError(f"leaf {leaf.path!r}: the host backend expected a native-byte-order NumPy array of "
                    f"{leaf.describe()}, got a {found}")
