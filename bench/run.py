"""``python -m bench [--quick] [--out DIR]``: every workload x dtype x operation,
gpuflat beside the installed peers and the machine's floors, in one process (#4).

Writes ``<machine>.json`` and ``<machine>.png`` (``-quick`` added for quick
runs) under ``--out`` and prints the side-by-side table.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

from . import chart, machine, report, timing, workloads
from .arrays import rel_err
from .impls import jax_peers, split_available
from .ops import BYTES_FACTOR, FLOOR_PARTS, OPS, RESIDENT_OPS

QUICK_WORKLOADS = ("tiny-10k", "mixed")  # well under a minute on 2 cores (#4)


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a reduced set in under a minute")
    p.add_argument("--out", default="bench/results", help="folder for the JSON and PNG")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: the GPU when CuPy sees one, else the CPU")
    p.add_argument("--workloads", help="comma-separated names from the workloads file")
    p.add_argument("--dtypes", help="comma-separated: float32,float16,bfloat16")
    p.add_argument("--workloads-file", default=str(workloads.DEFAULT_FILE))
    p.add_argument("--jax-max-leaves", type=int, default=jax_peers.MAX_LEAVES)
    p.add_argument("--name", help="file name stem instead of the machine's name")
    p.add_argument("--all", action="store_true", help="also print one line per implementation")
    return p.parse_args(argv)


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
        return Device("cuda", cupy, "cuda", timing.CudaEventTimer(cupy))
    import numpy

    return Device("cpu", numpy, "numpy", timing.HostTimer())


def units(args, spec):
    names = args.workloads.split(",") if args.workloads else (
        QUICK_WORKLOADS if args.quick else tuple(spec))
    dtypes = args.dtypes.split(",") if args.dtypes else (
        ["float32"] if args.quick else list(workloads.DTYPE_LABELS))
    return [(n, d) for n in names for d in workloads.dtypes_for(spec[n], dtypes)]


def _check(case, result, op, ctx):
    """(status, relative error against the float64 reference)."""
    if case.value is None:
        return "ok", None
    err = rel_err(case.value(result), ctx.expected(op))
    return ("ok" if err <= ctx.rtol else "wrong"), err


def run_case(case, op, ctx, settings) -> dict:
    """Time one case and check its answer; failures become rows, never crashes."""
    row = {"workload": ctx.workload, "dtype": ctx.dtype, "op": op, "impl": case.impl,
           "library": case.library, "kind": case.kind,
           "compile_ms": None if case.compile_s is None else case.compile_s * 1e3}
    if case.skip:
        return {**row, "status": "skipped", "reason": case.skip}
    gc.collect()
    try:
        t, result = timing.measure(case.fn, ctx.device.timer, settings)
        status, err = _check(case, result, op, ctx)
    except Exception as exc:
        return {**row, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]}
    del result
    factor = BYTES_FACTOR[op]
    nbytes = None if factor is None else factor * ctx.nbytes
    return {**row, "status": status, "rel_err": err,
            "median_ms": t.median_s * 1e3, "min_ms": t.min_s * 1e3, "reps": t.reps, "bytes": nbytes,
            "gb_s": None if nbytes is None else nbytes / t.median_s / 1e9}


def run_unit(name, label, spec, device, providers, settings, progress):
    """(rows, floor rows, note) for one workload in one dtype."""
    from .context import build
    from .floors import Floors

    progress.set_description(f"{name} {label} setup")
    try:
        ctx = build(workloads.build(name, spec, label), device)
    except Exception as exc:  # e.g. bfloat16 where the array library has none
        progress.update(len(OPS))
        return [], [], f"{name} {label}: not run ({type(exc).__name__}: {exc})"[:300]
    rows, floors, limits = [], [], Floors(ctx)
    for op in OPS:
        progress.set_description(f"{name} {label} {op}")
        if op in RESIDENT_OPS and ctx.resident_buf is None:
            progress.update()
            continue  # leaves of several dtypes cannot be views of one buffer
        ctx.prepare(op)
        where = {"workload": name, "dtype": label, "op": op}
        floors += [{**where, **f} for f in limits.measure(FLOOR_PARTS[op], settings)]
        for provider in providers:
            for case in provider.cases(op, ctx):
                rows.append(run_case(case, op, ctx, settings))
        progress.update()
    return rows, floors, None


def main(argv=None) -> int:
    from . import progress as progress_bar

    args = parse(argv)
    jax_peers.MAX_LEAVES = args.jax_max_leaves
    device = make_device(args.device)
    settings = timing.QUICK if args.quick else timing.FULL
    spec = workloads.load(args.workloads_file)
    todo = units(args, spec)
    providers, absent = split_available(device)
    results = {"machine": machine.describe(device.name, device.xp), "device": device.name,
               "backend": device.backend, "clock": device.timer.clock, "quick": args.quick,
               "settings": vars(settings), "absent": absent, "rows": [], "floors": [], "notes": []}
    began, progress = time.perf_counter(), progress_bar.bar(len(todo) * len(OPS))
    try:
        for name, label in todo:
            rows, floors, note = run_unit(name, label, spec[name], device, providers, settings, progress)
            results["rows"] += rows
            results["floors"] += floors
            results["notes"] += [note] if note else []
            gc.collect()
    finally:
        progress.close()
    results["wall_s"] = time.perf_counter() - began
    stem = (args.name or machine.name(device.name, device.xp)) + ("-quick" if args.quick else "")
    paths = report.write(results, args.out, stem)
    paths.append(chart.write(results, args.out, stem))
    print(report.text(results, every=args.all))
    print("\nwrote " + ", ".join(str(p) for p in paths if p))
    return 0
