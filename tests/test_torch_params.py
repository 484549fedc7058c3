"""gpuflat.torch_params: a resident PyTorch model inside a real training loop.

Each test runs the same loop twice, once on a resident model and once in
plain PyTorch, and compares: a resident model either gives PyTorch's answer
or raises StaleResidentError naming the parameter.
"""
from __future__ import annotations

import copy
import math
import timeit

import pytest

import gpuflat as gf

torch = pytest.importorskip("torch")


class Net(torch.nn.Module):
    def __init__(self, tied=True):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        self.norm = torch.nn.LayerNorm(8)
        self.out = torch.nn.Linear(8, 11, bias=False)
        if tied:
            self.out.weight = self.embed.weight
        self.body[0].bias.requires_grad_(False)  # frozen

    def forward(self, x):
        return self.out(self.norm(self.body(self.embed(x))))


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _batches(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 11, (6,), generator=gen), torch.randint(0, 11, (6,), generator=gen))
            for _ in range(n)]


def _backward(net, x, y):
    torch.nn.functional.cross_entropy(net(x), y).backward()


def _trainable(net):
    return [p for p in net.parameters() if p.requires_grad]


def _twins(tied=True):
    torch.manual_seed(0)
    net = Net(tied)
    return net, copy.deepcopy(net)


def _norm(params):
    with torch.no_grad():
        return float(torch.linalg.vector_norm(torch.cat([p.reshape(-1) for p in params]).double()))


def _assert_same_model(a, b):
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=name)


def test_a_nan_step_then_adamw_matches_pytorch():
    net, plain = _twins()
    r = gf.resident(net)
    opt, opt_plain = torch.optim.AdamW(_trainable(net), lr=1e-2), torch.optim.AdamW(_trainable(plain), lr=1e-2)
    for step, (x, y) in enumerate(_batches(5)):
        for model in (net, plain):
            _backward(model, x, y)
            if step == 1:  # a NaN step: both skip the update, as a GradScaler would
                model.body[2].weight.grad[0, 0] = math.nan
        got = r.clip_grad_norm_(1.0)
        want = torch.nn.utils.clip_grad_norm_(_trainable(plain), 1.0)
        if step == 1:
            assert math.isnan(float(got)) and math.isnan(float(want))
        else:
            assert float(got) == pytest.approx(float(want), rel=1e-5)
            opt.step()
            opt_plain.step()
        opt.zero_grad()  # set_to_none=True
        opt_plain.zero_grad()
    _assert_same_model(net, plain)


def test_a_grad_scaler_skipped_step_matches_pytorch():
    net, plain = _twins()
    r = gf.resident(net)
    opt, opt_plain = torch.optim.SGD(_trainable(net), lr=0.1), torch.optim.SGD(_trainable(plain), lr=0.1)
    scaler, scaler_plain = torch.amp.GradScaler("cpu", init_scale=2.0**16), torch.amp.GradScaler("cpu", init_scale=2.0**16)
    for step, (x, y) in enumerate(_batches(4)):
        for model, s, o in ((net, scaler, opt), (plain, scaler_plain, opt_plain)):
            s.scale(torch.nn.functional.cross_entropy(model(x), y)).backward()
            if step == 2:
                model.body[2].weight.grad[0, 0] = math.inf  # the scaler skips this step
            s.unscale_(o)
        got = r.clip_grad_norm_(1.0)
        want = torch.nn.utils.clip_grad_norm_(_trainable(plain), 1.0)
        assert float(got) == pytest.approx(float(want), rel=1e-5) or step == 2
        for s, o in ((scaler, opt), (scaler_plain, opt_plain)):
            s.step(o)
            s.update()
            o.zero_grad()
        assert scaler.get_scale() == scaler_plain.get_scale()
    _assert_same_model(net, plain)
    assert math.isfinite(float(r.grad_norm()))


def test_gradients_held_before_and_buffers_read_after_set_to_none():
    net, _ = _twins()
    x, y = _batches(1)[0]
    _backward(net, x, y)
    held = {n: p.grad.clone() for n, p in net.named_parameters() if p.grad is not None}
    r = gf.resident(net)
    for n, g in r.grads.items():  # gradients the model had are kept, not zeroed
        torch.testing.assert_close(g, held[n], rtol=0, atol=0)
    net.zero_grad()  # set_to_none
    _backward(net, x, y)
    fresh = torch.cat([p.grad.reshape(-1) for p in _trainable(net)])
    (buffer,) = r.grad_buffers  # read by hand: the new gradients are in it already
    assert torch.equal(torch.sort(buffer[buffer != 0]).values, torch.sort(fresh[fresh != 0]).values)


CHANGES = {"to(torch.float64)": lambda net: net.to(torch.float64), "double()": lambda net: net.double(),
           "to(torch.bfloat16)": lambda net: net.to(torch.bfloat16)}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_dtype_change_raises_naming_the_parameter(change):
    net, _ = _twins()
    r = gf.resident(net)
    CHANGES[change](net)
    for call in (r.grad_norm, lambda: r.clip_grad_norm_(1.0), r.param_norm, r.zero_grad, lambda: r.grad_buffers):
        with pytest.raises(gf.StaleResidentError, match=r"parameter 'embed.weight' now has dtype torch\.\w+ "
                                                        r"where the resident model holds torch.float32"):
            call()


def test_load_state_dict_assign_is_followed():
    # Untied: assign=True gives each name a Parameter of its own, which
    # would break a tie in plain PyTorch too.
    net, plain = _twins(tied=False)
    r = gf.resident(net)
    other = Net(tied=False)
    net.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    plain.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    assert float(r.param_norm()) == pytest.approx(_norm(_trainable(plain)), rel=1e-12)
    opt, opt_plain = torch.optim.SGD(_trainable(net), lr=0.1), torch.optim.SGD(_trainable(plain), lr=0.1)
    for x, y in _batches(3):
        for model in (net, plain):
            _backward(model, x, y)
        assert float(r.clip_grad_norm_(0.5)) == pytest.approx(
            float(torch.nn.utils.clip_grad_norm_(_trainable(plain), 0.5)), rel=1e-5)
        opt.step(), opt_plain.step(), opt.zero_grad(), opt_plain.zero_grad()
    _assert_same_model(net, plain)
    buffer = r.param_buffers[0]
    assert all(buffer.data_ptr() <= p.data_ptr() < buffer.data_ptr() + buffer.nbytes for p in _trainable(net))


def test_storage_moved_in_place_is_copied_in():
    net, _ = _twins()
    r = gf.resident(net)
    net.norm.weight.data = torch.full((8,), 2.0)
    assert float(r.param_norm()) == pytest.approx(_norm(_trainable(net)), rel=1e-12)
    buffer = r.param_buffers[0]
    assert buffer.data_ptr() <= net.norm.weight.data_ptr() < buffer.data_ptr() + buffer.nbytes


def test_an_unfrozen_parameter_raises_once_it_has_a_gradient():
    net, _ = _twins()
    r = gf.resident(net)
    net.body[0].bias.requires_grad_(True)
    r.grad_norm()  # no gradient yet: the norm is still PyTorch's
    _backward(net, *_batches(1)[0])
    with pytest.raises(gf.StaleResidentError, match=r"parameter 'body.0.bias' is not part of the resident model"):
        r.clip_grad_norm_(1.0)


def test_an_added_parameter_raises_once_it_has_a_gradient():
    net, _ = _twins()
    r = gf.resident(net)
    net.extra = torch.nn.Parameter(torch.ones(3))
    net.extra.grad = torch.ones(3)
    with pytest.raises(gf.StaleResidentError, match=r"parameter 'extra'"):
        r.grad_norm()


def test_a_replaced_parameter_of_another_shape_raises():
    net, _ = _twins()
    r = gf.resident(net)
    net.norm.weight = torch.nn.Parameter(torch.ones(9))
    with pytest.raises(gf.StaleResidentError, match=r"'norm.weight' was replaced by one with shape \(9,\)"):
        r.grad_norm()


def test_torch_compile_trains_on_the_resident_buffers():
    net, plain = _twins()
    r = gf.resident(net)
    compiled = torch.compile(net, backend="eager")
    opt, opt_plain = torch.optim.SGD(_trainable(net), lr=0.1), torch.optim.SGD(_trainable(plain), lr=0.1)
    for x, y in _batches(3):
        _backward(compiled, x, y)
        _backward(plain, x, y)
        assert float(r.clip_grad_norm_(0.5)) == pytest.approx(
            float(torch.nn.utils.clip_grad_norm_(_trainable(plain), 0.5)), rel=1e-5)
        opt.step(), opt_plain.step(), opt.zero_grad(), opt_plain.zero_grad()
    _assert_same_model(net, plain)


def test_the_per_step_checks_stay_cheap():
    net = torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(500)])  # 1,000 parameters
    r = gf.resident(net)
    binding = r._binding
    seconds = min(timeit.repeat(binding.sync, number=200, repeat=5)) / 200
    # The checks read two attributes per parameter: about 0.1 us each here.
    # The bound is loose (a shared, noisy machine) but catches a check that
    # grows into a walk of the modules.
    assert seconds < 1e-3, f"{seconds * 1e6:.0f} us per step for 1,000 parameters"


def test_a_refused_change_rebinds_nothing():
    net, _ = _twins()
    r = gf.resident(net)
    before = r.param_buffers[0].clone()
    net.embed.weight.data = torch.zeros(11, 8)  # would be followed alone
    net.norm.weight.data = torch.ones(8, dtype=torch.float64)  # cannot be
    with pytest.raises(gf.StaleResidentError, match=r"'norm.weight' now has dtype torch.float64"):
        r.grad_norm()
    assert torch.equal(r._binding.data[0], before[: 11 * 8].reshape(11, 8))  # nothing copied in
    assert not torch.equal(net.embed.weight, r._binding.data[0])  # and not rebound


def test_a_layer_frozen_mid_training_matches_pytorch():
    net, plain = _twins()
    r = gf.resident(net)
    opt, opt_plain = torch.optim.SGD(_trainable(net), lr=0.1), torch.optim.SGD(_trainable(plain), lr=0.1)
    for step, (x, y) in enumerate(_batches(4)):
        if step == 2:  # frozen after two steps: no new gradient, and set_to_none drops the old one
            net.body[2].weight.requires_grad_(False)
            plain.body[2].weight.requires_grad_(False)
        for model in (net, plain):
            _backward(model, x, y)
        got = r.clip_grad_norm_(0.5)
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)  # counts every .grad present
        assert float(got) == pytest.approx(float(want), rel=1e-5)
        for o in (opt, opt_plain):
            o.step()
            o.zero_grad()
    _assert_same_model(net, plain)
