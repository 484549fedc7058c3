"""The public whole-tree operations.

Each function binds its trees (``gpuflat._src.binding``: one walk, the plan from
the cache), checks everything (``gpuflat._src.checks``), and only then hands a
backend the plan and arrays; in-place operations therefore change nothing when they raise.
Leaves may be NumPy, CuPy, PyTorch or JAX arrays: PyTorch and JAX leaves are
read through zero-copy views. Results come back in the caller's kinds: a
rebuilt tree (``re``, ``clip_by_global_norm``) has each leaf in the kind and
on the device of the leaf it replaces; a result standing for the whole tree
(a norm, a flat buffer) takes the kind of the tree's first PyTorch or JAX
leaf, and is NumPy or CuPy where there is none.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import arrays as _arrays
from . import checks
from . import dtensor
from . import caches, clipping, flatplan, ranks
from . import tree as _tree
from .backends.selection import select
from .binding import Call, clip_bound, gradients_of, in_place, norm_inputs, slot_sources, summed_wide
from .dtypes import cast_copy
from ..errors import OverlapError, TreeMismatchError, UnsupportedLeafError
from .flatplan import FlatPlan
from .layout import CLIP_EPS
from .overlap import first_sharing

if TYPE_CHECKING:
    from .seen import Verdicts

_NAMED_TOTALS = ("sumsq", "l1", "l2", "count")


def plan(tree: Any, *, backend: str | None = None) -> FlatPlan:
    """The FlatPlan of ``tree``'s structure, carrying ``tree``'s non-trainable values.

    The structure comes from the cache (a same-shaped tree gets an equal
    plan, and the backends' tables built for it); the cache itself keeps none
    of ``tree``'s values alive.

    ``backend`` is checked against the leaves: a tree mixing NumPy and CuPy
    arrays, or leaves the backend cannot reach, raise here already.

    >>> import numpy as np, gpuflat as gf
    >>> gf.plan_cache_clear()
    >>> m = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    >>> p = gf.plan(m)
    >>> gf.plan({"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}) is p
    True
    >>> gf.plan_cache_info()
    CacheInfo(hits=1, misses=1, size=1, maxsize=256)
    """
    call = Call(tree)
    call.backend(backend)
    return call.plan.with_statics(call.statics)


def plan_cache_info() -> flatplan.CacheInfo:
    """Hits, misses and size of the plan cache.

    >>> import gpuflat as gf
    >>> gf.plan_cache_info().maxsize
    256
    """
    return flatplan.cache.info()


def plan_cache_clear() -> None:
    """Empty the plan cache and reset its counters: plans only (see
    :func:`cache_clear` for every cache).

    >>> import gpuflat as gf
    >>> gf.plan_cache_clear(); gf.plan_cache_info().size
    0
    """
    flatplan.cache.clear()


def cache_clear() -> None:
    """Empty every cache gpuflat keeps: plans, trees seen, tables of
    addresses (releasing their device copies), facts read from tensors, the
    flat optimizers' step tables. The next calls find nothing and build
    again; nothing else changes.

    >>> import numpy as np, gpuflat as gf
    >>> _ = gf.global_norm({"w": np.ones(3)})
    >>> gf.cache_info()["plans"] > 0
    True
    >>> gf.cache_clear(); any(gf.cache_info().values())
    False
    """
    caches.clear()


def cache_info() -> dict:
    """{name: entries held} of every cache gpuflat keeps (each bounded by entries).

    >>> import gpuflat as gf
    >>> "plans" in gf.cache_info()
    True
    """
    return caches.sizes()


def trainables(tree: Any, *, path: bool = False, backend: str | None = None) -> list:
    """The unique trainable arrays of ``tree`` in walk order (ties once), as
    the caller's own objects (a PyTorch tensor stays that tensor).

    ``backend`` is only checked against the leaves (no computation happens).

    >>> import numpy as np, gpuflat as gf
    >>> w = np.ones(2)
    >>> tree = {"enc": {"w": w, "n": np.arange(3)}, "dec": w, "act": "relu"}
    >>> [p for p, _ in gf.trainables(tree, path=True)]
    ["['enc']['w']"]
    """
    call = Call(tree)
    call.backend(backend)
    own = [call.foreign.get(id(a), a) for a in call.unique]
    return list(zip(call.paths(), own)) if path else own


def destructure(tree: Any, *, backend: str | None = None) -> tuple[Any, "Restructure"]:
    """``(flat, re)``: the trainables in one 1-D buffer, and a Restructure rebuilding the tree.

    ``re(flat2)`` returns a new tree with every trainable rebuilt from
    ``flat2`` (any real or complex floating dtype), cast back to its dtype
    and shape, in the kind of the leaf it replaces (a NumPy leaf as NumPy, a
    tensor as a tensor on its device); tied arrays come back as one shared
    array; everything else is kept as it was in ``tree``. ``flat`` is in the
    kind of the tree's first PyTorch or JAX leaf.

    >>> import numpy as np, gpuflat as gf
    >>> a = np.array([1.0, 2.0])
    >>> flat, re = gf.destructure({"x": a, "y": (np.sin, np.float32([3])), "z": a})
    >>> flat, re
    (array([1., 2., 3.]), Restructure(dict, ..., 3))
    >>> m = re(flat * 10)
    >>> m["x"], m["x"] is m["z"], m["y"][0] is np.sin
    (array([10., 20.]), True, True)
    """
    call = Call(tree)
    be = call.backend(backend)
    with _arrays.device_scope(be, call.like):
        flat = be.empty(call.plan.size, call.plan.dtype)
        be.gather(call.plan, [[a] for a in call.unique], flat)
        flat = call.result(flat)
    return flat, Restructure(call.plan.with_statics(call.statics), call.owners(), backend)


class Restructure:
    """The second result of ``destructure``: called with a flat vector, it
    rebuilds the tree (as Optimisers.jl's ``Restructure`` and JAX's
    ``ravel_pytree`` unravel function do).

    It keeps the plan, which carries the destructured tree's non-trainable
    values, exactly as ``gf.unflatten`` takes them from a plan, and the
    caller's leaves only to give new leaves their kind and device.

    >>> import numpy as np, gpuflat as gf
    >>> flat, re = gf.destructure([np.ones(2, np.float32), "relu"])
    >>> re.plan.size, re(np.arange(2.0))
    (2, [array([0., 1.], dtype=float32), 'relu'])
    """

    __slots__ = ("plan", "_owners", "_backend")

    def __init__(self, plan: FlatPlan, owners: list, backend: str | None):
        self.plan, self._owners, self._backend = plan, owners, backend

    def __call__(self, flat: Any) -> Any:
        return _rebuild(self.plan, flat, self._owners, self._backend)

    def __repr__(self) -> str:
        root = self.plan.treedef
        name = root[1].__name__ if type(root) is tuple else "array"
        return f"Restructure({name}, ..., {self.plan.size})"


def flatten(plan: FlatPlan, tree: Any, *, out: Any = None, backend: str | None = None) -> Any:
    """Gather ``tree``'s arrays at ``plan``'s trainable places into one 1-D buffer.

    ``tree`` is the model itself or a gradient tree shaped like it: gradients
    of a tied array, found at several places, are added into its one slot;
    the same gradient object found twice counts once; None counts as zero
    (Optimisers.jl's destructure contract).

    ``out``, if given, must be a writable, C-contiguous buffer of exactly
    ``plan.size`` elements of ``plan.dtype`` sharing no memory with a leaf
    (a JAX array, immutable, is refused); the result is then ``out`` itself,
    the caller's object. Without it the result is a new buffer in the kind
    of the tree's first PyTorch or JAX leaf, if any.

    >>> import numpy as np, gpuflat as gf
    >>> a, b = np.zeros(2, np.float32), np.zeros(2, np.float32)
    >>> p = gf.plan({"x": a, "y": b, "z": a})
    >>> g = {"x": np.full(2, 3, np.float32), "y": None, "z": np.full(2, 13, np.float32)}
    >>> gf.flatten(p, g)
    array([16., 16.,  0.,  0.], dtype=float32)
    >>> out = np.empty(4, np.float32)
    >>> gf.flatten(p, g, out=out) is out
    True
    """
    sources, like, recorded = slot_sources(plan, tree)
    if recorded is not None:  # a recorded tree: one array per slot, its checks remembered
        seen, arrays = recorded
        return _gather(plan, sources, like, arrays, plan.paths.__getitem__, out, backend,
                       seen.verdicts(arrays) if out is not None else None)
    # Every gradient chooses the backend, not only the first of each slot: a
    # tied weight's NumPy and CuPy gradients must meet the mixed-kinds error.
    arrays = [a for s in sources for a in s]
    slot_at = [slot for slot, s in enumerate(sources) for _ in s]
    return _gather(plan, sources, like, arrays, lambda k: plan.leaves[slot_at[k]].path, out, backend)


def _gather(plan: FlatPlan, sources: Sequence[Sequence[Any]], like: Any, arrays: list[Any],
            path_of: Callable[[int], str], out: Any, backend: str | None, verdicts: Verdicts | None = None) -> Any:
    """``flatten``'s work once its ``arrays`` are known (every source,
    ``path_of(k)`` naming the k-th): they choose the backend and are checked
    apart from ``out`` (``verdicts``: a recorded tree's, see ``_refuse_aliases``)."""
    if out is None:
        be = select(backend, arrays, path_of)
        with _arrays.device_scope(be, like):
            flat = be.empty(plan.size, plan.dtype)
            be.gather(plan, sources, flat)
            return flat if like is None else _arrays.to_caller(flat, like)
    target = _writable_flat(plan, out, "out")
    _refuse_aliases(arrays, target, "out", path_of, verdicts)
    be = select(backend, arrays + [target], lambda i: "<out>" if i == len(arrays) else path_of(i))
    with _arrays.device_scope(be, like if like is not None else out):
        be.gather(plan, sources, target)
        return out


def unflatten(plan: FlatPlan, flat: Any, *, backend: str | None = None) -> Any:
    """A tree shaped like ``plan``'s whose trainables are rebuilt from ``flat``.

    Where ``flat`` has a leaf's dtype, the leaf is a zero-copy view into it;
    elsewhere a cast copy. Non-trainable values are those of the tree
    ``gf.plan`` was given.

    >>> import numpy as np, gpuflat as gf
    >>> p = gf.plan({"w": np.ones(3), "n": "relu"})
    >>> flat = np.arange(3.0)
    >>> m = gf.unflatten(p, flat)
    >>> m["w"].base is flat, m["n"]
    (True, 'relu')
    """
    given, flat = flat, _view(flat, "flat")
    checks.check_flat(plan, flat, exact_dtype=False)
    be = select(backend, [flat], lambda i: "<flat>")
    with _arrays.device_scope(be, given):
        views = _views_of(plan, flat)
    return _tree.rebuild(plan.treedef, [views[s] for s in plan.slot_of], plan.statics)


def scatter(plan: FlatPlan, flat: Any, tree: Any, *, backend: str | None = None) -> None:
    """Write ``flat`` into ``tree``'s own arrays, in place; returns None.

    ``flat`` may have any real or complex floating dtype: each slice is cast
    to its leaf's dtype. Every check happens before the first write, so a
    bad call changes nothing.

    >>> import numpy as np, gpuflat as gf
    >>> m = {"w": np.zeros(2, np.float32), "b": np.zeros(1)}
    >>> gf.scatter(gf.plan(m), np.array([1.0, 2.0, 3.0]), m)
    >>> m["w"], m["b"]
    (array([1., 2.], dtype=float32), array([3.]))
    """
    values, _, like, seen = checks.occurrences(plan, tree, allow_none=False)
    given, flat = flat, _view(flat, "flat")
    checks.check_flat(plan, flat, exact_dtype=False)
    if seen is not None and seen.ties_as(plan):
        # A recorded tree tied as the plan is, one array per slot: its checks are remembered.
        written = seen.unique(values)
        paths, verdicts = plan.paths, seen.verdicts(written)
        be = select(backend, written + [flat], lambda i: paths[i] if i < len(paths) else "<flat>")
        in_place.check(plan, paths, written, verdicts)
        _refuse_aliases(written, flat, "flat", paths.__getitem__, verdicts)
        with _arrays.device_scope(be, like if like is not None else given):
            be.scatter(plan, flat, written)
        return
    targets = [None] * len(plan.leaves)
    for slot, value in zip(plan.slot_of, values):
        targets[slot] = value if targets[slot] is None else targets[slot]
    be = select(backend, targets + [flat],
                lambda i: plan.leaves[i].path if i < len(plan.leaves) else "<flat>")
    # A broken tie (two arrays where the plan has one slot) is written at
    # both places, so every distinct array is checked before any write.
    written, written_paths, met = [], [], set()
    for path, value in zip(plan.occurrence_paths, values):
        if id(value) not in met:
            met.add(id(value))
            written.append(value)
            written_paths.append(path)
    in_place.check(plan, written_paths, written)
    _refuse_aliases(written, flat, "flat", written_paths.__getitem__)
    with _arrays.device_scope(be, like if like is not None else given):
        # The flat goes in its own dtype: the backends round each value once,
        # straight into the leaf's dtype (through the plan's dtype, float64 to
        # float16 would round twice).
        be.scatter(plan, flat, targets)
        for slot, value in zip(plan.slot_of, values):
            if value is not targets[slot]:
                value[...] = targets[slot]


def total(f: str | Callable[[Any], Any], tree: Any, *, model: Any = None, backend: str | None = None) -> Any:
    """The sum over unique trainables of ``f(leaf)``.

    ``f`` is any callable, or one of the fused reductions: "sumsq" (sum of
    squares), "l1" (sum of absolute values), "l2" (the sum of each leaf's
    2-norm, as Optimisers.jl's ``total(norm, model)``) and "count" (the
    number of trainable elements). With ``model=``, ``tree`` is a gradient
    tree read through the model's plan, one term per model slot: a slot's
    gradients (a tied weight may have several) are added in float64 first,
    and a slot whose gradient is None counts as zeros. A callable ``f`` then
    receives, per slot, the gradient itself where the slot has exactly one,
    else that sum (or zeros) cast once to the leaf's dtype, as a new array in
    the kind of the gradient tree's first PyTorch or JAX leaf.

    >>> import numpy as np, gpuflat as gf
    >>> model = {"x": np.array([3.0, 4.0]), "y": (np.sin, np.array([5.0])), "z": (6, 7)}
    >>> float(gf.total("l2", model)), gf.total("count", model)
    (10.0, 3)
    >>> float(gf.total(np.sum, model))
    12.0
    >>> model = {"a": np.ones(1), "b": np.ones(1), "c": np.ones(1)}
    >>> grads = {"a": np.array([3.0]), "b": np.array([4.0]), "c": None}
    >>> float(gf.total("l2", grads, model=model)), gf.total(len, grads, model=model)
    (7.0, 3)
    """
    if not callable(f) and f not in _NAMED_TOTALS:
        raise ValueError(f"total: expected a callable or one of {_NAMED_TOTALS}, got {f!r}")
    call = Call(tree)
    _refuse_dtensors(call, f"total({f!r})" if isinstance(f, str) else "total")
    if callable(f):
        return sum((f(x) for x in _callable_inputs(call, tree, model, backend)), 0)
    plan, leaves = norm_inputs(call, tree, model, backend)
    if f == "count":
        return plan.size
    be = select(backend, leaves, lambda i: plan.leaves[i].path)
    with _arrays.device_scope(be, call.like):
        if f == "l2":
            result = be.norms(plan, leaves, 2.0, per_leaf=True)
            return call.result(be.sum(result.per_leaf))
        result = be.norms(plan, leaves, 1.0 if f == "l1" else 2.0, per_leaf=False)
        # "sumsq" is the pass's own float64 sum of squares: squaring the rounded
        # 2-norm would round twice (three ones gave 2.9999999999999996).
        return call.result(result.total if f == "l1" else result.power_sum)


def global_norm(tree: Any, ord: float = 2, *, per_leaf: bool = False, model: Any = None,
                backend: str | None = None) -> Any:
    """The norm of all trainables taken as one vector: (sum |x|**p) ** (1/p).

    Accumulated in float64 whatever the leaf dtype, in a fixed order (the
    same bits on every repeat): a leaf filling one dense block of memory in
    another order than C's (transposed, channels_last) in memory order, any
    other in its logical order. Returns a 0-d float64 array on the leaves'
    device (a tensor for PyTorch leaves); with ``per_leaf=True``,
    ``(total, per_leaf_norms)`` from the same pass, the latter in plan order.
    With ``model=``, ``tree`` is a gradient tree read through the model's
    plan: the gradients of a tied weight are added before the norm. A tree
    of DTensors gives the norm over the ranks of their mesh
    (``gpuflat.distributed.global_norm``).

    >>> import numpy as np, gpuflat as gf
    >>> g = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]], np.float32)}
    >>> float(gf.global_norm(g)), float(gf.global_norm(g, ord=1)), float(gf.global_norm(g, np.inf))
    (5.0, 7.0, 4.0)
    >>> total, per = gf.global_norm(g, per_leaf=True)
    >>> per
    array([3., 4.])
    """
    p = checks.check_ord(ord)
    call = Call(tree)
    if _has_dtensors(call):
        _refuse_model(model, call)
        return ranks.global_norm(tree, ord, per_leaf=per_leaf, backend=backend)
    plan, leaves = norm_inputs(call, tree, model, backend)
    be = select(backend, leaves, lambda i: plan.leaves[i].path)
    with _arrays.device_scope(be, call.like):
        result = be.norms(plan, leaves, p, per_leaf)
        if per_leaf:
            return call.result(result.total), call.result(result.per_leaf)
        return call.result(result.total)


def clip_grad_norm_(grads: Any, max_norm: float, ord: float = 2, *, eps: float = CLIP_EPS,
                    error_if_nonfinite: bool = False, model: Any = None, backend: str | None = None) -> Any:
    """Scale every gradient in place by min(1, max_norm / (norm + eps)); return the norm.

    PyTorch's semantics: the factor is always applied (no branch on a device
    value, so no host synchronisation on a GPU); a NaN norm makes the
    gradients NaN. With ``error_if_nonfinite`` a NaN or inf norm raises
    NonFiniteError naming the first leaf holding one, and nothing is scaled.
    With ``model=``, the gradients of a tied weight are added for the norm
    (as ``flatten`` adds them) and every occurrence is scaled by the factor.
    DTensor gradients are clipped by their norm over the ranks of their mesh
    (``gpuflat.distributed.clip_grad_norm_``).

    >>> import numpy as np, gpuflat as gf
    >>> g = {"w": np.array([3.0, 4.0]), "b": np.zeros(1, np.float32)}
    >>> float(gf.clip_grad_norm_(g, 1.0))
    5.0
    >>> g["w"].round(6)
    array([0.6, 0.8])

    A ``torch.nn.Module``, or a tree of tensors that require grad (a list of
    parameters), stands for its parameters' ``.grad``, as in
    ``torch.nn.utils.clip_grad_norm_``: the gradients are clipped (None ones
    skipped) and their norm returned; the weights are never touched.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.ones(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> float(gf.clip_grad_norm_([w], 1.0)), w.tolist()
    (5.0, [1.0, 1.0])
    """
    max_norm, p, eps = checks.clip_arguments(max_norm, ord, eps)
    call = Call(grads)
    # Parameters are leaf tensors that require grad; gradients made with
    # create_graph=True require grad too but are not leaves, and stay gradients.
    if any(getattr(own, "requires_grad", False) and own.is_leaf for own in call.foreign.values()):
        grads = gradients_of(call)
        call = Call(grads)
    if _has_dtensors(call):
        _refuse_model(model, call)
        return ranks.clip_grad_norm_(grads, max_norm, ord, eps=eps, error_if_nonfinite=error_if_nonfinite,
                                     backend=backend)
    return clipping.clip_(clip_bound(call, grads, model, backend), max_norm, p, eps, error_if_nonfinite)


def clip_by_global_norm(tree: Any, max_norm: float, ord: float = 2, *, eps: float = CLIP_EPS,
                        backend: str | None = None) -> tuple[Any, Any]:
    """``(clipped, norm)``: a new tree whose trainables are scaled by
    min(1, max_norm / (norm + eps)); the input is left untouched.

    The functional form of :func:`clip_grad_norm_`, for arrays that cannot
    be written in place (JAX's) or when the original must be kept. Ties stay
    ties; each clipped leaf is of its input leaf's kind; non-trainable values
    are kept as they are. The norm is in the kind of the first PyTorch or JAX
    leaf.

    >>> import numpy as np, gpuflat as gf
    >>> g = {"w": np.array([3.0, 4.0]), "step": 7}
    >>> clipped, norm = gf.clip_by_global_norm(g, 1.0)
    >>> clipped["w"].round(6), float(norm), g["w"]
    (array([0.6, 0.8]), 5.0, array([3., 4.]))
    """
    max_norm, p, eps = checks.clip_arguments(max_norm, ord, eps)
    call = Call(tree)
    _refuse_dtensors(call, "clip_by_global_norm")
    be = call.backend(backend)
    with _arrays.device_scope(be, call.like):
        copies = [be.copy(a) for a in call.unique]
        # The norm of the originals, the scale of the copies: the input stays untouched.
        bound = clipping.Bound([clipping.Part(call.plan, call.unique, be, call.like)],
                               [clipping.Part(call.plan, copies, be, call.like)])
        norm = clipping.clip_(bound, max_norm, p, eps, False)
        leaves = _in_kinds(copies, call.owners())
    clipped = _tree.rebuild(call.plan.treedef, [leaves[s] for s in call.plan.slot_of], call.statics)
    return clipped, norm


# ---------------------------------------------------------------- helpers

def _in_kinds(arrays: Sequence[Any], owners: Sequence[Any]) -> list[Any]:
    """Each array in the kind (and on the device) of its slot's caller leaf;
    a DTensor's local shard back in a DTensor of the same placements."""
    return [a if own is None else dtensor.like(_arrays.to_caller(a, own), own) for a, own in zip(arrays, owners)]


def _has_dtensors(call: Call) -> bool:
    return any(map(dtensor.is_dtensor, call.foreign.values()))


def _refuse_model(model: Any, call: Call) -> None:
    if model is not None:
        raise TypeError(f"leaf {dtensor.first_path(call.owners(), call.paths())!r}: model= expected gradients "
                        f"held whole, found a DTensor; pass the DTensor gradients without model= (their "
                        f"placements say how to count them)")


def _refuse_dtensors(call: Call, what: str) -> None:
    """TypeError naming the first DTensor leaf, for a reduction whose value
    over the ranks gpuflat does not compute: the local shards' would mislead."""
    path = dtensor.first_path(call.owners(), call.paths())
    if path is not None:
        raise TypeError(f"leaf {path!r}: {what} expected arrays held whole, found a DTensor, of which this "
                        f"rank holds a shard; use gf.global_norm or gf.clip_grad_norm_, which reduce "
                        f"over its mesh")


def _rebuild(plan: FlatPlan, flat: Any, owners: Sequence[Any], backend: str | None) -> Any:
    flat = _view(flat, "flat")
    checks.check_flat(plan, flat, exact_dtype=False)
    leaves = _new_leaves(plan, flat, backend, owners)
    return _tree.rebuild(plan.treedef, [leaves[s] for s in plan.slot_of], plan.statics)


def _new_leaves(plan: FlatPlan, flat: Any, backend: str | None, owners: Sequence[Any]) -> list[Any]:
    """New arrays shaped like ``plan``'s slots, holding ``flat`` cast to their
    dtypes, each in the kind of its slot's owner (see ``_in_kinds``)."""
    be = select(backend, [flat], lambda i: "<flat>")
    with _arrays.device_scope(be, next((own for own in owners if own is not None), None)):
        leaves = [be.empty(leaf.shape, leaf.dtype) for leaf in plan.leaves]
        be.scatter(plan, flat, leaves)
        return _in_kinds(leaves, owners)


def _views_of(plan: FlatPlan, flat: Any) -> list[Any]:
    """Each slot of ``flat`` as its leaf: a view where the dtype matches, else a cast copy."""
    views = []
    for leaf in plan.leaves:
        piece = flat[leaf.offset : leaf.offset + leaf.size]
        if leaf.dtype != flat.dtype and leaf.dtype.kind != "c" and flat.dtype.kind == "c":
            piece = piece.real  # complex to real keeps the real part, without NumPy's warning
        views.append(piece.reshape(leaf.shape) if leaf.dtype == flat.dtype else
                     _cast(piece, leaf.dtype).reshape(leaf.shape))
    return views


def _cast(piece: Any, dtype: np.dtype) -> Any:
    """A copy of ``piece`` as ``dtype``, rounded once as the backends round."""
    if not isinstance(piece, np.ndarray):
        return piece.astype(dtype)  # CuPy casts on the device, in one rounding
    out = np.empty(piece.shape, dtype)
    cast_copy(out, piece)  # ml_dtypes' astype rounds float64 to bfloat16 twice
    return out


def _view(x: Any, name: str) -> Any:
    """A NumPy or CuPy view of a flat buffer given as any supported kind."""
    if isinstance(x, _tree._array_types()):
        return x
    try:
        adopted = _arrays.adopt(x)
    except UnsupportedLeafError as e:
        raise TreeMismatchError(f"{name}: {e}") from None
    if adopted is None:
        raise TreeMismatchError(f"{name}: expected a 1-D array, got {type(x).__name__}")
    return adopted


def _writable_flat(plan: FlatPlan, x: Any, name: str) -> Any:
    """The NumPy or CuPy view of a flat buffer about to be written, checked:
    JAX arrays (immutable) and read-only arrays are refused, naming ``name``."""
    if _arrays.kind(x) == "jax":
        raise TreeMismatchError(f"{name}: expected a writable array, got a JAX array, which is "
                                f"immutable; leave {name} out to get a new array")
    view = _view(x, name)
    checks.check_flat(plan, view, name)
    # CuPy arrays have no writeable flag: device memory is always writable.
    if not getattr(view.flags, "writeable", True):
        raise TreeMismatchError(f"{name}: expected a writable array, got a read-only one")
    return view


def _refuse_aliases(arrays: Sequence[Any], buffer: Any, name: str, path_of: Callable[[int], str],
                    verdicts: Verdicts | None = None) -> None:
    """OverlapError naming the first array (``path_of(i)``, only on error)
    sharing memory with ``buffer``: the kernels would read it after writing over it.

    ``verdicts``: those of the recorded tree whose unique arrays ``arrays``
    are (``SeenTree.verdicts``); they keep the buffer last found apart from
    them, while neither changes."""
    if verdicts is not None and verdicts.apart_from(buffer):
        return
    shared = first_sharing(arrays, buffer)
    if shared is not None:
        raise OverlapError(f"leaf {path_of(shared)!r} and {name} share memory; expected {name} "
                           f"apart from every leaf, found them overlapping (pass a separate buffer)")
    if verdicts is not None:
        verdicts.found_apart(buffer)


def _callable_inputs(call: Call, grads: Any, model: Any, backend: str | None) -> list[Any]:
    """What a callable ``f`` of ``total`` receives, one value per slot."""
    if model is None:
        return [call.foreign.get(id(a), a) for a in call.unique]
    plan = Call(model).plan
    sources, _, _ = slot_sources(plan, grads, call.walked, call.seen)
    owners = [None] * len(plan.leaves)
    for slot, value in zip(plan.slot_of, _tree.arrays_like(plan.treedef, grads)):
        owners[slot] = value if owners[slot] is None else owners[slot]
    if all(len(s) == 1 for s in sources):
        return owners
    summed = _new_leaves(plan, summed_wide(plan, sources, backend, call.like), backend,
                         [call.like] * len(plan.leaves))
    return [owner if len(s) == 1 else new for owner, s, new in zip(owners, sources, summed)]
