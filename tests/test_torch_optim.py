"""gpuflat.torch.AdamW, SGD and Lion against torch.optim's (Lion: the plain
PyTorch one of tests/torch_lion.py), on the CPU.

The model has what real ones have: an embedding tied to the output layer,
a frozen layer, BatchNorm, and a no-decay group for biases and norms. Over
50 steps the flat optimizer, clipping inside its step, must stay within
a rounding error bound of torch.optim (foreach) after
torch.nn.utils.clip_grad_norm_, parameters and state; LR schedulers, state
dicts both ways, and a clip before a plain step must work as in PyTorch.
Then what training loops do to a model after the optimizer was built
(unfreezing a layer, adding a group or an adapter, replacing parameters,
leaving a head without gradients), each beside plain PyTorch doing the same.
"""
import copy

import pytest

torch = pytest.importorskip("torch")

import gpuflat as gf  # noqa: E402
import gpuflat.torch as gft  # noqa: E402
from gpuflat._src import tensor_table  # noqa: E402
from gpuflat._src.backends import get_backend  # noqa: E402
from conftest import apart_at_most  # noqa: E402
from torch_lion import Lion as TorchLion  # noqa: E402

VOCAB, DIM, BATCH = 11, 8, 16
# The two loops are one computation rounded differently: PyTorch's CPU
# kernels fuse multiplies and adds (addcmul, addcdiv) and round differently
# on each CPU (AVX-512, AVX2 or none), gpuflat's round each operation as its
# GPU kernels do, and its clip factor comes from a float64 norm where
# PyTorch's comes from one in the parameters' dtype. A step rounds a value
# along a chain of at most STEP_ROUNDINGS operations (a reduction of n terms
# counts n): forward, the frozen and hidden layers (a dot of DIM and a bias
# each), tanh, BatchNorm (the batch's mean and variance, normalise, scale,
# shift), the output layer, log-softmax over VOCAB and the mean over the
# batch; backward, that chain again and each weight's gradient summed over
# the batch (three layers); the clip, the squares of the largest gradient
# (the tied VOCAB x DIM weight) summed, the factor and the multiply; AdamW's
# update, the longer: decay (2), both moments (3 and 4), both bias
# corrections (2), the square root of the quotient (2), eps, the step's
# quotient (2), lr and the subtraction (18 in all); Lion's is shorter (decay
# 2, the moment 3, the sign, lr and the subtraction), so 18 bounds it too.
# Each loop is within the bound of its steps times that of exact arithmetic
# (tests/conftest.py).
# The models of the other tests here are no deeper.
FORWARD_ROUNDINGS = 2 * (DIM + 1) + 1 + (2 * BATCH + 3) + (DIM + 1) + (VOCAB + 2) + BATCH
STEP_ROUNDINGS = 2 * FORWARD_ROUNDINGS + 3 * BATCH + (VOCAB * DIM + 2) + 18


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.frozen = torch.nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.hidden = torch.nn.Linear(DIM, DIM)
        self.norm = torch.nn.BatchNorm1d(DIM)
        self.out = torch.nn.Linear(DIM, VOCAB)
        self.out.weight = self.emb.weight  # tied

    def forward(self, x):
        h = self.emb(x)
        h = torch.tanh(self.hidden(self.frozen(h)))
        return self.out(self.norm(h))


def groups(net, **no_decay):
    decay = [p for n, p in net.named_parameters() if n.endswith("weight") and not n.startswith("norm")]
    rest = [p for n, p in net.named_parameters() if not any(p is q for q in decay)]
    return [{"params": decay}, {"params": rest, "weight_decay": 0.0, **no_decay}]


def batches(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (BATCH,), generator=g), torch.randint(0, VOCAB, (BATCH,), generator=g))
            for _ in range(n)]


def backward(net, x, y, scale=1.0):
    loss = torch.nn.functional.cross_entropy(net(x), y) * scale
    loss.backward()


def run_torch(net, opt, data, max_norm=None, sched=None):
    for x, y in data:
        opt.zero_grad()
        backward(net, x, y, scale=5.0)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
        opt.step()
        if sched is not None:
            sched.step()


def run_flat(net, opt, data, sched=None):
    norms = []
    for x, y in data:
        opt.zero_grad()
        backward(net, x, y, scale=5.0)
        opt.step()
        norms.append(opt.last_grad_norm)
        if sched is not None:
            sched.step()
    return norms


def assert_close(net_a, opt_a, net_b, opt_b, steps):
    """Parameters and state of two loops of ``steps`` steps, within the bound."""
    for (name, a), b in zip(net_a.named_parameters(), net_b.parameters()):
        assert_tensors_close(a, b, name, steps)
        sa, sb = (_as_torch_keeps(o.state.get(p, {}), o) for o, p in ((opt_a, a), (opt_b, b)))
        assert sorted(sa) == sorted(sb), name
        for key in sa:
            assert_tensors_close(sa[key], sb[key], f"{name} {key}", steps, a.dtype)


def _as_torch_keeps(state, opt):
    """``state`` without the count of gpuflat's SGD momentum buffer, which
    torch.optim.SGD neither keeps nor reads (it keeps one it loads)."""
    return {k: v for k, v in state.items() if not (isinstance(opt, (gft.SGD, torch.optim.SGD)) and k == "step")}


def assert_tensors_close(a, b, name, steps, dtype=None):
    """``a`` and ``b``, computed in ``dtype`` (theirs by default) over
    ``steps`` steps, apart by at most the bound times their largest magnitude."""
    eps = torch.finfo(dtype or a.dtype).eps
    a, b = a.detach().double(), b.detach().double()
    scale = float(torch.cat([a.reshape(-1), b.reshape(-1)]).abs().max()) if a.numel() else 0.0
    atol = apart_at_most(eps, steps * STEP_ROUNDINGS, scale)
    torch.testing.assert_close(a, b, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def pair(seed=0):
    torch.manual_seed(seed)
    net = Net()
    return net, copy.deepcopy(net)


OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, gft.AdamW, dict(lr=3e-3, weight_decay=0.1)),
    "sgd": (torch.optim.SGD, gft.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    "sgd-nesterov": (torch.optim.SGD, gft.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
    "sgd-plain": (torch.optim.SGD, gft.SGD, dict(lr=0.05)),
    "lion": (TorchLion, gft.Lion, dict(lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_fifty_clipped_steps_match_torch(name):
    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    net_t, net_f = pair()
    opt_t = torch_cls(groups(net_t), foreach=True, **kw)
    opt_f = flat_cls(groups(net_f), max_norm=1.0, **kw)
    data = batches(50)
    run_torch(net_t, opt_t, data, max_norm=1.0)
    norms = run_flat(net_f, opt_f, data)
    assert_close(net_t, opt_t, net_f, opt_f, len(data))
    assert all(isinstance(n, torch.Tensor) and n.dtype == torch.float64 for n in norms)
    assert max(float(n) for n in norms) > 1.0  # the clip was active
    torch.testing.assert_close(net_f.frozen.weight, net_t.frozen.weight, rtol=0, atol=0)  # untouched
    assert net_f.frozen.weight not in opt_f.state


class Routed(torch.nn.Module):
    """A model with an expert layer the forward pass uses on some steps only."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.expert = torch.nn.Linear(DIM, DIM)
        self.out = torch.nn.Linear(DIM, VOCAB)

    def forward(self, x, routed):
        h = self.emb(x)
        return self.out(h + self.expert(h) if routed else h)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_parameter_without_a_gradient_is_skipped_as_in_torch(name, dtype):
    # zero_grad() sets every gradient to None and a layer the forward pass
    # does not use keeps None (an expert no token was routed to): PyTorch's
    # optimizers leave it, its state and its step count as they were, with
    # no weight decay and no momentum step.
    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    torch.manual_seed(3)
    net_t = Routed().to(dtype)
    net_f = copy.deepcopy(net_t)
    opt_t = torch_cls(net_t.parameters(), foreach=True, **kw)
    opt_f = flat_cls(net_f.parameters(), max_norm=1.0, **kw)
    first = net_f.expert.weight.detach().clone()
    for step, (x, y) in enumerate(batches(12, seed=3)):
        routed = step % 3 == 0
        for net, opt in ((net_t, opt_t), (net_f, opt_f)):
            opt.zero_grad()
            (torch.nn.functional.cross_entropy(net(x, routed), y) * 5.0).backward()
            if net is net_t:
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
        assert (net_f.expert.weight.grad is None) == (not routed)  # as the loop left it
    assert_close(net_t, opt_t, net_f, opt_f, 12)
    if "step" in opt_t.state[net_t.expert.weight]:
        assert float(opt_f.state[net_f.expert.weight]["step"]) == 4  # its 4 routed steps
    assert not torch.equal(net_f.expert.weight, first)


@pytest.mark.parametrize("backend", ["numpy", "host", "emulated"])
@pytest.mark.parametrize("torch_cls,flat_cls", [(torch.optim.AdamW, gft.AdamW), (TorchLion, gft.Lion)],
                         ids=["adamw", "lion"])
def test_every_backend_steps_as_torch(torch_cls, flat_cls, backend):
    # The emulated backend runs the CUDA kernels (the update over the
    # parameter table, the step counts) on the CPU tensors.
    net_t, net_f = pair(1)
    opt_t = torch_cls(net_t.parameters(), lr=1e-2, foreach=True)
    opt_f = flat_cls(net_f.parameters(), lr=1e-2, max_norm=0.5)
    data = batches(20, seed=1)
    run_torch(net_t, opt_t, data, max_norm=0.5)
    with tensor_table.serve_with(get_backend(backend)):
        run_flat(net_f, opt_f, data)
    assert_close(net_t, opt_t, net_f, opt_f, len(data))


def test_lr_schedulers_change_lr_the_same_way():
    net_t, net_f = pair(2)
    opt_t = torch.optim.AdamW(groups(net_t), lr=1e-2, foreach=True)
    opt_f = gft.AdamW(groups(net_f), lr=1e-2, max_norm=1.0)
    make = lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=2e-2, total_steps=30)  # noqa: E731
    s_t, s_f = make(opt_t), make(opt_f)
    data = batches(30, seed=2)
    run_torch(net_t, opt_t, data, max_norm=1.0, sched=s_t)
    run_flat(net_f, opt_f, data, sched=s_f)
    assert [g["lr"] for g in opt_f.param_groups] == [g["lr"] for g in opt_t.param_groups]
    assert_close(net_t, opt_t, net_f, opt_f, len(data))


@pytest.mark.parametrize("torch_cls,flat_cls,kw", [(torch.optim.SGD, gft.SGD, dict(lr=0.1, momentum=0.5)),
                                                   (TorchLion, gft.Lion, dict(lr=0.01, weight_decay=0.1))],
                         ids=["sgd", "lion"])
def test_lr_may_be_a_tensor(torch_cls, flat_cls, kw):
    net_t, net_f = pair(3)
    opt_t = torch_cls(net_t.parameters(), foreach=True, **dict(kw, lr=torch.tensor(kw["lr"])))
    opt_f = flat_cls(net_f.parameters(), **dict(kw, lr=torch.tensor(kw["lr"])))
    data = batches(5, seed=3)
    run_torch(net_t, opt_t, data)
    run_flat(net_f, opt_f, data)
    assert_close(net_t, opt_t, net_f, opt_f, len(data))


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_state_dicts_load_both_ways(name):
    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    data = batches(20, seed=4)
    # torch -> gpuflat: ten steps in torch, then each continues ten more.
    net_t, net_f = pair(4)
    opt_t = torch_cls(groups(net_t), foreach=True, **kw)
    run_torch(net_t, opt_t, data[:10], max_norm=1.0)
    net_f.load_state_dict(net_t.state_dict())
    opt_f = flat_cls(groups(net_f), max_norm=1.0, **kw)
    opt_f.load_state_dict(copy.deepcopy(opt_t.state_dict()))
    assert_close(net_t, opt_t, net_f, opt_f, 10)
    run_torch(net_t, opt_t, data[10:], max_norm=1.0)
    run_flat(net_f, opt_f, data[10:])
    assert_close(net_t, opt_t, net_f, opt_f, len(data))
    # gpuflat -> torch: and back again for ten more.
    opt_t2 = torch_cls(groups(net_t), foreach=True, **kw)
    net_t.load_state_dict(net_f.state_dict())
    opt_t2.load_state_dict(copy.deepcopy(opt_f.state_dict()))
    run_torch(net_t, opt_t2, data[:10], max_norm=1.0)
    run_flat(net_f, opt_f, data[:10])
    assert_close(net_t, opt_t2, net_f, opt_f, len(data) + 10)


def test_a_clip_before_a_plain_step():
    net_t, net_f = pair(5)
    opt_t = torch.optim.AdamW(net_t.parameters(), lr=1e-2, foreach=True)
    opt_f = gft.AdamW(net_f.parameters(), lr=1e-2)
    data = batches(10, seed=5)
    run_torch(net_t, opt_t, data, max_norm=0.5)
    for x, y in data:
        opt_f.zero_grad()
        backward(net_f, x, y, scale=5.0)
        gft.clip_grad_norm_(net_f.parameters(), 0.5)
        opt_f.step()
    assert opt_f.last_grad_norm is None
    assert_close(net_t, opt_t, net_f, opt_f, len(data))


def test_the_state_is_torchs_and_owns_its_storage(tmp_path):
    net = Net()
    opt = gft.AdamW(net.parameters(), lr=1e-3)
    assert not opt.state  # nothing before the first step, as in PyTorch
    backward(net, *batches(1)[0])
    opt.step()
    trained = [p for p in net.parameters() if p.requires_grad]
    assert len(opt.state) == len(trained) == 6
    for p in trained:
        state = opt.state[p]
        assert state["step"].shape == () and state["step"].dtype == torch.float32 and float(state["step"]) == 1
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].shape == p.shape and state[key].untyped_storage().nbytes() == p.numel() * 4
    # Saving one entry writes that entry's bytes, not a buffer of every parameter's.
    entry, alone = tmp_path / "entry.pt", tmp_path / "alone.pt"
    torch.save(opt.state[net.hidden.bias]["exp_avg"], entry)
    torch.save(opt.state[net.hidden.bias]["exp_avg"].clone(), alone)
    assert abs(entry.stat().st_size - alone.stat().st_size) < 1024


def test_refused_options_and_bad_hyperparameters():
    net = Net()
    with pytest.raises(TypeError, match=r"got a Resident; pass model.parameters\(\)"):
        gft.AdamW(gf.resident(Net()))
    with pytest.raises(ValueError, match=r"gpuflat.torch.SGD: parameter group 0: differentiable=True is not "
                                         r"implemented"):
        gft.SGD(net.parameters(), differentiable=True)
    with pytest.raises(ValueError, match="max_norm"):
        gft.SGD(net.parameters(), max_norm=-1.0)
    opt = gft.SGD(net.parameters(), lr=0.1, foreach=True)
    opt.param_groups[0]["lr"] = float("nan")
    backward(net, *batches(1)[0])
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match="parameter group 0: expected lr >= 0, got nan"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, net.parameters()))


def test_parameters_it_cannot_update_are_refused_by_name_before_any_write():
    w = torch.nn.Parameter(torch.ones(3))
    z = torch.nn.Parameter(torch.ones(2, dtype=torch.complex64))
    opt = gft.AdamW([w, z], lr=0.1)
    w.grad, z.grad = torch.ones(3), torch.ones(2, dtype=torch.complex64)
    with pytest.raises(TypeError, match=r"param_groups\[0\]\['params'\]\[1\]: expected a float16, bfloat16, "
                                        r"float32 or float64 parameter, got torch.complex64"):
        opt.step()
    assert torch.equal(w.detach(), torch.ones(3))
    base = torch.ones(4, 4)
    strided = torch.nn.Parameter(base[:, ::2])  # every other column: not one dense block
    opt = gft.SGD([torch.nn.Parameter(torch.ones(2)), strided], lr=0.1)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    with pytest.raises(ValueError, match=r"param_groups\[0\]\['params'\]\[1\]: expected a parameter whose "
                                         r"memory is one dense block, got shape \(4, 2\)"):
        opt.step()
    transposed = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3).t())  # dense, in another order
    opt = gft.SGD([transposed], lr=0.5)
    transposed.grad = torch.ones(3, 2).t().contiguous().t()
    opt.step()
    torch.testing.assert_close(transposed.detach(), torch.arange(6.0).reshape(2, 3).t() - 0.5)


# ---------------------------------------------------------------- GradScaler

SCALERS = {"stock": torch.amp.GradScaler, "gpuflat": gft.GradScaler}
INF_STEP, NAN_STEP = 7, 18


def inject(net, k):
    """An inf in one step's gradients and a NaN in another's (after backward, before the step)."""
    if k in (INF_STEP, NAN_STEP):
        net.hidden.weight.grad[0, 0] = float("inf") if k == INF_STEP else float("nan")


def scaled_backward(net, scaler, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(net(x), y) * 5.0
    scaler.scale(loss).backward()


def make_scaler(cls):
    return cls("cpu", init_scale=2.0**12, growth_interval=4)


def run_torch_scaled(net, opt, data):
    scaler, scales = make_scaler(torch.amp.GradScaler), []
    for k, (x, y) in enumerate(data):
        opt.zero_grad()
        scaled_backward(net, scaler, x, y)
        inject(net, k)
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def state_snapshot(opt):
    return {id(p): {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}


@pytest.mark.parametrize("scaler_name", list(SCALERS))
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_thirty_scaled_steps_match_torch(name, scaler_name):
    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    net_t, net_f = pair(6)
    opt_t = torch_cls(groups(net_t), foreach=True, **kw)
    opt_f = flat_cls(groups(net_f), max_norm=1.0, **kw)
    data = batches(30, seed=6)
    want_scales = run_torch_scaled(net_t, opt_t, data)
    scaler, scales, norms = make_scaler(SCALERS[scaler_name]), [], []
    for k, (x, y) in enumerate(data):
        opt_f.zero_grad()
        scaled_backward(net_f, scaler, x, y)
        inject(net_f, k)
        before = ([p.detach().clone() for p in net_f.parameters()], state_snapshot(opt_f))
        scaler.step(opt_f)
        scaler.update()
        scales.append(scaler.get_scale())
        norms.append(float(opt_f.last_grad_norm))
        if k in (INF_STEP, NAN_STEP):  # skipped on the device: every bit as it was
            assert all(torch.equal(a, b) for a, b in zip(before[0], net_f.parameters()))
            after = state_snapshot(opt_f)
            assert all(torch.equal(before[1][i][key], after[i][key]) for i in after for key in after[i])
    assert scales == want_scales
    assert scales[INF_STEP] == scales[INF_STEP - 1] / 2 and scales[NAN_STEP] == scales[NAN_STEP - 1] / 2
    assert max(scales) > 2.0**12  # the scale also grew
    assert max(n for n in norms if n == n and n != float("inf")) < 1e3  # the norm is the unscaled one
    assert_close(net_t, opt_t, net_f, opt_f, len(data))


def test_gpuflat_gradscaler_takes_the_flag_from_the_norm_pass(monkeypatch):
    net = Net()
    opt = gft.AdamW(net.parameters(), lr=1e-3, max_norm=1.0)
    scaler = make_scaler(gft.GradScaler)
    called = []
    monkeypatch.setattr(torch.amp.GradScaler, "_check_inf_per_device",
                        lambda self, o: called.append(o) or {})
    scaled_backward(net, scaler, *batches(1)[0])
    scaler.step(opt)
    scaler.update()
    assert not called  # no third pass over the gradients
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


# TorchDynamo warns where it traces into code it cannot follow faithfully.
@pytest.mark.filterwarnings("error::UserWarning")
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_a_compiled_training_step_matches_torch(name):
    # torch.compile traces the forward, the backward and the step, down to
    # gpuflat's operators (tests/test_torch_optim_compile.py).
    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    net_t, net_f = pair(3)
    opt_t = torch_cls(groups(net_t), foreach=True, **kw)
    opt_f = flat_cls(groups(net_f), max_norm=1.0, **kw)

    def step(x, y):
        opt_f.zero_grad()
        backward(net_f, x, y, scale=5.0)
        opt_f.step()

    data = batches(6, seed=3)
    compiled = torch.compile(step, backend="aot_eager")
    try:
        for x, y in data:
            compiled(x, y)
    finally:
        torch._dynamo.reset()
    run_torch(net_t, opt_t, data, max_norm=1.0)
    assert_close(net_t, opt_t, net_f, opt_f, len(data))


# ---------------------------------------------------------------- what loops do to a model

def torch_clip(opt, max_norm):
    """What max_norm= means: clip_grad_norm_ over the parameters in param_groups."""
    torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], max_norm)


LOOP_STEPS = 8


def side_by_side(name, make_params, loop, steps=LOOP_STEPS, seed=7, max_norm=1.0, scaler=None, dtype=torch.float32):
    """The same loop with torch.optim (clipping with torch's clip, unscaling
    with a stock GradScaler's unscale_) and with gpuflat's optimizer
    (clipping and unscaling inside the step); returns both models and
    optimizers. ``loop(net, opt, k, is_torch)`` runs step k's changes;
    ``scaler``: None, "stock" or "gpuflat" (the scaler gpuflat's side uses)."""
    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    torch.manual_seed(seed)
    net_t = Net().to(dtype)
    net_f = copy.deepcopy(net_t)
    opt_t = torch_cls(make_params(net_t), **kw)
    opt_f = flat_cls(make_params(net_f), max_norm=max_norm, **kw)
    scalers = {}
    if scaler is not None:
        scalers = {True: torch.amp.GradScaler("cpu", init_scale=2.0**8),
                   False: SCALERS[scaler]("cpu", init_scale=2.0**8)}
    for k, (x, y) in enumerate(batches(steps, seed=seed)):
        for net, opt, is_torch in ((net_t, opt_t, True), (net_f, opt_f, False)):
            opt.zero_grad()
            loop(net, opt, k, is_torch)
            sc = scalers.get(is_torch)
            backward(net, x, y, scale=5.0 * (sc.get_scale() if sc is not None else 1.0))
            if sc is not None:
                sc.scale(torch.ones(()))  # the scale tensor, made as scale(loss) makes it
            if is_torch and sc is not None:
                sc.unscale_(opt)
            if is_torch and max_norm is not None:
                torch_clip(opt, max_norm)
            if sc is None:
                opt.step()
            else:
                sc.step(opt)
                sc.update()
    return net_t, opt_t, net_f, opt_f


LOOP_CASES = [(None, None), (1.0, None), (1.0, "stock"), (None, "gpuflat"), (1.0, "gpuflat")]
LOOP_OPTIMIZERS = ["adamw", "sgd", "lion"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("max_norm,scaler", LOOP_CASES)
@pytest.mark.parametrize("name", LOOP_OPTIMIZERS)
def test_a_layer_unfrozen_after_construction_is_trained(name, max_norm, scaler, dtype):
    def unfreeze(net, opt, k, is_torch):
        if k == 2:
            net.frozen.requires_grad_(True)

    net_t, opt_t, net_f, opt_f = side_by_side(name, lambda n: n.parameters(), unfreeze, max_norm=max_norm,
                                              scaler=scaler, dtype=dtype)
    assert_close(net_t, opt_t, net_f, opt_f, LOOP_STEPS)
    assert net_f.frozen.weight in opt_f.state
    torch.manual_seed(7)  # side_by_side's seed: the weights it started from
    assert (net_f.frozen.weight - Net().to(dtype).frozen.weight).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("max_norm,scaler", LOOP_CASES)
@pytest.mark.parametrize("name", LOOP_OPTIMIZERS)
def test_an_adapter_added_mid_training_as_a_group(name, max_norm, scaler, dtype):
    # A LoRA-style adapter: a submodule added at step 3, its parameters given
    # to the optimizer with add_param_group, as PyTorch users do.
    def adapt(net, opt, k, is_torch):
        if k == 3:
            torch.manual_seed(11)
            net.hidden.adapter = torch.nn.Linear(DIM, DIM, bias=False).to(dtype)
            net.hidden.register_forward_hook(lambda m, i, o: o + m.adapter(i[0]))
            opt.add_param_group({"params": list(net.hidden.adapter.parameters()), "lr": 0.02})

    net_t, opt_t, net_f, opt_f = side_by_side(name, groups, adapt, max_norm=max_norm, scaler=scaler, dtype=dtype)
    assert_close(net_t, opt_t, net_f, opt_f, LOOP_STEPS)
    assert len(opt_f.param_groups) == 3 and net_f.hidden.adapter.weight in opt_f.state


@pytest.mark.parametrize("name", LOOP_OPTIMIZERS)
def test_an_adapter_outside_the_optimizer_is_neither_trained_nor_clipped(name):
    # max_norm clips what is in param_groups, as clip_grad_norm_ over them would.
    def adapt(net, opt, k, is_torch):
        if k == 2:
            torch.manual_seed(12)
            net.hidden.adapter = torch.nn.Linear(DIM, DIM, bias=False)
            net.hidden.register_forward_hook(lambda m, i, o: o + m.adapter(i[0]))

    net_t, opt_t, net_f, opt_f = side_by_side(name, groups, adapt)
    assert_close(net_t, opt_t, net_f, opt_f, LOOP_STEPS)
    assert_tensors_close(net_f.hidden.adapter.weight.grad, net_t.hidden.adapter.weight.grad, "adapter grad", LOOP_STEPS)


@pytest.mark.parametrize("name", LOOP_OPTIMIZERS)
def test_a_head_without_gradients_is_left_alone_when_gradients_are_zeroed_in_place(name):
    # zero_grad(set_to_none=False) zeroes the gradients that exist; a head
    # the loss never reaches keeps None and must not be decayed.
    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    torch.manual_seed(8)
    net_t = Net()
    net_t.head = torch.nn.Linear(DIM, 2)
    net_f = copy.deepcopy(net_t)
    opt_t = torch_cls(net_t.parameters(), **kw)
    opt_f = flat_cls(net_f.parameters(), max_norm=1.0, **kw)
    head = net_f.head.weight.detach().clone()
    for x, y in batches(6, seed=8):
        for net, opt in ((net_t, opt_t), (net_f, opt_f)):
            opt.zero_grad(set_to_none=False)
            backward(net, x, y, scale=5.0)
            if opt is opt_t:
                torch_clip(opt, 1.0)
            opt.step()
    assert_close(net_t, opt_t, net_f, opt_f, 6)
    assert torch.equal(net_f.head.weight, head) and net_f.head.weight not in opt_f.state


# With a GradScaler the replaced parameters leave torch.optim with no
# gradient at all, and torch.amp.GradScaler.step raises (no inf checks were
# recorded): gpuflat's optimizers raise there too (test below).
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("max_norm,scaler", [(None, None), (1.0, None)])
@pytest.mark.parametrize("name", LOOP_OPTIMIZERS)
def test_parameters_replaced_by_an_assigning_load_are_not_followed_as_in_torch(name, max_norm, scaler, dtype):
    # load_state_dict(assign=True) puts new Parameter objects in the model:
    # neither optimizer holds them, so neither trains them.
    def reload(net, opt, k, is_torch):
        if k == 4:
            net.load_state_dict(copy.deepcopy(net.state_dict()), assign=True)

    net_t, opt_t, net_f, opt_f = side_by_side(name, lambda n: n.parameters(), reload, max_norm=max_norm,
                                              scaler=scaler, dtype=dtype)
    for (name, a), b in zip(net_t.named_parameters(), net_f.parameters()):
        assert_tensors_close(a, b, name, LOOP_STEPS)
    for a, b in zip(opt_t.param_groups[0]["params"], opt_f.param_groups[0]["params"]):
        assert_tensors_close(a, b, "the optimizer's parameter", LOOP_STEPS)


@pytest.mark.parametrize("name", ["adamw", "lion"])
def test_betas_given_as_a_list_and_edited_in_place_are_followed(name):
    # The step keeps its hyperparameter rows while the groups' options
    # compare equal: a list edited in place must not compare equal to itself.
    def edit(net, opt, k, is_torch):
        if k == 0:
            opt.param_groups[0]["betas"] = list(opt.param_groups[0]["betas"])
        if k == 4:
            opt.param_groups[0]["betas"][0] = 0.5

    net_t, opt_t, net_f, opt_f = side_by_side(name, lambda n: n.parameters(), edit)
    assert_close(net_t, opt_t, net_f, opt_f, LOOP_STEPS)


@pytest.mark.parametrize("move", ["cloned", "transposed"])
@pytest.mark.parametrize("name", LOOP_OPTIMIZERS)
def test_parameters_moved_in_memory_mid_training_are_followed(name, move):
    # After warm steps (the step's rows kept for the next), each parameter's
    # memory is replaced under the optimizer (p.data = ...: new addresses,
    # and for "transposed" a layout that is no longer C-contiguous, which
    # autograd's gradients then take too): the next steps read it there.
    def moved(net, opt, k, is_torch):
        if k == 4:
            for p in net.parameters():
                p.data = p.data.clone() if move == "cloned" or p.dim() != 2 else p.data.t().contiguous().t()

    net_t, opt_t, net_f, opt_f = side_by_side(name, lambda n: n.parameters(), moved)
    assert_close(net_t, opt_t, net_f, opt_f, LOOP_STEPS)
    if move == "transposed":
        assert not next(p for p in net_f.parameters() if p.dim() == 2).grad.is_contiguous()


@pytest.mark.parametrize("name", LOOP_OPTIMIZERS)
def test_a_model_moved_to_float64_before_the_first_step(name):
    def to_double(net, opt, k, is_torch):
        if k == 0:
            net.double()

    torch_cls, flat_cls, kw = OPTIMIZERS[name]
    torch.manual_seed(9)
    net_t = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    net_f = copy.deepcopy(net_t)
    opt_t, opt_f = torch_cls(net_t.parameters(), **kw), flat_cls(net_f.parameters(), max_norm=1.0, **kw)
    for net in (net_t, net_f):
        net.double()
    g = torch.Generator().manual_seed(9)
    for _ in range(5):
        x = torch.randn(16, 4, generator=g, dtype=torch.float64)
        for net, opt in ((net_t, opt_t), (net_f, opt_f)):
            opt.zero_grad()
            (net(x) ** 2).mean().backward()
            if opt is opt_t:
                torch_clip(opt, 1.0)
            opt.step()
    for (name, a), b in zip(net_t.named_parameters(), net_f.parameters()):
        assert_tensors_close(a, b, name, 5)
    assert all(v.dtype == torch.float64 for s in opt_f.state.values() for k, v in s.items() if k != "step")


def test_a_group_of_frozen_parameters_placed_last():
    net_t, net_f = pair(10)
    make = lambda n: [{"params": [p for p in n.parameters() if p.requires_grad]},  # noqa: E731
                      {"params": list(n.frozen.parameters()), "lr": 0.5}]
    opt_t, opt_f = torch.optim.AdamW(make(net_t), lr=1e-2), gft.AdamW(make(net_f), lr=1e-2, max_norm=1.0)
    data = batches(5, seed=10)
    run_torch(net_t, opt_t, data, max_norm=1.0)
    run_flat(net_f, opt_f, data)
    assert_close(net_t, opt_t, net_f, opt_f, len(data))


def test_sgd_keeps_no_momentum_buffer_for_a_parameter_never_stepped():
    # PyTorch makes a momentum buffer at a parameter's first gradient: after a
    # save and a load, that parameter's first update is then the gradient itself.
    torch.manual_seed(13)
    net_t = Routed()
    net_f = copy.deepcopy(net_t)
    kw = dict(lr=0.1, momentum=0.9, dampening=0.5)
    opt_t, opt_f = torch.optim.SGD(net_t.parameters(), **kw), gft.SGD(net_f.parameters(), **kw)
    data = batches(4, seed=13)
    for step, (x, y) in enumerate(data):
        for net, opt in ((net_t, opt_t), (net_f, opt_f)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(net(x, step >= 2), y).backward()
            opt.step()
        if step == 0:
            saved = opt_f.state_dict()
            assert sorted(saved["state"]) == sorted(opt_t.state_dict()["state"])
            opt_f = gft.SGD(net_f.parameters(), **kw)
            opt_f.load_state_dict(saved)
    assert_close(net_t, opt_t, net_f, opt_f, len(data))


def test_a_gradscaler_with_no_gradients_raises_clearly():
    net = Net()
    opt = gft.AdamW(net.parameters())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # as a loop's scaler.scale(loss) would, before any backward
    with pytest.raises((RuntimeError, AssertionError), match="inf checks"):
        scaler.step(opt)


def test_gpuflat_gradscaler_skips_on_nonfinite_gradients_not_an_overflowing_norm():
    w = torch.nn.Parameter(torch.ones(4, dtype=torch.float64))
    opt, scaler = gft.SGD([w], lr=1e-200), gft.GradScaler("cpu", init_scale=1.0)
    w.grad = torch.full((4,), 1e200, dtype=torch.float64)  # finite, but its 2-norm's square overflows
    scaler.scale(torch.ones(()))  # as a loop's scaler.scale(loss) would
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 1.0  # not backed off
    assert torch.equal(w.detach(), torch.zeros(4, dtype=torch.float64))  # stepped: 1 - 1e-200 * 1e200


@pytest.mark.parametrize("scaler_name", list(SCALERS))
def test_sgd_momentum_made_at_a_skipped_first_step_stays_new_as_in_torch(scaler_name):
    # A GradScaler skips step 0 (an inf gradient). torch.optim.SGD never ran
    # it and has no momentum buffer: its first applied step takes the
    # gradient itself as the buffer, undamped. gpuflat's step ran, made the
    # buffers and skipped on the device: they stay new until a step applies,
    # through step 1 too for the one parameter without a gradient there.
    net_t, net_f = pair(16)
    kw = dict(lr=0.05, momentum=0.9, dampening=0.5, weight_decay=0.01)
    opt_t, opt_f = torch.optim.SGD(groups(net_t), **kw), gft.SGD(groups(net_f), **kw)
    scalers = {True: make_scaler(torch.amp.GradScaler), False: make_scaler(SCALERS[scaler_name])}
    for k, (x, y) in enumerate(batches(5, seed=16)):
        for net, opt, is_torch in ((net_t, opt_t, True), (net_f, opt_f, False)):
            opt.zero_grad()
            scaled_backward(net, scalers[is_torch], x, y)
            if k == 0:
                net.hidden.weight.grad[0, 0] = float("inf")
            if k == 1:
                net.hidden.bias.grad = None
            scalers[is_torch].step(opt)
            scalers[is_torch].update()
        if k == 0:
            assert not opt_t.state and all(torch.count_nonzero(s["momentum_buffer"]) == 0
                                           for s in opt_f.state.values())
    assert scalers[True].get_scale() == scalers[False].get_scale()
    assert_close(net_t, opt_t, net_f, opt_f, 5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_the_host_library_and_the_kernels_give_the_same_bits_on_every_dtype(name, dtype):
    # The host library and the CUDA kernels on the emulated device compute
    # each element by the same operations in the same precision (float for
    # 16-bit parameters, rounded once on the store), after norms of the same
    # bits; the NumPy reference sums its norm in another order, so its clip
    # factor, and its parameters, may differ in the last place.
    _, flat_cls, kw = OPTIMIZERS[name]
    results = {}
    for backend in ("host", "emulated", "numpy"):
        g = torch.Generator().manual_seed(14)
        params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in (5000, 3, 0, 70)]
        opt = flat_cls(params, max_norm=1.0, **kw)
        with tensor_table.serve_with(get_backend(backend)):
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g).to(dtype)
                opt.step()
        results[backend] = [p.detach().clone() for p in params]
    bits = (lambda t: t.view(torch.int16)) if dtype != torch.float64 else (lambda t: t.view(torch.int64))
    for a, b, c in zip(results["host"], results["emulated"], results["numpy"]):
        assert torch.equal(bits(a), bits(b))
        torch.testing.assert_close(c, a, rtol=1e-12 if dtype == torch.float64 else 1e-2, atol=0)


def test_a_tensor_lr_the_kernels_cannot_read_is_read_on_the_host():
    # A float16 lr is no type the kernels read through its address (nor is a
    # GPU lr beside CPU parameters): its value goes into the group's row.
    net_t, net_f = pair(15)
    lr = torch.tensor(0.05, dtype=torch.float16)
    opt_t = torch.optim.SGD(net_t.parameters(), lr=float(lr), momentum=0.5)
    opt_f = gft.SGD(net_f.parameters(), lr=lr, momentum=0.5)
    data = batches(4, seed=15)
    run_torch(net_t, opt_t, data)
    run_flat(net_f, opt_f, data)
    assert_close(net_t, opt_t, net_f, opt_f, len(data))


# The module switches of one warm AdamW(max_norm=1.0) step on a 3-layer MLP
# (a Python call event in a gpuflat module other than the previous call's):
# how many modules a step's work passes through, and how often it crosses
# between them. The seam's aim is at most 25; this is where the step stands,
# so that a change adding hops fails here.
STEP_SWITCHES = 25


def test_a_warm_step_passes_few_module_boundaries():
    import sys

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Tanh(),
                              torch.nn.Linear(16, 4))
    opt = gft.AdamW(net.parameters(), max_norm=1.0)
    for _ in range(4):  # warm: the state made, the plans and tables built
        net.zero_grad()
        net(torch.ones(2, 8)).sum().backward()
        opt.step()
    net.zero_grad()
    net(torch.ones(2, 8)).sum().backward()
    modules: list[str] = []

    def trace(frame, event, arg):
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("gpuflat") and (not modules or modules[-1] != name):
            modules.append(name)

    sys.setprofile(trace)
    try:
        opt.step()
    finally:
        sys.setprofile(None)
    assert modules[0] == "gpuflat._src.torch_optim"
    assert len(modules) <= STEP_SWITCHES, modules
