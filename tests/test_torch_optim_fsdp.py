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

import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import fsdp_optim_worker  # noqa: E402
from ranks import collect, free_port  # noqa: E402

WORKER = Path(__file__).with_name("fsdp_optim_worker.py")
# The ranks import gpuflat from this checkout, not from wherever it is installed.
CHECKOUT = str(Path(__file__).resolve().parents[1])
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")])),
           OMP_NUM_THREADS="1")
LAUNCH_TIMEOUT = {2: 180, 4: 360}  # seconds for one launch; a hang fails every case of it

_reports: dict = {}


def _launch(size, out_dir):
    """Run every case on ``size`` gloo ranks; returns the ranks' reports and the processes' output."""
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(WORKER), str(out_dir), str(r), str(size), port],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
             for r in range(size)]
    return collect(procs, out_dir, size, LAUNCH_TIMEOUT[size])


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    def get(size):
        if size not in _reports:
            _reports[size] = _launch(size, tmp_path_factory.mktemp(f"fsdp{size}"))
        return _reports[size]

    return get


@pytest.mark.timeout(LAUNCH_TIMEOUT[4] + 60)
@pytest.mark.parametrize("size,case", [pytest.param(n, name, id=f"gloo-{n}-{name}")
                                       for n in (2, 4) for name in fsdp_optim_worker.CASES])
def test_case_on_every_rank(report, size, case):
    reports, output = report(size)
    for rank, results in enumerate(reports):
        if case not in results:
            pytest.fail(f"rank {rank} did not report {case!r}; the processes printed:\n{output[-3000:]}")
        assert results[case] == "ok", f"rank {rank}:\n{results[case]}"
