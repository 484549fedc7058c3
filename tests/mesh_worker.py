"""One rank of the multi-process tests of models split over several meshes:
expert parallelism (experts and dense layers on different meshes of one
root mesh) and pipeline stages (``pp_mesh=``, ``tied=``).

Run as ``python mesh_worker.py OUT RANK SIZE PORT``: torch.distributed over
gloo on 127.0.0.1, one process per rank, every case of CASES in order (those
needing 4 ranks only there); each rank writes ``OUT/rank<r>.json`` after every
case, as tests/dtensor_worker.py does.

Every rank draws the whole tensors of every stage from fixed seeds, so each
can check the norm of its shards against the float64 norm of the whole model.
Collectives are counted with torch's CommDebugMode, which sees the gloo
all-reduces gpuflat makes on plain tensors too (one per reduction,
whichever group it runs on).
"""
from __future__ import annotations

import math
import sys
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import gpuflat.torch as gft
from gpuflat import distributed as gfd
from gpuflat._src import dtensor
from dtensor_worker import ORDS, assert_close, comm_count, ref_norm
from ranks import run_cases
from torch_lion import Lion as TorchLion

CASES = []  # (name, the world sizes it runs on; None: any)
MAX_NORM_SHARE = 0.5  # every clip below bounds the norm at half its value: it really scales


def case(f=None, *, sizes=None):
    def register(f):
        CASES.append((f.__name__, sizes))
        return f

    return register(f) if f is not None else register


# ---------------------------------------------------------------- data and checks

def whole(seed, shapes):
    """float64 tensors of ``shapes`` (name -> shape) drawn from ``seed``; their
    sizes split unevenly over 2 and 4 ranks, leaving some shards empty."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(*shape, generator=g, dtype=torch.float64) * (1 + 9 * (i % 2))
            for i, (name, shape) in enumerate(shapes.items())}


def parameters(tensors, on):
    """A parameter per tensor, laid out by ``on[name]`` ((mesh, placements), or
    None for a plain tensor), with a gradient of twice its values."""
    params = {}
    for name, t in tensors.items():
        mesh_placements = on[name]
        value = t.clone() if mesh_placements is None else distribute_tensor(t, *mesh_placements)
        p = torch.nn.Parameter(value)
        p.grad = value.detach() * 2
        params[name] = p
    return params


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def check_norms(grads, reference, what, **kw):
    """gft.get_total_norm and gfd.global_norm of ``grads`` against the float64
    norm of the whole tensors ``reference``, for every order."""
    for p in ORDS:
        expected = ref_norm(reference, p)
        assert_close(gft.get_total_norm(grads, p, **kw), expected, 1e-12, f"{what}, ord {p}: get_total_norm")
        assert_close(gfd.global_norm(grads, p, **kw), expected, 1e-12, f"{what}, ord {p}: gfd.global_norm")


def check_clip(params, reference, what, **kw):
    """gft.clip_grad_norm_ at half the norm: the norm returned, and every
    gradient after it equal to the float64 reference's scaled gradient
    (parameters without a gradient keep none)."""
    for p in ORDS:
        saved = {name: q.grad.detach().clone() for name, q in params.items() if q.grad is not None}
        expected = ref_norm(reference, p)
        max_norm = MAX_NORM_SHARE * expected
        total = gft.clip_grad_norm_(list(params.values()), max_norm, p, **kw)
        assert_close(total, expected, 1e-12, f"{what}, ord {p}: the norm clip_grad_norm_ returned")
        check_scaled({name: params[name].grad for name in saved}, saved, max_norm / (expected + 1e-6),
                     f"{what}, ord {p}: {{}}.grad after the clip")


def check_gfd_clip(grads, reference, what, **kw):
    """gfd.clip_grad_norm_ of the tree ``grads`` (name -> gradient) at half the norm, as check_clip."""
    for p in ORDS:
        saved = {name: g.detach().clone() for name, g in grads.items()}
        expected = ref_norm(reference, p)
        max_norm = MAX_NORM_SHARE * expected
        total = gfd.clip_grad_norm_(grads, max_norm, p, **kw)
        assert_close(total, expected, 1e-12, f"{what}, ord {p}: the norm gfd.clip_grad_norm_ returned")
        check_scaled(grads, saved, max_norm / (expected + 1e-6), f"{what}, ord {p}: {{}} after gfd's clip")


def check_scaled(tensors, saved, coef, message):
    """Each of ``tensors`` (name -> tensor) equal to its ``saved`` value times
    min(1, coef), then given its saved value back."""
    for name, before in saved.items():
        t = tensors[name]
        np.testing.assert_allclose(full(t).numpy(), full(before).numpy() * min(1.0, coef), rtol=1e-12, atol=0,
                                   err_msg=message.format(name))
        t.copy_(before)


def expect_error(kind, needles, f):
    try:
        f()
    except kind as err:
        missing = [n for n in needles if n not in str(err)]
        if missing:
            raise AssertionError(f"the error does not say {missing}: {err}") from err
        return str(err)
    raise AssertionError(f"no {kind.__name__} (expected one saying {needles})")


def expect_collectives(expected, f, what):
    result, count = comm_count(f)
    if count != expected:
        raise AssertionError(f"{what}: expected {expected} collective{'s' * (expected != 1)}, got {count}")
    return result


# ---------------------------------------------------------------- expert parallelism

DENSE = {"w": (7, 5), "ln": (9,), "row": (1, 3)}
EXPERTS = {"experts": (4, 6, 3), "gate": (6, 5)}


def ep_tensors():
    return {**whole(0, DENSE), **whole(1, EXPERTS)}


@case
def slice_beside_flattened_mesh(ctx):
    """Dense layers on ``mesh["dp"]``, experts on ``mesh["dp", "ep"]._flatten()``
    (both of the (dp, ep) root): one all-reduce over the ranks they join.
    With ep=2 (4 ranks) a dense layer is replicated along "ep": it must
    count on one rank of each pair holding the same shard."""
    mesh = init_device_mesh("cpu", (2, ctx.size // 2), mesh_dim_names=("dp", "ep"))
    dp, dp_ep = mesh["dp"], mesh["dp", "ep"]._flatten("dp_ep")
    tensors = ep_tensors()
    params = parameters(tensors, {"w": (dp, [Shard(0)]), "ln": (dp, [Replicate()]), "row": (dp, [Shard(0)]),
                                  "experts": (dp_ep, [Shard(0)]), "gate": (mesh, [Shard(1), Shard(0)])})
    grads = [p.grad for p in params.values()]
    reference = [t * 2 for t in tensors.values()]
    expect_collectives(1, lambda: gft.get_total_norm(grads), "get_total_norm over a slice and a flattened mesh")
    expect_collectives(1, lambda: gft.clip_grad_norm_(list(params.values()), 1e9),
                       "clip_grad_norm_ over a slice and a flattened mesh")
    check_norms(grads, reference, "slice beside flattened")
    check_clip(params, reference, "slice beside flattened")
    # The counting rule itself: a dense shard held by the ranks of one "ep"
    # row counts on the lowest of them, a replicated leaf on rank 0 alone.
    s = dtensor.sharding(grads, list(params))
    owners = {name: bool(o) for name, o in zip(params, s.owned)}
    lowest_of_row = ctx.rank % (ctx.size // 2) == 0
    expected = {"w": lowest_of_row, "ln": ctx.rank == 0, "row": lowest_of_row, "experts": True, "gate": True}
    if owners != expected:
        raise AssertionError(f"rank {ctx.rank} counts {owners}, expected {expected}")
    if ctx.size == 4:
        # Counted on the lowest rank of its own slice of "dp", blind to the
        # other slices, a dense shard would count twice: the case can fail.
        blind = {f"['{name}']" for name in params if name != "ln" or ctx.rank < 2}
        local = {name: dtensor.local(g) for name, g in zip(params, grads)}
        if math.isclose(float(gfd.global_norm(local, owned=blind)), ref_norm(reference, 2), rel_tol=1e-6):
            raise AssertionError("counting a shard on every slice made no difference: the case cannot fail")


@case
def torchtitan_sibling_meshes(ctx):
    """torchtitan's layout: a root mesh over the world, unflattened twice into
    sibling meshes, the dense layers' ("dp_shard_cp") and the experts'
    ("dp_shard_in_ep", "ep"); experts split over "ep" along their first
    dimension, each FSDP-sharded along its second."""
    world = init_device_mesh("cpu", (ctx.size,), mesh_dim_names=("world",))
    dense = world._unflatten(0, (ctx.size,), ("dp_shard_cp",))
    sparse = world._unflatten(0, (ctx.size // 2, 2), ("dp_shard_in_ep", "ep"))
    if dense._get_root_mesh() is not world or sparse._get_root_mesh() is not world:
        raise AssertionError("the sibling meshes are not cut from the world mesh")
    tensors = ep_tensors()
    params = parameters(tensors, {"w": (dense, [Shard(0)]), "ln": (dense, [Replicate()]), "row": (dense, [Shard(0)]),
                                  "experts": (sparse, [Shard(1), Shard(0)]),
                                  "gate": (sparse, [Replicate(), Shard(0)])})
    grads = [p.grad for p in params.values()]
    reference = [t * 2 for t in tensors.values()]
    expect_collectives(1, lambda: gft.get_total_norm(grads), "get_total_norm over sibling meshes")
    expect_collectives(1, lambda: gft.clip_grad_norm_(list(params.values()), 1e9),
                       "clip_grad_norm_ over sibling meshes")
    check_norms(grads, reference, "sibling meshes")
    check_clip(params, reference, "sibling meshes")
    total = gft.get_total_norm(grads)
    if isinstance(total, DTensor):
        raise AssertionError("no one mesh holds the norm of leaves on sibling meshes: expected a plain tensor")


# ---------------------------------------------------------------- pipeline stages

STAGES = ({"w": (7, 5), "ln": (9,)}, {"v": (5, 6), "row": (1, 3)})


def stage_tensors():
    return [whole(10 + s, shapes) for s, shapes in enumerate(STAGES)]


def pp_dp(ctx):
    """The (pp=2, dp) root mesh, this rank's stage, and its parameters FSDP-
    sharded (and one replicated) over the stage's "dp" slice."""
    mesh = init_device_mesh("cpu", (2, ctx.size // 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    tensors = stage_tensors()
    return mesh, stage, stage_parameters(mesh, tensors[stage]), [t * 2 for ts in tensors for t in ts.values()]


def dp_layout(mesh, name):
    """How a stage's tensor ``name`` lies over its "dp" slice: "ln" replicated, the others sharded."""
    return mesh["dp"], [Replicate()] if name == "ln" else [Shard(0)]


def stage_parameters(mesh, tensors):
    return parameters(tensors, {name: dp_layout(mesh, name) for name in tensors})


@case(sizes=(4,))
def pp_by_dp_shard(ctx):
    mesh, stage, params, reference = pp_dp(ctx)
    grads = [p.grad for p in params.values()]
    # Cut from the stages' root mesh: one all-reduce over both stages' ranks.
    expect_collectives(1, lambda: gft.get_total_norm(grads, pp_mesh=mesh["pp"]),
                       "pp=2 x dp_shard=2, pp_mesh cut from the root")
    expect_collectives(1, lambda: gft.clip_grad_norm_(list(params.values()), 1e9, pp_mesh=mesh["pp"]),
                       "the clip, pp_mesh cut from the root")
    check_norms(grads, reference, "pp x dp, pp_mesh a mesh", pp_mesh=mesh["pp"])
    check_clip(params, reference, "pp x dp, pp_mesh a mesh", pp_mesh=mesh["pp"])
    # A process group of its own: the stage's reduction, then the stages'.
    group = mesh["pp"].get_group()
    expect_collectives(2, lambda: gft.get_total_norm(grads, pp_mesh=group), "pp=2 x dp_shard=2, pp_mesh a group")
    check_norms(grads, reference, "pp x dp, pp_mesh a group", pp_mesh=group)
    check_clip(params, reference, "pp x dp, pp_mesh a group", pp_mesh=group)
    # Without pp_mesh each stage gets its own norm, as a DTensor on its mesh.
    own = gft.get_total_norm(grads)
    mine = [t * 2 for t in stage_tensors()[stage].values()]
    assert_close(own, ref_norm(mine, 2), 1e-12, "one stage's norm")
    if not isinstance(own, DTensor) or own.device_mesh != mesh["dp"]:
        raise AssertionError(f"a stage's own norm: expected a DTensor on the stage's mesh, as PyTorch "
                             f"returns, got {type(own).__name__} {getattr(own, 'device_mesh', '')}")


@case(sizes=(4,))
def pp_plain_tensors_in_a_data_parallel_stage_are_refused(ctx):
    mesh, _, params, _ = pp_dp(ctx)
    plain = [dtensor.local(p.grad).clone() for p in params.values()]
    for pp_mesh in (mesh["pp"], mesh["pp"].get_group()):
        expect_error(TypeError, ("'[0]'", "expected a DTensor beside pp_mesh", "2 stages in a world of 4",
                                 "(DDP)", "group="), lambda: gft.get_total_norm(plain, pp_mesh=pp_mesh))
    # Beside DTensors a plain tensor stays refused as ever.
    beside = [params["w" if "w" in params else "v"].grad, plain[0]]
    expect_error(TypeError, ("'[1]'", "expected a DTensor, as leaf '[0]' is one"),
                 lambda: gft.get_total_norm(beside, pp_mesh=mesh["pp"]))


@case(sizes=(2,))
def pp_plain_tensors_one_rank_a_stage(ctx):
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    tensors = stage_tensors()
    params = parameters(tensors[ctx.rank], {name: None for name in tensors[ctx.rank]})
    grads = [p.grad for p in params.values()]
    reference = [t * 2 for ts in tensors for t in ts.values()]
    for pp_mesh in (mesh, mesh.get_group()):
        expect_collectives(1, lambda: gft.get_total_norm(grads, pp_mesh=pp_mesh), "plain stages")
        check_norms(grads, reference, "plain stages", pp_mesh=pp_mesh)
        check_clip(params, reference, "plain stages", pp_mesh=pp_mesh)
    expect_error(ValueError, ("group: expected None beside pp_mesh",),
                 lambda: gfd.global_norm(grads, group=mesh.get_group(), pp_mesh=mesh))
    expect_error(ValueError, ("pp_mesh: expected a 1-D DeviceMesh",),
                 lambda: gft.get_total_norm(grads, pp_mesh=init_device_mesh("cpu", (2, 1), mesh_dim_names=("a", "b"))))
    expect_error(TypeError, ("pp_mesh: expected a DeviceMesh or a torch.distributed ProcessGroup",),
                 lambda: gft.get_total_norm(grads, pp_mesh=2))


def tied_model(ctx, mesh, stage):
    """Stage 0 holds the embedding and "w", stage 1 the output layer (the same
    embedding, its gradient the sum of both uses, as after the tied weights'
    all-reduce) and "v"; laid out on ``mesh`` (a stage's "dp" slice), or
    plain where it is None."""
    g = torch.Generator().manual_seed(20)
    embedding = torch.randn(6, 4, generator=g, dtype=torch.float64) * 3
    tensors = stage_tensors()
    own = {"w": tensors[0]["w"]} if stage == 0 else {"v": tensors[1]["v"]}
    mine = {"embedding": embedding, **own}
    layout = {name: None if mesh is None else (mesh, [Shard(0)]) for name in mine}
    return parameters(mine, layout), [embedding * 2, tensors[0]["w"] * 2, tensors[1]["v"] * 2]


@case
def tied_weight_across_stages(ctx):
    if ctx.size == 2:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
        pp_mesh, stage, dp = mesh, ctx.rank, None
    else:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
        pp_mesh, stage, dp = mesh["pp"], mesh.get_coordinate()[0], mesh["dp"]
    params, reference = tied_model(ctx, dp, stage)
    grads = [p.grad for p in params.values()]
    tied_grads = [(params["embedding"].grad, 0)]
    check_norms(grads, reference, "a tied weight", pp_mesh=pp_mesh, tied=tied_grads)
    check_clip(params, reference, "a tied weight", pp_mesh=pp_mesh, tied=[(params["embedding"], 0)])
    # Counted on both stages it would be counted twice: the case can fail.
    twice = float(full(gft.get_total_norm(grads, pp_mesh=pp_mesh)))
    if math.isclose(twice, ref_norm(reference, 2), rel_tol=1e-6):
        raise AssertionError("counting the tied weight twice made no difference: the case cannot fail")
    # Refused before anything changes, naming what is wrong.
    stranger = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    before = [full(p.grad).clone() for p in params.values()]
    for tied, kind, needles in (
            ([(params["embedding"], 2)], ValueError, ("tied[0]: expected the owning stage, 0 to 1", "got 2")),
            ([(stranger, 0)], ValueError, ("tied[0]: expected one of `parameters`", "shape (2,)")),
            ([params["embedding"]], TypeError, ("tied[0]: expected a pair (weight, owning stage)",))):
        expect_error(kind, needles, lambda: gft.clip_grad_norm_(list(params.values()), 1.0, pp_mesh=pp_mesh,
                                                                tied=tied))
    expect_error(ValueError, ("tied: expected pp_mesh= beside it",),
                 lambda: gft.clip_grad_norm_(list(params.values()), 1.0, tied=[(params["embedding"], 0)]))
    for (name, p), b in zip(params.items(), before):
        if not torch.equal(full(p.grad), b):
            raise AssertionError(f"{name}.grad changed by a refused clip")


@case(sizes=(4,))
def nonfinite_in_one_stage_is_named_on_every_rank(ctx):
    mesh, stage, params, _ = pp_dp(ctx)
    if stage == 1:
        dtensor.local(params["v"].grad).view(-1)[0] = math.nan
    before = [dtensor.local(p.grad).clone() for p in params.values()]
    message = expect_error(gft.NonFiniteNormError, ("is non-finite", "4 ranks"),
                           lambda: gft.clip_grad_norm_(list(params.values()), 1.0, pp_mesh=mesh["pp"],
                                                       error_if_nonfinite=True))
    # Stage 1's "v" is its first leaf; its first rows live on the stage's first rank, 2.
    if "'[0]' on rank 2" not in message:
        raise AssertionError(f"the error names neither the leaf nor the rank: {message}")
    for p, b in zip(params.values(), before):
        if not torch.equal(dtensor.local(p.grad).nan_to_num(), b.nan_to_num()):
            raise AssertionError("a gradient was scaled")


# ---------------------------------------------------------------- a stage without gradients

def pipelines(ctx, mesh):
    """(what, pp_mesh) for the (pp=2, dp) root ``mesh``: a mesh cut from it,
    its process group, and on 2 ranks (where init_device_mesh can make one
    over the stages alone) a mesh of its own."""
    found = [("pp_mesh cut from the stages' root", mesh["pp"]), ("pp_mesh a group", mesh["pp"].get_group())]
    if ctx.size == 2:
        found.append(("pp_mesh a mesh of its own", init_device_mesh("cpu", (2,), mesh_dim_names=("stages",))))
    return found


def gradients_of_stage(mesh, stage, empty, how):
    """This rank's parameters and its tree of gradients (name -> gradient),
    where stage ``empty`` holds none: its parameters' ``.grad`` all None,
    or no parameters at all; and the whole gradients of the other stage."""
    tensors = stage_tensors()
    params = stage_parameters(mesh, {} if stage == empty and how == "no parameters" else tensors[stage])
    if stage == empty:
        for q in params.values():
            q.grad = None
    grads = {name: q.grad for name, q in params.items() if q.grad is not None}
    return params, grads, [t * 2 for t in tensors[1 - empty].values()]


@case
def a_stage_without_gradients_joins_the_others(ctx):
    """One stage holds no gradient (every ``.grad`` None, or no parameters):
    its ranks join the other stage's collective, add nothing, and get the
    same norm and clip; before, they returned 0 at once and the other stage
    waited for them in its all-reduce."""
    mesh = init_device_mesh("cpu", (2, ctx.size // 2), mesh_dim_names=("pp", "dp"))
    stage, kinds = mesh.get_coordinate()[0], pipelines(ctx, mesh)
    for empty in (0, 1):
        for how in ("grads None", "no parameters"):
            for which, pp_mesh in kinds:
                what = f"stage {empty} without gradients ({how}), {which}"
                params, grads, reference = gradients_of_stage(mesh, stage, empty, how)
                check_norms(list(grads.values()), reference, what, pp_mesh=pp_mesh)
                for p in ORDS:  # an empty tree to gfd, as a dict
                    assert_close(gfd.global_norm(grads, p, pp_mesh=pp_mesh), ref_norm(reference, p), 1e-12,
                                 f"{what}, ord {p}: gfd.global_norm of the tree")
                check_clip(params, reference, what, pp_mesh=pp_mesh)
                check_gfd_clip(grads, reference, what, pp_mesh=pp_mesh)
                # The same bits on every rank, the stage without gradients too.
                totals = [None] * ctx.size
                dist.all_gather_object(totals, float(gft.get_total_norm(list(grads.values()), pp_mesh=pp_mesh)))
                if len(set(totals)) != 1:
                    raise AssertionError(f"{what}: the ranks got different norms {totals}")
            expect_collectives(1, lambda: gft.clip_grad_norm_(list(params.values()), 1e9, pp_mesh=mesh["pp"]),
                               f"stage {empty} without gradients ({how}): the clip, pp_mesh cut from the root")


@case
def a_pipeline_cut_from_another_root_is_refused(ctx):
    """Stages on one root mesh, pp_mesh cut from another: a stage without
    gradients could not tell which ranks the others reduce over."""
    mesh = init_device_mesh("cpu", (2, ctx.size // 2), mesh_dim_names=("pp", "dp"))
    other = init_device_mesh("cpu", (2, ctx.size // 2), mesh_dim_names=("pipe", "data"))
    params = stage_parameters(mesh, stage_tensors()[mesh.get_coordinate()[0]])
    before = [full(q.grad).clone() for q in params.values()]
    expect_error(ValueError, ("pp_mesh: expected a mesh cut from the root mesh of leaf '[0]'", "pass "
                              "pp_mesh.get_group()"),
                 lambda: gft.clip_grad_norm_(list(params.values()), 1.0, pp_mesh=other["pipe"]))
    for q, b in zip(params.values(), before):
        if not torch.equal(full(q.grad), b):
            raise AssertionError("a refused clip scaled a gradient")


def pipeline_steps():
    """Per step, each stage's whole gradients (name -> tensor, drawn from
    seeds), None for every gradient of stage 1 in step 1: a stage without
    gradients in the middle of training."""
    steps = []
    for k in range(3):
        steps.append([{name: None if (k, s) == (1, 1) else g
                       for name, g in whole(100 + 2 * k + s, shapes).items()} for s, shapes in enumerate(STAGES)])
    return steps


OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, gft.AdamW, dict(lr=2e-2, betas=(0.9, 0.99), weight_decay=0.1)),
    "SGD": (torch.optim.SGD, gft.SGD, dict(lr=5e-2, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "Lion": (TorchLion, gft.Lion, dict(lr=5e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}
OPTIMIZER_MAX_NORM = 1.0  # below every step's norm: each step clips


@case
def pp_flat_optimizers_train_as_torch_after_the_pipeline_clip(ctx):
    """gft.AdamW, SGD and Lion with max_norm= and pp_mesh=, each stage's
    optimizer over its own DTensor parameters, against torch.optim (Lion:
    tests/torch_lion.py's) over the whole
    model's tensors after torch.nn.utils.clip_grad_norm_ over all of them:
    the parameters after 3 steps in float64, a step where stage 1 has no
    gradient included."""
    mesh = init_device_mesh("cpu", (2, ctx.size // 2), mesh_dim_names=("pp", "dp"))
    stage = mesh.get_coordinate()[0]
    steps = pipeline_steps()
    for name, (torch_kind, gft_kind, options) in OPTIMIZERS.items():
        for which, pp_mesh in pipelines(ctx, mesh):
            what = f"{name}, {which}"
            tensors = stage_tensors()
            params = stage_parameters(mesh, tensors[stage])
            model = {(s, n): torch.nn.Parameter(t.clone()) for s, ts in enumerate(tensors) for n, t in ts.items()}
            ours = gft_kind(list(params.values()), max_norm=OPTIMIZER_MAX_NORM, pp_mesh=pp_mesh, **options)
            theirs = torch_kind(list(model.values()), **options)
            for k, grads in enumerate(steps):
                # Copies: the clips scale gradients in place, and a shard may be a view of its source.
                for n, q in params.items():
                    g = grads[stage][n]
                    q.grad = None if g is None else distribute_tensor(g.clone(), *dp_layout(mesh, n))
                for (s, n), q in model.items():
                    q.grad = None if grads[s][n] is None else grads[s][n].clone()
                norm = float(torch.nn.utils.clip_grad_norm_(list(model.values()), OPTIMIZER_MAX_NORM))
                if not norm > OPTIMIZER_MAX_NORM:
                    raise AssertionError(f"{what}, step {k}: the norm {norm} is not clipped: the case cannot fail")
                theirs.step()
                ours.step()
                assert_close(ours.last_grad_norm, norm, 1e-12, f"{what}, step {k}: last_grad_norm")
            for n, q in params.items():
                np.testing.assert_allclose(full(q.detach()).numpy(), model[stage, n].detach().numpy(), rtol=1e-10,
                                           atol=1e-13, err_msg=f"{what}: {n} after 3 steps")


# ---------------------------------------------------------------- meshes of different roots

@case(sizes=(4,))
def different_roots_refused_with_advice_that_works(ctx):
    tensors = ep_tensors()
    a, b = init_device_mesh("cpu", (4,)), init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "y"))
    layout = {"w": (a, [Shard(0)]), "ln": (a, [Replicate()]), "row": (a, [Shard(0)]),
              "experts": (b, [Shard(0), Replicate()]), "gate": (b, [Shard(1), Shard(0)])}
    grads = [p.grad for p in parameters(tensors, layout).values()]
    message = expect_error(ValueError, ("leaf '[3]'", "expected a DTensor on a mesh cut from the root mesh of "
                                        "leaf '[0]'", "_unflatten"), lambda: gft.get_total_norm(grads))
    # What the advice says: both meshes cut from one root.
    if "mesh._unflatten(0, (2, 2), ('dp', 'ep'))" not in message:
        raise AssertionError(f"the advice changed: {message}")
    # Other names than the refused meshes': DTensor's caches take meshes of
    # equal names and ranks for one another, whatever their root.
    root = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    a, b = root._unflatten(0, (4,), ("a",)), root._unflatten(0, (2, 2), ("u", "v"))
    layout = {k: (a if m.ndim == 1 else b, pl) for k, (m, pl) in layout.items()}
    params = parameters(tensors, layout)
    check_norms([p.grad for p in params.values()], [t * 2 for t in tensors.values()], "after the advice")


@case(sizes=(4,))
def a_span_no_group_covers_gets_its_own(ctx):
    """Where no mesh dimension spans exactly the ranks to reduce over, a group
    is made over them once, by its ranks only, and kept."""
    ranks = np.array([0, 1] if ctx.rank < 2 else [2, 3])
    group = dtensor._group_over(ranks, [])
    if dtensor._group_over(ranks, []) is not group:
        raise AssertionError("the group was made again")
    if dist.get_process_group_ranks(group) != ranks.tolist():
        raise AssertionError(f"a group over {dist.get_process_group_ranks(group)}, expected {ranks.tolist()}")
    t = torch.tensor([float(ctx.rank)])
    dist.all_reduce(t, group=group)
    if float(t) != float(ranks.sum()):
        raise AssertionError(f"the group's sum is {float(t)}")


# ---------------------------------------------------------------- running

class Ctx:
    def __init__(self, rank, size):
        self.rank, self.size = rank, size


def main(out_dir, rank, size, port):
    rank, size = int(rank), int(size)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    run_cases([(name, globals()[name]) for name, sizes in CASES if sizes is None or size in sizes],
              Ctx(rank, size), out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
