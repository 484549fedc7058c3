"""Reading DTensors (FSDP2, tensor parallel): the local shard, and who counts it.

A DTensor is one logical tensor spread over a device mesh. Its
``placements`` say, per mesh dimension, how: ``Shard(d)`` splits it along
tensor dimension ``d``, so every rank of that mesh dimension holds a
different piece; ``Replicate()`` gives every rank of it the whole; and
``Partial()`` gives every rank an addend of the true values.

gpuflat reads a DTensor through ``to_local()``, the rank's own shard,
zero-copy (FSDP2's uneven last shard comes unpadded). A global norm counts
every shard once: on the lowest global rank of those holding it, read from
its mesh's rank tensor and its placements. Leaves on submeshes of one mesh
(FSDP x TP puts the layers left out of tensor parallelism on the
data-parallel submesh) are read on that root mesh, replicated along the
dimensions their submesh leaves out, and the norm is reduced (one
collective each) over the mesh dimensions where some leaf is sharded; a
mesh dimension where every leaf is replicated needs none, since every rank
along it already holds the same partial. Leaves on meshes flattened or
unflattened from one root (expert parallelism: experts on one mesh, dense
layers on another) are reduced in one collective over the ranks their
meshes join, and so are pipeline stages given as a mesh cut from that
root. ``Partial()`` is refused: the norm of a sum is not the sum of norms,
so its values must be reduced first.

Neither torch nor its distributed package is imported here at module
import: a DTensor can only exist if the caller imported them already.
"""
from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from . import caches

if TYPE_CHECKING:
    from typing import TypeGuard

    import torch
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement

    # A layout as the norms read it: a DTensor's mesh and its placements.
    _Kind = tuple[DeviceMesh, tuple[Placement, ...]]

__all__ = ["Sharding", "first_path", "is_dtensor", "like", "local", "local_shards", "pipeline_group", "replicated",
           "sharding"]


def _dtensor_type() -> type[DTensor] | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def is_dtensor(x: object) -> TypeGuard[DTensor]:
    """True for a DTensor (a FSDP2 or tensor-parallel parameter or gradient).

    >>> import torch
    >>> is_dtensor(torch.ones(2)), is_dtensor("w")
    (False, False)
    """
    dtensor = _dtensor_type()
    return dtensor is not None and isinstance(x, dtensor)


def first_path(owners: Iterable[Any], paths: Iterable[str]) -> str | None:
    """The path of the first DTensor among ``owners``, or None.

    >>> import torch
    >>> first_path([None, torch.ones(2)], ["['a']", "['b']"]) is None
    True
    """
    return next((path for x, path in zip(owners, paths) if is_dtensor(x)), None)


def local(x: DTensor) -> torch.Tensor:
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


def local_shards(xs: Iterable[Any]) -> list[Any]:
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
    """How a tree of DTensors is spread over the ranks, and how its partials meet.

    ``groups``: the process groups this rank's partial is reduced over, one
    collective each, in order; ``owned``: a bool per leaf, True where this
    rank counts it; ``ranks``: how many ranks' partials the norm combines;
    ``mesh``: the mesh the norm is replicated over (the leaves' mesh, or
    their root mesh where they lie on several of its slices), or None where
    no one mesh holds it (leaves on meshes that are not dimensions of one
    mesh, or pipeline stages joined in); ``stages_joined``: whether
    ``groups`` already combine the stages of ``pp_mesh``. Made by
    :func:`sharding`.
    """

    def __init__(self, mesh: DeviceMesh | None, groups: list[ProcessGroup | None], owned: np.ndarray, ranks: int,
                 stages_joined: bool) -> None:
        self.mesh, self.groups, self.owned = mesh, groups, owned
        self.ranks, self.stages_joined = ranks, stages_joined


def sharding(owners: Sequence[Any], paths: Sequence[str], pp_mesh: DeviceMesh | None = None) -> Sharding | None:
    """The Sharding of leaves ``owners`` (the caller's objects, one per slot,
    None for NumPy and CuPy) named ``paths``, or None if none is a DTensor.

    Each shard counts on exactly one rank of those holding it: the lowest
    global rank, read from the rank tensor of its mesh and its placements.
    Where every leaf's mesh is its root mesh or a slice of it by dimension
    names, the partials are reduced over the root's dimensions that shard
    some leaf, one collective each. Otherwise (meshes made by ``_flatten``
    or ``_unflatten``: expert parallelism) they are reduced in one
    collective over the ranks the meshes join: reducing one partial over
    overlapping groups in turn (``dp_ep`` holding ``dp``) would count the
    shared ranks twice. ``pp_mesh``, a 1-D DeviceMesh over the pipeline
    stages cut from the same root mesh, joins the stages into that one
    collective, over every rank of the root; each stage holds its own
    layers, so ownership is settled within a stage. A ``pp_mesh`` that is
    a root of its own is left to the caller, to reduce over once the
    stages are.

    Raises naming the leaf for a ``Partial()`` placement, a leaf whose mesh
    has another root mesh than the first DTensor's, and a plain leaf beside
    DTensors (it does not say how it is spread over the ranks); a
    ``pp_mesh`` cut from another root than the leaves' is refused (a stage
    without gradients would reduce over that other root's ranks).

    >>> import torch, torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    >>> w = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0), Replicate()])
    >>> b = distribute_tensor(torch.ones(2), mesh["dp"], [Replicate()])
    >>> s = sharding([w, b], ["w", "b"])
    >>> len(s.groups), s.owned.tolist()  # reduced over mesh dimension 0 only; this rank counts both
    (1, [True, True])
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
    # Models hold many leaves of few layouts: each layout is checked once a call.
    layouts: dict[tuple[int, tuple[Placement, ...]], int] = {}
    kinds: list[_Kind] = []  # each layout's (mesh, placements), in the order met
    which = np.empty(len(owners), dtype=np.intp)
    for i, (x, path) in enumerate(zip(owners, paths)):
        if not is_dtensor(x):
            raise _plain_leaf(x, path, paths[first])
        key = (id(x.device_mesh), x.placements)
        k = layouts.get(key)
        if k is None:
            _check_layout(x, path, root, paths[first])
            k = layouts[key] = len(kinds)
            kinds.append((x.device_mesh, x.placements))
        which[i] = k
    joined = pp_mesh is not None and _root(pp_mesh) == root
    if joined and pp_mesh is not None:  # joined implies the second test, which is for mypy
        _check_layouts_readable(pp_mesh, "pp_mesh", root)
    elif pp_mesh is not None and _root(pp_mesh) != pp_mesh:
        raise _pipeline_of_another_root(pp_mesh, root, paths[first])
    import torch.distributed as dist

    found = _reading(tuple(kinds), pp_mesh if joined else None, dist.group.WORLD)
    return Sharding(found.mesh, found.groups, found.owned[which], found.ranks, joined)


def _root(mesh: DeviceMesh) -> DeviceMesh:
    # A submesh (mesh["dp"], a flattened or unflattened mesh) knows the mesh
    # it was cut from; a root mesh is its own.
    return mesh._get_root_mesh()


def _pipeline_of_another_root(pp_mesh: DeviceMesh, root: DeviceMesh, first_path: str) -> ValueError:
    return ValueError(f"pp_mesh: expected a mesh cut from the root mesh of leaf {first_path!r}, {root}, or a "
                      f"mesh of its own, found {pp_mesh} cut from {_root(pp_mesh)}: a stage holding no "
                      f"gradients reads no mesh but pp_mesh, so it reduces over the ranks of pp_mesh's root, "
                      f"which these stages do not; cut pp_mesh and the stages' meshes from one "
                      f"init_device_mesh (mesh['pp'], mesh['dp']), or pass pp_mesh.get_group()")


def _plain_leaf(x: object, path: str, first_path: str) -> TypeError:
    found = type(x).__name__ if x is not None else "a NumPy or CuPy array"
    return TypeError(f"leaf {path!r}: expected a DTensor, as leaf {first_path!r} is one (a plain leaf "
                     f"does not say how it is spread over the ranks), found {found}; make it a DTensor "
                     f"(distribute_tensor, or DTensor.from_local with its placements)")


def _check_layout(x: DTensor, path: str, root: DeviceMesh, first_path: str) -> None:
    for placement in x.placements:
        if placement.is_partial():
            raise ValueError(f"leaf {path!r}: expected Shard or Replicate placements, found {placement} in "
                             f"{tuple(x.placements)}: a Partial DTensor holds addends of its values, and "
                             f"the norm of a sum is not the sum of norms; redistribute it first, "
                             f"e.g. x.redistribute(placements=[Replicate()] * mesh.ndim)")
    mesh = x.device_mesh
    if _root(mesh) != root:
        cut_from = "" if _root(mesh) == mesh else f", cut from {_root(mesh)}"
        raise ValueError(f"leaf {path!r}: expected a DTensor on a mesh cut from the root mesh of leaf "
                         f"{first_path!r}, {root}, found one on {mesh}{cut_from}; make every mesh from one "
                         f"init_device_mesh: slice it by dimension names (mesh['dp']), flatten dimensions "
                         f"(mesh['dp', 'ep']._flatten('dp_ep')) or unflatten it "
                         f"(mesh._unflatten(0, (2, 2), ('dp', 'ep')))")
    if not _cut_by_names(mesh, root):
        _check_layouts_readable(mesh, f"leaf {path!r}", root)


def _cut_by_names(mesh: DeviceMesh, root: DeviceMesh) -> bool:
    """Whether ``mesh`` is ``root`` or a slice of it by dimension names."""
    names, root_names = mesh.mesh_dim_names or (), root.mesh_dim_names or ()
    return mesh == root or bool(names) and set(names) <= set(root_names)


# Reading every slice of a mesh (not only the one holding this rank, which
# its public ``mesh`` gives) takes the layout and rank map DeviceMesh keeps
# since torch 2.10; meshes sliced from their root by dimension names need
# neither.
_LAYOUTS_SINCE = "2.10"


def _check_layouts_readable(mesh: DeviceMesh, what: str, root: DeviceMesh) -> None:
    if not (hasattr(mesh, "_layout") and hasattr(mesh, "_rank_map")):
        import torch

        raise ValueError(f"{what}: expected a mesh that is {root} or a slice of it by dimension names, as "
                         f"torch {torch.__version__} does not say which ranks the other slices of other "
                         f"meshes hold, found {mesh}; upgrade torch to {_LAYOUTS_SINCE} or later, or "
                         f"slice every mesh from one root mesh by dimension names")


class _Reading:
    """What a set of layouts gives: per layout, whether this rank counts it;
    the groups to reduce over; the ranks joined; the mesh the norm is on."""

    def __init__(self, mesh: DeviceMesh | None, groups: list[ProcessGroup | None], owned: np.ndarray,
                 ranks: int) -> None:
        self.mesh, self.groups, self.owned, self.ranks = mesh, groups, owned, ranks


@caches.function(maxsize=8)
def _reading(kinds: tuple[_Kind, ...], pp_mesh: DeviceMesh | None, world: ProcessGroup | None) -> _Reading:
    """The _Reading of the layouts ``kinds`` ((mesh, placements) pairs), kept
    across calls: a model's layouts stay. ``world``, the default process
    group, keys it too, so that a new process group reads afresh."""
    import torch.distributed as dist

    root, me = _root(kinds[0][0]), dist.get_rank()
    if pp_mesh is None and all(_cut_by_names(mesh, root) for mesh, _ in kinds):
        return _by_root_dims(kinds, root, me)
    return _by_span(kinds, root, pp_mesh, me)


def _by_root_dims(kinds: Sequence[_Kind], root: DeviceMesh, me: int) -> _Reading:
    """Reduced over the root's dimensions that shard some leaf, one collective each.

    A leaf counts on the lowest rank of those holding its shard along the
    reduced dimensions: a dimension no leaf is sharded along is reduced
    over by no one, and every rank along it counts the same leaves.
    """
    sharded = [_sharded_root_dims(mesh, placements, root) for mesh, placements in kinds]
    dims = tuple(d for d in range(root.ndim) if any(s[d] for s in sharded))
    # This rank's place in the root; None, for a rank outside the root mesh,
    # is not handled here.
    coordinate = cast("list[int]", root.get_coordinate())
    ranks = root.mesh.numpy()
    owned = np.array([ranks[tuple(slice(None) if d in dims and not s[d] else coordinate[d]
                                  for d in range(root.ndim))].min() == me for s in sharded], dtype=bool)
    # The norm is replicated over the leaves' one mesh, as PyTorch returns
    # it; over the root where they lie on several of its cuts.
    meshes = {mesh for mesh, _ in kinds}
    on = meshes.pop() if len(meshes) == 1 else root
    return _Reading(on, [root.get_group(d) for d in dims], owned, root.size())


def _sharded_root_dims(mesh: DeviceMesh, placements: Sequence[Placement], root: DeviceMesh) -> list[bool]:
    """Per dimension of the root mesh, whether a leaf on ``mesh`` so placed is
    sharded along it (a submesh's leaf is replicated along the dimensions it
    leaves out)."""
    # Where mesh is not root both are named (only meshes cut by names come
    # here); ``or ()`` reads the names as _cut_by_names does.
    names = root.mesh_dim_names or ()
    dims = range(root.ndim) if mesh == root else [names.index(name) for name in mesh.mesh_dim_names or ()]
    sharded = [False] * root.ndim
    for d, placement in zip(dims, placements):
        # Not is_shard(): FSDP2 over tensor parallelism places _StridedShard,
        # which is no Shard, yet gives every rank its own piece all the same.
        sharded[d] = not placement.is_replicate()
    return sharded


def _by_span(kinds: Sequence[_Kind], root: DeviceMesh, pp_mesh: DeviceMesh | None, me: int) -> _Reading:
    """Reduced in one collective over the ranks the meshes join.

    A stage is the ranks joined to this one through slices of the leaves'
    meshes, and with ``pp_mesh`` through its stages too (the ranks at one
    position of its slices: the layers of one stage, replicated or sharded
    along the other dimensions). A leaf counts on the lowest rank of its
    stage holding its shard. With ``pp_mesh`` the collective is over every
    rank of the root (:func:`pipeline_group`), whatever the leaves' meshes
    join: a stage holding no gradients, which has no mesh but ``pp_mesh``
    to read, makes the same one.
    """
    meshes = list(dict.fromkeys(mesh for mesh, _ in kinds))
    slices = {mesh: _all_slices(mesh) for mesh in meshes}
    if pp_mesh is None:
        stage = span = _joined(me, slices.values())
    else:
        stage, span = _joined(me, [*slices.values(), _all_slices(pp_mesh).T]), _ranks_of(root)
    owned = np.array([_first_holder(slices[mesh], placements, me, stage) for mesh, placements in kinds],
                     dtype=bool)
    if span.size == 1:
        groups = []
    else:
        groups = [_group_over(span, [*meshes, root]) if pp_mesh is None else pipeline_group(pp_mesh)]
    return _Reading(None, groups, owned, int(span.size))


def pipeline_group(pp_mesh: DeviceMesh) -> ProcessGroup | None:
    """The process group the norms of the stages of ``pp_mesh`` (a 1-D
    DeviceMesh) are combined over: every rank of its root mesh, the mesh
    it was cut from (its own ranks where it is a root itself). Every rank
    finds it from ``pp_mesh`` alone, so a stage without gradients, that
    reads no other mesh, joins its stage-mates' collective.

    >>> import torch.distributed as dist
    >>> from torch.distributed.device_mesh import init_device_mesh
    >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    >>> mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("pp", "dp"))
    >>> dist.get_process_group_ranks(pipeline_group(mesh["pp"]))
    [0]
    >>> dist.destroy_process_group()
    """
    root = _root(pp_mesh)
    return _group_over(_ranks_of(root), [pp_mesh, root])


def _ranks_of(mesh: DeviceMesh) -> np.ndarray:
    """The global ranks of ``mesh``, sorted."""
    return np.sort(mesh.mesh.numpy().ravel())


def _all_slices(mesh: DeviceMesh) -> np.ndarray:
    """Every slice of ``mesh`` as a (slices, *mesh.shape) array of global ranks."""
    return mesh._layout.remap_to_tensor(mesh._rank_map).numpy()


def _joined(me: int, meshes: Iterable[np.ndarray]) -> np.ndarray:
    """The ranks (sorted) joined to ``me`` through slices, of any of ``meshes``
    (each as :func:`_all_slices` gives it), that share a rank."""
    rows = [s.reshape(len(s), -1) for s in meshes]
    held = np.array([me])
    while True:
        grown = np.union1d(held, np.concatenate([r[np.isin(r, held).any(axis=1)].ravel() for r in rows]))
        if grown.size == held.size:
            return grown
        held = grown


def _first_holder(slices: np.ndarray, placements: Sequence[Placement], me: int, within: np.ndarray) -> bool:
    """Whether ``me`` is the lowest rank of ``within`` holding the shard it holds.

    Those are the ranks, in any slice of the mesh, whose coordinates along
    its sharded dimensions are this rank's: a mesh that leaves out some of
    the stage's ranks holds the same tensor on each of its slices, as a
    layer left out of tensor parallelism does.
    """
    found = np.argwhere(slices == me)
    if not len(found):  # a DTensor on a mesh without this rank holds nothing here
        return False
    _, *coordinate = found[0]
    index = (slice(None), *(slice(None) if p.is_replicate() else c for p, c in zip(placements, coordinate)))
    holders = slices[index]
    return holders[np.isin(holders, within)].min() == me


# (default group, ranks) -> a process group made over exactly those ranks
_GROUPS: dict[tuple[ProcessGroup | None, tuple[int, ...]], ProcessGroup | None] = {}


def _group_over(ranks: np.ndarray, meshes: Sequence[DeviceMesh]) -> ProcessGroup | None:
    """A process group over exactly ``ranks`` (sorted global ranks, this one
    among them): the world's, or a mesh dimension's that spans them, else
    one made at the first call and kept."""
    import torch.distributed as dist

    if ranks.size == dist.get_world_size():
        return dist.group.WORLD
    wanted = ranks.tolist()
    for mesh in meshes:
        for d in range(mesh.ndim if mesh is not None else 0):
            group = mesh.get_group(d)
            if sorted(dist.get_process_group_ranks(group)) == wanted:
                return group
    key = (dist.group.WORLD, tuple(wanted))
    if key not in _GROUPS:
        # Only the group's ranks make it: the ranks of other spans (other
        # stages) make theirs in the same call.
        _GROUPS[key] = dist.new_group(wanted, use_local_synchronization=True)
    return _GROUPS[key]


def like(shard: torch.Tensor, x: object) -> torch.Tensor:
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


def replicated(total: torch.Tensor, mesh: DeviceMesh) -> DTensor:
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
