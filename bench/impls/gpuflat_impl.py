"""gpuflat itself, on the run's backend ("numpy" on a CPU, "cuda" on a GPU) (#4)."""
from __future__ import annotations

import gpuflat as gf

from .. import arrays
from ..case import Case


def library_name(device) -> str:
    return "gpuflat"


def absent(device):
    return None


def _case(ctx, fn, value) -> Case:
    return Case(impl=f"gpuflat ({ctx.device.backend})", library="gpuflat", kind="gpuflat",
                fn=fn, value=value)


def cases(op, ctx) -> list:
    b, plan, tree, out = ctx.device.backend, ctx.plan, ctx.tree, ctx.out
    leaves_norm = lambda _: arrays.norm_of(ctx.leaves)  # noqa: E731 - the model after an in-place op
    if op == "flatten":
        return [_case(ctx, lambda: plan.flatten(tree, out=out, backend=b), arrays.norm_of_flat)]
    if op == "unflatten":
        return [_case(ctx, lambda: plan.unflatten(out), lambda t: arrays.norm_of(gf.trainables(t)))]
    if op == "scatter":
        return [_case(ctx, lambda: plan.scatter(out, tree, backend=b), leaves_norm)]
    if op == "global_norm":
        return [_case(ctx, lambda: gf.global_norm(tree, backend=b), arrays.values)]
    if op == "per_leaf_norm":
        return [_case(ctx, lambda: gf.global_norm(tree, per_leaf=True, backend=b)[1], arrays.values)]
    if op == "clip":
        return [_case(ctx, lambda: gf.clip_grad_norm_(tree, ctx.max_norm, backend=b), arrays.values)]
    if ctx.resident_tree is None:
        return []
    if op == "resident_norm":
        return [_case(ctx, lambda: gf.global_norm(ctx.resident_tree, backend=b), arrays.values)]
    if op == "resident_clip":
        return [_case(ctx, lambda: gf.clip_grad_norm_(ctx.resident_tree, ctx.max_norm, backend=b),
                      arrays.values)]
    return []
