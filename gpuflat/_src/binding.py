"""Binding a call to its trees: what every front end does before a backend runs.

A front end (``gpuflat._src.ops``, ``gpuflat._src.residency``, ``gpuflat._src.ranks``,
``gpuflat.torch``) binds each call here: the walk of the call's tree (once),
its plan from the cache, the caller's own objects behind adopted views, the
backend the leaves choose, the gradients of a ``model=`` slot by slot (ties
added), the in-place checks, results in the caller's kind, and a clip's
gradients bound as ``gpuflat._src.clipping`` takes them (as a tensor list's
are in ``gpuflat._src.tensor_table``). Backends never walk or check.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from . import arrays as _arrays
from . import checks
from . import flatplan
from . import tree as _tree
from .backends.protocol import OneSourcePerSlot
from .backends.selection import select
from .clipping import Bound, Part
from ..errors import TreeMismatchError
from .seen import trees

if TYPE_CHECKING:
    from .backends.protocol import Backend
    from .flatplan import FlatPlan
    from .seen import SeenTree
    from .tree import Walked

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

    plan: FlatPlan
    unique: list[Any]
    statics: list[Any]
    like: Any
    foreign: dict[int, Any]
    walked: Walked
    seen: SeenTree | None

    def __init__(self, tree: Any) -> None:
        self.walked, self.seen = trees.walk(tree)
        if self.seen is None:
            with _tree.collector_paused():
                self.plan, self.unique = flatplan.cached(self.walked.treedef, self.walked.arrays)
        else:
            self.plan, self.unique = self.seen.plan(self.walked.arrays)
        self.statics = self.walked.statics
        self.foreign = self.walked.foreign
        self.like = next(iter(self.foreign.values()), None)

    def backend(self, backend: str | None) -> Backend:
        """The backend named ``backend`` (None: the one the leaves choose), checked
        against the leaves."""
        return select(backend, self.unique, lambda i: self.plan.leaves[i].path)

    def result(self, x: Any) -> Any:
        """A result standing for the whole tree (a norm, a flat buffer), in the
        kind of its first PyTorch or JAX leaf; NumPy or CuPy if it has none."""
        return x if self.like is None else _arrays.to_caller(x, self.like)

    def owners(self) -> list[Any]:
        """Per slot, the caller's own leaf behind it (None for NumPy and CuPy)."""
        return [self.foreign.get(id(a)) for a in self.unique]

    def paths(self) -> list[str]:
        return list(self.plan.paths)


def gradients_of(parameters: Call) -> list[Any]:
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


def slot_sources(plan: FlatPlan, tree: Any, walked: Walked | None = None, seen: SeenTree | None = None
                 ) -> tuple[Sequence[Sequence[Any]], Any, tuple[SeenTree, list[Any]] | None]:
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
    sources: list[list[Any]] = [[] for _ in plan.leaves]
    for slot, value in zip(plan.slot_of, values):
        # The same gradient object met twice counts once (Optimisers.jl).
        if value is not None and all(value is not seen for seen in sources[slot]):
            sources[slot].append(value)
    return sources, like, None


def norm_inputs(call: Call, grads: Any, model: Any, backend: str | None) -> tuple[FlatPlan, list[Any]]:
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
    if model is None:  # the walk's own list: a recorded tree's carries its token (identity.Recorded)
        return call.plan, call.unique
    plan = Call(model).plan
    sources, _, _ = slot_sources(plan, grads, call.walked, call.seen)
    if all(len(s) == 1 for s in sources):
        return plan, [s[0] for s in sources]
    # A tied weight's several gradients, or a None: each slot's gradients are
    # added in float64 (zeros for none), so every slot keeps its own norm and
    # nothing is rounded before the norm accumulates.
    wide = summed_wide(plan, sources, backend, call.like)
    return plan, [wide[leaf.offset : leaf.offset + leaf.size].reshape(leaf.shape) for leaf in plan.leaves]


def summed_wide(plan: FlatPlan, sources: Sequence[Sequence[Any]], backend: str | None, like: Any = None) -> Any:
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


def clip_bound(call: Call, grads: Any, model: Any, backend: str | None) -> Bound:
    """The gradients ``grads`` (walked as ``call``) bound for a clip
    (``gpuflat._src.clipping``), checked fit for an in-place write: their
    norm read through ``model``'s plan where given (a tied weight's
    gradients added first), each distinct gradient array scaled.

    >>> import numpy as np
    >>> from gpuflat._src import clipping
    >>> g = {"w": np.array([3.0, 4.0])}
    >>> float(clipping.clip_(clip_bound(Call(g), g, None, None), 1.0, 2.0, 0.0, False)), g["w"]
    (5.0, array([0.6, 0.8]))
    """
    norm_plan, norm_leaves = norm_inputs(call, grads, model, backend)
    # The grads' own walk holds each distinct gradient array once.
    scale_plan, scale_leaves, scale_paths = call.plan, call.unique, call.paths()
    # Without a model the norm reads the very arrays it scales: one list chooses the backend.
    chosen_by = scale_leaves if model is None else norm_leaves + scale_leaves
    be = select(backend, chosen_by,
                lambda i: (norm_plan.leaves[i].path if i < len(norm_leaves)
                           else scale_paths[i - len(norm_leaves)]))
    in_place.check(scale_plan, scale_paths, scale_leaves,
                   None if call.seen is None else call.seen.verdicts(scale_leaves))
    norm = Part(norm_plan, norm_leaves, be, call.like, path=lambda slot: norm_plan.leaves[slot].path)
    return Bound([norm], [norm if model is None else Part(scale_plan, scale_leaves, be, call.like)])
