"""Per workload, dtype and operation: gpuflat's best row (any backend), its best
peer and the floor.

Ratios compare times on one clock: a peer timed on the host clock (JAX on a
GPU, whose streams the CUDA events do not see) counts its host work too, so
it is never the best peer of a run on the device clock; :func:`other_clocks`
lists such rows apart."""
from __future__ import annotations

from .ops import FLOOR_PARTS


def floor_parts(results, workload, dtype, op) -> dict:
    """{part: median ms} of the floors timed right before ``op``'s cases."""
    return {f["part"]: f["median_ms"] for f in results["floors"]
            if (f["workload"], f["dtype"], f["op"]) == (workload, dtype, op)}


def floor_ms(results, workload, dtype, op):
    """The op's floor: the sum of its floor parts' medians, timed before its cases."""
    parts, times = FLOOR_PARTS[op], floor_parts(results, workload, dtype, op)
    if not parts or any(p not in times for p in parts):
        return None
    return sum(times[p] for p in parts)


def _groups(results):
    seen = []
    for r in results["rows"]:
        key = (r["workload"], r["dtype"], r["op"])
        if key not in seen:
            seen.append(key)
    return seen


def _timed(rows, kind, clock=None):
    """The rows of ``kind`` that ran and were right, on the run's ``clock``, fastest first."""
    return sorted((r for r in rows if r["kind"] == kind and r["status"] == "ok"
                   and r.get("clock", clock) == clock), key=lambda r: r["median_ms"])


def other_clocks(results) -> list:
    """The rows that ran and were right on a clock other than the run's.

    >>> other_clocks({"clock": "events", "rows": [{"status": "ok", "clock": "host"},
    ...                                           {"status": "ok", "clock": "events"}]})
    [{'status': 'ok', 'clock': 'host'}]
    """
    clock = results.get("clock")
    return [r for r in results["rows"] if r["status"] == "ok" and r.get("clock", clock) != clock]


def summarize(results) -> list:
    """One dict per (workload, dtype, op) that has a gpuflat or peer figure."""
    out = []
    for workload, dtype, op in _groups(results):
        rows = [r for r in results["rows"] if (r["workload"], r["dtype"], r["op"]) == (workload, dtype, op)]
        clock = results.get("clock")
        mine, peers = _timed(rows, "gpuflat", clock), _timed(rows, "peer", clock)
        floor = floor_ms(results, workload, dtype, op)
        g = mine[0] if mine else None
        best = peers[0] if peers else None
        out.append({
            "workload": workload, "dtype": dtype, "op": op,
            "gpuflat": g and g["impl"], "gpuflat_ms": g and g["median_ms"], "gpuflat_gb_s": g and g["gb_s"],
            "best_peer": best and best["impl"], "best_peer_ms": best and best["median_ms"],
            "speedup_vs_best_peer": (best["median_ms"] / g["median_ms"]) if g and best else None,
            "floor_ms": floor,
            "time_over_floor": (g["median_ms"] / floor) if g and floor else None,
        })
    return out
