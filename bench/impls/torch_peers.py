"""PyTorch's own whole-model helpers, on tensors sharing the model's memory (#4).

CPU tensors come from ``torch.from_numpy`` and CUDA tensors from DLPack, so
PyTorch works on the very arrays gpuflat works on and no peer pays for a copy
the others do not.
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

    utils, params = torch.nn.utils, _holders(ts)
    return {
        "norm": [
            Case("torch get_total_norm(foreach)", "torch",
                 lambda: utils.get_total_norm(ts, foreach=True), arrays.values),
            Case("torch get_total_norm(loop)", "torch",
                 lambda: utils.get_total_norm(ts, foreach=False), arrays.values),
        ],
        "per_leaf": [Case("torch _foreach_norm", "torch", lambda: torch._foreach_norm(ts),
                          arrays.values)],
        "clip": [
            Case("torch clip_grad_norm_(foreach)", "torch",
                 lambda: utils.clip_grad_norm_(params, max_norm, foreach=True), arrays.values),
            Case("torch clip_grad_norm_(loop)", "torch",
                 lambda: utils.clip_grad_norm_(params, max_norm, foreach=False), arrays.values),
        ],
    }


def cases(op, ctx) -> list:
    if op in ("flatten", "unflatten", "scatter"):
        return _flatten_cases(ctx, _tensors(ctx, "torch", ctx.leaves))[op]
    if op in ("global_norm", "per_leaf_norm", "clip"):
        group = {"global_norm": "norm", "per_leaf_norm": "per_leaf", "clip": "clip"}[op]
        return _norm_cases(_tensors(ctx, "torch", ctx.leaves), ctx.max_norm)[group]
    if ctx.resident_leaves is None:
        return []
    ts = _tensors(ctx, "resident", ctx.resident_leaves)
    return _norm_cases(ts, ctx.max_norm)["norm" if op == "resident_norm" else "clip"]
