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
