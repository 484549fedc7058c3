"""One timed thing: an implementation of one operation on one workload."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass
class Case:
    """``fn()`` runs the operation once; ``value(result)`` turns its result into
    a float64 array that the run compares with the expected figures, so a fast
    wrong answer is reported as wrong.

    ``skip`` holds why the case could not be built (a peer that lacks the
    dtype, a compile that failed); such cases are reported, never timed.

    ``own_streams``: its work runs on streams of its own (JAX's), which the
    CUDA events of the run's timer do not see; ``fn`` waits for its result
    and is timed on the host clock (the timer's ``own_streams``).

    ``graph``: what captures it into a CUDA graph under ``--device-time``
    (bench/graphs.py): "cupy" (CuPy's stream capture) or "torch"
    (``torch.cuda.graph``, the one capture during which PyTorch's caching
    allocator hands out memory, from the graph's private pool).
    """

    impl: str
    library: str
    fn: Optional[Callable[[], Any]] = None
    value: Optional[Callable[[Any], Any]] = None
    kind: str = "peer"  # "gpuflat" or "peer"
    compile_s: Optional[float] = None
    skip: Optional[str] = None
    own_streams: bool = False
    graph: str = "cupy"


def skipped(impl: str, library: str, reason: str, kind: str = "peer") -> Case:
    """A case that is listed in the results with the reason it did not run."""
    return Case(impl=impl, library=library, kind=kind, skip=reason)
