"""The step rows (``python -m bench --step-only``): a clipped AdamW step,
PyTorch's against gpuflat's, plain and with a GradScaler, on GPT-2 small and
on 10,000 tiny parameters.

PyTorch's clipped step is ``torch.nn.utils.clip_grad_norm_`` then
``AdamW.step()`` (foreach, and fused where it runs on the device): it reads
or writes about 10 parameter-sized arrays (norm 1, scale 2, AdamW 7).
gpuflat's ``gpuflat.torch.AdamW(max_norm=)`` takes the norm in one read and
clips inside the update: about 8 (norm 1, update 7). Each row gives the
median step time, those bytes per step and the speed-up over PyTorch's
fastest. With a GradScaler PyTorch adds the unscale (2 arrays: 12 in all);
gpuflat's optimizers unscale inside the update, after the stock scaler's own
non-finite check (about 10) or, with ``gpuflat.torch.GradScaler``, taking
the flag from the norm pass (8). Parameters live on PyTorch's device: the
GPU when one is at hand. Beside them, the host work of gpuflat's clipped
step alone (``bench.host_cost``: the CUDA backend on a runtime that counts
its launches and runs none).
"""
from __future__ import annotations

import gc
import json
from pathlib import Path

import numpy as np

from . import host_cost, machine, timing, workloads

WORKLOADS = ("gpt2-small", "tiny-10k")
# The workloads that also get the bfloat16 rows, one per precision option.
BF16_WORKLOADS = ("gpt2-small",)
MAX_NORM = 1.0
LR = 1e-4  # small, so thousands of repeats keep the parameters in range


def cases(torch):
    """(op, name, parameters' dtype, bytes moved per parameter per step,
    make(params) -> step function): the float32 rows on every workload, then
    the bfloat16 rows (``BF16_WORKLOADS``), one per precision option."""
    import gpuflat.torch as gft

    def scaler(cls):
        # A scale of 1 (never grown within a run): unscaling does the same
        # work as at any scale, and repeated steps keep the gradients as they are.
        s = cls("cuda" if torch.cuda.is_available() else "cpu", init_scale=1.0, growth_interval=1 << 30)
        s.scale(torch.ones(()))  # the scale tensor is made on first use
        return s

    def torch_step(scaled, **kw):
        def make(params):
            opt = torch.optim.AdamW(params, lr=LR, **kw)
            sc = scaler(torch.amp.GradScaler) if scaled else None

            def step():
                if sc is not None:
                    sc.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM, foreach=True)
                if sc is None:
                    return opt.step()
                sc.step(opt)
                sc.update()
            return step
        return make

    def flat_step(scaler_cls=None, **options):
        def make(params):
            opt = gft.AdamW(params, lr=LR, max_norm=MAX_NORM, **options)
            if scaler_cls is None:
                return opt.step
            sc = scaler(scaler_cls)

            def step():
                sc.step(opt)
                sc.update()
            return step
        return make

    plain, scaled, bf16 = "clip+adamw step", "scaled clip+adamw step", "clip+adamw step, bfloat16"
    f32 = torch.float32
    # Float32 rows: parameter-sized arrays moved, 4 bytes each.
    rows = [(plain, "torch foreach", 10, torch_step(False, foreach=True)),
            (plain, "torch fused", 10, torch_step(False, fused=True)),
            (plain, "gpuflat", 8, flat_step()),
            # The same passes: the figures are sums the update makes of what it holds.
            (plain, "gpuflat + stats", 8, flat_step(stats=True)),
            # unscale 2, clip 3, AdamW 7
            (scaled, "torch foreach + GradScaler", 12, torch_step(True, foreach=True)),
            (scaled, "torch fused + GradScaler", 12, torch_step(True, fused=True)),
            # the stock scaler's non-finite check (read and rewritten in place), norm 1, update 7
            (scaled, "gpuflat + torch.amp.GradScaler", 10, flat_step(torch.amp.GradScaler)),
            # the norm (and the non-finite flag) 1, update 7
            (scaled, "gpuflat + gpuflat GradScaler", 8, flat_step(gft.GradScaler))]
    # Bfloat16 rows, bytes per parameter: the norm reads the 2-byte gradient;
    # PyTorch's clip reads and writes it again (6 in all); a plain update
    # reads p, g, m, v and writes p, m, v (14); a master copy is read instead
    # of the parameter and written beside it (+6, float32 moments +8 more);
    # a compensation is read and written (+4); stochastic rounding moves what
    # the plain update moves (its draw is arithmetic on the element's index).
    return [(op, impl, "float32", 4 * arrays, make) for op, impl, arrays, make in rows] + [
        (bf16, "torch fused", "bfloat16", 6 + 14, torch_step(False, fused=True)),
        (bf16, "gpuflat", "bfloat16", 2 + 14, flat_step()),
        (bf16, "gpuflat master_weights", "bfloat16", 2 + 20, flat_step(master_weights=True)),
        (bf16, "gpuflat master_weights, float32 moments", "bfloat16", 2 + 28,
         flat_step(master_weights=True, exp_avg_dtype=f32, exp_avg_sq_dtype=f32)),
        (bf16, "gpuflat kahan_sum", "bfloat16", 2 + 18, flat_step(kahan_sum=True)),
        (bf16, "gpuflat bf16_stochastic_round", "bfloat16", 2 + 14, flat_step(bf16_stochastic_round=True))]


def _params(torch, leaves, device, dtype):
    """Fresh parameters of ``dtype`` (a name) with fixed random gradients, one per leaf."""
    rng = np.random.default_rng(1)
    out = []
    for leaf in leaves:
        p = torch.nn.Parameter(torch.from_numpy(np.array(leaf, np.float32)).to(device, getattr(torch, dtype)))
        p.grad = torch.from_numpy(rng.standard_normal(leaf.shape, np.float32)).to(device, p.dtype)
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
        n = sum(leaf.size for leaf in w.leaves)
        for op, impl, dtype, per_parameter, make in cases(torch):
            if dtype != "float32" and name not in BF16_WORKLOADS:
                continue
            row = {"workload": name, "dtype": dtype, "op": op, "impl": impl,
                   "leaves": len(w.leaves), "bytes": per_parameter * n}
            params = _params(torch, w.leaves, device, dtype)
            try:
                step = make(params)
                t, _ = timing.measure(lambda: (step(), sync()), timer, settings)
                rows.append({**row, "status": "ok", "median_ms": t.median_s * 1e3, "reps": t.reps,
                             "gb_s": row["bytes"] / t.median_s / 1e9})
            except Exception as exc:  # e.g. a fused kernel this device lacks: a row, not a crash
                rows.append({**row, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300]})
            del params
            gc.collect()
    _speedups(rows)
    host = host_cost.measure({name: spec[name] for name in workload_names}, settings, only=host_cost.STEP)
    return {"machine": machine.describe(device, _xp(device)), "device": device, "torch": torch.__version__,
            "settings": vars(settings), "rows": rows, "host_cost": host}


def _xp(device):
    """The array module bench.machine reads the device's name from."""
    if device == "cuda":
        import cupy

        return cupy
    return np


def _speedups(rows) -> None:
    """Each gpuflat row's speed-up over PyTorch's fastest on the same workload and op."""
    for r in rows:
        if r["impl"].startswith("gpuflat") and r["status"] == "ok":
            peers = [p["median_ms"] for p in rows if (p["workload"], p["op"]) == (r["workload"], r["op"])
                     and p["status"] == "ok" and p["impl"].startswith("torch")]
            r["speedup_vs_torch"] = min(peers) / r["median_ms"] if peers else None


def text(results) -> str:
    """The step rows as a table.

    >>> print(text({"device": "cpu", "rows": [{"workload": "w", "op": "step", "impl": "gpuflat",
    ...     "status": "ok", "median_ms": 2.0, "bytes": 8e6, "gb_s": 4.0, "speedup_vs_torch": 1.5}]}))
    optimizer steps on cpu
    w  step  gpuflat  2 ms  8 MB/step  4.0 GB/s  1.50x torch's fastest
    """
    lines = [f"optimizer steps on {results['device']}"]
    for r in results["rows"]:
        if r["status"] != "ok":
            lines.append(f"{r['workload']}  {r['op']}  {r['impl']}  {r['status']}: {r.get('reason', '')}")
            continue
        speed = r.get("speedup_vs_torch")
        lines.append(f"{r['workload']}  {r['op']}  {r['impl']}  {r['median_ms']:.3g} ms  {r['bytes'] / 1e6:.3g} MB/step  "
                     f"{r['gb_s']:.1f} GB/s" + (f"  {speed:.2f}x torch's fastest" if speed else ""))
    for r in results.get("host_cost", []):
        lines.append(f"{r['workload']}  host work of a {r['call']}  " + (
            f"{r['us_per_call'] / 1e3:.3g} ms ({r['runtime']})" if r["status"] == "ok" else r["reason"]))
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
