"""The terminal table and the JSON file."""
from __future__ import annotations

import json
from pathlib import Path

from . import summary, targets


def _num(x, fmt="{:.3g}", none="-"):
    return none if x is None else fmt.format(x)


def _columns(head, body, left) -> list:
    """Aligned text rows; columns in ``left`` are left-aligned, the rest right."""
    widths = [max(len(str(r[i])) for r in [head, *body]) for i in range(len(head))]
    line = lambda r: "  ".join(str(c).ljust(w) if i in left else str(c).rjust(w)  # noqa: E731
                               for i, (c, w) in enumerate(zip(r, widths)))
    return [line(head), "  ".join("-" * w for w in widths), *map(line, body)]


def _table(rows) -> list:
    head = ("workload", "dtype", "op", "best gpuflat", "gpuflat ms", "GB/s", "best peer", "peer ms",
            "peer/gpuflat", "floor ms", "gpuflat/floor")
    body = [(s["workload"], s["dtype"], s["op"], s["gpuflat"] or "-", _num(s["gpuflat_ms"]),
             _num(s["gpuflat_gb_s"], "{:.1f}"), s["best_peer"] or "-", _num(s["best_peer_ms"]),
             _num(s["speedup_vs_best_peer"], "{:.2f}x"), _num(s["floor_ms"]),
             _num(s["time_over_floor"], "{:.2f}x")) for s in rows]
    return _columns(head, body, left={0, 1, 2, 3, 6})


def _host_cost(rows) -> list:
    """The host µs per call table: the walk-per-call calls against the resident ones."""
    head = ("workload", "leaves", "runtime", "call", "host µs per call", "launches", "syncs")
    body = [(r["workload"], r["leaves"], r["runtime"], r["call"],
             _num(r.get("us_per_call"), "{:.1f}", none=r["status"]), _num(r.get("launches"), "{}"),
             _num(r.get("syncs"), "{}")) for r in rows]
    return _columns(head, body, left={0, 2, 3})


def _every_row(results) -> list:
    head = ("workload", "dtype", "op", "implementation", "median ms", "reps", "GB/s", "x floor", "status")
    body = []
    for r in results["rows"]:
        floor = summary.floor_ms(results, r["workload"], r["dtype"], r["op"])
        ms = r.get("median_ms")
        impl = r["impl"] + (" [host clock]" if r in summary.other_clocks(results) else "")
        body.append((r["workload"], r["dtype"], r["op"], impl, _num(ms), _num(r.get("reps"), "{}"),
                     _num(r.get("gb_s"), "{:.1f}"), _num(ms / floor if ms and floor else None, "{:.2f}x"),
                     r["status"]))
    return _columns(head, body, left={0, 1, 2, 3, 8})


def _header(results) -> list:
    m, s = results["machine"], results["settings"]
    where = m.get("gpu") or f"{m['cpu']}, {m['cores']} cores"
    out = [f"gpuflat benchmark on {where}: backends {', '.join(results['backends'])}, {results['clock']}, "
           f"median of {s['min_reps']}-{s['max_reps']} runs after {s['warmup']} warm-up "
           f"(a peer: at most {s['peer_budget_s']:g} s a row)"]
    out += [f"absent: {lib}: {why}" for lib, why in results["absent"].items()]
    return out


def _problems(results) -> list:
    out = []
    for r in results["rows"]:
        if r["status"] in ("error", "wrong", "skipped", "uncapturable"):
            why = r.get("reason") or f"relative error {r['rel_err']:.2g} against float64"
            out.append(f"  {r['workload']} {r['dtype']} {r['op']} {r['impl']}: {r['status']}: {why}")
    for r in results.get("host_cost", ()):
        if r["status"] != "ok":
            out.append(f"  host cost {r['workload']} {r['runtime']} {r['call']}: {r['status']}: {r['reason']}")
    return out


def _other_clocks(results) -> tuple:
    """(lines, clocks) of the rows timed on another clock than the run's: not in the ratios."""
    rows = summary.other_clocks(results)
    clocks = sorted({r["clock"] for r in rows})
    return [f"  {r['workload']} {r['dtype']} {r['op']} {r['impl']}: {r['median_ms']:.3g} ms"
            + (f" [{r['clock']}]" if len(clocks) > 1 else "") for r in rows], clocks


def _budgets(results) -> list:
    """The peers whose time budget cut them below the minimum of repeats."""
    return [f"  {r['workload']} {r['dtype']} {r['op']} {r['impl']}: {r['reps']} of {results['settings']['min_reps']}"
            f" repeats in its {r['budget_s']:.1f} s" for r in results["rows"] if r.get("cut_by_budget")]


def _compiles(results) -> list:
    rows = [r for r in results["rows"] if r.get("compile_ms") is not None]
    return [f"  {r['workload']} {r['dtype']} {r['op']} {r['impl']}: {r['compile_ms']:.0f} ms"
            for r in rows]


def _precision(results, above=1e-5) -> list:
    """Norms (a clip's too: the norm it met) off the float64 reference by more than ``above``."""
    rows = [r for r in results["rows"] if r["status"] == "ok" and (r.get("rel_err") or 0) > above]
    rows.sort(key=lambda r: -r["rel_err"])
    return [f"  {r['rel_err']:.1e}  {r['workload']} {r['dtype']} {r['op']} {r['impl']}" for r in rows]


def _targets(results) -> list:
    word = {True: "met", False: "MISSED", None: "not measured"}
    return [f"  {word[t['met']]:<12} {t['target']} [{t['unit']}]: {t['measured'] or '-'}"
            + (f" (best: {t['by']})" if t["by"] else "") for t in results["targets"]]


def text(results, every=False) -> str:
    """The side-by-side table, then the targets, compile times and problems;
    with ``every``, first one line per implementation timed."""
    out = _header(results) + [""]
    out += (_every_row(results) + [""]) if every else []
    out += _table(results["summary"])
    out += ["", "peer/gpuflat > 1: gpuflat is faster; gpuflat/floor = 1: at the machine's limit"]
    if results.get("host_cost"):
        out += ["", "host µs per call: gpuflat's own host work per step (CUDA backend; 'no-op launches': "
                "its kernels counted, not run)"]
        out += _host_cost(results["host_cost"])
    out += ["", "targets (each against the fastest gpuflat row of its operation, any backend):"]
    out += _targets(results)
    other, clocks = _other_clocks(results)
    if other:
        out += ["", f"timed on another clock ({'; '.join(clocks)}): their work runs on streams of their own, "
                "which the CUDA events do not see; host work included, so not in the ratios above:"] + other
    if _budgets(results):
        out += ["", "fewer repeats than the minimum (the peer's time budget, warm-up counted):"] + _budgets(results)
    if _compiles(results):
        out += ["", "JAX lower+compile time (not in the medians):"] + _compiles(results)
    if _precision(results):
        out += ["", "relative error against a float64 reference, where above 1e-5:"] + _precision(results)
    if _problems(results):
        out += ["", "not timed or wrong:"] + _problems(results)
    out += results["notes"] + [f"\ntotal {results['wall_s']:.0f} s"]
    return "\n".join(out)


def _device_time_rows(results) -> list:
    """One line per implementation: its replay's device time beside its eager wall clock."""
    head = ("workload", "dtype", "op", "implementation", "clock", "device ms", "eager wall ms", "eager/device",
            "x floor", "status")
    body = []
    for r in results["rows"]:
        floor = summary.floor_ms(results, r["workload"], r["dtype"], r["op"])
        ms, eager = r.get("median_ms"), r.get("eager_wall_ms")
        graph = r.get("clock") == results["clock"]
        body.append((r["workload"], r["dtype"], r["op"], r["impl"], "graph" if graph else "host",
                     _num(ms if graph else None), _num(eager if graph else ms),
                     _num(eager / ms if graph and eager and ms else None, "{:.2f}x"),
                     _num(ms / floor if graph and ms and floor else None, "{:.2f}x"), r["status"]))
    return _columns(head, body, left={0, 1, 2, 3, 4, 9})


def device_time_text(results) -> str:
    """The ``--device-time`` table: each row's graph replay (device time, no
    host work) beside its eager wall clock; JAX's on the host clock alone;
    then the summary on the graph clock, the targets and what could not be
    captured or timed."""
    out = _header(results) + [f"eager wall ms: {results['eager_clock']}", ""]
    out += _device_time_rows(results)
    out += ["", "graph: a CUDA-graph replay timed by CUDA events (device time); host: the host clock, "
            "host work included (JAX: streams of its own, which no capture sees)", ""]
    out += _table(results["summary"])
    out += ["", "targets (on the replays' device time):"] + _targets(results)
    if _problems(results):
        out += ["", "not captured, not timed or wrong:"] + _problems(results)
    out += results["notes"] + [f"\ntotal {results['wall_s']:.0f} s"]
    return "\n".join(out)


def write(results, out_dir, stem) -> list:
    """Adds the summary and targets to ``results`` and writes ``<stem>.json``."""
    results["summary"] = summary.summarize(results)
    results["targets"] = targets.judge(results)
    path = Path(out_dir) / f"{stem}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    return [path]
