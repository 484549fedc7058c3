"""PyTorch's own whole-model helpers, on tensors sharing the model's memory,
beside gpuflat's drop-ins for them (``gpuflat.torch``) on the same tensors.

CPU tensors come from ``torch.from_numpy`` and CUDA tensors from DLPack, so
PyTorch works on the very arrays gpuflat works on and no peer pays for a copy
the others do not. The resident rows work on the gradient views of gpuflat's
resident model, and ``gf.resident`` of a list of PyTorch parameters is timed
beside them: the same pattern for a user who holds a ``torch.nn.Module``.
"""
from __future__ import annotations

from .. import arrays
from ..case import Case


def library_name(device) -> str:
    return "torch"


def absent(device):
    try:
        import torch
    except ImportError:
        return "not installed"
    if device.name == "cuda" and not torch.cuda.is_available():
        return "installed without CUDA"
    return None


def _tensor(a):
    import torch

    if type(a).__module__.startswith("cupy"):
        return torch.from_dlpack(a)
    if a.dtype.name == "bfloat16":
        # NumPy has no bfloat16, so from_numpy refuses it: share the bits as int16
        return torch.from_numpy(a.view("int16")).view(torch.bfloat16)
    return torch.from_numpy(a)


def _tensors(ctx, key, leaves):
    if key not in ctx.cache:
        ctx.cache[key] = [_tensor(a) for a in leaves]
    return ctx.cache[key]


def _holders(tensors):
    """Parameters whose .grad is the model's tensor, for clip_grad_norm_.

    A zero-stride expansion of one element stands in for each parameter, so
    this costs no memory per model copy.
    """
    import torch

    params = []
    for t in tensors:
        p = torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)
        p.grad = t
        params.append(p)
    return params


def _flatten_cases(ctx, ts):
    import torch

    vec = _tensor(ctx.out)
    sizes = [t.numel() for t in ts]
    dummies = [torch.zeros((), dtype=vec.dtype, device=vec.device).expand(t.shape) for t in ts]
    v2p = torch.nn.utils.vector_to_parameters
    return {
        "flatten": [Case("torch parameters_to_vector", "torch",
                         lambda: torch.nn.utils.parameters_to_vector(ts), arrays.norm_of_flat)],
        "unflatten": [Case("torch vector_to_parameters", "torch",
                           lambda: v2p(vec, dummies) or dummies, arrays.norm_of)],
        "scatter": [Case("torch _foreach_copy_", "torch",
                         lambda: torch._foreach_copy_(
                             ts, [v.view_as(t) for v, t in zip(vec.split(sizes), ts)]),
                         lambda _: arrays.norm_of(ctx.leaves))],
    }


def _norm_cases(ts, max_norm):
    import torch

    import gpuflat.torch as gft

    utils, params = torch.nn.utils, _holders(ts)
    return {
        "norm": [
            Case("torch get_total_norm(foreach)", "torch",
                 lambda: utils.get_total_norm(ts, foreach=True), arrays.values),
            Case("torch get_total_norm(loop)", "torch",
                 lambda: utils.get_total_norm(ts, foreach=False), arrays.values),
            Case("gpuflat.torch get_total_norm", "gpuflat", lambda: gft.get_total_norm(ts),
                 arrays.values, kind="gpuflat"),
        ],
        "per_leaf": [Case("torch _foreach_norm", "torch", lambda: torch._foreach_norm(ts),
                          arrays.values)],
        "clip": [
            Case("torch clip_grad_norm_(foreach)", "torch",
                 lambda: utils.clip_grad_norm_(params, max_norm, foreach=True), arrays.values),
            Case("torch clip_grad_norm_(loop)", "torch",
                 lambda: utils.clip_grad_norm_(params, max_norm, foreach=False), arrays.values),
            Case("gpuflat.torch clip_grad_norm_", "gpuflat",
                 lambda: gft.clip_grad_norm_(params, max_norm), arrays.values, kind="gpuflat"),
        ],
    }


def _torch_resident(ctx):
    """``gf.resident`` of the model as PyTorch parameters, their gradients
    holding the workload's values; built once per workload and dtype."""
    import torch

    import gpuflat as gf

    if "torch resident" not in ctx.cache:
        values = [_tensor(a) for a in ctx.built_values()]
        r = gf.resident([torch.nn.Parameter(t) for t in values])
        for grad, value in zip(r.grads.values(), values):
            grad.copy_(value)
        ctx.keep_grads(r)
        ctx.cache["torch resident"] = r
    return ctx.cache["torch resident"]


def _resident_cases(op, ctx):
    ts = _tensors(ctx, "resident", ctx.resident_grads)
    peers = _norm_cases(ts, ctx.max_norm)["norm" if op == "resident_norm" else "clip"]
    r = _torch_resident(ctx)
    fn = r.grad_norm if op == "resident_norm" else (lambda: r.clip_grad_norm_(ctx.max_norm))
    return peers + [Case("gpuflat resident(torch params)", "gpuflat", fn, arrays.values, kind="gpuflat")]


def _cases(op, ctx) -> list:
    if op in ("flatten", "unflatten", "scatter"):
        return _flatten_cases(ctx, _tensors(ctx, "torch", ctx.leaves))[op]
    if op in ("global_norm", "per_leaf_norm", "clip"):
        group = {"global_norm": "norm", "per_leaf_norm": "per_leaf", "clip": "clip"}[op]
        return _norm_cases(_tensors(ctx, "torch", ctx.leaves), ctx.max_norm)[group]
    return _resident_cases(op, ctx)


def cases(op, ctx) -> list:
    """The cases of ``op``: every one works on PyTorch tensors, so a CUDA
    graph of it is ``torch.cuda.graph``'s (``Case.graph``)."""
    out = _cases(op, ctx)
    for case in out:
        case.graph = "torch"
    return out
