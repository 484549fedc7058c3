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

A tree of DTensors (FSDP2, tensor parallel, expert parallel) brings its
own groups and ownership: each leaf counts its local shard where its
placements say (``gpuflat._src.dtensor``), and the partials are reduced with one
collective per mesh dimension that shards some leaf, or in one collective
over the ranks that meshes flattened or unflattened from one root join;
``group=`` and ``owned=`` are then not taken. ``pp_mesh=`` combines the
norms of pipeline stages, and ``tied=`` counts a weight held by two stages
on one of them.

>>> import numpy as np
>>> from gpuflat import distributed as gfd
>>> grads = {"w": np.array([3.0, 4.0]), "ln": np.array([12.0])}
>>> float(gfd.global_norm(grads))
13.0
>>> float(gfd.global_norm(grads, owned={"['w']"}))  # a world of one: only 'w' counts
5.0
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._src import public as _public
from ._src import ranks as _ranks
from ._src.layout import CLIP_EPS as _CLIP_EPS
from ._src.ranks import PATH_FORMAT, Owned
from ._src.ranks import OwnedLike as _OwnedLike
from .errors import CollectiveError

__all__ = ["PATH_FORMAT", "CollectiveError", "Owned", "all_reduce_", "check_pipeline", "clip_grad_norm_",
           "global_norm", "replicated", "sharded", "tied"]

__dir__ = _public.listing(__all__)
# Names this module showed in 0.7.0 beside __all__ (what it imported), deprecated.
if not TYPE_CHECKING:  # see gpuflat._src.public
    __getattr__ = _public.deprecations(__name__, {
        "Call": "gpuflat._src.binding.Call",
        "adopt": "gpuflat._src.arrays.adopt",
        "caches": "gpuflat._src.caches",
        "checks": "gpuflat._src.checks",
        "clipping": "gpuflat._src.clipping",
        "device_scope": "gpuflat._src.arrays.device_scope",
        "dtensor": "gpuflat._src.dtensor",
        "get_backend": "gpuflat._src.backends.get_backend",
        "is_bfloat16": "gpuflat._src.dtypes.is_bfloat16",
        "is_module": "gpuflat._src.arrays.is_module",
        "module_parameters": "gpuflat._src.arrays.module_parameters",
    })


def global_norm(tree: Any, ord: float = 2, *, group: Any = None, owned: _OwnedLike | None = None,
                pp_mesh: Any = None, tied: Any = None, per_leaf: bool = False, error_if_nonfinite: bool = False,
                backend: str | None = None) -> Any:
    """The norm of a model spread over the ranks of ``group``; every rank gets the same value.

    Each rank passes its local leaves; ``owned`` says which of them this rank
    counts (see ``Owned``). Returns a 0-d float64 array on the leaves' device
    (a tensor for torch leaves); with ``per_leaf=True``, ``(total,
    per_leaf_norms)`` where the per-leaf norms are this rank's, owned or not.
    With ``error_if_nonfinite`` a non-finite norm makes every rank raise
    NonFiniteError naming the leaf and the rank.
    One collective, and no host synchronisation. A tree of DTensors takes
    its groups and ownership from its mesh and placements (one collective
    per mesh dimension that shards some leaf) and returns the norm as a
    DTensor replicated over the mesh, as PyTorch does.

    Leaves on meshes flattened or unflattened from one root mesh (expert
    parallelism) are reduced in one collective over the ranks the meshes
    join (reading those meshes takes torch 2.10 or later). ``pp_mesh``, a
    1-D DeviceMesh or a process group over the pipeline stages, combines
    the stages' partials (summed p-th powers, max for inf): cut from the
    leaves' root mesh, in the same one collective; otherwise in one more.
    The norm then comes back as a plain tensor, the same on every rank.
    Plain leaves take ``pp_mesh`` only where each stage is one rank. A
    stage without gradients passes an empty tree on each of its ranks:
    they join the other stages' collective, adding nothing, and get the
    same norm (a float64 NumPy scalar, or CuPy array, having no leaf to
    take the kind of). A ``pp_mesh`` mesh, the one mesh such a stage
    reads, is cut from the stages' root mesh or is a root of its own.
    ``tied``, pairs ``(leaf, owning stage)``, counts a weight held by
    several stages (an embedding tied to the output layer) on its owner
    only; a pair whose leaf is None is skipped.

    >>> import numpy as np
    >>> from gpuflat import distributed as gfd
    >>> g = {"a": np.array([3.0, 0.0]), "b": np.array([[4.0]], np.float32)}
    >>> float(gfd.global_norm(g)), float(gfd.global_norm(g, ord=1)), float(gfd.global_norm(g, np.inf))
    (5.0, 7.0, 4.0)
    """
    return _ranks.global_norm(tree, ord, group=group, owned=owned, pp_mesh=pp_mesh, tied=tied, per_leaf=per_leaf,
                             error_if_nonfinite=error_if_nonfinite, backend=backend)


def clip_grad_norm_(grads: Any, max_norm: float, ord: float = 2, *, group: Any = None,
                    owned: _OwnedLike | None = None, pp_mesh: Any = None, tied: Any = None, eps: float = _CLIP_EPS,
                    error_if_nonfinite: bool = False, backend: str | None = None) -> Any:
    """Scale every rank's gradients by the same min(1, max_norm / (norm + eps)); return the norm.

    PyTorch's ``clip_grad_norm_`` over a model spread across ranks: the norm
    is ``global_norm(grads, ord, group=group, owned=owned)``, the factor is
    computed on the device and always applied (no host synchronisation).
    With ``error_if_nonfinite`` a non-finite norm makes every rank raise
    NonFiniteError naming the leaf and the rank, and nothing is scaled.
    DTensor gradients are scaled in their local shards, with no
    redistribution. ``pp_mesh`` and ``tied`` are taken as by
    ``global_norm``: every stage scales by the same factor.

    >>> import numpy as np
    >>> from gpuflat import distributed as gfd
    >>> g = {"w": np.array([3.0, 4.0]), "b": np.zeros(1, np.float32)}
    >>> float(gfd.clip_grad_norm_(g, 1.0))
    5.0
    >>> g["w"].round(6)
    array([0.6, 0.8])
    """
    return _ranks.clip_grad_norm_(grads, max_norm, ord, group=group, owned=owned, pp_mesh=pp_mesh, tied=tied,
                                 eps=eps, error_if_nonfinite=error_if_nonfinite, backend=backend)


def check_pipeline(pp_mesh: Any, tied: Any = None, leaves: Any = None) -> None:
    """Raise what ``global_norm`` raises for ``pp_mesh`` and ``tied``, before
    any norm is taken: for a caller keeping them for later norms (a flat
    optimizer's constructor). Where ``leaves`` is given, each tied leaf
    must be one of them.

    >>> import numpy as np
    >>> check_pipeline(None)
    >>> check_pipeline(None, tied=[(np.ones(2), 0)])
    Traceback (most recent call last):
    ...
    ValueError: tied: expected pp_mesh= beside it, the pipeline whose stages own the tied weights, ...
    """
    _ranks.check_pipeline(pp_mesh, tied, leaves)


def all_reduce_(grads: Any, op: str = "mean", *, group: Any = None, bucket_bytes: int | None = None) -> None:
    """Sum (or average) gradients across ranks in place, through one flat buffer.

    ``grads`` is a tree of gradients, a ``torch.nn.Module`` (its parameters'
    ``.grad``), or a resident model (``gf.resident``: its ``grad_buffers``
    are reduced as they are). A tree is gathered into one buffer of the
    plan's dtype, reduced, and scattered back: one collective per
    ``bucket_bytes`` (default: the whole buffer) instead of one per tensor.
    "mean" sums, then divides by the number of ranks; float16 and bfloat16
    are summed and divided in float32 and rounded once.

    All or nothing across ranks: each rank checks its gradients first, then
    one small collective compares every rank's verdict and gradient size; if
    any rank failed, every rank raises (the others a CollectiveError naming
    that rank and its error) and no rank changes anything. DTensor
    gradients are refused: their ranks hold different shards.

    A resident PyTorch model's parameters whose ``.grad`` is None (unused in
    this rank's forward, after ``zero_grad()``) add zeros, as DDP's
    ``find_unused_parameters=True`` does: where another rank had a gradient,
    every rank's ``.grad`` is then the average (or the sum), and where no
    rank had one, it stays None everywhere. Which ones those are takes one
    more small collective, only when some rank has such a parameter.

    >>> import numpy as np
    >>> from gpuflat import distributed as gfd
    >>> g = {"w": np.array([1.0, 2.0], np.float32), "b": np.array([3.0], np.float32)}
    >>> gfd.all_reduce_(g, "sum")  # a world of one: the values stay
    >>> g["w"], g["b"]
    (array([1., 2.], dtype=float32), array([3.], dtype=float32))
    """
    _ranks.all_reduce_(grads, op, group=group, bucket_bytes=bucket_bytes)


def sharded() -> Owned:
    """Every leaf counts on every rank: tensor-parallel shards, ZeRO/FSDP shards.

    >>> import numpy as np
    >>> sharded()("['w']", np.ones(2))
    True
    """
    return _ranks.sharded()


def replicated(group: Any = None, where: _OwnedLike | None = None) -> Owned:
    """Leaves held whole on every rank of ``group`` count on its rank 0 only.

    For tensor-parallel duplicates (layer norms, biases of row-parallel
    layers: Megatron's ``param_is_not_tensor_parallel_duplicate``).
    ``where`` picks the replicated leaves (an iterable of paths, each of
    which every rank must hold, or a callable ``(path)`` or ``(path, leaf)``
    -> bool; None: all of them); the others count everywhere.

    >>> import numpy as np
    >>> rule = replicated(where={"ln"})  # a world of one: this is rank 0
    >>> rule("['ln']", np.ones(2)), rule("['w']", np.ones(2))
    (True, True)
    """
    return _ranks.replicated(group, where)


def tied(owner_rank: int, group: Any = None, where: _OwnedLike | None = None) -> Owned:
    """Copies of one parameter on several ranks count on ``owner_rank`` of ``group`` only.

    For an embedding tied across pipeline stages (the first and last stage
    each hold a copy): pass the pipeline group, the owning stage, and
    ``where`` naming the tied leaves (paths the owner must hold, or a
    callable as in ``replicated``); other leaves count everywhere.

    >>> import numpy as np
    >>> rule = tied(0, where=lambda path: "embed" in path)  # a world of one: this is rank 0
    >>> rule("['embed']", np.ones(2)), rule("['w']", np.ones(2))
    (True, True)
    >>> tied(1, where={"embed"})
    Traceback (most recent call last):
    ...
    ValueError: owner_rank: expected a rank of the group, 0 to 0 (a group of 1 rank), got 1
    """
    return _ranks.tied(owner_rank, group, where)
