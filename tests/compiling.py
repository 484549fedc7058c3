"""What the tests of gpuflat inside torch.compile share (tests/test_torch_ops.py,
tests/test_torch_optim_compile.py): a fresh TorchDynamo around each test, a
small model and its twin, and DTensor parameters on a world of one rank,
which takes the same code paths as many."""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

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


@contextlib.contextmanager
def sharded_twins(seed):
    """(shard, two lists of equal DTensor parameters) on a one-rank mesh,
    ``shard(t)`` making a DTensor like theirs; the process group is gone after."""
    dist = pytest.importorskip("torch.distributed")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        torch.manual_seed(seed)
        values = [torch.randn(6, 4), torch.randn(5)]
        twins = ([nn.Parameter(distribute_tensor(v.clone(), mesh, [Shard(0)])) for v in values] for _ in range(2))
        yield (lambda t: distribute_tensor(t, mesh, [Shard(0)])), *twins
    finally:
        dist.destroy_process_group()
