"""Binding a call to its trees: what every front end does before a backend runs.

A front end (``gpuflat._src.ops``, ``gpuflat._src.residency``, ``gpuflat.distributed``,
``gpuflat.torch``) binds each call here: the walk of the call's tree (once),
its plan from the cache, the caller's own objects behind adopted views, the
backend the leaves choose, the gradients of a ``model=`` slot by slot (ties
added), the in-place checks, results in the caller's kind, and the one
error naming the first non-finite leaf. Backends never walk or check.
"""
from __future__ import annotations

import math

import numpy as np

from . import arrays as _arrays
from . import checks
from . import flatplan
from . import tree as _tree
from .backends.protocol import OneSourcePerSlot
from .backends.selection import select
from ..errors import NonFiniteError, TreeMismatchError
from .seen import trees

# Arrays last found fit for an in-place write, per plan (see InPlaceChecked).
in_place = checks.InPlaceChecked()


class Call:
    """One call's walk of a tree: its plan, arrays and the caller's kind.

    Every front end starts from it, so every entry point walks a tree the
    same way, once; ``walked`` is kept so that matching this tree against
    another plan (a gradient tree read through its model's plan) needs no
    second walk. A plain tree met again unchanged is read again without a
    walk (``seen``, its record; see ``gpuflat._src.seen.SeenTrees``).

    >>> import numpy as np
    >>> a = np.ones(2)
    >>> call = Call({"w": a, "tied": a, "act": "relu"})
    >>> call.paths(), len(call.unique), call.statics, call.backend("numpy").name
    (["['w']"], 1, ['relu'], 'numpy')
    """

    __slots__ = ("plan", "unique", "statics", "like", "foreign", "walked", "seen")

    def __init__(self, tree):
        self.walked, self.seen = trees.walk(tree)
        if self.seen is None:
            with _tree.collector_paused():
                self.plan, self.unique = flatplan.cached(self.walked.treedef, self.walked.arrays)
        else:
            self.plan, self.unique = self.seen.plan(self.walked.arrays)
        self.statics = self.walked.statics
        self.foreign = self.walked.foreign
        self.like = next(iter(self.foreign.values()), None)

    def backend(self, backend):
        """The backend named ``backend`` (None: the one the leaves choose), checked
        against the leaves."""
        return select(backend, self.unique, lambda i: self.plan.leaves[i].path)

    def result(self, x):
        """A result standing for the whole tree (a norm, a flat buffer), in the
        kind of its first PyTorch or JAX leaf; NumPy or CuPy if it has none."""
        return x if self.like is None else _arrays.to_caller(x, self.like)

    def owners(self) -> list:
        """Per slot, the caller's own leaf behind it (None for NumPy and CuPy)."""
        return [self.foreign.get(id(a)) for a in self.unique]

    def paths(self):
        return list(self.plan.paths)


def gradients_of(parameters) -> list:
    """The ``.grad`` of each parameter of a walked module or tree (None ones
    left out), as torch's clip_grad_norm_ takes them: clipping the parameters
    themselves in place would silently ruin the weights.

    >>> import torch
    >>> w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))
    >>> w.grad = torch.full((2,), 3.0)
    >>> gradients_of(Call([w, b]))
    [tensor([3., 3.])]
    """
    owners = parameters.owners()
    for path, own, view in zip(parameters.paths(), owners, parameters.unique):
        if _arrays.kind(own) != "torch":
            found = type(view if own is None else own).__name__
            raise TreeMismatchError(
                f"leaf {path!r}: expected a PyTorch tensor, as the tree holds parameters (tensors "
                f"that require grad, whose .grad is clipped), got a {found}")
    return [own.grad for own in owners if own.grad is not None]


def slot_sources(plan, tree, walked=None, seen=None):
    """(per slot, the distinct arrays ``tree`` holds there (tied gradients: several);
    one of the caller's own objects behind them, or None for NumPy/CuPy;
    ``(record, unique arrays)`` where ``tree`` is a recorded tree tied as
    the plan is, its unique arrays the slots' one source each; else None).

    ``walked`` is ``tree``'s walk where the caller has it already (and
    ``seen`` its record, if any).

    >>> import numpy as np, gpuflat as gf
    >>> w = np.ones(2)
    >>> plan = gf.plan({"a": w, "b": w, "c": np.ones(1)})
    >>> sources, like, recorded = slot_sources(plan, {"a": np.ones(2), "b": np.ones(2), "c": None})
    >>> [len(s) for s in sources], like, recorded
    ([2, 0], None, None)
    """
    values, exact, like, seen = checks.occurrences(plan, tree, allow_none=True, walked=walked, seen=seen)
    if seen is not None and seen.ties_as(plan):
        # A recorded tree tied as the plan is: each slot's one array, one C loop.
        unique = seen.unique(values)
        return OneSourcePerSlot(unique), like, (seen, unique)
    if exact and len(plan.slot_of) == len(plan.leaves):
        return OneSourcePerSlot(values), like, None  # no ties, no None: the common case
    sources: list = [[] for _ in plan.leaves]
    for slot, value in zip(plan.slot_of, values):
        # The same gradient object met twice counts once (Optimisers.jl).
        if value is not None and all(value is not seen for seen in sources[slot]):
            sources[slot].append(value)
    return sources, like, None


def norm_inputs(call, grads, model, backend):
    """(plan, one array per slot) whose norms are the gradients' norms, slot by
    slot in the plan's order (the model's plan with ``model``); ``call`` is
    the walk of ``grads``.

    >>> import numpy as np
    >>> w = np.ones(2)
    >>> grads = {"a": np.ones(2), "b": np.ones(2)}
    >>> plan, arrays = norm_inputs(Call(grads), grads, {"a": w, "b": w}, None)
    >>> plan.size, arrays
    (2, [array([2., 2.])])
    """
    if model is None:
        return call.plan, list(call.unique)
    plan = Call(model).plan
    sources, _, _ = slot_sources(plan, grads, call.walked, call.seen)
    if all(len(s) == 1 for s in sources):
        return plan, [s[0] for s in sources]
    # A tied weight's several gradients, or a None: each slot's gradients are
    # added in float64 (zeros for none), so every slot keeps its own norm and
    # nothing is rounded before the norm accumulates.
    wide = summed_wide(plan, sources, backend, call.like)
    return plan, [wide[leaf.offset : leaf.offset + leaf.size].reshape(leaf.shape) for leaf in plan.leaves]


def summed_wide(plan, sources, backend, like=None):
    """Each slot's sources added into one float64 (complex128) flat buffer,
    made where ``like`` (one of the caller's tensors, or None) says.

    >>> import numpy as np, gpuflat as gf
    >>> plan = gf.plan([np.ones(1, np.float32)])
    >>> summed_wide(plan, [[np.ones(1, np.float32), np.full(1, 2, np.float32)]], None)
    array([3.])
    """
    arrays = [(plan.leaves[slot].path, a) for slot, s in enumerate(sources) for a in s]
    be = select(backend, [a for _, a in arrays], lambda i: arrays[i][0])
    with _arrays.device_scope(be, like):
        wide = be.empty(plan.size, np.complex128 if plan.dtype.kind == "c" else np.float64)
        be.gather(plan, sources, wide)
    return wide


def max_norm_for(backend, max_norm):
    """``max_norm`` as ``backend.clip_`` takes it: a float, or, when it is a
    0-d device tensor and the backend runs on that device, a 0-d float64
    array of the backend's that the kernel reads, so that no value crosses
    to the host and a captured CUDA graph reads its current value at every
    replay. Called inside the call's device scope: the cast runs on its
    stream.

    >>> import numpy as np
    >>> from gpuflat._src.backends import get_backend
    >>> max_norm_for(get_backend("numpy"), np.float32(0.5))
    0.5
    """
    if isinstance(max_norm, float):
        return max_norm
    if backend.name != "cuda":
        return float(max_norm)  # host memory, or a device value for a host backend: one read
    found, expected = _device_index(max_norm), backend.runtime.device.id
    if found != expected:
        raise ValueError(f"max_norm: expected a number or a 0-d tensor on CUDA device {expected}, the "
                         f"gradients' device, got one on CUDA device {found}")
    if _arrays.kind(max_norm) == "torch":
        import torch

        return _arrays.adopt(max_norm.detach().to(torch.float64))
    return max_norm.astype(np.float64, copy=False)


def _device_index(x) -> int:
    """The CUDA device of a CuPy array or a PyTorch CUDA tensor."""
    return x.device.index if _arrays.kind(x) == "torch" else x.device.id


def raise_if_nonfinite(be, plan, result, p) -> None:
    """NonFiniteError naming the first leaf holding NaN or inf, if the norm is
    not finite (the one host synchronisation of a checked clip).

    >>> import numpy as np, gpuflat as gf
    >>> from gpuflat._src.backends import get_backend
    >>> g = [np.ones(2), np.array([np.nan])]
    >>> be, p = get_backend("numpy"), gf.plan(g)
    >>> raise_if_nonfinite(be, p, be.norms(p, g, 2.0, False), 2.0)
    Traceback (most recent call last):
    ...
    gpuflat.errors.NonFiniteError: leaf '[1]' holds NaN or inf; the total 2-norm is non-finite, so no gradient was scaled (error_if_nonfinite=True; set it to False to scale by the non-finite norm anyway)
    """
    # The norm itself is read: finite leaves whose sum overflows float64 give
    # an inf norm too, and PyTorch raises on that. Only a non-finite norm costs
    # a second read, to name the leaf.
    if math.isfinite(float(be.to_host(result.total))):
        return
    bad = int(be.to_host(result.first_nonfinite))
    raise nonfinite_error(p, f"leaf {plan.leaves[bad].path!r}" if bad >= 0 else None)


def nonfinite_error(p: float, culprit: str | None, *, ranks: int | None = None, scaled: bool = True,
                    kind: type = NonFiniteError) -> NonFiniteError:
    """The one error a norm or clip with ``error_if_nonfinite`` raises, in
    every front end: ``culprit`` names the first leaf holding NaN or inf
    (and its rank, over many), None where none does and the sum overflowed
    float64; ``ranks``, the ranks a global norm spans; ``scaled``, whether
    the call would have scaled; ``kind``, the class (``NonFiniteNormError``
    for PyTorch's drop-ins, a RuntimeError as PyTorch raises).

    >>> print(nonfinite_error(2.0, "leaf '[1]'"))
    leaf '[1]' holds NaN or inf; the total 2-norm is non-finite, so no gradient was scaled (error_if_nonfinite=True; set it to False to scale by the non-finite norm anyway)
    >>> print(nonfinite_error(1.0, None, ranks=4, scaled=False))
    no leaf holds NaN or inf, but the sum overflowed float64; the global 1-norm over 4 ranks is non-finite (error_if_nonfinite=True; set it to False to return the non-finite norm)
    """
    what = f"{culprit} holds NaN or inf" if culprit else "no leaf holds NaN or inf, but the sum overflowed float64"
    norm = f"the total {p:g}-norm" if ranks is None else f"the global {p:g}-norm over {ranks} ranks"
    then = "" if not scaled else ", so no gradient was scaled" + ("" if ranks is None else " on any rank")
    instead = "scale by the non-finite norm anyway" if scaled else "return the non-finite norm"
    return kind(f"{what}; {norm} is non-finite{then} (error_if_nonfinite=True; set it to False to {instead})")
