"""The CUDA backend: whole-tree operations as a fixed number of kernel launches.

gather 1 launch, scatter 1, norms 1 (2 with per-leaf norms), clip_ 1, whatever the
number of leaves.

Host side, this module only builds tables; the kernels (kernels/*.cu) do the
work. The tables:

- static, per plan and device (uploaded once, memoised in a
  ``WeakKeyDictionary`` keyed by the plan, so they go with it): the work items (slot, start, length, flat offset),
  each at most ITEM elements of one leaf, so big leaves split and tiny leaves
  take one item each; where each slot's items begin; the slots the norm
  finisher sums with the whole block; the identity CSR of plain flattens;
- per call: one row per source array (address, dtype tag, merged shape and
  byte strides), plus the CSR slot -> sources for tied gradients. Norms and
  clips read a leaf whose elements fill one dense block (transposed,
  channels_last, reversed) as that block, lowest address first, through the
  contiguous row (``gpuflat._src.memory_order``); gather and scatter keep the
  logical order of every leaf. The last
  few tables are kept per plan, found again by the identity of the arrays
  (weak references, so a table never keeps old gradients alive and a
  recycled id never matches), so the norm and the scale of one clip, and
  every step on arrays updated in place, build and upload nothing.

The same code drives the GPU (``CupyRuntime``) and the host emulator
(``EmulatedRuntime``); only the runtime differs.

>>> import numpy as np, gpuflat as gf
>>> from gpuflat._src.backends.cuda_runtime import EmulatedRuntime
>>> be = CudaBackend(EmulatedRuntime())
>>> tree = {"w": np.ones((2, 3), np.float32), "b": np.full(2, 2.0)}
>>> plan, leaves = gf.plan(tree), gf.trainables(tree)
>>> r = be.norms(plan, leaves, 2, per_leaf=True)
>>> float(r.total) ** 2, r.per_leaf ** 2, int(r.first_nonfinite)
(14.0, array([6., 8.]), -1)
>>> be.stats.launches, be.stats.syncs
(2, 0)
>>> _ = be.norms(plan, leaves, 2, per_leaf=False); be.stats.launches
3
"""
from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuflat._src import caches
from gpuflat._src import kernel_loader as kl
from gpuflat._src.dtypes import c_name, dtype_of_tag
from gpuflat._src.identity import Layout, SameArrays, equal_facts
from gpuflat._src.layout import (BLOCK_THREADS, C_NAMES, FINISH_THREADS, ITEM, ITEM_WORDS, LEAF_ROW_WORDS, MAX_DIMS,
                                 ORDERS_TAKEN, ROW_NUMEL, ROW_PRECISION, RULES, SMALL_SLOT_ITEMS, WARP, dense_row,
                                 leaf_row, takes_order, work_items)
from gpuflat._src.memory_order import dense_start
from gpuflat._src.native import array_facts

from .numpy_backend import _check_stats
from .protocol import LeafRows, NormResult, OneSourcePerSlot

if TYPE_CHECKING:
    from gpuflat._src.flatplan import FlatPlan

    from .cuda_runtime import DeviceTable, Runtime, Stats

# Per-call tables kept per plan and device, so alternating between parameter
# and gradient trees does not upload every time.
TABLES_KEPT = 8
# The key of the norms' and clips' tables (memory-order rows), apart from the
# gather and scatter tables of the same arrays (logical-order rows).
MEMORY_ORDER = "memory order"

_sig = attrgetter("shape", "strides", "dtype")


class CudaBackend:
    """Whole-tree operations through the CUDA kernels on ``runtime``.

    ``grid`` fixes the number of blocks of the grid-stride kernels (default:
    the runtime's choice); results never depend on it.
    """

    reads_rows = True  # takes LeafRows for leaves in norms and clip_

    def __init__(self, runtime: Runtime, grid: int | None = None) -> None:
        self.runtime = runtime
        self.name = runtime.name
        self.xp = runtime.xp
        self.grid = grid
        self._step_tables = _StepTables(runtime)

    @property
    def stats(self) -> Stats:
        """The runtime's launch, sync and upload counters."""
        return self.runtime.stats

    def on_device(self) -> AbstractContextManager[Any]:
        """The runtime's device as a context: arrays made inside land there."""
        return self.runtime.on_device()

    def to_host(self, x: Any) -> np.ndarray:
        """Read a device array on the host (one synchronisation)."""
        return self.runtime.to_host(x)

    def empty(self, shape: int | tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised device array, from the allocator of the current scope."""
        return self.runtime.empty(shape, dtype)

    def zeros(self, shape: int | tuple[int, ...], dtype: Any) -> Any:
        """A zeroed device array (a fill on the current stream)."""
        return self.runtime.zeros(shape, dtype)

    def copy(self, x: Any) -> Any:
        """A C-contiguous device copy of ``x``, on the current stream."""
        with self.runtime.on_device():
            return self.xp.array(x, copy=True, order="C")

    def sum(self, x: Any) -> Any:
        """The sum of ``x``'s elements as a 0-d device array (no host read)."""
        with self.runtime.on_device():
            return self.xp.sum(x)

    # ------------------------------------------------------------ operations

    def gather(self, plan: FlatPlan, sources: Sequence[Sequence[Any]], out: Any) -> None:
        """out[offset:offset+size] = sum of each slot's sources, cast to out's dtype
        (any of gpuflat._src.dtypes.TAGS: the kernel is instantiated for each) (1 launch)."""
        st = _static_tables(plan, self.runtime)
        if isinstance(sources, OneSourcePerSlot):  # the arrays themselves: a recorded tree's keep their token
            counts, arrays = [1] * len(sources), sources.arrays
        else:
            counts, arrays = [len(s) for s in sources], [a for s in sources for a in s]
        if all(c == 1 for c in counts):
            uploaded = st.table(arrays, None, lambda: _leaf_rows(st, plan, arrays, range(len(arrays)), self.runtime))
            table, csr = uploaded.array, st.identity_csr
        else:
            extra = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
            slots = [slot for slot, s in enumerate(sources) for _ in s]
            uploaded = st.table(arrays, tuple(counts), lambda: np.concatenate(
                [_leaf_rows(st, plan, arrays, slots, self.runtime).ravel(), extra]))
            buf = uploaded.array
            table, csr = buf[: len(arrays) * LEAF_ROW_WORDS], buf[len(arrays) * LEAF_ROW_WORDS :]
        self._launch(kl.gather_name(out.dtype), st, [st.items, np.int64(st.n_items), table, csr, out], uploaded)

    def scatter(self, plan: FlatPlan, flat: Any, leaves: Sequence[Any]) -> None:
        """leaves[i][...] = flat slice i cast to the leaf's dtype, in place, rounded
        once whatever flat's dtype (any of gpuflat._src.dtypes.TAGS) (1 launch)."""
        st = _static_tables(plan, self.runtime)
        table = st.table(leaves, None, lambda: _leaf_rows(st, plan, leaves, range(len(leaves)), self.runtime))
        self._launch(kl.scatter_name(flat.dtype), st, [st.items, np.int64(st.n_items), table.array, flat], table)

    def norms(self, plan: FlatPlan, leaves: Sequence[Any] | LeafRows, ord: float, per_leaf: bool) -> NormResult:
        """The total norm, the first non-finite slot and, with ``per_leaf``,
        each leaf's norm (1 launch, and a 16-byte memset; 2 launches with
        ``per_leaf``), in kernels/norms.cu's order.

        A leaf filling one dense block of memory in another order than C's
        (transposed, channels_last, reversed) is summed in memory order, any
        other leaf in its logical order.
        """
        kind, p = _norm_kind(ord)
        rt = self.runtime
        st = _static_tables(plan, rt)
        table = self._leaf_table(st, plan, leaves)
        # totals[0] the norm (the clip kernel reads it), totals[1] the unrooted
        # total it is the root of; one allocation, exposed as two 0-d views.
        totals = rt.empty(2, np.float64)
        # Scratch per call, not per plan: two threads norming same-shaped
        # trees share the plan, and their launches may interleave. Each item's
        # partial, then each item's non-finite flag; every word is written.
        partial = rt.empty(2 * st.n_items, np.float64)
        if not per_leaf:
            # One launch (gpuflat_norm_one): the block that finishes last adds
            # every partial. Its ticket word is zeroed here, in one memset with
            # the first-bad word the kernel overwrites anyway: a word per call
            # is never shared by two launches in flight (two streams norming
            # one plan, a graph's replay beside a direct call), and a memset is
            # captured into a CUDA graph with the launch, so every replay
            # starts from 0, where a word kept per plan or per stream would
            # need its own care for each of those.
            words = rt.zeros(2, np.int64)
            first, ticket = words[:1].reshape(()), words[1:]
            block = FINISH_THREADS
            grid = self.grid or int(max(1, min(rt.max_grid, -(-st.n_items // (block // WARP)))))
            rt.launch(kl.norm_one_name(kind), grid, block,
                      [st.items, np.int64(st.n_items), table.array, np.float64(p), partial, ticket, totals,
                       first], (st.uploaded, table))
            return NormResult(totals[:1].reshape(()), None, first, totals[1:].reshape(()))
        n_slots = len(plan.leaves)
        per = rt.empty(n_slots, np.float64)
        first = rt.empty((), np.int64)
        self._launch(kl.norm_partial_name(kind), st,
                     [st.items, np.int64(st.n_items), table.array, np.float64(p), partial], table)
        # The leaves' own norms need the finisher's registers (about 150 a
        # thread, kernels/norms.cu): a launch of its own, apart from the
        # partials' kernel and its 64.
        rt.launch(kl.norm_finish_name(kind), 1, FINISH_THREADS,
                  [st.items, np.int64(st.n_items), partial, st.slot_items,
                   np.int64(n_slots), st.big_slots, np.int64(st.n_big), np.float64(p), per,
                   totals, first], (st.uploaded,))
        return NormResult(totals[:1].reshape(()), per, first, totals[1:].reshape(()))

    def clip_(self, plan: FlatPlan, leaves: Sequence[Any] | LeafRows, total: Any, max_norm: Any, eps: float,
              flat: Any = None) -> None:
        """Every leaf *= min(1, max_norm / (total + eps)), the factor computed on
        the device from ``total`` and ``max_norm`` (a float, or a 0-d float64
        device array) (1 launch, no synchronisation)."""
        st = _static_tables(plan, self.runtime)
        table = self._leaf_table(st, plan, leaves, flat)
        # max_norm is a number, or a 0-d float64 device array the kernel reads.
        name, max_norm = ((kl.SCALE_NAME, np.float64(max_norm)) if isinstance(max_norm, float)
                          else (kl.SCALE_AT_NAME, max_norm))
        self._launch(name, st, [st.items, np.int64(st.n_items), table.array, total, max_norm, np.float64(eps)],
                     table)

    # ------------------------------------------------------------ helpers

    def _leaf_table(self, st: _StaticTables, plan: FlatPlan, leaves: Sequence[Any] | LeafRows,
                    flat: Any = None) -> DeviceTable:
        """The memory-order table of the norms and clips; ``flat``, a clip's
        buffer its leaves are fixed views of (see the protocol)."""
        if isinstance(leaves, LeafRows):
            # Built once from tensors' metadata and never changed: found by its identity.
            return st.table((leaves,), "rows", lambda: memory_order_rows(leaves.words))

        def build() -> np.ndarray:
            return _leaf_rows(st, plan, leaves, range(len(leaves)), self.runtime, memory_order=True)
        if flat is not None:
            # The leaves are fixed views of ``flat`` (a resident model's): their
            # table depends on its address alone, found without a per-leaf look.
            return st.table((), ("flat", self.runtime.pointer(flat)), build)
        return st.table(leaves, MEMORY_ORDER, build)

    def _launch(self, name: str, st: _StaticTables, args: Sequence[Any], table: DeviceTable) -> None:
        grid = self.grid or self.runtime.grid_for(st.n_items)
        self.runtime.launch(name, grid, min(self.runtime.block, BLOCK_THREADS), args, (st.uploaded, table))

    def step_(self, rule: str, plan: FlatPlan, params: Any, grads: Any, states: Sequence[Any], slot_group: Any,
              hyper: Any, steps: Any, total: Any, max_norm: float, eps: float, amp: Any) -> None:
        """One optimizer update of a flat buffer (1 launch, no synchronisation):
        the clip factor is taken from ``total`` on the device, the
        hyperparameters and step counts from device tables."""
        st = _static_tables(plan, self.runtime)
        clip = total is not None
        # The kernel's state arguments beyond the caller's (AdamW's
        # max_exp_avg_sq where no group sets amsgrad, a generic rule's unused
        # ones): the kernel reads none of them, so any device array stands in.
        kept = RULES[rule].flat_states
        args = [st.items, np.int64(st.n_items), slot_group, hyper, steps, params, grads,
                *states, *[steps] * (kept - len(states)), total if clip else steps, np.float64(max_norm),
                np.float64(eps), np.int64(clip), amp]
        name = RULES[rule].flat_kernel(c_name(params.dtype))
        grid = self.grid or self.runtime.grid_for(st.n_items)
        self.runtime.launch(name, grid, min(self.runtime.block, BLOCK_THREADS), args, (st.uploaded,))


    def step_rows(self, rule: str, tag: int, rows: np.ndarray, hyper: np.ndarray, lr_at: np.ndarray, total: Any,
                  max_norm: float, eps: float, amp: Any, stats: Any = None) -> None:
        """One optimizer update of parameters where they are (2 launches, no
        synchronisation): the update over the rows' work items, then the
        step counts. The rows, the groups' hyperparameters and the items
        are uploaded with no host wait (and checked, as
        ``Rule.check_rows`` checks them, when new); the clip factor is
        taken from ``total`` on the device. Where any row's precision word
        is not 0 (a state of another dtype than its parameter, or the
        parameter kept through a master copy or a compensation), the
        update is the rule's mixed kernel (``Rule.mixed_rows_kernel``,
        element by element) for every row of the table.

        With ``stats`` (a (rows, 2) float64 device array), the update is
        its kernel's ``stats`` instantiation, which writes each work
        item's update statistics into a scratch kept with the step's
        tables (uploaded once with them: a repeated step, and a graph's
        replay, reuse it), and a third launch (``gpuflat_row_stats``) adds
        each row's items into ``stats``: 3 launches, no synchronisation,
        no allocation once the tables are kept. The scratch belongs to the
        tables, so two steps over the same tables must not run at once on
        different streams with ``stats``."""
        rt, rule_of = self.runtime, RULES[rule]
        rows = np.ascontiguousarray(rows, np.int64)
        items = _row_items(rows[:, ROW_NUMEL].tobytes())
        if stats is not None:
            _check_stats(stats, len(rows))
        tables, (flag, mixed) = self._step_tables.get(
            lambda: (rule_of.checked_flag(rows, hyper), bool(rows[:, ROW_PRECISION].any())),
            rows, items, hyper, lr_at, scratch=None if stats is None else (lambda: _stats_scratch(rows)))
        on_device = [t.array for t in tables]
        clip = total is not None
        n_items = len(items) // ITEM_WORDS
        args = [on_device[1], np.int64(n_items), on_device[0], on_device[2], on_device[3],
                total if clip else on_device[2], np.float64(max_norm), np.float64(eps), np.int64(clip), amp]
        block = min(rt.block, BLOCK_THREADS)
        wants = stats is not None
        name = rule_of.mixed_rows_kernel(C_NAMES[tag], wants) if mixed else \
            rule_of.rows_kernel(C_NAMES[tag], flag, wants)
        if wants:
            # The scratch table: each row's first item (len(rows) + 1 words), then two float64 per item.
            row_items, partial = on_device[4][: len(rows) + 1], on_device[4][len(rows) + 1 :].view(np.float64)
            args.append(partial)
        rt.launch(name, self.grid or rt.grid_for(n_items), block, args, tables)
        if wants:
            rt.launch(kl.ROW_STATS_NAME, self.grid or rt.grid_for(len(rows)), block,
                      [row_items, np.int64(len(rows)), partial, amp, stats], [tables[4]])
        rt.launch(kl.COUNT_STEPS_NAME, self.grid or rt.grid_for(-(-len(rows) // WARP)), block,
                  [on_device[0], np.int64(len(rows)), on_device[2], np.int64(rule_of.counted_field), amp],
                  [tables[0], tables[2]])


class _StepTables:
    """The device tables of the last few optimizer steps, found again by their
    host words: a step over the same memory (gradients zeroed in place, or
    allocated again where they were) uploads nothing, so it can be captured
    in a CUDA graph after one warm-up step.

    The host words are compared with those kept, the latest first, rather
    than hashed: a comparison stops at the first difference and reads no
    more than a hash would, and a loop's step mostly repeats the last one."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        # (host arrays, their device tables)
        self.kept = caches.Recent("optimizer step tables", TABLES_KEPT, on_evict=self._release)
        self.lock = threading.Lock()

    def get(self, check: Callable[[], Any], *arrays: np.ndarray,
            scratch: Callable[[], np.ndarray] | None = None) -> tuple[list[DeviceTable], Any]:
        """(the device tables of the ``arrays`` (host), what ``check()``
        returned for them): where they are new, ``check()`` (which raises
        for bad ones) runs before the upload, and its answer is kept with
        the tables. With ``scratch``, one more table after them: the
        upload of ``scratch()``, made the first time these tables are
        asked for one and kept with them from then on (not compared: it
        follows from the arrays), which the kernels may write."""
        host = [np.ascontiguousarray(a) for a in arrays]
        with self.lock:
            entry = self.kept.find(lambda kept: all(a.shape == b.shape and np.array_equal(a, b)
                                                    for a, b in zip(host, kept[0])))
            if entry is None:
                checked = check()
                entry = [host, [self.runtime.upload_table(a, "the optimizer step (new parameter or gradient memory)")
                                for a in host], checked, None]
                self.kept.add(entry)
            if scratch is None:
                return entry[1], entry[2]
            if entry[3] is None:
                entry[3] = self.runtime.upload_table(scratch(), "the optimizer step's update statistics (their "
                                                                "scratch, new with new parameter or gradient memory)")
            return [*entry[1], entry[3]], entry[2]

    def _release(self, entry: list[Any]) -> None:
        for table in entry[1] + ([entry[3]] if entry[3] is not None else []):
            self.runtime.release(table)


def _stats_scratch(rows: np.ndarray) -> np.ndarray:
    """The host words of a step's update-statistics scratch (int64): each
    row's first work item, with one more for the end (``len(rows) + 1``
    words: a row's items are consecutive), then two zero words per item,
    which the row kernels' ``stats`` instantiations overwrite with its
    float64 sums.

    >>> from gpuflat._src.layout import PARAM_ROW_WORDS
    >>> rows = np.zeros((3, PARAM_ROW_WORDS), np.int64)
    >>> rows[:, ROW_NUMEL] = [ITEM + 1, 0, 3]
    >>> _stats_scratch(rows).tolist()
    [0, 2, 2, 3, 0, 0, 0, 0, 0, 0]
    """
    counts = -(-rows[:, ROW_NUMEL] // ITEM)
    return np.concatenate([[0], np.cumsum(counts), np.zeros(2 * int(counts.sum()), np.int64)]).astype(np.int64)


@caches.function(maxsize=16)
def _row_items(numels: bytes) -> np.ndarray:
    """The work items (flat, ITEM_WORDS per item) of parameters of these
    element counts (int64 bytes): ``work_items``, slot = its row.

    >>> _row_items(np.array([3, ITEM + 1], np.int64).tobytes()).reshape(-1, ITEM_WORDS).tolist()
    [[0, 0, 3, 0], [1, 0, 4096, 0], [1, 4096, 1, 4096]]
    """
    return work_items(np.frombuffer(numels, np.int64)).reshape(-1)


def _norm_kind(ord: float) -> tuple[str, float]:
    p = float(ord)
    if not takes_order(p):
        raise ValueError(f"ord: expected {ORDERS_TAKEN}, got {ord!r}")
    return kl.norm_kind(p), p


# ---------------------------------------------------------------- static tables


def plan_items(plan: FlatPlan) -> np.ndarray:
    """The work items of a plan: int64 rows (slot, start, length, flat offset).

    >>> from types import SimpleNamespace as NS
    >>> p = NS(leaves=[NS(size=ITEM + 1), NS(size=0), NS(size=3)],
    ...        offsets=np.array([0, ITEM + 1, ITEM + 1, ITEM + 4]))
    >>> plan_items(p).tolist()
    [[0, 0, 4096, 0], [0, 4096, 1, 4096], [2, 0, 3, 4097]]
    """
    return work_items([leaf.size for leaf in plan.leaves], np.asarray(plan.offsets, dtype=np.int64)[:-1])


class _TableEntry:
    """One uploaded per-call table and what it was built for: the arrays and
    a hashable ``key`` (tie counts, or a resident buffer's address).

    The arrays are recognised by weak reference (the cache never keeps
    gradients alive, and a dead or recycled array never matches), and NumPy
    arrays, whose strides a caller may set in place (the emulated device's),
    by their layout too. Where the host library reads NumPy arrays' facts
    (identity, address, dtype, flags, dims, strides: all a table row holds,
    and more), those alone decide, in one native pass: equal facts mean
    equal rows. Arrays a recorded tree found unchanged carry its token
    (``identity.Recorded``): the same token, the same arrays as they were,
    with nothing to compare."""

    def __init__(self, arrays: Sequence[Any], key: Hashable, host: np.ndarray, uploaded: DeviceTable) -> None:
        self.token = getattr(arrays, "token", 0)
        numpy = bool(arrays) and isinstance(arrays[0], np.ndarray)
        words = 4 * len(arrays) + 2 * sum(a.ndim for a in arrays) if numpy else 0
        self.facts = array_facts(arrays, words) if numpy else None
        self.arrays = SameArrays(arrays) if self.facts is None else None
        self.layout = Layout(arrays) if numpy and self.facts is None else None
        self.key = key
        self.host = host
        self.uploaded = uploaded  # a runtime.DeviceTable

    def holds(self, arrays: Sequence[Any], key: Hashable, facts: np.ndarray | None) -> bool:
        """Whether this table is ``arrays``'s (``facts``: theirs, as
        :func:`_current_facts` read them once for every entry)."""
        if self.key != key:
            return False
        token = getattr(arrays, "token", 0)
        if token and token == self.token:
            return True
        if self.facts is not None:
            held = facts is not None and equal_facts(facts, self.facts)
        else:
            assert self.arrays is not None  # kept exactly where the facts are not
            held = self.arrays.holds(arrays) and (self.layout is None or self.layout.holds(arrays))
        if held and token:  # these arrays, as the table was built for them: their token names them from now on
            self.token = token
        return held


def _current_facts(arrays: Sequence[Any], entries: Iterable[_TableEntry]) -> np.ndarray | None:
    """The facts of ``arrays`` read once, in room for the longest an entry
    keeps (longer ones match no entry: None), or None where no entry keeps any."""
    words = max((len(e.facts) for e in entries if e.facts is not None), default=0)
    return array_facts(arrays, words) if words else None


class _StaticTables:
    """Device tables of one plan on one device, uploaded as one buffer, and
    the plan's last few per-call tables. Every table it lets go (evicted, or
    all of them when the plan is collected) goes back through
    ``runtime.release``, which keeps it while another stream may still read it."""

    def __init__(self, plan: FlatPlan, runtime: Runtime) -> None:
        items = plan_items(plan)
        n_slots = len(plan.leaves)
        counts = np.bincount(items[:, 0], minlength=n_slots).astype(np.int64)
        slot_items = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        big = np.flatnonzero(counts > SMALL_SLOT_ITEMS).astype(np.int64)
        identity = np.arange(n_slots + 1, dtype=np.int64)
        parts = [items.ravel(), slot_items, big, identity]
        self.runtime = runtime
        self.plan_paths = [leaf.path for leaf in plan.leaves[:3]] + ["..."] * (len(plan.leaves) > 3)
        self.uploaded = runtime.upload_table(np.concatenate(parts).astype(np.int64),
                                             _purpose(self.plan_paths, "static"))
        self.buffer = self.uploaded.array
        bounds = np.cumsum([0] + [p.size for p in parts])
        views = [self.buffer[bounds[i] : bounds[i + 1]] for i in range(len(parts))]
        self.items, self.slot_items, self.big_slots, self.identity_csr = views
        self.n_items = len(items)
        self.n_big = len(big)
        # The caches below are shared by every thread using this plan.
        self.lock = threading.RLock()  # re-entrant: an entry evicted while it is held releases its table
        self.entries = caches.Recent("per-call device tables", TABLES_KEPT,
                                     on_evict=_evicting(weakref.WeakMethod(self._evict)))
        self.rows = caches.LRU("per-call host rows", TABLES_KEPT)  # rows and starts by reading order and signatures
        # Every table alive, released when the plan (and so this object) goes;
        # not at exit, when the device may be gone already.
        self.alive = [self.uploaded]
        weakref.finalize(self, _release_all, runtime, self.alive).atexit = False

    def table(self, arrays: Sequence[Any], key: Hashable, build: Callable[[], np.ndarray]) -> DeviceTable:
        """The DeviceTable for ``arrays`` (and ``key``): found by identity,
        else built with ``build()`` and uploaded unless a kept table has the
        same words (new array objects at the same addresses)."""
        with self.lock:
            facts = _current_facts(arrays, self.entries.entries())
            found = self.entries.find(lambda entry: entry.holds(arrays, key, facts))
            if found is not None:
                return found.uploaded
        host = np.ascontiguousarray(build(), np.int64).ravel()
        with self.lock:
            same = next((e for e in self.entries.entries() if _same_words(e.host, host)), None)
            if same is not None:
                uploaded = same.uploaded
            else:
                uploaded = self.runtime.upload_table(host, _purpose(self.plan_paths, "per-call"))
                self.alive.append(uploaded)
            self.entries.add(_TableEntry(arrays, key, host, uploaded))
            return uploaded

    def _evict(self, uploaded: DeviceTable) -> None:
        """Release a table no kept entry holds any more."""
        with self.lock:
            if uploaded not in self.alive or any(e.uploaded is uploaded for e in self.entries.entries()):
                return
            self.alive.remove(uploaded)
        self.runtime.release(uploaded)


def _evicting(evict: Callable[[], Callable[[DeviceTable], None] | None]) -> Callable[[_TableEntry], None]:
    """What an entry dropped from a plan's per-call tables does: ``evict``
    (weakly, so that the plan's going frees its tables at once) releases its
    table, unless the tables are gone already (their finaliser released them)."""
    def evicted(entry: _TableEntry) -> None:
        method = evict()
        if method is not None:
            method(entry.uploaded)
    return evicted


def _release_all(runtime: Runtime, tables: list[DeviceTable]) -> None:
    for uploaded in tables:
        runtime.release(uploaded)


def _purpose(paths: Sequence[str], which: str) -> str:
    """What a table upload is for, as a CaptureError names it."""
    return f"a call over the leaves {', '.join(paths)} (its {which} table)"


# Static tables per plan (weakly: they go when the plan goes) and device.
_tables_lock = threading.Lock()
_tables: weakref.WeakKeyDictionary[FlatPlan, dict[Hashable, _StaticTables]] = weakref.WeakKeyDictionary()
caches.register("static device tables", lambda: len(_tables), _tables.clear)


def _static_tables(plan: FlatPlan, runtime: Runtime) -> _StaticTables:
    per_device = _tables.get(plan)
    st = per_device.get(runtime.device_key) if per_device is not None else None
    if st is None:
        with _tables_lock:
            per_device = _tables.setdefault(plan, {})
            st = per_device.get(runtime.device_key)
            if st is None:
                st = per_device[runtime.device_key] = _StaticTables(plan, runtime)
    return st


# ---------------------------------------------------------------- per-call tables

# Every 61st word first: a prime stride meets every word of a row (an
# address among them) every few rows.
_SAMPLE_STRIDE = 61


def _same_words(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two host tables are equal. A sample of their words is
    compared first: a table of memory that moved differs there, and is told
    apart without reading all of its words (2.3 MB for 10,000 leaves).

    >>> a = np.arange(200)
    >>> _same_words(a, a.copy()), _same_words(a, a + (np.arange(200) == 150))
    (True, False)
    """
    return (a.shape == b.shape and np.array_equal(a[::_SAMPLE_STRIDE], b[::_SAMPLE_STRIDE])
            and np.array_equal(a, b))


def memory_order_row(row: list[int]) -> tuple[list[int], int]:
    """(``row``, a :func:`leaf_row`, read in memory order; the byte offset of
    its first element from the array's address): the contiguous row at the
    lowest address where the leaf's merged dims fill one dense block, else
    (``row``, 0).

    >>> row, start = memory_order_row(leaf_row((2, 3), (8, -16), np.float64))
    >>> row[:3], start
    ([3, 0, 6], -32)
    """
    ndim = row[1]
    if ndim == 0:
        return row, 0
    dtype = dtype_of_tag(row[0])
    start = dense_start(row[3 : 3 + ndim], row[3 + MAX_DIMS : 3 + MAX_DIMS + ndim], dtype.itemsize)
    if start is None:
        return row, 0
    return dense_row(row[2], dtype), start


def memory_order_rows(words: np.ndarray) -> np.ndarray:
    """A leaf table (address, then a :func:`leaf_row`, per row) whose rows are
    read in memory order (see :func:`memory_order_row`).

    >>> words = np.zeros((1, LEAF_ROW_WORDS), np.int64)
    >>> words[0, 0], words[0, 1:] = 1000, leaf_row((3,), (-4,), np.float32)
    >>> memory_order_rows(words)[0, :4].tolist()
    [992, 2, 0, 3]
    """
    out = np.array(words, np.int64)
    for i in np.flatnonzero(out[:, 2]).tolist():
        row, start = memory_order_row(out[i, 1:].tolist())
        out[i, 0] += start
        out[i, 1:] = row
    return out


def _leaf_rows(st: _StaticTables, plan: FlatPlan, arrays: Sequence[Any], slots: Sequence[int], runtime: Runtime,
               memory_order: bool = False) -> np.ndarray:
    """Host table (n, LEAF_ROW_WORDS) of ``arrays`` (``slots[i]`` is array i's
    slot), its rows read in memory order with ``memory_order`` (see
    :func:`memory_order_row`)."""
    sig: tuple[Any, ...] = (memory_order, *map(_sig, arrays))
    found = st.rows.find(sig)
    if found is None:
        rows = []
        for (shape, strides, dtype), slot in zip(sig[1:], slots):
            row = leaf_row(shape, strides, dtype)
            if row is None:
                raise ValueError(
                    f"leaf {plan.leaves[slot].path!r}: shape {shape} with strides {strides} keeps "
                    f"more than {MAX_DIMS} dimensions after merging; the CUDA kernels take at most "
                    f"{MAX_DIMS}: pass a contiguous copy"
                )
            rows.append(memory_order_row(row) if memory_order else (row, 0))
        template = np.zeros((len(rows), LEAF_ROW_WORDS), np.int64)
        if rows:
            template[:, 1:] = [row for row, _ in rows]
        # Each row's byte offset from its array's address to its first element read.
        found = template, np.array([start for _, start in rows], np.int64)
        st.rows.put(sig, found)
    template, starts = found
    table = template.copy()
    table[:, 0] = np.fromiter(map(runtime.pointer, arrays), np.int64, count=len(arrays)) + starts
    return table
