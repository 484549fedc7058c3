"""The rank engine: norms, clips and the gradient all-reduce over many ranks.

``gpuflat.distributed`` is its public face and documents what it does; the
front ends (``gpuflat.torch``, ``gpuflat._src.ops``,
``gpuflat._src.torch_optim``) call it here. Its parts: the ownership rules
(``Owned`` and the rules it combines, their masks cached per plan), a group
or communicator as ``_Comm``, this rank's leaves and the groups its partial
is reduced over (``_Local``, ``_Pipeline``), the norm (``_reduce_norm``,
bound for ``gpuflat._src.clipping`` as ``_RankBound``) and the all-reduce
(``_Reduction``, checked on every rank by ``_agree``).
"""
from __future__ import annotations

import abc
import ast
import contextlib
import inspect
import re
import sys
import threading
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from . import caches, checks, clipping, dtensor
from .arrays import adopt, device_scope, external_stream, is_module, module_parameters
from .backends import get_backend
from .dtypes import wider
from .layout import CLIP_EPS, NORMS, norm_kind
from .binding import Call
from ..errors import CollectiveError

if TYPE_CHECKING:
    import torch

# Each rank's row in the one exchanged buffer: its partial, and 1 + the slot
# of its first owned leaf with a non-finite norm (0: none).
_ROW = 2


# ---------------------------------------------------------------- gpuflat.distributed's functions

def global_norm(tree: Any, ord: float = 2, *, group: Any = None, owned: OwnedLike | None = None,
                pp_mesh: Any = None, tied: Any = None, per_leaf: bool = False, error_if_nonfinite: bool = False,
                backend: str | None = None) -> Any:
    """The norm of a model spread over the ranks of ``group`` (see ``gpuflat.distributed.global_norm``)."""
    p = checks.check_ord(ord)
    bound = _RankBound(_Local(tree, backend, group, owned, pp_mesh, tied), per_leaf)
    total = clipping.total_norm(bound, p, error_if_nonfinite).total
    return (total, bound.per_leaf) if per_leaf else total


def clip_grad_norm_(grads: Any, max_norm: float, ord: float = 2, *, group: Any = None,
                    owned: OwnedLike | None = None, pp_mesh: Any = None, tied: Any = None, eps: float = CLIP_EPS,
                    error_if_nonfinite: bool = False, backend: str | None = None) -> Any:
    """Scale every rank's gradients by one factor; return the norm (see
    ``gpuflat.distributed.clip_grad_norm_``)."""
    max_norm, p, eps = checks.clip_arguments(max_norm, ord, eps)
    local = _Local(grads, backend, group, owned, pp_mesh, tied)
    local.check_in_place()
    return clipping.clip_(_RankBound(local), max_norm, p, eps, error_if_nonfinite)


def check_pipeline(pp_mesh: Any, tied: Any = None, leaves: Any = None) -> None:
    """Raise what ``global_norm`` raises for ``pp_mesh`` and ``tied``; each
    tied leaf one of ``leaves`` where given (see ``gpuflat.distributed.check_pipeline``)."""
    pipeline = _pipeline(pp_mesh, tied)
    if pipeline is None or tied is None:  # without a pipeline, _pipeline refused tied
        return
    for i, (leaf, _) in enumerate(pipeline.owner_stages(tied)):
        if leaves is not None and leaf is not None and not any(leaf is x for x in leaves):
            raise _not_given(i, leaf)


def all_reduce_(grads: Any, op: str = "mean", *, group: Any = None, bucket_bytes: int | None = None) -> None:
    """Sum (or average) gradients across ranks in place (see ``gpuflat.distributed.all_reduce_``)."""
    _check_reduce_arguments(op, bucket_bytes)
    comm = _Comm(group)
    try:
        reduction, failure = _Reduction(grads), None
    except Exception as err:  # re-raised below on this rank, once every rank knows
        reduction, failure = None, err
    gradless_somewhere = _agree(comm, "all_reduce_", failure, reduction)
    assert reduction is not None  # _agree raised this rank's failure
    given = reduction.gradients_given(comm) if gradless_somewhere else ()
    for buf in reduction.moving:
        _reduce_buffer(comm, buf, bucket_bytes)
    reduction.finish(op, comm.size)
    if given:
        assert reduction.resident is not None  # only a resident model's parameters lack gradients
        reduction.resident._give_grads(given)


# ---------------------------------------------------------------- ownership

PATH_FORMAT = ("paths are written as gpuflat prints them (\"['enc']['w']\", \"['layers'][0].weight\", "
               "'encoder.layers.0.weight') or dotted ('enc.w', 'layers.0.weight')")
_PATHS_SHOWN = 5  # valid paths listed in an error about an unknown one


class Owned:
    """A rule saying which leaves this rank counts in the global norm.

    Made from an iterable of leaf paths (a set, list, tuple...) or a callable
    ``(path) -> bool`` or ``(path, leaf) -> bool``; called as
    ``rule(path, leaf) -> bool``. Rules combine with ``&`` (a leaf counts
    when every rule counts it), with sets, iterables and callables on either
    side. ``owned=`` takes any of these, or None (every leaf). A path named
    in a set must be a trainable leaf of the tree (see ``PATH_FORMAT``). The
    answer is cached per plan, so it must depend on the path, shape or
    dtype only.

    >>> rule = Owned(lambda path: "norm" not in path) & Owned(lambda path, leaf: leaf.ndim > 1)
    >>> rule("['w']", np.ones((2, 2))), rule("['norm']", np.ones((2, 2)))
    (True, False)
    >>> both = {"enc.w", "['b']"} & sharded()
    >>> both("['enc']['w']", np.ones(2)), both("['enc']['v']", np.ones(2))
    (True, False)
    """

    def __init__(self, rule: OwnedLike | _Rule) -> None:
        self._rule = _as_rule(rule, "owned")

    def __call__(self, path: str, leaf: Any = None) -> bool:
        return self._rule.match(path, leaf)

    def __and__(self, other: OwnedLike) -> Owned:
        return Owned(_Both(self._rule, _as_rule(other, "the right side of &")))

    def __rand__(self, other: OwnedLike) -> Owned:
        return Owned(_Both(_as_rule(other, "the left side of &"), self._rule))

    def _mask(self, paths: list[str], leaves: Sequence[Any]) -> np.ndarray:
        return self._rule.mask(paths, leaves)


# What owned= and where= take: an Owned, leaf paths, or a (path) or (path, leaf) -> bool.
OwnedLike = Owned | Iterable[str] | Callable[..., bool]


def sharded() -> Owned:
    """Every leaf counts on every rank (see ``gpuflat.distributed.sharded``)."""
    return Owned(_Everything())


def replicated(group: Any = None, where: OwnedLike | None = None) -> Owned:
    """Leaves held whole on every rank of ``group`` count on its rank 0 only
    (see ``gpuflat.distributed.replicated``)."""
    comm = _Comm(group)
    return Owned(_Tied(comm.rank == 0, _where(where, required=True)))


def tied(owner_rank: int, group: Any = None, where: OwnedLike | None = None) -> Owned:
    """Copies of one parameter count on ``owner_rank`` of ``group`` only (see
    ``gpuflat.distributed.tied``)."""
    comm = _Comm(group)
    if isinstance(owner_rank, bool) or not isinstance(owner_rank, int) or not 0 <= owner_rank < comm.size:
        raise ValueError(f"owner_rank: expected a rank of the group, 0 to {comm.size - 1} "
                         f"(a group of {comm.size} rank{'s' * (comm.size > 1)}), got {owner_rank!r}")
    is_owner = comm.rank == owner_rank
    # Only the owner must hold the tied leaves: stages between hold no copy.
    return Owned(_Tied(is_owner, _where(where, required=is_owner)))


def _where(where: OwnedLike | None, *, required: bool) -> _Rule:
    if where is None:
        return _Everything()
    return _as_rule(where, "where", required=required)


def _as_rule(rule: OwnedLike | _Rule, name: str, *, required: bool = True) -> _Rule:
    """``rule`` as one of the rules below; TypeError saying what is accepted."""
    if isinstance(rule, Owned):
        return rule._rule
    if isinstance(rule, _Rule):
        return rule
    if callable(rule):
        return _Predicate(rule, name)
    if not isinstance(rule, (str, bytes)) and hasattr(rule, "__iter__"):
        return _Paths(rule, name, required)
    raise TypeError(f"{name}: expected None, an iterable of leaf paths, or a callable (path) -> bool "
                    f"or (path, leaf) -> bool, got {type(rule).__name__}"
                    + (f" {rule!r} (wrap one path in a set: {{{rule!r}}})" if isinstance(rule, str) else ""))


class _Rule:
    """What every rule below has: ``match(path, leaf)``, ``mask(paths, leaves)``
    (which also checks the paths it names) and a ``key`` to cache masks by."""

    key: Hashable
    match: Callable[[str, Any], bool]
    mask: Callable[[list[str], Sequence[Any]], np.ndarray]


class _Everything(_Rule):
    key = "everything"

    def match(self, path: str, leaf: Any) -> bool:
        return True

    def mask(self, paths: list[str], leaves: Sequence[Any]) -> np.ndarray:
        return np.ones(len(paths), dtype=bool)


class _Predicate(_Rule):
    """A callable taking ``(path)`` or ``(path, leaf)``, told apart by its signature."""

    def __init__(self, f: Callable[..., Any], name: str) -> None:
        self.f = self.key = f
        self.takes_leaf = _takes_leaf(f, name)

    def match(self, path: str, leaf: Any) -> bool:
        return bool(self.f(path, leaf) if self.takes_leaf else self.f(path))

    def mask(self, paths: list[str], leaves: Sequence[Any]) -> np.ndarray:
        return np.array([self.match(p, a) for p, a in zip(paths, leaves)], dtype=bool)


def _takes_leaf(f: Callable[..., Any], name: str) -> bool:
    try:
        signature = inspect.signature(f)
    except (TypeError, ValueError):  # no signature to read (some builtins): the documented (path, leaf)
        return True
    for args in (("path", "leaf"), ("path",)):
        with contextlib.suppress(TypeError):
            signature.bind(*args)
            return len(args) == 2
    raise TypeError(f"{name}: expected a callable (path) -> bool or (path, leaf) -> bool, "
                    f"got {getattr(f, '__qualname__', type(f).__name__)}{signature}")


class _Paths(_Rule):
    """Leaf paths, matched exactly or by their components, so that ``enc.w``,
    ``['enc'].w`` and ``['enc']['w']`` name the same leaf."""

    def __init__(self, paths: Iterable[str], name: str, required: bool) -> None:
        self.name, self.required = name, required
        self.paths = frozenset(paths)
        for p in self.paths:
            if not isinstance(p, str):
                raise TypeError(f"{name}: expected leaf paths as strings ({PATH_FORMAT}), got {p!r}")
        self.components = {_components(p) for p in self.paths}
        self.key = ("paths", required, self.paths)

    def match(self, path: str, leaf: Any = None) -> bool:
        return path in self.paths or _components(path) in self.components

    def mask(self, paths: list[str], leaves: Sequence[Any]) -> np.ndarray:
        found = np.array([self.match(p) for p in paths], dtype=bool)
        if self.required:
            held = set(paths) | {_components(p) for p in paths}
            unknown = sorted(p for p in self.paths if p not in held and _components(p) not in held)
            if unknown:
                raise ValueError(_unknown_paths(self.name, unknown, paths))
        return found


def _unknown_paths(name: str, unknown: list[str], paths: list[str]) -> str:
    shown = ", ".join(map(repr, paths[:_PATHS_SHOWN])) + (", ..." if len(paths) > _PATHS_SHOWN else "")
    which = ", ".join(map(repr, unknown))
    return (f"{name}: path{'s' * (len(unknown) > 1)} {which} not a trainable leaf of this tree; "
            f"expected one of [{shown}] ({len(paths)} leaves; {PATH_FORMAT})")


_SEGMENT = re.compile(r"""\[('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\]]*)\]|\.?([^.\[]+)""")


def _components(path: str) -> tuple[str, ...]:
    """The keys along ``path``: ``['enc']['layers'][0].weight`` and
    ``enc.layers.0.weight`` both give ('enc', 'layers', '0', 'weight'); a
    bracketed key stays whole, dots and all.

    >>> _components("['a.b'][0].w"), _components("a.b.0.w")
    (('a.b', '0', 'w'), ('a', 'b', '0', 'w'))
    """
    parts = []
    for bracketed, dotted in _SEGMENT.findall(path):
        if not bracketed:
            parts.append(dotted)
            continue
        try:
            parts.append(str(ast.literal_eval(bracketed)))
        except (ValueError, SyntaxError):
            parts.append(bracketed)
    return tuple(parts)


class _Both(_Rule):
    def __init__(self, first: _Rule, second: _Rule) -> None:
        self.first, self.second = first, second
        self.key = ("both", first.key, second.key)

    def match(self, path: str, leaf: Any) -> bool:
        return self.first.match(path, leaf) and self.second.match(path, leaf)

    def mask(self, paths: list[str], leaves: Sequence[Any]) -> np.ndarray:
        return self.first.mask(paths, leaves) & self.second.mask(paths, leaves)


class _Tied(_Rule):
    """Counts every leaf on the owner; elsewhere only the leaves ``selected`` leaves out."""

    def __init__(self, is_owner: bool, selected: _Rule) -> None:
        self.is_owner, self.selected = is_owner, selected
        self.key = ("tied", is_owner, selected.key)

    def match(self, path: str, leaf: Any) -> bool:
        return self.is_owner or not self.selected.match(path, leaf)

    def mask(self, paths: list[str], leaves: Sequence[Any]) -> np.ndarray:
        chosen = self.selected.mask(paths, leaves)  # checks the paths on the owner too
        return np.ones(len(paths), dtype=bool) if self.is_owner else ~chosen


_MASKS_KEPT = 8  # ownership masks remembered per plan
_masks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_masks_lock = threading.Lock()


def _owned_mask(plan: Any, arrays: list, owned: OwnedLike, xp: Any) -> Any:
    """The plan's 0/1 ownership vector on the device of ``xp``, cached weakly per plan."""
    rule = Owned(owned)
    key = (rule._rule.key, xp.__name__)
    with _masks_lock:
        cache = _masks.get(plan)
        if cache is None:
            cache = _masks[plan] = caches.LRU("ownership masks", _MASKS_KEPT)
    return cache.get(key, lambda: xp.asarray(rule._mask([leaf.path for leaf in plan.leaves], arrays)))


# ---------------------------------------------------------------- the norm

def _reduce_norm(local: _Local, p: float, per_leaf: bool) -> tuple[Any, Any, list]:
    """(global total, this rank's per-leaf norms where asked for, the exchanged (ranks, _ROW) packet of each collective).

    This rank's partial is the unrooted total of one fused pass over the
    leaves it counts (all of them, or a plan of the owned ones alone): the
    bits of ``gf.global_norm`` of those leaves, in the kernels' order. Each
    rank writes its own row of a zeroed buffer; one SUM all-reduce fills
    every row everywhere (adding zeros is exact, NaN and inf included), and
    every rank then combines the rows in rank order: the same bits on every
    rank, and a max for ord=inf without a second collective. Over several
    groups (the mesh dimensions of DTensors) the combined rows of one group
    are this rank's row in the next: ranks sharing a row after one group
    share it after the next, so every rank still gets the same bits. A norm
    over one rank is that rank's own pass, root and all.
    """
    xp, kind = local.be.xp, NORMS[norm_kind(p)]
    partial, first_bad = xp.zeros((), np.float64), xp.zeros((), np.float64)
    per = xp.zeros(0, np.float64)
    own_total = None
    if local.arrays:
        plan, arrays, local.counted = _counted(local)
        if plan.leaves:
            result = local.be.norms(plan, arrays, p, per_leaf and local.counted is None)
            partial, own_total = result.power_sum, result.total
            # The first counted slot holding NaN or inf, from the elements (a
            # leaf whose own norm overflows float64 holds neither), plus one.
            first_bad = result.first_nonfinite + 1
            if per_leaf and local.counted is None:
                per = result.per_leaf
        if per_leaf and local.counted is not None:
            per = local.be.norms(local.plan, local.arrays, p, True).per_leaf
    local.first_bad = first_bad
    packets = []
    for comm in local.comms:
        packet = xp.zeros((comm.size, _ROW), np.float64)
        packet[comm.rank, 0] = partial
        packet[comm.rank, 1] = first_bad
        comm.all_reduce(packet.reshape(-1), "global_norm")
        partial = getattr(packet[:, 0], kind.fold)()
        first_bad = packet[:, 1].max()
        packets.append(packet)
    if local.ranks == 1 and own_total is not None:
        return own_total, per, packets
    return kind.kernel_root(partial, p, xp), per, packets


# Plans of the leaves a rank counts, remembered per plan and ownership.
_counted_plans: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _counted(local: _Local) -> tuple[Any, list, Any]:
    """(plan, arrays, slots) of the leaves this rank counts: ``local``'s own
    plan and arrays and None where it counts them all, else a plan of the
    counted ones (kept per plan and ownership, so a device finds its tables
    again) and their slots in ``local.plan``."""
    mask = local.owned_mask(np)
    if mask is None or bool(np.all(mask)):
        return local.plan, local.arrays, None
    slots = np.flatnonzero(mask)
    with _masks_lock:
        cache = _counted_plans.get(local.plan)
        if cache is None:
            cache = _counted_plans[local.plan] = caches.LRU("counted-leaf plans", _MASKS_KEPT)
    plan = cache.get(slots.tobytes(), lambda: _plan_of(local.plan, slots))
    return plan, [local.arrays[i] for i in slots], slots


def _plan_of(plan: Any, slots: np.ndarray) -> Any:
    """A plan of ``plan``'s leaves at ``slots``, laid end to end."""
    from .flatplan import FlatPlan, LeafSpec

    specs, offset = [], 0
    for i in slots:
        leaf = plan.leaves[i]
        specs.append(LeafSpec(leaf.path, offset, leaf.size, leaf.shape, leaf.dtype))
        offset += leaf.size
    return FlatPlan(None, tuple(specs), tuple(range(len(specs))), offset, plan.dtype)


class _RankBound(clipping.Bound):
    """This rank's share of a model spread over ranks, bound for a norm and a
    clip: the norm is :func:`_reduce_norm`'s, over the ranks; a stage
    without gradients joins the collective and scales nothing."""

    def __init__(self, local: _Local, per_leaf: bool = False) -> None:
        part = clipping.Part(local.plan, local.arrays, local.be, local.call.like,
                             path=lambda slot: local.plan.leaves[slot].path)
        super().__init__([part], [part] if local.arrays else [])
        self.local, self.ranks, self.wants_per_leaf = local, local.ranks, per_leaf
        self.per_leaf: Any = None

    @contextlib.contextmanager
    def place(self) -> Iterator[None]:
        """The leaves' device scope and every group's stream."""
        with device_scope(self.local.be, self.local.call.like), self.local.streams():
            yield

    def norm(self, p: float, per_leaf: bool = False) -> clipping.Norm:
        """The norm over the ranks; its per-leaf norms are kept in
        ``per_leaf`` where the bound was made wanting them (``per_leaf`` is
        the clipping Bound's, whose parts' results this norm has none of)."""
        total, per, packets = _reduce_norm(self.local, p, self.wants_per_leaf)
        if self.wants_per_leaf:
            self.per_leaf = self.local.call.result(per)
        return clipping.Norm(self.local.give_back(total), total, packets)

    def culprit(self, norm: clipping.Norm, p: float, name_of: Callable[[int], str] | None = None) -> str | None:
        """The leaf and rank of the first non-finite leaf, the same on every
        rank: the rank holding it sends its path to the others, one group
        after the other (more collectives, on this error path only)."""
        local, text = self.local, None
        first = int(local.be.to_host(local.first_bad))
        if first:
            slot = first - 1 if local.counted is None else int(local.counted[first - 1])
            text = f"leaf {local.plan.leaves[slot].path!r} on rank {local.rank}"
        for comm, packet in zip(local.comms, norm.results):
            culprits = np.flatnonzero(local.be.to_host(packet[:, 1]))
            if culprits.size:
                text = comm.broadcast_text(text if comm.rank == culprits[0] else None, int(culprits[0]))
        return text


class LeafPartials:
    """Per-leaf partials combined over the ranks holding the leaves' shards.

    ``values`` is a (leaves, columns) float64 tensor, a row per DTensor of
    ``owners`` (named ``paths``) in order, that the caller rewrites with
    this rank's partials before each :meth:`reduce_`. The groups and who
    counts each shard are :func:`gpuflat._src.dtensor.sharding`'s, the
    norm's own: a rank zeroes the rows of the leaves it does not count (a
    replicated leaf's whole partial is on every rank of its group), then
    one SUM all-reduce per group fills in every rank's, as the norm
    combines its partial. A column ``maxed`` (an inf-norm's) is combined by
    a max instead: each rank then writes its own row of a zeroed (ranks,
    leaves, columns) packet, which the same one collective fills
    everywhere, and the rows are folded in rank order, as
    :func:`_reduce_norm` does for its max. The buffers are made here and
    at the first max: a reduction reads nothing to the host and allocates
    nothing. The rows of ``values`` must be the same leaves on every rank
    of a group (FSDP2 gives every rank a gradient for the same parameters).

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Shard, distribute_tensor
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> w = distribute_tensor(torch.ones(4), init_device_mesh("cpu", (1,)), [Shard(0)])
    >>> values = torch.tensor([[2.0, 4.0]], dtype=torch.float64)
    >>> over = LeafPartials(values, [w], ["w"])
    >>> over.reduce_(maxed=0); values  # one rank's partials are already the whole's
    tensor([[2., 4.]], dtype=torch.float64)
    >>> dist.destroy_process_group()
    """

    def __init__(self, values: torch.Tensor, owners: Sequence[Any], paths: Sequence[str]) -> None:
        import torch

        found = dtensor.sharding(owners, paths)
        assert found is not None and values.is_contiguous()  # the caller's DTensors, in its own buffer
        self.values = values
        self.comms = [_Comm(group) for group in found.groups]
        unowned = np.flatnonzero(~found.owned)
        self.unowned = torch.as_tensor(unowned, device=values.device) if unowned.size else None
        self.packets: list[torch.Tensor] = []

    def reduce_(self, maxed: int | None = None) -> None:
        """``values`` made the partials of the whole leaves, the same on every
        rank: column ``maxed`` by a max, the others by a sum."""
        import torch

        values = self.values
        if self.unowned is not None:
            values.index_fill_(0, self.unowned, 0.0)
        if maxed is not None and not self.packets:
            self.packets = [values.new_zeros((comm.size, *values.shape)) for comm in self.comms]
        for k, comm in enumerate(self.comms):
            if maxed is None:
                comm.all_reduce(values.view(-1), "global figures")
                continue
            packet = self.packets[k]
            packet.zero_()
            packet[comm.rank].copy_(values)
            comm.all_reduce(packet.view(-1), "global figures")
            for c in range(values.shape[1]):
                fold = torch.amax if c == maxed else torch.sum
                fold(packet[:, :, c], 0, out=values[:, c])


# ---------------------------------------------------------------- all-reduce

def _check_reduce_arguments(op: str, bucket_bytes: int | None) -> None:
    if op not in ("sum", "mean"):
        raise ValueError(f"op: expected 'sum' or 'mean', got {op!r}")
    if bucket_bytes is not None and not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes: expected a number of bytes > 0 or None, got {bucket_bytes!r}")


class ResidentGradients(abc.ABC):
    """A resident model as ``all_reduce_`` reduces it (``gf.Resident`` is
    one): its ``grad_buffers``, its ``layout``, and the leaves whose PyTorch
    gradient is None, which a reduction can give one."""

    layout: tuple

    @abc.abstractmethod
    def _gradless(self) -> frozenset:
        """The leaves (indices into ``layout``) whose PyTorch gradient is None."""

    @abc.abstractmethod
    def _give_grads(self, leaves: list[int]) -> None:
        """Make each of ``leaves`` hold its view into ``grad_buffers`` as its gradient."""


class _Reduction:
    """What all_reduce_ moves, checked before anything moves: contiguous
    buffers (16-bit ones as float32 copies), and where their sums go back."""

    def __init__(self, grads: Any) -> None:
        if is_module(grads):
            grads = _module_grads(grads)
        buffers = getattr(grads, "grad_buffers", None)  # read first: a resident model follows its parameters
        self.leaves = None
        # A resident PyTorch model's parameters: 1 where one has a gradient, 0 where its .grad is None.
        self.resident, self.held = None, np.zeros(0)
        if buffers is not None:
            self.targets = [_checked_buffer(f"grad_buffers[{i}]", b) for i, b in enumerate(buffers)]
            self.like = buffers[0] if buffers else None
            if isinstance(grads, ResidentGradients):
                self.resident, self.held = grads, np.ones(len(grads.layout))
                self.held[sorted(grads._gradless())] = 0
        else:
            call = Call(grads)
            _refuse_dtensors(call)
            checks.check_in_place(call.paths(), call.unique)
            self.plan, self.leaves, self.like = call.plan, call.unique, call.like
            self.backend = call.backend(None)
            with device_scope(self.backend, self.like):
                flat = self.backend.empty(call.plan.size, call.plan.dtype)
                self.backend.gather(call.plan, [[a] for a in call.unique], flat)
            self.targets = [flat]
        # A small float is summed and divided in its row's wider dtype
        # (float32 for 16-bit ones: see layout.DTYPES) and rounded back once.
        with device_scope(None, self.like):
            self.moving = [b.astype(wide) if (wide := wider(b.dtype)) is not None else b for b in self.targets]

    def signature(self) -> tuple:
        """(elements, bytes, resident parameters) moved: every rank must move the same."""
        return sum(b.size for b in self.moving), sum(b.nbytes for b in self.moving), self.held.size

    def gradless(self) -> int:
        """How many of a resident model's parameters have no gradient here."""
        return int(self.held.size - self.held.sum())

    def gradients_given(self, comm: _Comm) -> list[int]:
        """The resident parameters (in layout order) without a gradient here
        that some rank has one for: after the reduction their views hold it."""
        anywhere = self.held.copy()
        comm.sum_on_host(anywhere, "all_reduce_")
        return np.flatnonzero((anywhere > 0) & (self.held == 0)).tolist()

    def finish(self, op: str, size: int) -> None:
        """Divide for "mean", then write the sums back, each rounded once."""
        with device_scope(None, self.like):
            for target, moved in zip(self.targets, self.moving):
                if op == "mean" and size > 1:
                    moved /= size
                if self.leaves is None and moved is not target:
                    target[...] = moved
        if self.leaves is not None:
            with device_scope(self.backend, self.like):
                self.backend.scatter(self.plan, self.moving[0], self.leaves)


def _refuse_dtensors(call: Call) -> None:
    # A DTensor's shards differ from rank to rank: summing them is no gradient.
    path = dtensor.first_path(call.owners(), call.paths())
    if path is not None:
        raise TypeError(f"leaf {path!r}: all_reduce_ expected gradients of the same tensors on every rank, "
                        f"found a DTensor, whose ranks hold different shards (FSDP2 and tensor "
                        f"parallelism reduce their gradients themselves)")


def _module_grads(module: Any) -> dict[str, Any]:
    grads = {}
    for name, param in module_parameters(module):
        if param.grad is None:
            raise ValueError(f"leaf {name!r}: expected a gradient tensor, got None (run backward first, "
                             f"or pass a tree of the gradients to reduce)")
        grads[name] = param.grad
    return grads


def _checked_buffer(name: str, buffer: Any) -> Any:
    """A resident model's gradient buffer, as a NumPy or CuPy view fit for an in-place reduction."""
    view = adopt(buffer)
    if view is None or view.ndim != 1 or not view.flags.c_contiguous:
        found = (f"shape {tuple(view.shape)} with strides {tuple(view.strides)}" if view is not None
                 else type(buffer).__name__)
        raise ValueError(f"{name}: expected a C-contiguous 1-D array, got {found}")
    checks.check_in_place([name], [view])
    return view


def _agree(comm: _Comm, caller: str, failure: Exception | None, reduction: _Reduction | None) -> bool:
    """Every rank's verdict and size, in one small collective before any data
    moves; returns whether some rank's resident model has a parameter
    without a gradient.

    A failure anywhere makes every rank raise: the failing rank its own
    error, the others a CollectiveError naming it (its message travels in a
    second collective, on this error path only). Ranks moving different
    sizes all raise ValueError.
    """
    if comm.size == 1:
        if failure is not None:
            raise failure
        return False
    row = [failure is not None, *reduction.signature(), reduction.gradless()] if reduction else [True, 0, 0, 0, 0]
    rows = comm.gather_rows(row, caller)
    failed = np.flatnonzero(rows[:, 0])
    if failed.size:
        rank = int(failed[0])
        told = comm.broadcast_text(f"{type(failure).__name__}: {failure}" if comm.rank == rank else None, rank)
        if failure is None:
            raise CollectiveError(f"{caller}: rank {rank} of {comm.size} raised before the collective, "
                                  f"so no rank changed anything: {told}")
        raise failure
    if (rows[:, 1:4] != rows[0, 1:4]).any():
        sizes = ", ".join(f"rank {r}: {int(n)} elements ({int(b)} bytes)" + (f" of {int(k)} parameters" if k else "")
                          for r, (n, b, k) in enumerate(rows[:, 1:4]))
        raise ValueError(f"{caller}: expected the same gradients on every rank, got {sizes}; "
                         f"no rank changed anything")
    return bool(rows[:, 4].any())


def _reduce_buffer(comm: _Comm, buf: Any, bucket_bytes: int | None) -> None:
    step = buf.size if bucket_bytes is None else max(1, int(bucket_bytes) // buf.dtype.itemsize)
    xp = np if isinstance(buf, np.ndarray) else sys.modules["cupy"]
    with comm.stream(xp):
        for start in range(0, buf.size, max(step, 1)):
            comm.all_reduce(buf[start : start + step], "all_reduce_")


class _Comm:
    """A process group or communicator seen as (rank, size, in-place SUM all-reduce)."""

    def __init__(self, group: Any) -> None:
        self.group, self.kind = group, _kind_of(group)
        if self.kind == "mpi":
            self.rank, self.size = group.Get_rank(), group.Get_size()
        elif self.kind == "torch":
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.size = 0, 1

    def all_reduce(self, buf: Any, caller: str) -> None:
        """Sum the contiguous 1-D ``buf`` (NumPy, CuPy or a tensor) over the ranks, in place."""
        if self.kind is None or buf.size == 0:
            return
        try:
            if self.kind == "mpi":
                _mpi_all_reduce(self.group, buf)
            else:
                import torch.distributed as dist

                dist.all_reduce(_torch_view(buf), group=self.group)
        except RuntimeError as err:
            raise CollectiveError(
                f"{caller}: the all-reduce over {self.size} ranks failed on rank {self.rank}; "
                f"another rank probably raised before reaching it, or left the group ({err})"
            ) from err

    def broadcast_text(self, text: str | None, root: int) -> str | None:
        """``text`` as rank ``root`` holds it, on every rank."""
        if self.kind == "mpi":
            return self.group.bcast(text, root=root)
        if self.kind == "torch":
            import torch.distributed as dist

            box = [text]
            # None names the default group, which torch's rank lookup does not take.
            source = root if self.group is None else dist.get_global_rank(self.group, root)
            dist.broadcast_object_list(box, src=source, group=self.group)
            return box[0]
        return text

    def gather_rows(self, row: Sequence[float], caller: str) -> np.ndarray:
        """Every rank's ``row`` of a few numbers, as a (ranks, len(row)) float64 host array."""
        packet = np.zeros((self.size, len(row)))
        packet[self.rank] = row
        self.sum_on_host(packet.reshape(-1), caller)
        return packet

    def sum_on_host(self, packet: np.ndarray, caller: str) -> None:
        """Sum the contiguous 1-D float64 host array ``packet`` over the ranks, in place."""
        if self.nccl():  # NCCL moves device memory only
            import torch

            on_device = torch.from_numpy(packet).cuda()
            self.all_reduce(on_device, caller)
            packet[...] = on_device.cpu().numpy()
        else:
            self.all_reduce(packet, caller)

    def nccl(self) -> bool:
        """Whether the group runs on NCCL, so even an empty shard's buffer lives on the GPU."""
        if self.kind != "torch":
            return False
        import torch.distributed as dist

        return dist.get_backend(self.group) == "nccl"

    def stream(self, xp: Any) -> contextlib.AbstractContextManager[Any]:
        """CuPy work on PyTorch's current stream, where NCCL collectives are ordered."""
        if self.kind != "torch" or xp is np:
            return contextlib.nullcontext()
        import torch

        return external_stream(xp, torch.cuda.current_stream().cuda_stream)


def _kind_of(group: Any) -> str | None:
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(group, mpi.Comm):
        return "mpi"
    dist = sys.modules.get("torch.distributed")
    if group is None:
        return "torch" if dist is not None and dist.is_available() and dist.is_initialized() else None
    if dist is not None and isinstance(group, dist.ProcessGroup):
        return "torch"
    raise TypeError(f"group: expected a torch.distributed ProcessGroup, an mpi4py communicator "
                    f"or None, got {type(group).__module__}.{type(group).__name__}")


def _mpi_all_reduce(comm: Any, buf: Any) -> None:
    from mpi4py import MPI

    if not isinstance(buf, np.ndarray):
        # A CUDA-aware MPI reads device memory directly, but does not wait for
        # kernels still running on the stream that writes it.
        sys.modules["cupy"].cuda.get_current_stream().synchronize()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


def _torch_view(buf: Any) -> torch.Tensor:
    """``buf`` as a tensor sharing its memory."""
    import torch

    if isinstance(buf, torch.Tensor):
        return buf
    return torch.from_numpy(buf) if isinstance(buf, np.ndarray) else torch.from_dlpack(buf)


# ---------------------------------------------------------------- local leaves

class _Local:
    """This rank's tree: plan, unique trainables (NumPy or CuPy views) and
    backend, the groups its partial is reduced over and what it owns."""

    def __init__(self, tree: Any, backend: str | None, group: Any, owned: OwnedLike | None,
                 pp_mesh: Any = None, tied: Any = None) -> None:
        self.call = Call(tree)
        self.plan, self.arrays = self.call.plan, list(self.call.unique)
        pipeline = _pipeline(pp_mesh, tied)
        paths = self.call.paths()
        self.sharding = dtensor.sharding(self.call.owners(), paths, pipeline.mesh if pipeline else None)
        if self.sharding is None:  # plain leaves, or none: a stage without gradients joins its peers here
            if pipeline is not None:
                pipeline.check_plain(group, paths, self.call.owners())
                group = pipeline.reduced_over()
            comm = _Comm(group)
            self.comms, self.owned, self.rank, self.ranks = [comm], owned, comm.rank, comm.size
            self.mesh = None
        else:
            _refuse_group_and_owned(group, owned, paths[0])
            import torch.distributed as dist

            self.comms = [_Comm(g) for g in self.sharding.groups]
            self.owned, self.rank, self.ranks = None, dist.get_rank(), self.sharding.ranks
            if pipeline is not None and not self.sharding.stages_joined:
                self.comms.append(_Comm(pipeline.reduced_over()))
                self.ranks *= pipeline.stages
            # Stages combined: no one mesh holds the norm, as no one stage does.
            self.mesh = self.sharding.mesh if pipeline is None else None
        self.elsewhere = None if pipeline is None or tied is None else pipeline.elsewhere(tied, self.call)
        self.first_bad = 0
        self.counted = None  # the slots of the leaves this rank counts, where not all
        if not self.arrays and any(comm.nccl() for comm in self.comms):
            # No local gradients, but NCCL still needs a device buffer to join in.
            self.be = get_backend(backend or "cuda")
        else:
            self.be = self.call.backend(backend)

    def owned_mask(self, xp: Any) -> Any:
        """The 0/1 vector of the leaves this rank counts, or None for all of them."""
        if self.sharding is not None:
            mask = xp.asarray(self.sharding.owned)
        else:
            mask = None if self.owned is None else _owned_mask(self.plan, self.arrays, self.owned, xp)
        if self.elsewhere is None:
            return mask
        here = xp.asarray(~self.elsewhere)
        return here if mask is None else mask & here

    def streams(self) -> contextlib.AbstractContextManager[Any]:
        """Every group's stream context (one stream: PyTorch's current one)."""
        return self.comms[0].stream(self.be.xp) if self.comms else contextlib.nullcontext()

    def check_in_place(self) -> None:
        checks.check_in_place([leaf.path for leaf in self.plan.leaves], self.arrays)

    def give_back(self, x: Any) -> Any:
        """A result standing for the whole tree in the caller's kind: a tensor for
        PyTorch leaves, a DTensor replicated over the mesh for DTensors on one
        mesh (a plain tensor where no one mesh holds the norm)."""
        if self.mesh is not None:
            return dtensor.replicated(self.call.result(x), self.mesh)
        return self.call.result(x)


class _Pipeline:
    """The pipeline stages ``pp_mesh=`` names: a 1-D DeviceMesh over them
    (``mesh``), or a process group; this rank's ``stage`` of ``stages``."""

    mesh: Any

    def __init__(self, pp_mesh: Any) -> None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        if isinstance(pp_mesh, DeviceMesh):
            if pp_mesh.ndim != 1:
                raise ValueError(f"pp_mesh: expected a 1-D DeviceMesh over the pipeline stages "
                                 f"(e.g. mesh['pp']), got {pp_mesh}")
            self.mesh, group = pp_mesh, pp_mesh.get_group()
        elif isinstance(pp_mesh, dist.ProcessGroup):
            self.mesh, group = None, pp_mesh
        else:
            raise TypeError(f"pp_mesh: expected a DeviceMesh or a torch.distributed ProcessGroup over the "
                            f"pipeline stages, or None, got {type(pp_mesh).__module__}.{type(pp_mesh).__name__}")
        self.group, self.stage, self.stages = group, dist.get_rank(group), dist.get_world_size(group)
        if self.stage < 0:
            raise ValueError(f"pp_mesh: expected a group holding this rank ({dist.get_rank()}), got one over "
                             f"ranks {dist.get_process_group_ranks(group)}")

    def reduced_over(self) -> Any:
        """The group the stages' partials are combined over where the leaves'
        meshes do not combine them: the process group given, or for a mesh
        every rank of its root (``dtensor.pipeline_group``), found from the
        mesh alone, as a stage holding nothing must find it."""
        return self.group if self.mesh is None else dtensor.pipeline_group(self.mesh)

    def check_plain(self, group: Any, paths: list[str], owners: list) -> None:
        """Plain leaves beside ``pp_mesh``: only where each stage is one rank,
        as nothing says whether a stage's other ranks hold copies or shards."""
        import torch.distributed as dist

        if group is not None:
            raise ValueError(f"group: expected None beside pp_mesh, which names the group the stages' norms "
                             f"are combined over, got {group!r}")
        world = dist.get_world_size()
        if paths and world > self.stages:
            found = type(owners[0]).__name__ if owners[0] is not None else "a NumPy or CuPy array"
            raise TypeError(
                f"leaf {paths[0]!r}: expected a DTensor beside pp_mesh where a stage spans several ranks "
                f"({self.stages} stages in a world of {world} ranks), found {found}: a plain leaf does not "
                f"say whether the other ranks of its stage hold copies of it (DDP) or other shards (ZeRO), "
                f"and a copy would be counted on every rank; make it a DTensor (fully_shard, or "
                f"DTensor.from_local with its placements), or, for copies, pass the pipeline's process "
                f"group as group= (and owned=gfd.tied(...) for a tied weight) instead of pp_mesh")

    def owner_stages(self, tied: Iterable) -> list[tuple[Any, int]]:
        """``tied`` checked: (leaf, owning stage) pairs, each stage one of pp_mesh's."""
        pairs = []
        for i, entry in enumerate(tied):
            if not isinstance(entry, (tuple, list)) or len(entry) != 2:
                raise TypeError(f"tied[{i}]: expected a pair (weight, owning stage), got "
                                f"{type(entry).__name__}")
            leaf, stage = entry
            if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < self.stages:
                raise ValueError(f"tied[{i}]: expected the owning stage, 0 to {self.stages - 1} (pp_mesh has "
                                 f"{self.stages} stages), got {stage!r}")
            pairs.append((leaf, stage))
        return pairs

    def elsewhere(self, tied: Iterable, call: Call) -> np.ndarray:
        """Per slot of ``call``, True for a weight of ``tied`` that another stage counts."""
        owners, arrays = call.owners(), call.unique
        elsewhere = np.zeros(len(arrays), dtype=bool)
        for i, (leaf, stage) in enumerate(self.owner_stages(tied)):
            if leaf is None:
                continue
            slot = next((k for k, (o, a) in enumerate(zip(owners, arrays)) if leaf is o or leaf is a), None)
            if slot is None:
                raise _not_given(i, leaf)
            elsewhere[slot] = stage != self.stage
        return elsewhere


def _pipeline(pp_mesh: Any, tied: Any) -> _Pipeline | None:
    """The _Pipeline of ``pp_mesh``, None without it (then ``tied`` is refused)."""
    if pp_mesh is not None:
        return _Pipeline(pp_mesh)
    if tied is not None:
        raise ValueError("tied: expected pp_mesh= beside it, the pipeline whose stages own the tied "
                         "weights, got tied= without pp_mesh=")
    return None


def _not_given(i: int, leaf: Any) -> ValueError:
    shape = tuple(getattr(leaf, "shape", ()))
    return ValueError(f"tied[{i}]: expected one of the leaves given, found a {type(leaf).__name__} "
                      f"of shape {shape} that is none of them")


def _refuse_group_and_owned(group: Any, owned: OwnedLike | None, path: str) -> None:
    for name, value in (("group", group), ("owned", owned)):
        if value is not None:
            raise ValueError(f"{name}: expected None for a tree of DTensors, whose mesh and placements say "
                             f"which ranks hold and count each leaf (leaf {path!r} is a DTensor), "
                             f"got {value!r}")
