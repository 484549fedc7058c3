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

``gpuflat.torch.clip_grad_norm_``, and a clipped ``gpuflat.torch.AdamW``
step, are timed the same way on PyTorch tensors
(parameters with gradients over the same memory), the CUDA backend on the
no-launch runtime serving them (``tensor_table.serve_with``): the table
built from each tensor's metadata, the checks and the launches, with the
metadata reads PyTorch itself charges. PyTorch here may have no CUDA tensors;
its CPU tensors answer ``data_ptr()``, ``stride()`` and the rest at the same
cost. Three ways a training loop hands the gradients over: the same tensors
every step; new tensor objects in the same memory (``zero_grad()`` sets them
to None and backward allocates them again where they were); and gradients in
other memory every step (more layouts than the tables kept, so every call
builds its table again).
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager

import numpy as np

import gpuflat as gf
from gpuflat._src import tensor_table
from gpuflat._src.backends import get_backend
from gpuflat._src.backends.cuda_runtime import EmulatedRuntime

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
    (1, False)
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


DROP_IN = "gpuflat.torch clip_grad_norm_"
STEP = "gpuflat.torch AdamW(max_norm=1.0) step"
# Gradient sets the "moved" call rotates through: one more than the tables
# gpuflat.torch keeps, so no call finds its table again.
MOVED_SETS = tensor_table.TABLES_KEPT + 1
MOVED_BYTES = 1 << 28  # their copies are made only for trees this small (the 10,000-leaf one)


def _torch_calls(leaves, backend):
    """(name, (call, before)) of the drop-in on parameters whose gradients
    are views of ``leaves`` (NumPy or CuPy), served by ``backend``."""
    import torch

    import gpuflat.torch as gft

    grads = [_tensor(torch, a).view(-1) for a in leaves]
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    moved = ([[g.clone() for g in grads] for _ in range(MOVED_SETS)]
             if sum(a.nbytes for a in leaves) * MOVED_SETS <= MOVED_BYTES else None)
    turn = itertools.count()

    def clip():
        with tensor_table.serve_with(backend):
            gft.clip_grad_norm_(params, 1.0)

    def regrad(sets):
        k = next(turn) % len(sets)
        for p, g in zip(params, sets[k]):
            p.grad = g.view_as(g)

    opt = gft.AdamW(params, lr=1e-4, max_norm=1.0)

    def step():
        with tensor_table.serve_with(backend):
            opt.step()

    calls = {f"{DROP_IN} (the same gradients)": (clip, None),
             f"{DROP_IN} (new gradient tensors, same memory)": (clip, lambda: regrad([grads]))}
    if backend.name == "emulated":
        # The step's host work alone. Its tensors here are the CPU's, which a
        # step on the CUDA runtime cannot take (its state and norm would be
        # host arrays): on a GPU the step rows time CUDA tensors.
        calls[f"{STEP} (the same gradients)"] = (step, None)
        calls[f"{STEP} (new gradient tensors, same memory)"] = (step, lambda: regrad([grads]))
    if moved is not None:
        calls[f"{DROP_IN} (gradients in other memory)"] = (clip, lambda: regrad(moved))
    return calls


def _tensor(torch, a):
    return torch.from_numpy(a) if isinstance(a, np.ndarray) else torch.from_dlpack(a)


def _rows(name, tree, backend, runtime_label, stats, timer, settings, only="") -> list:
    leaves = len(gf.plan(tree).leaves)
    rows = []
    where = {"workload": name, "leaves": leaves, "runtime": runtime_label}
    try:
        calls = {call: (fn, None) for call, fn in _calls(tree, backend).items()}
    except Exception as exc:  # reported as a row, never a crash of the run
        return [{**where, "call": "gf.resident(tree)", **_error(exc)}]
    try:
        calls.update(_torch_calls(gf.trainables(tree), get_backend(backend)))
    except Exception as exc:  # PyTorch absent, or the tensors refused: a row saying so
        rows.append({**where, "call": DROP_IN, **_error(exc)})
    for call, (fn, before_each) in calls.items():
        if not call.startswith(only):
            continue
        try:
            t, _ = timing.measure(fn, timer, settings, before_each)
            if before_each is not None:
                before_each()
            before = stats.snapshot()
            fn()
        except Exception as exc:
            rows.append({**where, "call": call, **_error(exc)})
            continue
        launches, syncs, uploads = (b - a for a, b in zip(before, stats.snapshot()))
        rows.append({**where, "call": call, "status": "ok", "us_per_call": t.median_s * 1e6, "clock": timer.clock,
                     "reps": t.reps, "launches": launches, "syncs": syncs, "uploads": uploads})
    return rows


def _error(exc) -> dict:
    return {"status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}


def measure(spec, settings, cupy=None, only="") -> list:
    """One row per workload, runtime and call (those whose name starts with
    ``only``): median host µs per call, and the launches, host
    synchronisations and table uploads of one more call."""
    rows = []
    for name in WORKLOADS:
        if name not in spec:
            continue
        tree = workloads.build(name, spec[name], "float32", alloc=np.empty).tree
        runtime = NoLaunchRuntime()
        with emulated_backend_on(runtime):
            rows += _rows(name, tree, "emulated", NO_LAUNCH, runtime.stats, timing.HostTimer(), settings, only)
        if cupy is not None:
            tree = workloads.build(name, spec[name], "float32", alloc=cupy.empty).tree
            stats = get_backend("cuda").stats
            rows += _rows(name, tree, "cuda", "cuda", stats, IssueTimer(cupy), settings, only)
        del tree
    return rows
