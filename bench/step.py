"""The step rows (``python -m bench --step-only``): a clipped AdamW step,
PyTorch's against gpuflat's, on GPT-2 small and on 10,000 tiny parameters.

PyTorch's clipped step is ``torch.nn.utils.clip_grad_norm_`` then
``AdamW.step()`` (foreach, and fused where it runs on the device): it reads
or writes about 10 parameter-sized arrays (norm 1, scale 2, AdamW 7).
gpuflat's ``gpuflat.torch.AdamW(max_norm=)`` takes the norm in one read and
clips inside the update: about 8 (norm 1, update 7). Each row gives the
median step time, those bytes per step and the speed-up over PyTorch's
fastest. Parameters live on PyTorch's device: the GPU when one is at hand.
"""
from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np

from . import machine, timing, workloads

WORKLOADS = ("gpt2-small", "tiny-10k")
MAX_NORM = 1.0
LR = 1e-4  # small, so thousands of repeats keep the parameters in range


def cases(torch):
    """(name, parameter-sized arrays moved per step, make(params) -> step function)."""
    import gpuflat.torch as gft

    def torch_step(**kw):
        def make(params):
            opt = torch.optim.AdamW(params, lr=LR, **kw)

            def step():
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
                opt.step()
            return step
        return make

    def flat_step(params):
        return gft.AdamW(params, lr=LR, max_norm=MAX_NORM).step

    return [("torch foreach", 10, torch_step(foreach=True)), ("torch fused", 10, torch_step(fused=True)),
            ("gpuflat", 8, flat_step)]


def _params(torch, leaves, device):
    """Fresh parameters with fixed random gradients, one per leaf."""
    rng = np.random.default_rng(1)
    out = []
    for leaf in leaves:
        p = torch.nn.Parameter(torch.from_numpy(np.array(leaf, np.float32)).to(device))
        p.grad = torch.from_numpy(rng.standard_normal(leaf.shape, np.float32)).to(device)
        out.append(p)
    return out


def run(settings, workload_names=WORKLOADS) -> dict:
    """Every case on every workload: the rows of the step benchmark."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    timer = timing.HostTimer()
    spec = workloads.load()
    rows = []
    for name in workload_names:
        w = workloads.build(name, spec[name], "float32")
        n_bytes = sum(leaf.nbytes for leaf in w.leaves)
        for impl, arrays, make in cases(torch):
            row = {"workload": name, "dtype": "float32", "op": "clip+adamw step", "impl": impl,
                   "leaves": len(w.leaves), "bytes": arrays * n_bytes}
            params = _params(torch, w.leaves, device)
            try:
                step = make(params)
                t, _ = timing.measure(lambda: (step(), sync()), timer, settings)
                rows.append({**row, "status": "ok", "median_ms": t.median_s * 1e3, "reps": t.reps,
                             "gb_s": arrays * n_bytes / t.median_s / 1e9})
            except Exception as exc:  # e.g. a fused kernel this device lacks: a row, not a crash
                rows.append({**row, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]})
            del params
            gc.collect()
    _speedups(rows)
    return {"machine": machine.describe(device, _xp(device)), "device": device, "torch": torch.__version__,
            "settings": vars(settings), "rows": rows}


def _xp(device):
    """The array module bench.machine reads the device's name from."""
    if device == "cuda":
        import cupy

        return cupy
    return np


def _speedups(rows) -> None:
    """Each gpuflat row's speed-up over PyTorch's fastest on the same workload."""
    for r in rows:
        if r["impl"].startswith("gpuflat") and r["status"] == "ok":
            peers = [p["median_ms"] for p in rows if p["workload"] == r["workload"] and p["status"] == "ok"
                     and p["impl"].startswith("torch")]
            r["speedup_vs_torch"] = min(peers) / r["median_ms"] if peers else None


def text(results) -> str:
    """The step rows as a table.

    >>> print(text({"device": "cpu", "rows": [{"workload": "w", "impl": "gpuflat", "status": "ok",
    ...     "median_ms": 2.0, "bytes": 8e6, "gb_s": 4.0, "speedup_vs_torch": 1.5}]}))
    clip+AdamW step on cpu
    w  gpuflat  2 ms  8 MB/step  4.0 GB/s  1.50x torch's fastest
    """
    lines = [f"clip+AdamW step on {results['device']}"]
    for r in results["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['workload']}  {r['impl']}  {r['status']}: {r.get('reason', '')}")
            continue
        speed = r.get("speedup_vs_torch")
        lines.append(f"{r['workload']}  {r['impl']}  {r['median_ms']:.3g} ms  {r['bytes'] / 1e6:.3g} MB/step  "
                     f"{r['gb_s']:.1f} GB/s" + (f"  {speed:.2f}x torch's fastest" if speed else ""))
    return "\n".join(lines)


def main(args) -> int:
    """Run, print, and write ``<stem>-step.json`` under ``args.out``."""
    settings = timing.QUICK if args.quick else timing.FULL
    names = args.workloads.split(",") if args.workloads else WORKLOADS
    results = run(settings, names)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = (args.name or machine.name(results["device"], _xp(results["device"]))) + ("-quick" if args.quick else "")
    path = out / f"{stem}-step.json"
    path.write_text(json.dumps(results, indent=1))
    print(text(results))
    print(f"\nwrote {path}")
    return 0
