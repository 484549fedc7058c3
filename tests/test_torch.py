"""gpuflat.torch against torch.nn.utils on real modules: norms, clipped gradients,
returned tensors, errors, and a training loop."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn

import gpuflat as gf
import gpuflat.torch as gft
from conftest import apart_at_most, counted, exact_norm, torch_scaled

# PyTorch's own suite's orders, the string 'inf' among them (float(norm_type)).
NORM_TYPES = [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, math.inf, "inf"]
GRAD_DTYPES = [torch.float32, torch.float64, torch.bfloat16]
# Relative agreement with PyTorch's own result: PyTorch reduces in the
# gradients' dtype, gpuflat in float64, so they differ by the dtype's rounding.
TORCH_RTOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 2e-2,
              torch.float16: 2e-3, torch.complex64: 1e-5, torch.complex128: 1e-12}


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread():
    # These models are tiny: PyTorch's intra-op thread pool only contends for
    # the machine's cores (a 2-layer transformer's backward went from 12 ms to
    # 3.5 s on a loaded 2-core machine); one thread also fixes the reduction order.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class TiedLM(nn.Module):
    """An embedding tied to the output layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 16)
        self.hidden = nn.Linear(16, 16)
        self.out = nn.Linear(16, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(self.embed(tokens))))


class FrozenBN(nn.Module):
    """Frozen parameters and BatchNorm buffers beside trainable ones."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(6, 8)
        self.stem.requires_grad_(False)
        self.norm = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.stem(x))))


def transformer():
    return nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                          dim_feedforward=64, dropout=0.0, batch_first=True)


def loss_of(model, seed):
    g = torch.Generator().manual_seed(seed)
    if isinstance(model, nn.Transformer):
        dtype = next(model.parameters()).dtype
        src = torch.randn(2, 5, 32, generator=g).to(dtype)
        tgt = torch.randn(2, 4, 32, generator=g).to(dtype)
        return model(src, tgt).float().pow(2).mean()
    if isinstance(model, TiedLM):
        return model(torch.randint(0, 11, (4, 7), generator=g)).float().logsumexp(-1).mean()
    x = torch.randn(5, 6, generator=g).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


MODELS = {"transformer": transformer, "tied": TiedLM, "frozen_bn": FrozenBN}


def model_with_grads(name, dtype, seed=0):
    torch.manual_seed(seed)
    model = MODELS[name]().to(dtype)
    loss_of(model, seed).backward()
    return model


def twin(model):
    """A deep copy (ties kept) holding copies of the same gradients."""
    other = copy.deepcopy(model)
    for p, q in zip(model.parameters(), other.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()
    return other


def grads_of(model):
    return [p.grad for p in model.parameters() if p.grad is not None]


def exact(grads, norm_type):
    wide = {True: torch.complex128, False: torch.float64}
    return exact_norm([g.detach().to(wide[g.dtype.is_complex]).numpy() for g in grads], float(norm_type))


def expected_clipped(grads, max_norm, total):
    """Each gradient times min(1, max_norm / (total + 1e-6)), in PyTorch's per-dtype precision."""
    coef = min(1.0, max_norm / (total + 1e-6))
    out = []
    for g in grads:
        as_np = g.detach().float().numpy() if g.dtype == torch.bfloat16 else g.detach().numpy()
        scaled = torch_scaled(as_np, coef)
        out.append(torch.from_numpy(np.asarray(scaled, np.float32 if g.dtype == torch.bfloat16
                                               else scaled.dtype)).to(g.dtype))
    return out


# ---------------------------------------------------------------- norms and clipped gradients

@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=str)
@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_clip_grad_norm_matches_pytorch(name, norm_type, dtype):
    ours = model_with_grads(name, dtype)
    theirs = twin(ours)
    reference_total = exact(grads_of(ours), norm_type)
    max_norm = 0.3 * reference_total  # clipping happens
    expected = expected_clipped(grads_of(ours), max_norm, reference_total)

    total = gft.clip_grad_norm_(ours.parameters(), max_norm, norm_type)
    torch_total = nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type)

    assert total.shape == () and total.dtype == torch_total.dtype == dtype
    assert total.device == torch_total.device
    # float64 inside: within one unit in the last place of the returned dtype of the
    # exact norm (float64's own summation error, ~1e-15, for float64 gradients).
    one_ulp = 1e-14 if dtype == torch.float64 else torch.finfo(dtype).eps
    exact_in_dtype = torch.tensor(reference_total, dtype=torch.float64).to(dtype)
    torch.testing.assert_close(total, exact_in_dtype, rtol=one_ulp, atol=0)
    torch.testing.assert_close(total, torch_total, rtol=TORCH_RTOL[dtype], atol=0)
    for got, want, pytorchs in zip(grads_of(ours), expected, grads_of(theirs)):
        torch.testing.assert_close(got, want, rtol=1e-15 if dtype == torch.float64 else 1e-6, atol=1e-300)
        torch.testing.assert_close(got, pytorchs, rtol=TORCH_RTOL[dtype], atol=1e-7)


@pytest.mark.parametrize("norm_type", NORM_TYPES, ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_get_total_norm_and_clip_grads_with_norm_match_pytorch(name, norm_type):
    ours = model_with_grads(name, torch.float32)
    theirs = twin(ours)
    total = gft.get_total_norm(grads_of(ours), norm_type)
    torch_total = nn.utils.get_total_norm(grads_of(theirs), norm_type)
    assert total.dtype == torch_total.dtype and total.shape == ()
    torch.testing.assert_close(total, torch_total, rtol=1e-5, atol=0)

    max_norm = 0.5 * torch_total.item()
    gft.clip_grads_with_norm_(ours.parameters(), max_norm, torch_total)
    nn.utils.clip_grads_with_norm_(theirs.parameters(), max_norm, torch_total)
    for got, want in zip(grads_of(ours), grads_of(theirs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)


def test_no_clipping_below_max_norm_leaves_gradients_bit_for_bit():
    ours = model_with_grads("tied", torch.float32)
    before = [g.clone() for g in grads_of(ours)]
    total = gft.clip_grad_norm_(ours.parameters(), max_norm=1e6)
    assert total.item() > 0
    for got, want in zip(grads_of(ours), before):
        assert torch.equal(got, want)


def test_tied_parameter_counts_once():
    ours = model_with_grads("tied", torch.float64)
    unique = grads_of(ours)  # parameters() yields the tied weight once
    assert len(unique) == 3
    repeated = [ours.embed.weight, ours.out.weight, ours.hidden.weight, ours.hidden.bias]
    assert gft.get_total_norm(unique).item() == gft.clip_grad_norm_(repeated, 1e9).item()
    assert gft.get_total_norm(unique).item() == pytest.approx(exact(unique, 2), rel=1e-15)


@pytest.mark.parametrize("dtypes, returned", [
    ((torch.float32, torch.float64), torch.float64),
    ((torch.float16, torch.bfloat16), torch.float32),
    ((torch.float16,), torch.float16),
    ((torch.complex64,), torch.float32),
    ((torch.complex128, torch.float32), torch.float64),
])
def test_returned_dtype_is_pytorchs(dtypes, returned):
    tensors = [torch.randn(5, generator=torch.Generator().manual_seed(i)).to(d)
               for i, d in enumerate(dtypes)]
    ours, theirs = gft.get_total_norm(tensors), nn.utils.get_total_norm(tensors)
    assert ours.dtype == theirs.dtype == returned
    # PyTorch takes each tensor's norm in its own dtype: the least precise one bounds the agreement.
    torch.testing.assert_close(ours, theirs, rtol=max(TORCH_RTOL[d] for d in dtypes), atol=0)
    torch.testing.assert_close(ours.double(), torch.tensor(exact(tensors, 2), dtype=torch.float64),
                               rtol=torch.finfo(returned).eps, atol=0)


def test_complex_gradients_match_pytorch():
    p = nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    p.grad = torch.tensor([3 + 4j, 1j, -2, 0], dtype=torch.complex64)
    q = nn.Parameter(p.detach().clone())
    q.grad = p.grad.clone()
    torch.testing.assert_close(gft.clip_grad_norm_([p], 1.0), nn.utils.clip_grad_norm_([q], 1.0))
    torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


# ---------------------------------------------------------------- arguments as PyTorch takes them

def test_single_tensor_generator_and_missing_gradients():
    w, b, unused = (nn.Parameter(torch.zeros(2)) for _ in range(3))
    w.grad, b.grad = torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])
    assert gft.get_total_norm(w.grad).item() == 3.0
    total = gft.clip_grad_norm_((p for p in (w, unused, b)), max_norm=1.0)
    assert total.item() == 5.0 and unused.grad is None
    torch.testing.assert_close(w.grad, torch.tensor([0.6, 0.0]))
    assert gft.clip_grad_norm_(w, max_norm=10.0).item() == pytest.approx(0.6)


def test_empty_inputs_give_tensor_zero_as_pytorch():
    for ours, theirs in [(gft.get_total_norm([]), nn.utils.get_total_norm([])),
                         (gft.clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0),
                          nn.utils.clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0))]:
        assert ours.dtype == theirs.dtype and ours.shape == () and ours.item() == theirs.item() == 0.0
    with pytest.warns(UserWarning, match="empty generator"):
        assert gft.clip_grad_norm_((p for p in []), 1.0).item() == 0.0


def test_requires_grad_gradients_and_the_autograd_state_are_left_alone():
    p = nn.Parameter(torch.ones(3))
    p.grad = torch.full((3,), 2.0, requires_grad=True)  # create_graph=True leaves such gradients
    total = gft.clip_grad_norm_([p], 1.0)
    assert not total.requires_grad and p.grad.requires_grad
    torch.testing.assert_close(p.grad.detach(), torch.full((3,), 2.0 / (math.sqrt(12) + 1e-6)))


@pytest.mark.parametrize("norm_type", [0, -1, "two", float("nan")])
def test_bad_norm_type_raises_naming_pytorchs_argument(norm_type):
    for call in (lambda: gft.get_total_norm([torch.ones(2)], norm_type),
                 lambda: gft.clip_grad_norm_(with_grads(torch.ones(2)), 1.0, norm_type)):
        with pytest.raises(ValueError, match=r"^norm_type: expected 1, 2, inf or a number p > 0, got "):
            call()



def with_grads(*grads):
    params = []
    for g in grads:
        p = nn.Parameter(torch.zeros(g.shape, dtype=g.dtype))
        p.grad = g
        params.append(p)
    return params


@pytest.mark.parametrize("bad", [torch.arange(4), torch.tensor([True, False])], ids=["int64", "bool"])
@pytest.mark.parametrize("position", [0, 1])
def test_integer_and_bool_tensors_are_refused_by_name_as_pytorch_refuses_them(bad, position):
    tensors = [torch.ones(2)]
    tensors.insert(position, bad)
    with pytest.raises(RuntimeError):
        nn.utils.get_total_norm(tensors)
    with pytest.raises(gft.NonFloatingTensorError) as info:
        gft.get_total_norm(tensors)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value, gf.TreeMismatchError)
    assert str(info.value) == (f"leaf 'tensors[{position}]': expected a floating point or complex "
                               f"tensor, found dtype {bad.dtype}")
    with pytest.raises(gft.NonFloatingTensorError, match="tensors\\[0\\]"):
        gft.get_total_norm(bad)


def test_clips_refuse_integer_gradients_by_name_and_scale_nothing():
    class Holder:  # PyTorch refuses an integer .grad on a Parameter; any object with .grad is accepted
        grad = torch.arange(3)

    params = with_grads(torch.full((2,), 4.0)) + [Holder()]
    for clip in (lambda: gft.clip_grad_norm_(params, 1.0),
                 lambda: gft.clip_grads_with_norm_(params, 1.0, torch.tensor(8.0))):
        with pytest.raises(gft.NonFloatingTensorError, match="'parameters\\[1\\].grad'.*torch.int64"):
            clip()
        assert params[0].grad.tolist() == [4.0, 4.0] and Holder.grad.tolist() == [0, 1, 2]


@pytest.mark.parametrize("max_norm", [-1.0, math.nan, "1.0", None])
def test_bad_max_norm_is_a_value_error_and_scales_nothing(max_norm):
    params = with_grads(torch.full((2,), 4.0))
    with pytest.raises(ValueError, match="max_norm: expected a number >= 0"):
        gft.clip_grad_norm_(params, max_norm)
    with pytest.raises(ValueError, match="max_norm: expected a number >= 0"):
        gft.clip_grads_with_norm_(params, max_norm, torch.tensor(8.0))
    assert params[0].grad.tolist() == [4.0, 4.0]


def _overlapping_gradients():
    x = torch.arange(10.0)
    return x, {"slices": (x[:6], x[4:]), "views": (x[:6].view(2, 3), x[:6].view(3, 2).t()),
               "the same storage twice": (x, x.view(2, 5))}


@pytest.mark.parametrize("case", list(_overlapping_gradients()[1]))
def test_clips_refuse_overlapping_gradients_and_scale_nothing(case):
    x, cases = _overlapping_gradients()
    params = with_grads(*cases[case])
    for clip in (lambda: gft.clip_grad_norm_(params, 1.0),
                 lambda: gft.clip_grads_with_norm_(params, 1.0, torch.tensor(100.0))):
        with pytest.raises(gf.OverlapError, match=r"'parameters\[0\].grad' and 'parameters\[1\].grad'"):
            clip()
        assert x.equal(torch.arange(10.0))


def test_clips_refuse_a_broadcast_gradient_and_scale_nothing():
    shared = torch.ones(1)
    params = with_grads(torch.full((2,), 3.0), shared.expand(3))
    with pytest.raises(ValueError, match="'parameters\\[1\\].grad'.*distinct memory"):
        gft.clip_grad_norm_(params, 1.0)
    assert params[0].grad.tolist() == [3.0, 3.0] and shared.item() == 1.0


def test_disjoint_views_of_one_storage_are_clipped_as_pytorch():
    x, y = torch.arange(10.0), torch.arange(10.0)
    total = gft.clip_grad_norm_(with_grads(x[:4], x[4:]), 1.0)
    torch.testing.assert_close(total, nn.utils.clip_grad_norm_(with_grads(y[:4], y[4:]), 1.0))
    torch.testing.assert_close(x, y)


# ---------------------------------------------------------------- non-finite gradients

@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_error_if_nonfinite_raises_a_runtime_error_and_scales_nothing(bad):
    model = model_with_grads("frozen_bn", torch.float32)
    model.head.bias.grad[1] = bad
    before = [g.clone() for g in grads_of(model)]
    try:
        gft.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    except RuntimeError as err:
        assert isinstance(err, gf.NonFiniteError)
        assert "leaf 'parameters[5].grad' holds NaN or inf" in str(err)
        assert "set it to False to scale by the non-finite norm anyway" in str(err)  # PyTorch's advice too
    else:
        pytest.fail("no error raised")
    for got, want in zip(grads_of(model), before):
        assert torch.equal(got.nan_to_num(), want.nan_to_num())
    with pytest.raises(RuntimeError, match="non-finite"):
        nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
    with pytest.raises(gft.NonFiniteNormError):
        gft.get_total_norm(grads_of(model), error_if_nonfinite=True)


def test_nonfinite_without_the_flag_scales_as_pytorch():
    ours = model_with_grads("tied", torch.float32)
    ours.hidden.weight.grad[0, 0] = math.nan
    theirs = twin(ours)
    total = gft.clip_grad_norm_(ours.parameters(), 1.0)
    torch_total = nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
    assert math.isnan(total.item()) and math.isnan(torch_total.item())
    for got, want in zip(grads_of(ours), grads_of(theirs)):
        assert torch.equal(got.isnan(), want.isnan())


# ---------------------------------------------------------------- a training loop

def assert_within_bound(got, want, roundings, msg=None):
    """``got`` and ``want``, two roundings of one computation of at most
    ``roundings`` operations in their dtype, within the bound of
    tests/conftest.py: PyTorch's CPU kernels round differently on each CPU."""
    scale = float(torch.maximum(got.detach().abs().max(), want.detach().abs().max())) if got.numel() else 0.0
    atol = apart_at_most(torch.finfo(got.dtype).eps, roundings, scale)
    torch.testing.assert_close(got, want, rtol=0, atol=atol, msg=msg)


def layer_norm(d):
    return 2 * d + 3  # the mean and variance of d values, then normalise, scale, shift


def attention(d, keys):
    # the projection of the query, key and value (a dot of d and a bias),
    # the scores (a dot of the head's 8 and the scale), softmax over the
    # keys, the weighted sum and the output projection
    return 2 * (d + 1) + 9 + (keys + 2) + keys


# A training step rounds a value along a chain of at most these many
# operations (a reduction of n terms counts n): the forward pass; backward,
# that chain again and each weight's gradient summed over the batch's
# tokens; the clip, the squares of the largest gradient summed, the factor
# and the multiply; SGD's update with momentum (5).
_D, _FF, _SRC, _TGT = 32, 64, 5, 4
_ENCODER = attention(_D, _SRC) + 1 + layer_norm(_D) + (_D + 1) + (_FF + 1) + 1 + layer_norm(_D)
_DECODER = (attention(_D, _TGT) + 1 + layer_norm(_D) + attention(_D, _SRC) + 1 + layer_norm(_D)
            + (_D + 1) + (_FF + 1) + 1 + layer_norm(_D))
FORWARD_ROUNDINGS = {
    # two encoder and two decoder layers, their final norms, the mean square over 2 x 4 x 32 outputs
    "transformer": 2 * _ENCODER + 2 * _DECODER + 2 * layer_norm(_D) + 1 + 2 * _TGT * _D,
    # hidden (16 and a bias), tanh, the tied output (16), logsumexp over 11, the mean over 4 x 7 tokens
    "tied": 17 + 1 + 16 + 13 + 28,
    # stem (6 and a bias), BatchNorm over 5, head (8 and a bias), the mean square over 5 x 3
    "frozen_bn": 7 + layer_norm(5) + 9 + 1 + 15,
}
BATCH_TOKENS = {"transformer": 2 * _SRC, "tied": 4 * 7, "frozen_bn": 5}
LARGEST_GRADIENT = {"transformer": _D * _FF, "tied": 11 * 16, "frozen_bn": 8 * 3}


def step_roundings(name):
    forward = FORWARD_ROUNDINGS[name]
    return 2 * forward + BATCH_TOKENS[name] + LARGEST_GRADIENT[name] + 2 + 5


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("name", MODELS)
def test_training_loop_gives_pytorchs_parameters(name, dtype):
    torch.manual_seed(0)
    ours = MODELS[name]().to(dtype)
    theirs = copy.deepcopy(ours)
    runs = [(ours, gft.clip_grad_norm_), (theirs, nn.utils.clip_grad_norm_)]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m, _ in runs]
    clipped = 0
    steps = 5
    for step in range(steps):
        for (model, clip), opt in zip(runs, optimizers):
            loss_of(model, seed=step).backward()
            total = clip(model.parameters(), max_norm=0.05)
            clipped += total.item() > 0.05
            opt.step()
            opt.zero_grad()
    assert clipped == 10  # every step clipped, in both runs
    roundings = steps * step_roundings(name)
    for (n, p), q in zip(ours.named_parameters(), theirs.parameters()):
        assert_within_bound(p, q, roundings, msg=n)
    for (n, a), b in zip(ours.named_buffers(), theirs.buffers()):
        if a.is_floating_point():
            assert_within_bound(a, b, roundings, msg=n)
        else:
            assert torch.equal(a, b), n


# ---------------------------------------------------------------- modules and tensors as gpuflat trees


@pytest.mark.parametrize("name", list(MODELS))
def test_a_module_is_a_tree_of_its_trainable_parameters(name):
    model = model_with_grads(name, torch.float32)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    got = gf.trainables(model, path=True)
    assert [p for p, _ in got] == list(trainable)  # PyTorch's qualified names, shared once
    assert all(t is trainable[p] for p, t in got)
    norm = gf.global_norm(model)
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float64 and norm.shape == ()
    want = exact([p.detach() for p in trainable.values()], 2.0)
    assert abs(float(norm) - want) <= 1e-12 * want
    # The same through a list of parameters and a dict of tensors: never a silent 0.
    assert float(gf.global_norm(list(model.parameters()))) > 0
    assert float(gf.global_norm({"w": torch.ones(3)})) == pytest.approx(math.sqrt(3))


def test_a_parameters_generator_is_refused_not_silently_zero():
    model = model_with_grads("tied", torch.float32)
    with pytest.raises(gf.UnwalkableError, match="generator"):
        gf.global_norm(model.parameters())


def test_destructure_rebuilds_a_copy_of_the_module():
    model = model_with_grads("frozen_bn", torch.float32)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    flat, re = gf.destructure(model)
    assert isinstance(flat, torch.Tensor) and flat.numel() == sum(
        p.numel() for p in model.parameters() if p.requires_grad)
    copy_ = re(flat * 0)
    assert type(copy_) is type(model) and copy_ is not model
    assert all(float(p.detach().abs().sum()) == 0 for p in copy_.parameters() if p.requires_grad)
    assert all(torch.equal(p.detach(), before[n]) for n, p in model.named_parameters())
    frozen = dict(copy_.named_parameters())["stem.weight"]
    assert not frozen.requires_grad and torch.equal(frozen.detach(), before["stem.weight"])


def test_clip_grad_norm_of_a_gradient_tree_writes_the_tensors():
    grads = {"w": torch.full((3,), 4.0), "b": torch.full((1,), 3.0, dtype=torch.float64)}
    norm = gf.clip_grad_norm_(grads, 1.0)
    assert float(norm) == pytest.approx(math.sqrt(57))
    assert torch.allclose(grads["w"], torch.full((3,), 4.0 / math.sqrt(57)))


def test_model_argument_with_tied_tensor_gradients():
    w = torch.ones(3)
    model = {"a": w, "b": w}
    grads = {"a": torch.full((3,), 2.0), "b": torch.full((3,), 1.0)}
    norm = gf.global_norm(grads, model=model)
    assert isinstance(norm, torch.Tensor) and float(norm) == pytest.approx(math.sqrt(27))


def _compiled_pair(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    return model, copy.deepcopy(model)


# _compiled_pair's chain of roundings up to the clipped gradients (see
# step_roundings): forward, the layers (8 and a bias, 16 and a bias), tanh,
# the sum of 5 squares; backward, that chain again and the weights'
# gradients summed over the batch of 5; the clip, the 128 squares of the
# first weight's gradient summed, the factor and the multiply.
_PAIR_FORWARD = 9 + 1 + 17 + 1 + 5
PAIR_CLIPPED_GRADIENT_ROUNDINGS = 2 * _PAIR_FORWARD + 5 + 8 * 16 + 2
PAIR_ADAMW_STEP_ROUNDINGS = PAIR_CLIPPED_GRADIENT_ROUNDINGS + 18  # AdamW's update (test_torch_optim.py)


# TorchDynamo warns where it traces into code it cannot follow faithfully.
@pytest.mark.filterwarnings("error::UserWarning")
def test_a_compiled_model_clipped_by_the_drop_in_trains_as_with_torchs_clip():
    model, ref = _compiled_pair()
    compiled = torch.compile(model, backend="aot_eager")
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    steps = 4
    try:
        for step in range(steps):
            x = torch.randn(5, 8)
            opt.zero_grad()
            ref_opt.zero_grad()
            compiled(x).pow(2).sum().backward()
            ref(x).pow(2).sum().backward()
            got = gft.clip_grad_norm_(model.parameters(), 0.5)
            want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            assert_within_bound(got, want, step * PAIR_ADAMW_STEP_ROUNDINGS + PAIR_CLIPPED_GRADIENT_ROUNDINGS)
            opt.step()
            ref_opt.step()
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_within_bound(p, q, steps * PAIR_ADAMW_STEP_ROUNDINGS)
    finally:
        torch._dynamo.reset()


# TorchDynamo warns where it traces into code it cannot follow faithfully.
@pytest.mark.filterwarnings("error::UserWarning")
def test_the_drop_in_inside_a_compiled_step_runs_between_graphs():
    model, ref = _compiled_pair(1)
    x = torch.randn(5, 8)

    def step(m, clip):
        m.zero_grad()
        m(x).pow(2).sum().backward()
        return clip(m.parameters(), 0.5)

    try:
        got = torch.compile(step, backend="aot_eager")(model, gft.clip_grad_norm_)
    finally:
        torch._dynamo.reset()
    want = step(ref, torch.nn.utils.clip_grad_norm_)
    assert_within_bound(got, want, PAIR_CLIPPED_GRADIENT_ROUNDINGS)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_within_bound(p.grad, q.grad, PAIR_CLIPPED_GRADIENT_ROUNDINGS)


def test_naming_every_gradient_reads_each_parameter_once():
    # The DTensor path names every gradient: reading all parameters per name
    # would be quadratic in their number.
    reads = []

    class Counted(nn.Parameter):
        @property
        def grad(self):
            reads.append(1)
            return nn.Parameter.grad.__get__(self)

        @grad.setter
        def grad(self, value):
            nn.Parameter.grad.__set__(self, value)

    params = [Counted(torch.zeros(2)) for _ in range(50)]
    for p in params[::2]:
        p.grad = torch.ones(2)
    grads, _, name_of = gft._gradients(params)
    reads.clear()
    names = [name_of(i) for i in range(len(grads))]
    assert names[:2] == ["parameters[0].grad", "parameters[2].grad"] and names[-1] == "parameters[48].grad"
    assert len(reads) == len(params)


@pytest.mark.parametrize("foreach", [None, True, False])
@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e9])
def test_max_norm_zero_and_foreach_as_in_pytorch(max_norm, foreach):
    # torch.nn.utils' own suite: max_norm 0 zeroes every gradient (the factor
    # is 0 / (norm + 1e-6)); foreach picks PyTorch's implementation, never the result.
    g = torch.Generator().manual_seed(21)
    ours = with_grads(torch.randn(7, generator=g), torch.randn(3, 2, generator=g))
    theirs = with_grads(*[p.grad.clone() for p in ours])
    total = gft.clip_grad_norm_(ours, max_norm, foreach=foreach)
    want = nn.utils.clip_grad_norm_(theirs, max_norm, foreach=foreach)
    torch.testing.assert_close(total, want, rtol=1e-6, atol=0)
    for p, q in zip(ours, theirs):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)
    if max_norm == 0.0:
        assert all(not p.grad.any() for p in ours)


def test_a_clip_is_one_binding_call_and_one_backend_call_each_for_the_norm_and_the_scale(monkeypatch):
    # The host cost of a clip is its table read and two launches' worth of
    # backend calls, whatever the number of tensors: counted here on the
    # host backend.
    from gpuflat._src import tensor_table
    from gpuflat._src.backends import get_backend

    calls = []
    backend = get_backend("host")
    monkeypatch.setattr(tensor_table, "read", counted(calls, "read", tensor_table.read))
    monkeypatch.setattr(backend, "norms", counted(calls, "norms", backend.norms))
    monkeypatch.setattr(backend, "clip_", counted(calls, "clip_", backend.clip_))
    params = [nn.Parameter(torch.ones(n)) for n in (3, 5, 7, 1000)]
    for p in params:
        p.grad = torch.full_like(p, 2.0)
    with tensor_table.serve_with(backend):
        for _ in range(3):
            calls.clear()
            gft.clip_grad_norm_(params, 1.0)
            assert calls == ["read", "norms", "clip_"]
