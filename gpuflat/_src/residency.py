"""A model resident in flat buffers: per-step operations with O(1) host work.

``resident(tree)`` moves every trainable array of a tree into one parameter
buffer per dtype (a model mixing dtypes gets one buffer each, as Megatron-LM
and FSDP keep one flat buffer per dtype) and makes matching gradient
buffers. Every leaf starts on a 256-byte boundary (wide enough for every
vector load); the padding between leaves is zero and never counted.

From then on a training step never walks the tree: ``grad_norm``,
``clip_grad_norm_``, ``zero_grad`` and ``param_norm`` work on the buffers
with a fixed number of backend calls, however many leaves there are. A norm
is one call over a table of the leaves' places in the buffers, built once,
in the tree's order: the slots ``gf.global_norm`` reads, so the same bits as
it (``gpuflat._src.clipping``). The one per-leaf work left is, for PyTorch
parameters, the checks that follow what a training loop did to them
(``gpuflat._src.torch_params``).
"""
from __future__ import annotations

import math
import sys
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
from numpy.typing import DTypeLike

from . import arrays as _arrays
from . import checks
from . import dtensor
from . import tree as _tree
from .backends.protocol import LeafRows
from .backends.selection import select
from .dtypes import torch_dtype
from .layout import CLIP_EPS, dense_row
from ..errors import CaptureError
from .flatplan import FlatPlan, LeafSpec
from . import clipping
from .binding import Call
from .ranks import ResidentGradients
from .torch_params import Binding

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Sequence

    from .backends.protocol import Backend

ALIGN_BYTES = 256
PADDING = "<padding>"


@dataclass(frozen=True)
class Slice:
    """Where one unique trainable lives: its buffer (by index) and its elements there."""

    path: str
    buffer: int
    offset: int
    size: int
    shape: tuple[int, ...]
    dtype: np.dtype


class _Group:
    """One dtype's buffer pair as the backends see it.

    ``plan`` covers the whole buffer, its slots the leaves and the zero
    padding between them (the optimizers' updates); ``leaf_plan`` covers
    the leaves alone, for writes. Padding is zero and stays zero: no clip
    or update writes it (0 x NaN would be NaN), and no norm reads it.
    """

    def __init__(self, dtype: np.dtype, slices: Sequence[Slice]) -> None:
        self.dtype = dtype
        specs: list[LeafSpec] = []
        offset = 0
        for s in slices:
            if s.offset > offset:
                specs.append(LeafSpec(PADDING, offset, s.offset - offset, (s.offset - offset,), dtype))
            specs.append(LeafSpec(s.path, s.offset, s.size, (s.size,), dtype))
            offset = s.offset + s.size
        self.size = offset
        self.plan = FlatPlan(None, tuple(specs), tuple(range(len(specs))), offset, dtype)
        self.real = [i for i, spec in enumerate(specs) if spec.path != PADDING]
        self.leaf_plan = _contiguous_plan([(specs[i].path, (specs[i].size,)) for i in self.real], dtype)

    def pieces(self, buffer: Any) -> list[Any]:
        """The buffer cut along the plan's slots: what backends read per slot."""
        return [buffer[spec.offset : spec.offset + spec.size] for spec in self.plan.leaves]


class Storage(NamedTuple):
    """One zeroed 1-D array in two guises over the same memory: ``own`` in
    the caller's kind (a PyTorch tensor for a PyTorch model), ``array`` as
    the backend computes on it. Made by :meth:`Buffers.zeros`.

    >>> import numpy as np, gpuflat as gf
    >>> table = gf.resident({"w": np.ones(2)}).buffers().zeros(3, np.int64)
    >>> table.array[1] = 7; table.own
    array([0, 7, 0])
    """

    own: Any
    array: Any


class _Buffer:
    """One flat buffer: in the caller's kind, as a backend array, and cut once
    into its slots (all of them, and the leaves alone), so a step cuts nothing."""

    def __init__(self, own: Any, array: Any, group: _Group) -> None:
        self.own, self.array = own, array
        self.pieces = group.pieces(array)
        self.leaves = [self.pieces[i] for i in group.real]


def _contiguous_plan(named_shapes: Iterable[tuple[str, tuple[int, ...]]], dtype: DTypeLike) -> FlatPlan:
    """A plan of leaves laid end to end, each of ``dtype``."""
    specs: list[LeafSpec] = []
    offset = 0
    for path, shape in named_shapes:
        size = math.prod(shape)
        specs.append(LeafSpec(path, offset, size, shape, np.dtype(dtype)))
        offset += size
    return FlatPlan(None, tuple(specs), tuple(range(len(specs))), offset, np.dtype(dtype))


def _norm_plan(slices: Iterable[Slice]) -> FlatPlan:
    """The plan of a norm over every leaf of ``slices`` in their order, each
    one slot (what a tree of the same leaves gets: the same chunks, so the
    same bits); laid end to end, as no pass gathers it (float64, the norms'
    own dtype, stands for the leaves' mixed ones).

    >>> s = layout([np.ones(3, np.float32), np.ones(2)], "ab")
    >>> [(leaf.path, leaf.offset, leaf.size, str(leaf.dtype)) for leaf in _norm_plan(s).leaves]
    [('a', 0, 3, 'float32'), ('b', 3, 2, 'float64')]
    """
    specs: list[LeafSpec] = []
    offset = 0
    for s in slices:
        specs.append(LeafSpec(s.path, offset, s.size, (s.size,), s.dtype))
        offset += s.size
    return FlatPlan(None, tuple(specs), tuple(range(len(specs))), offset, np.dtype(np.float64))


def _address_reader(backend: Backend) -> Callable[[Any], int]:
    """How ``backend`` reads the address of one of its arrays' first element."""
    runtime = getattr(backend, "runtime", None)
    if runtime is not None:
        return runtime.pointer
    return lambda a: a.__array_interface__["data"][0]


def layout(unique: Sequence[Any], paths: Iterable[str]) -> tuple[Slice, ...]:
    """The Slice of each unique trainable: grouped by dtype in order of first
    appearance, each start aligned to ALIGN_BYTES.

    >>> [(s.buffer, s.offset) for s in layout([np.ones(3, np.float32), np.ones(2), np.ones(5, np.float32)], "abc")]
    [(0, 0), (1, 0), (0, 64)]
    """
    dtypes = list(dict.fromkeys(a.dtype for a in unique))
    ends = [0] * len(dtypes)
    slices: list[Slice] = []
    for a, path in zip(unique, paths):
        b = dtypes.index(a.dtype)
        align = max(1, ALIGN_BYTES // a.dtype.itemsize)
        offset = -(-ends[b] // align) * align
        slices.append(Slice(path, b, offset, int(a.size), tuple(a.shape), a.dtype))
        ends[b] = offset + int(a.size)
    return tuple(slices)


class Resident(ResidentGradients):
    """A model living in flat buffers; made by :func:`resident`.

    ``params`` is the tree with every trainable a view into ``param_buffers``
    (for PyTorch parameters, the parameters themselves, whose storage now is
    the view); ``grads`` the gradient views into ``grad_buffers`` (for
    PyTorch, every ``p.grad`` is set to its view, so autograd accumulates into
    the buffer, and ``grads`` maps each parameter's path to its view, which
    is ``p.grad`` while the parameter has a gradient; gradients the
    parameters already had are kept, and None ones stay None). ``layout``
    gives each trainable's buffer and offset.

    What a PyTorch resident model follows, checked first in every per-step
    call and whenever ``grads`` or ``grad_buffers`` is read:

    - gradients rebound by ``optimizer.zero_grad()`` (set to None, PyTorch's
      default) and allocated anew by autograd, or assigned by hand: copied
      into the buffer and ``p.grad`` rebound to its view. A gradient that is
      None stays None, when the model is made too: its view is zero and
      counts nothing, and optimizers skip its parameter;
      ``optimizer.zero_grad(set_to_none=False)`` or ``r.zero_grad()`` avoid
      the copy;
    - parameters given new storage of the same dtype, shape and device
      (``p.data = ...``): copied in and rebound.

    What makes it raise ``gf.StaleResidentError`` at its next call, naming
    the parameter and what changed, before anything is written: a dtype,
    shape or device change (``model.to(torch.bfloat16)``, ``.double()``), a
    parameter replaced by another Parameter object (``load_state_dict(...,
    assign=True)``, ``resize_token_embeddings``) or removed, a parameter
    that requires grad added (a new submodule: an adapter), and a new
    gradient on a parameter the resident model left out (one frozen when it
    was made and unfrozen since, or added frozen since). Rebuild with
    ``gf.resident(model)`` then.

    Each thread calling a resident model gets scratch of its own, so that
    ``grad_norm`` in one thread and ``clip_grad_norm_`` in another each get
    their own norm.

    >>> import numpy as np, gpuflat as gf
    >>> r = gf.resident({"w": np.array([3.0, 0.0]), "b": np.array([4.0], np.float32)})
    >>> r.grads["w"][:] = [3.0, 0.0]; r.grads["b"][:] = 4.0
    >>> float(r.grad_norm()), float(r.clip_grad_norm_(1.0)), r.grads["w"].round(6)
    (5.0, 5.0, array([0.6, 0. ]))
    >>> len(r.param_buffers), float(r.param_norm())
    (2, 5.0)
    """

    def __init__(self, tree: Any, *, grads: bool = True, backend: str | None = None):
        call = Call(tree)
        unique = call.unique
        paths = call.paths()
        owners = call.owners()
        pairs = _torch_parameters(owners, paths)
        self._backend: Backend = select(backend, unique, lambda i: paths[i])
        self._like: Any = next((o for o in owners if o is not None), None)  # a PyTorch parameter, or None
        self.layout = layout(unique, paths)
        dtypes = list(dict.fromkeys(a.dtype for a in unique))
        self._groups = [_Group(dt, [s for s in self.layout if s.buffer == b]) for b, dt in enumerate(dtypes)]
        self._norm_plan = _norm_plan(self.layout)
        # By id of the buffer list (the parameters', the gradients'), both fixed.
        self._bounds: dict[int, clipping.Bound] = {}
        with self._scope():
            self._params = [self._allocate(g) for g in self._groups]
            self._grads: list[_Buffer] | None = [self._allocate(g) for g in self._groups] if grads else None
            self._grad_tree: Any  # set below: a tree of views, or for PyTorch a dict path -> p.grad
            self.params: Any
            if pairs is None:
                self._binding: Binding | None = None
                self._bind_arrays(call, unique)
            else:
                modules = [x for x in call.statics if _arrays.is_module(x)]
                self._binding = Binding(pairs, modules, self._views(self._params, own=True),
                                        self._views(self._grads, own=True) if self._grads is not None else None)
                self.params = tree
                # The binding holds gradient views exactly when ``grads`` asked for them.
                self._grad_tree = (dict(zip(self._binding.paths, self._binding.grads))
                                   if self._binding.grads is not None else None)

    def _bind_arrays(self, call: Call, unique: Sequence[Any]) -> None:
        """NumPy and CuPy trees: the values copied in, and new trees of views."""
        for s, a in zip(self.layout, unique):
            _view(self._params[s.buffer].array, s)[...] = a

        def rebuilt(buffers: list[_Buffer]) -> Any:
            views = self._views(buffers, own=False)
            return _tree.rebuild(call.plan.treedef, [views[slot] for slot in call.plan.slot_of], call.statics)

        self.params = rebuilt(self._params)
        self._grad_tree = rebuilt(self._grads) if self._grads is not None else None

    def _views(self, buffers: list[_Buffer], *, own: bool) -> list[Any]:
        return [_view(buffers[s.buffer].own if own else buffers[s.buffer].array, s) for s in self.layout]

    def _allocate(self, group: _Group) -> _Buffer:
        """A zeroed buffer for ``group``."""
        return _Buffer(*self._zeros(group.size, group.dtype), group)

    def _zeros(self, size: int, dtype: DTypeLike) -> Storage:
        """A zeroed 1-D array, PyTorch's own for PyTorch parameters."""
        if self._like is not None:
            torch = sys.modules["torch"]
            own = torch.zeros(size, dtype=torch_dtype(np.dtype(dtype).name), device=self._like.device)
            return Storage(own, _arrays.adopt(own))
        buf = self._backend.zeros(size, dtype)
        return Storage(buf, buf)

    # ---------------------------------------------------------- buffers

    @property
    def grads(self) -> Any:
        """The gradient views: a tree like ``params``, or for PyTorch a dict from
        each parameter's path to its ``p.grad`` (None with ``grads=False``)."""
        if self._grads is None:
            return None
        self._sync()
        return self._grad_tree

    @property
    def param_buffers(self) -> tuple:
        """The 1-D parameter buffers, one per dtype, in the caller's kind."""
        self._sync()
        return tuple(b.own for b in self._params)

    @property
    def grad_buffers(self) -> tuple:
        """The 1-D gradient buffers, one per dtype, in the caller's kind."""
        self._sync()
        return tuple(b.own for b in self._require_grads())

    def buffers(self) -> "Buffers":
        """The parameter and gradient buffers as the backend sees them, for
        work that updates them in place every step (the flat optimizers).
        Raises ValueError for a model made with ``grads=False``.

        >>> import numpy as np, gpuflat as gf
        >>> r = gf.resident({"w": np.ones(2)})
        >>> r.buffers().dtypes[0].params is r.param_buffers[0]   # NumPy's own arrays
        True
        """
        self._require_grads()
        return Buffers(self)

    def _require_grads(self) -> list[_Buffer]:
        if self._grads is None:
            raise ValueError("this Resident was made with grads=False: it holds no gradient buffers")
        return self._grads

    def _sync(self) -> None:
        if self._binding is not None:
            self._binding.sync(self._refuse_capture)

    def _refuse_capture(self, what: str) -> None:
        """Following ``what`` copies into the buffers: refused while PyTorch's
        current stream captures a CUDA graph, which would record the copy
        instead of running it."""
        if self._backend.name == "cuda" and _arrays.launch_stream(self._like).is_capturing():
            raise CaptureError(f"{what} has a new gradient or new storage to copy into the resident buffers "
                               f"while PyTorch's current stream captures a CUDA graph, and a capture records "
                               f"copies instead of running them: make the same call once before capturing "
                               f"(a warm-up call after the gradients are set), so nothing is left to follow")

    def _gradless(self) -> frozenset[int]:
        """The leaves (in layout order) whose PyTorch gradient is None: they
        count as zero in norms, and the flat optimizers skip them."""
        return frozenset() if self._binding is None else self._binding.gradless()

    def _give_grads(self, leaves: list[int]) -> None:
        """Make each of ``leaves`` (in layout order, gradless until now) hold its
        view as its PyTorch gradient: a gradient all-reduce wrote one there,
        as DDP gives every rank the average gradient of a parameter that
        some other rank used."""
        if self._binding is not None:
            self._binding.give_grads(leaves)

    # ---------------------------------------------------------- per step

    def grad_norm(self, ord: float = 2, *, per_leaf: bool = False) -> Any:
        """The gradients' norm (``(total, per_leaf)`` with ``per_leaf``), as ``gf.global_norm``.

        >>> import numpy as np, gpuflat as gf
        >>> r = gf.resident({"a": np.zeros(2), "b": np.zeros(1)})
        >>> r.grads["a"][:] = [3.0, 4.0]; r.grads["b"][:] = 12.0
        >>> float(r.grad_norm()), r.grad_norm(per_leaf=True)[1]
        (13.0, array([ 5., 12.]))
        """
        p = checks.check_ord(ord)
        self._sync()
        bound = self._bound(self._require_grads())
        if not per_leaf:
            return clipping.total_norm(bound, p).total
        (part,) = bound.norm_parts
        with self._scope():
            result = part.backend.norms(part.plan, part.leaves, p, True)
            return self._result(result.total), self._result(result.per_leaf)

    def param_norm(self, ord: float = 2) -> Any:
        """The parameters' norm, as ``gf.global_norm`` of the model.

        >>> import numpy as np, gpuflat as gf
        >>> float(gf.resident({"w": np.array([3.0, 4.0])}).param_norm())
        5.0
        """
        p = checks.check_ord(ord)
        self._sync()
        return clipping.total_norm(self._bound(self._params), p).total

    def clip_grad_norm_(self, max_norm: float, ord: float = 2, *, eps: float = CLIP_EPS,
                        error_if_nonfinite: bool = False) -> Any:
        """Scale the gradients by min(1, max_norm / (norm + eps)) in place; return the norm.

        As ``gf.clip_grad_norm_``: no host synchronisation unless
        ``error_if_nonfinite``, which raises naming the first leaf holding
        NaN or inf and scales nothing. Only the leaves are scaled: the
        padding between them stays zero, so a NaN step leaves no trace in
        the next step's norm.

        >>> import numpy as np, gpuflat as gf
        >>> r = gf.resident({"w": np.zeros(2)})
        >>> r.grads["w"][:] = [3.0, 4.0]
        >>> float(r.clip_grad_norm_(1.0)), r.grads["w"].round(6)
        (5.0, array([0.6, 0.8]))
        """
        max_norm, p, eps = checks.clip_arguments(max_norm, ord, eps)
        self._sync()
        return clipping.clip_(self._bound(self._require_grads()), max_norm, p, eps, error_if_nonfinite)

    def zero_grad(self) -> None:
        """Zero every gradient buffer (PyTorch gradients become views of it; one
        that is None stays None, as with ``optimizer.zero_grad(set_to_none=False)``).

        >>> import numpy as np, gpuflat as gf
        >>> r = gf.resident({"w": np.zeros(2)})
        >>> r.grads["w"][:] = 1.0; r.zero_grad(); r.grads["w"]
        array([0., 0.])
        """
        buffers = self._require_grads()
        self._sync()  # adopts rebound gradients first
        with self._scope():
            for buf in buffers:
                buf.array.fill(0)

    # ---------------------------------------------------------- helpers

    def _scope(self) -> AbstractContextManager[Any]:
        """Where the per-step device work runs: the buffers' device and, for
        PyTorch, its current stream and allocator (``arrays.device_scope``)."""
        return _arrays.device_scope(self._backend, self._like)

    def _bound(self, buffers: list[_Buffer]) -> clipping.Bound:
        """``buffers`` bound for a norm and a clip: the norm one pass over
        every leaf, the scale one per buffer, of the leaves alone. Bound once:
        the buffers and the caller's kind never change."""
        bound = self._bounds.get(id(buffers))
        if bound is None:
            bound = self._bounds[id(buffers)] = self._bind(buffers)
        return bound

    def _bind(self, buffers: list[_Buffer]) -> clipping.Bound:
        be, like, layout = self._backend, self._like, self.layout
        norm = clipping.Part(self._norm_plan, self._norm_leaves(buffers), be, like,
                             path=lambda slot: layout[slot].path)
        scale_parts = [clipping.Part(g.leaf_plan, buf.leaves, be, like, flat=buf.array)
                       for g, buf in zip(self._groups, buffers)]
        return clipping.Bound([norm], scale_parts)

    def _norm_leaves(self, buffers: list[_Buffer]) -> list[Any] | LeafRows:
        """Every leaf of ``buffers`` in layout order, as the backend reads them:
        a table of their addresses where it reads tables (found again by its
        identity on a device: no per-leaf work per call), else the views."""
        views = [buffers[s.buffer].array[s.offset : s.offset + s.size] for s in self.layout]
        if not self._backend.reads_rows:
            return views
        address = _address_reader(self._backend)
        return LeafRows(np.array([[address(v)] + dense_row(s.size, s.dtype)
                                  for v, s in zip(views, self.layout)], np.int64).reshape(len(views), -1))

    def _result(self, x: Any) -> Any:
        return x if self._like is None else _arrays.to_caller(x, self._like)


@dataclass(frozen=True, eq=False)
class DtypeBuffers:
    """One dtype's parameter and gradient buffers, as the backend sees them.

    ``plan`` cuts the buffers into slots: the leaves and the zero padding
    between them (no update may write the padding); ``slot_of`` maps each
    leaf held here, by its index in ``resident.layout``, to its slot;
    ``params`` and ``grads`` are the buffers as the backend's arrays.

    >>> import numpy as np, gpuflat as gf
    >>> r = gf.resident({"a": np.ones(3, np.float32), "b": np.ones(2), "c": np.ones(4, np.float32)})
    >>> f32 = r.buffers().dtypes[0]
    >>> [(leaf.path, leaf.offset, leaf.size) for leaf in f32.plan.leaves], f32.slot_of
    ([("['a']", 0, 3), ('<padding>', 3, 61), ("['c']", 64, 4)], {0: 0, 2: 2})
    """

    plan: FlatPlan
    slot_of: dict[int, int]
    params: Any
    grads: Any


class Buffers:
    """A resident model's buffers as its backend sees them: what work that
    updates them in place every step needs (the flat optimizers). Made by
    :meth:`Resident.buffers`.

    ``backend`` is the backend that serves the model; ``dtypes`` one
    :class:`DtypeBuffers` per dtype, in ``param_buffers`` order. Every array
    here is the backend's, over the model's own memory. A step calls
    :meth:`follow` first, then does its device work inside :meth:`scope`.

    >>> import numpy as np, gpuflat as gf
    >>> bufs = gf.resident({"w": np.array([1.0, 2.0])}).buffers()
    >>> d = bufs.dtypes[0]
    >>> d.grads[:] = [3.0, 4.0]
    >>> bufs.follow()
    >>> with bufs.scope():
    ...     d.params[...] -= 0.5 * d.grads
    ...     norm = bufs.grad_norm(2.0)
    >>> d.params, float(norm)
    (array([-0.5,  0. ]), 5.0)
    """

    def __init__(self, resident: Resident) -> None:
        self._resident = resident
        self.backend = resident._backend
        grads = resident._require_grads()
        dtypes = []
        for b, group in enumerate(resident._groups):
            leaves = [k for k, s in enumerate(resident.layout) if s.buffer == b]
            dtypes.append(DtypeBuffers(group.plan, dict(zip(leaves, group.real)),
                                       resident._params[b].array, grads[b].array))
        self.dtypes = tuple(dtypes)

    def follow(self) -> None:
        """Take in what the training loop did to a PyTorch model's parameters
        and gradients since the last call (see :class:`Resident`), so the
        buffers hold them; raises ``gf.StaleResidentError`` for what cannot
        be followed. Nothing to do for NumPy and CuPy arrays.

        >>> import torch, gpuflat as gf
        >>> w = torch.nn.Parameter(torch.zeros(2))
        >>> bufs = gf.resident([w]).buffers()
        >>> w.grad = torch.tensor([3.0, 4.0])   # a new tensor: not in the buffer yet
        >>> bufs.follow(); bufs.dtypes[0].grads
        array([3., 4.], dtype=float32)
        """
        self._resident._sync()

    def scope(self) -> AbstractContextManager[Any]:
        """A context for the per-step device work: the buffers' device and,
        for PyTorch, its current stream and allocator.

        >>> import numpy as np, gpuflat as gf
        >>> bufs = gf.resident({"w": np.ones(2)}).buffers()
        >>> with bufs.scope():
        ...     bufs.dtypes[0].params[...] *= 2.0
        >>> bufs.dtypes[0].params
        array([2., 2.])
        """
        return self._resident._scope()

    def zeros(self, size: int, dtype: DTypeLike) -> Storage:
        """A zeroed 1-D array of ``size`` elements on the buffers' device (a
        PyTorch tensor's memory for a PyTorch model): for state laid out like
        a buffer (``zeros(d.plan.size, d.plan.dtype)``) or a small table.
        Call it inside :meth:`scope`.

        >>> import numpy as np, gpuflat as gf
        >>> bufs = gf.resident({"w": np.ones(3, np.float32)}).buffers()
        >>> d = bufs.dtypes[0]
        >>> state = bufs.zeros(d.plan.size, d.plan.dtype)
        >>> state.array.shape, state.array.dtype
        ((3,), dtype('float32'))
        """
        return self._resident._zeros(size, dtype)

    def gradless(self) -> frozenset[int]:
        """The leaves (indices into ``resident.layout``) whose PyTorch
        gradient is None: their slots hold zeros, and an optimizer leaves
        them as they are, as PyTorch's do. Empty for NumPy and CuPy arrays.

        >>> import torch, gpuflat as gf
        >>> a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
        >>> a.grad = torch.ones(2)
        >>> gf.resident([a, b]).buffers().gradless()
        frozenset({1})
        """
        return self._resident._gradless()

    def grad_norm(self, p: float) -> Any:
        """The gradients' total ``p``-norm (a checked order, see
        ``checks.check_ord``) as a 0-d float64 backend array, left on the
        device, as :meth:`Resident.grad_norm` computes it. Call it inside
        :meth:`scope`, after :meth:`follow`.

        >>> import numpy as np, gpuflat as gf
        >>> r = gf.resident({"a": np.zeros(1), "b": np.zeros(1, np.float32)})
        >>> r.grads["a"][:] = 3.0; r.grads["b"][:] = 4.0
        >>> bufs = r.buffers()
        >>> with bufs.scope():
        ...     float(bufs.grad_norm(2.0)), float(bufs.grad_norm(float("inf")))
        (5.0, 4.0)
        """
        r = self._resident
        return r._bound(r._require_grads()).norm(p).on_backend

    def to_caller(self, x: Any) -> Any:
        """A backend array as the caller's kind: a PyTorch tensor for a
        PyTorch model (the same memory), else ``x`` itself.

        >>> import torch, gpuflat as gf
        >>> bufs = gf.resident([torch.nn.Parameter(torch.ones(2))]).buffers()
        >>> bufs.to_caller(bufs.dtypes[0].params)
        tensor([1., 1.])
        """
        return self._resident._result(x)


def resident(tree: Any, *, grads: bool = True, backend: str | None = None) -> Resident:
    """Move ``tree``'s trainables into flat buffers, one per dtype; see :class:`Resident`.

    >>> import numpy as np, gpuflat as gf
    >>> w = np.ones((2, 2), np.float32)
    >>> r = gf.resident({"enc": w, "dec": w, "act": "relu"})
    >>> r.params["enc"] is r.params["dec"], r.params["act"], r.param_buffers[0].size
    (True, 'relu', 4)
    """
    return Resident(tree, grads=grads, backend=backend)


def _view(buffer: Any, s: Slice) -> Any:
    return buffer[s.offset : s.offset + s.size].reshape(s.shape)


# FSDP2 (torch/distributed/fsdp/_fully_shard/) keeps each sharded parameter
# as a view into its own padded flat storage and all-gathers from that
# storage, not from the parameter, before every forward and backward; it
# swaps the unsharded parameters in and out of the modules around them, and
# each backward's reduce-scatter makes new gradient shards. A shard rebound
# to a resident buffer would be updated there by the optimizer while FSDP2
# all-gathered its stale storage: silently wrong, so it is refused.
_DTENSOR_REFUSED = (
    "leaf {path!r}: expected plain tensors, found a DTensor with placements {placements}; FSDP2 and "
    "tensor parallelism own their parameters' storage (FSDP2 all-gathers from its own flat buffer "
    "and makes new gradient shards every backward), so a resident copy would go stale silently. "
    "Clip with gpuflat.torch.clip_grad_norm_(model.parameters(), max_norm) instead"
)


def _torch_parameters(owners: Sequence[Any], paths: Sequence[str]) -> list[tuple[str, Any]] | None:
    """[(path, tensor)] when every trainable is a PyTorch tensor; None when none is."""
    if all(o is None for o in owners):
        return None
    for o, path in zip(owners, paths):
        if dtensor.is_dtensor(o):
            raise TypeError(_DTENSOR_REFUSED.format(path=path, placements=tuple(o.placements)))
        if _arrays.kind(o) != "torch":
            found = "a NumPy or CuPy array" if o is None else type(o).__name__
            raise TypeError(f"leaf {path!r}: a resident model holds PyTorch tensors or NumPy/CuPy "
                            f"arrays, not both; expected a torch.Tensor, got {found}"
                            + (" (JAX arrays are immutable: use gf.clip_by_global_norm)"
                               if _arrays.kind(o) == "jax" else ""))
    return list(zip(paths, owners))
