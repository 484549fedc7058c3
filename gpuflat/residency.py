"""A model resident in flat buffers: per-step operations with O(1) host work.

``resident(tree)`` moves every trainable array of a tree into one parameter
buffer per dtype (a model mixing dtypes gets one buffer each, as Megatron-LM
and FSDP keep one flat buffer per dtype) and makes matching gradient
buffers. Every leaf starts on a 256-byte boundary (wide enough for every
vector load); the padding between leaves is zero and never counted.

From then on a training step never walks the tree: ``grad_norm``,
``clip_grad_norm_``, ``zero_grad`` and ``param_norm`` work on the buffers
with a fixed number of backend calls per dtype, however many leaves there
are. The one per-leaf work left is, for PyTorch parameters, an identity check
of each ``p.grad`` (see :class:`Resident`).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np

from . import arrays as _arrays
from . import checks
from . import tree as _tree
from .backends.base import select
from .errors import NonFiniteError
from .flatplan import FlatPlan, LeafSpec
from .ops import Call, raise_if_nonfinite

ALIGN_BYTES = 256
PADDING = "<padding>"


@dataclass(frozen=True)
class Slice:
    """Where one unique trainable lives: its buffer (by index) and its elements there."""

    path: str
    buffer: int
    offset: int
    size: int
    shape: tuple
    dtype: np.dtype


class _Group:
    """One dtype's buffer pair as the backends see it: a contiguous plan whose
    slots are the leaves and the zero padding between them."""

    def __init__(self, dtype, slices, xp):
        self.dtype = dtype
        specs, offset = [], 0
        for s in slices:
            if s.offset > offset:
                specs.append(LeafSpec(PADDING, offset, s.offset - offset, (s.offset - offset,), dtype))
            specs.append(LeafSpec(s.path, s.offset, s.size, (s.size,), dtype))
            offset = s.offset + s.size
        self.size = offset
        self.plan = FlatPlan(None, tuple(specs), tuple(range(len(specs))), offset, dtype)
        self.real = xp.asarray(np.array([i for i, spec in enumerate(specs) if spec.path != PADDING],
                                        dtype=np.int64))

    def pieces(self, buffer) -> list:
        """The buffer cut along the plan's slots: what backends read per slot."""
        return [buffer[spec.offset : spec.offset + spec.size] for spec in self.plan.leaves]


def layout(unique, paths) -> tuple:
    """The Slice of each unique trainable: grouped by dtype in order of first
    appearance, each start aligned to ALIGN_BYTES.

    >>> [(s.buffer, s.offset) for s in layout([np.ones(3, np.float32), np.ones(2), np.ones(5, np.float32)], "abc")]
    [(0, 0), (1, 0), (0, 64)]
    """
    dtypes = list(dict.fromkeys(a.dtype for a in unique))
    ends = [0] * len(dtypes)
    slices = []
    for a, path in zip(unique, paths):
        b = dtypes.index(a.dtype)
        align = max(1, ALIGN_BYTES // a.dtype.itemsize)
        offset = -(-ends[b] // align) * align
        slices.append(Slice(path, b, offset, int(a.size), tuple(a.shape), a.dtype))
        ends[b] = offset + int(a.size)
    return tuple(slices)


class Resident:
    """A model living in flat buffers; made by :func:`resident`.

    ``params`` is the tree with every trainable a view into ``param_buffers``
    (for PyTorch parameters, the parameters themselves, whose storage now is
    the view); ``grads`` the gradient views into ``grad_buffers``, zeroed
    (for PyTorch, every ``p.grad`` is set to its view, so autograd
    accumulates into the buffer, and ``grads`` maps each parameter's path to
    it). ``layout`` gives each trainable's buffer and offset.

    Keeping residency: write gradients into the views in place. PyTorch's
    ``optimizer.zero_grad()`` sets gradients to None by default, after which
    autograd allocates new ones; every per-step method checks each
    ``p.grad`` by identity first and, where it was rebound, copies the new
    gradient into the buffer and rebinds ``p.grad`` to its view (None counts
    as zero). Nothing is ever computed on a stale buffer; to skip the copy,
    use ``optimizer.zero_grad(set_to_none=False)`` or ``r.zero_grad()``.

    >>> import numpy as np, gpuflat as gf
    >>> r = gf.resident({"w": np.array([3.0, 0.0]), "b": np.array([4.0], np.float32)})
    >>> r.grads["w"][:] = [3.0, 0.0]; r.grads["b"][:] = 4.0
    >>> float(r.grad_norm()), float(r.clip_grad_norm_(1.0)), r.grads["w"].round(6)
    (5.0, 5.0, array([0.6, 0. ]))
    >>> len(r.param_buffers), float(r.param_norm())
    (2, 5.0)
    """

    def __init__(self, tree, *, grads: bool = True, backend: str | None = None):
        call = Call(tree)
        unique = call.unique
        paths = call.paths()
        owners = [call.foreign.get(id(a)) for a in unique]
        self._torch = _torch_parameters(owners, paths)
        self._backend = select(backend, unique, lambda i: paths[i])
        self._like = next((o for o in owners if o is not None), None)
        self.layout = layout(unique, paths)
        with self._backend.on_device():
            self._make_buffers(call, unique, tree, grads)

    def _make_buffers(self, call, unique, tree, grads):
        xp = self._backend.xp
        dtypes = list(dict.fromkeys(a.dtype for a in unique))
        self._groups = [_Group(dt, [s for s in self.layout if s.buffer == b], xp)
                        for b, dt in enumerate(dtypes)]
        # Per-leaf results come out grouped by dtype; this puts them back in plan order.
        grouped = [i for b in range(len(dtypes)) for i, s in enumerate(self.layout) if s.buffer == b]
        self._plan_order = xp.asarray(np.argsort(np.array(grouped, dtype=np.int64)))
        self._params = [self._allocate(g) for g in self._groups]
        for s, a in zip(self.layout, unique):
            _view(self._params[s.buffer][1], s)[...] = a
        self.params = self._bind(call, self._params, "data", tree)
        self._grads = [self._allocate(g) for g in self._groups] if grads else None
        self.grads = self._bind(call, self._grads, "grad", None) if grads else None

    # ---------------------------------------------------------- buffers

    @property
    def param_buffers(self) -> tuple:
        """The 1-D parameter buffers, one per dtype, in the caller's kind."""
        return tuple(own for own, _, _ in self._params)

    @property
    def grad_buffers(self) -> tuple:
        """The 1-D gradient buffers, one per dtype, in the caller's kind."""
        return tuple(own for own, _, _ in self._require_grads())

    def _allocate(self, group):
        """(buffer in the caller's kind, the same memory as a backend array,
        its slot pieces), zeroed. The pieces are cut once, so a step cuts nothing."""
        if self._like is not None:
            torch = sys.modules["torch"]
            own = torch.zeros(group.size, dtype=_torch_dtype(torch, group.dtype), device=self._like.device)
            buf = _arrays.adopt(own)
        else:
            own = buf = self._backend.xp.zeros(group.size, group.dtype)
        return own, buf, group.pieces(buf)

    def _bind(self, call, buffers, attribute, tree):
        """The caller's tree over ``buffers``: PyTorch tensors rebound in place, else a rebuilt tree."""
        views = [_view(buffers[s.buffer][1], s) for s in self.layout]
        if self._torch is None:
            return _tree.rebuild(call.plan.treedef, [views[slot] for slot in call.plan.slot_of], call.statics)
        bound = {}
        for (path, param), view, s in zip(self._torch, views, self.layout):
            tensor = _view(buffers[s.buffer][0], s)
            setattr(param, attribute, tensor)
            bound[path] = tensor
        return tree if attribute == "data" else bound

    def _require_grads(self):
        if self._grads is None:
            raise ValueError("this Resident was made with grads=False: it holds no gradient buffers")
        return self._grads

    # ---------------------------------------------------------- per step

    def grad_norm(self, ord=2, *, per_leaf: bool = False):
        """The gradients' norm (``(total, per_leaf)`` with ``per_leaf``), as ``gf.global_norm``."""
        p = checks.check_ord(ord)
        self._adopt_rebound_grads()
        with self._backend.on_device():
            results = self._norms(self._require_grads(), p, per_leaf)
            total = self._combine([r.total for r in results], p)
            if not per_leaf:
                return self._result(total)
            return self._result(total), self._result(self._per_leaf(results))

    def param_norm(self, ord=2):
        """The parameters' norm, as ``gf.global_norm`` of the model."""
        p = checks.check_ord(ord)
        with self._backend.on_device():
            return self._result(self._combine([r.total for r in self._norms(self._params, p, False)], p))

    def clip_grad_norm_(self, max_norm, ord=2, *, eps=1e-6, error_if_nonfinite: bool = False):
        """Scale the gradients by min(1, max_norm / (norm + eps)) in place; return the norm.

        As ``gf.clip_grad_norm_``: no host synchronisation unless
        ``error_if_nonfinite``, which raises naming the first leaf holding
        NaN or inf and scales nothing.
        """
        max_norm, p, eps = checks.clip_arguments(max_norm, ord, eps)
        self._adopt_rebound_grads()
        buffers = self._require_grads()
        with self._backend.on_device():
            results = self._norms(buffers, p, False)
            total = self._combine([r.total for r in results], p)
            if error_if_nonfinite:
                self._raise_if_nonfinite(total, results, p)
            with _arrays.launch_stream(self._like):
                for group, (_, buf, pieces) in zip(self._groups, buffers):
                    self._backend.clip_(group.plan, pieces, total, max_norm, eps, flat=buf)
        return self._result(total)

    def zero_grad(self) -> None:
        """Zero every gradient buffer (and rebind PyTorch gradients to their views)."""
        with self._backend.on_device():
            for _, buf, _ in self._require_grads():
                buf.fill(0)
        if self._torch is not None:
            for (_, param), tensor in zip(self._torch, self.grads.values()):
                param.grad = tensor

    # ---------------------------------------------------------- helpers

    def _adopt_rebound_grads(self):
        """Copy gradients PyTorch allocated anew into the buffer; rebind them to their views."""
        if self._torch is None:
            return
        for (path, param), tensor in zip(self._torch, self.grads.values()):
            grad = param.grad
            if grad is tensor:
                continue
            if grad is None:
                tensor.zero_()
            else:
                tensor.copy_(grad)
            param.grad = tensor

    def _norms(self, buffers, p, per_leaf):
        with _arrays.launch_stream(self._like):
            return [self._backend.norms(g.plan, pieces, p, per_leaf, flat=buf)
                    for g, (_, buf, pieces) in zip(self._groups, buffers)]

    def _combine(self, totals, p):
        """The norm over all buffers from each buffer's norm, on the device."""
        xp = self._backend.xp
        if not totals:
            return xp.zeros((), np.float64)
        if len(totals) == 1:
            return totals[0]
        stacked = xp.stack(totals)
        if p == math.inf:
            return xp.max(stacked)
        return xp.sum(stacked**p) ** (1.0 / p)

    def _per_leaf(self, results):
        xp = self._backend.xp
        if not results:
            return xp.zeros(0, np.float64)
        grouped = xp.concatenate([r.per_leaf[g.real] for r, g in zip(results, self._groups)])
        return grouped[self._plan_order]

    def _raise_if_nonfinite(self, total, results, p):
        if math.isfinite(float(self._backend.to_host(total))):
            return
        for group, result in zip(self._groups, results):
            raise_if_nonfinite(self._backend, group.plan, result, p)
        raise NonFiniteError(f"no leaf holds NaN or inf, but the sum overflowed float64; the total "
                             f"{p:g}-norm is non-finite, so no gradient was scaled (error_if_nonfinite=True)")

    def _result(self, x):
        return x if self._like is None else _arrays.to_caller(x, self._like)


def resident(tree, *, grads: bool = True, backend: str | None = None) -> Resident:
    """Move ``tree``'s trainables into flat buffers, one per dtype; see :class:`Resident`.

    >>> import numpy as np, gpuflat as gf
    >>> w = np.ones((2, 2), np.float32)
    >>> r = gf.resident({"enc": w, "dec": w, "act": "relu"})
    >>> r.params["enc"] is r.params["dec"], r.params["act"], r.param_buffers[0].size
    (True, 'relu', 4)
    """
    return Resident(tree, grads=grads, backend=backend)


def _view(buffer, s: Slice):
    return buffer[s.offset : s.offset + s.size].reshape(s.shape)


def _torch_parameters(owners, paths):
    """[(path, tensor)] when every trainable is a PyTorch tensor; None when none is."""
    if all(o is None for o in owners):
        return None
    for o, path in zip(owners, paths):
        if _arrays.kind(o) != "torch":
            found = "a NumPy or CuPy array" if o is None else type(o).__name__
            raise TypeError(f"leaf {path!r}: a resident model holds PyTorch tensors or NumPy/CuPy "
                            f"arrays, not both; expected a torch.Tensor, got {found}"
                            + (" (JAX arrays are immutable: use gf.clip_by_global_norm)"
                               if _arrays.kind(o) == "jax" else ""))
    return list(zip(paths, owners))


def _torch_dtype(torch, dtype):
    from .dtypes import BFLOAT16

    if dtype == BFLOAT16:
        return torch.bfloat16
    return torch.from_numpy(np.zeros(0, dtype)).dtype
