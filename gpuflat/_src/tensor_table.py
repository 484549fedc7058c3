"""PyTorch tensors as leaf tables read from their metadata, with no per-tensor import.

``gpuflat.torch``'s drop-ins get the gradients of the same parameters every
step. Importing a tensor (``Tensor.numpy()``, or DLPack on CUDA) costs
microseconds; on 10,000 tiny gradients the imports alone took longer than
PyTorch's foreach clip. Here the tensors of a call become
:class:`~gpuflat._src.backends.protocol.LeafRows` straight from each one's
``data_ptr()``, shape, strides and dtype: the table the CUDA kernels and the
native host library read. What a call works out is kept, keyed by what
decides it: each tensor's address, element count, dtype and contiguity
(shapes and strides too where some tensor is not contiguous). A training
loop's next step finds its table again whether it clips the very same
gradient tensors or new ones in the same memory (``optimizer.zero_grad()``
sets gradients to None by default, and the next backward allocates new ones,
usually where the last ones were): the tensors' facts read in one native
pass (``gpuflat._src.tensor_facts``), then the kernels. Where the memory moved,
the rows are rebuilt from the metadata with the plan and the rows' layout
found again; nothing is imported.

Addresses are unique across the CPU and every CUDA device of a process
(CUDA's unified virtual addressing), so equal addresses mean the same memory.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np
import torch

from . import caches, dtensor, tensor_facts
from .arrays import adopt, plain_tensor, tensor_refusal
from .layout import ITEMSIZES, LEAF_ROW_WORDS, MAX_DIMS, leaf_row
from .backends.protocol import LeafRows
from .backends.selection import get_backend, host_default
from .clipping import Bound, Part
from .checks import check_in_place, may_overlap_itself, overlapping_itself, sharing_memory
from .dtypes import FROM_PACKAGE, TAGS, imported, torch_dtype
from ..errors import NonFloatingTensorError, UnsupportedLeafError
from .flatplan import FlatPlan, cached
from .overlap import first_pair, really_overlap
from .tree import walk

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Sequence
    from typing import Literal, TypeAlias

    from .backends.protocol import Backend, NormResult

    # What decides the tensors' layout: True when every tensor is
    # contiguous, else (their shapes, their strides in elements).
    LayoutKey: TypeAlias = "Literal[True] | tuple[tuple[Any, ...], tuple[Any, ...]]"

TABLES_KEPT = 8  # calls remembered: a few clips and norms over different tensor lists
for _name in FROM_PACKAGE:  # each in TAGS from now on where its package is installed
    imported(_name)
_NUMPY_DTYPES: dict[torch.dtype, np.dtype] = {torch_dtype(d.name): d for d in TAGS}
_ITEMSIZE_BY_TAG = np.array(ITEMSIZES, np.int64)
# Whether gpuflat holds each dtype of tensor_facts.DTYPES, by its code.
_HELD_CODES = np.array([d in _NUMPY_DTYPES for d in tensor_facts.DTYPES])

_shape, _dtype, _device, _layout = attrgetter("shape"), attrgetter("dtype"), attrgetter("device"), attrgetter("layout")
_override: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("gpuflat_tensor_backend", default=None)


@dataclass(frozen=True, eq=False)
class Group:
    """The tensors of one device in a call: their positions in the call's
    list (``members``), plan, backend, leaves (LeafRows, or NumPy views
    where the backend reads arrays only) and device."""

    members: tuple[int, ...]
    plan: FlatPlan
    backend: Backend
    leaves: LeafRows | list[Any]
    device: torch.device


@dataclass(frozen=True, eq=False)
class Reading:
    """What decides a table, read from the tensors each call: their facts
    (``gpuflat._src.tensor_facts``: address, element count, and a code for the
    dtype, contiguity, device and conjugate or negative bit; one native
    pass), their layout (True when every tensor is contiguous,
    else their shapes and strides) and the backend :func:`serve_with` put in
    place."""

    facts: np.ndarray
    layout: LayoutKey
    override: Backend | None

    @functools.cached_property
    def key(self) -> bytes:
        # Bytes compare with memcmp and stop at the first difference: a
        # table of other tensors is told apart at its first address.
        return self.facts.tobytes()

    def same(self, other: Reading) -> bool:
        return self.override is other.override and self.key == other.key and self.layout == other.layout


class _Described(NamedTuple):
    """The tensors' facts, one tuple per field, as a table is built from them."""

    pointers: tuple[int, ...]
    numels: tuple[int, ...]
    dtypes: tuple[torch.dtype, ...]
    layout: LayoutKey


@dataclass(frozen=True)
class UpdateRows:
    """One device's and dtype's rows of an optimizer step's update (the
    parameter rows of ``gpuflat._src.param_rows``), the backend serving
    them, a tensor placing their work (its device, its stream), and the
    rows' positions in the step's parameters (None: all of them, in order)."""

    rows: np.ndarray
    like: torch.Tensor
    backend: Backend
    positions: np.ndarray | None = None


@dataclass(eq=False)
class Table:
    """The tensors of one call as the rows the kernels read, whatever the
    front end: ``groups``, the rows of a norm (and of its check and scale)
    by device; ``updates``, the rows of an optimizer step's update by
    device and dtype (none for a norm or a clip; a step's table has norm
    rows where it reads its gradients' norm). With them, the dtype PyTorch
    returns the norm in, what the tensors were recognised by (their
    Reading, and where an address repeats, which of them were the same
    tensor: :func:`_ties`) and whether they were found fit for an in-place
    write."""

    groups: list[Group]
    returned_dtype: torch.dtype = torch.float64
    reading: Reading | None = None
    ties: tuple[int, ...] | None = None
    fit_in_place: bool = False
    updates: list[UpdateRows] = field(default_factory=list)

    @functools.cached_property
    def bound(self) -> Bound:
        """The tensors bound for a norm, a check and a scale
        (``gpuflat._src.clipping``): one part per device, placed by a tensor
        of no elements there (the work needs only the device and its current
        stream, and a table kept for later calls must hold none of a call's
        tensors), their totals combined in PyTorch on the first device; a
        leaf is named by its position in the call's list.

        >>> from gpuflat._src import clipping
        >>> ts = [torch.tensor([3.0]), torch.tensor([4.0])]
        >>> clipping.total_norm(read(ts, str).bound, 2.0).total
        tensor(5., dtype=torch.float64)
        """
        parts = [Part(g.plan, g.leaves, g.backend, _placed_on(g.device), positions=g.members) for g in self.groups]
        return Bound(parts, combine=None if len(parts) == 1 else _combined_in_torch, total_for=_total_for)


_tables = caches.Recent("tensor tables", TABLES_KEPT)
_plans = caches.LRU("tensor-list plans", TABLES_KEPT)  # by (numels, dtypes)
_templates = caches.LRU("tensor-list rows", TABLES_KEPT)  # rows but their addresses, by (numels, dtypes, layout)
# What an optimizer step's gradients decide but their addresses (of_gradients), by
# their facts but the addresses and the backend put in place.
_gradient_layouts = caches.LRU("optimizer gradient layouts", TABLES_KEPT)


@contextlib.contextmanager
def serve_with(backend: Backend) -> Iterator[None]:
    """Run the tensors of every device on ``backend`` inside the context.

    The emulated CUDA backend over CPU tensors runs the CUDA path (rows,
    kernels, device tables) where there is no GPU; a backend whose runtime
    records launches without running them times the host work alone.

    >>> import torch, gpuflat.torch as gft
    >>> from gpuflat._src.backends import get_backend
    >>> with serve_with(get_backend("emulated")):
    ...     float(gft.get_total_norm([torch.tensor([3.0, 4.0])]))
    5.0
    """
    token = _override.set(backend)
    try:
        yield
    finally:
        _override.reset(token)


def served_with() -> Backend | None:
    """The backend :func:`serve_with` put in place, else None.

    >>> from gpuflat._src.backends import get_backend
    >>> with serve_with(get_backend("numpy")):
    ...     served_with().name
    'numpy'
    """
    return _override.get()


def read(tensors: list[torch.Tensor], name_of: Callable[[int], str], in_place: bool = False,
         facts: np.ndarray | None = None) -> Table | None:
    """The table of ``tensors`` (each counted once), checked, and with
    ``in_place`` checked fit to be written in place; None when some are
    DTensors (``gpuflat._src.ranks`` reduces those). ``name_of(i)`` names
    ``tensors[i]`` in errors; ``facts``: theirs, if already read
    (``tensor_facts.gradients``).

    >>> import torch
    >>> t = read([torch.ones(2), torch.ones(3, dtype=torch.float64)], lambda i: f"tensors[{i}]")
    >>> [g.plan.size for g in t.groups], t.returned_dtype
    ([5], torch.float64)
    """
    reading = _reading(tensors, tensor_facts.of_tensors(tensors) if facts is None else facts)
    table = _remembered(reading, tensors) if reading is not None else None
    if table is None:
        table = _build(tensors, reading, name_of)
        if table is None:
            return None
    if in_place and not table.fit_in_place:
        _check_in_place(table, tensors, name_of)
        table.fit_in_place = True
    return table


def of_gradients(grads: list[torch.Tensor], starts: np.ndarray, facts: np.ndarray) -> Table | None:
    """The table of an optimizer step's gradients, from what its parameter
    rows hold already (``gpuflat._src.param_rows``): ``facts``, their tensor
    facts, and ``starts``, the lowest address of the dense block each
    fills, read as one dense leaf (in memory order, as every norm reads a
    leaf that fills one block in another order than C's). Each parameter's
    gradient counts, as ``torch.nn.utils.clip_grad_norm_`` over the
    parameters counts it. The plan and rows but the addresses are kept by
    what decides them, so new gradient tensors cost one copy of the rows.
    None where the gradients lie on several devices or their backend reads
    arrays, not rows: :func:`read` decides those.

    >>> ts = [torch.tensor([3.0]), torch.tensor([4.0], dtype=torch.float64)]
    >>> facts = tensor_facts.of_tensors(ts)
    >>> float(norm_pass(of_gradients(ts, facts[:, 0].copy(), facts), 2.0)[0])
    5.0
    """
    reading = Reading(facts, True, _override.get())
    layout = _gradient_layouts.get((facts[:, 1:].tobytes(), reading.override), lambda: _gradient_layout(grads, facts))
    return None if layout is None else layout.table(reading, starts)


def of_step(rows: np.ndarray, buckets: list[np.ndarray], params: Sequence[torch.Tensor],
            gradients: tuple[list[torch.Tensor], np.ndarray, np.ndarray, Callable[[int], str]] | None = None) -> Table:
    """The table of an optimizer step: its update rows (``rows``, the
    parameter rows ``gpuflat._src.param_rows`` made, split by device and
    dtype at ``buckets``, each placed by its first parameter of
    ``params``) and, where ``gradients`` are given (the step reads their
    norm), their norm rows: (the gradients, their facts, the lowest
    address of each one's dense block, a function naming the i-th), as
    :func:`of_gradients` gives them, or :func:`read` where it gives none.

    >>> from gpuflat._src.layout import PARAM_ROW_WORDS
    >>> g = [torch.tensor([3.0]), torch.tensor([4.0])]
    >>> facts = tensor_facts.of_tensors(g)
    >>> rows = np.zeros((2, PARAM_ROW_WORDS), np.int64)  # as gpuflat._src.param_rows fills them
    >>> table = of_step(rows, [np.arange(2)], g, (g, facts, facts[:, 0].copy(), str))
    >>> len(table.updates), float(norm_pass(table, 2.0)[0])
    (1, 5.0)
    """
    norm: Table | None = None
    if gradients is not None:
        grads, facts, starts, name_of = gradients
        norm = of_gradients(grads, starts, facts) or read(grads, name_of, facts=facts)
        assert norm is not None  # a step's plain gradients: read gives None only for DTensors
    # The norm's backend where one serves every gradient: the parameters' too.
    shared = norm.groups[0].backend if norm is not None and len(norm.groups) == 1 else None

    def serving(like: torch.Tensor) -> Backend:
        return shared if shared is not None else backend_for(like.device)

    if len(buckets) == 1:
        updates = [UpdateRows(rows, params[0], serving(params[0]))]
    else:
        updates = []
        for members in buckets:
            like = params[int(members[0])]
            updates.append(UpdateRows(rows[members], like, serving(like), members))
    if norm is None:
        return Table([], updates=updates)
    table = Table(norm.groups, norm.returned_dtype, norm.reading, norm.ties, norm.fit_in_place, updates)
    # The norm rows' bound, kept with the norm's table: made once while the gradients' memory repeats.
    table.__dict__["bound"] = norm.bound
    return table


class _GradientLayout:
    """What an optimizer step's gradients decide but their addresses, and
    the last tables made from it (apart from :func:`read`'s: a step's
    gradients count per parameter, never as ties), found again by their
    facts, addresses included: the same gradients as a recent step's (their
    memory reused) get its table, whose rows a device holds already."""

    RECENT = 4  # tables kept: a loop alternating a few sets of gradient memory finds each

    def __init__(self, plan: FlatPlan, template: np.ndarray, returned: torch.dtype, device: torch.device,
                 backend: Backend) -> None:
        self.plan, self.template, self.returned, self.device, self.backend = plan, template, returned, device, backend
        self.members = tuple(range(len(template)))
        self.recent: list[Table] = []
        self.lock = threading.Lock()

    def table(self, reading: Reading, starts: np.ndarray) -> Table:
        """The table of gradients read as ``reading``, starting at ``starts``."""
        with self.lock:
            for k, kept in enumerate(self.recent):
                if cast(Reading, kept.reading).same(reading):
                    self.recent.append(self.recent.pop(k))
                    return kept
        words = self.template.copy()
        words[:, 0] = starts
        table = Table([Group(self.members, self.plan, self.backend, LeafRows(words), self.device)], self.returned,
                      reading, None)
        with self.lock:
            self.recent = [*self.recent[1 - self.RECENT:], table]
        return table


def _gradient_layout(grads: list[torch.Tensor], facts: np.ndarray) -> _GradientLayout | None:
    """What :func:`of_gradients` keeps, or None (several devices, or a backend reading arrays)."""
    keys = tensor_facts.device_keys(facts)
    if not len(grads) or (keys != keys[0]).any():
        return None
    device = grads[0].device
    backend = backend_for(device)
    if not getattr(backend, "reads_rows", False):
        return None
    numels = tuple(facts[:, 1].tolist())
    dtypes = tuple(map(tensor_facts.DTYPES.__getitem__, tensor_facts.dtype_codes(facts).tolist()))
    template = _template(numels, dtypes, True)
    assert template is not None  # 1-D leaves fit a row
    return _GradientLayout(_plan(numels, dtypes), template, returned_dtype(dtypes), device, backend)


def _reading(tensors: list[torch.Tensor], facts: np.ndarray | None) -> Reading | None:
    """The tensors' Reading; None for tensors checked in full when built (of a
    type that is no plain tensor, or without storage of their own: no facts)."""
    if facts is None:
        return None
    layout: LayoutKey = (True if np.all(facts[:, 2] & tensor_facts.CONTIGUOUS)
              else (tuple(map(_shape, tensors)), tuple(map(torch.Tensor.stride, tensors))))
    return Reading(facts, layout, _override.get())


def _ties(tensors: Iterable[object]) -> tuple[int, ...]:
    """For each tensor, the position of the first one that is the same object."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(t), i) for i, t in enumerate(tensors))


def _remembered(reading: Reading, tensors: list[torch.Tensor]) -> Table | None:
    # Repeated addresses are the same tensor passed twice (counted once) or
    # two views of one memory (counted twice): which, is read again.
    return _tables.find(lambda table: table.reading.same(reading)
                        and (table.ties is None or table.ties == _ties(tensors)))


# ---------------------------------------------------------------- building

def _build(tensors: list[torch.Tensor], reading: Reading | None, name_of: Callable[[int], str]) -> Table | None:
    if not _all_plain(tensors, name_of):
        return None
    if reading is None or not _all_readable(reading.facts):
        _check_readable(tensors, name_of)
    facts = _described(tensors, reading)
    ties = _ties(tensors) if len(set(facts.pointers)) < len(tensors) else None
    # A tensor passed twice counts once.
    unique = range(len(tensors)) if ties is None else [i for i, first in enumerate(ties) if first == i]
    devices = tensor_facts.device_keys(reading.facts).tolist() if reading else list(map(_device, tensors))
    table = Table(_groups(tensors, unique, devices, facts, name_of), returned_dtype(facts.dtypes), reading, ties)
    if reading is not None and all(isinstance(g.leaves, LeafRows) for g in table.groups):
        _tables.add(table)
    return table


def _described(tensors: list[torch.Tensor], reading: Reading | None) -> _Described:
    """The facts as tuples: from the Reading, or read in full (then never remembered)."""
    if reading is None:
        return _Described(tuple(map(torch.Tensor.data_ptr, tensors)), tuple(map(torch.Tensor.numel, tensors)),
                          tuple(map(_dtype, tensors)),
                          (tuple(map(_shape, tensors)), tuple(map(torch.Tensor.stride, tensors))))
    codes = tensor_facts.dtype_codes(reading.facts).tolist()
    return _Described(tuple(reading.facts[:, 0].tolist()), tuple(reading.facts[:, 1].tolist()),
                      tuple(map(tensor_facts.DTYPES.__getitem__, codes)), reading.layout)


def _all_plain(tensors: list[torch.Tensor], name_of: Callable[[int], str]) -> bool:
    """False if some tensor is a DTensor; raises for anything else that is
    not a tensor gpuflat can read."""
    for cls in set(map(type, tensors)) - tensor_facts.PLAIN:
        i = next(i for i, t in enumerate(tensors) if type(t) is cls)
        if dtensor.is_dtensor(tensors[i]):
            return False
        if not isinstance(tensors[i], torch.Tensor):
            raise TypeError(f"leaf {name_of(i)!r}: expected a torch.Tensor, found {cls.__qualname__}")
        _named(name_of(i), plain_tensor, tensors[i])
    return True


def _all_readable(facts: np.ndarray) -> bool:
    """Whether the tensors of these facts are all of a dtype gpuflat holds, on
    the CPU or a CUDA device, with no conjugate or negative bit (they are
    strided: only strided tensors have facts)."""
    kinds = tensor_facts.device_keys(facts) & 255
    return bool(_HELD_CODES[tensor_facts.dtype_codes(facts)].all() and ((kinds == 1) | (kinds == 2)).all()
                and not (facts[:, 2] & tensor_facts.LAZY_VIEW).any())


def _check_readable(tensors: list[torch.Tensor], name_of: Callable[[int], str]) -> None:
    """Every tensor floating point, strided, on the CPU or a CUDA device, with
    no conjugate or negative bit: one pass per property, and a pass per
    tensor only to name the first that is not."""
    if (set(map(_dtype, tensors)) <= _NUMPY_DTYPES.keys() and set(map(_layout, tensors)) == {torch.strided}
            and {d.type for d in map(_device, tensors)} <= {"cpu", "cuda"}
            and not any(map(torch.Tensor.is_conj, tensors)) and not any(map(torch.Tensor.is_neg, tensors))):
        return
    check_floating(tensors, name_of)
    for i, t in enumerate(tensors):
        _named(name_of(i), _readable, t)


def check_floating(tensors: Iterable[torch.Tensor], name_of: Callable[[int], str]) -> None:
    """NonFloatingTensorError naming (``name_of(i)``) the first tensor that is
    neither floating point nor complex: an integer or bool tensor has no
    trainable values, and PyTorch's vector_norm refuses it too.

    >>> check_floating([torch.ones(2), torch.ones(2, dtype=torch.int64)], "tensors[{}]".format)
    Traceback (most recent call last):
    ...
    gpuflat.errors.NonFloatingTensorError: leaf 'tensors[1]': expected a floating point or complex tensor, found dtype torch.int64
    """
    for i, t in enumerate(tensors):
        if not (t.is_floating_point() or t.is_complex()):
            raise NonFloatingTensorError(f"leaf {name_of(i)!r}: expected a floating point or "
                                         f"complex tensor, found dtype {t.dtype}")


def _readable(t: torch.Tensor) -> None:
    refusal = tensor_refusal(t)
    if refusal is None and t.dtype not in _NUMPY_DTYPES:
        refusal = f"expected a tensor of a dtype gpuflat holds, found {t.dtype}"
    if refusal is not None:
        raise UnsupportedLeafError(refusal)


def _named(name: str, check: Callable[[Any], object], t: Any) -> None:
    try:
        check(t)
    except TypeError as err:
        raise type(err)(f"leaf {name!r}: {err}") from None


def _combined_in_torch(bound: Bound, results: Sequence[NormResult], p: float) -> tuple[torch.Tensor, None]:
    """The norm of the parts' norms, each in PyTorch on its own device first."""
    totals: list[torch.Tensor] = []
    for part, result in zip(bound.norm_parts, results):
        with bound.within(part):
            totals.append(part.result(result.total))
    device = totals[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(device) for n in totals]), p), None


@caches.function(maxsize=TABLES_KEPT)
def _placed_on(device: torch.device) -> torch.Tensor:
    """A tensor of no elements on ``device``, kept: where work for tensors
    there runs (the device, its current stream) and what kind its results take."""
    return torch.empty(0, device=device)


def _total_for(part: Part, total: Any) -> Any:
    """A norm given as a tensor (or a number), as ``part``'s backend reads it: on its device."""
    return adopt(torch.as_tensor(total, dtype=torch.float64).to(part.like.device))


def norm_pass(table: Table, p: float, detect: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the float64 norm of order ``p`` of all of ``table``'s tensors, as a
    0-d tensor on the first one's device; with ``detect``, a 0-d float64
    tensor beside it: 1 where some tensor holds NaN or inf (from the
    elements themselves, not the norm, which can overflow alone), else
    None), one fused pass per device.

    >>> ts = [torch.tensor([3.0]), torch.tensor([4.0, float("nan")])]
    >>> total, nonfinite = norm_pass(read(ts, str), 2.0, detect=True)
    >>> total.dtype, float(nonfinite)
    (torch.float64, 1.0)
    """
    total, nonfinite, _ = leaf_norm_pass(table, p, detect, per_leaf=False)
    return total, nonfinite


def leaf_norm_pass(table: Table, p: float, detect: bool = False,
                   per_leaf: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """:func:`norm_pass`, and from the same pass, with ``per_leaf``, each
    tensor's float64 norm in the table's order (None where the table spans
    several devices, whose passes are apart).

    >>> ts = [torch.tensor([3.0]), torch.tensor([4.0, 0.0])]  # held: a table holds their addresses only
    >>> total, _, leaves = leaf_norm_pass(read(ts, str), 2.0)
    >>> float(total), leaves.tolist()
    (5.0, [3.0, 4.0])
    """
    bound = table.bound
    with bound.place():
        norm = bound.norm(p, per_leaf)
        leaves = None
        if per_leaf and len(bound.norm_parts) == 1:
            leaves = bound.norm_parts[0].result(norm.results[0].per_leaf)
        if not detect:
            return norm.total, None, leaves
        firsts: list[torch.Tensor] = []
        for part, result in zip(bound.norm_parts, norm.results):
            with bound.within(part):
                firsts.append(part.result(result.first_nonfinite))
    device = norm.total.device
    return norm.total, (torch.stack([f.to(device) for f in firsts]) >= 0).any().double(), leaves


def returned_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype PyTorch returns a norm of tensors of ``dtypes`` in: their promoted real dtype.

    >>> returned_dtype([torch.bfloat16, torch.complex64, torch.float16])
    torch.float32
    """
    # A dict rather than dtype.to_real(), which TorchDynamo cannot trace.
    return functools.reduce(torch.promote_types, {_REAL.get(d, d) for d in set(dtypes)})


_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _groups(tensors: list[torch.Tensor], unique: Sequence[int], devices: list[Any], facts: _Described,
            name_of: Callable[[int], str]) -> list[Group]:
    """The unique tensors grouped by their ``devices`` (anything equal for
    tensors on the same device), each group with its plan, backend and leaves."""
    by_device: dict[Any, list[int]]
    if len(set(devices)) == 1:  # the common case, without a pass per tensor in Python
        by_device = {devices[0]: list(unique)}
    else:
        by_device = {}
        for i in unique:
            by_device.setdefault(devices[i], []).append(i)
    return [_group(tensors, tuple(members), facts, tensors[members[0]].device, name_of)
            for members in by_device.values()]


def _group(tensors: list[torch.Tensor], members: tuple[int, ...], facts: _Described, device: torch.device,
           name_of: Callable[[int], str]) -> Group:
    backend = backend_for(device)
    whole = len(members) == len(tensors)
    pick = (lambda xs: xs) if whole else (lambda xs: tuple(xs[i] for i in members))
    numels, dtypes = pick(facts.numels), pick(facts.dtypes)
    layout = facts.layout if facts.layout is True else tuple(map(pick, facts.layout))
    leaves: LeafRows | list[Any] | None = None
    if getattr(backend, "reads_rows", False):
        template = _template(numels, dtypes, layout)
        if template is not None:
            words = template.copy()
            words[:, 0] = pick(facts.pointers)
            leaves = LeafRows(words)
    if leaves is None:  # a backend reading arrays only, or a leaf of too many dims for a row
        leaves = [_named_adopt(name_of(i), tensors[i]) for i in members]
    return Group(members, _plan(numels, dtypes), backend, leaves, device)


def backend_for(device: torch.device) -> Backend:
    """The backend serving tensors on ``device``: the native host backend (or
    NumPy) on the CPU, the CUDA backend of that device on a GPU; inside
    :func:`serve_with`, its backend.

    >>> backend_for(torch.device("cpu")).name in ("host", "numpy")
    True
    """
    override = _override.get()
    if override is not None:
        return override
    if device.type == "cuda":
        return get_backend("cuda", device.index)
    return get_backend(host_default())


def _named_adopt(name: str, t: torch.Tensor) -> Any:
    try:
        return adopt(t)
    except TypeError as err:
        raise type(err)(f"leaf {name!r}: {err}") from None


def _plan(numels: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> FlatPlan:
    """The plan of tensors of these sizes and dtypes (as 1-D leaves), walked once per layout."""
    def make() -> FlatPlan:
        stand_ins = [np.broadcast_to(np.zeros((), _NUMPY_DTYPES[d]), (n,)) for n, d in zip(numels, dtypes)]
        return cached(walk(stand_ins).treedef, stand_ins)[0]

    return _plans.get((numels, dtypes), make)


def _template(numels: tuple[int, ...], dtypes: tuple[torch.dtype, ...], layout: LayoutKey) -> np.ndarray | None:
    """The rows of tensors of this layout but their addresses; None if one
    keeps more dims than a row holds."""
    def make() -> np.ndarray | None:
        template = np.zeros((len(numels), LEAF_ROW_WORDS), np.int64)
        for k, (n, dtype) in enumerate(zip(numels, dtypes)):
            itemsize = _NUMPY_DTYPES[dtype].itemsize
            shape, strides = ((n,), (itemsize,)) if layout is True else (
                tuple(layout[0][k]), tuple(s * itemsize for s in layout[1][k]))
            row = leaf_row(shape, strides, _NUMPY_DTYPES[dtype])
            if row is None:
                return None
            template[k, 1:] = row
        return template

    return _templates.get((numels, dtypes, layout), make)


# ---------------------------------------------------------------- in-place fitness

def _check_in_place(table: Table, tensors: list[torch.Tensor], name_of: Callable[[int], str]) -> None:
    """Refuse, naming the leaves, tensors with overlapping elements or sharing
    memory: ``checks.check_in_place`` on arrays, its tests on rows."""
    for g in table.groups:
        if not isinstance(g.leaves, LeafRows):
            check_in_place([name_of(i) for i in g.members], g.leaves)
            continue
        words = g.leaves.words
        for k in np.flatnonzero(words[:, 2] > 0):  # strided rows only: a contiguous one cannot overlap itself
            t = tensors[g.members[k]]
            itemsize = _NUMPY_DTYPES[t.dtype].itemsize
            if may_overlap_itself(_Layout(t.numel(), t.shape, [s * itemsize for s in t.stride()], itemsize)):
                raise overlapping_itself(name_of(g.members[k]), "a tensor", t.shape, t.stride(), "an expanded")
        pair = _sharing_pair(words, lambda k, members=g.members: adopt(tensors[members[k]]))
        if pair is not None:
            raise sharing_memory(*(name_of(g.members[k]) for k in pair))


class _Layout:
    """A tensor's layout as ``checks.may_overlap_itself`` reads an array's (byte strides)."""

    def __init__(self, size: int, shape: tuple[int, ...], strides: list[int], itemsize: int) -> None:
        self.size, self.shape, self.strides, self.dtype = size, shape, strides, np.dtype(f"V{itemsize}")


# ``view(i)`` is row i's array; Callable[..., Any], not Callable[[int], Any]:
# mypy cannot infer the caller's lambda, which binds the group's members as
# a default argument, against the latter.
def _sharing_pair(words: np.ndarray, view: Callable[..., Any]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of rows whose elements share memory, or
    None: their byte ranges read from the rows, swept as ``overlap.first_pair`` sweeps."""
    itemsize = _ITEMSIZE_BY_TAG[words[:, 1]]
    ndim = words[:, 2]
    reach = np.maximum(words[:, 4:4 + MAX_DIMS] - 1, 0) * words[:, 4 + MAX_DIMS:4 + 2 * MAX_DIMS]
    below = np.where(ndim > 0, np.minimum(reach, 0).sum(axis=1), 0)
    above = np.where(ndim > 0, np.maximum(reach, 0).sum(axis=1), (words[:, 3] - 1) * itemsize)
    index = np.flatnonzero(words[:, 3] > 0)
    if len(index) < 2:
        return None
    lo, hi = words[index, 0] + below[index], words[index, 0] + above[index] + itemsize[index]
    return first_pair(lo, hi, index, lambda i, j: really_overlap(view(i), view(j)))
