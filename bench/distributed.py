"""``python -m bench.distributed``: gpuflat.distributed on 2 ranks against the peers' way.

Two ranks on this machine, once over torch.distributed (gloo, 127.0.0.1) and
once over MPI (mpirun, shared memory). For each transport, on float32
gradients shaped like GPT-2 small (148 arrays, 124,439,808 elements) and like
10,000 arrays of 100 elements:

- all-reduce: ``gfd.all_reduce_`` (gather, one collective, scatter; and
  with 25 MiB buckets) against one collective per tensor; the floor is one
  collective over a ready flat buffer of the same bytes.
- clip: ``gfd.clip_grad_norm_`` (one fused norm pass, one small collective,
  one scale pass) against the peers' way: torch's per-tensor
  ``get_total_norm`` (foreach), an all-reduce of its square, and a foreach
  multiply by the clamped factor (what ``clip_grads_with_norm_`` runs).
- FSDP2 (gloo only): the GPT-2 shapes as parameters sharded by
  ``fully_shard`` over the 2 ranks, their gradients DTensors;
  ``gpuflat.torch.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_``
  on the same parameters: the time, and the collectives of one clip
  (counted by torch's CommDebugMode).
- pp x dp (gloo, 4 ranks): the GPT-2 shapes split into 2 pipeline stages
  (the first half of the arrays, the rest), each sharded by ``fully_shard``
  over the 2 ranks of its stage on a (pp, dp) mesh;
  ``gpuflat.torch.clip_grad_norm_(..., pp_mesh=mesh["pp"])`` against
  torchtitan's way (each stage's ``torch.nn.utils.get_total_norm``, its
  square all-reduced over the pipeline group, ``clip_grads_with_norm_``):
  the time and the collectives of one clip.

Every clip bounds the norm at half its value, and the gradients are put back
untimed before each call, so every timed clip really scales them.
Medians of repeated runs after a warm-up, timed on rank 0 between barriers;
printed as ratios (peer / gpuflat: above 1, gpuflat is faster), and written
to bench/results/distributed-cpu.json. ``--quick`` runs fewer repeats on a
GPT-2 scaled down 16 times.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "distributed-cpu.json"
WORKLOADS = ("gpt2-small", "tiny-10k")
BUCKET = 25 << 20  # DDP's default bucket size


def shapes_of(name, scale):
    """The workload's parameter shapes; ``scale`` divides the first dimension (at least 1)."""
    spec = json.loads((ROOT / "workloads.json").read_text())[name]
    if "repeat" in spec:
        return [tuple(spec["repeat"]["shape"])] * spec["repeat"]["count"]
    return [(max(1, s[0] // scale),) + tuple(s[1:]) for _, s in spec["params"]]


# ---------------------------------------------------------------- one rank

RANKS = {"gloo": 2, "mpi": 2, "pp": 4}  # the world size of each launch


class Rank:
    """This process's view of the transport: barrier, per-tensor all-reduce, group."""

    def __init__(self, transport, argv):
        self.transport = transport
        if transport == "mpi":
            from mpi4py import MPI

            self.group, self.rank = MPI.COMM_WORLD, MPI.COMM_WORLD.Get_rank()
            self.barrier = self.group.Barrier
        else:
            import torch.distributed as dist

            rank, port = int(argv[0]), argv[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=RANKS[transport])
            self.group, self.rank, self.barrier = dist.group.WORLD, rank, dist.barrier

    def all_reduce(self, array):
        if self.transport == "mpi":
            from mpi4py import MPI

            self.group.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        else:
            import torch
            import torch.distributed as dist

            dist.all_reduce(torch.from_numpy(array), group=self.group)


def median_ms(rank, fn, repeats, before=None):
    """The median wall time of ``fn`` over ``repeats`` calls after a warm-up,
    the ranks lined up before each; ``before()``, if given, runs untimed
    ahead of every call (a clip's gradients put back)."""
    if before is not None:
        before()
    fn()  # warm-up: plans, tables and transport buffers
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        rank.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def restorer(arrays):
    """A function putting ``arrays`` (NumPy arrays or tensors) back to their
    values now: every clip is timed on the same gradients, and each really
    scales them (a clip whose factor is 1 may skip the scale, which would
    time a norm against a clip)."""
    saved = [a.copy() if isinstance(a, np.ndarray) else a.detach().clone() for a in arrays]

    def restore():
        for a, s in zip(arrays, saved):
            if isinstance(a, np.ndarray):
                np.copyto(a, s)
            else:
                a.copy_(s)
    return restore


def peer_clip(rank, tensors, max_norm):
    """The peers' distributed clip: per-tensor norms, an all-reduce of the square, a foreach scale."""
    import torch

    local = torch.nn.utils.get_total_norm(tensors, 2.0, foreach=True)
    square = (local.double() ** 2).reshape(1).numpy()
    rank.all_reduce(square)
    coef = torch.clamp(max_norm / (torch.from_numpy(square).sqrt() + 1e-6), max=1.0)
    torch._foreach_mul_(tensors, coef.float().reshape(()))


def fsdp2_clip(rank, scale, repeats):
    """Both clips on the GPT-2 shapes sharded by FSDP2: median ms and collectives per clip."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    import gpuflat.torch as gft

    torch.manual_seed(0)
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*s) * 0.02) for s in shapes_of("gpt2-small", scale))
    fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
    params = list(model.parameters())
    for p in params:
        p.grad = p.detach() * 0.5
    # Half the gradients' norm: every timed clip really scales them by 1/2.
    max_norm = float(gft.get_total_norm([p.grad for p in params]).full_tensor()) / 2
    restore = restorer([p.grad.to_local() for p in params])
    row = {"elements": sum(p.numel() for p in params), "arrays": len(params), "max_norm": max_norm}
    for label, clip in (("gpuflat.torch clip_grad_norm_", gft.clip_grad_norm_),
                        ("torch clip_grad_norm_", torch.nn.utils.clip_grad_norm_)):
        restore()
        with CommDebugMode() as mode:
            clip(params, max_norm)
        row[label] = {"ms": median_ms(rank, lambda: clip(params, max_norm), max(3, repeats // 4), restore),
                      "collectives": mode.get_total_counts()}
    return row


def torchtitan_pp_clip(params, max_norm, pp_group):
    """torchtitan's clip over pipeline stages: the stage's norm by torch, its
    square summed over the pipeline group, the gradients scaled by it."""
    import torch
    import torch.distributed as dist

    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    total = total.full_tensor() ** 2
    dist.all_reduce(total, group=pp_group)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total.sqrt())


def pp_dp_clip(rank, scale, repeats):
    """Both clips on the GPT-2 shapes split into 2 stages, each sharded by FSDP2
    over 2 ranks: median ms and collectives per clip."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    import gpuflat.torch as gft

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    shapes = shapes_of("gpt2-small", scale)
    stage = mesh.get_coordinate()[0]
    mine = shapes[: len(shapes) // 2] if stage == 0 else shapes[len(shapes) // 2 :]
    torch.manual_seed(stage)  # the two ranks of a stage hold the same parameters
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*s) * 0.02) for s in mine)
    fully_shard(model, mesh=mesh["dp"])
    params = list(model.parameters())
    for p in params:
        p.grad = p.detach() * 0.5
    # Half the whole model's norm: every timed clip really scales the gradients by 1/2.
    max_norm = float(gft.get_total_norm([p.grad for p in params], pp_mesh=mesh["pp"])) / 2
    restore = restorer([p.grad.to_local() for p in params])
    pp_group = mesh["pp"].get_group()
    row = {"elements": int(sum(np.prod(s) for s in shapes)), "arrays": len(shapes), "max_norm": max_norm}
    for label, clip in (("gpuflat.torch clip_grad_norm_", lambda: gft.clip_grad_norm_(params, max_norm,
                                                                                      pp_mesh=mesh["pp"])),
                        ("torchtitan's way", lambda: torchtitan_pp_clip(params, max_norm, pp_group))):
        restore()
        with CommDebugMode() as mode:
            clip()
        row[label] = {"ms": median_ms(rank, clip, max(3, repeats // 4), restore),
                      "collectives": mode.get_total_counts()}
    return row


def run_rank(transport, argv, scale, repeats, out):
    import torch

    from gpuflat import distributed as gfd

    rank = Rank(transport, argv)
    # The ranks share the machine's cores: each one runs on one core, PyTorch
    # with one thread and gpuflat's host backend with the one CPU its affinity
    # leaves it (left to take every core, each rank's threads would contend
    # with the other ranks' and time the contention).
    torch.set_num_threads(1)
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank.rank % len(cores)]})
    if transport == "pp":
        row = pp_dp_clip(rank, scale, repeats)
        if rank.rank == 0:
            Path(out).write_text(json.dumps(row))
        return
    results = {}
    for name in WORKLOADS:
        rng = np.random.default_rng(rank.rank)
        tensors = [torch.from_numpy(rng.standard_normal(s, np.float32) * np.float32(0.02))
                   for s in shapes_of(name, scale if name == "gpt2-small" else 1)]
        grads = {f"p{i}": t.numpy() for i, t in enumerate(tensors)}
        flat = np.concatenate([g.ravel() for g in grads.values()])
        n = max(3, repeats // 4) if name == "gpt2-small" else repeats
        # Half the global norm: every timed clip really scales (see restorer).
        max_norm = float(gfd.global_norm(grads, group=rank.group)) / 2
        restore = restorer(list(grads.values()))
        results[name] = {
            "elements": int(flat.size),
            "arrays": len(tensors),
            "all_reduce_ms": {
                "gpuflat all_reduce_": median_ms(rank, lambda: gfd.all_reduce_(grads, "sum", group=rank.group), n),
                "gpuflat all_reduce_, 25 MiB buckets": median_ms(
                    rank, lambda: gfd.all_reduce_(grads, "sum", group=rank.group, bucket_bytes=BUCKET), n),
                "per tensor": median_ms(rank, lambda: [rank.all_reduce(g) for g in grads.values()], n),
                "floor: one collective": median_ms(rank, lambda: rank.all_reduce(flat), n),
            },
            "clip_ms": {
                "gpuflat clip_grad_norm_": median_ms(
                    rank, lambda: gfd.clip_grad_norm_(grads, max_norm, group=rank.group), n, restore),
                "torch foreach norm + all-reduce": median_ms(rank, lambda: peer_clip(rank, tensors, max_norm), n,
                                                             restore),
            },
        }
    if transport == "gloo":
        results["fsdp2"] = fsdp2_clip(rank, scale, repeats)
    if rank.rank == 0:
        Path(out).write_text(json.dumps(results))


# ---------------------------------------------------------------- the driver

def launch(transport, scale, repeats, out):
    here = [sys.executable, "-m", "bench.distributed", "--rank-of", transport,
            "--scale", str(scale), "--repeats", str(repeats), "--out", out]
    if transport == "mpi":
        root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
        mpirun = str(Path(sys.executable).with_name("mpirun"))
        cmd = [mpirun, *root, "--oversubscribe", "-n", "2", "--mca", "btl", "self,sm",
               sys.executable, "-m", "mpi4py", *here[1:]]
        subprocess.run(cmd, check=True, cwd=ROOT.parent)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen(here + ["--", str(r), port], cwd=ROOT.parent) for r in range(RANKS[transport])]
    if any(p.wait() for p in procs):
        raise SystemExit(f"a {transport} rank failed")


def report(results, scale):
    lines = []
    for transport, by_workload in results.items():
        for name, r in by_workload.items():
            if name == "fsdp2":
                lines.append(fsdp2_line(transport, r))
                continue
            if name == "pp x dp":
                lines.append(pp_dp_line(transport, r))
                continue
            ar, clip = r["all_reduce_ms"], r["clip_ms"]
            mine, mine_clip = ar["gpuflat all_reduce_"], clip["gpuflat clip_grad_norm_"]
            lines.append(
                f"{transport:5} {name:10} ({r['arrays']:>5} arrays, {r['elements']:>11,} elements)  "
                f"all-reduce: per tensor / gpuflat {ar['per tensor'] / mine:6.2f}x, "
                f"gpuflat / floor {mine / ar['floor: one collective']:5.2f}x, "
                f"one bucket / 25 MiB buckets {mine / ar['gpuflat all_reduce_, 25 MiB buckets']:5.2f}x   "
                f"clip: peer / gpuflat {clip['torch foreach norm + all-reduce'] / mine_clip:6.2f}x")
    note = "" if scale == 1 else f" (GPT-2 scaled down {scale}x in its first dimension)"
    return ("2 ranks (pp x dp: 4), float32, medians; ratios above 1 favour gpuflat" + note + "\n"
            + "\n".join(lines))


def fsdp2_line(transport, r):
    mine, theirs = r["gpuflat.torch clip_grad_norm_"], r["torch clip_grad_norm_"]
    return (f"{transport:5} {'FSDP2':10} ({r['arrays']:>5} arrays, {r['elements']:>11,} elements)  "
            f"clip: torch / gpuflat.torch {theirs['ms'] / mine['ms']:6.2f}x "
            f"({theirs['ms']:.1f} / {mine['ms']:.1f} ms), collectives per clip: "
            f"torch {theirs['collectives']}, gpuflat {mine['collectives']}")


def pp_dp_line(transport, r):
    mine, theirs = r["gpuflat.torch clip_grad_norm_"], r["torchtitan's way"]
    return (f"{transport:5} {'pp2 x dp2':10} ({r['arrays']:>5} arrays, {r['elements']:>11,} elements)  "
            f"clip: torchtitan's way / gpuflat.torch {theirs['ms'] / mine['ms']:6.2f}x "
            f"({theirs['ms']:.1f} / {mine['ms']:.1f} ms), collectives per clip: "
            f"torchtitan's way {theirs['collectives']}, gpuflat {mine['collectives']}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, GPT-2 scaled down 16x")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--rank-of", choices=tuple(RANKS), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_of:
        return run_rank(args.rank_of, args.rest, args.scale, args.repeats, args.out)
    scale, repeats = (16, 5) if args.quick else (args.scale, args.repeats)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for transport in ("gloo", "mpi"):
            out = os.path.join(tmp, f"{transport}.json")
            launch(transport, scale, repeats, out)
            results[transport] = json.loads(Path(out).read_text())
        out = os.path.join(tmp, "pp.json")
        launch("pp", scale, repeats, out)
        results["gloo"]["pp x dp"] = json.loads(Path(out).read_text())
    text = report(results, scale)
    print(text)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"scale": scale, "repeats": repeats, "ranks": RANKS, "dtype": "float32",
                                   "summary": text, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
