"""One rank of the FSDP2 tests of gpuflat.torch.AdamW, SGD and Lion.

Run as ``python fsdp_optim_worker.py OUT RANK SIZE PORT``: torch.distributed
over gloo on 127.0.0.1, one process per rank. Every case runs on every rank
in CASES order and ``OUT/rank<r>.json`` is rewritten after each (see
tests/ranks.py); the checkpoints of the DCP cases go under ``OUT`` too, which
every rank shares.

The cases train identically initialised FSDP2 models side by side in the
same processes: with gpuflat's optimizer clipping inside its step
(``max_norm=``), and with torch.optim after ``torch.nn.utils.clip_grad_norm_``
(which takes DTensor gradients; Lion: the plain PyTorch one of
tests/torch_lion.py), ``zero_grad()`` setting gradients to None
each step. The model has a frozen layer, a layer used in even steps only, and
layers that split unevenly over 2 and 4 ranks (a one-row layer leaves most
ranks an empty shard).
"""
from __future__ import annotations

import math
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

import gpuflat.torch as gft
from ranks import run_cases
from torch_lion import Lion as TorchLion

CASES = []
MAX_NORM = 0.5
# In float64 the two clipped steps differ in summation order only.
RTOL, ATOL = 1e-10, 1e-13
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, gft.AdamW, dict(lr=2e-2, betas=(0.9, 0.99), weight_decay=0.1)),
    "sgd": (torch.optim.SGD, gft.SGD, dict(lr=5e-2, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "lion": (TorchLion, gft.Lion, dict(lr=5e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}


def case(f):
    CASES.append(f.__name__)
    return f


class Net(torch.nn.Module):
    """A frozen layer, a side layer used in even steps only, a one-row gate."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.frozen = torch.nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.hidden = torch.nn.Linear(16, 7)
        self.side = torch.nn.Linear(16, 7)
        self.gate = torch.nn.Linear(16, 1)
        self.norm = torch.nn.LayerNorm(7)

    def forward(self, x, k):
        h = torch.tanh(self.frozen(self.inp(x)))
        y = self.hidden(h) * torch.sigmoid(self.gate(h))
        if k % 2 == 0:
            y = y + self.side(h)
        return self.norm(y)


def model(ctx, dtype=torch.float64, seed=0, **fsdp):
    torch.manual_seed(seed)
    net = Net().to(dtype)  # made in float32: the same values in either dtype
    for layer in (net.inp, net.side):
        fully_shard(layer, mesh=ctx.mesh, **fsdp)
    fully_shard(net, mesh=ctx.mesh, **fsdp)
    return net


def groups(net, lr=None):
    """Weights with decay, the rest without (and, with ``lr``, a tensor lr in both)."""
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    rest = [p for n, p in net.named_parameters() if not any(p is q for q in decay)]
    extra = {} if lr is None else {"lr": torch.tensor(lr, dtype=torch.float64)}
    return [{"params": decay, **extra}, {"params": rest, "weight_decay": 0.0, **extra}]


def train(ctx, net, opt, steps, clip):
    """Steps ``steps`` (a range) of training; the norms each step clipped.
    Step k's batch is drawn on this rank the same whether a run was resumed or
    not, in float32 (the same values in either dtype)."""
    dtype = next(net.parameters()).dtype
    norms = []
    for k in steps:
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * ctx.rank + k)).to(dtype)
        (net(x, k).square().sum() * 4).backward()
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM).full_tensor()))
        opt.step()
        if not clip:
            norms.append(float(opt.last_grad_norm))
        opt.zero_grad()
    return norms


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def assert_same(net_ours, opt_ours, net_theirs, opt_theirs, what):
    """Parameters and state alike; gpuflat's state laid out as torch's on its DTensors."""
    for (name, a), b in zip(net_ours.named_parameters(), net_theirs.parameters()):
        torch.testing.assert_close(full(a.detach()), full(b.detach()), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{what}: {name}: {m}")
        ours, theirs = opt_ours.state.get(a, {}), opt_theirs.state.get(b, {})
        # gpuflat's SGD counts its momentum buffer's updates in a step of its
        # own, which torch.optim.SGD neither keeps nor reads.
        own = {"step"} if isinstance(opt_ours, gft.SGD) and "momentum_buffer" in ours else set()
        if sorted(set(ours) - own) != sorted(theirs):
            raise AssertionError(f"{what}: {name}: state {sorted(ours)} against torch's {sorted(theirs)}")
        for key, value in ours.items():
            if key == "step":
                if not (value.dtype == torch.float32 and value.dim() == 0 and not isinstance(value, DTensor)):
                    raise AssertionError(f"{what}: {name}: step is {value!r}, not a 0-d float32 tensor")
                if key in own:
                    continue
            elif not (isinstance(value, DTensor) and value.placements == a.placements
                      and value.device_mesh == a.device_mesh and value.shape == a.shape):
                raise AssertionError(f"{what}: {name}: {key} is not a DTensor laid out as its parameter: "
                                     f"{type(value).__name__} {getattr(value, 'placements', None)}")
            torch.testing.assert_close(full(value).double(), full(theirs[key]).double(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{what}: {name} {key}: {m}")


def side_by_side(ctx, name, steps=5, **fsdp):
    """gpuflat's optimizer and torch.optim's, ``steps`` steps each on an identical float64 model."""
    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    ours, theirs = model(ctx, **fsdp), model(ctx, **fsdp)
    opt_ours = flat_cls(groups(ours), max_norm=MAX_NORM, **kw)
    opt_theirs = torch_cls(groups(theirs), **kw)
    norms_ours = train(ctx, ours, opt_ours, range(steps), clip=False)
    norms_theirs = train(ctx, theirs, opt_theirs, range(steps), clip=True)
    torch.testing.assert_close(norms_ours, norms_theirs, rtol=RTOL, atol=0,
                               msg=lambda m: f"{name}: the norms clipped: {m}")
    if norms_theirs[0] <= MAX_NORM:
        raise AssertionError(f"{name}: the first norm {norms_theirs[0]} is within max_norm: the clip is not tested")
    assert_same(ours, opt_ours, theirs, opt_theirs, name)
    if any(p in opt_ours.state for p in ours.frozen.parameters()):
        raise AssertionError(f"{name}: the frozen layer has state")
    if name in ("adamw", "lion") and float(opt_ours.state[ours.side.weight]["step"]) != (steps + 1) // 2:
        raise AssertionError(f"{name}: the side layer, used in even steps, counted "
                             f"{float(opt_ours.state[ours.side.weight]['step'])} steps")
    return ours


def distance(net, other) -> float:
    """The 2-norm of the difference of two models' parameters, in float64."""
    return sum(float((full(a.detach()).double() - full(b.detach()).double()).square().sum())
               for a, b in zip(net.parameters(), other.parameters())) ** 0.5


# ---------------------------------------------------------------- training

@case
def adamw_matches_torch(ctx):
    side_by_side(ctx, "adamw")


@case
def adamw_float32_is_as_close_to_float64_as_torch(ctx):
    # float32 training of this model ends 2e-3 (2 ranks) to 6e-3 (4 ranks)
    # away from the same training in float64, in the 2-norm of all the
    # parameters, with either optimizer: AdamW's m / (sqrt(v) + eps)
    # magnifies the last bits where a gradient is near zero, and the next
    # steps carry that on. The two float32 optimizers round otherwise
    # (gpuflat's clip factor in float64, its update in one fused pass) and
    # end 2e-5 to 7e-5 apart (one element 6.5e-5 off, 5e-4 of its value):
    # a fixed bound would measure that noise. What is asked of gpuflat is
    # what torch gives: to end as close to float64 training.
    torch_cls, flat_cls, kw = OPTIMIZERS["adamw"]
    ours, theirs, exact = model(ctx, torch.float32), model(ctx, torch.float32), model(ctx, torch.float64)
    train(ctx, ours, flat_cls(groups(ours), max_norm=MAX_NORM, **kw), range(5), clip=False)
    train(ctx, theirs, torch_cls(groups(theirs), **kw), range(5), clip=True)
    train(ctx, exact, torch_cls(groups(exact), **kw), range(5), clip=True)
    off_ours, off_theirs, apart = distance(ours, exact), distance(theirs, exact), distance(ours, theirs)
    if not off_ours <= 1.1 * off_theirs:
        raise AssertionError(f"float32 gpuflat ends {off_ours:.3g} from float64 training, torch {off_theirs:.3g}, "
                             f"{apart:.3g} apart")


@case
def sgd_momentum_matches_torch(ctx):
    side_by_side(ctx, "sgd")


@case
def lion_matches_torch(ctx):
    side_by_side(ctx, "lion")


@case
def cpu_offload_matches_torch(ctx):
    # pin_memory=True, CPUOffloadPolicy's default, needs an accelerator to pin for.
    ours = side_by_side(ctx, "adamw", steps=3, offload_policy=CPUOffloadPolicy(pin_memory=False))
    devices = {p.to_local().device.type for p in ours.parameters()}
    if devices != {"cpu"}:
        raise AssertionError(f"the offloaded parameters live on {devices}")


# ---------------------------------------------------------------- checkpoints

def save(ctx, net, opt, tag):
    path = os.path.join(ctx.out_dir, tag)
    dcp.save({"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}, checkpoint_id=path)
    return path


def load(ctx, opt_cls, kw, path, lr=None, dtype=torch.float64):
    """A model initialised otherwise and a new optimizer (a tensor lr: DCP
    sets it to a CPU tensor 0 for the step that makes the state), both
    loaded from ``path``."""
    net = model(ctx, dtype, seed=1)
    opt = opt_cls(groups(net, lr), **kw)
    before = [full(p.detach()).clone() for p in net.parameters()]
    state = {"model": get_model_state_dict(net), "optim": get_optimizer_state_dict(net, opt)}
    for (name, p), b in zip(net.named_parameters(), before):
        if not torch.equal(full(p.detach()), b):
            raise AssertionError(f"{name} moved in the step that made the state, with lr 0")
    if not opt.state:
        raise AssertionError("get_optimizer_state_dict made no state")
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(net, state["model"])
    set_optimizer_state_dict(net, opt, state["optim"])
    return net, opt


def resumed(ctx, name, lr):
    """Against torch.optim trained 6 steps straight: gpuflat's optimizer
    saved after 3 and resumed from the checkpoint by a new one, and
    torch.optim resumed from that same checkpoint."""
    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    if lr is not None:  # in the groups, and torch.optim takes a tensor lr without foreach only
        kw = {k: v for k, v in kw.items() if k != "lr"} | {"foreach": False}
    reference, ours = model(ctx), model(ctx)
    opt_reference = torch_cls(groups(reference, lr), **kw)
    opt_ours = flat_cls(groups(ours, lr), max_norm=MAX_NORM, **kw)
    train(ctx, reference, opt_reference, range(6), clip=True)
    train(ctx, ours, opt_ours, range(3), clip=False)
    path = save(ctx, ours, opt_ours, f"{name}-{'float' if lr is None else 'tensor'}-lr")
    saved = {key: full(value).clone() for key, value in opt_ours.state[ours.hidden.weight].items()}

    net, opt = load(ctx, flat_cls, dict(kw, max_norm=MAX_NORM), path, lr)
    for key, value in opt.state[net.hidden.weight].items():
        torch.testing.assert_close(full(value), saved[key], rtol=0, atol=0, msg=lambda m: f"loaded {key}: {m}")
    train(ctx, net, opt, range(3, 6), clip=False)
    assert_same(net, opt, reference, opt_reference, f"{name}, resumed by gpuflat")

    net, opt = load(ctx, torch_cls, kw, path, lr)
    train(ctx, net, opt, range(3, 6), clip=True)
    assert_same(reference, opt_reference, net, opt, f"{name}, resumed by torch.optim")


@case
def adamw_resumes_from_dcp(ctx):
    resumed(ctx, "adamw", None)


@case
def adamw_with_a_tensor_lr_resumes_from_dcp(ctx):
    resumed(ctx, "adamw", 2e-2)


@case
def sgd_momentum_resumes_from_dcp(ctx):
    resumed(ctx, "sgd", None)


@case
def lion_resumes_from_dcp(ctx):
    resumed(ctx, "lion", None)


@case
def lion_with_a_tensor_lr_resumes_from_dcp(ctx):
    resumed(ctx, "lion", 5e-3)


def precision_resumed(ctx, name, **options):
    """A bfloat16 model trained 4 steps straight, against the same saved
    after 2 and resumed by a new optimizer: what each parameter keeps beside
    it and its moments are DTensors laid out as the parameter, in the dtypes
    their options chose, and come back in them from the checkpoint
    (torch.optim's load_state_dict casts floating state to the parameter's
    dtype); the resumed run ends with the straight one's bits."""
    _, flat_cls, kw = OPTIMIZERS[name]
    options = dict(kw, max_norm=MAX_NORM, **options)
    straight, ours = model(ctx, torch.bfloat16), model(ctx, torch.bfloat16)
    opt_straight, opt_ours = flat_cls(groups(straight), **options), flat_cls(groups(ours), **options)
    train(ctx, straight, opt_straight, range(4), clip=False)
    train(ctx, ours, opt_ours, range(2), clip=False)
    path = save(ctx, ours, opt_ours, f"{name}-precision")
    net, opt = load(ctx, flat_cls, options, path, dtype=torch.bfloat16)
    kept = "master_param" if options.get("master_weights") else "kahan_comp" if options.get("kahan_sum") else "step"
    for (label, p), q in zip(net.named_parameters(), ours.parameters()):
        if p not in opt.state:
            continue
        for key, value in opt.state[p].items():
            saved = opt_ours.state[q][key]
            if key != "step" and not (isinstance(value, DTensor) and value.placements == p.placements):
                raise AssertionError(f"{label}: {key} is not a DTensor laid out as its parameter")
            if value.dtype != saved.dtype or not torch.equal(full(value), full(saved)):
                raise AssertionError(f"{label}: {key} came back {value.dtype}, saved {saved.dtype}, or otherwise")
        if kept not in opt.state[p]:
            raise AssertionError(f"{label}: no {kept} in its state {sorted(opt.state[p])}")
    train(ctx, net, opt, range(2, 4), clip=False)
    for (label, p), q in zip(net.named_parameters(), straight.parameters()):
        if not torch.equal(full(p.detach()), full(q.detach())):
            raise AssertionError(f"{label}: the resumed run ends apart from the straight one")
        for key, value in opt.state.get(p, {}).items():
            if not torch.equal(full(value), full(opt_straight.state[q][key])):
                raise AssertionError(f"{label}: {key}: the resumed run ends apart from the straight one")


@case
def adamw_master_weights_resume_from_dcp_in_float32(ctx):
    precision_resumed(ctx, "adamw", master_weights=True, exp_avg_dtype=torch.float32,
                      exp_avg_sq_dtype=torch.float32)


@case
def lion_kahan_sums_resume_from_dcp(ctx):
    precision_resumed(ctx, "lion", kahan_sum=True)


@case
def sgd_stochastic_rounding_resumes_from_dcp(ctx):
    # The draws are keyed by each parameter's count, which the checkpoint keeps.
    precision_resumed(ctx, "sgd", bf16_stochastic_round=True, rounding_seed=3)


@case
def stats_are_the_local_shards(ctx):
    # Per parameter, from this rank's share of the passes: its shard's
    # gradient norm (unscaled, before the clip) and its update's.
    _, flat_cls, kw = OPTIMIZERS["adamw"]
    net = model(ctx)
    opt = flat_cls(net.named_parameters(), max_norm=MAX_NORM, stats=True, **kw)
    for k in range(2):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * ctx.rank + k)).double()
        (net(x, k).square().sum() * 4).backward()
        before = {name: p.to_local().detach().clone() for name, p in net.named_parameters()}
        opt.step()
        for name, p in net.named_parameters():
            if p.grad is None:
                continue
            figures = {key: float(value) for key, value in opt.stats[name].items()}
            grad = float(torch.linalg.vector_norm(p.grad.to_local()))
            update = float(torch.linalg.vector_norm(p.to_local().detach() - before[name]))
            if not (math.isclose(figures["grad_norm"], grad, rel_tol=1e-12, abs_tol=1e-300)
                    and math.isclose(figures["update_norm"], update, rel_tol=1e-9, abs_tol=1e-300)):
                raise AssertionError(f"{name}: figures {figures}, the local shard's gradient norm {grad} and "
                                     f"update norm {update}")
        opt.zero_grad()


@case
def global_stats_are_the_whole_tensors(ctx):
    # With stats="global", every rank's figures of a parameter are those of
    # its whole tensor, gathered here in float64: one per norm kind (the
    # 2-norm's, the inf-norm's max, a p-norm's), clipped. A replicated
    # DTensor beside the shards is counted once, not once per rank.
    for name, norm_type in (("adamw", 2.0), ("sgd", math.inf), ("lion", 3.0)):
        _, flat_cls, kw = OPTIMIZERS[name]
        net = model(ctx)
        extra = torch.nn.Parameter(distribute_tensor(torch.randn(5, generator=torch.Generator().manual_seed(7))
                                                     .double(), ctx.mesh, [Replicate()]))
        params = [*net.named_parameters(), ("extra", extra)]
        opt = flat_cls(params, max_norm=MAX_NORM, norm_type=norm_type, stats="global", **kw)
        for k in range(3):  # the side layer's gradient comes and goes: the buffers are made again
            x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1000 * ctx.rank + k)).double()
            (net(x, k).square().sum() * 4).backward()
            extra.grad = distribute_tensor(torch.randn(5, generator=torch.Generator().manual_seed(k)).double(),
                                           ctx.mesh, [Replicate()])
            stepped = [(label, p) for label, p in params if p.grad is not None]
            grads = {label: p.grad.full_tensor().clone() for label, p in stepped}
            before = {label: p.detach().full_tensor().clone() for label, p in stepped}  # a replicated one is no copy
            opt.step()
            for label, p in stepped:
                figures = {key: float(value) for key, value in opt.stats[label].items()}
                after = p.detach().full_tensor()
                grad = float(torch.linalg.vector_norm(grads[label], norm_type))
                update = float(torch.linalg.vector_norm(after - before[label]))
                ratio = update / float(torch.linalg.vector_norm(after))
                if not (math.isclose(figures["grad_norm"], grad, rel_tol=1e-12, abs_tol=1e-300)
                        and math.isclose(figures["update_norm"], update, rel_tol=1e-9, abs_tol=1e-300)
                        and math.isclose(figures["update_ratio"], ratio, rel_tol=1e-9, abs_tol=1e-300)):
                    raise AssertionError(f"{name}, step {k}, {label}: figures {figures}, the whole tensor's "
                                         f"gradient norm {grad}, update norm {update} and ratio {ratio}")
            opt.zero_grad()
            extra.grad = None


# ---------------------------------------------------------------- running

class Ctx:
    def __init__(self, out_dir, rank, size):
        self.out_dir, self.rank, self.size = out_dir, rank, size
        self.mesh = init_device_mesh("cpu", (size,))


def main(out_dir, rank, size, port):
    rank, size = int(rank), int(size)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=60))
    ctx = Ctx(out_dir, rank, size)
    run_cases([(name, globals()[name]) for name in CASES], ctx, out_dir)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
