"""Launching test ranks on this machine and collecting what each reported:
shared by the multi-process tests (tests/test_distributed.py,
tests/test_dtensor.py, tests/test_meshes.py, tests/test_torch_optim_fsdp.py),
whose workers write ``rank<r>.json`` into a folder."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import traceback
from pathlib import Path

# The ranks import gpuflat from this checkout, not from wherever it is installed.
CHECKOUT = str(Path(__file__).resolve().parents[1])
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [CHECKOUT, os.environ.get("PYTHONPATH")])),
           OMP_NUM_THREADS="1")


class Launches:
    """Every case of a worker module (``worker <out_dir> <rank> <size> <port>``),
    run once per world size on gloo ranks over 127.0.0.1 and kept: each
    case's test then reads its ranks' reports. ``timeouts[size]`` bounds one
    launch; a hang fails every case of it."""

    def __init__(self, worker: Path, timeouts: dict):
        self.worker, self.timeouts, self.kept = worker, timeouts, {}

    def get(self, size, tmp_path_factory):
        """(each rank's report, the processes' output) of the launch on ``size`` ranks."""
        if size not in self.kept:
            out_dir = tmp_path_factory.mktemp(f"{self.worker.stem}{size}")
            port = str(free_port())
            procs = [subprocess.Popen([sys.executable, str(self.worker), str(out_dir), str(r), str(size), port],
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV)
                     for r in range(size)]
            self.kept[size] = collect(procs, out_dir, size, self.timeouts[size])
        return self.kept[size]


def check_case(reports, output, case) -> None:
    """AssertionError unless every rank reported ``case`` ok: with every
    failing rank's traceback and the processes' output (one rank's error in
    a collective, a connection reset, is often another rank's failure seen
    from outside), or the output alone where a rank reported nothing."""
    for rank, results in enumerate(reports):
        if case not in results:
            raise AssertionError(f"rank {rank} did not report {case!r}; the processes printed:\n{output[-3000:]}")
    failed = [f"rank {rank}:\n{results[case]}" for rank, results in enumerate(reports) if results[case] != "ok"]
    assert not failed, "\n".join(failed) + f"\nthe processes printed:\n{output[-3000:]}"


def free_port() -> int:
    """A free TCP port on the loopback interface (the ranks never leave it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collect(procs, out_dir, size, timeout):
    """(each rank's report, or {} if it wrote none; the processes' output),
    killing every process if one outlives ``timeout`` seconds."""
    output = []
    for proc in procs:
        try:
            output.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            output.append(f"timed out after {timeout} s")
    reports = []
    for r in range(size):
        path = out_dir / f"rank{r}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    return reports, "\n".join(output)


def run_cases(cases, ctx, out_dir):
    """In a worker: run each (name, function) of ``cases`` on ``ctx``, and
    rewrite ``rank<ctx.rank>.json`` after each with every case's "ok" or
    traceback, so a rank that hangs or dies still reports what it finished."""
    results = {}
    for name, run in cases:
        try:
            run(ctx)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()  # whole: an error inside a collective is frames deep
        with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(results, f)
