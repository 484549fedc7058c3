"""One rank of the multi-process tests of gpuflat.distributed.

Run as ``python distributed_worker.py OUT gloo RANK SIZE PORT`` (one process
per rank, torch.distributed over gloo on 127.0.0.1) or under mpirun as
``python -m mpi4py distributed_worker.py OUT mpi``. Every case runs on every
rank, in CASES order; each rank writes ``OUT/rank<r>.json`` mapping case name
to "ok" or the error it met, after every case, so a crash still reports the
cases before it.

The data of rank r is drawn from a seed of its own, so every rank can rebuild
every other rank's data and check the collective results against plain NumPy.
"""
from __future__ import annotations

import math
import sys
import time
from datetime import timedelta

import ml_dtypes
import numpy as np

import gpuflat as gf
from gpuflat import distributed as gfd
from ranks import run_cases

BF16 = np.dtype(ml_dtypes.bfloat16)
ORDS = (1, 2, math.inf, 3)
CASES = []  # (name, the transports it runs on)
TORCH_ONLY = ("gloo",)


def case(f=None, *, transports=("gloo", "mpi")):
    """Register a case; ``transports`` limits it to those where it means something,
    so the test file never counts a case that did nothing as passing."""
    def register(f):
        CASES.append((f.__name__, transports))
        return f

    return register(f) if f is not None else register


class Ctx:
    """What a case needs: the transport, the group, this rank and the world size."""

    def __init__(self, transport, group, rank, size):
        self.transport, self.group, self.rank, self.size = transport, group, rank, size

    def per_tensor_sum_(self, arrays):
        """The peers' way: one SUM all-reduce per array, in place."""
        for a in arrays:
            if self.transport == "mpi":
                from mpi4py import MPI

                self.group.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM)
            else:
                import torch
                import torch.distributed as dist

                dist.all_reduce(torch.from_numpy(a), group=self.group)


# ---------------------------------------------------------------- data

def whole_model(seed=0):
    """Every dtype, an empty leaf, a 0-d leaf, a strided leaf and a large float32 one."""
    rng = np.random.default_rng(seed)
    big = rng.standard_normal((9, 4)) * 1e3
    return {
        "f16": rng.standard_normal((6, 5)).astype(np.float16),
        "bf16": rng.standard_normal(7).astype(BF16),
        "f32": big.astype(np.float32),
        "f64": rng.standard_normal((5, 3)),
        "c64": (rng.standard_normal((4, 2)) + 1j * rng.standard_normal((4, 2))).astype(np.complex64),
        "c128": rng.standard_normal(3) + 1j * rng.standard_normal(3),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(-2.5),
        "strided": rng.standard_normal((10, 6)).astype(np.float32)[::2, ::3],
    }


def shard(whole, rank, size):
    """Rank ``rank``'s row block of every leaf (a 0-d leaf lives on one rank; the
    others hold an empty leaf in its place); strided leaves stay strided views."""
    out = {}
    for name, a in whole.items():
        if a.ndim == 0:
            out[name] = a if rank == size - 1 else np.zeros(0, a.dtype)
        else:
            out[name] = np.array_split(a, size, axis=0)[rank]
    return out


def ref_norm(arrays, p):
    """The p-norm of all ``arrays`` taken as one vector: float64, exactly summed."""
    mags = [np.abs(np.asarray(a).astype(np.complex128)).ravel() for a in arrays]
    values = np.concatenate(mags) if mags else np.zeros(0)
    if p == math.inf:
        return float(values.max()) if values.size else 0.0
    return math.fsum(values ** p) ** (1 / p)


def assert_close(found, expected, rtol, what):
    found = float(found)
    if not (math.isclose(found, expected, rel_tol=rtol, abs_tol=0) or found == expected):
        raise AssertionError(f"{what}: expected {expected!r}, got {found!r} (rtol {rtol})")


def rtol_of(dtype):
    """A few roundings in ``dtype`` (its real part's precision)."""
    return 4 * float((ml_dtypes.finfo if dtype == BF16 else np.finfo)(dtype).eps)


# ---------------------------------------------------------------- norms

@case
def sharded_norm_equals_whole(ctx):
    whole = whole_model()
    local = shard(whole, ctx.rank, ctx.size)
    for p in ORDS:
        found = gfd.global_norm(local, p, group=ctx.group)
        assert_close(found, float(gf.global_norm(whole, p)), 1e-12, f"ord {p} against gf.global_norm")
        assert_close(found, ref_norm(whole.values(), p), 1e-12, f"ord {p} against NumPy")


@case
def same_bits_on_every_rank(ctx):
    local = shard(whole_model(), ctx.rank, ctx.size)
    for p in ORDS:
        mine = np.array([float(gfd.global_norm(local, p, group=ctx.group))])
        every = np.zeros(ctx.size)
        every[ctx.rank] = mine[0]
        ctx.per_tensor_sum_([every])
        if not (every.view(np.int64) == mine.view(np.int64)).all():
            raise AssertionError(f"ord {p}: ranks disagree: {every.tolist()}")


@case
def replicated_counted_once(ctx):
    whole = whole_model()
    layer_norm = np.linspace(-1e4, 2e4, 11).astype(np.float32)  # the same on every rank
    local = dict(shard(whole, ctx.rank, ctx.size), ln=layer_norm)
    rule = gfd.replicated(ctx.group, where={"['ln']"})
    for p in ORDS:
        expected = ref_norm(list(whole.values()) + [layer_norm], p)
        assert_close(gfd.global_norm(local, p, group=ctx.group, owned=rule), expected, 1e-12,
                     f"ord {p}, replicated leaf")
        paths = {leaf.path for leaf in gf.plan(local).leaves if ctx.rank == 0 or leaf.path != "['ln']"}
        assert_close(gfd.global_norm(local, p, group=ctx.group, owned=paths), expected, 1e-12,
                     f"ord {p}, owned as a set of paths")
    # Counting the copy on every rank, as the peers' bug does, gives another norm.
    naive = float(gfd.global_norm(local, 2, group=ctx.group))
    if math.isclose(naive, ref_norm(list(whole.values()) + [layer_norm], 2), rel_tol=1e-6):
        raise AssertionError("the replicated leaf made no difference: the case cannot fail")


@case
def tied_embedding_counted_once(ctx):
    whole = whole_model()
    embed = np.arange(12, dtype=np.float64).reshape(3, 4) - 5.5
    local = shard(whole, ctx.rank, ctx.size)
    last = ctx.size - 1
    if ctx.rank in (0, last):  # the first and last pipeline stage hold a copy
        local["embed"] = embed.copy()
    rule = gfd.tied(last, ctx.group, where={"['embed']"}) & gfd.sharded()
    for p in ORDS:
        expected = ref_norm(list(whole.values()) + [embed], p)
        assert_close(gfd.global_norm(local, p, group=ctx.group, owned=rule), expected, 1e-12,
                     f"ord {p}, tied embedding")


@case
def ties_within_a_rank_count_once(ctx):
    w = np.full(4, float(ctx.rank + 1), np.float32)
    local = {"enc": w, "dec": w}
    expected = math.sqrt(sum(4 * (r + 1) ** 2 for r in range(ctx.size)))
    assert_close(gfd.global_norm(local, group=ctx.group), expected, 1e-12, "tied within a rank")


@case
def empty_shard(ctx):
    whole = whole_model()
    # Rank 0 holds nothing at all; the others share the model.
    local = {} if ctx.rank == 0 else shard(whole, ctx.rank - 1, ctx.size - 1)
    for p in ORDS:
        assert_close(gfd.global_norm(local, p, group=ctx.group), ref_norm(whole.values(), p), 1e-12,
                     f"ord {p} with an empty shard on rank 0")
    total, per = gfd.global_norm(local, group=ctx.group, per_leaf=True)
    if per.shape != (len(local),):
        raise AssertionError(f"per-leaf norms of shape {per.shape} for {len(local)} leaves")
    expected = ref_norm(whole.values(), 2)  # before the clip scales the shards, views of whole
    total = gfd.clip_grad_norm_(local, 1.0, group=ctx.group)
    assert_close(total, expected, 1e-12, "clip with an empty shard")


@case
def per_leaf_norms_are_local(ctx):
    local = shard(whole_model(), ctx.rank, ctx.size)
    total, per = gfd.global_norm(local, group=ctx.group, per_leaf=True)
    for leaf, arr, found in zip(gf.plan(local).leaves, gf.trainables(local), per):
        assert_close(found, ref_norm([arr], 2), 1e-12, f"per-leaf norm of {leaf.path}")


@case
def clip_scales_every_rank_alike(ctx):
    whole = whole_model()
    for p in ORDS:
        local = {k: v.copy() for k, v in shard(whole, ctx.rank, ctx.size).items()}
        before = {k: v.copy() for k, v in local.items()}
        norm = ref_norm(whole.values(), p)
        total = gfd.clip_grad_norm_(local, norm / 4, p, group=ctx.group)
        assert_close(total, norm, 1e-12, f"ord {p}: the returned norm")
        coef = min(1.0, (norm / 4) / (norm + 1e-6))
        for k, v in local.items():
            expected = before[k].astype(np.complex128) * coef
            np.testing.assert_allclose(v.astype(np.complex128), expected, rtol=rtol_of(v.dtype),
                                       err_msg=f"ord {p}, leaf {k}")


@case
def clip_below_max_norm_leaves_gradients(ctx):
    local = {k: v.copy() for k, v in shard(whole_model(), ctx.rank, ctx.size).items()}
    before = {k: v.copy() for k, v in local.items()}
    gfd.clip_grad_norm_(local, 1e9, group=ctx.group)
    for k, v in local.items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"leaf {k}")


@case
def nan_on_one_rank_is_nan_everywhere(ctx):
    for bad, expect in ((np.nan, math.isnan), (np.inf, math.isinf)):
        local = {k: v.copy() for k, v in shard(whole_model(), ctx.rank, ctx.size).items()}
        if ctx.rank == 1:
            local["f32"][0, 1] = bad
        for p in ORDS:
            found = float(gfd.global_norm(local, p, group=ctx.group))
            if not expect(found):
                raise AssertionError(f"ord {p}: {bad} on rank 1 gave {found} on rank {ctx.rank}")


@case
def error_if_nonfinite_raises_on_every_rank(ctx):
    local = {k: v.copy() for k, v in shard(whole_model(), ctx.rank, ctx.size).items()}
    if ctx.rank == 1:
        local["c64"][0, 0] = complex(np.nan, 0)
    before = {k: v.copy() for k, v in local.items()}
    try:
        gfd.clip_grad_norm_(local, 1.0, group=ctx.group, error_if_nonfinite=True)
    except gf.NonFiniteError as err:
        message = str(err)
    else:
        raise AssertionError(f"rank {ctx.rank}: no NonFiniteError")
    if "['c64']" not in message or "rank 1" not in message:
        raise AssertionError(f"the error names neither the leaf nor the rank: {message}")
    for k, v in local.items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"leaf {k} was scaled")


@case
def bad_arguments_raise_before_the_collective(ctx):
    # Every rank raises on its own, before any collective: nothing hangs.
    for call, needle in ((lambda: gfd.global_norm({"w": np.ones(2)}, 0, group=ctx.group), "ord"),
                         (lambda: gfd.clip_grad_norm_({"w": np.ones(2)}, -1, group=ctx.group), "max_norm"),
                         (lambda: gfd.global_norm({"w": np.ones(2)}, group=ctx.group, owned={"['x']"}),
                          "['x']"),
                         (lambda: gfd.all_reduce_({"w": np.ones(2)}, "max", group=ctx.group), "op")):
        try:
            call()
        except (ValueError, TypeError) as err:
            if needle not in str(err):
                raise AssertionError(f"the error does not name {needle!r}: {err}") from err
        else:
            raise AssertionError(f"no error for a bad {needle}")


# ---------------------------------------------------------------- all-reduce

def float32_grads(seed, integers=False):
    rng = np.random.default_rng(seed)
    shapes = [(50, 7), (0,), (), (13,), (3, 4, 5), (1,), (257,)]
    draw = (lambda s: rng.integers(-1000, 1000, s)) if integers else rng.standard_normal
    return {f"g{i}": np.array(draw(s), np.float32) for i, s in enumerate(shapes)}


@case
def all_reduce_equals_per_tensor(ctx):
    # Integer values add exactly in any order, so any rank count compares bits;
    # random values do at 2 ranks, where one addition is commutative.
    for integers in (True, False) if ctx.size == 2 else (True,):
        for op in ("sum", "mean"):
            for bucket in (None, 64):
                mine = float32_grads(ctx.rank, integers)
                theirs = {k: v.copy() for k, v in mine.items()}
                gfd.all_reduce_(mine, op, group=ctx.group, bucket_bytes=bucket)
                ctx.per_tensor_sum_(list(theirs.values()))
                for k, v in mine.items():
                    expected = theirs[k] / np.float32(ctx.size) if op == "mean" else theirs[k]
                    if v.tobytes() != expected.tobytes():
                        raise AssertionError(f"{op}, bucket {bucket}, leaf {k}: differs from per tensor")


@case
def all_reduce_against_numpy(ctx):
    for op in ("sum", "mean"):
        mine = float32_grads(ctx.rank)
        gfd.all_reduce_(mine, op, group=ctx.group, bucket_bytes=100)
        every = [float32_grads(r) for r in range(ctx.size)]
        for k, v in mine.items():
            expected = sum(g[k].astype(np.float64) for g in every) / (ctx.size if op == "mean" else 1)
            np.testing.assert_allclose(v, expected, rtol=1e-5, atol=1e-5, err_msg=f"{op}, leaf {k}")


@case
def all_reduce_every_dtype(ctx):
    for name in ("f16", "bf16", "f32", "f64", "c64", "c128", "strided"):
        mine = {name: whole_model(ctx.rank)[name].copy()}
        gfd.all_reduce_(mine, "mean", group=ctx.group)
        expected = sum(whole_model(r)[name].astype(np.complex128) for r in range(ctx.size)) / ctx.size
        np.testing.assert_allclose(mine[name].astype(np.complex128), expected,
                                   rtol=rtol_of(mine[name].dtype) * 10, atol=rtol_of(mine[name].dtype) * 10,
                                   err_msg=f"leaf {name}")


@case
def all_reduce_grad_buffers(ctx):
    class Resident:
        def __init__(self, buffers):
            self.grad_buffers = buffers

    buffers = (np.full(1000, ctx.rank + 1, np.float32), np.arange(3.0) * (ctx.rank + 1), np.zeros(0))
    gfd.all_reduce_(Resident(buffers), "sum", group=ctx.group, bucket_bytes=512)
    total = sum(range(1, ctx.size + 1))
    np.testing.assert_array_equal(buffers[0], np.full(1000, total, np.float32))
    np.testing.assert_array_equal(buffers[1], np.arange(3.0) * total)


def torch_net(seed, resident=False):
    """The same small network on every rank, its gradients from rank ``seed``'s
    batch; with ``resident``, made resident before the backward pass."""
    import torch

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    r = gf.resident(net) if resident else None
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((4, 5)).astype(np.float32))
    net(x).pow(2).sum().backward()
    return net, r


@case(transports=TORCH_ONLY)
def all_reduce_torch_modules(ctx):
    import torch.distributed as dist

    for form in ("a tree of p.grad", "the module", "a resident model"):
        net, r = torch_net(ctx.rank, resident=form == "a resident model")
        expected = {n: p.grad.clone() for n, p in net.named_parameters()}
        for t in expected.values():  # the peers' way: one all-reduce per tensor
            dist.all_reduce(t, group=ctx.group)
            t /= ctx.size
        grads = {"a tree of p.grad": {n: p.grad for n, p in net.named_parameters()},
                 "the module": net, "a resident model": r}[form]
        gfd.all_reduce_(grads, "mean", group=ctx.group)
        for n, p in net.named_parameters():
            np.testing.assert_allclose(p.grad.numpy(), expected[n].numpy(), rtol=1e-6, atol=1e-7,
                                       err_msg=f"{form}: {n}")
        if r is not None:
            for n, g in r.grads.items():
                np.testing.assert_array_equal(g.numpy(), net.get_parameter(n).grad.numpy(), err_msg=n)


@case(transports=TORCH_ONLY)
def ddp_with_a_resident_model(ctx):
    """gf.resident before or after wrapping in DDP, with and without
    gradient_as_bucket_view (where DDP rebinds every p.grad to its bucket),
    trains as plain DDP with torch's clip does."""
    import copy

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    for order in ("resident, then DDP", "DDP, then resident"):
        for bucket_view in (False, True):
            torch.manual_seed(0)
            net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
            plain = copy.deepcopy(net)
            r = gf.resident(net) if order.startswith("resident") else None
            model = DDP(net, gradient_as_bucket_view=bucket_view, process_group=ctx.group)
            r = r or gf.resident(model)
            plain_model = DDP(plain, gradient_as_bucket_view=bucket_view, process_group=ctx.group)
            opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
            opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
            for step in range(3):
                rng = np.random.default_rng(10 * step + ctx.rank)
                x = torch.from_numpy(rng.standard_normal((4, 5)).astype(np.float32))
                for m in (model, plain_model):
                    m(x).pow(2).sum().backward()
                got = r.clip_grad_norm_(0.5)
                want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
                assert_close(float(got), float(want), 1e-5, f"{order}, bucket view {bucket_view}, step {step}")
                for o in (opt, opt_plain):
                    o.step()
                    o.zero_grad()
            for (n, a), b in zip(net.named_parameters(), plain.parameters()):
                np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6,
                                           err_msg=f"{order}, bucket view {bucket_view}: {n}")


@case(transports=TORCH_ONLY)
def a_layer_used_on_one_rank_trains_as_ddp(ctx):
    """all_reduce_ of a resident model one of whose layers only rank 0 uses,
    after zero_grad() (set to None): as DDP with find_unused_parameters=True,
    every rank's .grad of that layer is the average, a layer no rank uses
    keeps None everywhere, and after 5 SGD steps every rank holds DDP's
    parameters, the same on every rank."""
    import copy

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.head = torch.nn.Linear(5, 7), torch.nn.Linear(7, 3)
            self.aux, self.never = torch.nn.Linear(7, 3), torch.nn.Linear(7, 3)

        def forward(self, x, aux):
            h = torch.tanh(self.body(x))
            return self.head(h) + self.aux(h) if aux else self.head(h)

    torch.manual_seed(0)
    net = TwoHeads()
    plain = copy.deepcopy(net)
    r = gf.resident(net)
    ddp = DDP(plain, find_unused_parameters=True, process_group=ctx.group)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        x = torch.from_numpy(np.random.default_rng(10 * step + ctx.rank).standard_normal((4, 5)).astype(np.float32))
        net(x, ctx.rank == 0).pow(2).sum().backward()
        ddp(x, ctx.rank == 0).pow(2).sum().backward()
        gfd.all_reduce_(r, "mean", group=ctx.group)
        for (n, p), q in zip(net.named_parameters(), plain.parameters()):
            assert (p.grad is None) == (q.grad is None) == n.startswith("never"), f"step {step}: {n}"
            if p.grad is not None:
                np.testing.assert_allclose(p.grad.numpy(), q.grad.numpy(), rtol=1e-5, atol=1e-7,
                                           err_msg=f"step {step}: {n}")
        for o in (opt, opt_plain):
            o.step()
            o.zero_grad()
    mine = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    every = [torch.empty_like(mine) for _ in range(ctx.size)]
    dist.all_gather(every, mine, group=ctx.group)
    for rank, theirs in enumerate(every):
        assert torch.equal(theirs, mine), f"rank {rank} holds other parameters than rank {ctx.rank}"
    for (n, a), b in zip(net.named_parameters(), plain.parameters()):
        np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6, err_msg=n)


@case(transports=TORCH_ONLY)
def ddp_with_the_drop_in_clip(ctx):
    """gpuflat.torch.clip_grad_norm_ under DDP, with and without
    gradient_as_bucket_view (each step's gradients new tensors, or views of
    DDP's buckets), zero_grad()'s default set_to_none: as torch's clip."""
    import copy

    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gpuflat.torch as gft

    for bucket_view in (False, True):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
        plain = copy.deepcopy(net)
        runs = [(DDP(m, gradient_as_bucket_view=bucket_view, process_group=ctx.group), m, clip)
                for m, clip in ((net, gft.clip_grad_norm_), (plain, torch.nn.utils.clip_grad_norm_))]
        opts = [torch.optim.AdamW(m.parameters(), lr=0.05) for _, m, _ in runs]
        for step in range(4):
            rng = np.random.default_rng(10 * step + ctx.rank)
            x = torch.from_numpy(rng.standard_normal((4, 5)).astype(np.float32))
            norms = []
            for (model, m, clip), opt in zip(runs, opts):
                model(x).pow(2).sum().backward()
                norms.append(float(clip(m.parameters(), 0.5)))
                opt.step()
                opt.zero_grad()
            assert_close(norms[0], norms[1], 1e-5, f"bucket view {bucket_view}, step {step}")
        for (n, a), b in zip(net.named_parameters(), plain.parameters()):
            np.testing.assert_allclose(a.detach().numpy(), b.detach().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"bucket view {bucket_view}: {n}")


@case
def a_refusal_on_one_rank_changes_nothing_anywhere(ctx):
    for problem in ("read-only", "another tree"):
        grads = float32_grads(ctx.rank)
        if ctx.rank == 0 and problem == "read-only":
            grads["g3"].flags.writeable = False
        if ctx.rank == 0 and problem == "another tree":
            grads["extra"] = np.ones(3, np.float32)
        before = {k: v.copy() for k, v in grads.items()}
        try:
            gfd.all_reduce_(grads, "mean", group=ctx.group)
        except (ValueError, gfd.CollectiveError) as err:
            message = str(err)
        else:
            raise AssertionError(f"{problem} on rank 0: rank {ctx.rank} raised nothing")
        needles = (("['g3']", "writable") + (() if ctx.rank == 0 else ("rank 0",))
                   if problem == "read-only" else ("rank 0: 685 elements", "rank 1: 682 elements"))
        for needle in needles:
            if needle not in message:
                raise AssertionError(f"{problem}: the error does not name {needle!r}: {message}")
        for k, v in grads.items():
            np.testing.assert_array_equal(v, before[k], err_msg=f"{problem}: leaf {k} changed")


@case
def sixteen_bit_means_add_in_float32(ctx):
    halves = {"h": np.full(5, 60000, np.float16)}  # the sum of two ranks overflows float16
    gfd.all_reduce_(halves, "mean", group=ctx.group)
    np.testing.assert_array_equal(halves["h"], np.full(5, 60000, np.float16))
    # bfloat16 holds 8 bits: 256 + 1 + 1 + 1 rounds to 256 or 258 when added in bfloat16.
    brain = {"b": np.full(3, 256.0 if ctx.rank == 0 else 1.0).astype(BF16)}
    gfd.all_reduce_(brain, "mean", group=ctx.group)
    exact = (256.0 + (ctx.size - 1)) / ctx.size
    np.testing.assert_array_equal(brain["b"], np.full(3, exact).astype(BF16))

    class Resident:
        grad_buffers = (np.full(4, 60000, np.float16),)

    gfd.all_reduce_(Resident(), "mean", group=ctx.group)
    np.testing.assert_array_equal(Resident.grad_buffers[0], np.full(4, 60000, np.float16))


@case
def where_takes_dotted_paths_and_refuses_unknown_ones(ctx):
    whole = whole_model()
    layer_norm = np.linspace(-1e4, 2e4, 11).astype(np.float32)
    expected = ref_norm(list(whole.values()) + [layer_norm, layer_norm], 2)
    local = dict(shard(whole, ctx.rank, ctx.size), ln=layer_norm, enc={"ln": layer_norm.copy()})
    for where in ({"ln", "enc.ln"}, ["['ln']", "['enc'].ln"], ("ln", "['enc']['ln']")):
        rule = gfd.replicated(ctx.group, where=where)
        assert_close(gfd.global_norm(local, group=ctx.group, owned=rule), expected, 1e-12, f"where={where}")
    bad = [(lambda: gfd.replicated(ctx.group, where={"enc.lm"}), "'enc.lm'", "expected one of"),
           (lambda: gfd.tied(ctx.size, ctx.group, where={"ln"}), f"got {ctx.size}", f"a group of {ctx.size}")]
    for make, *needles in bad:
        try:  # every rank raises before the collective: nothing hangs
            gfd.global_norm(local, group=ctx.group, owned=make())
        except ValueError as err:
            if not all(n in str(err) for n in needles) or ("path" in needles[0] and "dotted" not in str(err)):
                raise AssertionError(f"the error does not name {needles}: {err}") from err
        else:
            raise AssertionError(f"no error for {needles}")


@case(transports=TORCH_ONLY)
def error_if_nonfinite_with_the_default_group(ctx):
    local = {k: v.copy() for k, v in shard(whole_model(), ctx.rank, ctx.size).items()}
    if ctx.rank == 1:
        local["f64"][0, 0] = np.inf
    before = {k: v.copy() for k, v in local.items()}
    try:
        gfd.clip_grad_norm_(local, 1.0, error_if_nonfinite=True)  # group=None: the default group
    except gf.NonFiniteError as err:
        if "['f64']" not in str(err) or "rank 1" not in str(err):
            raise AssertionError(f"the error names neither the leaf nor the rank: {err}") from err
    else:
        raise AssertionError(f"rank {ctx.rank}: no NonFiniteError")
    for k, v in local.items():
        np.testing.assert_array_equal(v, before[k], err_msg=f"leaf {k} was scaled")


@case(transports=TORCH_ONLY)
def torch_leaves(ctx):
    import torch

    grads = {"w": torch.full((3, 2), float(ctx.rank + 1)), "b": torch.ones(4, dtype=torch.float64)}
    total = gfd.global_norm(grads, group=ctx.group)
    expected = math.sqrt(sum(6 * (r + 1) ** 2 + 4 for r in range(ctx.size)))
    if not isinstance(total, torch.Tensor):
        raise AssertionError(f"expected a tensor for torch leaves, got {type(total).__name__}")
    assert_close(total, expected, 1e-12, "torch leaves")
    gfd.all_reduce_(grads, "sum", group=ctx.group)
    np.testing.assert_array_equal(grads["w"].numpy(), np.full((3, 2), sum(range(1, ctx.size + 1)), np.float32))
    gfd.clip_grad_norm_(grads, 1.0, group=ctx.group)
    assert_close(gfd.global_norm(grads, group=ctx.group), 1.0, 1e-5, "torch leaves clipped in place")


@case(transports=TORCH_ONLY)
def a_rank_that_raises_does_not_hang_the_others(ctx):
    """Last: the group used here is left broken. Rank 1 fails before the collective;
    the others get CollectiveError within the group's timeout (gloo). Under MPI
    the test file checks that mpirun aborts the job instead."""
    import torch.distributed as dist

    group = dist.new_group(timeout=timedelta(seconds=2))
    if ctx.rank == 1:
        time.sleep(4)  # alive, but as if it had raised in its own code before the collective
        return
    start = time.monotonic()
    try:
        gfd.global_norm({"w": np.ones(3)}, group=group)
    except gfd.CollectiveError as err:
        if "another rank" not in str(err) or time.monotonic() - start > 30:
            raise AssertionError(f"unclear or late error: {err}") from err
    else:
        raise AssertionError("the collective completed without rank 1")


# ---------------------------------------------------------------- running

def connect(transport, argv):
    if transport == "mpi":
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
        return Ctx("mpi", comm, comm.Get_rank(), comm.Get_size())
    import torch.distributed as dist

    rank, size, port = map(int, argv)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size, timeout=timedelta(seconds=60))
    return Ctx("gloo", dist.group.WORLD, rank, size)


def main(out_dir, transport, *argv):
    ctx = connect(transport, argv)
    run_cases([(name, globals()[name]) for name, transports in CASES if transport in transports], ctx, out_dir)
    if transport == "gloo":
        import torch.distributed as dist

        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
