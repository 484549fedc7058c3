"""Launching test ranks on this machine and collecting what each reported:
shared by the multi-process tests (tests/test_distributed.py,
tests/test_dtensor.py), whose workers write ``rank<r>.json`` into a folder."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import traceback


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
            results[name] = traceback.format_exc(limit=4)
        with open(os.path.join(out_dir, f"rank{ctx.rank}.json"), "w") as f:
            json.dump(results, f)
