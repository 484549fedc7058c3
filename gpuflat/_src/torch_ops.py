"""gpuflat's norm and clip as PyTorch operators, for ``torch.compile``.

Inside a compiled function TorchDynamo cannot trace gpuflat's native calls
and host-side tables; as operators (``gpuflat._src.torch_optim_ops.operator``
registers them) they stay in the graph, opaque, and run as they are when
the graph runs, their table caches inside them, so new gradient tensors in
a later step neither recompile nor re-trace anything. Each has a fake
implementation that gives its result's metadata without running. The operators take plain tensors:
DTensors are unwrapped, and their collectives run, outside any operator, or
ranks could reach them in different orders.

Eager calls never go through the dispatcher: a Python operator costs
milliseconds on lists of 10,000 tensors, more than the whole eager clip.
``gpuflat.torch`` calls these only while compiling
(``torch.compiler.is_compiling()``).

>>> ts = [torch.tensor([3.0]), torch.tensor([4.0])]
>>> total = torch.ops.gpuflat.total_norm(ts, 2.0)
>>> total.dtype, float(total)
(torch.float64, 5.0)
>>> torch.ops.gpuflat.scale_by_norm_(ts, 1.0, total, 1e-6)
>>> [round(float(t), 4) for t in ts]
[0.6, 0.8]
>>> round(float(torch.ops.gpuflat.clip_(ts, 0.5, None, 2.0, 0.0)), 4), [round(float(t), 4) for t in ts]
(1.0, [0.3, 0.4])
"""
from __future__ import annotations

from typing import Optional

import torch

from . import clipping, tensor_table
from .torch_optim_ops import fake, operator

__all__ = ["clip_", "scale_by_norm_", "scale_by_tensor_norm_", "total_norm"]


@operator("total_norm")
def total_norm(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The float64 norm of order ``norm_type`` of all ``tensors`` as one
    vector, a 0-d tensor on the first one's device (one fused pass per device).
    """
    table = tensor_table.read(tensors, "tensors[{}]".format)
    assert table is not None, "the operators take plain tensors: read gives None only for DTensors"
    return tensor_table.norm_pass(table, norm_type)[0].clone()


@fake(total_norm)
def _(tensors: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    return tensors[0].new_empty((), dtype=torch.float64)


@operator("scale_by_norm_", mutates=("tensors",))
def scale_by_norm_(tensors: list[torch.Tensor], max_norm: float, total: torch.Tensor, eps: float) -> None:
    """Scale every tensor in place by min(1, max_norm / (total + eps)), the
    factor taken from ``total`` on the device (no host read)."""
    table = tensor_table.read(tensors, "tensors[{}]".format, in_place=True)
    assert table is not None, "the operators take plain tensors: read gives None only for DTensors"
    clipping.scale_by(table.bound, total, max_norm, eps)


@fake(scale_by_norm_)
def _(tensors: list[torch.Tensor], max_norm: float, total: torch.Tensor, eps: float) -> None:
    return None


@operator("scale_by_tensor_norm_", mutates=("tensors",))
def scale_by_tensor_norm_(tensors: list[torch.Tensor], max_norm: torch.Tensor, total: torch.Tensor,
                          eps: float) -> None:
    """:func:`scale_by_norm_` with ``max_norm`` a 0-d tensor, read where it
    lies (on a GPU by the kernel: a schedule may change it between calls of
    a compiled function or replays of a graph)."""
    table = tensor_table.read(tensors, "tensors[{}]".format, in_place=True)
    assert table is not None, "the operators take plain tensors: read gives None only for DTensors"
    clipping.scale_by(table.bound, total, max_norm, eps)


@fake(scale_by_tensor_norm_)
def _(tensors: list[torch.Tensor], max_norm: torch.Tensor, total: torch.Tensor, eps: float) -> None:
    return None


@operator("clip_", mutates=("tensors",))
def clip_(tensors: list[torch.Tensor], max_norm: float, max_norm_tensor: Optional[torch.Tensor], norm_type: float,
          eps: float) -> torch.Tensor:
    """The eager clip in one operator: every tensor scaled in place by
    min(1, max_norm / (total + eps)), ``total`` the float64 norm of order
    ``norm_type`` of all of them as one vector, which it returns; their
    table is read once, for the norm and the scale. ``max_norm_tensor``,
    where given, is ``max_norm`` as a 0-d tensor read where it lies."""
    table = tensor_table.read(tensors, "tensors[{}]".format, in_place=True)
    assert table is not None, "the operators take plain tensors: read gives None only for DTensors"
    limit = max_norm if max_norm_tensor is None else max_norm_tensor
    return clipping.clip_(table.bound, limit, norm_type, eps, False).clone()


@fake(clip_)
def _(tensors: list[torch.Tensor], max_norm: float, max_norm_tensor: Optional[torch.Tensor], norm_type: float,
      eps: float) -> torch.Tensor:
    return tensors[0].new_empty((), dtype=torch.float64)
