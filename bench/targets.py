"""The targets, judged from this run's medians; none is assumed.

Each is judged against the fastest gpuflat row of its operation, whatever
the backend (or the ``gpuflat.torch`` drop-in), and names that row; a row
that is missing makes the target "not measured", never met.
"""
from __future__ import annotations

from .summary import floor_ms, floor_parts
from .workloads import DTYPE_LABELS

GPT2, TINY = "gpt2-small", "tiny-10k"
TORCH = {"global_norm": "torch get_total_norm(foreach)", "clip": "torch clip_grad_norm_(foreach)"}
NUMPY_LOOP = "numpy loop"
DROP_IN_CLIP = "gpuflat.torch clip_grad_norm_"
# The device time of a norm over 10,000 leaves of 100 floats: launch and
# table work, not bandwidth (4 MB read in about 1 µs on an H200).
TINY_NORM_MS = 0.010
# Flatten and scatter against one copy moving the same bytes (the tree's
# read and its flat buffer's written, bench/floors.py): 1.2x on trees of
# large leaves, where the copy itself is the cost. A tree of many tiny leaves
# is held to 5x instead: every call reads each leaf again (its identity,
# shape and dtype, a tenth of a microsecond each from Python, and its
# address and strides in the native gather), which on 10,000 leaves of 400
# bytes is several times the 0.09 ms that copying their 4 MB as one buffer
# takes; the mixed tree's floor, a copy moving 0.86 MB (its 0.28 MB of
# leaves and their 0.58 MB float64 buffer), takes about 9 µs on a 2-core
# CPU, a fraction of a call's fixed host work.
COPY_LIMIT, MANY_LEAVES_COPY_LIMIT = 1.2, 5.0
MANY_LEAVES = (TINY, "mixed")
# Host work per call on 10,000 leaves, launches counted and never run
# (bench/host_cost.py): what a GPU step pays on the CPU besides its kernels.
# The drop-in on the same gradient memory, whether the same tensor objects
# or new ones (zero_grad() sets them to None), and the tree clip's walk.
HOST_LIMITS_US = {"gpuflat.torch clip_grad_norm_ (the same gradients)": 1500.0,
                  "gpuflat.torch clip_grad_norm_ (new gradient tensors, same memory)": 1500.0,
                  "gf.clip_grad_norm_(tree)": 2000.0}


def _ok(results, w, d, op, **match):
    return [r for r in results["rows"] if (r["workload"], r["dtype"], r["op"]) == (w, d, op)
            and r["status"] == "ok" and all(r[k] == v for k, v in match.items())]


def _best(results, w, d, op):
    """The fastest gpuflat row, or None."""
    return min(_ok(results, w, d, op, kind="gpuflat"), key=lambda r: r["median_ms"], default=None)


def _peer_ms(results, w, d, op, impl):
    rows = _ok(results, w, d, op, impl=impl)
    return rows[0]["median_ms"] if rows else None


def _verdict(name, w, d, best, reference_ms, limit, faster):
    """``faster``: met when reference/gpuflat >= limit; else when gpuflat/reference <= limit."""
    out = {"target": name, "unit": f"{w} {d}", "measured": None, "met": None, "by": None}
    if best is None or not reference_ms:
        return out
    ratio = reference_ms / best["median_ms"] if faster else best["median_ms"] / reference_ms
    met = ratio >= limit if faster else ratio <= limit
    text = f"{ratio:.2f}x faster" if faster else f"{ratio:.2f}x the reference time"
    return {**out, "measured": text, "met": met, "by": best["impl"]}


def _within(results, name, w, d, op, limit, part=None):
    """gpuflat's time within ``limit`` times the op's floor (or one part of it)."""
    ref = floor_ms(results, w, d, op) if part is None else floor_parts(results, w, d, op).get(part)
    return _verdict(name, w, d, _best(results, w, d, op), ref, limit, faster=False)


def _faster(results, name, w, d, op, peer, limit):
    """gpuflat at least ``limit`` times faster than ``peer``."""
    return _verdict(name, w, d, _best(results, w, d, op), _peer_ms(results, w, d, op, peer), limit, faster=True)


def _copy_units(results) -> list:
    """GPT-2 small and the 10,000-leaf tree in float32, and every other workload run in float32 or mixed."""
    units = [(GPT2, "float32"), (TINY, "float32")]
    for f in results["floors"]:
        unit = (f["workload"], f["dtype"])
        if f["dtype"] in ("float32", "mixed") and unit not in units:
            units.append(unit)
    return units


def _cpu(results) -> list:
    f32 = "float32"
    out = [_within(results, "global_norm within 1.5x of the np.dot floor", GPT2, f32, "global_norm", 1.5),
           _faster(results, f"global_norm faster than {TORCH['global_norm']}", GPT2, f32, "global_norm",
                   TORCH["global_norm"], 1.0)]
    for d in ("float16", "bfloat16"):
        out += [
            _within(results, "global_norm within 4x of a float32 np.dot over the same bytes", GPT2, d,
                    "global_norm", 4.0, part="reduce"),
            _within(results, "clip within 5x of a float32 np.dot over the same bytes", GPT2, d, "clip", 5.0,
                    part="reduce"),
        ]
        out += [_faster(results, f"{op} faster than {TORCH[op]}", GPT2, d, op, TORCH[op], 1.0)
                for op in ("global_norm", "clip")]
    out += [_faster(results, f"{op} >= 3x faster than {peer}", TINY, f32, op, peer, 3.0)
            for op in ("global_norm", "clip") for peer in (TORCH[op], NUMPY_LOOP)]
    # The drop-in itself, on the same CPU tensors as PyTorch's clip.
    out.append(_verdict(f"{DROP_IN_CLIP} >= 3x faster than {TORCH['clip']}", TINY, f32,
                        _row(results, TINY, f32, "clip", DROP_IN_CLIP),
                        _peer_ms(results, TINY, f32, "clip", TORCH["clip"]), 3.0, faster=True))
    for w, d in _copy_units(results):
        limit = MANY_LEAVES_COPY_LIMIT if w in MANY_LEAVES else COPY_LIMIT
        out += [_within(results, f"{op} within {limit:g}x of the copy floor", w, d, op, limit)
                for op in ("flatten", "scatter")]
    return out + _host_work(results)


def _host_work(results) -> list:
    """The host-cost rows of the 10,000-leaf tree within :data:`HOST_LIMITS_US`."""
    out = []
    for call, limit in HOST_LIMITS_US.items():
        rows = [r for r in results.get("host_cost", ()) if r["workload"] == TINY and r["call"] == call
                and r["status"] == "ok"]
        verdict = {"target": f"{call} host work within {limit / 1e3:g} ms", "unit": f"{TINY} host cost",
                   "measured": None, "met": None, "by": None}
        if rows:
            us = rows[0]["us_per_call"]
            verdict.update(measured=f"{us / 1e3:.2f} ms", met=us <= limit, by=call)
        out.append(verdict)
    return out


def _row(results, w, d, op, impl):
    rows = _ok(results, w, d, op, impl=impl)
    return rows[0] if rows else None


def _gpu(results) -> list:
    """GPT-2 small in every dtype against the bandwidth floors (each dtype
    from 249 MB up, beyond the 60 MB L2), and the 10,000-leaf tree: its norm's
    device time, the drop-in's and the resident clip against PyTorch's."""
    out = []
    for d in DTYPE_LABELS:
        out += [_within(results, "global_norm within 1.1x of a plain read of the same bytes", GPT2, d,
                        "global_norm", 1.1),
                _within(results, "flatten within 1.15x of a device copy", GPT2, d, "flatten", 1.15),
                _within(results, "clip within 1.15x of its 3N floor", GPT2, d, "clip", 1.15)]
    out.append(_verdict(f"global_norm device time within {TINY_NORM_MS * 1e3:.0f} µs", TINY, "float32",
                        _best(results, TINY, "float32", "global_norm"), TINY_NORM_MS, 1.0, faster=False))
    torch_clip = _peer_ms(results, TINY, "float32", "clip", TORCH["clip"])
    out.append(_verdict(f"{DROP_IN_CLIP} >= 10x faster than {TORCH['clip']}", TINY, "float32",
                        _row(results, TINY, "float32", "clip", DROP_IN_CLIP), torch_clip, 10.0, faster=True))
    out.append(_faster(results, f"resident_clip >= 10x faster than {TORCH['clip']}", TINY, "float32",
                       "resident_clip", TORCH["clip"], 10.0))
    return out


def judge(results) -> list:
    """The CPU targets on a CPU run, the GPU targets on a CUDA run."""
    return _cpu(results) if results["device"] == "cpu" else _gpu(results)
