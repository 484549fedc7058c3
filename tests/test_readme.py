"""The README's Python examples run as written, and their comments hold."""
import math
import re
from pathlib import Path

import numpy as np
import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def run(index):
    scope: dict = {}
    exec(compile(BLOCKS[index], f"{README}:block{index}", "exec"), scope)
    return scope


def test_every_example_is_tested():
    assert len(BLOCKS) == 9


def test_tree_example():
    scope = run(0)
    assert scope["flat"].shape == (4160,)
    assert scope["model2"]["dec"] is scope["model2"]["enc"]["w"]
    g = scope["g"]
    assert np.all(g[: 64 * 64] == 2.0) and np.all(g[64 * 64 :] == 0.0)
    norm = scope["norm"]
    assert norm.shape == () and norm.dtype == np.float64 and float(norm) == 128.0


def test_pytorch_example():
    torch = pytest.importorskip("torch")
    scope = run(1)
    net, r = scope["net"], scope["r"]
    assert isinstance(scope["norm"], torch.Tensor) and float(scope["step_norm"]) > 0
    buf = r.param_buffers[0]
    for p in net.parameters():
        assert buf.data_ptr() <= p.data_ptr() < buf.data_ptr() + buf.numel() * buf.element_size()
    assert all(float(p.grad.abs().sum()) == 0 for p in net.parameters())  # r.zero_grad()


def test_jax_example():
    jax = pytest.importorskip("jax")
    scope = run(2)
    assert isinstance(scope["total"], jax.Array) and float(scope["total"]) == pytest.approx(math.sqrt(12))
    assert float(scope["clipped"]["w"][0, 0]) == pytest.approx(1 / (math.sqrt(12) + 1e-6))
    assert float(scope["params"]["w"][0, 0]) == 1.0


def test_register_example():
    assert run(3)["count"] == 6


def test_distributed_example():
    scope = run(4)
    # A world of one: every rule counts every leaf, so the norm is the plain one.
    assert float(scope["norm"]) == pytest.approx(math.sqrt(32 + 4 + 16))
    assert float(scope["grads"]["ln"][0]) == pytest.approx(1 / (math.sqrt(52) + 1e-6), rel=1e-6)


def test_fsdp2_example():
    """Under torchrun the process group exists; here it is a world of one rank."""
    pytest.importorskip("torch")
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        scope = run(5)
        norm, net = scope["norm"], scope["net"]
        assert isinstance(norm, DTensor) and all(p.is_replicate() for p in norm.placements)
        grads = [p.grad.full_tensor() for p in net.parameters()]
        clipped = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        assert clipped == pytest.approx(min(1.0, float(norm.full_tensor())), rel=1e-5)
        assert float(norm.full_tensor()) > 1.0  # the clip bound: the example shows it working
    finally:
        dist.destroy_process_group()


def test_flat_optimizer_example():
    torch = pytest.importorskip("torch")
    scope = run(6)
    net, opt, norm = scope["net"], scope["opt"], scope["norm"]
    assert isinstance(norm, torch.Tensor) and norm.dtype == torch.float64 and float(norm) > 0
    for p in net.parameters():
        assert 5 < float(opt.state[p]["step"]) <= 8  # a scaled step with NaN or inf is skipped
        assert opt.state[p]["exp_avg"].untyped_storage().data_ptr() != p.untyped_storage().data_ptr()
    assert opt.param_groups[1]["weight_decay"] == 0.0 and opt.param_groups[0]["lr"] < 1e-3  # the schedule ran
    assert scope["scaler"].get_scale() > 0 and float(opt.last_grad_norm) < 1e3  # unscaled


def test_step_stats_example():
    torch = pytest.importorskip("torch")
    scope = run(7)
    logged, ratio = scope["logged"], scope["ratio"]
    assert len(logged) == 2 and logged[0]["grad_norm"] > 0 and logged[0] != logged[1]
    names = [n for n, _ in scope["model"].named_parameters()]
    assert set(logged[1]) == {"grad_norm"} | {f"{n}/{c}" for n in names
                                               for c in ("grad_norm", "update_norm", "update_ratio")}
    assert ratio.dtype == torch.float64 and float(ratio) == logged[1]["2.weight/update_ratio"]


def test_compiled_clip_example():
    torch = pytest.importorskip("torch")
    try:
        scope = run(8)
    finally:
        torch._dynamo.reset()
    norm, net = scope["norm"], scope["net"]
    assert norm.dtype == torch.float32 and float(norm) > 0
    clipped = math.sqrt(sum(float(p.grad.double().square().sum()) for p in net.parameters()))
    assert clipped == pytest.approx(min(float(norm), 0.5), rel=1e-5)
