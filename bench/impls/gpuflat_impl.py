"""gpuflat itself, one row per backend the run times ("numpy", and "host" where
its C++ library builds, on a CPU; "cuda" on a GPU)."""
from __future__ import annotations

import gpuflat as gf
from gpuflat._src import native

from .. import arrays
from ..case import Case


def library_name(device) -> str:
    return "gpuflat"


def absent(device):
    return None


def cpu_backends() -> tuple:
    """gpuflat's CPU backends: "numpy" always, "host" (native C++) where its library builds here.

    >>> cpu_backends()[0]
    'numpy'
    """
    return ("numpy", "host") if native.available() else ("numpy",)


def notes(device) -> list:
    """Why a CPU run has no "host" rows: its C++ library did not build here.

    >>> from bench.context import Device
    >>> notes(Device("cuda", None, ("cuda",), None))
    []
    """
    if device.name != "cpu" or native.available():
        return []
    return [f"gpuflat (host): its C++ library did not build here, so the run has no host rows: "
            f"{native.unavailable_reason()}"]


def _case(backend, fn, value) -> Case:
    return Case(impl=f"gpuflat ({backend})", library="gpuflat", kind="gpuflat", fn=fn, value=value)


def _tree_cases(op, ctx, b) -> list:
    plan, tree, out = ctx.plan, ctx.tree, ctx.out
    leaves_norm = lambda _: arrays.norm_of(ctx.leaves)  # noqa: E731 - the model after an in-place op
    fns = {
        "flatten": (lambda: gf.flatten(plan, tree, out=out, backend=b), arrays.norm_of_flat),
        "unflatten": (lambda: gf.unflatten(plan, out, backend=b),
                      lambda t: arrays.norm_of(gf.trainables(t))),
        "scatter": (lambda: gf.scatter(plan, out, tree, backend=b), leaves_norm),
        "global_norm": (lambda: gf.global_norm(tree, backend=b), arrays.values),
        "per_leaf_norm": (lambda: gf.global_norm(tree, per_leaf=True, backend=b)[1], arrays.values),
        "clip": (lambda: gf.clip_grad_norm_(tree, ctx.max_norm, backend=b), arrays.values),
    }
    fn, value = fns[op]
    return [_case(b, fn, value)]


def _resident_case(op, ctx, b) -> Case:
    r = ctx.resident(b)
    if op == "resident_norm":
        return _case(b, r.grad_norm, arrays.values)
    return _case(b, lambda: r.clip_grad_norm_(ctx.max_norm), arrays.values)


def cases(op, ctx) -> list:
    if op.startswith("resident_"):
        return [_resident_case(op, ctx, b) for b in ctx.device.backends]
    return [case for b in ctx.device.backends for case in _tree_cases(op, ctx, b)]
