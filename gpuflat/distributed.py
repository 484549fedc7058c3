"""The global norm, gradient clipping and the gradient all-reduce across ranks.

The norm of a model spread over many processes counts every element of every
logical parameter exactly once across the world. Each rank reduces the
leaves it *owns* to one float64 partial, sum(|g|**p) (max |g| for inf), with
the fused norm kernels; one collective then gathers every rank's partial and
the first leaf holding a non-finite value, and every rank combines them in the
same fixed order, so all ranks get the same bits. Norms are never averaged
over ranks: the partials are summed, then the root is taken once.

``group`` is a ``torch.distributed`` process group (None: the default group
when one is initialised, else a world of one process) or an ``mpi4py``
communicator. GPU arrays go to NCCL or a CUDA-aware MPI as device buffers.

>>> import numpy as np
>>> from gpuflat import distributed as gfd
>>> grads = {"w": np.array([3.0, 4.0]), "ln": np.array([12.0])}
>>> float(gfd.global_norm(grads))
13.0
>>> float(gfd.global_norm(grads, owned={"['w']"}))  # a world of one: only 'w' counts
5.0
"""
from __future__ import annotations

import contextlib
import math
import sys
import threading
import weakref
from collections import OrderedDict

import numpy as np

import gpuflat as gf

from . import checks
from .arrays import adopt
from .backends import get_backend
from .errors import NonFiniteError
from .ops import Call

__all__ = ["CollectiveError", "Owned", "all_reduce_", "clip_grad_norm_", "global_norm",
           "replicated", "sharded", "tied"]

# Each rank's row in the one exchanged buffer: its partial, and 1 + the slot
# of its first owned leaf with a non-finite norm (0: none).
_ROW = 2


class CollectiveError(RuntimeError):
    """A collective failed: typically another rank raised before reaching it, or left.

    >>> raise CollectiveError("rank 0 of 2: the all-reduce failed")
    Traceback (most recent call last):
    ...
    gpuflat.distributed.CollectiveError: rank 0 of 2: the all-reduce failed
    """


# ---------------------------------------------------------------- public API

def global_norm(tree, ord=2, *, group=None, owned=None, per_leaf=False, backend=None):
    """The norm of a model spread over the ranks of ``group``; every rank gets the same value.

    Each rank passes its local leaves; ``owned`` says which of them this rank
    counts (see ``Owned``). Returns a 0-d float64 array on the leaves' device
    (a tensor for torch leaves); with ``per_leaf=True``, ``(total,
    per_leaf_norms)`` where the per-leaf norms are this rank's, owned or not.
    One collective, and no host synchronisation.

    >>> import numpy as np
    >>> from gpuflat import distributed as gfd
    >>> g = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]], np.float32)}
    >>> float(gfd.global_norm(g)), float(gfd.global_norm(g, ord=1)), float(gfd.global_norm(g, np.inf))
    (5.0, 7.0, 4.0)
    """
    p = checks.check_ord(ord)
    comm = _Comm(group)
    local = _Local(tree, backend, comm)
    with local.be.on_device(), comm.stream(local.be.xp):
        total, per, _ = _reduce_norm(local, p, comm, owned)
    if per_leaf:
        return local.give_back(total), local.give_back(per)
    return local.give_back(total)


def clip_grad_norm_(grads, max_norm, ord=2, *, group=None, owned=None, eps=1e-6,
                    error_if_nonfinite=False, backend=None):
    """Scale every rank's gradients by the same min(1, max_norm / (norm + eps)); return the norm.

    PyTorch's ``clip_grad_norm_`` over a model spread across ranks: the norm
    is ``global_norm(grads, ord, group=group, owned=owned)``, the factor is
    computed on the device and always applied (no host synchronisation).
    With ``error_if_nonfinite`` a non-finite norm makes every rank raise
    NonFiniteError naming the leaf and the rank, and nothing is scaled.

    >>> import numpy as np
    >>> from gpuflat import distributed as gfd
    >>> g = {"w": np.array([3.0, 4.0]), "b": np.zeros(1, np.float32)}
    >>> float(gfd.clip_grad_norm_(g, 1.0))
    5.0
    >>> g["w"].round(6)
    array([0.6, 0.8])
    """
    max_norm, p, eps = checks.clip_arguments(max_norm, ord, eps)
    comm = _Comm(group)
    local = _Local(grads, backend, comm)
    local.check_in_place()
    with local.be.on_device(), comm.stream(local.be.xp):
        total, _, packet = _reduce_norm(local, p, comm, owned)
        if error_if_nonfinite:
            _raise_if_nonfinite(local, p, comm, total, packet)
        if local.arrays:
            local.be.clip_(local.plan, local.arrays, total, max_norm, eps)
    return local.give_back(total)


def all_reduce_(grads, op="mean", *, group=None, bucket_bytes=None):
    """Sum (or average) gradients across ranks in place, through one flat buffer.

    ``grads`` is a tree of gradients, or an object holding its gradients in
    ``grad_buffers`` (1-D arrays, reduced as they are). A tree is gathered
    into one buffer of the plan's dtype, reduced, and scattered back: one
    collective per ``bucket_bytes`` (default: the whole buffer) instead of
    one per tensor. "mean" sums, then divides by the number of ranks.

    >>> import numpy as np
    >>> from gpuflat import distributed as gfd
    >>> g = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([3.0], np.float32)}
    >>> gfd.all_reduce_(g, "sum")  # a world of one: the values stay
    >>> g["w"], g["b"]
    (array([1., 2.], dtype=float32), array([3.], dtype=float32))
    """
    if op not in ("sum", "mean"):
        raise ValueError(f"op: expected 'sum' or 'mean', got {op!r}")
    if bucket_bytes is not None and not bucket_bytes > 0:
        raise ValueError(f"bucket_bytes: expected a number of bytes > 0 or None, got {bucket_bytes!r}")
    comm = _Comm(group)
    buffers = getattr(grads, "grad_buffers", None)
    if buffers is not None:
        for buf in buffers:
            _reduce_buffer(comm, buf, op, bucket_bytes)
        return
    plan = gf.plan(grads)
    flat = adopt(gf.flatten(plan, grads))
    _reduce_buffer(comm, flat, op, bucket_bytes)
    gf.scatter(plan, flat, grads)


# ---------------------------------------------------------------- ownership

class Owned:
    """A rule saying which leaves this rank counts in the global norm.

    Called as ``rule(path, leaf) -> bool``; rules combine with ``&`` (a leaf
    counts when every rule counts it). ``owned=`` also takes None (every
    leaf), a set of leaf paths, or any such callable. The answer is cached
    per plan, so it must depend on the path, shape or dtype only.

    >>> rule = Owned(lambda path, leaf: "norm" not in path)
    >>> both = rule & Owned(lambda path, leaf: leaf.ndim > 1)
    >>> both("['w']", np.ones((2, 2))), both("['norm']", np.ones((2, 2)))
    (True, False)
    """

    def __init__(self, rule):
        self.rule = rule

    def __call__(self, path, leaf) -> bool:
        return bool(self.rule(path, leaf))

    def __and__(self, other):
        return Owned(lambda path, leaf: self(path, leaf) and bool(other(path, leaf)))


def sharded():
    """Every leaf counts on every rank: tensor-parallel shards, ZeRO/FSDP shards.

    >>> sharded()("['w']", np.ones(2))
    True
    """
    return Owned(lambda path, leaf: True)


def replicated(group=None, where=None):
    """Leaves held whole on every rank of ``group`` count on its rank 0 only.

    For tensor-parallel duplicates (layer norms, biases of row-parallel
    layers: Megatron's ``param_is_not_tensor_parallel_duplicate``).
    ``where`` picks the replicated leaves (a set of paths or a predicate on
    the path; None: all of them); the others count everywhere.

    >>> rule = replicated(where={"['ln']"})  # a world of one: this is rank 0
    >>> rule("['ln']", np.ones(2)), rule("['w']", np.ones(2))
    (True, True)
    """
    return tied(0, group=group, where=where)


def tied(owner_rank, group=None, where=None):
    """Copies of one parameter on several ranks count on ``owner_rank`` of ``group`` only.

    For an embedding tied across pipeline stages (the first and last stage
    each hold a copy): pass the pipeline group, the owning stage, and
    ``where`` naming the tied leaves; other leaves count everywhere.

    >>> rule = tied(1, where=lambda path: "embed" in path)  # this process is rank 0
    >>> rule("['embed']", np.ones(2)), rule("['w']", np.ones(2))
    (False, True)
    """
    is_owner = _Comm(group).rank == owner_rank
    selected = _selector(where)
    return Owned(lambda path, leaf: is_owner or not selected(path))


def _selector(where):
    if where is None:
        return lambda path: True
    if isinstance(where, (set, frozenset)):
        return where.__contains__
    if callable(where):
        return where
    raise TypeError(f"where: expected a set of paths, a predicate or None, got {type(where).__name__}")


_MASKS_KEPT = 8  # ownership masks remembered per plan
_masks: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_masks_lock = threading.Lock()


def _owned_mask(plan, arrays, owned, xp):
    """The plan's 0/1 ownership vector on the device of ``xp``, cached weakly per plan."""
    key = (frozenset(owned) if isinstance(owned, (set, frozenset)) else owned, xp.__name__)
    with _masks_lock:
        cache = _masks.setdefault(plan, OrderedDict())
        mask = cache.get(key)
    if mask is None:
        mask = xp.asarray(_ownership(plan, arrays, owned))
        with _masks_lock:
            cache[key] = mask
            while len(cache) > _MASKS_KEPT:
                cache.popitem(last=False)
    return mask


def _ownership(plan, arrays, owned) -> np.ndarray:
    paths = [leaf.path for leaf in plan.leaves]
    if isinstance(owned, (set, frozenset)):
        unknown = sorted(set(owned) - set(paths))
        if unknown:
            raise ValueError(f"owned: path {unknown[0]!r} is not a trainable leaf of this tree; "
                             f"expected one of {paths}")
        return np.array([path in owned for path in paths], dtype=bool)
    if not callable(owned):
        raise TypeError(f"owned: expected None, a set of leaf paths or a callable (path, leaf) -> bool, "
                        f"got {type(owned).__name__}")
    return np.array([bool(owned(path, a)) for path, a in zip(paths, arrays)], dtype=bool)


# ---------------------------------------------------------------- the norm

def _reduce_norm(local, p, comm, owned):
    """(global total, this rank's per-leaf norms, the exchanged (ranks, _ROW) packet).

    Each rank writes its own row of a zeroed buffer; one SUM all-reduce fills
    every row everywhere (adding zeros is exact, NaN and inf included), and
    every rank then combines the rows in rank order: the same bits on every
    rank, and a max for ord=inf without a second collective.
    """
    xp = local.be.xp
    packet = xp.zeros((comm.size, _ROW), np.float64)
    per = xp.zeros(0, np.float64)
    if local.arrays:
        per = local.be.norms(local.plan, local.arrays, p, per_leaf=True).per_leaf
        contrib = per if p in (1, math.inf) else per ** p
        if owned is not None:
            contrib = xp.where(_owned_mask(local.plan, local.arrays, owned, xp), contrib, 0.0)
        bad = ~xp.isfinite(contrib)
        packet[comm.rank, 0] = contrib.max() if p == math.inf else contrib.sum()
        packet[comm.rank, 1] = xp.where(bad.any(), bad.argmax() + 1, 0)
    comm.all_reduce(packet.reshape(-1), "global_norm")
    partials = packet[:, 0]
    if p == math.inf:
        return partials.max(), per, packet
    total = partials.sum()
    return (xp.sqrt(total) if p == 2 else total if p == 1 else total ** (1.0 / p)), per, packet


def _raise_if_nonfinite(local, p, comm, total, packet):
    """Every rank raises the same NonFiniteError when the global norm is not finite.

    The rank holding the first non-finite leaf sends its path to the others:
    a second collective, on this error path only.
    """
    if math.isfinite(float(local.be.to_host(total))):
        return
    first = local.be.to_host(packet[:, 1])
    culprits = np.flatnonzero(first)
    if culprits.size:
        rank = int(culprits[0])
        path = local.plan.leaves[int(first[rank]) - 1].path if rank == comm.rank else None
        where = (f"leaf {comm.broadcast_text(path, rank)!r} on rank {rank} holds NaN or inf "
                 f"(or its sum overflows float64)")
    else:
        where = "no rank holds NaN or inf, but the sum overflowed float64"
    raise NonFiniteError(f"{where}; the global {p:g}-norm over {comm.size} ranks is non-finite, "
                         f"so no gradient was scaled on any rank (error_if_nonfinite=True)")


# ---------------------------------------------------------------- all-reduce

def _reduce_buffer(comm, buf, op, bucket_bytes):
    step = buf.size if bucket_bytes is None else max(1, int(bucket_bytes) // buf.dtype.itemsize)
    xp = np if isinstance(buf, np.ndarray) else sys.modules["cupy"]
    with comm.stream(xp):
        for start in range(0, buf.size, max(step, 1)):
            comm.all_reduce(buf[start : start + step], "all_reduce_")
        if op == "mean" and comm.size > 1:
            buf /= comm.size


class _Comm:
    """A process group or communicator seen as (rank, size, in-place SUM all-reduce)."""

    def __init__(self, group):
        self.group, self.kind = group, _kind_of(group)
        if self.kind == "mpi":
            self.rank, self.size = group.Get_rank(), group.Get_size()
        elif self.kind == "torch":
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank, self.size = 0, 1

    def all_reduce(self, buf, caller):
        """Sum the contiguous 1-D ``buf`` over the ranks, in place."""
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

    def broadcast_text(self, text, root):
        """``text`` as rank ``root`` holds it, on every rank."""
        if self.kind == "mpi":
            return self.group.bcast(text, root=root)
        if self.kind == "torch":
            import torch.distributed as dist

            box = [text]
            dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, root), group=self.group)
            return box[0]
        return text

    def nccl(self) -> bool:
        """Whether the group runs on NCCL, so even an empty shard's buffer lives on the GPU."""
        if self.kind != "torch":
            return False
        import torch.distributed as dist

        return dist.get_backend(self.group) == "nccl"

    def stream(self, xp):
        """CuPy work on PyTorch's current stream, where NCCL collectives are ordered."""
        if self.kind != "torch" or xp is np:
            return contextlib.nullcontext()
        import torch

        return xp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)


def _kind_of(group):
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


def _mpi_all_reduce(comm, buf):
    from mpi4py import MPI

    if buf.dtype.name == "bfloat16":  # MPI has no bfloat16: add in float32, round once
        wide = buf.astype(np.float32)
        comm.Allreduce(MPI.IN_PLACE, wide, op=MPI.SUM)
        buf[...] = wide
        return
    if not isinstance(buf, np.ndarray):
        # A CUDA-aware MPI reads device memory directly, but does not wait for
        # kernels still running on the stream that writes it.
        sys.modules["cupy"].cuda.get_current_stream().synchronize()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)


def _torch_view(buf):
    """``buf`` as a tensor sharing its memory (bfloat16 travels as its bits)."""
    import torch

    if isinstance(buf, np.ndarray):
        if buf.dtype.name == "bfloat16":
            return torch.from_numpy(buf.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(buf)
    return torch.from_dlpack(buf)


# ---------------------------------------------------------------- local leaves

class _Local:
    """This rank's tree: plan, unique trainables (NumPy or CuPy views) and backend."""

    def __init__(self, tree, backend, comm):
        self.call = Call(tree)
        self.plan, self.arrays = self.call.plan, list(self.call.unique)
        if not self.arrays and comm.nccl():
            # No local gradients, but NCCL still needs a device buffer to join in.
            self.be = get_backend(backend or "cuda")
        else:
            self.be = self.call.backend(backend)

    def check_in_place(self):
        checks.check_in_place([leaf.path for leaf in self.plan.leaves], self.arrays)

    def give_back(self, x):
        """A result in the caller's kind: a tensor for PyTorch leaves."""
        return x if x is None else self.call.result(x)
