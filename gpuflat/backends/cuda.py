"""The CUDA backend: whole-tree operations as a fixed number of kernel launches (#3).

gather 1 launch, scatter 1, norms 2, clip_ 1, whatever the number of leaves.

Host side, this module only builds tables; the kernels (kernels/*.cu) do the
work. The tables:

- static, per plan and device (uploaded once, memoised in
  ``plan.device_cache``): the work items (slot, start, length, flat offset),
  each at most ITEM elements of one leaf, so big leaves split and tiny leaves
  take one item each; where each slot's items begin; the slots the norm
  finisher sums with the whole block; the identity CSR of plain flattens;
- per call: one row per source array (address, dtype tag, merged shape and
  byte strides), plus the CSR slot -> sources for tied gradients. It is
  uploaded again only when an address, stride or dtype changed: the last few
  uploaded tables are kept per plan and reused when the bytes match.

The same code drives the GPU (``CupyRuntime``) and the host emulator
(``EmulatedRuntime``); only the runtime differs.

>>> import numpy as np, gpuflat as gf
>>> from gpuflat.runtime import EmulatedRuntime
>>> be = CudaBackend(EmulatedRuntime())
>>> tree = {"w": np.ones((2, 3), np.float32), "b": np.full(2, 2.0)}
>>> plan, leaves = gf.plan(tree), gf.trainables(tree)
>>> r = be.norms(plan, leaves, 2, per_leaf=True)
>>> float(r.total) ** 2, r.per_leaf ** 2, int(r.first_nonfinite)
(14.0, array([6., 8.]), -1)
>>> be.stats.launches, be.stats.syncs
(2, 0)
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from functools import lru_cache
from operator import attrgetter

import numpy as np

from gpuflat import kernel_loader as kl
from gpuflat.dtypes import TAGS

from .protocol import NormResult

# Elements per work item. A multiple of 32 lanes * 8 elements per 16-byte
# vector, so every item of a leaf starts as aligned as the leaf itself. The
# norm partials are per item, so this constant is part of the summation order.
ITEM = 4096
# Mirrors of kernels/gpuflat_common.cuh (a test checks they agree).
MAX_DIMS = 8
FINISH_THREADS = 256
SMALL_SLOT_ITEMS = 16
LEAF_ROW_WORDS = 4 + 2 * MAX_DIMS
ITEM_WORDS = 4
# Per-call tables kept per plan and device, so alternating between parameter
# and gradient trees does not upload every time.
TABLES_KEPT = 8

_sig = attrgetter("shape", "strides", "dtype")


class CudaBackend:
    """Whole-tree operations through the CUDA kernels on ``runtime``.

    ``grid`` fixes the number of blocks of the grid-stride kernels (default:
    the runtime's choice); results never depend on it.
    """

    def __init__(self, runtime, grid: int | None = None):
        self.runtime = runtime
        self.name = runtime.name
        self.xp = runtime.xp
        self.grid = grid

    @property
    def stats(self):
        """The runtime's launch, sync and upload counters."""
        return self.runtime.stats

    def to_host(self, x) -> np.ndarray:
        """Read a device array on the host (one synchronisation)."""
        return self.runtime.to_host(x)

    # ------------------------------------------------------------ operations

    def gather(self, plan, sources, out) -> None:
        """out[offset:offset+size] = sum of each slot's sources, cast to plan.dtype (1 launch)."""
        st = _static_tables(plan, self.runtime)
        counts = [len(s) for s in sources]
        arrays = [a for s in sources for a in s]
        slots = [slot for slot, s in enumerate(sources) for _ in s]
        rows = _leaf_rows(plan, arrays, slots, self.runtime)
        if all(c == 1 for c in counts):
            table, csr = _device_table(plan, self.runtime, rows), st.identity_csr
        else:
            extra = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
            buf = _device_table(plan, self.runtime, rows, extra)
            table, csr = buf[: rows.size], buf[rows.size :]
        self._launch(kl.gather_name(plan.dtype), st, [st.items, np.int64(st.n_items), table, csr, out])

    def scatter(self, plan, flat, leaves) -> None:
        """leaves[i][...] = flat slice i cast to the leaf's dtype, in place (1 launch)."""
        st = _static_tables(plan, self.runtime)
        table = self._leaf_table(plan, leaves, None)
        self._launch(kl.scatter_name(plan.dtype), st, [st.items, np.int64(st.n_items), table, flat])

    def norms(self, plan, leaves, ord, per_leaf, flat=None) -> NormResult:
        """Total and per-leaf norms and the first non-finite slot (2 launches).

        ``flat``: the buffer the leaves are views of (a resident model), whose
        table is cheaper to build; the results are the same bits.
        """
        kind, p = _norm_kind(ord)
        rt = self.runtime
        st = _static_tables(plan, rt)
        table = self._leaf_table(plan, leaves, flat)
        n_slots = len(plan.leaves)
        per = rt.empty(n_slots, np.float64)
        total = rt.empty((), np.float64)
        first = rt.empty((), np.int64)
        # Scratch per call, not per plan: two threads norming same-shaped
        # trees share the plan, and their launches may interleave (#5).
        partial = rt.empty(st.n_items, np.float64)
        flags = rt.empty(st.n_items, np.int32)
        self._launch(kl.norm_partial_name(kind), st,
                     [st.items, np.int64(st.n_items), table, np.float64(p), partial, flags])
        rt.launch(kl.norm_finish_name(kind), 1, FINISH_THREADS,
                  [st.items, np.int64(st.n_items), partial, flags, st.slot_items,
                   np.int64(n_slots), st.big_slots, np.int64(st.n_big), np.float64(p),
                   per, total, first])
        return NormResult(total, per, first)

    def clip_(self, plan, leaves, total, max_norm, eps, flat=None) -> None:
        """Every leaf *= min(1, max_norm / (total + eps)), the factor computed on
        the device from ``total`` (1 launch, no synchronisation)."""
        st = _static_tables(plan, self.runtime)
        table = self._leaf_table(plan, leaves, flat)
        self._launch(kl.SCALE_NAME, st, [st.items, np.int64(st.n_items), table, total,
                                         np.float64(max_norm), np.float64(eps)])

    # ------------------------------------------------------------ helpers

    def _leaf_table(self, plan, leaves, flat):
        if flat is not None:
            rows = _flat_rows(plan, self.runtime.pointer(flat))
        else:
            rows = _leaf_rows(plan, leaves, range(len(leaves)), self.runtime)
        return _device_table(plan, self.runtime, rows)

    def _launch(self, name, st, args):
        grid = self.grid or self.runtime.grid_for(st.n_items)
        self.runtime.launch(name, grid, self.runtime.block, args)


def _norm_kind(ord):
    p = float(ord)
    if p == 1:
        return "l1", p
    if p == 2:
        return "l2", p
    if p == math.inf:
        return "inf", p
    if p > 0 and math.isfinite(p):
        return "p", p
    raise ValueError(f"ord: expected 1, 2, inf or a number p > 0, got {ord!r}")


# ---------------------------------------------------------------- static tables


def plan_items(plan) -> np.ndarray:
    """The work items of a plan: int64 rows (slot, start, length, flat offset).

    >>> from types import SimpleNamespace as NS
    >>> p = NS(leaves=[NS(size=ITEM + 1), NS(size=0), NS(size=3)],
    ...        offsets=np.array([0, ITEM + 1, ITEM + 1, ITEM + 4]))
    >>> plan_items(p).tolist()
    [[0, 0, 4096, 0], [0, 4096, 1, 4096], [2, 0, 3, 4097]]
    """
    sizes = np.array([leaf.size for leaf in plan.leaves], dtype=np.int64)
    counts = -(-sizes // ITEM)
    slot = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    start = (np.arange(len(slot), dtype=np.int64) - first[slot]) * ITEM
    length = np.minimum(ITEM, sizes[slot] - start)
    flat = np.asarray(plan.offsets, dtype=np.int64)[:-1][slot] + start
    return np.stack([slot, start, length, flat], axis=1).astype(np.int64).reshape(-1, ITEM_WORDS)


class _StaticTables:
    """Device tables of one plan on one device, uploaded as one buffer."""

    def __init__(self, plan, runtime):
        items = plan_items(plan)
        n_slots = len(plan.leaves)
        counts = np.bincount(items[:, 0], minlength=n_slots).astype(np.int64)
        slot_items = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        big = np.flatnonzero(counts > SMALL_SLOT_ITEMS).astype(np.int64)
        identity = np.arange(n_slots + 1, dtype=np.int64)
        parts = [items.ravel(), slot_items, big, identity]
        self.buffer = runtime.upload(np.concatenate(parts).astype(np.int64))
        bounds = np.cumsum([0] + [p.size for p in parts])
        views = [self.buffer[bounds[i] : bounds[i + 1]] for i in range(len(parts))]
        self.items, self.slot_items, self.big_slots, self.identity_csr = views
        self.n_items = len(items)
        self.n_big = len(big)
        # The caches below are shared by every thread using this plan (#5).
        self.lock = threading.Lock()
        self.tables: OrderedDict = OrderedDict()  # per-call tables by content
        self.rows: OrderedDict = OrderedDict()  # host rows by array signature


def _static_tables(plan, runtime) -> _StaticTables:
    key = ("gpuflat.cuda",) + tuple(runtime.device_key)
    st = plan.device_cache.get(key)
    if st is None:
        st = plan.device_cache.setdefault(key, _StaticTables(plan, runtime))
    return st


# ---------------------------------------------------------------- per-call tables


@lru_cache(maxsize=4096)
def _row(shape, strides, dtype):
    """The table row of an array but its address; None if it keeps too many dims.

    Size-1 dims are dropped and adjacent dims merged where the strides allow,
    so a transposed matrix keeps 2 dims and any C-contiguous array none
    (ndim 0 marks the contiguous fast path).
    """
    size = int(np.prod(shape, dtype=np.int64))
    dims = []
    if size > 0:
        for n, s in zip(shape, strides):
            if n == 1:
                continue
            if dims and dims[-1][1] == s * n:
                dims[-1] = (dims[-1][0] * n, s)
            else:
                dims.append((n, s))
    itemsize = np.dtype(dtype).itemsize
    if size == 0 or not dims or (len(dims) == 1 and dims[0][1] == itemsize):
        dims = []
    if len(dims) > MAX_DIMS:
        return None
    pad = [0] * (MAX_DIMS - len(dims))
    return ([TAGS[np.dtype(dtype)], len(dims), size] + [n for n, _ in dims] + pad
            + [s for _, s in dims] + pad)


def _leaf_rows(plan, arrays, slots, runtime) -> np.ndarray:
    """Host table (n, LEAF_ROW_WORDS) of ``arrays`` (``slots[i]`` is array i's slot)."""
    sig = tuple(map(_sig, arrays))
    st = _static_tables(plan, runtime)
    with st.lock:
        template = st.rows.get(sig)
        if template is not None:
            st.rows.move_to_end(sig)
    if template is None:
        rows = []
        for (shape, strides, dtype), slot in zip(sig, slots):
            row = _row(shape, strides, dtype)
            if row is None:
                raise ValueError(
                    f"leaf {plan.leaves[slot].path!r}: shape {shape} with strides {strides} keeps "
                    f"more than {MAX_DIMS} dimensions after merging; the CUDA kernels take at most "
                    f"{MAX_DIMS}: pass a contiguous copy"
                )
            rows.append(row)
        template = np.zeros((len(rows), LEAF_ROW_WORDS), np.int64)
        if rows:
            template[:, 1:] = rows
        with st.lock:
            st.rows[sig] = template
            while len(st.rows) > TABLES_KEPT:
                st.rows.popitem(last=False)
    table = template.copy()
    table[:, 0] = np.fromiter(map(runtime.pointer, arrays), np.int64, count=len(arrays))
    return table


def _flat_rows(plan, flat_pointer) -> np.ndarray:
    """Rows of a resident model: slot i is the contiguous slice at its offset."""
    key = "gpuflat.cuda.flat_rows"
    template = plan.device_cache.get(key)
    if template is None:
        n = len(plan.leaves)
        template = np.zeros((n, LEAF_ROW_WORDS), np.int64)
        template[:, 1] = TAGS[plan.dtype]
        template[:, 3] = [leaf.size for leaf in plan.leaves]
        template = plan.device_cache.setdefault(key, template)
    table = template.copy()
    table[:, 0] = flat_pointer + np.asarray(plan.offsets[:-1], np.int64) * plan.dtype.itemsize
    return table


def _device_table(plan, runtime, rows, extra=None):
    """The device copy of ``rows`` (+ ``extra`` words), uploaded only when new."""
    host = rows.ravel() if extra is None else np.concatenate([rows.ravel(), extra])
    key = host.tobytes()
    st = _static_tables(plan, runtime)
    with st.lock:
        dev = st.tables.get(key)
        if dev is None:
            dev = runtime.upload(host)
            st.tables[key] = dev
            while len(st.tables) > TABLES_KEPT:
                st.tables.popitem(last=False)
        else:
            st.tables.move_to_end(key)
        return dev
