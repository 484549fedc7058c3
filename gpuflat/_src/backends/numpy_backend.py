"""The NumPy backend: the same operations as the CUDA kernels, on the host.

Norms accumulate in float64 whatever the leaf dtype: leaves are converted
in pieces of at most PIECE elements (small leaves packed together, large ones
cut), so the float64 copy stays in cache and memory use stays flat. Pieces are
fixed by the plan's leaves (their sizes and kinds alone), so every repeat,
and every front end handing the same leaves, adds the same numbers in the
same order. It is not the kernels' order (kernels/norms.cu): BLAS dots and
an exact sum of the pieces' partials, whose bits the other backends do not
reproduce.
Norms and clips read a leaf that fills one dense block of memory in another
order than C's (transposed, channels_last, reversed) in memory order, as the
1-D view of that block (``gpuflat._src.memory_order``); any other leaf in its
logical order.
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuflat._src import caches
from gpuflat._src.dtypes import cast_copy, dtype_of_tag
from gpuflat._src.layout import (HYPER, NORMS, RULES, TAG_OF_NAME, NormKind, norm_kind, precision_of, stochastic_bits,
                                 store)
from gpuflat._src.memory_order import in_memory_order

from .protocol import NormResult

if TYPE_CHECKING:
    from gpuflat._src.flatplan import FlatPlan

PIECE = 1 << 15  # elements per float64 piece: 256 KiB, a comfortable L2 fit
# OpenBLAS computes a dot product of at most 10,000 elements on the calling
# thread; a longer one wakes its thread pool, which stalls for milliseconds on
# a busy machine. Dots of DOT elements stay on one thread, in a fixed order.
DOT = 8192


# Per-plan piece layouts; a dropped plan drops its entry.
_layouts: weakref.WeakKeyDictionary[FlatPlan, tuple[tuple[int, int, int, bool], ...]] = weakref.WeakKeyDictionary()
caches.register("NumPy piece layouts", lambda: len(_layouts), _layouts.clear)


def _layout(plan: FlatPlan) -> tuple[tuple[int, int, int, bool], ...]:
    """Pieces of the plan: (first slot, end slot, element count, complex?), memoised per plan.

    A piece is either a run of consecutive small slots of one kind (real or
    complex) packed together, or one large slot on its own.
    """
    layout = _layouts.get(plan)
    if layout is not None:
        return layout
    # kind starts False: it is read only once the first slot has set it.
    pieces: list[tuple[int, int, int, bool]] = []
    start, count, kind = 0, 0, False
    for s, leaf in enumerate(plan.leaves):
        is_complex = leaf.dtype.kind == "c"
        if s > start and (count + leaf.size > PIECE or is_complex != kind):
            pieces.append((start, s, count, kind))
            start, count = s, 0
        kind = is_complex
        count += leaf.size
    if start < len(plan.leaves):
        pieces.append((start, len(plan.leaves), count, kind))
    _layouts[plan] = layout = tuple(pieces)
    return layout


class HostMemory:
    """Allocation and the small array operations of the backends whose memory is the host's.

    >>> HostMemory().copy(np.arange(6.0).reshape(2, 3).T).flags.c_contiguous
    True
    """

    def empty(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.empty(shape, dtype)

    def zeros(self, shape: int | tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.zeros(shape, dtype)

    def copy(self, x: Any) -> np.ndarray:
        return np.array(x, copy=True, order="C")

    def sum(self, x: Any) -> Any:
        return np.sum(x)


class NumpyBackend(HostMemory):
    """Whole-tree operations on NumPy arrays (the default for NumPy trees)."""

    name = "numpy"
    xp = np
    reads_rows = False  # reads leaves as arrays only: LeafRows would need native code

    def gather(self, plan: FlatPlan, sources: Sequence[Sequence[Any]], out: Any) -> None:
        if not sources:  # an empty tree: np.concatenate refuses an empty list
            return
        if all(len(s) == 1 for s in sources):
            # One C loop over all leaves; axis=None flattens any strides.
            np.concatenate([s[0] for s in sources], axis=None, out=out, casting="unsafe")
            return
        acc_dtype = np.complex128 if plan.dtype.kind == "c" else np.float64
        for leaf, srcs in zip(plan.leaves, sources):
            target = out[leaf.offset : leaf.offset + leaf.size]
            if len(srcs) == 1:
                cast_copy(target, srcs[0].reshape(-1))
                continue
            acc = np.zeros(leaf.size, acc_dtype)
            for src in srcs:  # added in occurrence order, as the kernel does
                acc += src.reshape(-1)
            cast_copy(target, acc)

    def scatter(self, plan: FlatPlan, flat: Any, leaves: Sequence[Any]) -> None:
        for leaf, target in zip(plan.leaves, leaves):
            cast_copy(target, flat[leaf.offset : leaf.offset + leaf.size].reshape(leaf.shape))

    def norms(self, plan: FlatPlan, leaves: Sequence[Any], ord: float, per_leaf: bool) -> NormResult:
        """Fused norms, a dense-permuted leaf summed in memory order.

        >>> import numpy as np, gpuflat as gf
        >>> leaves = [np.array([[3.0, 0.0], [4.0, 12.0]]).T]
        >>> r = NumpyBackend().norms(gf.plan(leaves), leaves, 2, per_leaf=True)
        >>> float(r.total), r.per_leaf
        (13.0, array([13.]))
        """
        # Past float64, powers and roots give inf silently, as the kernels do.
        with np.errstate(over="ignore"):
            return self._norms(plan, list(map(in_memory_order, leaves)), float(ord), per_leaf)

    def _norms(self, plan: FlatPlan, leaves: list[np.ndarray], p: float, per_leaf: bool) -> NormResult:
        kind = NORMS[norm_kind(p)]
        sums = np.zeros(len(plan.leaves))
        partials = []
        for first, end, count, is_complex in _layout(plan):
            acc_dtype = np.complex128 if is_complex else np.float64
            packed = per_leaf and end - first > 1
            for values in _chunks(leaves, first, end, count, acc_dtype):
                # The total always comes from the chunk partials, so per_leaf=True
                # and False (global_norm and clip_grad_norm_) give the same bits.
                part, contrib = _partial(values, kind, p, keep=packed)
                partials.append(part)
                if packed:
                    assert contrib is not None  # kept: _partial gives it with keep
                    _per_slot(plan, first, end, contrib, kind, sums)
                elif per_leaf:
                    sums[first] = kind.combine(sums[first], part)
        raw = _combine(np.asarray(partials, np.float64), kind)
        total = kind.root(raw, p)
        per = kind.root(sums, p) if per_leaf else None
        bad = -1 if math.isfinite(total) else _first_nonfinite(leaves)
        return NormResult(np.asarray(total), per, np.asarray(bad, np.int64), np.asarray(raw))

    def clip_(self, plan: FlatPlan, leaves: Sequence[Any], total: Any, max_norm: Any, eps: float,
              flat: Any = None) -> None:
        # A NaN or inf norm scales to NaN, PyTorch's semantics, without
        # NumPy's warnings: the caller asked for exactly that.
        with np.errstate(invalid="ignore", over="ignore"):
            coef = _clip_coef(total, max_norm, eps)
            # Never all of ``flat``: a resident model's padding stays zero.
            for target in map(in_memory_order, leaves):
                _scale(target, coef)

    # Host memory needs no device context: the protocol's on_device() makes
    # an empty one, directly (no call of this backend's per step).
    on_device = staticmethod(contextlib.nullcontext)

    def to_host(self, x: Any) -> np.ndarray:
        return np.asarray(x)

    def step_(self, rule: str, plan: FlatPlan, params: np.ndarray, grads: np.ndarray, states: Sequence[np.ndarray],
              slot_group: np.ndarray, hyper: np.ndarray, steps: np.ndarray, total: Any, max_norm: float, eps: float,
              amp: np.ndarray) -> None:
        """One optimizer update of a flat buffer, slot by slot: the kernels'
        operations in the same order and precision (the reference).

        >>> import numpy as np, gpuflat as gf
        >>> p, g, buf = np.ones(2), np.full(2, 4.0), np.zeros(2)
        >>> hyper = np.array([0.5, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0])
        >>> NumpyBackend().step_("sgd", gf.plan([p]), p, g, (buf,), np.zeros(1, np.int64), hyper,
        ...                      np.ones(1), np.asarray(8.0), 2.0, 0.0, np.array([1.0, 0.0]))
        >>> p, buf
        (array([0.5, 0.5]), array([1., 1.]))
        """
        if amp[1] != 0.0:  # a loss scaler found NaN or inf: skip
            return
        update = RULES[rule].numpy
        assert update is not None, f"every rule has a NumPy reference; {rule!r} has none"
        compute = np.float64 if params.dtype == np.float64 else np.float32
        factor = (1.0 if total is None else _clip_factor(total, max_norm, eps)) * float(amp[0])
        with np.errstate(all="ignore"):  # NaN and inf follow IEEE rules, as in the kernels
            for slot, leaf in enumerate(plan.leaves):
                group = int(slot_group[slot])
                if group < 0:
                    continue
                part = slice(leaf.offset, leaf.offset + leaf.size)
                update(params[part], grads[part], [s[part] for s in states],
                       [float(x) for x in hyper[group * HYPER : (group + 1) * HYPER]],
                       float(steps[slot]), factor, compute)

    def step_rows(self, rule: str, tag: int, rows: np.ndarray, hyper: np.ndarray, lr_at: np.ndarray, total: Any,
                  max_norm: float, eps: float, amp: np.ndarray, stats: np.ndarray | None = None) -> None:
        """One optimizer update of parameters where they are (host memory),
        row by row: the kernels' operations in the same order and precision.
        With ``stats`` (float64, one row of two per parameter row), the
        reference of the update statistics: each row's update runs on a
        compute-type copy of the value it starts from (the same bits for the
        parameter and its state), and row j of ``stats`` takes the sums of
        d**2 and w**2 in float64 (w the value produced, d = w - held in the
        compute type); zeros for a skipped step.

        >>> p, g, buf = np.ones(2, np.float32), np.full(2, 4.0, np.float32), np.zeros(2, np.float32)
        >>> count = np.zeros(1, np.float32)   # the buffer's updates: 0, so it is new
        >>> rows = np.array([[p.ctypes.data, g.ctypes.data, buf.ctypes.data, 0, 0, 0, count.ctypes.data, 2, 0, 0]])
        >>> NumpyBackend().step_rows("sgd", 2, rows, np.array([0.5, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0]),
        ...                          np.zeros(2, np.int64), None, 0.0, 0.0, np.array([0.25, 0.0]))
        >>> p, buf, count
        (array([0.5, 0.5], dtype=float32), array([1., 1.], dtype=float32), array([1.], dtype=float32))
        >>> stats = np.full((1, 2), np.nan)
        >>> NumpyBackend().step_rows("sgd", 2, rows, np.array([0.5, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0]),
        ...                          np.zeros(2, np.int64), None, 0.0, 0.0, np.array([0.25, 0.0]), stats)
        >>> stats.round(6)   # p moved by -0.5 * (0.9 * 1 + 1) to -0.45: (2 * 0.95**2, 2 * 0.45**2)
        array([[1.805, 0.405]])
        """
        RULES[rule].check_rows(rows, hyper)
        if stats is not None:
            _check_stats(stats, len(rows))
        if amp[1] != 0.0:  # a loss scaler found NaN or inf: skip, steps uncounted
            if stats is not None:
                stats[...] = 0.0
            return
        factor = (1.0 if total is None else _clip_factor(total, max_norm, eps)) * float(amp[0])
        _rows_step(rule, dtype_of_tag(tag), np.asarray(rows, np.int64), hyper, lr_at, factor, stats)


def _check_stats(stats: Any, n_rows: int) -> None:
    """Refuse ``stats`` unless it is a C-contiguous float64 array of shape (``n_rows``, 2).

    >>> _check_stats(np.zeros((3, 2), np.float32), 3)
    Traceback (most recent call last):
    ...
    ValueError: stats: expected a C-contiguous float64 array of shape (3, 2), got float32 of shape (3, 2)
    """
    if stats.shape != (n_rows, 2) or stats.dtype != np.float64 or not stats.flags.c_contiguous:
        raise ValueError(f"stats: expected a C-contiguous float64 array of shape ({n_rows}, 2), got {stats.dtype} "
                         f"of shape {tuple(stats.shape)}" + ("" if stats.flags.c_contiguous else ", not contiguous"))


def _at(address: int, dtype: Any, n: int) -> np.ndarray:
    """The ``n`` elements of ``dtype`` at ``address`` (host memory), as a writable view."""
    dtype = np.dtype(dtype)
    return np.frombuffer((ctypes.c_byte * (n * dtype.itemsize)).from_address(address), dtype) if n else \
        np.empty(0, dtype)


def _rows_step(rule: str, dtype: np.dtype, rows: np.ndarray, hyper: np.ndarray, lr_at: np.ndarray, factor: float,
               stats: np.ndarray | None = None) -> None:
    """The reference of the kernels' update over a parameter table (gpuflat_adamw_rows /
    gpuflat_sgd_rows / gpuflat_rule_mixed_rows, then gpuflat_count_steps), one row at a time;
    with ``stats``, row j's update statistics in stats[j] (_kept_update)."""
    rule_of = RULES[rule]
    update = rule_of.numpy
    assert update is not None, f"every rule has a NumPy reference; {rule!r} has none"
    compute = np.float64 if dtype == np.float64 else np.float32
    counted = []
    with np.errstate(all="ignore"):  # NaN and inf follow IEEE rules, as in the kernels
        for j, (param, grad, s0, s1, s2, extra, step_at, numel, group, precision) in enumerate(rows.tolist()):
            h = [float(x) for x in hyper[group * HYPER : (group + 1) * HYPER]]
            if lr_at[2 * group]:
                h[0] = float(_at(int(lr_at[2 * group]), dtype_of_tag(int(lr_at[2 * group + 1])), 1)[0])
            state_dtypes, keep, key = precision_of(precision)
            # A stochastically rounded row counts every step: its draws are keyed by the count.
            counts = step_at != 0 and (rule_of.counted_field < 0 or h[rule_of.counted_field] != 0.0
                                       or keep == "stochastic")
            # The count after this step; a row that does not count takes 1 (SGD
            # without momentum reads none).
            step = float(_at(step_at, np.float32, 1)[0]) + 1.0 if counts else 1.0
            states = [_at(s, dtype if name is None else dtype_of_tag(TAG_OF_NAME[name]), numel) if s else None
                      for s, name in zip((s0, s1, s2), state_dtypes)]
            _kept_update(update, keep, key, _at(param, dtype, numel),
                         _at(extra, np.float32 if keep == "master" else dtype, numel) if extra else None,
                         _at(grad, dtype, numel), states, h, step, factor, compute,
                         None if stats is None else stats[j])
            if counts:
                counted.append(step_at)
    for step_at in counted:
        _at(step_at, np.float32, 1)[0] += np.float32(1.0)


def _kept_update(update: Any, keep: str, key: int, p: np.ndarray, extra: np.ndarray | None, g: np.ndarray,
                 states: list[Any], h: list[float], step: float, factor: float, compute: Any,
                 stats: np.ndarray | None = None) -> None:
    """A rule's ``update`` of one row, its parameter kept as ``keep`` says
    (gpuflat._src.layout.KEEPS): updated in place, through its float32
    master copy ``extra``, through parameter + compensation ``extra``, or
    rounded stochastically with draws keyed by ``key`` and ``step``. With
    ``stats`` (two float64), the update runs on a compute-type copy of the
    value it starts from (the rule rounds into storage once either way, so
    the bits are the same), and ``stats`` takes the sums of d**2 and w**2
    (``_update_stats``)."""
    if keep == "plain":
        if stats is None:
            update(p, g, states, h, step, factor, compute)
            return
        value = p.astype(compute)
        update(value, g, states, h, step, factor, compute)
        _update_stats(stats, p.astype(compute), value)
        store(p, value)
        return
    if keep == "stochastic":
        value = p.astype(compute)
        update(value, g, states, h, step, factor, compute)
        if stats is not None:
            _update_stats(stats, p.astype(compute), value)
        _store_stochastically(p, value, key, step)
        return
    assert extra is not None, "Rule.check_rows refuses a row kept beside its parameter without the address"
    if keep == "master":
        if stats is None:
            update(extra, g, states, h, step, factor, compute)
        else:
            value = extra.astype(compute)
            update(value, g, states, h, step, factor, compute)
            _update_stats(stats, extra.astype(compute), value)
            store(extra, value)
        store(p, extra)
        return
    value = p.astype(compute) + extra.astype(compute)
    held = value.copy() if stats is not None else None
    update(value, g, states, h, step, factor, compute)
    if held is not None and stats is not None:
        _update_stats(stats, held, value)
    store(p, value)
    store(extra, value - p.astype(compute))


def _update_stats(out: np.ndarray, held: np.ndarray, w: np.ndarray) -> None:
    """``out`` = (sum of d**2, sum of w**2) in float64, d = w - held in
    their compute type: the update statistics of one row.

    >>> out = np.zeros(2)
    >>> _update_stats(out, np.array([1.0, 2.0], np.float32), np.array([1.5, 1.0], np.float32))
    >>> out
    array([1.25, 3.25])
    """
    out[0] = _sum_of_squares((w - held).astype(np.float64))
    out[1] = _sum_of_squares(w.astype(np.float64))


def _sum_of_squares(x: np.ndarray) -> float:
    """sum x**2 of a float64 array: dots of DOT elements (one thread each,
    see DOT), added exactly."""
    return math.fsum(np.dot(x[i : i + DOT], x[i : i + DOT]) for i in range(0, x.size, DOT))


def _store_stochastically(target: np.ndarray, x: np.ndarray, key: int, step: float) -> None:
    """Float32 ``x`` rounded into bfloat16 ``target`` up or down at random
    (gf_store_stochastic): ``stochastic_bits`` added below the 16 bits kept,
    then truncated, so that a value a quarter of the way to the next one up
    rounds up a quarter of the time; NaN and inf rounded to nearest.

    >>> bf16 = dtype_of_tag(TAG_OF_NAME["bfloat16"])
    >>> out = np.zeros(4096, bf16)
    >>> _store_stochastically(out, np.full(4096, 1.0 + 2**-9, np.float32), 7, 1)
    >>> sorted(set(out.astype(np.float64).tolist())), 0.2 < float(np.mean(out.astype(np.float64) > 1)) < 0.3
    ([1.0, 1.0078125], True)
    """
    if target.dtype.name != "bfloat16":  # the layout keeps bfloat16 parameters only this way
        store(target, x)
        return
    x = np.asarray(x, np.float32)
    drawn = ((x.view(np.uint32) + stochastic_bits(key, int(step), np.arange(x.size))) >> np.uint32(16))
    nearest = x.astype(target.dtype).view(np.uint16)
    target.view(np.uint16)[...] = np.where(np.isfinite(x), drawn.astype(np.uint16), nearest)


def _scale(target: np.ndarray, coef: Any) -> None:
    """target *= coef in PyTorch's precision, as the CUDA kernel does.

    The factor is cast to float32 for 16- and 32-bit leaves and to float64
    for 64-bit ones; complex leaves scale their real and imaginary parts.
    """
    wide = target.dtype.itemsize == 8 and target.dtype.kind == "f" or target.dtype.itemsize == 16
    factor = np.float64(coef) if wide else np.float32(coef)
    for part in (target.real, target.imag) if target.dtype.kind == "c" else (target,):
        np.multiply(part, factor, out=part, casting="unsafe")


def _clip_coef(total: Any, max_norm: Any, eps: float) -> Any:
    # PyTorch's clip_grad_norm_: the factor is clamped to 1 and always applied;
    # a NaN norm gives a NaN factor, as there.
    return np.minimum(np.float64(max_norm) / (np.float64(total) + eps), 1.0)


def _chunks(leaves: list[np.ndarray], first: int, end: int, count: int, acc_dtype: Any) -> Iterator[np.ndarray]:
    """The values of a piece as float64 (or complex128) arrays of at most PIECE elements.

    A large leaf is converted chunk by chunk into one reused scratch buffer,
    so it costs PIECE elements of memory and stays in cache.
    """
    if end - first == 1:
        # np.asarray: an ndarray subclass such as np.matrix stays 2-D under reshape(-1).
        values = np.asarray(leaves[first]).reshape(-1)
    else:
        buf = np.empty(count, acc_dtype)
        np.concatenate(leaves[first:end], axis=None, out=buf, casting="unsafe")
        yield buf
        return
    scratch = np.empty(min(count, PIECE), acc_dtype)
    for lo in range(0, count, PIECE):
        chunk = values[lo : lo + PIECE]
        out = scratch[: chunk.size]
        np.copyto(out, chunk, casting="unsafe")
        yield out


def _partial(values: np.ndarray, kind: NormKind, p: float, keep: bool = False) -> tuple[float, np.ndarray | None]:
    """(one chunk's terms combined: sum of |x|**p, or max |x| for p = inf;
    its terms if ``keep``, else possibly None). May overwrite ``values``."""
    if kind.sum_of_squares and values.dtype.kind == "f":
        part = math.fsum(np.dot(values[i : i + DOT], values[i : i + DOT])
                         for i in range(0, values.size, DOT))
        return part, (kind.terms(values, p) if keep else None)
    contrib = kind.terms(values, p)
    if not contrib.size:
        return 0.0, contrib
    return float(getattr(contrib, kind.fold)()), contrib


def _per_slot(plan: FlatPlan, first: int, end: int, contrib: np.ndarray, kind: NormKind, sums: np.ndarray) -> None:
    """Combine a packed piece's terms into each of its slots' sums."""
    sizes = [leaf.size for leaf in plan.leaves[first:end]]
    starts = np.cumsum([0] + sizes[:-1])
    nonempty = np.flatnonzero(sizes)
    if len(nonempty):
        sums[first + nonempty] = kind.combine.reduceat(contrib, starts[nonempty])


def _combine(partials: np.ndarray, kind: NormKind) -> float:
    """The unrooted total: sum |x|**p, or the max for ord inf. math.fsum
    adds finite partials exactly, in any order (a max is exact in any order)."""
    if kind.combine is np.add and np.isfinite(partials).all():
        return math.fsum(partials)
    return float(getattr(partials, kind.fold)()) if len(partials) else 0.0


def _first_nonfinite(leaves: Sequence[np.ndarray]) -> int:
    for i, a in enumerate(leaves):
        if a.size and not np.isfinite(a).all():
            return i
    return -1



def _clip_factor(total: Any, max_norm: Any, eps: float) -> float:
    # kernels/gpuflat_optim.cuh (gf_grad_factor): min(1, max_norm / (total + eps)) with NaN kept.
    c = np.float64(max_norm) / (np.float64(total) + np.float64(eps))
    return 1.0 if c > 1.0 else float(c)


