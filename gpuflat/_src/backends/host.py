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
a resident model's norms read a table of its leaves' places built once.

The libraries are ``gpuflat._src.native``'s. Where they cannot be built (no
compiler, no Python or NumPy headers, a compiler error) or ``GPUFLAT_NATIVE=0``
turns them off, this backend cannot be made: asking for it by name raises
with the reason, and NumPy arrays take the NumPy backend by default instead.
Where only the optimizer library is missing, the optimizer steps are the
NumPy backend's (the same bits, slower).

Leaves reach this backend from the tree walk, which refuses byte-swapped
arrays; the library refuses arrays of any dtype but gpuflat's.

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
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuflat._src import native
from gpuflat._src.dtypes import TAGS
from gpuflat._src.identity import Recorded
from gpuflat._src.layout import DTYPES, NORM_KINDS, RULES, norm_kind

from .numpy_backend import HostMemory, NumpyBackend, _check_stats
from .protocol import LeafRows, NormResult, OneSourcePerSlot

if TYPE_CHECKING:
    from gpuflat._src.flatplan import FlatPlan


def _token(arrays: object) -> int:
    """The token under which the library may keep what it read from ``arrays``
    (a :class:`~gpuflat._src.identity.Recorded` list's), else 0.

    >>> _token([np.ones(2)])
    0
    """
    return getattr(arrays, "token", 0) if type(arrays) is Recorded else 0


class HostBackend(HostMemory):
    """Whole-tree operations on NumPy arrays in native code on ``threads`` threads.

    ``threads`` defaults to the CPUs this process may run on; results never
    depend on it.
    """

    name = "host"
    xp = np

    # Made only where the native library loads, so it always takes LeafRows.
    reads_rows = True

    def __init__(self, threads: int | None = None) -> None:
        self.threads = int(threads or len(os.sched_getaffinity(0)))
        self._lib = _needed(native.host_library(), "host library")

    def gather(self, plan: FlatPlan, sources: Sequence[Sequence[Any]], out: np.ndarray) -> None:
        """out[slot's range] = sum of the slot's sources, cast to ``plan.dtype``.

        >>> import numpy as np, gpuflat as gf
        >>> a, b = np.ones(2, np.float32), np.full(1, 3.0, np.float32)
        >>> plan, out = gf.plan([a, b]), np.empty(3, np.float32)
        >>> HostBackend().gather(plan, [[a, a], [b]], out)
        >>> out
        array([2., 2., 3.], dtype=float32)
        """
        # One array per slot passes as the arrays themselves (the library takes an array as a slot's one source).
        given = sources.arrays if isinstance(sources, OneSourcePerSlot) else sources
        bad = self._lib.gf_host_gather(given, plan.offsets, out, self.threads, _token(given))
        if bad >= 0:
            counts = np.cumsum([len(s) for s in sources])
            slot = int(np.searchsorted(counts, bad, side="right"))
            _refuse(plan, slot, [a for s in sources for a in s][bad])

    def scatter(self, plan: FlatPlan, flat: np.ndarray, leaves: Sequence[Any]) -> None:
        """leaves[slot][...] = flat[slot's range], cast to the leaf's dtype, in place.

        >>> import numpy as np, gpuflat as gf
        >>> leaves = [np.zeros((1, 2), np.float32), np.zeros(1)]
        >>> HostBackend().scatter(gf.plan(leaves), np.array([1.0, 2.0, 3.0]), leaves)
        >>> leaves
        [array([[1., 2.]], dtype=float32), array([3.])]
        """
        _check(plan, leaves, self._lib.gf_host_scatter(flat, leaves, plan.offsets, self.threads, _token(leaves)))

    def norms(self, plan: FlatPlan, leaves: Sequence[Any] | LeafRows, ord: float, per_leaf: bool) -> NormResult:
        """Total and per-leaf norms (always both) and the first non-finite slot, in
        the CUDA kernels' order (a dense-permuted leaf summed in memory order).

        >>> import numpy as np, gpuflat as gf
        >>> leaves = [np.array([3.0, 4.0]), np.array([12.0])]
        >>> plan = gf.plan(leaves)
        >>> r = HostBackend().norms(plan, leaves, 2, per_leaf=True)
        >>> float(r.total), r.per_leaf
        (13.0, array([ 5., 12.]))
        """
        lib = self._lib
        p = float(ord)
        # totals[0] the norm, totals[1] the unrooted total it is the root of.
        per, totals, first = np.empty(len(plan.leaves)), np.empty(2), np.empty((), np.int64)
        args = (plan.offsets, NORM_KINDS[norm_kind(p)], p, self.threads, per, totals, first)
        bad = lib.gf_host_norms_rows(leaves.words, *args) if isinstance(leaves, LeafRows) \
            else lib.gf_host_norms(leaves, *args, _token(leaves))
        if bad >= 0:
            _refuse(plan, bad, leaves[bad])
        return NormResult(totals[:1].reshape(()), per, first, totals[1:].reshape(()))

    def clip_(self, plan: FlatPlan, leaves: Sequence[Any] | LeafRows, total: Any, max_norm: Any, eps: float,
              flat: Any = None) -> None:
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
        lib = self._lib
        args = (float(total), float(max_norm), float(eps))
        if isinstance(leaves, LeafRows):
            return _check(plan, leaves, lib.gf_host_clip_rows(leaves.words, plan.offsets, *args, self.threads))
        if flat is not None and lib.gf_host_clip_flat(flat, *args, self.threads) < 0:
            return
        _check(plan, leaves, lib.gf_host_clip(leaves, plan.offsets, *args, self.threads, _token(leaves)))

    # Host memory needs no device context: the protocol's on_device() makes
    # an empty one, directly (no call of this backend's per step).
    on_device = staticmethod(contextlib.nullcontext)

    def to_host(self, x: Any) -> np.ndarray:
        """``x`` as a NumPy array (it already is one).

        >>> HostBackend().to_host(np.float64(2.0))
        array(2.)
        """
        return np.asarray(x)

    def step_(self, rule: str, plan: FlatPlan, params: np.ndarray, grads: np.ndarray, states: Sequence[np.ndarray],
              slot_group: np.ndarray, hyper: np.ndarray, steps: np.ndarray, total: Any, max_norm: float, eps: float,
              amp: np.ndarray) -> None:
        """One optimizer update of a flat buffer in native code (see the protocol).

        >>> import numpy as np, gpuflat as gf
        >>> p, g, m, v = np.ones(3, np.float32), np.ones(3, np.float32), np.zeros(3, np.float32), np.zeros(3, np.float32)
        >>> hyper = np.array([0.1, 0.0, 0.9, 0.999, 1e-8, 0.0, 0.0])
        >>> HostBackend().step_("adamw", gf.plan([p]), p, g, (m, v), np.zeros(1, np.int64), hyper,
        ...                     np.ones(1), None, 0.0, 0.0, np.array([1.0, 0.0]))
        >>> p.round(6)
        array([0.9, 0.9, 0.9], dtype=float32)
        """
        lib = native.optim_library()[0]
        if lib is None:
            return NumpyBackend().step_(rule, plan, params, grads, states, slot_group, hyper, steps, total,
                                        max_norm, eps, amp)
        ptr = _address
        # A dtype the update is not built for gets -1, which the library refuses.
        tag = TAGS.get(params.dtype, -1)
        s0, s1, s2 = [ptr(s) for s in states] + [None] * (3 - len(states))
        code = lib.gf_host_optim_step(RULES[rule].number, tag, ptr(plan.offsets), len(plan.leaves),
                                      ptr(slot_group), ptr(hyper), ptr(steps), ptr(params), ptr(grads),
                                      s0, s1, s2, None if total is None else ptr(total),
                                      float(max_norm), float(eps), ptr(amp), self.threads)
        if code != 0:
            raise TypeError(f"the host backend's optimizer step: expected buffers of a real floating dtype "
                            f"({_OPTIM_NAMES}), found {params.dtype}")


    def step_rows(self, rule: str, tag: int, rows: np.ndarray, hyper: np.ndarray, lr_at: np.ndarray, total: Any,
                  max_norm: float, eps: float, amp: np.ndarray, stats: np.ndarray | None = None) -> None:
        """One optimizer update of parameters where they are, in native code (see the protocol): the
        library runs the mixed update where any row's precision word is not 0, and with ``stats``
        sums each row's update statistics from its own loops (item by item, in a fixed order).

        >>> import numpy as np
        >>> p, g, buf = np.ones(2, np.float32), np.full(2, 4.0, np.float32), np.zeros(2, np.float32)
        >>> count = np.zeros(1, np.float32)   # the buffer's updates: 0, so it is new
        >>> rows = np.array([[p.ctypes.data, g.ctypes.data, buf.ctypes.data, 0, 0, 0, count.ctypes.data, 2, 0, 0]])
        >>> hyper = np.array([0.5, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0])
        >>> HostBackend().step_rows("sgd", 2, rows, hyper, np.zeros(2, np.int64), None, 0.0, 0.0,
        ...                         np.array([0.25, 0.0]))
        >>> p, buf, count
        (array([0.5, 0.5], dtype=float32), array([1., 1.], dtype=float32), array([1.], dtype=float32))
        >>> stats = np.full((1, 2), np.nan)
        >>> HostBackend().step_rows("sgd", 2, rows, hyper, np.zeros(2, np.int64), None, 0.0, 0.0,
        ...                         np.array([0.25, 0.0]), stats)
        >>> p, stats.round(6)   # each moved by -0.5 * (0.9 * 1 + 1) to -0.45: (2 * 0.95**2, 2 * 0.45**2)
        (array([-0.45, -0.45], dtype=float32), array([[1.805, 0.405]]))
        """
        lib = native.optim_library()[0]
        if lib is None:
            return NumpyBackend().step_rows(rule, tag, rows, hyper, lr_at, total, max_norm, eps, amp, stats)
        rows = np.ascontiguousarray(rows, np.int64)
        rule_of = RULES[rule]
        if stats is not None:
            _check_stats(stats, len(rows))
        # The addresses taken here, not through _address: a step's host work is a few calls, kept few.
        at = [None if a is None else np.asarray(a).ctypes.data for a in (rows, hyper, lr_at, total, amp, stats)]
        rule_of.check_rows(rows, hyper)
        code = lib.gf_host_optim_rows(rule_of.number, tag, at[0], len(rows), at[1], at[2], rule_of.counted_field,
                                      at[3], float(max_norm), float(eps), at[4], self.threads, at[5])
        if code != 0:
            raise TypeError(f"the host backend's optimizer step: expected parameters of a real floating dtype "
                            f"({_OPTIM_NAMES}), found dtype tag {tag}")


# The NumPy names of the dtypes the native update is built for.
_OPTIM_NAMES = ", ".join(row.name for row in DTYPES if row.optim)


def _address(a: Any) -> int:
    return np.asarray(a).ctypes.data


def _needed(loaded: tuple[Any, str | None], what: str) -> Any:
    """The library of ``loaded`` (a native loader's pair), else an error naming why it is missing."""
    lib, reason = loaded
    if lib is None:
        raise RuntimeError(f"backend=\"host\": expected gpuflat's native {what}, but it cannot be built or loaded "
                           f"here; backend=\"numpy\" is the portable choice (the same operations, in NumPy). "
                           f"Why: {reason}")
    return lib


def _check(plan: FlatPlan, arrays: Sequence[Any] | LeafRows, bad: int) -> None:
    if bad >= 0:
        _refuse(plan, bad, arrays[bad])


def _refuse(plan: FlatPlan, slot: int, array: object) -> None:
    leaf = plan.leaves[slot]
    found = (f"{type(array).__module__}.{type(array).__name__} of shape {getattr(array, 'shape', '?')} "
             f"{getattr(array, 'dtype', '?')}")
    raise TypeError(f"leaf {leaf.path!r}: the host backend expected a native-byte-order NumPy array of "
                    f"{leaf.describe()}, got a {found}")
