"""Reading DTensors (FSDP2, tensor parallel): the local shard, and who counts it.

A DTensor is one logical tensor spread over a device mesh. Its
``placements`` say, per mesh dimension, how: ``Shard(d)`` splits it along
tensor dimension ``d``, so every rank of that mesh dimension holds a
different piece; ``Replicate()`` gives every rank of it the whole; and
``Partial()`` gives every rank an addend of the true values.

gpuflat reads a DTensor through ``to_local()``, the rank's own shard,
zero-copy (FSDP2's uneven last shard comes unpadded). A global norm counts
every element once: a leaf counts on a rank when, along every mesh
dimension the norm is reduced over where the leaf is replicated, the rank
sits at coordinate 0. The norm is reduced (one collective each) over the
mesh dimensions where some leaf is sharded; a mesh dimension where every
leaf is replicated needs none, since every rank along it already holds the
same partial. Leaves on submeshes of one mesh (FSDP x TP puts the layers
left out of tensor parallelism on the data-parallel submesh) are read on
that root mesh, replicated along the dimensions their submesh leaves out.
``Partial()`` is refused: the norm of a sum is not the sum of norms, so its
values must be reduced first.

Neither torch nor its distributed package is imported here at module
import: a DTensor can only exist if the caller imported them already.
"""
from __future__ import annotations

import sys

import numpy as np

__all__ = ["Sharding", "first_path", "is_dtensor", "like", "local", "local_shards", "replicated", "sharding"]


def _dtensor_type():
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(x) -> bool:
    """True for a DTensor (a FSDP2 or tensor-parallel parameter or gradient).

    >>> import torch
    >>> is_dtensor(torch.ones(2)), is_dtensor("w")
    (False, False)
    """
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(x, dtensor)


def first_path(owners, paths):
    """The path of the first DTensor among ``owners``, or None.

    >>> import torch
    >>> first_path([None, torch.ones(2)], ["['a']", "['b']"]) is None
    True
    """
    return next((path for x, path in zip(owners, paths) if is_dtensor(x)), None)


def local(x):
    """The rank's own shard of the DTensor ``x``: a plain tensor sharing its memory.

    The shard is the very tensor the DTensor holds (as ``to_local()``
    returns it with autograd off), so writes into it change the DTensor; a
    shard still arriving from an asynchronous collective is waited for.

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Shard, distribute_tensor
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> w = distribute_tensor(torch.arange(3.0), init_device_mesh("cpu", (1,)), [Shard(0)])
    >>> local(w), local(w).untyped_storage().data_ptr() == w._local_tensor.untyped_storage().data_ptr()
    (tensor([0., 1., 2.]), True)
    >>> dist.destroy_process_group()
    """
    return local_shards([x])[0]


def local_shards(xs) -> list:
    """Each DTensor of ``xs`` as :func:`local` reads it, anything else
    (a plain tensor, None) itself: a model's parameters in one call.

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Shard, distribute_tensor
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> w = distribute_tensor(torch.arange(2.0), init_device_mesh("cpu", (1,)), [Shard(0)])
    >>> local_shards([w, None, torch.ones(1)])
    [tensor([0., 1.]), None, tensor([1.])]
    >>> dist.destroy_process_group()
    """
    dtensor = _dtensor_type()
    if dtensor is None:
        return list(xs)
    # Without autograd, to_local() is the DTensor's _local_tensor (PyTorch
    # keeps that identity), except that for a parameter it makes a new view
    # of it each call: about 1 us, milliseconds per step for a model's
    # thousands of shards. Read directly, the slot costs nothing, and no
    # autograd node is made whether autograd is on or not.
    shards = [x._local_tensor if isinstance(x, dtensor) else x for x in xs]
    collectives = sys.modules.get("torch.distributed._functional_collectives")
    if collectives is not None:
        waiting = collectives.AsyncCollectiveTensor
        shards = [s.wait() if isinstance(s, waiting) else s for s in shards]
    return shards


class Sharding:
    """How a tree of DTensors is spread over the ranks.

    ``mesh`` is the root mesh of every leaf's mesh (a leaf on a submesh,
    such as a layer left out of tensor parallelism on the data-parallel
    submesh of a 2-D mesh, is replicated over the root's other dimensions);
    ``dims`` the root mesh dimensions the norm is reduced over (those where
    some leaf is sharded), in mesh order; ``owned`` a bool per leaf, True
    where this rank counts it. Made by :func:`sharding`.
    """

    def __init__(self, mesh, dims, owned):
        self.mesh, self.dims, self.owned = mesh, dims, owned

    def groups(self) -> list:
        """The process group of each mesh dimension to reduce over: one collective each."""
        return [self.mesh.get_group(d) for d in self.dims]


def sharding(owners, paths):
    """The Sharding of leaves ``owners`` (the caller's objects, one per slot,
    None for NumPy and CuPy) named ``paths``, or None if none is a DTensor.

    Raises naming the leaf for a ``Partial()`` placement, a leaf whose mesh
    has another root mesh than the first DTensor's (or whose dimensions are
    not named ones of the root), and a plain leaf beside DTensors (it does
    not say how it is spread over the ranks).

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    >>> w = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0), Replicate()])
    >>> b = distribute_tensor(torch.ones(2), mesh["dp"], [Replicate()])
    >>> s = sharding([w, b], ["w", "b"])
    >>> s.dims, s.owned.tolist()  # reduced over mesh dimension 0 only; this rank counts both
    ((0,), [True, True])
    >>> sharding([w, torch.ones(2)], ["w", "c"])
    Traceback (most recent call last):
    ...
    TypeError: leaf 'c': expected a DTensor, as leaf 'w' is one (a plain leaf does not say how it is spread over the ranks), found Tensor; make it a DTensor (distribute_tensor, or DTensor.from_local with its placements)
    >>> sharding([None], ["['w']"]) is None
    True
    >>> dist.destroy_process_group()
    """
    first = next((i for i, x in enumerate(owners) if is_dtensor(x)), None)
    if first is None:
        return None
    root = _root(owners[first].device_mesh)
    # Models hold many leaves of few layouts: each layout is read once.
    layouts: dict = {}
    sharded = [_sharded_dims(x, path, root, paths[first], layouts) for x, path in zip(owners, paths)]
    coordinate = root.get_coordinate()
    dims = tuple(d for d in range(root.ndim) if any(s[d] for s in sharded))
    owned = np.array([all(s[d] or coordinate[d] == 0 for d in dims) for s in sharded], dtype=bool)
    return Sharding(root, dims, owned)


def _root(mesh):
    # A submesh (mesh["dp"]) knows the mesh it was cut from; a root mesh is its own.
    return mesh._get_root_mesh()


def _sharded_dims(x, path, root, first_path, layouts) -> tuple:
    """Per dimension of the root mesh, whether leaf ``x`` is sharded along it;
    ``layouts`` keeps the answers by (mesh, placements)."""
    if is_dtensor(x):
        key = (id(x.device_mesh), x.placements)
        if key not in layouts:
            layouts[key] = _read_layout(x, path, root, first_path)
        return layouts[key]
    found = type(x).__name__ if x is not None else "a NumPy or CuPy array"
    raise TypeError(f"leaf {path!r}: expected a DTensor, as leaf {first_path!r} is one (a plain leaf "
                    f"does not say how it is spread over the ranks), found {found}; make it a DTensor "
                    f"(distribute_tensor, or DTensor.from_local with its placements)")


def _read_layout(x, path, root, first_path) -> tuple:
    for placement in x.placements:
        if placement.is_partial():
            raise ValueError(f"leaf {path!r}: expected Shard or Replicate placements, found {placement} in "
                             f"{tuple(x.placements)}: a Partial DTensor holds addends of its values, and "
                             f"the norm of a sum is not the sum of norms; redistribute it first, "
                             f"e.g. x.redistribute(placements=[Replicate()] * mesh.ndim)")
    sharded = [False] * root.ndim
    for d, placement in zip(_root_dims(x.device_mesh, path, root, first_path), x.placements):
        # Not is_shard(): FSDP2 over tensor parallelism places _StridedShard,
        # which is no Shard, yet gives every rank its own piece all the same.
        sharded[d] = not placement.is_replicate()
    return tuple(sharded)


def _root_dims(mesh, path, root, first_path) -> list:
    """The root mesh dimension of each of ``mesh``'s, found by name for a submesh."""
    if mesh == root:
        return list(range(root.ndim))
    names, root_names = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
    if _root(mesh) != root or not names or not set(names) <= set(root_names):
        raise ValueError(f"leaf {path!r}: expected a DTensor on the mesh of leaf {first_path!r}, {root}, or "
                         f"on a submesh of it cut by dimension names, found one on {mesh}; take the norm "
                         f"of each mesh's leaves with gpuflat.torch.get_total_norm and combine the norms")
    return [root_names.index(name) for name in names]


def like(shard, x):
    """``shard`` (a plain tensor shaped as ``x``'s local shard) as a DTensor laid
    out as ``x``; ``shard`` itself when ``x`` is no DTensor.

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Shard, distribute_tensor
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> w = distribute_tensor(torch.ones(2), init_device_mesh("cpu", (1,)), [Shard(0)])
    >>> half = like(torch.full((2,), 0.5), w)
    >>> half.placements, half.full_tensor()
    ((Shard(dim=0),), tensor([0.5000, 0.5000]))
    >>> like(torch.ones(1), torch.zeros(1))
    tensor([1.])
    >>> dist.destroy_process_group()
    """
    if not is_dtensor(x):
        return shard
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(shard, x.device_mesh, x.placements, run_check=False, shape=x.shape,
                              stride=x.stride())


def replicated(total, mesh):
    """``total``, the same on every rank, as a DTensor replicated over ``mesh``:
    what PyTorch's norms return for DTensor inputs.

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> norm = replicated(torch.tensor(5.0), init_device_mesh("cpu", (1,)))
    >>> norm.placements, norm.full_tensor()
    ((Replicate(),), tensor(5.))
    >>> dist.destroy_process_group()
    """
    from torch.distributed.tensor import DTensor, Replicate

    return DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
