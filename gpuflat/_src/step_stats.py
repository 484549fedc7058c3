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

A DTensor's figures (FSDP2) come from this rank's share of the passes: of
its local shard. With ``stats="global"`` they are its whole tensor's, the
same on every rank: per device, the step's rows of unrooted partials
(Σ|g|^p of the gradient, the inf-norm's max, Σ update², Σ new value²)
combined over the ranks in one all-reduce per mesh dimension that shards
some parameter, on the device (``ranks.LeafPartials``, with the norm's
groups and ownership: a replicated DTensor counted once), then rooted.

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

from . import dtensor, ranks
from .layout import norm_kind

__all__ = ["COLUMNS", "OPTIONS", "StepStats", "check_option", "to_host"]

# What each parameter's row of figures holds, in order.
COLUMNS = ("grad_norm", "update_norm", "update_ratio")
# What stats= takes: none, each rank's figures of its own shards, or the whole tensors'.
OPTIONS = (False, True, "global")


def check_option(stats: Any) -> bool | str:
    """``stats=`` as an optimizer takes it: False (no figures), True (a
    DTensor's figures of this rank's shard) or ``"global"`` (of its whole
    tensor); else ValueError saying what was expected and found.

    >>> check_option("global"), check_option(False)
    ('global', False)
    >>> check_option("globl")
    Traceback (most recent call last):
    ...
    ValueError: stats: expected False, True or 'global', got 'globl'
    """
    if not any(stats is option or (isinstance(stats, str) and stats == option) for option in OPTIONS):
        raise ValueError(f"stats: expected False, True or 'global', got {stats!r}")
    return stats


class StepStats:
    """One optimizer's buffers: per update rows of the step (``tensor_table.UpdateRows``),
    the sums the update writes (Σ update², Σ new value², per row) and the
    figures [n, 3] made from them, with per parameter key its row's views.
    The figures of the tables on one device are rows of one buffer, which
    with ``over_ranks`` is combined over the ranks in one collective per
    group (``ranks.LeafPartials``): a DTensor's figures are then its whole
    tensor's."""

    def __init__(self, over_ranks: bool = False) -> None:
        self.over_ranks = over_ranks
        self.params: list | None = None  # the step's parameters the buffers were made for
        self.sums: list[torch.Tensor] = []
        self.figures: list[torch.Tensor] = []
        self.picks: list[torch.Tensor | None] = []  # per table, its rows' positions among the gradients
        self.picked: list[torch.Tensor | None] = []  # per table, where the gradient norms picked land
        self.by_key: dict[Any, dict[str, torch.Tensor]] = {}
        self.keys: list[list[Any]] = []  # per table, its rows' parameters' keys in row order
        self.layout: list[tuple[int, torch.device]] = []  # per table, its rows and device
        # Per device, its tables' figures as one buffer, and (with over_ranks,
        # for DTensors) what combines it over the ranks.
        self.buffers: list[torch.Tensor] = []
        self.spread: list[ranks.LeafPartials | None] = []

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
        on: dict[torch.device, list[int]] = {}
        for t, table in enumerate(tables):
            on.setdefault(table.like.device, []).append(t)
        figures_of: dict[int, torch.Tensor] = {}
        self.buffers, self.spread = [], []
        for device, members in on.items():
            n = sum(len(tables[t].rows) for t in members)
            buffer = torch.full((n, len(COLUMNS)), float("nan"), dtype=torch.float64, device=device)
            rows, start = [], 0
            for t in members:
                figures_of[t] = buffer[start:start + len(tables[t].rows)]
                start += len(tables[t].rows)
                rows.extend(_positions(tables[t]).tolist())
            owners = [params[j] for j in rows]
            spread = None
            if self.over_ranks and any(map(dtensor.is_dtensor, owners)):
                spread = ranks.LeafPartials(buffer, owners, [str(keys[j]) for j in rows])
            self.buffers.append(buffer)
            self.spread.append(spread)
        for t, table in enumerate(tables):
            n, device = len(table.rows), table.like.device
            self.sums.append(torch.zeros((n, 2), dtype=torch.float64, device=device))
            figures = figures_of[t]
            self.figures.append(figures)
            positions, whole = _positions(table), table.positions is None
            self.picks.append(None if whole else torch.as_tensor(positions, dtype=torch.int64, device=device))
            self.picked.append(None if whole else torch.empty(n, dtype=torch.float64, device=device))
            self.keys.append([keys[j] for j in positions.tolist()])
            for r, key in enumerate(self.keys[-1]):
                self.by_key[key] = {name: figures[r, c] for c, name in enumerate(COLUMNS)}

    def finish(self, grad_norms: torch.Tensor | None, unscale: torch.Tensor | None, order: float) -> None:
        """The figures from the sums the update wrote and ``grad_norms``
        (the norm pass's per gradient, in the step's order, of ``order``;
        None where the pass gave none: NaN then), unscaled by ``unscale``
        (a GradScaler's 1 / scale, or None)."""
        for sums, figures, pick, picked in zip(self.sums, self.figures, self.picks, self.picked):
            if grad_norms is None:
                figures[:, 0].fill_(float("nan"))
            elif pick is None:
                figures[:, 0].copy_(grad_norms)
            else:
                assert picked is not None  # made with its pick
                torch.index_select(grad_norms.to(figures.device), 0, pick, out=picked)
                figures[:, 0].copy_(picked)
            figures[:, 1:].copy_(sums)
        kind = norm_kind(order)
        for buffer, spread in zip(self.buffers, self.spread):
            if spread is not None:
                # The ranks combine unrooted partials: Σ|g|^p, or the inf-norm's max.
                _power_(buffer[:, 0], kind, order)
                spread.reduce_(maxed=0 if kind == "inf" else None)
                _power_(buffer[:, 0], kind, 1.0 / order)
            if unscale is not None:
                buffer[:, 0].mul_(unscale.to(buffer.device))
            buffer[:, 1:].sqrt_()
            # ||update|| / ||new value||: inf or NaN where the value is 0.
            buffer[:, 2].reciprocal_().mul_(buffer[:, 1])


def _positions(table: Any) -> np.ndarray:
    """A table's rows' positions among the step's parameters."""
    return np.arange(len(table.rows)) if table.positions is None else table.positions


def _power_(column: torch.Tensor, kind: str, exponent: float) -> None:
    """``column`` raised to ``exponent`` in place, as a norm of ``kind``
    needs it to go between its root and its partial (nothing for the
    1-norm's and the inf-norm's, whose partial is the norm)."""
    if kind == "l2":
        # A product and IEEE's square root, not pow: the norm pass roots its 2-norms so.
        if exponent == 2.0:
            column.square_()
        else:
            column.sqrt_()
    elif kind == "p":
        column.pow_(exponent)


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
