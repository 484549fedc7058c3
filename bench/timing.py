"""Medians of repeated runs after warm-up, on the host clock or CUDA events.

The machines are shared and noisy, so each case runs until it has both a
minimum number of repeats and a minimum total time, and the median is kept;
unless it has a time budget (a peer's), which may stop it sooner.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Settings:
    warmup: int
    min_reps: int
    max_reps: int
    min_time_s: float
    # Wall seconds a peer's row may take, its warm-up counted: enough for the
    # warm-up and one repeat of a per-leaf loop over 10,000 leaves on a GPU
    # (about 0.3 s of host work a call there, and a timed repeat about three
    # times that: CudaEventTimer's spin holds the GPU for twice it).
    peer_budget_s: float


QUICK = Settings(warmup=1, min_reps=3, max_reps=15, min_time_s=0.03, peer_budget_s=1.5)
FULL = Settings(warmup=2, min_reps=5, max_reps=60, min_time_s=0.25, peer_budget_s=15.0)


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    reps: int
    cut: bool = False  # fewer repeats than the settings' minimum: the time budget ran out


class OverBudget(Exception):
    """The warm-up alone took a case's whole time budget: nothing was timed."""

    def __init__(self, spent_s: float, budget_s: float):
        super().__init__(f"over its {budget_s:.1f} s budget: the warm-up alone took {spent_s:.1f} s")


class HostTimer:
    """Wall time of one call: every CPU peer returns only when its work is done."""

    clock = "time.perf_counter"

    @property
    def own_streams(self):
        """The timer for work on streams of its own (JAX's): this one, whose clock sees all work."""
        return self

    def once(self, fn):
        t0 = time.perf_counter()
        result = fn()
        return time.perf_counter() - t0, result


class GpuHostTimer:
    """Wall time of one call on a GPU, for work the CUDA events cannot see.

    JAX runs its kernels on streams of its own: events recorded on CuPy's
    stream around a JAX call time nothing of it. Its calls wait for their
    result (``block_until_ready``), so the host clock from the call to its
    return holds the device work, and the host work around it. As under
    :class:`CudaEventTimer`, the L2 is rewritten first; then the device is
    left idle, so no earlier work is counted.
    """

    clock = "host clock: time.perf_counter to block_until_ready, the device idle at the start"

    def __init__(self, cupy, scratch):
        self.cp, self.scratch, self.host = cupy, scratch, HostTimer()

    def once(self, fn):
        self.scratch.fill(1)
        self.cp.cuda.Device().synchronize()
        return self.host.once(fn)


# A kernel that keeps one thread of the GPU busy for a number of clock cycles.
_SPIN = r"""
extern "C" __global__ void gpuflat_bench_spin(long long cycles) {
    const long long start = clock64();
    while (clock64() - start < cycles) {}
}
"""


class CudaEventTimer:
    """Device time of one call: from the GPU reaching a start event queued
    before the call's first launch to its reaching an end event after its last.

    Before each call a scratch buffer twice the L2 size is rewritten, so every
    repeat reads its operands from memory rather than from the 60 MB L2: a
    repeat that found them in cache would time the cache. Then a spin kernel
    holds the GPU, ahead of the start event, for twice the host time the
    last call took (1 ms at least): every launch of the call is queued before
    the GPU reaches the start event, so the events time the kernels and the
    gaps the GPU leaves between them, not the host work (Python, tables)
    around and between the launches.
    """

    clock = "cuda events, launches queued behind a spin kernel (device time)"

    def __init__(self, cupy):
        self.cp = cupy
        props = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)
        self.scratch = cupy.empty(2 * int(props.get("l2CacheSize", 64 << 20)), cupy.uint8)
        # The timer for work on streams other than CuPy's (JAX's).
        self.own_streams = GpuHostTimer(cupy, self.scratch)
        self.start, self.end = cupy.cuda.Event(), cupy.cuda.Event()
        self.spin = cupy.RawKernel(_SPIN, "gpuflat_bench_spin")
        self.cycles_per_s = float(props.get("clockRate", 2_000_000)) * 1e3  # clockRate is in kHz
        self.host_s = 1e-3

    def once(self, fn):
        self.scratch.fill(1)
        self.spin((1,), (1,), (int(self.cycles_per_s * max(1e-3, 2 * self.host_s)),))
        self.start.record()
        began = time.perf_counter()
        result = fn()
        self.host_s = time.perf_counter() - began
        self.end.record()
        self.end.synchronize()
        return self.cp.cuda.get_elapsed_time(self.start, self.end) / 1e3, result


def measure(fn, timer, settings: Settings, before=None, budget_s=None):
    """(Timing, last result) of ``fn`` after ``settings.warmup`` untimed calls.

    ``before()``, if given, runs untimed ahead of every call (a clip's
    gradients put back, so each call meets the same input). ``budget_s``,
    if given, bounds the wall time of it all, the warm-up counted: no
    repeat starts that would end past it (judged by the last one), even
    below ``settings.min_reps`` (the Timing says ``cut``); but one repeat
    always runs, unless the warm-up alone took the budget
    (:class:`OverBudget`).

    >>> calls = []
    >>> t, last = measure(lambda: calls.append("fn") or len(calls), HostTimer(), QUICK, lambda: calls.append("before"))
    >>> calls[:4], t.reps >= QUICK.min_reps, last == len(calls), t.cut
    (['before', 'fn', 'before', 'fn'], True, True, False)
    >>> measure(lambda: time.sleep(0.02), HostTimer(), QUICK, budget_s=0.05)[0].reps
    1
    """
    def once():
        if before is not None:
            before()
        return timer.once(fn)

    began = time.perf_counter()
    for _ in range(settings.warmup):
        once()
    if budget_s is not None and time.perf_counter() - began >= budget_s:
        raise OverBudget(time.perf_counter() - began, budget_s)
    times, result, timed_from, last_s = [], None, time.perf_counter(), 0.0
    while len(times) < settings.max_reps and (
        len(times) < settings.min_reps or time.perf_counter() - timed_from < settings.min_time_s
    ):
        if times and budget_s is not None and time.perf_counter() - began + last_s > budget_s:
            break
        t0 = time.perf_counter()
        dt, result = once()
        last_s = time.perf_counter() - t0
        times.append(dt)
    return Timing(statistics.median(times), min(times), len(times), len(times) < settings.min_reps), result
