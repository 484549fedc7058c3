"""gpuflat's norm and clip as PyTorch operators inside torch.compile: the
drop-ins compile with fullgraph=True into one graph with no break, give the
eager calls' bits, and new gradient tensors each step recompile nothing."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gpuflat.torch as gft  # noqa: E402
from compiling import fresh_dynamo, model_and_twin, sharded_twins  # noqa: E402,F401  (fresh_dynamo: autouse)

nn = torch.nn


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


def test_the_compiled_clip_is_one_operator_call():
    # The eager clip reads the gradients' table once, for the norm and the
    # scale; compiled, that is one operator, not a norm and a scale each
    # finding the table.
    model, _ = model_and_twin(4)
    backward(model, torch.randn(3, 8))
    called = []

    def recording(gm, example_inputs):
        called.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "gpuflat" in str(n.target))
        return gm

    torch.compile(clip, fullgraph=True, backend=recording)(list(model.parameters()))
    assert called == ["gpuflat.clip_.default"]


def test_new_gradient_tensors_each_step_recompile_nothing():
    # torch._dynamo.config.patch, not monkeypatch: undoing a monkeypatch of
    # torch's config module leaves the option missing for the next tests.
    model, twin = model_and_twin(1)
    opt, twin_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(twin.parameters(), lr=0.1)
    compiled = torch.compile(clip, fullgraph=True, backend="aot_eager")
    with torch._dynamo.config.patch(error_on_recompile=True):
        for step in range(5):
            x = torch.randn(4, 8)
            for m, o, f in ((model, opt, compiled), (twin, twin_opt, clip)):
                o.zero_grad()  # set_to_none: the next backward makes new gradient tensors
                backward(m, x)
                f(list(m.parameters()))
                o.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


@pytest.mark.slow  # Inductor builds C++ with g++
def test_inductor_compiles_the_clip():
    model, twin = model_and_twin(2)
    x = torch.randn(6, 8)
    backward(twin, x)
    want = clip(list(twin.parameters()))
    backward(model, x)
    versions = [p.grad._version for p in model.parameters()]
    got = torch.compile(lambda: clip(list(model.parameters())), fullgraph=True)()
    assert torch.equal(got, want)
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p.grad, q.grad)
    assert all(p.grad._version > v for p, v in zip(model.parameters(), versions))


def test_every_tensor_an_operator_writes_has_its_version_moved():
    # Autograd reads a tensor's version to tell whether it was written after
    # it was saved for backward: a call moves the version of each tensor of
    # the list it writes, called directly as from a compiled graph.
    ts = [torch.randn(3), torch.randn(2, 2), torch.randn(1)]
    total = torch.tensor(100.0, dtype=torch.float64)
    calls = {"clip_": lambda: torch.ops.gpuflat.clip_(ts, 0.5, None, 2.0, 1e-6),
             "scale_by_norm_": lambda: torch.ops.gpuflat.scale_by_norm_(ts, 1.0, total, 1e-6),
             "scale_by_tensor_norm_": lambda: torch.ops.gpuflat.scale_by_tensor_norm_(ts, torch.tensor(1.0), total,
                                                                                      1e-6)}
    for name, call in calls.items():
        versions = [t._version for t in ts]
        call()
        assert [t._version > v for t, v in zip(ts, versions)] == [True] * len(ts), name
    model, _ = model_and_twin(5)
    for fn in (clip, norm_then_clip):
        backward(model, torch.randn(2, 8))
        versions = [p.grad._version for p in model.parameters()]
        torch.compile(fn, fullgraph=True, backend="aot_eager")(list(model.parameters()))
        assert all(p.grad._version > v for p, v in zip(model.parameters(), versions)), fn.__name__


def test_backward_through_a_saved_tensor_the_clip_wrote_raises():
    x = torch.randn(4, requires_grad=True)
    y = x.exp()  # saved for exp's backward
    with torch.no_grad():
        torch.ops.gpuflat.clip_([y], 0.5, None, 2.0, 1e-6)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_an_operator_result_has_no_derivative():
    # Where an input requires grad under grad mode the result does too, and
    # a backward through it raises rather than give a wrong gradient.
    ts = [torch.tensor([3.0], requires_grad=True), torch.tensor([4.0], requires_grad=True)]
    for total in (torch.ops.gpuflat.total_norm(ts, 2.0), torch.ops.gpuflat.clip_(ts, 1.0, None, 2.0, 1e-6)):
        assert total.requires_grad
        with pytest.raises(RuntimeError, match="no autograd formula"):
            total.backward()
    with torch.no_grad():
        assert not torch.ops.gpuflat.total_norm(ts, 2.0).requires_grad


def test_a_tensor_max_norm_is_read_where_it_lies_with_no_recompile():
    # A schedule writes max_norm in place: the compiled clip follows it
    # (the operator reads the tensor, no value is baked into the graph).
    # The eager clip reads the same float32 tensor: 0.05 there is
    # 0.0500000007, and a Python 0.05 would clip by another factor.
    model, twin = model_and_twin(3)
    max_norm = torch.tensor(0.5)
    compiled = torch.compile(lambda ps: gft.clip_grad_norm_(ps, max_norm), fullgraph=True, backend="aot_eager")
    for step, value in enumerate([0.5, 0.05, 2.0]):
        max_norm.fill_(value)
        x = torch.randn(2, 8)
        for m in (model, twin):
            m.zero_grad()
            backward(m, x)
        with torch._dynamo.config.patch(error_on_recompile=step > 0):  # compiled once, never again
            got = compiled(list(model.parameters()))
        want = gft.clip_grad_norm_(list(twin.parameters()), max_norm)
        assert torch.equal(got, want)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_a_tensor_max_norm_must_be_a_real_floating_scalar():
    model, _ = model_and_twin(3)
    backward(model, torch.randn(2, 8))
    fn = torch.compile(lambda ps: gft.clip_grad_norm_(ps, torch.ones(2)), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception, match=r"max_norm: expected a number >= 0 or a 0-d real floating tensor, got one "
                                        r"of shape \(2,\) and dtype float32"):
        fn(list(model.parameters()))


def test_dtensor_gradients_are_clipped_between_graphs_with_the_eager_bits():
    # DTensors never enter gpuflat's operators: their norm is a collective
    # over the mesh, which runs as it is between two graphs. One rank: the
    # same code paths.
    with sharded_twins(6) as (shard, params, twins):
        grads = [torch.randn(p.shape) for p in params]
        for ps in (params, twins):
            for p, g in zip(ps, grads):
                p.grad = shard(g.clone())
        got = torch.compile(clip, backend="aot_eager")(params)
        want = clip(twins)
        assert torch.equal(got.full_tensor(), want.full_tensor()) and float(want) > 0.5
        for p, q in zip(params, twins):
            assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor())


def test_a_compiled_total_norm_checks_the_norm_as_the_eager_one_does():
    # The check reads the norm on the host, so the graph breaks there, as at
    # torch.nn.utils.get_total_norm's own; before, the compiled norm skipped it.
    grads = [torch.ones(3), torch.tensor([1.0, float("inf")])]
    compiled = torch.compile(lambda ts: gft.get_total_norm(ts, error_if_nonfinite=True), backend="eager")
    with pytest.raises(gft.NonFiniteNormError, match=r"^leaf 'tensors\[1\]' holds NaN or inf; the total 2-norm is "
                                                       r"non-finite \(error_if_nonfinite=True"):
        compiled(grads)
    assert float(compiled([torch.ones(3), torch.ones(1)])) == 2.0
