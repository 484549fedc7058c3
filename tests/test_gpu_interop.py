"""PyTorch and JAX on a real GPU: the paths CI reaches only through stand-ins.

Marked ``gpu`` and skipped where CuPy, a CUDA device, or the library's CUDA
build is missing; ``bench/gpu_check.sh`` runs them on a lent machine.
"""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import gpuflat as gf

from conftest import cupy_with_device

cp = cupy_with_device()
torch = pytest.importorskip("torch") if cp is not None else None
has_torch_cuda = torch is not None and torch.cuda.is_available()

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not has_torch_cuda, reason="needs CuPy and PyTorch with CUDA")]


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4)).cuda()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_gpuflat_torch_clip_matches_pytorch_on_cuda(dtype):
    import gpuflat.torch as gft

    net = _net().to(getattr(torch, dtype))
    x = torch.randn(8, 16, device="cuda", dtype=getattr(torch, dtype))
    net(x).float().pow(2).mean().backward()
    twin = copy.deepcopy(net)
    for p, q in zip(net.parameters(), twin.parameters()):
        q.grad = p.grad.clone()
    norm = gft.clip_grad_norm_(net.parameters(), 0.1)
    want = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    assert norm.device.type == "cuda" and norm.dtype == want.dtype
    assert float(norm) == pytest.approx(float(want), rel=1e-2 if dtype != "float32" else 1e-5)
    for p, q in zip(net.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad.float(), q.grad.float(), rtol=2e-2, atol=1e-3)


def test_a_resident_cuda_module_trains_like_plain_pytorch():
    net = _net()
    plain = copy.deepcopy(net)
    r = gf.resident(net)
    assert r.param_buffers[0].is_cuda
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    opt_plain = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        for model, o, clip in ((net, opt, lambda: r.clip_grad_norm_(0.5)),
                               (plain, opt_plain, lambda: torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5))):
            model(x).pow(2).mean().backward()
            clip()
            o.step()
            o.zero_grad()
    for a, b in zip(net.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_global_norm_of_a_cuda_module_is_a_cuda_tensor():
    net = _net()
    norm = gf.global_norm(net)
    want = math.sqrt(sum(float(p.detach().double().pow(2).sum()) for p in net.parameters()))
    assert norm.is_cuda and float(norm) == pytest.approx(want, rel=1e-12)


def test_jax_gpu_arrays_are_read_zero_copy():
    jax = pytest.importorskip("jax")
    if not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX sees no GPU")
    x = jax.device_put(np.arange(6.0, dtype=np.float32), jax.devices("gpu")[0])
    norm = gf.global_norm({"x": x})
    assert float(norm) == pytest.approx(math.sqrt(55.0))


def _two_dtype_module(seed):
    """A float32 and a float64 parameter (a resident model with two buffers), gradients set by hand."""
    gen = torch.Generator("cuda").manual_seed(seed)
    module = torch.nn.Module()
    module.w = torch.nn.Parameter(torch.randn(300, 7, device="cuda", generator=gen))
    module.d = torch.nn.Parameter(torch.randn(50, device="cuda", dtype=torch.float64, generator=gen))
    return module


def _set_grads(parameters, step):
    gen = torch.Generator("cuda").manual_seed(100 + step)
    for p in parameters:
        g = torch.randn(p.shape, device="cuda", dtype=p.dtype, generator=gen) * (step + 1)
        if p.grad is None:
            p.grad = g
        else:
            p.grad.copy_(g)  # in place: the captured graph reads the same memory


def _captured(call):
    """(graph, what ``call()`` returned): warmed up on a side stream, then captured."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def test_torch_cuda_graph_replays_a_resident_clip_like_eager_calls():
    model, twin = _two_dtype_module(0), _two_dtype_module(0)
    r, eager = gf.resident(model), gf.resident(twin)
    _set_grads(model.parameters(), 0)
    graph, (clipped, after) = _captured(lambda: (r.clip_grad_norm_(0.5), r.grad_norm()))
    for step in range(1, 4):
        _set_grads(model.parameters(), step)
        _set_grads(twin.parameters(), step)
        graph.replay()
        want_clipped, want_after = eager.clip_grad_norm_(0.5), eager.grad_norm()
        torch.cuda.synchronize()
        assert float(want_clipped) > 0.5  # the clip really scales
        assert torch.equal(clipped, want_clipped) and torch.equal(after, want_after)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert torch.equal(p.grad, q.grad)


def test_torch_cuda_graph_replays_the_drop_in_clip_like_eager_calls():
    import gpuflat.torch as gft

    params, twins = list(_two_dtype_module(1).parameters()), list(_two_dtype_module(1).parameters())
    _set_grads(params, 0)
    graph, norm = _captured(lambda: gft.clip_grad_norm_(params, 0.5))
    for step in range(1, 4):
        _set_grads(params, step)
        _set_grads(twins, step)
        graph.replay()
        want = gft.clip_grad_norm_(twins, 0.5)
        torch.cuda.synchronize()
        assert float(want) > 0.5 and torch.equal(norm, want)
        for p, q in zip(params, twins):
            assert torch.equal(p.grad, q.grad)


def test_torch_cuda_graph_replays_a_whole_training_step_like_eager_steps():
    # PyTorch's whole-network capture recipe
    # (https://pytorch.org/docs/stable/notes/cuda.html#whole-network-capture):
    # forward, backward (gradients allocated inside the capture, in the
    # graph's pool), the clipped step under a GradScaler and its update, with
    # a scheduler writing the tensor lr between replays. Replay 5 holds an
    # inf, which the scaler skips.
    import gpuflat.torch as gft

    def build():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).cuda()
        lr = torch.tensor(1e-2, device="cuda")
        opt = gft.AdamW(model.parameters(), lr=lr, weight_decay=0.1, max_norm=0.5)
        return model, lr, opt, gft.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)

    runs = [build(), build()]
    data = [(torch.zeros(8, 16, device="cuda"), torch.zeros(8, 4, device="cuda")) for _ in runs]

    def step(run, batch):
        model, _, opt, scaler = run
        x, y = batch
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()

    def feed(number):
        gen = torch.Generator("cuda").manual_seed(300 + number)
        x, y = torch.randn(8, 16, device="cuda", generator=gen), torch.randn(8, 4, device="cuda", generator=gen)
        if number == 5:
            x[0, 0] = float("inf")
        for (xs, ys), (_, lr, _, _) in zip(data, runs):
            xs.copy_(x)
            ys.copy_(y)
            lr.fill_(1e-2 / (number + 1))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for number in range(3):
            feed(number)
            for run, batch in zip(runs, data):
                run[2].zero_grad(set_to_none=True)
                step(run, batch)
    torch.cuda.current_stream().wait_stream(side)
    runs[0][2].zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(runs[0], data[0])
    for number in range(3, 8):
        feed(number)
        graph.replay()
        runs[1][2].zero_grad(set_to_none=True)
        step(runs[1], data[1])
        torch.cuda.synchronize()
        for p, q in zip(runs[0][0].parameters(), runs[1][0].parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        assert float(runs[0][3].get_scale()) == float(runs[1][3].get_scale())
    assert float(runs[1][2].state[next(runs[1][0].parameters())]["step"]) == 7  # 8 steps, one skipped
