"""``python -m bench --device-time``: each gpuflat, PyTorch and CuPy operation
timed as a CUDA-graph replay, beside its eager wall clock.

An eager call's figure holds its host work (Python, tables, launches) as
well as its kernels, and on a GPU whose kernels are fast that host work can
be most of it. Here each operation is warmed on a side stream, one call is
captured into a CUDA graph, and the replays are timed by the run's CUDA
events, the L2 rewritten before each as for every other device figure: the
replay launches the captured kernels with no Python, so its time is the
kernels and the gaps the GPU leaves between them. Beside it, the eager call's
wall clock: the call and a device synchronisation, the device idle at the
start.

CuPy operations (gpuflat's, the CuPy peers', the floors) are captured by
CuPy's stream capture in relaxed mode, their allocations drawn from a memory
pool of the graph's own, kept while the graph lives (as ``torch.cuda.graph``
keeps a private pool): the pool is the only memory the capture may
allocate. PyTorch operations, gpuflat's PyTorch front ends among them, are
captured by ``torch.cuda.graph``, whose private pool is the only one
PyTorch's caching allocator may hand out during a capture. A call that
cannot be captured (a host read, a synchronisation, an upload) gives a row
saying why, and no device figure. JAX runs on streams of its own, which
neither capture sees: its rows stay on the host clock.
"""
from __future__ import annotations

import contextlib
import gc
import time

from . import machine, report, timing, workloads
from .impls import split_available
from .ops import moved_bytes

CLOCK = "graph"
EAGER_CLOCK = "wall clock: the call and a device synchronisation, the device idle at the start"


class Uncapturable(Exception):
    """A call could not be captured into a CUDA graph; the message says why."""


def cupy_capture(cupy, fn, warmup=1, before=None):
    """(replay, what the captured call returned): ``fn`` warmed ``warmup``
    times on a side stream, then one call captured there. ``replay()``
    launches the graph on the current stream and returns that result, which
    the replay rewrites. ``before()``, if given, runs ahead of each warm-up.
    """
    device, side, pool = cupy.cuda.Device(), cupy.cuda.Stream(non_blocking=True), cupy.cuda.MemoryPool()
    device.synchronize()  # the side stream meets every earlier write
    with side:
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
    device.synchronize()
    with side, cupy.cuda.using_allocator(pool.malloc):
        side.begin_capture(mode=cupy.cuda.runtime.streamCaptureModeRelaxed)
        try:
            result = fn()
        except Exception as exc:
            with contextlib.suppress(Exception):  # the capture is void; leave capture mode all the same
                side.end_capture()
            raise Uncapturable(f"{type(exc).__name__}: {exc}") from exc
        graph = side.end_capture()

    def replay():
        graph.launch()
        return result
    replay.pool = pool  # the graph's memory lives as long as its replay
    return replay, result


def torch_capture(torch, fn, warmup=1, before=None):
    """(replay, what the captured call returned), as :func:`cupy_capture`,
    captured by ``torch.cuda.graph``; ``replay()`` runs on PyTorch's current stream."""
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        for _ in range(warmup):
            if before is not None:
                before()
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            result = fn()
    except Exception as exc:
        raise Uncapturable(f"{type(exc).__name__}: {exc}") from exc

    def replay():
        graph.replay()
        return result
    return replay, result


def _on_torch_stream(cupy):
    """CuPy's stream context over PyTorch's current stream, so the timer's
    events and the L2 rewrite sit in the stream a PyTorch graph replays on."""
    import torch

    from gpuflat._src.arrays import external_stream

    return external_stream(cupy, torch.cuda.current_stream().cuda_stream, cupy.cuda.Device().id)


def _capture(case, ctx, settings, before):
    """(replay, stream context to time it in) of ``case``, by the capture its arrays need."""
    if case.graph == "torch":
        import torch

        replay, _ = torch_capture(torch, case.fn, settings.warmup, before)
        return replay, _on_torch_stream(ctx.xp)
    replay, _ = cupy_capture(ctx.xp, case.fn, settings.warmup, before)
    return replay, contextlib.nullcontext()


def _eager(case, ctx, settings, before, budget):
    """The eager call's wall clock: the call and a device synchronisation (JAX's calls wait themselves)."""
    sync = ctx.xp.cuda.Device().synchronize

    def call():
        result = case.fn()
        sync()
        return result
    return timing.measure(call, ctx.device.timer.own_streams, settings, before=before, budget_s=budget)[0]


def run_case(case, op, ctx, settings, deadline=None) -> dict:
    """One row: the replay's device time (``clock: "graph"``) and the eager
    call's wall clock, or why the call could not be captured; a JAX case
    (streams of its own) keeps the host clock of the default run."""
    from . import run

    if case.own_streams or case.skip:
        return run.run_case(case, op, ctx, settings, deadline)
    row = {"workload": ctx.workload, "dtype": ctx.dtype, "op": op, "impl": case.impl, "library": case.library,
           "kind": case.kind, "clock": CLOCK, "eager_clock": EAGER_CLOCK, "capture": case.graph,
           "compile_ms": None}
    budget = run.budget_of(case, settings, deadline)
    if budget is not None and budget <= 0:
        return {**row, "status": "skipped", "reason": f"not run: {run.OUT_OF_TIME}"}
    before = ctx.restore(op)
    gc.collect()
    try:
        eager = _eager(case, ctx, settings, before, budget)
        row.update(eager_wall_ms=eager.median_s * 1e3, eager_reps=eager.reps)
        replay, stream = _capture(case, ctx, settings, before)
        with stream:
            t, result = timing.measure(replay, ctx.device.timer, settings, before=before, budget_s=budget)
        status, err = run.check(case, result, op, ctx)
    except Uncapturable as exc:
        return {**row, "status": "uncapturable", "reason": str(exc)[:300]}
    except timing.OverBudget as exc:
        return {**row, "status": "skipped", "reason": str(exc)}
    except Exception as exc:
        return {**row, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    nbytes = moved_bytes(op, ctx.nbytes, ctx.out.nbytes)
    return {**row, "status": status, "rel_err": err, "median_ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3,
            "reps": t.reps, "cut_by_budget": t.cut, "bytes": nbytes,
            "gb_s": nbytes / t.median_s / 1e9 if nbytes and t.median_s > 0 else None}


def floor_capture(ctx, settings):
    """What :class:`bench.floors.Floors` times instead of a floor's call: its graph's replay."""
    return lambda fn: cupy_capture(ctx.xp, fn, settings.warmup)[0]


def main(args) -> int:
    """Every chosen workload and dtype, replayed; writes ``<stem>-device-time.json`` and prints its table."""
    from . import progress as progress_bar
    from . import run
    from .ops import OPS

    began = time.perf_counter()
    device = run.make_device("cuda" if args.device == "auto" else args.device)
    if device.name != "cuda":
        raise SystemExit("--device-time: CUDA graphs need a GPU, and this run has none (--device cpu)")
    deadline = None if args.time_limit is None else began + args.time_limit
    settings = timing.QUICK if args.quick else timing.FULL
    spec = workloads.load(args.workloads_file)
    todo = run.units(args, spec, device.name)
    providers, absent = split_available(device)
    results = {"machine": machine.describe(device.name, device.xp), "device": device.name, "mode": "device-time",
               "backends": list(device.backends), "clock": CLOCK, "eager_clock": EAGER_CLOCK, "quick": args.quick,
               "settings": vars(settings), "time_limit_s": args.time_limit, "absent": absent, "rows": [],
               "floors": [], "notes": []}
    stem = (args.name or machine.name(device.name, device.xp)) + ("-quick" if args.quick else "") + "-device-time"
    progress = progress_bar.bar(len(todo) * len(OPS))
    try:
        for name, label in todo:
            rows, floors, notes = run.run_unit(name, label, spec[name], device, providers, settings, progress,
                                               deadline, run_one=run_case, floor_capture=floor_capture)
            results["rows"] += rows
            results["floors"] += floors
            results["notes"] += notes
            report.write(results, args.out, stem)
            gc.collect()
    finally:
        progress.close()
    results["wall_s"] = time.perf_counter() - began
    (path,) = report.write(results, args.out, stem)
    print(report.device_time_text(results))
    print(f"\nwrote {path}")
    return 0

