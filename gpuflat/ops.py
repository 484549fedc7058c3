"""The public whole-tree operations: trainables, destructure, total, norms, clipping.

Each function walks the tree once (the plan comes from the cache), checks
everything, and only then hands flat tables to a backend (#2). In-place
operations validate before their first write, so a failed call changes
nothing (#5).
"""
from __future__ import annotations

import math
import weakref

from . import tree as _tree
from .backends.base import check_ord, select
from .errors import NonFiniteError, TreeMismatchError
from .overlap import check_no_overlap
from .plan import occurrences, plan_and_arrays

_NAMED_TOTALS = ("sumsq", "l1", "l2", "count")


def _backend_for(plan, arrays, backend):
    return select(backend, arrays, lambda i: plan.leaves[i].path)


def trainables(tree, *, path=False, backend=None):
    """The unique trainable arrays of ``tree`` in walk order (ties once).

    ``backend`` is only checked against the leaves (no computation happens).

    >>> import numpy as np, gpuflat as gf
    >>> w = np.ones(2)
    >>> tree = {"enc": {"w": w, "n": np.arange(3)}, "dec": w, "act": "relu"}
    >>> [p for p, _ in gf.trainables(tree, path=True)]
    ["['enc']['w']"]
    """
    plan, unique = plan_and_arrays(tree)
    _backend_for(plan, unique, backend)
    if not path:
        return list(unique)
    return [(leaf.path, a) for leaf, a in zip(plan.leaves, unique)]


def destructure(tree, *, backend=None):
    """``(flat, re)``: the trainables in one 1-D buffer, and a function rebuilding the tree.

    ``re(flat2)`` returns a new tree with every trainable rebuilt from
    ``flat2``, cast back to its dtype and shape; tied arrays come back as one
    shared array; everything else is kept.

    >>> import numpy as np, gpuflat as gf
    >>> a = np.array([1.0, 2.0])
    >>> flat, re = gf.destructure({"x": a, "y": (np.sin, np.float32([3])), "z": a})
    >>> flat
    array([1., 2., 3.])
    >>> m = re(flat * 10)
    >>> m["x"], m["x"] is m["z"], m["y"][0] is np.sin
    (array([10., 20.]), True, True)
    """
    plan, unique = plan_and_arrays(tree)
    be = _backend_for(plan, unique, backend)
    flat = be.xp.empty(plan.size, plan.dtype)
    be.gather(plan, [[a] for a in unique], flat)

    def re(flat2):
        _check_flat(plan, flat2)
        be2 = select(backend, [flat2], lambda i: "<flat>")
        leaves = [be2.xp.empty(leaf.shape, leaf.dtype) for leaf in plan.leaves]
        be2.scatter(plan, flat2, leaves)
        return _tree.rebuild(plan.treedef, [leaves[s] for s in plan.slot_of])

    return flat, re


def total(f, tree, *, backend=None):
    """The sum over unique trainables of ``f(leaf)``.

    ``f`` is any callable, or one of the fused reductions: "sumsq" (sum of
    squares), "l1" (sum of absolute values), "l2" (the sum of each leaf's
    2-norm, as Optimisers.jl's ``total(norm, model)``) and "count" (the
    number of trainable elements).

    >>> import numpy as np, gpuflat as gf
    >>> model = {"x": np.array([3.0, 4.0]), "y": (np.sin, np.array([5.0])), "z": (6, 7)}
    >>> float(gf.total("l2", model)), gf.total("count", model)
    (10.0, 3)
    >>> float(gf.total(np.sum, model))
    12.0
    """
    plan, unique = plan_and_arrays(tree)
    if callable(f):
        return sum((f(a) for a in unique), 0)
    if f not in _NAMED_TOTALS:
        raise ValueError(f"total: expected a callable or one of {_NAMED_TOTALS}, got {f!r}")
    if f == "count":
        return plan.size
    be = _backend_for(plan, unique, backend)
    if f == "l2":
        result = _norms(plan, unique, be, 2.0, per_leaf=True)
        return be.xp.sum(result.per_leaf)
    result = _norms(plan, unique, be, 1.0 if f == "l1" else 2.0, per_leaf=False)
    return result.total if f == "l1" else result.total * result.total


def global_norm(tree, ord=2, *, per_leaf=False, backend=None):
    """The norm of all trainables taken as one vector: (sum |x|**p) ** (1/p).

    Accumulated in float64 whatever the leaf dtype, in a fixed order (the
    same bits on every repeat). Returns a 0-d float64 array on the leaves'
    device; with ``per_leaf=True``, ``(total, per_leaf_norms)`` from the same
    pass, the latter in plan order (``trainables`` order).

    >>> import numpy as np, gpuflat as gf
    >>> g = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]], np.float32)}
    >>> float(gf.global_norm(g)), float(gf.global_norm(g, ord=1)), float(gf.global_norm(g, np.inf))
    (5.0, 7.0, 4.0)
    >>> total, per = gf.global_norm(g, per_leaf=True)
    >>> per
    array([3., 4.])
    """
    p = check_ord(ord)
    plan, unique = plan_and_arrays(tree)
    be = _backend_for(plan, unique, backend)
    result = _norms(plan, unique, be, p, per_leaf)
    return (result.total, result.per_leaf) if per_leaf else result.total


def clip_grad_norm_(grads, max_norm, ord=2, *, eps=1e-6, error_if_nonfinite=False, backend=None):
    """Scale every gradient in place by min(1, max_norm / (norm + eps)); return the norm.

    PyTorch's semantics: the factor is always applied (no branch on a device
    value, so no host synchronisation on a GPU); a NaN norm makes the
    gradients NaN. With ``error_if_nonfinite`` a NaN or inf norm raises
    NonFiniteError naming the first leaf holding one, and nothing is scaled.

    >>> import numpy as np, gpuflat as gf
    >>> g = {"w": np.array([3.0, 4.0]), "b": np.zeros(1, np.float32)}
    >>> float(gf.clip_grad_norm_(g, 1.0))
    5.0
    >>> g["w"].round(6)
    array([0.6, 0.8])
    """
    max_norm = _check_max_norm(max_norm)
    p = check_ord(ord)
    plan, unique = plan_and_arrays(grads)
    be = _backend_for(plan, unique, backend)
    flat = _resident_buffer(plan, unique)
    if flat is None:
        _check_writable([leaf.path for leaf in plan.leaves], unique)
        check_no_overlap(plan, unique)
    result = _norms(plan, unique, be, p, per_leaf=False, flat=flat)
    # The one synchronisation (#3) reads the norm itself: finite leaves whose sum
    # overflows float64 give an inf norm too, and PyTorch raises on that (#5).
    # Only a non-finite norm costs a second read, to name the leaf.
    if error_if_nonfinite and not math.isfinite(float(be.to_host(result.total))):
        bad = int(be.to_host(result.first_nonfinite))
        where = (f"leaf {plan.leaves[bad].path!r} holds NaN or inf" if bad >= 0 else
                 "no leaf holds NaN or inf, but the sum overflowed float64")
        raise NonFiniteError(
            f"{where}; the total {p:g}-norm is non-finite, so no gradient was scaled "
            f"(error_if_nonfinite=True)"
        )
    be.clip_(plan, unique, result.total, max_norm, eps, flat=flat)
    return result.total


# ---------------------------------------------------------------- plan methods

def plan_flatten(plan, tree, out, backend):
    values, exact = occurrences(plan, tree, allow_none=True)
    if exact and len(plan.slot_of) == len(plan.leaves):
        sources = [[v] for v in values]  # no ties, no None: the common case
    else:
        sources = [[] for _ in plan.leaves]
        for slot, value in zip(plan.slot_of, values):
            # The same gradient object met twice counts once (Optimisers.jl, #2).
            if value is not None and all(value is not seen for seen in sources[slot]):
                sources[slot].append(value)
    present = [(leaf.path, s[0]) for leaf, s in zip(plan.leaves, sources) if s]
    if out is not None:
        _check_flat(plan, out, name="out")
        present.append(("<out>", out))
    be = select(backend, [a for _, a in present], lambda i: present[i][0])
    if out is None:
        out = be.xp.empty(plan.size, plan.dtype)
    be.gather(plan, sources, out)
    return out


def plan_unflatten(plan, flat, backend):
    _check_flat(plan, flat)
    select(backend, [flat], lambda i: "<flat>")
    views = []
    for leaf in plan.leaves:
        piece = flat[leaf.offset : leaf.offset + leaf.size]
        if leaf.dtype != flat.dtype and leaf.dtype.kind != "c" and flat.dtype.kind == "c":
            piece = piece.real  # complex to real keeps the real part, without NumPy's warning
        views.append(piece.reshape(leaf.shape) if leaf.dtype == flat.dtype else
                     piece.astype(leaf.dtype).reshape(leaf.shape))
    if views and all(leaf.dtype == flat.dtype for leaf in plan.leaves):
        _remember_resident(plan, flat, views)
    return _tree.rebuild(plan.treedef, [views[s] for s in plan.slot_of])


def plan_scatter(plan, flat, tree, backend):
    values, _ = occurrences(plan, tree, allow_none=False)
    targets = [None] * len(plan.leaves)
    for slot, value in zip(plan.slot_of, values):
        targets[slot] = value if targets[slot] is None else targets[slot]
    _check_flat(plan, flat)
    be = select(backend, targets + [flat],
                lambda i: plan.leaves[i].path if i < len(plan.leaves) else "<flat>")
    _check_writable(plan.occurrence_paths, values)
    # A broken tie adds arrays the plan has no slot for; they are written too,
    # so they are checked for overlap with the rest before any write (#5).
    extra, seen = [], {id(t) for t in targets}
    for path, value in zip(plan.occurrence_paths, values):
        if id(value) not in seen:
            seen.add(id(value))
            extra.append((path, value))
    check_no_overlap(plan, targets + [v for _, v in extra],
                     [leaf.path for leaf in plan.leaves] + [p for p, _ in extra])
    be.scatter(plan, flat, targets)
    # A broken tie (two arrays where the plan has one slot) gets the slot's values at both places.
    for slot, value in zip(plan.slot_of, values):
        if value is not targets[slot]:
            value[...] = targets[slot]


# ---------------------------------------------------------------- helpers

def _norms(plan, unique, be, p, per_leaf, flat=None):
    if flat is None:
        flat = _resident_buffer(plan, unique)
    return be.norms(plan, unique, p, per_leaf, flat=flat)


_RESIDENT_KEPT = 4  # models resident in a buffer remembered per plan


def _remember_resident(plan, flat, views):
    """Remember unflatten's views, so later calls on that model use the buffer itself (#4).

    Keyed by the first view's id and checked by identity of every view, so a
    tree that merely looks alike is never mistaken for the buffer. Only weak
    references are kept: a dropped model frees its buffer.
    """
    registry = plan.device_cache.setdefault("resident", {})
    registry[id(views[0])] = (weakref.ref(flat), [weakref.ref(v) for v in views])
    while len(registry) > _RESIDENT_KEPT:
        registry.pop(next(iter(registry)), None)


def _resident_buffer(plan, unique):
    """The buffer the leaves are views of, if they are exactly the views unflatten made."""
    registry = plan.device_cache.get("resident")
    if not registry or not unique:
        return None
    entry = registry.get(id(unique[0]))
    if entry is None:
        return None
    flat_ref, view_refs = entry
    if all(ref() is a for ref, a in zip(view_refs, unique)):
        return flat_ref()
    return None


def _check_flat(plan, flat, name="flat"):
    shape = getattr(flat, "shape", None)
    if shape is None:
        raise TreeMismatchError(f"{name}: expected a 1-D array, got {type(flat).__name__}")
    if shape != (plan.size,):
        raise TreeMismatchError(f"{name}: expected shape ({plan.size},), got {tuple(shape)}")
    if flat.dtype != plan.dtype:
        raise TreeMismatchError(f"{name}: expected dtype {plan.dtype}, got {flat.dtype}")


def _check_max_norm(max_norm) -> float:
    try:
        value = float(max_norm)
    except (TypeError, ValueError):
        value = math.nan
    if not value >= 0:
        raise ValueError(f"max_norm: expected a number >= 0, got {max_norm!r}")
    return value


def _check_writable(paths, arrays):
    for path, a in zip(paths, arrays):
        # CuPy arrays have no writeable flag: device memory is always writable.
        if not getattr(getattr(a, "flags", None), "writeable", True):
            raise ValueError(f"leaf {path!r}: expected a writable array, got a read-only one")
