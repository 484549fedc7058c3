"""A PNG that tells the story at a glance: per workload and dtype, each
operation's implementations placed by their time over the machine's floor
(log scale; 1 is the floor, left is better). gpuflat's rows are coloured
and labelled; the peers are grey dots, the best of them named.
"""
from __future__ import annotations

from pathlib import Path

from .ops import OPS
from .summary import floor_ms

_MARKERS = "oDs^vP*X"


def _units(results):
    seen = []
    for r in results["rows"]:
        unit = (r["workload"], r["dtype"])
        if unit not in seen:
            seen.append(unit)
    return seen


def _over_floor(results, unit) -> dict:
    """op -> [(row, median / floor)] for the op's rows that ran, where the op has a floor."""
    out = {}
    for op in OPS:
        floor = floor_ms(results, *unit, op)
        rows = [r for r in results["rows"] if (r["workload"], r["dtype"], r["op"]) == (*unit, op)
                and r["status"] == "ok"]
        if floor and rows:
            out[op] = [(r, r["median_ms"] / floor) for r in rows]
    return out


def _styles(results, plt) -> dict:
    """gpuflat implementation -> (colour, marker): few, and each its own."""
    mine = sorted({r["impl"] for r in results["rows"] if r["kind"] == "gpuflat"})
    cmap = plt.get_cmap("tab10")
    return {impl: (cmap(i % 10), _MARKERS[i % len(_MARKERS)]) for i, impl in enumerate(mine)}


def _draw(ax, unit, by_op, styles):
    ops = list(by_op)
    for y, op in enumerate(ops):
        peers = [(r, x) for r, x in by_op[op] if r["kind"] != "gpuflat"]
        ax.scatter([x for _, x in peers], [y] * len(peers), s=28, facecolors="none", edgecolors="0.55",
                   label="peers")
        if peers:
            best, x = min(peers, key=lambda p: p[1])
            ax.annotate(best["impl"], (x, y), xytext=(0, 7), textcoords="offset points", fontsize=7,
                        color="0.35", ha="center")
        for r, x in by_op[op]:
            if r["kind"] == "gpuflat":
                color, marker = styles[r["impl"]]
                ax.scatter([x], [y], s=60, color=color, marker=marker, zorder=3, label=r["impl"])
    ax.axvline(1.0, color="black", linewidth=1.5, label="floor")
    ax.set_xscale("log")
    ax.set_yticks(range(len(ops)), ops, fontsize=8)
    ax.set_ylim(len(ops) - 0.5, -0.7)
    ax.set_title(f"{unit[0]} {unit[1]}", loc="left", fontsize=10)


def write(results, out_dir, stem):
    """Writes ``<stem>.png``; returns its path, or None without matplotlib or
    without a floored row to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results["notes"].append("no chart: matplotlib is not installed")
        return None
    panels = [(unit, by_op) for unit in _units(results) if (by_op := _over_floor(results, unit))]
    if not panels:
        results["notes"].append("no chart: no operation with a floor ran")
        return None
    styles = _styles(results, plt)
    height = 0.45 * sum(len(b) for _, b in panels) + 1.0 * len(panels)
    # One x scale for every panel, so their distances to the floor compare.
    fig, axes = plt.subplots(len(panels), 1, figsize=(11, height), squeeze=False, sharex=True)
    for ax, (unit, by_op) in zip(axes[:, 0], panels):
        _draw(ax, unit, by_op, styles)
        ax.tick_params(labelbottom=True)
    axes[-1, 0].set_xlabel("median time over the floor (log; 1 = the machine's limit, left is better)")
    handles = {}
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    m = results["machine"]
    # Which clock the times are: device time on a GPU (CUDA events behind a
    # spin kernel), wall time on a CPU; the host-cost rows are wall time always.
    fig.suptitle(f"gpuflat and its peers on {m.get('gpu') or m['cpu']}: time over the floor "
                 f"({results.get('clock', 'wall clock')})", y=1.0)
    fig.tight_layout()
    path = Path(out_dir) / f"{stem}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
