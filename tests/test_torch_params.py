"""gpuflat._src.torch_params: a resident PyTorch model inside a real training loop.

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


def _buffers(r):
    """Copies of every parameter and gradient buffer, read without the checks."""
    return [b.own.clone() for b in (*r._params, *r._grads)]


def _raises_and_writes_nothing(r, pattern):
    """Every per-step call raises StaleResidentError matching ``pattern``, and no buffer changes."""
    before = _buffers(r)
    for call in (r.grad_norm, lambda: r.clip_grad_norm_(1.0), r.param_norm, r.zero_grad, lambda: r.grad_buffers):
        with pytest.raises(gf.StaleResidentError, match=pattern):
            call()
    for a, b in zip(before, _buffers(r)):
        assert torch.equal(a, b)


def _clip_and_step_like_pytorch(net, plain, steps=3, tokens=11):
    """Train ``net`` made resident now and ``plain`` alike: the same clipped norms and parameters."""
    r = gf.resident(net)
    opt, opt_plain = torch.optim.SGD(_trainable(net), lr=0.1), torch.optim.SGD(_trainable(plain), lr=0.1)
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x, y = torch.randint(0, tokens, (6,), generator=gen), torch.randint(0, tokens, (6,), generator=gen)
        for model in (net, plain):
            _backward(model, x, y)
        assert float(r.clip_grad_norm_(0.5)) == pytest.approx(
            float(torch.nn.utils.clip_grad_norm_(_trainable(plain), 0.5)), rel=1e-5)
        opt.step(), opt_plain.step(), opt.zero_grad(), opt_plain.zero_grad()
    _assert_same_model(net, plain)


def test_load_state_dict_assign_raises_naming_the_parameter():
    # assign=True puts new Parameter objects in the modules; an optimizer
    # made before still holds (and updates) the old ones.
    net, plain = _twins(tied=False)
    r = gf.resident(net)
    other = Net(tied=False)
    net.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    _raises_and_writes_nothing(r, r"parameter 'embed.weight' was replaced by another Parameter object \(of the "
                                  r"same dtype, shape and device\), as load_state_dict\(\.\.\., assign=True\).*"
                                  r"rebuild it with gf.resident\(model\)")
    # The advice works: rebuilt (and a new optimizer), it trains as PyTorch does.
    plain.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    _clip_and_step_like_pytorch(net, plain)


def test_load_state_dict_without_assign_copies_into_the_buffers():
    net, plain = _twins(tied=False)
    r = gf.resident(net)
    state = Net(tied=False).state_dict()
    net.load_state_dict(state)
    plain.load_state_dict(state)
    assert float(r.param_norm()) == pytest.approx(_norm(_trainable(plain)), rel=1e-12)


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
    _raises_and_writes_nothing(r, r"'norm.weight' was replaced by another Parameter object \(shape \(9,\) where "
                                  r"the resident model holds \(8,\)\)")


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


# ---------------------------------------------------------------- gradients that are None


class TwoHeads(Net):
    """Net with a second output layer, used only when asked: on other steps
    its parameters get no gradient, as an unused branch's."""

    def __init__(self):
        super().__init__(tied=False)
        self.aux = torch.nn.Linear(8, 11)

    def forward(self, x, aux=False):
        return (self.aux if aux else self.out)(self.norm(self.body(self.embed(x))))


def test_a_none_gradient_stays_none_and_adamw_trains_as_pytorch():
    # AdamW's weight decay moves a parameter whose gradient is a zero tensor
    # but skips one whose gradient is None: a None turned into zeros shows.
    torch.manual_seed(0)
    net = TwoHeads()
    plain = copy.deepcopy(net)
    x, y = _batches(1)[0]
    for model in (net, plain):
        _backward(model, x, y)  # every parameter but aux's gets a gradient
    r = gf.resident(net)
    assert net.aux.weight.grad is None and net.aux.bias.grad is None
    assert not r.grads["aux.weight"].any()  # its slot is zero
    opt, opt_plain = torch.optim.AdamW(_trainable(net), lr=1e-2), torch.optim.AdamW(_trainable(plain), lr=1e-2)
    for step, (x, y) in enumerate(_batches(4, seed=3)):
        if step == 2:  # new storage for a parameter without a gradient: it stays without one
            for model in (net, plain):
                model.aux.weight.data = torch.full((11, 8), 0.5)
            r.grad_norm()
            assert net.aux.weight.grad is None
        if step:
            for model in (net, plain):
                torch.nn.functional.cross_entropy(model(x, aux=step == 3), y).backward()
        assert (net.aux.weight.grad is None) == (plain.aux.weight.grad is None)
        got = r.clip_grad_norm_(0.5)
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
        assert float(got) == pytest.approx(float(want), rel=1e-5)
        for o in (opt, opt_plain):
            o.step()
            o.zero_grad()
    _assert_same_model(net, plain)


# ---------------------------------------------------------------- modules that change


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder(x))


class LoRA(torch.nn.Module):
    """A low-rank adapter added to a linear layer's output (its forward hook)."""

    def __init__(self, base, rank=2):
        super().__init__()
        self.a = torch.nn.Linear(base.in_features, rank, bias=False)
        self.b = torch.nn.Linear(rank, base.out_features, bias=False)
        base.register_forward_hook(lambda module, args, out: out + self.b(self.a(args[0])))


def test_an_adapter_added_as_a_submodule_raises_naming_it():
    torch.manual_seed(0)
    net = Encoder()
    plain = copy.deepcopy(net)
    r = gf.resident(net)
    for model in (net, plain):
        torch.manual_seed(1)
        model.encoder.layers[0].linear1.lora = LoRA(model.encoder.layers[0].linear1)
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    for model in (net, plain):
        model(x).sum().backward()
    assert net.encoder.layers[0].linear1.lora.a.weight.grad is not None  # the adapter trains
    _raises_and_writes_nothing(r, r"parameter 'encoder.layers.0.linear1.lora.a.weight' was added to the model "
                                  r"after gf.resident .* rebuild it with gf.resident\(model\)")
    r = gf.resident(net)  # the advice: rebuilt, it counts the adapter
    assert float(r.clip_grad_norm_(0.5)) == pytest.approx(
        float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)), rel=1e-5)


def test_new_storage_and_a_registration_in_the_same_step_are_both_followed():
    net, plain = _twins()
    r = gf.resident(net)
    for model in (net, plain):
        model.norm.weight.data = torch.full((8,), 2.0)
        model.act = torch.nn.ReLU()  # a registration that changes the root's table of submodules
    assert float(r.param_norm()) == pytest.approx(_norm(_trainable(plain)), rel=1e-12)
    buffer = r.param_buffers[0]
    assert buffer.data_ptr() <= net.norm.weight.data_ptr() < buffer.data_ptr() + buffer.nbytes
    opt, opt_plain = torch.optim.SGD(_trainable(net), lr=0.1), torch.optim.SGD(_trainable(plain), lr=0.1)
    for x, y in _batches(2):
        for model in (net, plain):
            _backward(model, x, y)
        assert float(r.clip_grad_norm_(0.5)) == pytest.approx(
            float(torch.nn.utils.clip_grad_norm_(_trainable(plain), 0.5)), rel=1e-5)
        opt.step(), opt_plain.step(), opt.zero_grad(), opt_plain.zero_grad()
    _assert_same_model(net, plain)


def _resized_in_place(net, weight):
    # Hugging Face's resize_token_embeddings: the new rows copied into new
    # storage for the old Parameter, then set_input_embeddings registers
    # the module again.
    net.embed.weight.data = weight
    net.embed.num_embeddings = weight.shape[0]
    net.embed = net.embed


def _resized_by_a_new_parameter(net, weight):
    net.embed.weight = torch.nn.Parameter(weight)
    net.out.weight = net.embed.weight  # tied again


def _resized_by_a_new_module(net, weight):
    net.embed = torch.nn.Embedding.from_pretrained(weight, freeze=False)
    net.out.weight = net.embed.weight


RESIZES = {
    "weight.data in place": (_resized_in_place, r"parameter 'embed.weight' now has shape \(13, 8\) where the "
                                                r"resident model holds \(11, 8\); rebuild it with gf.resident"),
    "a new Parameter": (_resized_by_a_new_parameter, r"parameter 'embed.weight' was replaced by another Parameter "
                                                     r"object \(shape \(13, 8\) where the resident model holds "
                                                     r"\(11, 8\)\).*rebuild it with gf.resident\(model\)"),
    "a new Embedding": (_resized_by_a_new_module, r"parameter 'embed.weight' was replaced by another Parameter "
                                                  r"object \(shape \(13, 8\) .*rebuild it with gf.resident\(model\)"),
}


@pytest.mark.parametrize("resize", list(RESIZES))
def test_a_resized_embedding_raises_naming_it(resize):
    how, pattern = RESIZES[resize]
    net, plain = _twins()
    r = gf.resident(net)
    weight = torch.randn(13, 8, generator=torch.Generator().manual_seed(3))
    for model in (net, plain):
        how(model, weight.clone())
        model.out.out_features = 13
    x = torch.tensor([12, 0, 5, 7, 1, 3])
    for model in (net, plain):  # the resized model trains in PyTorch
        _backward(model, x, x)
    _raises_and_writes_nothing(r, pattern)
    for model in (net, plain):
        model.zero_grad()
    _clip_and_step_like_pytorch(net, plain, tokens=13)  # rebuilt as advised
