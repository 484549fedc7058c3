"""gpuflat.torch.AdamW and SGD under FSDP2 (``fully_shard``), beside
torch.optim after ``torch.nn.utils.clip_grad_norm_`` on an identically
initialised model: training, CPU offload, and state saved and resumed
through torch.distributed.checkpoint.

The cases live in tests/fsdp_optim_worker.py. Starting a process group costs
seconds and these machines have 2 cores, so each world size runs every case
in one launch of gloo ranks on 127.0.0.1, under an explicit timeout; each
case is then its own test here, passing when every rank reported it ok.
"""
from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import fsdp_optim_worker  # noqa: E402
from ranks import Launches, check_case  # noqa: E402

LAUNCH_TIMEOUT = {2: 180, 4: 360}  # seconds for one launch; a hang fails every case of it
LAUNCHES = Launches(Path(__file__).with_name("fsdp_optim_worker.py"), LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    return lambda size: LAUNCHES.get(size, tmp_path_factory)


@pytest.mark.timeout(LAUNCH_TIMEOUT[4] + 60)
@pytest.mark.parametrize("size,case", [pytest.param(n, name, id=f"gloo-{n}-{name}")
                                       for n in (2, 4) for name in fsdp_optim_worker.CASES])
def test_case_on_every_rank(report, size, case):
    check_case(*report(size), case)
