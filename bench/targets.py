"""The issue's targets, judged from this run's medians; none is assumed (#4)."""
from __future__ import annotations

from .summary import floor_ms

BIG = 256 * 2**20  # "from 256 MB up": the GPU bandwidth targets' model size (#4)
TINY = "tiny-10k"


def _ms(results, workload, dtype, op, impl=None, kind=None):
    for r in results["rows"]:
        if ((r["workload"], r["dtype"], r["op"]) == (workload, dtype, op) and r["status"] == "ok"
                and (impl is None or r["impl"] == impl) and (kind is None or r["kind"] == kind)):
            return r["median_ms"]
    return None


def _units(results, dtype="float32"):
    seen = {}
    for f in results["floors"]:
        if f["dtype"] == dtype and f["part"] == "reduce" and f["op"] == "global_norm":
            seen[f["workload"]] = f["bytes"]
    return seen


def _verdict(name, unit, value, limit, higher_is_better, fmt):
    if value is None:
        return {"target": name, "unit": unit, "measured": None, "met": None}
    met = value >= limit if higher_is_better else value <= limit
    return {"target": name, "unit": unit, "measured": fmt.format(value), "met": met}


def _over_floor(results, w, op):
    g, floor = _ms(results, w, "float32", op, kind="gpuflat"), floor_ms(results, w, "float32", op)
    return g / floor if g and floor else None


def _speedup(results, w, op, peer):
    g, p = _ms(results, w, "float32", op, kind="gpuflat"), _ms(results, w, "float32", op, impl=peer)
    return p / g if g and p else None


def _cpu(results):
    out = [_verdict("resident global_norm within 1.2x of the floor", w,
                    _over_floor(results, w, "resident_norm"), 1.2, False, "{:.2f}x floor time")
           for w in _units(results) if w != "mixed"]
    for peer in ("numpy loop", "torch get_total_norm(foreach)"):
        out.append(_verdict(f"10,000-leaf global_norm >= 3x faster than {peer}", TINY,
                            _speedup(results, TINY, "global_norm", peer), 3.0, True, "{:.2f}x faster"))
    return out


def _gpu(results):
    out = []
    for w, nbytes in _units(results).items():
        if nbytes < BIG:
            continue
        over = _over_floor(results, w, "flatten")
        out.append(_verdict("flatten >= 90% of copy bandwidth", w, over and 1 / over, 0.9, True,
                            "{:.0%} of copy"))
        over = _over_floor(results, w, "global_norm")
        out.append(_verdict("global_norm >= 95% of a cupy sum", w, over and 1 / over, 0.95, True,
                            "{:.0%} of sum"))
        out.append(_verdict("clip within 10% of the 3N floor", w, _over_floor(results, w, "clip"),
                            1.1, False, "{:.2f}x floor time"))
    for peer, limit in (("cupy loop", 10.0), ("torch clip_grad_norm_(foreach)", 2.0)):
        out.append(_verdict(f"10,000-leaf clip >= {limit:g}x faster than {peer}", TINY,
                            _speedup(results, TINY, "clip", peer), limit, True, "{:.2f}x faster"))
    return out


def judge(results) -> list:
    return _cpu(results) if results["device"] == "cpu" else _gpu(results)
