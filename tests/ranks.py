"""Launching test ranks on this machine and collecting what each reported:
shared by the multi-process tests (tests/test_distributed.py,
tests/test_dtensor.py), whose workers write ``rank<r>.json`` into a folder."""
from __future__ import annotations

import json
import socket
import subprocess


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
