"""Flat optimizers: AdamW and SGD over a resident model's buffers.

A step is one norm pass over the gradients (when it clips) and one update
launch per dtype buffer, whatever the number of leaves or parameter groups:
the update kernel (``kernels/optim.cu``) takes the clip factor
``min(1, max_norm / (norm + 1e-6))`` from the norm on the device and applies
it to each gradient as it reads it, so clipping costs no pass of its own.
The state (``exp_avg`` and ``exp_avg_sq``, with ``max_exp_avg_sq`` once a
group sets ``amsgrad``; or ``momentum_buffer``) lives in flat buffers beside
the parameters, the step counts and the per-group hyperparameters in small
device tables, so the host reads nothing back. ``maximize`` (both) and
``amsgrad`` (AdamW) are PyTorch's, per group.

The arithmetic is PyTorch's (``torch.optim.AdamW`` and ``SGD``, foreach
path), computed once in ``kernels/gpuflat_optim.cuh`` for the CUDA,
emulated and host backends; the NumPy backend is the same operations in
NumPy. All give the same bits. ``gpuflat.torch.AdamW`` and ``SGD`` run the same
arithmetic over PyTorch's parameters where they are, one table row each.

>>> import numpy as np, gpuflat as gf
>>> from gpuflat.optim import SGD
>>> r = gf.resident({"w": np.array([1.0, 2.0]), "b": np.array([0.5])})
>>> opt = SGD(r, lr=0.5, max_norm=1.0)
>>> r.grads["w"][:] = [3.0, 0.0]; r.grads["b"][:] = 4.0
>>> float(opt.step())   # the gradients' norm, before the clip
5.0
>>> r.params["w"].round(6), r.params["b"].round(6)   # each gradient scaled by 1 / 5 in the update
(array([0.7, 2. ]), array([0.1]))
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

from ._src import checks as _checks
from ._src import clipping as _clipping
from ._src import public as _public
from ._src.layout import HYPER as _HYPER
from ._src.layout import CLIP_EPS as _CLIP_EPS
from ._src.layout import RULES as _RULES
from ._src.layout import Rule as _Rule

if TYPE_CHECKING:
    from ._src.residency import Resident, Storage

__all__ = ["AdamW", "Lion", "SGD"]

__dir__ = _public.listing(__all__)
# Names this module showed in 0.7.0 beside __all__, deprecated.
if not TYPE_CHECKING:  # see gpuflat._src.public
    __getattr__ = _public.deprecations(__name__, {
        "CLIP_EPS": "gpuflat.optim._CLIP_EPS",
        "FlatStep": "gpuflat.optim._FlatStep",
        "HYPER": "gpuflat._src.layout.HYPER",
        "RULES": "gpuflat._src.layout.RULES",
        "Rule": "gpuflat._src.layout.Rule",
        "checks": "gpuflat._src.checks",
    })


class _FlatStep:
    """The state and device tables of one resident model's optimizer.

    ``rule`` is the optimizer's :class:`gpuflat._src.layout.Rule`;
    ``leaf_group[k]`` the parameter group of the resident model's leaf k
    (in ``resident.layout`` order). :meth:`set_hyper` writes each group's
    row of hyperparameters, :meth:`step` updates every buffer. It reads the
    model through ``resident.buffers()`` alone; :class:`AdamW` and
    :class:`SGD` build on it. Every rule's steps are counted here, as
    ``Rule.counted_when`` says: SGD's count its momentum buffer's updates
    (the steps with momentum), and the buffer kernels tell a new buffer by
    a count of 1 after the step.

    >>> import numpy as np, gpuflat as gf
    >>> r = gf.resident({"w": np.ones(2)})
    >>> flat = _FlatStep(r, _RULES["sgd"], [0])
    >>> flat.set_hyper([_RULES["sgd"].hyper_row({"lr": 0.5, "weight_decay": 0.0, "momentum": 0.9,
    ...                                         "dampening": 0.5, "nesterov": False})])
    >>> r.grads["w"][:] = 1.0
    >>> flat.step(max_norm=None)
    (None, None)
    >>> r.params["w"], flat.state_views(0)["momentum_buffer"], flat.state_views(0)["step"]
    (array([0.5, 0.5]), array([1., 1.]), array(1.))
    """

    def __init__(self, resident: Resident, rule: _Rule, leaf_group: list[int]):
        self.buffers = resident.buffers()
        for s in resident.layout:
            if s.dtype.kind == "c":
                raise TypeError(f"leaf {s.path!r}: the flat optimizers expected a real floating "
                                f"parameter, got {s.dtype}")
        self.resident, self.rule = resident, rule
        self.n_groups = max(leaf_group, default=-1) + 1
        bufs = self.buffers
        self.slot = {k: slot for d in bufs.dtypes for k, slot in d.slot_of.items()}
        with bufs.scope():
            self.states = [[bufs.zeros(d.plan.size, d.plan.dtype) for _ in rule.state_names] for d in bufs.dtypes]
            # Each of the rule's flag_states, made (zero) when a group first sets its flag.
            self.flag_states: dict[str, list[Storage]] = {}
            self.steps = [bufs.zeros(len(d.plan.leaves), np.float64) for d in bufs.dtypes]
            self.slot_group = [bufs.zeros(len(d.plan.leaves), np.int64) for d in bufs.dtypes]
            self.counted = [bufs.zeros(len(d.plan.leaves), np.float64) for d in bufs.dtypes]
            self._leaf_group: list[int] = list(leaf_group)
            self._skipped: frozenset[int] | None = None
            # Whether each group's steps count (Rule.counted_when), by its written hyperparameters.
            self._group_counts: tuple[bool, ...] = (True,) * self.n_groups
            self._route(frozenset())
            self.hyper = bufs.zeros(max(1, self.n_groups) * _HYPER, np.float64)
            # (the gradients' unscale factor, nonzero to skip the step): a loss scaler's, on the device.
            self.amp = self._table([1.0, 0.0], np.float64)
        self._amp_plain = True
        self._written: tuple | None = None

    def _route(self, skipped: frozenset[int]) -> None:
        """Point each slot at its parameter group, or at none (-1: neither
        written nor counted) for the padding and the leaves in ``skipped``,
        whose gradients are None: PyTorch's optimizers skip such a
        parameter, leaving it, its state and its step count as they were.
        A slot's step counts where its group's do. Written to the device
        only when the set or the groups that count change."""
        for b, d in enumerate(self.buffers.dtypes):
            groups, counted = np.full(len(d.plan.leaves), -1, np.int64), np.zeros(len(d.plan.leaves))
            for k, slot in d.slot_of.items():
                if k not in skipped:
                    groups[slot] = self._leaf_group[k]
                    counted[slot] = float(self._group_counts[self._leaf_group[k]])
            _write(self.slot_group[b], groups)
            _write(self.counted[b], counted)
        self._skipped = skipped

    def _table(self, values: list[float], dtype: Any) -> Storage:
        table = self.buffers.zeros(len(values), dtype)
        _write(table, np.asarray(values, dtype))
        return table

    def set_hyper(self, rows: list) -> None:
        """Each group's hyperparameters (HYPER floats, see
        kernels/gpuflat_optim.cuh), written to the device only when they
        changed; the state a flag newly set needs is made then."""
        written = tuple(tuple(float(x) for x in row) for row in rows)
        if written == self._written:
            return
        rule, bufs = self.rule, self.buffers
        with bufs.scope():
            _write(self.hyper, np.asarray(written, np.float64).reshape(-1))
            for flag, name in rule.flag_states:
                if name not in self.flag_states and any(row[rule.hyper.index(flag)] for row in written):
                    self.flag_states[name] = [bufs.zeros(d.plan.size, d.plan.dtype) for d in bufs.dtypes]
            counts = tuple(rule.counted_when is None or row[rule.counted_field] != 0.0 for row in written)
            if counts != self._group_counts:
                self._group_counts = counts
                self._route(self._skipped or frozenset())
        self._written = written

    def step(self, max_norm: Any = None, norm_type: float = 2.0, *, inv_scale: Any = None, skip: Any = None,
             detect: bool = False) -> tuple:
        """Count a step and update every buffer: (the gradients' norm, the skip flag).

        With ``max_norm`` the update clips inside itself, and the norm
        (before the clip) comes back on the device, else None. For a loss
        scaler: ``inv_scale`` (a 0-d float64 backend array) unscales the
        gradients inside the update (the norm returned is the unscaled one);
        ``skip`` (0-d float64, nonzero to skip) leaves every parameter, state
        and step count as it was; ``detect`` takes that flag from the norm
        pass instead (NaN or inf anywhere) and returns it.
        """
        bufs = self.buffers
        if max_norm is not None:
            max_norm, p, _ = _checks.clip_arguments(max_norm, norm_type, _CLIP_EPS)
            max_norm = float(max_norm)  # the update kernel takes it by value: a device one is read once
        else:
            p = 2.0
        bufs.follow()
        xp = bufs.backend.xp
        with bufs.scope():
            skipped = bufs.gradless()
            if skipped != self._skipped:
                self._route(skipped)

            def norm() -> tuple[Any, Any]:
                total = bufs.grad_norm(p)
                return total, xp.where(xp.isfinite(total), 0.0, 1.0) if detect else None

            def update(total: Any, nonfinite: Any) -> None:
                self._update(total if max_norm is not None else None, max_norm, inv_scale,
                             nonfinite if detect else skip)

            total, nonfinite = _clipping.step_(norm, update, reads_norm=max_norm is not None or detect,
                                               unscale=None if inv_scale is None else lambda t: xp.asarray(t * inv_scale))
            return (None if total is None else bufs.to_caller(total),
                    None if not detect else bufs.to_caller(nonfinite))

    def _update(self, total: Any, max_norm: float | None, inv_scale: Any, skip: Any) -> None:
        """Every buffer's update launch, its step counts moved first: the
        gradients clipped by ``total`` (None: no clip), unscaled by
        ``inv_scale`` and the whole step skipped on the device where ``skip``
        is nonzero (None: never)."""
        bufs = self.buffers
        amp = self.amp.array
        scaled = inv_scale is not None or skip is not None
        if scaled or not self._amp_plain:
            amp[0] = 1.0 if inv_scale is None else inv_scale
            amp[1] = 0.0 if skip is None else skip
            self._amp_plain = not scaled
        # A skipped step is not counted. Assignments, not in-place
        # operators: every array module writes through them.
        count = 1.0 if skip is None else 1.0 - amp[1]
        for b, d in enumerate(bufs.dtypes):
            steps = self.steps[b].array
            steps[...] = steps + self.counted[b].array * count
            states = self.states[b] + [kept[b] for kept in self.flag_states.values()]
            bufs.backend.step_(self.rule.name, d.plan, d.params, d.grads,
                               [s.array for s in states], self.slot_group[b].array, self.hyper.array,
                               steps, total, 0.0 if max_norm is None else max_norm, _CLIP_EPS, amp)

    def state_views(self, k: int) -> dict:
        """Leaf k's state as views in the caller's kind: each of the rule's
        ``state_names`` and of the ``flag_states`` its group sets (a slice
        of its buffer), and ``step`` (a 0-d float64 view of its count)."""
        s, rule = self.resident.layout[k], self.rule
        row = self._written[self._leaf_group[k]] if self._written else ()
        buffers = dict(zip(rule.state_names, zip(*self.states)))
        buffers.update((name, self.flag_states[name]) for flag, name in rule.flag_states
                       if name in self.flag_states and row[rule.hyper.index(flag)])
        views = {name: buf[s.buffer].own[s.offset : s.offset + s.size].reshape(s.shape)
                 for name, buf in buffers.items()}
        slot = self.slot[k]
        views["step"] = self.steps[s.buffer].own[slot : slot + 1].reshape(())
        return views


def _write(table: Storage, host: np.ndarray) -> None:
    """Host values into a device table (a ``Storage``): PyTorch's copy (on
    its current stream) for a PyTorch tensor, an upload for a CuPy array."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(table.own, torch.Tensor):
        table.own.copy_(torch.from_numpy(np.ascontiguousarray(host)))
    elif isinstance(table.array, np.ndarray):
        table.array[...] = host
    else:
        table.array.set(host)


class _Flat:
    """What AdamW and SGD share: the groups, the step and the state views."""

    rule: _Rule

    def __init__(self, resident: Resident, defaults: dict, groups: list[dict] | None, max_norm: float | None,
                 norm_type: float):
        if max_norm is not None:
            _checks.clip_arguments(max_norm, norm_type, _CLIP_EPS)
        self.resident, self.max_norm, self.norm_type = resident, max_norm, norm_type
        paths = [s.path for s in resident.layout]
        self.groups, leaf_group = _groups(paths, defaults, groups)
        for i, group in enumerate(self.groups):
            _checks.optimizer_options(self.rule.name, group, i)
        self._flat = _FlatStep(resident, self.rule, leaf_group)
        self._flat.set_hyper([self.rule.hyper_row(g) for g in self.groups])
        self.last_grad_norm = None

    def step(self) -> Any:
        """One update of every parameter; the gradients' norm (before the
        clip, on the device) with ``max_norm``, else None."""
        for i, group in enumerate(self.groups):
            _checks.optimizer_options(self.rule.name, group, i)
        self._flat.set_hyper([self.rule.hyper_row(g) for g in self.groups])
        self.last_grad_norm = self._flat.step(self.max_norm, self.norm_type)[0]
        return self.last_grad_norm

    @property
    def state(self) -> dict:
        """Each leaf's state by path: views into the state buffers (and ``step``)."""
        return {s.path: self._flat.state_views(k) for k, s in enumerate(self.resident.layout)}


class AdamW(_Flat):
    """PyTorch's AdamW over a resident model (NumPy or CuPy arrays).

    ``groups`` is an optional list of dicts, each with ``"params"`` (leaf
    paths, as ``resident.layout`` names them) and the options it overrides;
    leaves in no group take the defaults. Options are read from
    ``opt.groups`` at every step, so a schedule may change ``lr`` there, or
    any other option. ``maximize`` ascends; ``amsgrad`` keeps
    ``max_exp_avg_sq``, the running maximum of ``exp_avg_sq``, and divides
    by its root instead (made at 0 when a group first sets it).

    >>> import numpy as np, gpuflat as gf
    >>> r = gf.resident({"w": np.ones(2, np.float32), "b": np.ones(1, np.float32)})
    >>> opt = AdamW(r, lr=0.1, groups=[{"params": ["['b']"], "weight_decay": 0.0}])
    >>> r.grads["w"][:] = 1.0; r.grads["b"][:] = 1.0
    >>> opt.step()
    >>> r.params["w"].round(4), r.params["b"].round(4), float(opt.state["['w']"]["step"])
    (array([0.899, 0.899], dtype=float32), array([0.9], dtype=float32), 1.0)
    >>> opt.groups[0]["amsgrad"] = True
    >>> _ = opt.step()
    >>> sorted(opt.state["['w']"]), sorted(opt.state["['b']"])
    (['exp_avg', 'exp_avg_sq', 'step'], ['exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', 'step'])
    """

    rule = _RULES["adamw"]

    def __init__(self, resident: Resident, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 max_norm: float | None = None, norm_type: float = 2.0, groups: list[dict] | None = None):
        defaults = {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad,
                    "maximize": maximize}
        super().__init__(resident, defaults, groups, max_norm, norm_type)


class SGD(_Flat):
    """PyTorch's SGD (momentum, dampening, nesterov, weight decay, maximize)
    over a resident model; ``groups`` as for :class:`AdamW`. ``step`` in a
    leaf's state counts its momentum buffer's updates (the steps with
    momentum): a momentum switched on later starts a new buffer, as
    PyTorch's does.

    >>> import numpy as np, gpuflat as gf
    >>> r = gf.resident({"w": np.ones(2)})
    >>> opt = SGD(r, lr=0.1, momentum=0.9)
    >>> for _ in range(2):
    ...     r.grads["w"][:] = 1.0
    ...     _ = opt.step()
    >>> r.params["w"], opt.state["['w']"]["momentum_buffer"]
    (array([0.71, 0.71]), array([1.9, 1.9]))
    """

    rule = _RULES["sgd"]

    def __init__(self, resident: Resident, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 max_norm: float | None = None, norm_type: float = 2.0, groups: list[dict] | None = None):
        defaults = {"lr": lr, "momentum": momentum, "dampening": dampening, "weight_decay": weight_decay,
                    "nesterov": nesterov, "maximize": maximize}
        super().__init__(resident, defaults, groups, max_norm, norm_type)


class Lion(_Flat):
    """Lion (Chen et al. 2023, https://arxiv.org/abs/2302.06675) over a
    resident model, as :class:`gpuflat.torch.Lion` computes it; ``groups``
    as for :class:`AdamW`. The state is ``exp_avg`` and ``step``.

    >>> import numpy as np, gpuflat as gf
    >>> r = gf.resident({"w": np.array([1.0, -1.0, 0.5])})
    >>> opt = Lion(r, lr=0.1, weight_decay=0.5)
    >>> r.grads["w"][:] = [2.0, -3.0, 0.0]
    >>> _ = opt.step()
    >>> r.params["w"], opt.state["['w']"]["exp_avg"]
    (array([ 0.85 , -0.85 ,  0.475]), array([ 0.02, -0.03,  0.  ]))
    """

    rule = _RULES["lion"]

    def __init__(self, resident: Resident, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, max_norm: float | None = None,
                 norm_type: float = 2.0, groups: list[dict] | None = None):
        defaults = {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay, "maximize": maximize}
        super().__init__(resident, defaults, groups, max_norm, norm_type)


def _groups(paths: list[str], defaults: dict, groups: list[dict] | None) -> tuple[list[dict], list[int]]:
    """(the groups with every option filled in, each leaf's group). Leaves in
    no group form a first group of the defaults."""
    if groups is None:
        return [dict(defaults)], [0] * len(paths)
    index = {p: k for k, p in enumerate(paths)}
    leaf_group: list[int | None] = [None] * len(paths)
    filled = []
    for i, group in enumerate(groups):
        unknown = set(group) - set(defaults) - {"params"}
        if unknown:
            raise ValueError(f"group {i}: unknown options {sorted(unknown)}; expected some of {sorted(defaults)}")
        for path in group.get("params", ()):
            if path not in index:
                raise ValueError(f"group {i}: {path!r} is not a leaf of the resident model; its leaves: "
                               f"{paths[:5]}{' ...' if len(paths) > 5 else ''}")
            if leaf_group[index[path]] is not None:
                raise ValueError(f"leaf {path!r}: expected in one group, found in groups "
                                 f"{leaf_group[index[path]]} and {i}")
            leaf_group[index[path]] = i
        filled.append({**defaults, **group, "params": list(group.get("params", ()))})
    if any(g is None for g in leaf_group):
        rest = [p for p, g in zip(paths, leaf_group) if g is None]
        filled.append({**defaults, "params": rest})
    return filled, [len(filled) - 1 if g is None else g for g in leaf_group]
