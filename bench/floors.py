"""The machine's limits over contiguous buffers of the bytes an operation moves.

"reduce" reads the tree's N bytes once (np.dot on a CPU, a CuPy sum on a
GPU); "copy" reads and writes a buffer (np.copyto on a CPU; on a GPU the
faster of a copy kernel and a device-to-device memcpy) sized so that it moves
what the operation's copy does: a clip's scale reads and writes the N bytes
(2N moved), while flatten reads N and writes the flat buffer's F bytes and
scatter reads F and writes N (N + F moved, a copy of (N + F) / 2 bytes).
F is N where every leaf has the buffer's dtype; a mixed tree's buffer holds
every leaf in the widest dtype (float64 for the mixed workload: F about 2N, so
3N moved, not the 2N of a copy of the tree's bytes). Both floors run on
float32 buffers whatever the workload's dtype: float16 np.dot has no BLAS
path and would time NumPy's fallback loop, not memory.

The floors are timed again right before each operation's cases, so a ratio
compares figures taken under the same load on a shared machine.
"""
from __future__ import annotations

from .ops import FLOOR_PARTS, TREE_AND_BUFFER, moved_bytes
from .timing import measure


def part_bytes(op, part, tree_bytes, buffer_bytes) -> int:
    """The bytes one floor part of ``op`` reads (``reduce``) or copies
    (``copy``: half the bytes it moves), for a tree of ``tree_bytes`` whose
    flat buffer holds ``buffer_bytes``.

    >>> part_bytes("global_norm", "reduce", 1000, 2000)
    1000
    >>> part_bytes("clip", "copy", 1000, 2000)  # the scale reads and writes the tree
    1000
    >>> part_bytes("flatten", "copy", 1000, 2000)  # reads 1000, writes 2000: 3000 moved
    1500
    """
    if part == "copy" and op in TREE_AND_BUFFER:
        return moved_bytes(op, tree_bytes, buffer_bytes) // 2
    return tree_bytes


class Floors:
    """``capture(fn)``, if given, makes what is timed of each floor call
    (``bench.graphs``: the replay of its CUDA graph); a call it refuses
    (``bench.graphs.Uncapturable``) is left out of the candidates, and
    ``notes`` says why."""

    def __init__(self, ctx, capture=None):
        self.ctx = ctx
        self.capture = capture
        self.notes: list = []
        self._pairs = {}  # float32 elements -> (source, destination), made on first use

    def buffers(self, op, part):
        """The source and destination float32 buffers ``op``'s ``part`` runs on."""
        n = max(part_bytes(op, part, self.ctx.nbytes, self.ctx.out.nbytes) // 4, 1)
        if n not in self._pairs:
            xp = self.ctx.xp
            self._pairs[n] = (xp.full(n, 0.5, xp.float32),  # touched pages, finite squares
                              xp.zeros(n, xp.float32))
        return self._pairs[n]

    def _host(self, src, dst):
        import numpy as np

        return {"reduce": [("np.dot", lambda: np.dot(src, src))],
                "copy": [("np.copyto", lambda: np.copyto(dst, src))]}

    def _cuda(self, src, dst):
        cp = self.ctx.xp
        kernel = cp.ElementwiseKernel("T x", "T y", "y = x", "bench_copy")
        return {"reduce": [("cupy.sum", lambda: cp.sum(src))],
                "copy": [("copy kernel", lambda: kernel(src, dst)),
                         ("memcpy D2D", lambda: dst.data.copy_from_device_async(src.data, src.nbytes))]}

    def _captured(self, op, candidates) -> list:
        """The (impl, what to time) of each candidate: itself, or its replay
        where the floors capture; those that cannot be captured left out."""
        if self.capture is None:
            return candidates
        from .graphs import Uncapturable

        out = []
        for impl, fn in candidates:
            try:
                out.append((impl, self.capture(fn)))
            except Uncapturable as exc:
                self.notes.append(f"{self.ctx.workload} {self.ctx.dtype} {op} floor {impl}: not captured: {exc}")
        return out

    def measure(self, op, settings) -> list:
        """One row per floor part of ``op``: the fastest of that part's candidates."""
        timer, ctx = self.ctx.device.timer, self.ctx
        rows = []
        for part in FLOOR_PARTS[op]:
            src, dst = self.buffers(op, part)
            candidates = (self._host if ctx.device.name == "cpu" else self._cuda)(src, dst)[part]
            timed = [(impl, measure(fn, timer, settings)[0]) for impl, fn in self._captured(op, candidates)]
            if not timed:
                continue
            impl, t = min(timed, key=lambda it: it[1].median_s)
            nbytes = src.nbytes * (1 if part == "reduce" else 2)
            rows.append({"part": part, "impl": impl, "median_ms": t.median_s * 1e3,
                         "min_ms": t.min_s * 1e3, "reps": t.reps, "bytes": nbytes,
                         "gb_s": nbytes / t.median_s / 1e9})
        return rows
