"""gpuflat.torch's optimizers with ``stats=True`` (gpuflat._src.step_stats):
each parameter's gradient norm, update norm and update/weight ratio, from
the step's own passes, against the same figures computed in float64 from
the gradients and the parameters before and after the step."""
import re

import pytest

torch = pytest.importorskip("torch")

import gpuflat.torch as gft  # noqa: E402
from gpuflat._src import tensor_table  # noqa: E402
from gpuflat._src.backends import get_backend  # noqa: E402

BACKENDS = ["numpy", "host", "emulated"]


def model(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).to(dtype)


def backward(net, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 6, generator=g).to(net[0].weight.dtype)
    net.zero_grad()
    (net(x).float().square().mean() * scale).backward()


def expected(net, before, grads_scale=1.0):
    """Per parameter name: (gradient norm, update norm, update / new value) in float64."""
    out = {}
    for name, p in net.named_parameters():
        update = p.detach().double() - before[name]
        out[name] = (float(p.grad.double().norm()) / grads_scale, float(update.norm()),
                     float(update.norm() / p.detach().double().norm()))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cls,kw", [(gft.AdamW, dict(lr=1e-2, max_norm=0.5)), (gft.SGD, dict(lr=0.1, momentum=0.9)),
                                    (gft.Lion, dict(lr=1e-3, weight_decay=0.1))], ids=["adamw", "sgd", "lion"])
def test_the_figures_are_the_steps(cls, kw, backend):
    net = model()
    opt = cls(net.named_parameters(), stats=True, **kw)
    with tensor_table.serve_with(get_backend(backend)):
        for seed in range(3):
            backward(net, seed)
            before = {n: p.detach().double().clone() for n, p in net.named_parameters()}
            opt.step()
            want = expected(net, before)
            got = gft.read_stats(opt)
            assert set(got) == {"grad_norm"} | {f"{n}/{c}" for n in want for c in
                                                ("grad_norm", "update_norm", "update_ratio")}
            total = float(torch.cat([p.grad.double().reshape(-1) for p in net.parameters()]).norm())
            assert got["grad_norm"] == pytest.approx(total, rel=1e-12)
            for name, (grad, update, ratio) in want.items():
                assert got[f"{name}/grad_norm"] == pytest.approx(grad, rel=1e-12)
                # The kernels' update is the new value less the old in float32, each rounded once.
                assert got[f"{name}/update_norm"] == pytest.approx(update, rel=1e-5)
                assert got[f"{name}/update_ratio"] == pytest.approx(ratio, rel=1e-5)
                assert float(opt.stats[name]["update_norm"]) == got[f"{name}/update_norm"]


def test_a_repeated_step_rewrites_the_same_tensors():
    # No allocation in a repeated step: the figures are views of buffers made
    # at the first step, rewritten in place by the next.
    net = model()
    opt = gft.AdamW(net.parameters(), stats=True)
    backward(net, 0)
    opt.step()
    views = {k: dict(v) for k, v in opt.stats.items()}
    first = {k: float(v["update_norm"]) for k, v in views.items()}
    backward(net, 1)
    opt.step()
    assert all(opt.stats[k][c] is views[k][c] for k in views for c in views[k])
    assert any(float(views[k]["update_norm"]) != first[k] for k in views)
    assert sorted(opt.stats) == [0, 1, 2, 3]  # indices across param_groups without names


def test_a_scaled_steps_gradient_norms_are_unscaled():
    net, twin = model(), model()
    opt, twin_opt = gft.AdamW(net.parameters(), stats=True), gft.AdamW(twin.parameters(), stats=True)
    scaler = gft.GradScaler("cpu", init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 6, generator=g)
    scaler.scale(net(x).square().mean()).backward()
    scaler.step(opt)
    scaler.update()
    twin(x).square().mean().backward()
    twin_opt.step()
    ours, theirs = gft.read_stats(opt), gft.read_stats(twin_opt)
    for key in theirs:
        assert ours[key] == pytest.approx(theirs[key], rel=1e-6), key


def test_a_lost_bfloat16_update_still_shows():
    # Plain bfloat16 rounds these updates away; the figures are the update
    # the rule computed, before its rounding into the parameter.
    w = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = gft.SGD([w], lr=1e-4, stats=True)
    w.grad = torch.ones_like(w)
    opt.step()
    assert torch.equal(w.detach(), torch.ones_like(w))
    assert float(opt.stats[0]["update_norm"]) == pytest.approx(1e-4 * 8, rel=1e-3)


def test_parameters_of_two_dtypes_keep_their_own_keys():
    # Two tables (one per dtype): each parameter's row found again by its key.
    a = torch.nn.Parameter(torch.ones(3))
    b = torch.nn.Parameter(torch.ones(5, dtype=torch.float64))
    c = torch.nn.Parameter(torch.ones(2))
    opt = gft.SGD([a, b, c], lr=1.0, stats=True)
    for p, g in ((a, 1.0), (b, 2.0), (c, 3.0)):
        p.grad = torch.full_like(p, g)
    opt.step()
    figures = gft.read_stats(opt)
    assert figures["0/grad_norm"] == pytest.approx(3 ** 0.5)
    assert figures["1/grad_norm"] == pytest.approx(2 * 5 ** 0.5)
    assert figures["2/grad_norm"] == pytest.approx(3 * 2 ** 0.5)
    assert figures["2/update_norm"] == pytest.approx(3 * 2 ** 0.5)


def test_a_compiled_step_with_stats_runs_its_update_between_graphs():
    # The figures come from the eager step's buffers: compiled, the step
    # breaks the graph there and gives the eager step's bits and figures.
    net, twin = model(), model()
    opt, twin_opt = gft.AdamW(net.parameters(), stats=True), gft.AdamW(twin.parameters(), stats=True)
    step = torch.compile(opt.step, backend="eager")
    for seed in range(2):
        backward(net, seed)
        backward(twin, seed)
        step()
        twin_opt.step()
    assert all(torch.equal(p, q) for p, q in zip(net.parameters(), twin.parameters()))
    assert gft.read_stats(opt) == gft.read_stats(twin_opt)


def test_figures_need_stats():
    with pytest.raises(ValueError, match="expected an optimizer made with stats=True"):
        gft.read_stats(gft.AdamW(model().parameters()))


def test_a_parameter_whose_dtype_changes_takes_its_figures_along():
    # model.double() regroups the step's tables: the figures follow each parameter.
    a, b = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(5, dtype=torch.float64))
    opt = gft.SGD([a, b], lr=1.0, stats=True)
    for step in range(2):
        for p, g in ((a, 1.0), (b, 2.0)):
            p.grad = torch.full_like(p, g)
        opt.step()
        figures = gft.read_stats(opt)
        assert figures["0/grad_norm"] == pytest.approx(3 ** 0.5) and figures["1/grad_norm"] == pytest.approx(2 * 5 ** 0.5)
        a.data = a.data.double()


@pytest.mark.parametrize("stats", ["globl", "local", 1, None, "Global"])
def test_a_bad_stats_option_is_refused_before_anything_changes(stats):
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    with pytest.raises(ValueError, match=re.escape(f"stats: expected False, True or 'global', got {stats!r}")):
        gft.AdamW(net.parameters(), stats=stats)
    assert all(torch.equal(p, b) for p, b in zip(net.parameters(), before))


@pytest.mark.parametrize("cls", [gft.AdamW, gft.SGD, gft.Lion])
def test_global_figures_of_plain_tensors_are_their_own(cls):
    # A plain tensor is whole on every rank: "global" asks for no collective
    # and gives stats=True's figures.
    net, twin = model(), model()
    opt, twin_opt = cls(net.named_parameters(), stats="global"), cls(twin.named_parameters(), stats=True)
    for seed in range(2):
        backward(net, seed)
        backward(twin, seed)
        opt.step()
        twin_opt.step()
    assert gft.read_stats(opt) == gft.read_stats(twin_opt)
