"""What a user writes with the array library alone: a per-array loop, and
``concatenate`` for flattening (NumPy on a CPU, CuPy on a GPU)."""
from __future__ import annotations

from .. import arrays
from ..case import Case


def library_name(device) -> str:
    return "numpy" if device.name == "cpu" else "cupy"


# What the loops below call on the array module.
_NEEDS = ("linalg", "stack", "concatenate")


def absent(device):
    """None: the run's own array module is there; unless it lacks what the
    loops call (the CuPy stand-in of a dry run of the device script does).

    >>> import numpy, types
    >>> absent(types.SimpleNamespace(xp=numpy)) is None
    True
    """
    missing = [name for name in _NEEDS if not hasattr(device.xp, name)]
    return f"its array module has no {', '.join(missing)}" if missing else None


def _norms(xp, leaves):
    return [xp.linalg.norm(a) for a in leaves]


def _total(xp, leaves):
    # PyTorch's get_total_norm(foreach=False) shape: norm of the per-array norms
    return xp.linalg.norm(xp.stack(_norms(xp, leaves)).astype(xp.float64))


def _clip(xp, leaves, max_norm, eps=1e-6):
    total = _total(xp, leaves)
    coef = xp.minimum(max_norm / (total + eps), 1.0)  # always applied, no branch (PyTorch)
    for a in leaves:
        a *= coef.astype(a.dtype)
    return total


def _flatten_loop(leaves, offsets, out):
    for a, lo, hi in zip(leaves, offsets, offsets[1:]):
        out[lo:hi] = a.reshape(-1)
    return out


def _slices(out, leaves, offsets):
    return [out[lo:hi].astype(a.dtype, copy=False).reshape(a.shape)
            for a, lo, hi in zip(leaves, offsets, offsets[1:])]


def _scatter_loop(out, leaves, offsets):
    for a, lo, hi in zip(leaves, offsets, offsets[1:]):
        a[...] = out[lo:hi].reshape(a.shape)


def cases(op, ctx) -> list:
    xp, lib, leaves, out, offs = ctx.xp, library_name(ctx.device), ctx.leaves, ctx.out, ctx.offsets
    loop = f"{lib} loop"
    if op == "flatten":
        return [
            Case(loop, lib, lambda: _flatten_loop(leaves, offs, out), arrays.norm_of_flat),
            Case(f"{lib}.concatenate", lib,
                 lambda: xp.concatenate([a.reshape(-1) for a in leaves], out=out), arrays.norm_of_flat),
        ]
    if op == "unflatten":
        return [Case(f"{lib} slice views", lib, lambda: _slices(out, leaves, offs), arrays.norm_of)]
    if op == "scatter":
        return [Case(loop, lib, lambda: _scatter_loop(out, leaves, offs),
                     lambda _: arrays.norm_of(leaves))]
    if op == "global_norm":
        return [Case(loop, lib, lambda: _total(xp, leaves), arrays.values)]
    if op == "per_leaf_norm":
        return [Case(loop, lib, lambda: _norms(xp, leaves), arrays.values)]
    if op == "clip":
        return [Case(loop, lib, lambda: _clip(xp, leaves, ctx.max_norm), arrays.values)]
    if op == "resident_norm":
        return [Case(loop, lib, lambda: _total(xp, ctx.resident_grads), arrays.values)]
    if op == "resident_clip":
        return [Case(loop, lib, lambda: _clip(xp, ctx.resident_grads, ctx.max_norm), arrays.values)]
    return []
