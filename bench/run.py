"""``python -m bench``: every workload x dtype x operation, gpuflat on each of its
backends beside the installed peers and the machine's floors, in one process.

Writes ``<machine>.json`` and ``<machine>.png`` (``-quick`` added for quick
runs) under ``--out`` and prints the side-by-side table, the host cost per
call of gpuflat's norm and clip, and the targets met or missed.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

from . import chart, host_cost, machine, report, timing, workloads
from .arrays import rel_err
from .impls import gpuflat_impl, jax_peers, split_available
from .ops import OPS, moved_bytes

# --quick on a CPU: the many-leaves case and the mixed-dtype tree, under a
# minute on 2 cores; on a GPU: what its targets are judged on (bench/targets.py).
QUICK_UNITS = {"cpu": (("tiny-10k", "float32"), ("mixed", "mixed")),
               "cuda": (("gpt2-small", "float32"), ("gpt2-small", "bfloat16"), ("tiny-10k", "float32"))}


def _workload_list(path) -> str:
    """One line per workload of the file: name, leaf count, what it models."""
    try:
        spec = workloads.load(path)
    except (OSError, ValueError) as exc:
        return f"(could not read {path}: {exc})"
    lines = []
    for name, w in spec.items():
        count = w.get("count") or len(w.get("params", ())) or w.get("repeat", {}).get("count", "?")
        lines.append(f"  {name:<12} {count} arrays: {w.get('about', '')}")
    return "\n".join(lines)


def parser(argv=None) -> argparse.ArgumentParser:
    """The command line, its help listing the workloads of the file ``argv`` names.

    >>> "tiny-10k" in parser([]).format_help()
    True
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--workloads-file", default=str(workloads.DEFAULT_FILE))
    path = pre.parse_known_args(argv)[0].workloads_file
    p = argparse.ArgumentParser(
        prog="python -m bench", description="gpuflat on each of its backends beside the installed peers and the machine's\n"
                    "floors: every workload x dtype x operation, medians and ratios; then the\n"
                    "host cost per call of norm and clip, and the targets met or missed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"workloads in {path}:\n{_workload_list(path)}")
    quick = {device: ", ".join(f"{w} {d}" for w, d in todo) for device, todo in QUICK_UNITS.items()}
    p.add_argument("--quick", action="store_true",
                   help=f"fewer repeats, and unless --workloads or --dtypes say otherwise: on a CPU "
                        f"{quick['cpu']} (under a minute on 2 cores; the tests run it); on a GPU the "
                        f"workloads of its targets, {quick['cuda']}")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and PNG (default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU when CuPy sees one, else the CPU (default: %(default)s)")
    p.add_argument("--workloads", help="comma-separated workload names (listed below); default: all")
    p.add_argument("--dtypes", help="comma-separated, from " + ",".join(workloads.DTYPE_LABELS)
                   + "; default: all (float32 with --quick); the mixed tree always runs in its own dtypes")
    p.add_argument("--workloads-file", default=str(workloads.DEFAULT_FILE),
                   help="JSON file of parameter shapes (default: %(default)s)")
    p.add_argument("--jax-max-leaves", type=int, default=jax_peers.MAX_LEAVES,
                   help="JAX is not attempted on trees with more leaves: its compile time grows "
                        "faster than linearly with them (default: %(default)s)")
    p.add_argument("--name", help="file name stem instead of the machine's name")
    p.add_argument("--all", action="store_true", help="also print one line per implementation timed")
    p.add_argument("--time-limit", type=float, metavar="SECONDS",
                   help="start no operation, and time no case, past this many seconds from the start; "
                        "what is left is named as not run (default: no limit)")
    p.add_argument("--device-time", action="store_true",
                   help="on a GPU: each gpuflat, PyTorch and CuPy operation (and floor) timed as a CUDA-graph "
                        "replay, no host work in it, beside its eager wall clock; JAX rows stay on the host "
                        "clock; an operation that cannot be captured says why (bench/graphs.py); written to "
                        "<name>-device-time.json")
    p.add_argument("--step-only", action="store_true",
                   help="only the optimizer step rows (bench/step.py): clip + AdamW, PyTorch's against "
                        "gpuflat's, written to <name>-step.json")
    return p


def parse(argv):
    return parser(argv).parse_args(argv)


def _cupy_with_device():
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # not installed, no driver, no device: all mean "no GPU"
        return None


def make_device(choice: str):
    from .context import Device

    cupy = _cupy_with_device() if choice in ("auto", "cuda") else None
    if choice == "cuda" and cupy is None:
        sys.exit("--device cuda: CuPy sees no GPU")
    if cupy is not None:
        return Device("cuda", cupy, ("cuda",), timing.CudaEventTimer(cupy))
    import numpy

    return Device("cpu", numpy, gpuflat_impl.cpu_backends(), timing.HostTimer())


def units(args, spec, device: str = "cpu") -> list:
    """(workload, dtype) pairs to run, in order.

    >>> units(parse(["--quick"]), workloads.load(), "cuda")[1]
    ('gpt2-small', 'bfloat16')
    """
    if args.quick and not (args.workloads or args.dtypes):
        return list(QUICK_UNITS[device])
    names = args.workloads.split(",") if args.workloads else tuple(spec)
    dtypes = args.dtypes.split(",") if args.dtypes else (
        ["float32"] if args.quick else list(workloads.DTYPE_LABELS))
    return [(n, d) for n in names for d in workloads.dtypes_for(spec[n], dtypes)]


def check(case, result, op, ctx):
    """(status, relative error against the float64 reference)."""
    if case.value is None:
        return "ok", None
    err = rel_err(case.value(result), ctx.expected(op))
    return ("ok" if err <= ctx.rtol else "wrong"), err


def run_case(case, op, ctx, settings, deadline=None) -> dict:
    """Time one case and check its answer; failures become rows, never crashes.

    A peer's row takes at most ``settings.peer_budget_s`` (fewer repeats if
    need be, and the row says so); no row runs past ``deadline`` (a
    ``time.perf_counter()`` reading).
    """
    timer = ctx.device.timer.own_streams if case.own_streams else ctx.device.timer
    row = {"workload": ctx.workload, "dtype": ctx.dtype, "op": op, "impl": case.impl,
           "library": case.library, "kind": case.kind, "clock": timer.clock,
           "compile_ms": None if case.compile_s is None else case.compile_s * 1e3}
    if case.skip:
        return {**row, "status": "skipped", "reason": case.skip}
    budget = budget_of(case, settings, deadline)
    if budget is not None and budget <= 0:
        return {**row, "status": "skipped", "reason": f"not run: {OUT_OF_TIME}"}
    if case.kind == "peer":
        row["budget_s"] = budget
    gc.collect()
    try:
        t, result = timing.measure(case.fn, timer, settings, before=ctx.restore(op), budget_s=budget)
        status, err = check(case, result, op, ctx)
    except timing.OverBudget as exc:
        return {**row, "status": "skipped", "reason": str(exc)}
    except Exception as exc:
        return {**row, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    del result
    nbytes = moved_bytes(op, ctx.nbytes, ctx.out.nbytes)
    return {**row, "status": status, "rel_err": err, "median_ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3,
            "reps": t.reps, "cut_by_budget": t.cut, "bytes": nbytes,
            "gb_s": nbytes / t.median_s / 1e9 if nbytes and t.median_s > 0 else None}


def budget_of(case, settings, deadline):
    """Seconds ``case`` may take: a peer's budget, and no further than the deadline; None: unbounded."""
    left = None if deadline is None else deadline - time.perf_counter()
    if case.kind != "peer":
        return left
    return settings.peer_budget_s if left is None else min(settings.peer_budget_s, left)


def run_unit(name, label, spec, device, providers, settings, progress, deadline=None, run_one=run_case,
             floor_capture=None):
    """(rows, floor rows, notes) for one workload in one dtype; the operations
    not begun by ``deadline`` are named in a note, not run. ``run_one`` times
    each case (:func:`run_case`; ``bench.graphs.run_case`` replays it);
    ``floor_capture(ctx, settings)``, if given, makes what the floors time
    of each floor call (``bench.graphs``: its graph's replay)."""
    from .context import build
    from .floors import Floors

    if _past(deadline):
        progress.update(len(OPS))
        return [], [], [f"{name} {label}: not run: {OUT_OF_TIME}"]
    progress.set_description(f"{name} {label} setup")
    try:
        ctx = build(workloads.build(name, spec, label), device)
    except Exception as exc:  # e.g. bfloat16 where the array library has none
        progress.update(len(OPS))
        return [], [], [f"{name} {label}: not run ({type(exc).__name__}: {exc})"[:300]]
    capture = None if floor_capture is None else floor_capture(ctx, settings)
    rows, floors, limits = [], [], Floors(ctx, capture)
    for i, op in enumerate(OPS):
        if _past(deadline):
            progress.update(len(OPS) - i)
            return rows, floors, [f"{name} {label}: {', '.join(OPS[i:])} not run: {OUT_OF_TIME}"]
        progress.set_description(f"{name} {label} {op}")
        where = {"workload": name, "dtype": label, "op": op}
        floors += [{**where, **f} for f in limits.measure(op, settings)]
        for provider in providers:
            try:
                cases = provider.cases(op, ctx)
            except Exception as exc:  # a setup that fails (a resident model, say) is a row too
                rows.append(_setup_error(provider, op, ctx, exc))
                continue
            rows += [run_one(case, op, ctx, settings, deadline) for case in cases]
        progress.update()
    return rows, floors, limits.notes


OUT_OF_TIME = "the run's time limit (--time-limit) was reached"


def _past(deadline) -> bool:
    return deadline is not None and time.perf_counter() >= deadline


def _write(results, out, stem) -> list:
    """The results' JSON (with their verdicts) and chart, from what was measured so far."""
    paths = report.write(results, out, stem)
    paths.append(chart.write(results, out, stem))
    return paths


def _setup_error(provider, op, ctx, exc) -> dict:
    library = provider.library_name(ctx.device)
    return {"workload": ctx.workload, "dtype": ctx.dtype, "op": op, "impl": f"{library} (setup)",
            "library": library, "kind": "gpuflat" if provider is gpuflat_impl else "peer",
            "compile_ms": None, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}


def main(argv=None) -> int:
    from . import progress as progress_bar

    began, args = time.perf_counter(), parse(argv)
    if args.step_only:
        from . import step

        return step.main(args)
    if args.device_time:
        from . import graphs

        return graphs.main(args)
    deadline = None if args.time_limit is None else began + args.time_limit
    jax_peers.MAX_LEAVES = args.jax_max_leaves
    device = make_device(args.device)
    settings = timing.QUICK if args.quick else timing.FULL
    spec = workloads.load(args.workloads_file)
    todo = units(args, spec, device.name)
    providers, absent = split_available(device)
    results = {"machine": machine.describe(device.name, device.xp), "device": device.name,
               "backends": list(device.backends), "clock": device.timer.clock, "quick": args.quick,
               "settings": vars(settings), "time_limit_s": args.time_limit, "absent": absent, "rows": [],
               "floors": [], "notes": gpuflat_impl.notes(device)}
    stem = (args.name or machine.name(device.name, device.xp)) + ("-quick" if args.quick else "")
    progress = progress_bar.bar(len(todo) * len(OPS))
    try:
        # The host-cost rows first, then the workloads in order (the targets'
        # first): after each, the JSON, its verdicts and the chart are written
        # from what was measured, so a run cut short keeps all it finished.
        progress.set_description("host cost per call")
        results["host_cost"] = host_cost.measure(spec, settings, device.xp if device.name == "cuda" else None)
        _write(results, args.out, stem)
        for name, label in todo:
            rows, floors, notes = run_unit(name, label, spec[name], device, providers, settings, progress,
                                           deadline)
            results["rows"] += rows
            results["floors"] += floors
            results["notes"] += notes
            _write(results, args.out, stem)
            gc.collect()
    finally:
        progress.close()
    results["wall_s"] = time.perf_counter() - began
    paths = _write(results, args.out, stem)
    print(report.text(results, every=args.all))
    print("\nwrote " + ", ".join(str(p) for p in paths if p))
    return 0
