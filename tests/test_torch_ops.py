"""gpuflat's norm and clip as PyTorch operators inside torch.compile: the
drop-ins compile with fullgraph=True into one graph with no break, give the
eager calls' bits, and new gradient tensors each step recompile nothing."""
from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

import gpuflat.torch as gft  # noqa: E402

nn = torch.nn


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def model_and_twin(seed):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    return model, copy.deepcopy(model)


def backward(model, x):
    model(x).pow(2).sum().backward()


def clip(params):
    return gft.clip_grad_norm_(params, 0.5)


def norm_then_clip(params):
    total = gft.get_total_norm([p.grad for p in params], norm_type="inf")
    gft.clip_grads_with_norm_(params, 0.1, total)
    return total


@pytest.mark.parametrize("fn", [clip, norm_then_clip], ids=["clip_grad_norm_", "get_total_norm+clip_grads_with_norm_"])
def test_the_drop_ins_compile_in_one_graph_with_the_eager_bits(fn):
    model, twin = model_and_twin(0)
    x = torch.randn(5, 8)
    backward(model, x)
    backward(twin, x)
    explained = torch._dynamo.explain(fn)(list(twin.parameters()))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    for p in twin.parameters():  # explain ran it: start the twin again from the same gradients
        p.grad = None
    backward(twin, x)
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(list(model.parameters()))
    want = fn(list(twin.parameters()))
    assert got.dtype == want.dtype and torch.equal(got, want)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_new_gradient_tensors_each_step_recompile_nothing(monkeypatch):
    model, twin = model_and_twin(1)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = torch.compile(clip, fullgraph=True, backend="aot_eager")
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    for step in range(5):
        x = torch.randn(4, 8)
        for m, o, f in ((model, opt, compiled), (twin, twin_opt, clip)):
            o.zero_grad()  # set_to_none: the next backward makes new gradient tensors
            backward(m, x)
            f(list(m.parameters()))
            o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_inductor_compiles_the_clip():
    model, twin = model_and_twin(2)
    x = torch.randn(6, 8)
    backward(twin, x)
    want = clip(list(twin.parameters()))
    backward(model, x)
    got = torch.compile(lambda: clip(list(model.parameters())), fullgraph=True)()
    assert torch.equal(got, want)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)


def test_a_tensor_max_norm_inside_compile_is_refused_clearly():
    model, _ = model_and_twin(3)
    backward(model, torch.randn(2, 8))
    fn = torch.compile(lambda ps: gft.clip_grad_norm_(ps, torch.tensor(0.5)), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match="max_norm: inside torch.compile expected a number"):
        fn(list(model.parameters()))
