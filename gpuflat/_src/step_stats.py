"""Per-parameter statistics of a flat optimizer's step, as by-products of
its two passes (``stats=True`` on ``gpuflat.torch.AdamW``, ``SGD`` and
``Lion``): each parameter's gradient norm from the norm pass (its order is
the optimizer's ``norm_type``; unscaled, before the clip, as
``clip_grad_norm_`` returns the total), and from the update pass the norm
of its update and the ratio of that to the norm of its new value.

The update is the held value's (the parameter, its float32 master copy, or
parameter + compensation) as the rule computed it, before it is rounded
into storage: a bfloat16 update lost to rounding still shows. The figures
stay on the device, in buffers made once and reused while the step's
parameters and tables hold, written by the kernels and a few in-place
PyTorch operations: no host read, no allocation in a repeated step.
:func:`to_host` reads them all with one copy per device.

>>> import torch, gpuflat.torch as gft
>>> w = torch.nn.Parameter(torch.ones(4))
>>> opt = gft.SGD([w], lr=0.25, stats=True)
>>> w.grad = torch.full((4,), 2.0)
>>> opt.step()
>>> {k: round(v, 4) for k, v in to_host(opt).items()}
{'grad_norm': 4.0, '0/grad_norm': 4.0, '0/update_norm': 1.0, '0/update_ratio': 1.0}
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["COLUMNS", "StepStats", "to_host"]

# What each parameter's row of figures holds, in order.
COLUMNS = ("grad_norm", "update_norm", "update_ratio")


class StepStats:
    """One optimizer's buffers: per table of the step (``param_rows.DeviceRows``),
    the sums the update writes (Σ update², Σ new value², per row) and the
    figures [n, 3] made from them, with per parameter key its row's views."""

    def __init__(self) -> None:
        self.params: list | None = None  # the step's parameters the buffers were made for
        self.sums: list[torch.Tensor] = []
        self.figures: list[torch.Tensor] = []
        self.picks: list[torch.Tensor | None] = []  # per table, its rows' positions among the gradients
        self.picked: list[torch.Tensor | None] = []  # per table, where the gradient norms picked land
        self.by_key: dict[Any, dict[str, torch.Tensor]] = {}
        self.keys: list[list[Any]] = []  # per table, its rows' parameters' keys in row order
        self.layout: list[tuple[int, torch.device]] = []  # per table, its rows and device

    def sums_for(self, tables: Sequence[Any], params: list, keys: Callable[[], Sequence[Any]]) -> list[torch.Tensor]:
        """The sums' buffers for a step over ``tables`` (made anew only
        where the step's parameters changed); ``keys()`` names each of ``params``."""
        layout = [(len(table.rows), table.like.device) for table in tables]
        if not _same(params, self.params) or layout != self.layout:  # new parameters, or their tables regrouped
            self._make(tables, params, keys())
            self.layout = layout
        return self.sums

    def _make(self, tables: Sequence[Any], params: list, keys: Sequence[Any]) -> None:
        self.params, self.by_key = params, {}
        self.sums, self.figures, self.picks, self.picked, self.keys = [], [], [], [], []
        for table in tables:
            n, device = len(table.rows), table.like.device
            self.sums.append(torch.zeros((n, 2), dtype=torch.float64, device=device))
            figures = torch.full((n, len(COLUMNS)), float("nan"), dtype=torch.float64, device=device)
            self.figures.append(figures)
            positions = np.arange(n) if table.positions is None else table.positions
            whole = table.positions is None
            self.picks.append(None if whole else torch.as_tensor(positions, dtype=torch.int64, device=device))
            self.picked.append(None if whole else torch.empty(n, dtype=torch.float64, device=device))
            self.keys.append([keys[j] for j in positions.tolist()])
            for r, key in enumerate(self.keys[-1]):
                self.by_key[key] = {name: figures[r, c] for c, name in enumerate(COLUMNS)}

    def finish(self, grad_norms: torch.Tensor | None, unscale: torch.Tensor | None) -> None:
        """The figures from the sums the update wrote and ``grad_norms``
        (the norm pass's per gradient, in the step's order; None where the
        pass gave none: NaN then), unscaled by ``unscale`` (a GradScaler's
        1 / scale, or None)."""
        for sums, figures, pick, picked in zip(self.sums, self.figures, self.picks, self.picked):
            if grad_norms is not None:
                if pick is None:
                    figures[:, 0].copy_(grad_norms)
                else:
                    assert picked is not None  # made with its pick
                    torch.index_select(grad_norms.to(figures.device), 0, pick, out=picked)
                    figures[:, 0].copy_(picked)
                if unscale is not None:
                    figures[:, 0].mul_(unscale.to(figures.device))
            else:
                figures[:, 0].fill_(float("nan"))
            updates = figures[:, 1:]
            updates.copy_(sums).sqrt_()
            # ||update|| / ||new value||: inf or NaN where the value is 0.
            figures[:, 2].reciprocal_().mul_(figures[:, 1])


def _same(params: list, kept: list | None) -> bool:
    """Whether ``params`` are the parameters ``kept`` lists, in order (the
    same list, as a repeated step's, at once)."""
    return params is kept or (kept is not None and len(params) == len(kept)
                              and all(p is q for p, q in zip(params, kept)))


def to_host(optimizer: Any) -> dict[str, float]:
    """An optimizer's last step's figures as one host dict for a logger:
    ``grad_norm`` (the global norm, unscaled, before the clip), and per
    parameter ``<key>/grad_norm``, ``<key>/update_norm`` and
    ``<key>/update_ratio`` (the key its name where the optimizer was given
    ``named_parameters()``, else its index across ``param_groups``). One copy
    to the host per device: the one synchronisation.

    >>> import torch, gpuflat.torch as gft
    >>> net = torch.nn.Linear(2, 1)
    >>> opt = gft.AdamW(net.named_parameters(), stats=True, max_norm=1.0)
    >>> net(torch.ones(3, 2)).sum().backward()
    >>> opt.step()
    >>> sorted(to_host(opt))
    ['bias/grad_norm', 'bias/update_norm', 'bias/update_ratio', 'grad_norm', 'weight/grad_norm', 'weight/update_norm', 'weight/update_ratio']
    """
    kept: StepStats | None = getattr(optimizer, "_step_stats", None)
    if kept is None or kept.params is None:
        raise ValueError(f"{type(optimizer).__name__}: expected an optimizer made with stats=True and stepped "
                         f"since, got one without figures")
    total = optimizer.last_grad_norm
    parts: dict[torch.device, list[torch.Tensor]] = {}
    for figures in kept.figures:
        parts.setdefault(figures.device, []).append(figures.reshape(-1))
    if total is not None:
        parts.setdefault(total.device, []).append(total.reshape(1).double())
    host = {device: iter(torch.cat(tensors).cpu().tolist()) for device, tensors in parts.items()}
    out: dict[str, float] = {}
    for figures, keys in zip(kept.figures, kept.keys):
        values = host[figures.device]
        for key in keys:
            for name in COLUMNS:
                out[f"{key}/{name}"] = next(values)
    if total is not None:
        out["grad_norm"] = next(host[total.device])
    return dict(sorted(out.items(), key=lambda kv: kv[0] != "grad_norm"))
