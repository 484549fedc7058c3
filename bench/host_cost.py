"""Host microseconds per call of gpuflat's per-step norm and clip, device work taken away.

On a GPU a clip costs its kernels' device time plus the host time to walk
the tree, check the leaves and issue the launches; only the host part grows
with the number of leaves. Here the CUDA backend runs on a runtime whose
launches are counted and never run, so what is timed is gpuflat's host work
alone: ``gf.global_norm`` and ``gf.clip_grad_norm_`` on the tree (a walk per
call), and a resident model's ``grad_norm`` and ``clip_grad_norm_`` (no walk:
the same work for 148 leaves as for 10,000). The leaves are never read, so
they are left uninitialised. On a CUDA run the same calls are timed again
on the real device, from the call to its return with the device idle at the
start: the host's issue time.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

import gpuflat as gf
from gpuflat.backends import get_backend
from gpuflat.backends.cuda_runtime import EmulatedRuntime

from . import timing, workloads

WORKLOADS = ("gpt2-small", "tiny-10k")
NO_LAUNCH = "no-op launches"


class NoLaunchRuntime(EmulatedRuntime):
    """The emulated device with every launch counted and none run.

    >>> rt = NoLaunchRuntime()
    >>> rt.launch("gf_gather<float>", 1, 32, []); rt.stats.launches
    1
    """

    def _launch(self, name, grid, block, args):
        return None


@contextmanager
def emulated_backend_on(runtime):
    """gpuflat's "emulated" backend (the CUDA backend on the host) launching on ``runtime``.

    >>> rt = NoLaunchRuntime()
    >>> with emulated_backend_on(rt):
    ...     _ = gf.global_norm([np.zeros(3)], backend="emulated")
    >>> rt.stats.launches, get_backend("emulated").runtime is rt
    (2, False)
    """
    backend = get_backend("emulated")
    saved, backend.runtime = backend.runtime, runtime
    try:
        yield backend
    finally:
        backend.runtime = saved


class IssueTimer:
    """Host time from a call to its return, the device idle when it starts."""

    clock = "time.perf_counter after a device synchronize"

    def __init__(self, cupy):
        self.cp, self.host = cupy, timing.HostTimer()

    def once(self, fn):
        self.cp.cuda.get_current_stream().synchronize()
        return self.host.once(fn)


def _calls(tree, backend):
    r = gf.resident(tree, backend=backend)
    return {
        "gf.global_norm(tree)": lambda: gf.global_norm(tree, backend=backend),
        "gf.clip_grad_norm_(tree)": lambda: gf.clip_grad_norm_(tree, 1.0, backend=backend),
        "resident grad_norm()": r.grad_norm,
        "resident clip_grad_norm_()": lambda: r.clip_grad_norm_(1.0),
    }


def _rows(name, tree, backend, runtime_label, stats, timer, settings) -> list:
    leaves = len(gf.plan(tree).leaves)
    rows = []
    where = {"workload": name, "leaves": leaves, "runtime": runtime_label}
    try:
        calls = _calls(tree, backend)
    except Exception as exc:  # reported as a row, never a crash of the run
        return [{**where, "call": "gf.resident(tree)", **_error(exc)}]
    for call, fn in calls.items():
        try:
            t, _ = timing.measure(fn, timer, settings)
            before = stats.snapshot()
            fn()
        except Exception as exc:
            rows.append({**where, "call": call, **_error(exc)})
            continue
        launches, syncs, uploads = (b - a for a, b in zip(before, stats.snapshot()))
        rows.append({**where, "call": call, "status": "ok", "us_per_call": t.median_s * 1e6,
                     "reps": t.reps, "launches": launches, "syncs": syncs, "uploads": uploads})
    return rows


def _error(exc) -> dict:
    return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}


def measure(spec, settings, cupy=None) -> list:
    """One row per workload, runtime and call: median host µs per call, and the
    launches, host synchronisations and table uploads of one more call."""
    rows = []
    for name in WORKLOADS:
        if name not in spec:
            continue
        tree = workloads.build(name, spec[name], "float32", alloc=np.empty).tree
        runtime = NoLaunchRuntime()
        with emulated_backend_on(runtime):
            rows += _rows(name, tree, "emulated", NO_LAUNCH, runtime.stats, timing.HostTimer(), settings)
        if cupy is not None:
            tree = workloads.build(name, spec[name], "float32", alloc=cupy.empty).tree
            stats = get_backend("cuda").stats
            rows += _rows(name, tree, "cuda", "cuda", stats, IssueTimer(cupy), settings)
        del tree
    return rows
