"""Medians of repeated runs after warm-up, on the host clock or CUDA events.

The machines are shared and noisy, so each case runs until it has both a
minimum number of repeats and a minimum total time, and the median is kept.
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


QUICK = Settings(warmup=1, min_reps=3, max_reps=15, min_time_s=0.03)
FULL = Settings(warmup=2, min_reps=5, max_reps=60, min_time_s=0.25)


@dataclass(frozen=True)
class Timing:
    median_s: float
    min_s: float
    reps: int


class HostTimer:
    """Wall time of one call: every CPU peer returns only when its work is done."""

    clock = "time.perf_counter"

    def once(self, fn):
        t0 = time.perf_counter()
        result = fn()
        return time.perf_counter() - t0, result


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


def measure(fn, timer, settings: Settings, before=None):
    """(Timing, last result) of ``fn`` after ``settings.warmup`` untimed calls.

    ``before()``, if given, runs untimed ahead of every call (a clip's
    gradients put back, so each call meets the same input).

    >>> calls = []
    >>> t, last = measure(lambda: calls.append("fn") or len(calls), HostTimer(), QUICK, lambda: calls.append("before"))
    >>> calls[:4], t.reps >= QUICK.min_reps, last == len(calls)
    (['before', 'fn', 'before', 'fn'], True, True)
    """
    def once():
        if before is not None:
            before()
        return timer.once(fn)

    for _ in range(settings.warmup):
        once()
    times, result, began = [], None, time.perf_counter()
    while len(times) < settings.max_reps and (
        len(times) < settings.min_reps or time.perf_counter() - began < settings.min_time_s
    ):
        dt, result = once()
        times.append(dt)
    return Timing(statistics.median(times), min(times), len(times)), result
