"""The machine's limits over one contiguous buffer of the workload's bytes.

"reduce" reads N bytes once (np.dot on a CPU, a CuPy sum on a GPU); "copy"
reads and writes them (np.copyto on a CPU; on a GPU the faster of a copy
kernel and a device-to-device memcpy). Both run on float32 buffers of the same
byte count whatever the workload's dtype: float16 np.dot has no BLAS path and
would time NumPy's fallback loop, not memory.

The floors are timed again right before each operation's cases, so a ratio
compares figures taken under the same load on a shared machine.
"""
from __future__ import annotations

from .timing import measure


class Floors:
    def __init__(self, ctx):
        xp, n = ctx.xp, max(ctx.nbytes // 4, 1)
        self.ctx = ctx
        self.src = xp.full(n, 0.5, xp.float32)  # touched pages, finite squares
        self.dst = xp.zeros(n, xp.float32)

    def _host(self):
        import numpy as np

        src, dst = self.src, self.dst
        return {"reduce": [("np.dot", lambda: np.dot(src, src))],
                "copy": [("np.copyto", lambda: np.copyto(dst, src))]}

    def _cuda(self):
        cp, src, dst = self.ctx.xp, self.src, self.dst
        kernel = cp.ElementwiseKernel("T x", "T y", "y = x", "bench_copy")
        return {"reduce": [("cupy.sum", lambda: cp.sum(src))],
                "copy": [("copy kernel", lambda: kernel(src, dst)),
                         ("memcpy D2D", lambda: dst.data.copy_from_device_async(src.data, src.nbytes))]}

    def measure(self, parts, settings) -> list:
        """One row per part: the fastest of that part's candidates."""
        timer, ctx = self.ctx.device.timer, self.ctx
        candidates = self._host() if ctx.device.name == "cpu" else self._cuda()
        rows = []
        for part in parts:
            timed = [(impl, measure(fn, timer, settings)[0]) for impl, fn in candidates[part]]
            impl, t = min(timed, key=lambda it: it[1].median_s)
            nbytes = ctx.nbytes * (1 if part == "reduce" else 2)
            rows.append({"part": part, "impl": impl, "median_ms": t.median_s * 1e3,
                         "min_ms": t.min_s * 1e3, "reps": t.reps, "bytes": nbytes,
                         "gb_s": nbytes / t.median_s / 1e9})
        return rows
