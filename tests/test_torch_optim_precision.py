"""The precision options of gpuflat.torch's optimizers (``master_weights``,
``kahan_sum``, a dtype per moment) on 16-bit parameters, on the CPU, on
every backend that steps PyTorch's tensors.

The references are independent of gpuflat's update: ``torch.optim`` (and
the plain PyTorch Lion of tests/torch_lion.py) run on a float32 copy of the
16-bit model, fed the 16-bit gradients. A float32 master copy updated in
float32 must follow that run as closely as two float32 computations of one
formula can; the 16-bit parameter must be the master rounded once.
"""
import copy

import pytest

torch = pytest.importorskip("torch")

import gpuflat.torch as gft  # noqa: E402
from gpuflat._src import param_rows, tensor_table  # noqa: E402
from gpuflat._src.backends import get_backend  # noqa: E402
from torch_lion import Lion as TorchLion  # noqa: E402

BACKENDS = ["numpy", "host", "emulated"]
# (torch's optimizer, gpuflat's, their options, the option naming each moment's dtype).
RULES = {
    "adamw": (torch.optim.AdamW, gft.AdamW, dict(lr=1e-3, weight_decay=0.1), ("exp_avg_dtype", "exp_avg_sq_dtype")),
    "sgd": (torch.optim.SGD, gft.SGD, dict(lr=1e-2, momentum=0.9, weight_decay=0.1), ("momentum_buffer_dtype",)),
    "lion": (TorchLion, gft.Lion, dict(lr=1e-4, weight_decay=0.1), ("exp_avg_dtype",)),
}
STEPS = 12


def float32_moments(name):
    return dict.fromkeys(RULES[name][3], torch.float32)


def model(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def gradients(net, seed, scaler=None):
    """Each parameter's gradient of one batch's loss, in the parameters' dtype."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 6, generator=g).to(net[0].weight.dtype), torch.randint(0, 3, (16,), generator=g)
    net.zero_grad()
    loss = torch.nn.functional.cross_entropy(net(x).float(), y)
    (loss if scaler is None else scaler.scale(loss)).backward()
    return [p.grad.clone() for p in net.parameters()]


def train(net, opt, steps=STEPS, reference=None, ref_opt=None):
    """``steps`` steps of ``opt``; ``reference`` (a float32 copy) stepped by
    ``ref_opt`` on the same 16-bit gradients."""
    for step in range(steps):
        grads = gradients(net, step)
        opt.step()
        if reference is not None:
            for p, g in zip(reference.parameters(), grads):
                p.grad = g.float()
            ref_opt.step()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_master_weights_follow_torch_in_float32(name, backend):
    torch_cls, flat_cls, kw, _ = RULES[name]
    net = model()
    reference = copy.deepcopy(net).float()
    opt = flat_cls(net.parameters(), master_weights=True, **float32_moments(name), **kw)
    ref_opt = torch_cls(reference.parameters(), foreach=True, **kw)
    with tensor_table.serve_with(get_backend(backend)):
        train(net, opt, reference=reference, ref_opt=ref_opt)
    for p, r in zip(net.parameters(), reference.parameters()):
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32
        # Two float32 computations of one formula, apart by a few roundings per step.
        torch.testing.assert_close(master, r.detach(), rtol=2e-6 * STEPS, atol=1e-7 * STEPS)
        assert torch.equal(p.detach(), master.to(torch.bfloat16))  # the master, rounded once
        for moment in RULES[name][3]:
            assert opt.state[p][moment.removesuffix("_dtype")].dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_updates_below_half_an_ulp_are_kept_by_master_weights_and_kahan_sums(name, backend):
    # A weight near 1.0 in bfloat16 has half an ulp of 0.0039: every update
    # smaller is lost when the parameter itself is the only copy.
    # The moments are float32 here, as the reference's: what differs is how
    # the parameter is held.
    torch_cls, flat_cls, kw, _ = RULES[name]
    kw = dict(kw, lr=1e-4, weight_decay=0.0)
    moved = {}
    for option in ({}, {"master_weights": True}, {"kahan_sum": True}):
        w = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16))
        reference = torch.nn.Parameter(torch.ones(256))
        opt, ref_opt = flat_cls([w], **option, **float32_moments(name), **kw), torch_cls([reference], **kw)
        g = torch.Generator().manual_seed(1)
        with tensor_table.serve_with(get_backend(backend)):
            for _ in range(40):
                w.grad = torch.randn(256, generator=g).to(torch.bfloat16)
                reference.grad = w.grad.float()
                opt.step()
                ref_opt.step()
        held = w.detach().double()
        if option:
            held = held + opt.state[w]["kahan_comp"].double() if "kahan_sum" in option \
                else opt.state[w]["master_param"].double()
        moved[str(option)] = (float((w.detach().double() - 1).abs().mean()),
                              float((held - reference.detach().double()).abs().max()))
    plain, master, kahan = moved.values()
    assert plain[0] == 0.0  # every update lost: the error is the whole way travelled
    travelled = float((reference.detach().double() - 1).abs().mean())
    assert travelled > 1e-4 and plain[1] > travelled, moved
    # The float32 master is the float32 run; the compensation, itself
    # bfloat16, holds what the parameter lost to 8 more bits.
    assert master[1] < 1e-3 * travelled and kahan[1] < plain[1] / 20, moved


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_moments_of_bfloat16_parameters_are_torchs_float32_moments(backend):
    # AdamW's moments depend on the gradients alone: fed the same ones, they
    # are those of a float32 run.
    torch_cls, flat_cls, kw, _ = RULES["adamw"]
    net = model()
    reference = copy.deepcopy(net).float()
    opt = flat_cls(net.parameters(), **float32_moments("adamw"), **kw)
    ref_opt = torch_cls(reference.parameters(), foreach=True, **kw)
    with tensor_table.serve_with(get_backend(backend)):
        train(net, opt, reference=reference, ref_opt=ref_opt)
    for p, r in zip(net.parameters(), reference.parameters()):
        assert "master_param" not in opt.state[p] and p.dtype == torch.bfloat16
        for moment in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][moment], ref_opt.state[r][moment], rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_state_dicts_keep_float32_state_and_say_which_options_made_it(name):
    # torch.optim.Optimizer.load_state_dict casts floating state to its
    # parameter's dtype: a float32 master copy would come back bfloat16.
    _, flat_cls, kw, _ = RULES[name]
    options = dict(master_weights=True, **float32_moments(name), **kw)
    net = model()
    opt = flat_cls(net.parameters(), **options)
    train(net, opt, steps=3)
    saved = copy.deepcopy(opt.state_dict())
    assert saved["param_groups"][0]["master_weights"] is True
    net_b = copy.deepcopy(net)
    opt_b = flat_cls(net_b.parameters(), **options)
    opt_b.load_state_dict(saved)
    for p, q in zip(net.parameters(), net_b.parameters()):
        for key, value in opt.state[p].items():
            assert opt_b.state[q][key].dtype == value.dtype and torch.equal(opt_b.state[q][key], value), key
    train(net, opt, steps=3)
    train(net_b, opt_b, steps=3)
    for p, q in zip(net.parameters(), net_b.parameters()):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["master_param"], opt_b.state[q]["master_param"])


def test_a_torch_state_dict_loads_into_master_weights():
    # A torch.optim checkpoint holds no precision options: the groups take
    # the optimizer's, and the next step makes what they keep.
    net = model()
    ref_opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    train(net, ref_opt, steps=2)
    opt = gft.AdamW(net.parameters(), lr=1e-3, master_weights=True, exp_avg_dtype=torch.float32)
    opt.load_state_dict(ref_opt.state_dict())
    assert opt.param_groups[0]["master_weights"] is True
    assert opt.param_groups[0]["exp_avg_dtype"] is torch.float32
    before = {p: opt.state[p]["exp_avg"].clone() for p in net.parameters()}
    train(net, opt, steps=1)
    for p in net.parameters():
        state = opt.state[p]
        assert state["exp_avg"].dtype == torch.float32 and state["exp_avg_sq"].dtype == torch.bfloat16
        assert state["master_param"].dtype == torch.float32 and float(state["step"]) == 3
        assert not torch.equal(state["exp_avg"], before[p].float())


def test_only_16_bit_parameters_keep_something_beside_them():
    # A float32 parameter is its own master: a group's master weights leave it plain.
    params = [torch.nn.Parameter(torch.ones(4, dtype=dtype)) for dtype in (torch.bfloat16, torch.float32)]
    opt = gft.AdamW(params, master_weights=True)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert "master_param" in opt.state[params[0]] and "master_param" not in opt.state[params[1]]
    assert torch.equal(params[0].float(), params[1].detach().to(torch.bfloat16).float())


def test_a_group_switched_to_master_weights_or_kahan_sums_mid_training():
    net = model()
    opt = gft.AdamW(net.parameters(), lr=1e-3)
    train(net, opt, steps=2)
    weight = net[0].weight
    opt.param_groups[0]["master_weights"] = True
    train(net, opt, steps=1)
    master = opt.state[weight]["master_param"]
    assert torch.equal(master.to(torch.bfloat16), weight.detach())
    opt.param_groups[0]["master_weights"] = False
    opt.param_groups[0]["kahan_sum"] = True
    before = weight.detach().clone()
    train(net, opt, steps=2)
    assert "kahan_comp" in opt.state[weight] and not torch.equal(weight, before)
    assert torch.equal(opt.state[weight]["master_param"], master)  # kept, no longer read


@pytest.mark.parametrize("scaler_cls", [gft.GradScaler, torch.amp.GradScaler], ids=["gpuflat", "stock"])
def test_a_skipped_step_leaves_the_master_copy(scaler_cls):
    net = model()
    opt = gft.AdamW(net.parameters(), lr=1e-2, master_weights=True, max_norm=1.0)
    scaler = scaler_cls("cpu", init_scale=2.0 ** 8)
    train(net, opt, steps=1)
    master = {p: opt.state[p]["master_param"].clone() for p in net.parameters()}
    gradients(net, 5, scaler)
    net[0].bias.grad[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    for p in net.parameters():
        assert torch.equal(opt.state[p]["master_param"], master[p])
        assert torch.equal(p.detach(), master[p].to(torch.bfloat16))
    assert scaler.get_scale() == 2.0 ** 7
    # The next, finite, step unscales inside the update, through the master copy.
    gradients(net, 6, scaler)
    scaler.step(opt)
    scaler.update()
    assert all(not torch.equal(opt.state[p]["master_param"], master[p]) for p in net.parameters())


def test_precision_options_are_checked_before_anything_is_made():
    net = model()
    with pytest.raises(ValueError, match=r"parameter group 0: expected at most one of master_weights, kahan_sum, "
                                         r"bf16_stochastic_round, got master_weights and kahan_sum"):
        gft.AdamW(net.parameters(), master_weights=True, kahan_sum=True)
    with pytest.raises(TypeError, match=r"parameter group 0: expected exp_avg_sq_dtype None or .*got torch.int8"):
        gft.AdamW(net.parameters(), exp_avg_sq_dtype=torch.int8)
    opt = gft.SGD(net.parameters(), lr=0.1, momentum=0.9)
    train(net, opt, steps=1)
    opt.param_groups[0]["kahan_sum"] = opt.param_groups[0]["master_weights"] = True
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=r"parameter group 0: expected at most one of"):
        train(net, opt, steps=1)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert all("master_param" not in s and "kahan_comp" not in s for s in opt.state.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_keeps_updates_in_expectation(backend):
    # SGD without momentum moves every weight by lr * 1 = 1e-4 a step, a
    # fortieth of the bfloat16 ulp at 1.0: rounded to nearest, nothing moves;
    # rounded at random, each weight's expected value is the exact one, and
    # the mean of 4096 weights lies within a few standard deviations
    # (0.0039 / 2 * sqrt(STEPS) / sqrt(4096) about 1e-4) of it.
    moved = {}
    for option in ({}, {"bf16_stochastic_round": True}):
        w = torch.nn.Parameter(torch.ones(4096, dtype=torch.bfloat16))
        opt = gft.SGD([w], lr=1e-4, **option)
        with tensor_table.serve_with(get_backend(backend)):
            for _ in range(50):
                w.grad = torch.ones_like(w)
                opt.step()
        moved[str(option)] = w.detach().double()
        if option:
            # Its draws are keyed by a count, which SGD without momentum keeps for them.
            assert float(opt.state[w]["step"]) == 50
    plain, drawn = moved.values()
    assert torch.equal(plain, torch.ones_like(plain))
    assert abs(float(drawn.mean()) - (1 - 50e-4)) < 1e-3 and len(set(drawn.tolist())) > 1


def test_stochastic_rounding_draws_anew_each_step_the_same_for_a_seed():
    def run(seed, steps):
        w = torch.nn.Parameter(torch.ones(512, dtype=torch.bfloat16))
        opt = gft.AdamW([w], lr=1e-3, bf16_stochastic_round=True, rounding_seed=seed)
        g = torch.Generator().manual_seed(0)
        for _ in range(steps):
            w.grad = torch.randn(512, generator=g).to(torch.bfloat16)
            opt.step()
        return w.detach().clone()

    assert torch.equal(run(3, 4), run(3, 4))
    assert not torch.equal(run(3, 4), run(4, 4))
    # One step's draws do not repeat the last's: the same gradient twice
    # from the same value would move the same way.
    w = torch.nn.Parameter(torch.ones(512, dtype=torch.bfloat16))
    opt = gft.SGD([w], lr=1e-3, bf16_stochastic_round=True)
    ups = []
    for _ in range(2):
        w.data.fill_(1.0)
        w.grad = torch.full_like(w, -1.0)  # 1 + 1e-3: a quarter of the ulp above 1.0 (0.0078)
        opt.step()
        ups.append(w.detach() > 1)
    assert not torch.equal(ups[0], ups[1]) and 0.05 < float(ups[0].float().mean()) < 0.3


def test_stochastic_rounding_leaves_other_dtypes_rounded_to_nearest():
    params = [torch.nn.Parameter(torch.ones(64, dtype=dtype)) for dtype in (torch.float16, torch.bfloat16)]
    opt = gft.SGD(params, lr=1e-4, bf16_stochastic_round=True)
    for _ in range(20):
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
    # Half of float16's ulp below 1.0 (0.00049) is more than each step's 1e-4: lost, rounded to nearest.
    assert torch.equal(params[0].detach(), torch.ones(64, dtype=torch.float16))
    assert len(set(params[1].detach().tolist())) > 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_stochastic_rounding_has_the_mean_and_variance_of_its_distances(backend):
    # 65,536 weights at 1.0, each moved by 3/8 of the ulp above 1.0 (2**-7):
    # each rounds up with probability 3/8, so the fraction rounded up lies
    # within 4 standard deviations (4 * sqrt(3/8 * 5/8 / n) = 0.0076) of 3/8,
    # and the values' variance is ulp**2 * 3/8 * 5/8 (to 5%, for n draws).
    n, ulp, p = 1 << 16, 2.0 ** -7, 3 / 8
    w = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    opt = gft.SGD([w], lr=1.0, bf16_stochastic_round=True)
    w.grad = torch.full((n,), -p * ulp, dtype=torch.bfloat16)  # exact in bfloat16: -3 * 2**-10
    with tensor_table.serve_with(get_backend(backend)):
        opt.step()
    values = w.detach().double()
    assert set(values.unique().tolist()) == {1.0, 1.0 + ulp}
    assert abs(float((values > 1).double().mean()) - p) < 4 * (p * (1 - p) / n) ** 0.5
    assert float(values.var()) == pytest.approx(ulp ** 2 * p * (1 - p), rel=0.05)
    assert float(values.mean()) == pytest.approx(1 + p * ulp, abs=4 * ulp * (p * (1 - p) / n) ** 0.5)


def test_a_seed_changed_between_steps_is_followed():
    # The keys of the draws come from the group's rounding_seed, read again when it changes.
    def run(seeds):
        w = torch.nn.Parameter(torch.ones(512, dtype=torch.bfloat16))
        opt = gft.SGD([w], lr=1e-3, bf16_stochastic_round=True, rounding_seed=seeds[0])
        for seed in seeds:
            opt.param_groups[0]["rounding_seed"] = seed
            w.grad = torch.full_like(w, -1.0)
            opt.step()
        return w.detach().clone()

    assert torch.equal(run([1, 2]), run([1, 2]))
    assert not torch.equal(run([1, 1]), run([1, 2]))


@pytest.mark.parametrize("move", ["within its group", "into the next group"])
def test_the_keys_of_the_draws_follow_a_parameter_moved_in_param_groups(move):
    # A parameter's key is its group's seed and its place in the group, read
    # where it is now: a step after the move draws as a step of an optimizer
    # that finds every parameter anew. The parameter moved has no gradient,
    # so its own state is never read again at the move.
    def run(forget):
        g = torch.Generator().manual_seed(3)
        ws = [torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16)) for _ in range(4)]
        opt = gft.SGD([{"params": ws[:2]}, {"params": ws[2:]}], lr=1e-3, bf16_stochastic_round=True)
        for k in range(4):
            if k == 2:
                first, second = opt.param_groups[0]["params"], opt.param_groups[1]["params"]
                if move == "within its group":
                    first.reverse()
                else:
                    second.insert(0, first.pop())
            for j, w in enumerate(ws):
                w.grad = None if k >= 2 and j == 1 else torch.randn(256, generator=g).to(torch.bfloat16)
            if forget:
                param_rows.forget(opt)
            opt.step()
        return [w.detach().clone() for w in ws]

    for kept, anew in zip(run(False), run(True)):
        assert torch.equal(kept, anew)


def test_a_state_dict_with_master_copies_resumes_in_torch_optim():
    # torch.optim keeps the state it does not know (master_param) and trains on.
    net = model()
    opt = gft.AdamW(net.parameters(), lr=1e-3, master_weights=True, exp_avg_dtype=torch.float32)
    train(net, opt, steps=2)
    ref_opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
    ref_opt.load_state_dict(opt.state_dict())
    before = [p.detach().clone() for p in net.parameters()]
    train(net, ref_opt, steps=1)
    assert all(not torch.equal(p, b) for p, b in zip(net.parameters(), before))
    assert all(float(ref_opt.state[p]["step"]) == 3 for p in net.parameters())
