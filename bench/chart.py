"""A PNG: per workload, every implementation's median time per operation on a
log scale, with the floor drawn across each group.

Only float32 (and the mixed tree) is drawn, to keep it readable; every dtype
is in the JSON and the table.
"""
from __future__ import annotations

from pathlib import Path

from .ops import OPS
from .summary import floor_ms


def _units(results):
    seen = []
    for r in results["rows"]:
        unit = (r["workload"], r["dtype"])
        if r["dtype"] in ("float32", "mixed") and unit not in seen:
            seen.append(unit)
    return seen


def _colors(results, plt):
    """Peers in tab20's colours but its reds; gpuflat's rows in shades of red."""
    ok = [r for r in results["rows"] if r["status"] == "ok"]
    peers = sorted({r["impl"] for r in ok if r["kind"] != "gpuflat"})
    mine = sorted({r["impl"] for r in results["rows"] if r["kind"] == "gpuflat"})
    cmap, reds = plt.get_cmap("tab20"), plt.get_cmap("Reds")
    palette = [cmap(i) for i in range(20) if i not in (6, 7)]
    colors = {impl: palette[i % len(palette)] for i, impl in enumerate(peers)}
    colors.update({impl: reds(0.9 - 0.5 * i / max(len(mine) - 1, 1)) for i, impl in enumerate(mine)})
    return colors


def _draw(ax, results, unit, colors):
    for x, op in enumerate(OPS):
        rows = [r for r in results["rows"] if (r["workload"], r["dtype"], r["op"]) == (*unit, op)
                and r["status"] == "ok"]
        rows.sort(key=lambda r: (r["kind"] != "gpuflat", r["impl"]))
        width = 0.8 / max(len(rows), 1)
        for i, r in enumerate(rows):
            ax.bar(x - 0.4 + (i + 0.5) * width, r["median_ms"], width, color=colors[r["impl"]],
                   label=r["impl"])
        floor = floor_ms(results, *unit, op)
        if floor:
            ax.hlines(floor, x - 0.45, x + 0.45, colors="black", linewidth=2, label="floor")
    ax.set_yscale("log")
    ax.set_ylabel("median ms (log)")
    ax.set_title(f"{unit[0]} {unit[1]}", loc="left", fontsize=10)
    ax.set_xticks(range(len(OPS)), OPS, fontsize=8)


def write(results, out_dir, stem):
    """Writes ``<stem>.png``; returns its path, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results["notes"].append("no chart: matplotlib is not installed")
        return None
    units = _units(results)
    fig, axes = plt.subplots(len(units), 1, figsize=(13, 3.2 * len(units)), squeeze=False)
    colors = _colors(results, plt)
    for ax, unit in zip(axes[:, 0], units):
        _draw(ax, results, unit, colors)
    handles = {}
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(handles.values(), handles.keys(), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    m = results["machine"]
    fig.suptitle(f"gpuflat vs peers on {m.get('gpu') or m['cpu']} (lower is better; black: floor)")
    fig.tight_layout()
    path = Path(out_dir) / f"{stem}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
