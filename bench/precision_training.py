"""``python -m bench.precision_training``: why train a 16-bit model with master weights, Kahan sums or stochastic rounding.

A 2-layer GPT-2 (Hugging Face's ``GPT2LMHeadModel`` from a small config) learns
a fixed synthetic next-token task on the CPU: sequences drawn from a fixed
random transition table (each token has a few likely successors), so the loss
falls from ln(vocab) towards the table's entropy. Every run starts from the
same float32 weights (rounded to bfloat16 where the run is 16-bit), sees the
same batches, and takes AdamW steps at lr 1e-4 with the gradients clipped to a
norm of 1 (``torch.nn.utils.clip_grad_norm_`` beside ``torch.optim.AdamW``,
``max_norm=`` for gpuflat's):

- ``torch float32``: the reference;
- ``torch bfloat16``: the model in bfloat16, ``torch.optim.AdamW`` (moments
  in bfloat16, the parameters' dtype);
- ``gpuflat bfloat16``: ``gpuflat.torch.AdamW``, moments in bfloat16;
- ``gpuflat bfloat16 + master_weights``: a float32 copy of each parameter
  updated in float32 and rounded once into it, and float32 moments;
- ``gpuflat bfloat16 + kahan_sum``: a bfloat16 compensation beside each
  parameter, moments in bfloat16 (every state 16-bit);
- ``gpuflat bfloat16 + bf16_stochastic_round``: the parameter rounded up or
  down at random, moments in bfloat16.

Per step it records the loss (cross-entropy in float32 of the batch, before
the step) and the fraction of parameter updates lost to rounding: the
elements whose held value did not change though their float32 update was
non-zero. The held value is the master copy with master weights, parameter +
compensation with Kahan sums, the parameter otherwise (rounded at random,
an unchanged element keeps its update in expectation: the count measures
how often it moved, not what it lost); the float32 update is
AdamW's, computed in float32 from the moments after the step, the step
count, lr and the weight decay:
``-lr * wd * held - lr / (1 - beta1^t) * m / (sqrt(v / (1 - beta2^t)) + eps)``.

Writes ``precision_training.json`` (every curve, the summary, the settings
and the machine), ``precision_training.png`` (the loss curves; the lost
fraction below) and ``precision_training.md`` (the table) to ``--out``
(default: bench/results/precision-training).

gpuflat's optimizers run on ``--backend`` ("host", the native library that
serves CPU tensors by default, or "numpy": the same bits). A backend whose
update does not keep the master copy or the compensation is refused, not
measured.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "results" / "precision-training"
STEM = "precision_training"
BACKENDS = ("host", "numpy")
LR = 1e-4
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.999)
EPS = 1e-8
MAX_NORM = 1.0


@dataclass(frozen=True)
class Size:
    """The model and the task: a GPT-2 config's sizes, the batch, the table."""
    n_layer: int = 2
    n_embd: int = 64
    n_head: int = 4
    vocab: int = 64
    context: int = 32
    batch: int = 16
    successors: int = 3  # each token's likely next tokens in the transition table
    seed: int = 0


SIZES = {"default": Size(), "tiny": Size(n_embd=32, n_head=2, vocab=32, context=16, batch=8)}


@dataclass(frozen=True)
class Run:
    name: str
    kind: str  # "torch" or "gpuflat"
    dtype: str  # "float32" or "bfloat16"
    options: tuple = ()  # gpuflat.torch.AdamW's precision options, as (name, value) pairs
    held: str = "parameter"  # what the update changes: "parameter", "master copy", "parameter + compensation"
    moments: str = "bfloat16"


RUNS = (
    Run("torch float32", "torch", "float32", moments="float32"),
    Run("torch bfloat16", "torch", "bfloat16"),
    Run("gpuflat bfloat16", "gpuflat", "bfloat16"),
    Run("gpuflat bfloat16 + master_weights", "gpuflat", "bfloat16",
        (("master_weights", True), ("exp_avg_dtype", "float32"), ("exp_avg_sq_dtype", "float32")),
        held="master copy", moments="float32"),
    Run("gpuflat bfloat16 + kahan_sum", "gpuflat", "bfloat16", (("kahan_sum", True),),
        held="parameter + compensation"),
    Run("gpuflat bfloat16 + bf16_stochastic_round", "gpuflat", "bfloat16", (("bf16_stochastic_round", True),),
        held="parameter, rounded at random"),
)


# ---------------------------------------------------------------- the task

def transition_table(torch, size: Size):
    """A fixed (vocab, vocab) table of next-token probabilities: each token's
    ``successors`` likely next tokens (weights 8, 4, 2, ...) and a little
    mass on every token, so every sequence is possible and the best loss is
    the table's entropy, well below ln(vocab)."""
    g = torch.Generator().manual_seed(size.seed + 1)
    table = torch.full((size.vocab, size.vocab), 0.02, dtype=torch.float64)
    for token in range(size.vocab):
        nexts = torch.randperm(size.vocab, generator=g)[:size.successors]
        table[token, nexts] += torch.tensor([2.0 ** (3 - i) for i in range(size.successors)], dtype=torch.float64)
    return table / table.sum(1, keepdim=True)


def batches(torch, size: Size, steps: int):
    """``steps`` batches of (batch, context + 1) tokens drawn from the table with
    a seeded generator: the same for every run."""
    table = transition_table(torch, size)
    g = torch.Generator().manual_seed(size.seed + 2)
    n = steps * size.batch
    seqs = torch.empty((n, size.context + 1), dtype=torch.long)
    seqs[:, 0] = torch.randint(0, size.vocab, (n,), generator=g)
    for t in range(size.context):
        seqs[:, t + 1] = torch.multinomial(table[seqs[:, t]], 1, generator=g)[:, 0]
    return seqs.view(steps, size.batch, size.context + 1)


def entropy_floor(torch, size: Size) -> float:
    """The best expected loss (nats per token): the table's entropy under its
    stationary distribution (the first token of a sequence is uniform, so this
    is the floor once the chain has mixed, which it does within a few tokens)."""
    table = transition_table(torch, size)
    pi = torch.full((size.vocab,), 1.0 / size.vocab, dtype=torch.float64)
    for _ in range(200):
        pi = pi @ table
    return float(-(pi[:, None] * table * table.log()).sum())


def make_model(torch, size: Size):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=size.n_layer, n_embd=size.n_embd, n_head=size.n_head, vocab_size=size.vocab,
                        n_positions=size.context, bos_token_id=0, eos_token_id=0,
                        # No dropout: every run computes the same function of its weights.
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(size.seed)
    return GPT2LMHeadModel(config)


# ---------------------------------------------------------------- one run

def backend_context(name: str):
    """Where gpuflat's optimizers run: the backend called ``name`` serves every
    tensor inside the context."""
    from gpuflat._src import tensor_table
    from gpuflat._src.backends import get_backend

    return tensor_table.serve_with(get_backend(name))


def make_optimizer(torch, run: Run, params):
    if run.kind == "torch":
        return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    import gpuflat.torch as gft

    options = {k: getattr(torch, v) if k.endswith("_dtype") else v for k, v in run.options}
    return gft.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, max_norm=MAX_NORM, **options)


def held_values(torch, run: Run, opt, params):
    """Each parameter's held value in float64 (exact for bfloat16 + bfloat16)."""
    out = []
    for p in params:
        state = opt.state.get(p, {})
        if run.held == "master copy" and "master_param" in state:
            out.append(state["master_param"].double())
        elif run.held == "parameter + compensation" and "kahan_comp" in state:
            out.append(p.detach().double() + state["kahan_comp"].double())
        else:
            out.append(p.detach().double())  # also before the first step, when the state is not made yet
    return out


def float32_update(torch, opt, p, held_before):
    """AdamW's update of ``p``'s held value, in float32, from its moments after
    the step: what a float32 parameter would have moved by."""
    state = opt.state[p]
    step = float(state["step"])
    m, v = state["exp_avg"].float(), state["exp_avg_sq"].float()
    bc1, bc2 = 1 - BETAS[0] ** step, 1 - BETAS[1] ** step
    denom = (v / bc2).sqrt() + EPS
    return -LR * WEIGHT_DECAY * held_before.float() - (LR / bc1) * m / denom


def check_kept(run: Run, opt, params, backend: str):
    """A backend that ignores the option leaves the master copy or the
    compensation as it made them: its figures would be the plain run's.
    Raises a RuntimeError then."""
    key = {"master copy": "master_param", "parameter + compensation": "kahan_comp"}.get(run.held)
    if key is None:
        return
    kept = [opt.state[p][key] for p in params]
    if key == "kahan_comp":
        moved = any(bool(c.any()) for c in kept)
    else:
        # The parameter is its master rounded once, and after a step at this
        # lr the master is no longer a bfloat16 value: a backend updating the
        # parameter alone leaves a stale master that rounds elsewhere.
        moved = all(bool((c.to(p.dtype) == p.detach()).all()) for c, p in zip(kept, params)) and \
            any(bool((c != p.detach().float()).any()) for c, p in zip(kept, params))
    if not moved:
        raise RuntimeError(f"{run.name}: the {backend!r} backend does not keep {key} (it updates the parameter "
                           f"alone): it does not implement this option yet (run with --backend numpy)")


def train(torch, run: Run, size: Size, data, init, backend: str) -> dict:
    """One run: per-step loss and lost fraction, and its wall time."""
    model = make_model(torch, size)
    model.load_state_dict(init)
    model.to(getattr(torch, run.dtype))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(torch, run, params)
    context = backend_context(backend) if run.kind == "gpuflat" else contextlib.nullcontext()
    losses, lost = [], []
    start = time.perf_counter()
    with context:
        for step, batch in enumerate(data):
            logits = model(batch[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, size.vocab), batch[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if run.kind == "torch":
                torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            before = held_values(torch, run, opt, params)
            opt.step()
            if step == 1:
                check_kept(run, opt, params, backend)
            with torch.no_grad():
                after = held_values(torch, run, opt, params)
                moving = stuck = 0
                for p, b, a in zip(params, before, after):
                    nonzero = float32_update(torch, opt, p, b) != 0
                    moving += int(nonzero.sum())
                    stuck += int((nonzero & (a == b)).sum())
            losses.append(float(loss.detach()))
            lost.append(stuck / moving if moving else 0.0)
    return {"loss": losses, "lost_fraction": lost, "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------- all runs

def summarize(curves: dict, tail: float = 0.1) -> dict:
    """Per run: the final loss (mean of the last ``tail`` of the steps), its gap
    to float32's, the mean per-step distance to float32's loss, the mean lost
    fraction."""
    ref = curves["torch float32"]["loss"]
    n = len(ref)
    last = max(1, math.ceil(tail * n))
    ref_final = sum(ref[-last:]) / last
    out = {}
    for name, c in curves.items():
        final = sum(c["loss"][-last:]) / last
        out[name] = {"final_loss": final, "gap_to_float32": final - ref_final,
                     "mean_abs_diff_to_float32": sum(abs(a - b) for a, b in zip(c["loss"], ref)) / n,
                     "mean_lost_fraction": sum(c["lost_fraction"]) / n,
                     "first_loss": c["loss"][0], "seconds": c["seconds"]}
    return out


def measure(steps: int, backend: str = "host", size: Size = SIZES["default"], runs=RUNS, log=None) -> dict:
    """Every run in ``runs`` over ``steps`` steps: the curves and their summary."""
    import torch

    model = make_model(torch, size)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    data = batches(torch, size, steps)
    curves = {}
    for run in runs:
        curves[run.name] = train(torch, run, size, data, init, backend)
        if log:
            s = curves[run.name]
            log(f"{run.name:40s} loss {s['loss'][0]:.3f} -> {s['loss'][-1]:.3f}  "
                f"lost {sum(s['lost_fraction']) / steps:.2%}  {s['seconds']:.1f} s")
    return {"settings": {"steps": steps, "backend": backend, "size": asdict(size), "lr": LR,
                         "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "eps": EPS, "max_norm": MAX_NORM,
                         "parameters": sum(p.numel() for p in model.parameters()),
                         "initial_loss_uniform": math.log(size.vocab), "entropy_floor": entropy_floor(torch, size),
                         "torch_threads": torch.get_num_threads()},
            "runs": [dict(asdict(r), options=dict(r.options)) for r in runs],
            "curves": curves, "summary": summarize(curves)}


# ---------------------------------------------------------------- outputs

def machine_facts() -> dict:
    from . import machine

    info = machine.describe("cpu")
    try:
        info["versions"]["transformers"] = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        info["versions"]["transformers"] = None
    return info


def table(results: dict) -> str:
    rows = ["| run | held value | moments | final loss | gap to float32 | mean \\|loss - float32's\\| | "
            "updates lost to rounding |", "|---|---|---|---:|---:|---:|---:|"]
    for run in results["runs"]:
        s = results["summary"][run["name"]]
        gap = "" if run["name"] == "torch float32" else f"{s['gap_to_float32']:+.4f}"
        diff = "" if run["name"] == "torch float32" else f"{s['mean_abs_diff_to_float32']:.4f}"
        # Rounded at random, an unmoved weight keeps its update in expectation.
        unmoved = " unmoved, kept in expectation" if "at random" in run["held"] else ""
        rows.append(f"| {run['name']} | {run['held']} | {run['moments']} | {s['final_loss']:.4f} | {gap} | {diff} "
                    f"| {s['mean_lost_fraction']:.3%}{unmoved} |")
    return "\n".join(rows)


def markdown(results: dict) -> str:
    st, m = results["settings"], results["machine"]
    z = st["size"]
    last = max(1, math.ceil(0.1 * st["steps"]))
    return f"""# Training a 16-bit model: master weights, Kahan sums and stochastic rounding against plain bfloat16

A {z['n_layer']}-layer GPT-2 (n_embd {z['n_embd']}, {z['n_head']} heads, vocab {z['vocab']}, context \
{z['context']}; {st['parameters']:,} parameters) on a fixed synthetic next-token task (a random transition \
table, {z['successors']} likely successors per token: loss from ln({z['vocab']}) = {st['initial_loss_uniform']:.3f} \
towards the table's entropy, {st['entropy_floor']:.3f}), {st['steps']} AdamW steps at lr {st['lr']:g}, weight \
decay {st['weight_decay']:g}, gradients clipped to norm {st['max_norm']:g}, batch {z['batch']}; same initial \
weights and batches for every run. Final loss: the mean of the last {last} steps' losses. An update is lost when \
the held value did not change though its float32 AdamW update was non-zero; rounded at random, an unchanged \
weight keeps its update in expectation, so that count says how often it moved.

{table(results)}

gpuflat backend: {st['backend']}. {m['cpu']}, {m['cores']} cores, torch {m['versions']['torch']}, \
transformers {m['versions']['transformers']}, revision {m['revision']}. Made by \
`python -m bench.precision_training --steps {st['steps']} --backend {st['backend']}` in {results['seconds']:.0f} s.
"""


def chart(results: dict, path: Path):
    """Loss curves (a moving average over 5% of the steps) above the lost fraction per step."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results["notes"].append("no chart: matplotlib is not installed")
        return None
    steps = results["settings"]["steps"]
    window = max(1, steps // 20)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    # The remedies lie on float32's curve: float32 wide and pale beneath,
    # the remedies narrow above it, so each stays visible.
    styles = {"torch float32": ("0.6", "-", 5.0), "torch bfloat16": ("tab:red", "--", 1.6),
              "gpuflat bfloat16": ("tab:orange", "-", 1.6), "gpuflat bfloat16 + master_weights": ("tab:blue", "-", 1.6),
              "gpuflat bfloat16 + kahan_sum": ("tab:green", (0, (2, 2)), 1.6),
              "gpuflat bfloat16 + bf16_stochastic_round": ("tab:purple", (0, (5, 2)), 1.6)}
    for name, c in results["curves"].items():
        color, line, width = styles.get(name, (None, "-", 1.6))
        loss = c["loss"]
        smooth = [sum(loss[max(0, i - window + 1):i + 1]) / len(loss[max(0, i - window + 1):i + 1])
                  for i in range(len(loss))]
        top.plot(range(1, steps + 1), smooth, color=color, linestyle=line, linewidth=width, label=name)
        bottom.plot(range(1, steps + 1), [100 * f for f in c["lost_fraction"]], color=color, linestyle=line,
                    linewidth=min(width, 3.0), label=name)
    top.axhline(results["settings"]["entropy_floor"], color="0.6", linewidth=0.8, linestyle="-.",
                label="the task's entropy (best loss)")
    top.set_ylabel(f"training loss (moving mean over {window} steps)")
    top.legend(fontsize=8)
    bottom.set_ylabel("parameter updates lost to rounding (%)")
    bottom.set_xlabel("step")
    # Linear up to 0.01 %, logarithmic above: the remedies' hundredths of a
    # percent show beside plain bfloat16's tens.
    bottom.set_yscale("symlog", linthresh=0.01)
    bottom.set_ylim(0, 100)
    bottom.set_yticks([0, 0.01, 0.1, 1, 10, 100], ["0", "0.01", "0.1", "1", "10", "100"])
    z, st = results["settings"]["size"], results["settings"]
    fig.suptitle(f"{z['n_layer']}-layer GPT-2 ({st['parameters']:,} parameters), AdamW lr {st['lr']:g}, "
                 f"on {results['machine']['cpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write(results: dict, out: Path) -> list:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{STEM}.json", out / f"{STEM}.md"]
    chart_path = chart(results, out / f"{STEM}.png")
    paths[0].write_text(json.dumps(results, indent=1) + "\n")
    paths[1].write_text(markdown(results))
    return paths + ([chart_path] if chart_path else [])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.precision_training", description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("--steps", type=int, default=300, help="AdamW steps per run (default: %(default)s)")
    p.add_argument("--backend", choices=BACKENDS, default="host",
                   help="the backend gpuflat's optimizers run on (default: %(default)s)")
    p.add_argument("--size", choices=tuple(SIZES), default="default", help="the model and the task: " + "; ".join(
        f"{k}: n_embd {v.n_embd}, vocab {v.vocab}, context {v.context}, batch {v.batch}" for k, v in SIZES.items())
        + " (default: %(default)s)")
    p.add_argument("--out", default=OUT, type=Path,
                   help="folder for the JSON, PNG and table (default: bench/results/precision-training)")
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench.precision_training needs transformers (in gpuflat's test extra: pip install -e '.[test]')",
              file=sys.stderr)
        return 2
    start = time.perf_counter()
    results = measure(args.steps, args.backend, SIZES[args.size], log=lambda s: print(s, flush=True))
    results["seconds"] = time.perf_counter() - start
    results["machine"] = machine_facts()
    results["notes"] = []
    for path in write(results, args.out):
        print(f"wrote {path}")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
