"""Drop-in replacements for ``torch.nn.utils``' gradient-norm clipping.

Swap one import and keep the call::

    from gpuflat.torch import clip_grad_norm_   # was: from torch.nn.utils import clip_grad_norm_

The signatures, the returned 0-d tensor (on the gradients' device, in the
dtype PyTorch returns) and the errors are PyTorch's. What differs is inside:
the gradients are read zero-copy and the norm is accumulated in float64 in
one fused pass, and the clip factor ``min(1, max_norm / (norm + 1e-6))`` is
taken from that float64 norm, so it is closer to exact than PyTorch's, which
reduces in the gradients' dtype. CUDA gradients are worked on in PyTorch's
current stream, with no host synchronisation unless ``error_if_nonfinite``.

DTensor gradients (FSDP2, tensor parallel) are read in their local shards,
counted where their placements say and reduced with one collective per
mesh dimension that shards some of them (``gpuflat.distributed``); the
norm comes back as PyTorch returns it for them, a DTensor replicated over
their mesh, and the clip scales the local shards with no redistribution.

Differences that remain, on purpose:

- a tensor passed twice counts once (PyTorch counts and scales it twice);
- ``error_if_nonfinite`` reads the float64 norm, so a float16 norm that only
  overflows the returned dtype (above 65504) does not raise, and the clip
  factor stays finite where PyTorch's would scale by 0;
- ``norm_type`` must be a number p > 0 or inf, and ``max_norm`` a number
  >= 0 (ValueError otherwise); ``foreach`` is accepted and ignored (gpuflat
  always uses its fused pass);
- the clips refuse, before writing anything, gradients that share memory
  with each other (OverlapError) or within themselves (an expanded tensor,
  ValueError), which PyTorch would scale twice; integer and bool tensors
  raise NonFloatingTensorError, a RuntimeError, as PyTorch's norms do.
"""
from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Iterable

import torch

from . import distributed as _gfd
from . import dtensor
from .arrays import adopt, device_scope, to_caller
from .backends.selection import select
from .binding import max_norm_for
from .checks import check_in_place, check_ord, clip_arguments
from .errors import NonFiniteError, NonFiniteNormError, NonFloatingTensorError
from .ops import plan

__all__ = ["NonFloatingTensorError", "NonFiniteNormError", "clip_grad_norm_", "clip_grads_with_norm_",
           "get_total_norm"]
__all__ += ["AdamW", "GradScaler", "SGD"]  # gpuflat.torch_optim: the flat optimizers

_EPS = 1e-6  # PyTorch's: coef = max_norm / (total_norm + 1e-6)


@torch.no_grad()
def get_total_norm(tensors: torch.Tensor | Iterable[torch.Tensor], norm_type: float | str = 2.0,
                   error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """The norm of all ``tensors`` taken as one vector, as ``torch.nn.utils.get_total_norm``.

    >>> import torch
    >>> get_total_norm([torch.tensor([3.0]), torch.tensor([[4.0]])])
    tensor(5.)
    >>> get_total_norm([])
    tensor(0.)
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    tensors, names = _unique((t, f"tensors[{i}]") for i, t in enumerate(tensors))
    p = check_ord(norm_type)
    if not tensors:
        return torch.tensor(0.0)
    if any(map(dtensor.is_dtensor, tensors)):
        _check_floating(tensors, names)
        with _torch_nonfinite_error():
            total = _gfd.global_norm(tensors, p, error_if_nonfinite=error_if_nonfinite)
        return total.to(_returned_dtype(tensors))
    total = _total_norm(_device_groups(tensors, names), p)
    if error_if_nonfinite:
        _check_finite(total, p, tensors, names)
    return total.to(_returned_dtype(tensors))


@torch.no_grad()
def clip_grads_with_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                          total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    """Scale the parameters' gradients in place by min(1, max_norm / (total_norm + 1e-6)).

    As ``torch.nn.utils.clip_grads_with_norm_``: ``total_norm`` may come from
    anywhere (e.g. reduced over a pipeline), and the factor is applied without
    reading it on the host.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grads_with_norm_([w], 1.0, torch.tensor(5.0))
    >>> w.grad
    tensor([0.6000, 0.8000])
    """
    grads, names = _gradients(_parameter_list(parameters, warn_empty=False))
    max_norm, _, _ = clip_arguments(max_norm, 2, _EPS)  # the norm comes given: any order passes
    if dtensor.is_dtensor(total_norm):
        total_norm = total_norm.full_tensor()  # a replicated norm's own local value
    if grads:
        _scale(_device_groups(grads, names, in_place=True), max_norm, total_norm)


@torch.no_grad()
def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float | str = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradient norm of ``parameters`` in place; return the total norm before clipping.

    As ``torch.nn.utils.clip_grad_norm_``; parameters without a gradient are
    skipped. With ``error_if_nonfinite``, a NaN or inf norm raises
    NonFiniteNormError (a RuntimeError) and no gradient is scaled.

    >>> import torch
    >>> net = torch.nn.Linear(3, 1)
    >>> net(torch.ones(1, 3)).sum().backward()
    >>> float(clip_grad_norm_(net.parameters(), max_norm=1.0))
    2.0
    >>> round(float(torch.cat([p.grad.flatten() for p in net.parameters()]).norm()), 5)
    1.0
    """
    grads, names = _gradients(_parameter_list(parameters, warn_empty=True))
    max_norm, p, _ = clip_arguments(max_norm, norm_type, _EPS)
    if not grads:
        return torch.tensor(0.0)
    if any(map(dtensor.is_dtensor, grads)):
        # Over the ranks of their mesh: the norm comes back a replicated DTensor.
        _check_floating(grads, names)
        with _torch_nonfinite_error():
            total = _gfd.clip_grad_norm_(grads, max_norm, p, eps=_EPS, error_if_nonfinite=error_if_nonfinite)
        return total.to(_returned_dtype(grads))
    # Each gradient is viewed once, for the norm and the scale, and checked before either.
    groups = _device_groups(grads, names, in_place=True)
    total = _total_norm(groups, p)
    if error_if_nonfinite:
        _check_finite(total, p, grads, names)
    _scale(groups, max_norm, total)
    return total.to(_returned_dtype(grads))


# ---------------------------------------------------------------- arguments

def _parameter_list(parameters, warn_empty):
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    is_generator = isinstance(parameters, types.GeneratorType)
    parameters = list(parameters)
    if warn_empty and is_generator and not parameters:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                      stacklevel=4)
    return parameters


def _gradients(parameters):
    """(unique gradients, their names) of the parameters that have one."""
    return _unique((p.grad, f"parameters[{i}].grad") for i, p in enumerate(parameters)
                   if p.grad is not None)


def _unique(named):
    """(tensors, names) from (tensor, name) pairs, each tensor once: a tensor met twice counts once."""
    seen, tensors, names = set(), [], []
    for tensor, name in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append(tensor)
            names.append(name)
    return tensors, names


def _returned_dtype(tensors):
    """The dtype PyTorch returns: the promoted real dtype of the tensors."""
    dtype = tensors[0].dtype.to_real()
    for t in tensors[1:]:
        dtype = torch.promote_types(dtype, t.dtype.to_real())
    return dtype


# ---------------------------------------------------------------- DTensors

@contextlib.contextmanager
def _torch_nonfinite_error():
    """gpuflat.distributed's NonFiniteError raised as NonFiniteNormError, the RuntimeError PyTorch raises."""
    try:
        yield
    except NonFiniteError as err:
        raise NonFiniteNormError(str(err)) from None


# ---------------------------------------------------------------- the work, per device

class _DeviceGroup:
    """The tensors of one device, their zero-copy views, plan and backend."""

    def __init__(self, pairs):
        self.like = pairs[0][0]
        self.names = [name for _, name in pairs]
        self.views = []
        with device_scope(None, self.like):  # DLPack's exchange on PyTorch's stream: no cross-stream wait
            for t, name in pairs:
                try:
                    self.views.append(adopt(t))
                except TypeError as err:
                    raise type(err)(f"leaf {name!r}: {err}") from None
        self.plan = plan(self.views)
        self.backend = select(None, self.views, lambda i: self.names[i])


def _device_groups(tensors, names, in_place=False) -> list:
    """The tensors grouped by device, checked; with ``in_place``, also fit to be scaled in place."""
    _check_floating(tensors, names)
    groups: dict = {}
    for t, name in zip(tensors, names):
        groups.setdefault(t.device, []).append((t, name))
    groups = [_DeviceGroup(pairs) for pairs in groups.values()]
    if in_place:
        # Tensors on different devices cannot share memory: each group is checked on its own.
        for g in groups:
            check_in_place(g.names, g.views)
    return groups


def _check_floating(tensors, names):
    # An integer or bool tensor has no trainable values: gpuflat's plan would
    # leave it out, and PyTorch's vector_norm refuses it.
    for t, name in zip(tensors, names):
        if not (t.is_floating_point() or t.is_complex()):
            raise NonFloatingTensorError(
                f"leaf {name!r}: expected a floating point or complex tensor, found dtype {t.dtype}")


def _total_norm(groups, p):
    """The float64 norm of all tensors, as a 0-d tensor on the first group's device."""
    norms = []
    for g in groups:
        with device_scope(g.backend, g.like):
            result = g.backend.norms(g.plan, g.views, p, per_leaf=False)
            norms.append(to_caller(result.total, g.like))
    if len(norms) == 1:
        return norms[0]
    first = groups[0].like.device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), p)


def _check_finite(total, p, tensors, names):
    # The one host synchronisation, asked for by the caller.
    if torch.isfinite(total).item():
        return
    bad = next((name for t, name in zip(tensors, names) if not torch.isfinite(t).all()), None)
    where = (f"leaf {bad!r} holds NaN or inf" if bad else
             "no tensor holds NaN or inf, but the sum overflowed float64")
    raise NonFiniteNormError(
        f"{where}: the total norm of order {p:g} for gradients from `parameters` is "
        f"non-finite ({total.item()}), so it cannot be clipped; no gradient was scaled. To "
        f"disable this error and scale the gradients by the non-finite norm anyway, set "
        f"`error_if_nonfinite=False`"
    )


def _scale(groups, max_norm, total_norm):
    for g in groups:
        with device_scope(g.backend, g.like):
            total = torch.as_tensor(total_norm, dtype=torch.float64).to(g.like.device)
            g.backend.clip_(g.plan, g.views, adopt(total), max_norm_for(g.backend, max_norm), _EPS)


from .torch_optim import SGD, AdamW, GradScaler  # noqa: E402  (re-exported: gpuflat.torch is the PyTorch entry point)
