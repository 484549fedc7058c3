"""One rank of the multi-process DTensor tests (FSDP2, tensor parallel).

Run as ``python dtensor_worker.py OUT RANK SIZE PORT``: torch.distributed over
gloo on 127.0.0.1, one process per rank. Every case runs on every rank, in
CASES order (cases needing 4 ranks only there); each rank writes
``OUT/rank<r>.json`` mapping case name to "ok" or the error it met, after
every case, so a crash still reports the cases before it.

Every rank draws the same whole tensors from one seed, so each can check the
norm of its DTensors against the single-process norm of the whole tensors.
"""
from __future__ import annotations

import math
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import gpuflat as gf
import gpuflat.torch as gft
from gpuflat import distributed as gfd
from ranks import run_cases

ORDS = (1, 2, math.inf, 3)
CASES = []  # (name, the world sizes it runs on; None: any)


def case(f=None, *, sizes=None):
    def register(f):
        CASES.append((f.__name__, sizes))
        return f

    return register(f) if f is not None else register


# ---------------------------------------------------------------- data and references

def whole_tensors(seed=0):
    """float64 tensors whose sizes split unevenly over 2 and 4 ranks (7 rows, 6
    columns over 4, a single row), so some ranks hold short or empty shards."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(7, 5, generator=g, dtype=torch.float64) * 10,
        "v": torch.randn(5, 6, generator=g, dtype=torch.float64),
        "row": torch.randn(1, 3, generator=g, dtype=torch.float64),
        "ln": torch.randn(9, generator=g, dtype=torch.float64) * 100,
    }


LAYOUT_1D = {"w": [Shard(0)], "v": [Shard(1)], "row": [Shard(0)], "ln": [Replicate()]}


def ref_norm(tensors, p):
    """The p-norm of the whole tensors taken as one vector, exactly summed in float64."""
    values = np.concatenate([t.detach().numpy().ravel() for t in tensors]) if tensors else np.zeros(0)
    values = np.abs(values)
    if p == math.inf:
        return float(values.max())
    return math.fsum(values ** p) ** (1 / p)


def assert_close(found, expected, rtol, what):
    found = float(found.full_tensor() if isinstance(found, DTensor) else found)
    if not (math.isclose(found, expected, rel_tol=rtol, abs_tol=0) or found == expected):
        raise AssertionError(f"{what}: expected {expected!r}, got {found!r} (rtol {rtol})")


def assert_replicated(total, mesh, what):
    if not isinstance(total, DTensor):
        raise AssertionError(f"{what}: expected a DTensor, as PyTorch returns, got {type(total).__name__}")
    if total.device_mesh != mesh or any(not pl.is_replicate() for pl in total.placements):
        raise AssertionError(f"{what}: expected a DTensor replicated over {mesh}, got {total.placements} "
                             f"on {total.device_mesh}")


def distributed(whole, mesh, layout):
    return {k: distribute_tensor(t, mesh, layout[k]) for k, t in whole.items()}


def as_parameters(tree):
    """Parameters holding ``tree``'s DTensors, each with a gradient of twice its values."""
    params = []
    for t in tree.values():
        p = torch.nn.Parameter(t.clone())
        p.grad = t * 2
        params.append(p)
    return params


def comm_count(f):
    with CommDebugMode() as mode:
        result = f()
    return result, mode.get_total_counts()


# ---------------------------------------------------------------- norms

@case
def sharded_replicated_uneven_against_whole(ctx):
    whole = whole_tensors()
    tree = distributed(whole, ctx.mesh, LAYOUT_1D)
    # The one-row leaf lives on rank 0; the others hold an empty shard.
    if tree["row"].to_local().shape != ((1, 3) if ctx.rank == 0 else (0, 3)):
        raise AssertionError(f"the one-row leaf's shard is {tuple(tree['row'].to_local().shape)}")
    for p in ORDS:
        expected = ref_norm(list(whole.values()), p)
        assert_close(gfd.global_norm(tree, p), expected, 1e-12, f"ord {p}: gfd.global_norm")
        assert_close(gf.global_norm(tree, p), expected, 1e-12, f"ord {p}: gf.global_norm")
        total = gft.get_total_norm(list(tree.values()), p)
        assert_replicated(total, ctx.mesh, f"ord {p}: get_total_norm")
        assert_close(total, expected, 1e-12, f"ord {p}: gpuflat.torch.get_total_norm")
        if p != math.inf:  # torch's foreach inf-norm raises on the empty shards some ranks hold
            theirs = torch.nn.utils.get_total_norm(list(tree.values()), p)
            assert_close(total, float(theirs.full_tensor()), 1e-12, f"ord {p}: against torch's get_total_norm")
    # Counting the replicated leaf on every rank, as a plain sharded() rule
    # would, gives another norm: the case can fail.
    local = {k: t.to_local() for k, t in tree.items()}
    naive = float(gfd.global_norm(local, owned=gfd.sharded()))
    if math.isclose(naive, ref_norm(list(whole.values()), 2), rel_tol=1e-6):
        raise AssertionError("the replicated leaf made no difference: the case cannot fail")


@case
def local_shards_are_read_and_written_in_place(ctx):
    whole = whole_tensors()
    grads = distributed({k: t * 2 for k, t in whole.items()}, ctx.mesh, LAYOUT_1D)
    params = as_parameters(distributed(whole, ctx.mesh, LAYOUT_1D))
    for param, grad in zip(params, grads.values()):
        param.grad = grad
    addresses = [g.to_local().data_ptr() for g in grads.values()]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(ref, params):
        r.grad = p.grad.clone()
    expected = ref_norm([t * 2 for t in whole.values()], 2)
    total = gft.clip_grad_norm_(params, 1.0)
    theirs = torch.nn.utils.clip_grad_norm_(ref, 1.0)
    assert_replicated(total, ctx.mesh, "clip_grad_norm_")
    assert_close(total, expected, 1e-12, "clip_grad_norm_ against the whole tensors")
    assert_close(total, float(theirs.full_tensor()), 1e-12, "clip_grad_norm_ against torch's")
    for i, (p, r) in enumerate(zip(params, ref)):
        if p.grad is not grads[list(grads)[i]] or p.grad.to_local().data_ptr() != addresses[i]:
            raise AssertionError(f"parameters[{i}]: the gradient was replaced or redistributed")
        np.testing.assert_allclose(p.grad.full_tensor().numpy(), r.grad.full_tensor().numpy(), rtol=1e-12,
                                   err_msg=f"parameters[{i}].grad after the clip")
    # A norm reduced elsewhere drives the clip of the local shards.
    now = gft.get_total_norm([p.grad for p in params])
    gft.clip_grads_with_norm_(params, 0.5, now)
    assert_close(gft.get_total_norm([p.grad for p in params]), 0.5, 1e-5, "clip_grads_with_norm_")


@case
def one_collective_per_sharded_mesh_dimension(ctx):
    whole = {f"w{i}": torch.randn(8, 3, dtype=torch.float64) for i in range(20)}
    sharded = distributed(whole, ctx.mesh, {k: [Shard(0)] for k in whole})
    _, count = comm_count(lambda: gft.get_total_norm(list(sharded.values())))
    if count != 1:
        raise AssertionError(f"20 sharded leaves: expected 1 collective, got {count}")
    params = as_parameters(sharded)
    _, count = comm_count(lambda: gft.clip_grad_norm_(params, 1.0))
    if count != 1:
        raise AssertionError(f"the clip of 20 sharded leaves: expected 1 collective, got {count}")
    replicated = distributed(whole, ctx.mesh, {k: [Replicate()] for k in whole})
    total, count = comm_count(lambda: gft.get_total_norm(list(replicated.values())))
    if count != 0:
        raise AssertionError(f"every leaf replicated: expected no collective, got {count}")
    assert_close(total, ref_norm(list(whole.values()), 2), 1e-12, "every leaf replicated")


@case
def partial_and_plain_leaves_are_refused_naming_them(ctx):
    t = torch.ones(4, dtype=torch.float64)
    partial = DTensor.from_local(t, ctx.mesh, [Partial()], run_check=False)
    shard = distribute_tensor(t, ctx.mesh, [Shard(0)])
    for tree, kind, needles in (({"s": shard, "p": partial}, ValueError, ("['p']", "Partial", "redistribute")),
                                ({"s": shard, "plain": t}, TypeError, ("['plain']", "expected a DTensor"))):
        try:
            gfd.global_norm(tree)
        except kind as err:
            if not all(n in str(err) for n in needles):
                raise AssertionError(f"the error does not say {needles}: {err}") from err
        else:
            raise AssertionError(f"no {kind.__name__} for {list(tree)}")
    try:
        gfd.global_norm({"s": shard}, group=dist.group.WORLD)
    except ValueError as err:
        if "group: expected None for a tree of DTensors" not in str(err):
            raise AssertionError(f"unclear error: {err}") from err
    else:
        raise AssertionError("group= was taken beside DTensors")


@case
def nonfinite_is_named_on_every_rank(ctx):
    whole = whole_tensors()
    whole["w"][6, 0] = math.nan  # the last row: held by the last rank
    params = as_parameters(distributed(whole, ctx.mesh, LAYOUT_1D))
    before = [p.grad.to_local().clone() for p in params]
    try:
        gft.clip_grad_norm_(params, 1.0, error_if_nonfinite=True)
    except gft.NonFiniteNormError as err:
        message = str(err)
    else:
        raise AssertionError(f"rank {ctx.rank}: no NonFiniteNormError")
    if "'[0]'" not in message or f"rank {ctx.size - 1}" not in message:
        raise AssertionError(f"the error names neither the leaf nor the rank: {message}")
    for i, (p, b) in enumerate(zip(params, before)):
        if not torch.equal(p.grad.to_local().nan_to_num(), b.nan_to_num()):
            raise AssertionError(f"parameters[{i}] was scaled")


@case
def tree_functions_on_dtensors(ctx):
    whole = whole_tensors()
    tree = distributed(whole, ctx.mesh, LAYOUT_1D)
    flat, re = gf.destructure(tree)
    rebuilt = re(flat * 2)
    for k, t in rebuilt.items():
        if not isinstance(t, DTensor) or t.placements != tree[k].placements:
            raise AssertionError(f"leaf {k}: rebuilt as {type(t).__name__} {getattr(t, 'placements', '')}")
        np.testing.assert_allclose(t.full_tensor().numpy(), whole[k].numpy() * 2, rtol=1e-15, err_msg=k)
    # Written into the local shards themselves; a replicated DTensor's shard
    # is the very tensor it was made from, so compare with a fresh copy.
    gf.scatter(gf.plan(tree), flat * 3, tree)
    for k, t in tree.items():
        np.testing.assert_allclose(t.full_tensor().numpy(), whole_tensors()[k].numpy() * 3, rtol=1e-15,
                                   err_msg=k)
    for f in (lambda: gf.total("l2", tree), lambda: gf.clip_by_global_norm(tree, 1.0),
              lambda: gf.global_norm(tree, model=tree)):
        try:
            f()
        except TypeError as err:
            if "['w']" not in str(err) or "DTensor" not in str(err):
                raise AssertionError(f"unclear error: {err}") from err
        else:
            raise AssertionError("a reduction of local shards was not refused")
    grads = {k: t * 2 for k, t in tree.items()}  # six times the whole tensors, after the scatter
    try:
        gfd.all_reduce_(grads)
    except TypeError as err:
        if "['w']" not in str(err) or "different shards" not in str(err):
            raise AssertionError(f"unclear error: {err}") from err
    else:
        raise AssertionError("all_reduce_ summed the shards of DTensors")
    total = gf.clip_grad_norm_(grads, 1.0)
    assert_close(total, ref_norm([t * 6 for t in whole_tensors().values()], 2), 1e-12, "gf.clip_grad_norm_")
    assert_close(gf.global_norm(grads), 1.0, 1e-8, "gf.clip_grad_norm_ scaled the shards")


# ---------------------------------------------------------------- FSDP2

def mlp(seed, hidden=16, out=5):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, out),
                               torch.nn.LayerNorm(out)).double()


def train(net, clip, steps, rank):
    """Norms of ``steps`` SGD steps, clipped by ``clip(parameters)``; each rank its own data."""
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    norms = []
    for _ in range(steps):
        net(torch.randn(4, 8, generator=g, dtype=torch.float64)).square().sum().backward()
        norms.append(float(clip(list(net.parameters())).full_tensor()))
        opt.step()
        opt.zero_grad()
    return norms


def assert_same_training(ours, theirs, net_ours, net_theirs, what):
    for step, (a, b) in enumerate(zip(ours, theirs)):
        if not math.isclose(a, b, rel_tol=1e-12):
            raise AssertionError(f"{what}, step {step}: norm {a!r} against {b!r}")
    for (name, a), (_, b) in zip(net_ours.named_parameters(), net_theirs.named_parameters()):
        np.testing.assert_allclose(a.detach().full_tensor().numpy(), b.detach().full_tensor().numpy(),
                                   rtol=1e-12, atol=1e-15,
                                   err_msg=f"{what}: parameter {name}")


@case
def fsdp2_training_matches_torch(ctx):
    nets = [mlp(0), mlp(0)]
    for net in nets:
        fully_shard(net[0], mesh=ctx.mesh)
        fully_shard(net, mesh=ctx.mesh)
    if nets[0][2].weight.to_local().shape[0] * ctx.size == 5:
        raise AssertionError("the 5-row layer split evenly: the uneven shard is not tested")
    ours = train(nets[0], lambda ps: gft.clip_grad_norm_(ps, 0.05), 3, ctx.rank)
    theirs = train(nets[1], lambda ps: torch.nn.utils.clip_grad_norm_(ps, 0.05), 3, ctx.rank)
    if ours[0] <= 0.05:
        raise AssertionError(f"the norm {ours[0]} does not exceed max_norm: the clip did nothing")
    assert_same_training(ours, theirs, *nets, "FSDP2")


@case
def fsdp2_resident_is_refused(ctx):
    net = mlp(0)
    fully_shard(net, mesh=ctx.mesh)
    try:
        gf.resident(net)
    except TypeError as err:
        if "'0.weight'" not in str(err) or "FSDP2" not in str(err):
            raise AssertionError(f"unclear error: {err}") from err
    else:
        raise AssertionError("gf.resident took FSDP2 parameters")
    # Made resident first, then sharded: the next step raises instead of
    # computing on the buffers FSDP2 no longer reads.
    net = mlp(0)
    r = gf.resident(net)
    fully_shard(net, mesh=ctx.mesh)
    try:
        r.grad_norm()
    except gf.StaleResidentError as err:
        if "'0.weight'" not in str(err) or "DTensor" not in str(err):
            raise AssertionError(f"unclear error: {err}") from err
    else:
        raise AssertionError("a resident model computed after fully_shard replaced its parameters")


# ---------------------------------------------------------------- 2-D: FSDP x TP

def fsdp_tp(mesh):
    """The MLP with tensor-parallel linear layers on the "tp" dimension, then
    FSDP2 on "dp": the linear layers' parameters live on the 2-D mesh, the
    layer norm's on the "dp" submesh."""
    net = mlp(0, hidden=16, out=6)
    parallelize_module(net, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(net, mesh=mesh["dp"])
    return net


def full_norm_clip(max_norm):
    """The reference clip: the norm of the full gradients, the factor applied as PyTorch does."""
    def clip(params):
        grads = [p.grad for p in params if p.grad is not None]
        total = math.sqrt(math.fsum(float(g.full_tensor().square().sum()) for g in grads))
        coef = min(1.0, max_norm / (total + 1e-6))
        for g in grads:
            g.mul_(coef)
        return DTensor.from_local(torch.tensor(total, dtype=torch.float64), grads[0].device_mesh,
                                  [Replicate()] * grads[0].device_mesh.ndim, run_check=False)

    return clip


@case(sizes=(4,))
def fsdp_tp_2d_training(ctx):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    nets = [fsdp_tp(mesh), fsdp_tp(mesh)]
    meshes = {p.device_mesh.mesh_dim_names for p in nets[0].parameters()}
    if meshes != {("dp", "tp"), ("dp",)}:
        raise AssertionError(f"expected parameters on the 2-D mesh and its dp submesh, got {meshes}")
    params = list(nets[0].parameters())
    for p in params:
        p.grad = p.detach() * 3
    _, count = comm_count(lambda: gft.get_total_norm([p.grad for p in params]))
    if count != 2:
        raise AssertionError(f"two sharded mesh dimensions: expected 2 collectives, got {count}")
    total = gft.get_total_norm([p.grad for p in params])
    assert_replicated(total, mesh, "get_total_norm on the 2-D mesh")
    for p in ORDS:
        expected = ref_norm([q.grad.full_tensor() for q in params], p)
        assert_close(gft.get_total_norm([q.grad for q in params], p), expected, 1e-12, f"2-D, ord {p}")
    for p in params:
        p.grad = None
    ours = train(nets[0], lambda ps: gft.clip_grad_norm_(ps, 0.05), 3, ctx.rank // 2)
    theirs = train(nets[1], full_norm_clip(0.05), 3, ctx.rank // 2)
    assert_same_training(ours, theirs, *nets, "FSDP x TP")


@case(sizes=(4,))
def unrelated_meshes_are_refused_naming_the_leaf(ctx):
    a = init_device_mesh("cpu", (4,))
    b = init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    tree = {"a": distribute_tensor(torch.ones(4), a, [Shard(0)]),
            "b": distribute_tensor(torch.ones(4), b, [Shard(0), Replicate()])}
    try:
        gfd.global_norm(tree)
    except ValueError as err:
        if "['b']" not in str(err) or "mesh" not in str(err):
            raise AssertionError(f"unclear error: {err}") from err
    else:
        raise AssertionError("leaves on unrelated meshes were taken")


# ---------------------------------------------------------------- running

class Ctx:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size
        self.mesh = init_device_mesh("cpu", (size,))


def main(out_dir, rank, size, port):
    rank, size = int(rank), int(size)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    ctx = Ctx(rank, size)
    run_cases([(name, globals()[name]) for name, sizes in CASES if sizes is None or size in sizes], ctx, out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
