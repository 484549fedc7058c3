"""``gpuflat.torch.AdamW`` and ``SGD``: PyTorch's optimizers with the clip
inside the step, over PyTorch's own parameters.

They follow the parameters as ``torch.optim`` does and own only what they
create: ``param_groups`` hold every parameter given (frozen ones too), and
each step updates the parameters whose ``.grad`` is not None, where they are,
through their addresses. A parameter without a gradient is skipped: no
decay, no state, no step count. A layer unfrozen after the optimizer was
built, an expert unused in some steps, ``zero_grad()`` with
``set_to_none=True`` or not, ``load_state_dict(assign=True)`` on the model
(its new parameters are not followed, as ``torch.optim`` does not follow
them), ``add_param_group``: each behaves as it does with ``torch.optim``.

The state is ``torch.optim``'s: ``step`` a 0-d float32 tensor on the
parameter's device (as PyTorch's fused and capturable paths keep it),
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` and ``momentum_buffer``
tensors like the parameter, each owning its storage, created at the
parameter's first gradient (``_init_group``, as in PyTorch). SGD's
momentum buffer comes with a ``step`` of its own: the number of updates
applied to it, 0 while it is new. ``state_dict()`` and
``load_state_dict()`` go both ways with ``torch.optim.AdamW`` and ``SGD``.

With ``max_norm``, the gradients of every parameter in ``param_groups`` are
clipped by their global norm inside the update, as ``clip_grad_norm_`` over
them would: one norm pass, then one update launch per device and dtype, which
also unscales a GradScaler's gradients and skips on the device when they hold
NaN or inf. ``opt.last_grad_norm`` keeps that norm, before the clip, as a
float64 tensor. ``pp_mesh=`` and ``tied=`` are taken as by
``gpuflat.torch.clip_grad_norm_`` (``tied`` pairs a parameter with its
owning stage): the norm is then the whole pipeline's, which every stage's
optimizer joins, one whose parameters have no gradient too. A tensor
``lr`` is read where it lies, through its address: changing it between
steps needs no host read.

``amsgrad`` (the state ``max_exp_avg_sq``) and ``maximize`` are read from
each group at every step, as the loop may change them, with every other
hyperparameter; what the loop does to the groups' lists and to the state
is read too (``gpuflat._src.param_rows``). Differences, on purpose:
``differentiable`` is refused; ``foreach``, ``fused`` and ``capturable``
are accepted and change nothing; complex parameters, parameters whose
memory is not one dense block, sparse gradients and gradients laid out
unlike their parameter are refused, naming the parameter, before anything
is written; ``model.double()`` mid-training takes the state into the new
dtype.

Inside ``torch.compile(opt.step)`` the step is traced down to gpuflat's
operators (``gpuflat._src.torch_optim_ops``): no graph break in gpuflat's code,
the eager steps' bits, no recompile as ``zero_grad()`` reallocates the
gradients. SGD's momentum buffer made at a step that a GradScaler skips on
the device stays new (its count stays 0, on the device), as
``torch.optim.SGD``, which never ran that step, has none yet: its first
applied update makes it the gradient itself, and ``state_dict()`` leaves
it out.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from . import clipping, dtensor, param_rows, ranks, step_stats, tensor_table, torch_optim_ops
from ..errors import CaptureError
from .arrays import launch_stream
from .checks import clip_arguments, optimizer_options, torch_norm_type
from .residency import Resident
from .layout import HYPER, KEEPS, RULES, Rule
from .torch_optim_ops import CLIP_EPS, unscale_factor, update

__all__ = ["AdamW", "FlatOptimizer", "GradScaler", "SGD", "precision_defaults"]


class FlatOptimizer(torch.optim.Optimizer):
    """A PyTorch optimizer over one rule of ``gpuflat._src.layout.RULES``
    (a subclass names it in ``_rule``): the lazy state, the rows, the step,
    the state dicts, all read from the rule's record. A subclass gives its
    constructor's options and docstring, nothing else."""

    _rule = ""
    # torch.amp.GradScaler hands the scale and found_inf to step() instead of
    # unscaling the gradients itself: the update unscales, and skips on the device.
    _step_supports_amp_scaling = True
    # Set by gpuflat.torch.GradScaler around a step, and deleted after it (read
    # with getattr: absent otherwise). Declared only: no class attribute.
    grad_scale: torch.Tensor
    found_inf: torch.Tensor
    _found_inf_from_norm: bool
    _last_grad_norm: list[torch.Tensor | None]  # made by the last_grad_norm setter

    def __init__(self, params: Iterable[Any], defaults: dict[str, Any], max_norm: float | torch.Tensor | None, norm_type: float | str,
                 pp_mesh: Any, tied: Any, stats: bool | str = False) -> None:
        name = type(self).__name__
        stats = step_stats.check_option(stats)
        if isinstance(params, Resident):
            raise TypeError(f"gpuflat.torch.{name}: expected parameters or param groups, as torch.optim.{name} "
                            f"takes them, got a Resident; pass model.parameters(): the optimizer follows the "
                            f"parameters wherever their memory is, a resident model's buffers included")
        if max_norm is not None:
            clip_arguments(max_norm, 2.0, CLIP_EPS)
        super().__init__(params, defaults)
        param_rows.watch(self)
        ranks.check_pipeline(pp_mesh, tied, [p for g in self.param_groups for p in g["params"]])
        self.max_norm, self.norm_type = max_norm, torch_norm_type(norm_type)
        self.pp_mesh, self.tied = pp_mesh, tied
        self.last_grad_norm = None
        self._step_stats = step_stats.StepStats(over_ranks=stats == "global") if stats else None

    @property
    def stats(self) -> dict[Any, dict[str, torch.Tensor]] | None:
        """With ``stats=True`` or ``"global"``, per parameter of the last step
        (by name where the optimizer was given ``named_parameters()``, else
        by index across ``param_groups``), 0-d float64 tensors on its device
        that each step rewrites: ``grad_norm`` (unscaled, before the clip),
        ``update_norm`` and ``update_ratio`` (see ``gpuflat._src.step_stats``),
        of a DTensor's local shard with True, of its whole tensor with
        ``"global"``; else None. ``gpuflat.torch.read_stats(opt)`` reads them
        all in one copy."""
        return None if self._step_stats is None else self._step_stats.by_key

    def add_param_group(self, param_group: dict) -> None:
        """PyTorch's, then the group's options checked as ``torch.optim``
        checks them at construction (``differentiable=True`` refused)."""
        super().add_param_group(param_group)
        self._check_group(len(self.param_groups) - 1, self.param_groups[-1], compiling=False)

    @property
    def last_grad_norm(self) -> torch.Tensor | None:
        """The gradients' norm at the last step, unscaled, before the clip, as
        a float64 tensor; None before a step or without ``max_norm`` (and
        without ``stats=True`` or gpuflat's GradScaler, which has the norm
        pass look for NaN and inf)."""
        return self._last_grad_norm[0]

    @last_grad_norm.setter
    def last_grad_norm(self, total: torch.Tensor | None) -> None:
        # Held in a list: TorchDynamo drops a compiled step's writes to the
        # optimizer's own attributes
        # (https://github.com/pytorch/pytorch/issues/171590), not its writes
        # into a list the optimizer holds.
        self.__dict__.setdefault("_last_grad_norm", [None])[0] = total

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One update of every parameter that has a gradient (one launch per
        device and dtype, after one norm pass with ``max_norm``); returns the
        closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    def _init_group(self, group: dict[str, Any], params: list[torch.Tensor], grads: list[torch.Tensor],
                    state0: list[torch.Tensor], state1: list[torch.Tensor], state2: list[torch.Tensor],
                    extra: list[torch.Tensor], steps: list[torch.Tensor], indices: list[int]) -> None:
        """The lists of ``group``'s parameters that have a gradient: the
        parameters, their gradients, per name of the rows' state
        (``param_rows.state_names``: ``state0`` to ``state2``, what a 16-bit
        parameter keeps beside it, then the step counts) the tensors the
        group's steps read, and the parameters'
        indices in the group (flat lists: TorchDynamo finds the tensors an
        eager ``_init_group`` adds to them in the state); each parameter's state made first where it
        lacks what the group needs, as PyTorch's optimizers make theirs at a
        parameter's first gradient. PyTorch's name and way: a compiled step
        runs it as it is, while TorchDynamo traces, never in the graph."""
        rule = RULES[self._rule]
        columns = (state0, state1, state2, extra, steps)
        for i, p in enumerate(group["params"]):
            if p.grad is None:
                continue
            state = self.state[p]
            self._lazy_state(state, p, group)
            params.append(p)
            grads.append(p.grad)
            indices.append(i)
            keep, needs = param_rows.needs_of(rule, p, group)
            for column, name, need in zip(columns, param_rows.state_names(rule, keep), needs):
                if need:
                    column.append(state[name])

    def _update(self) -> None:
        if torch.compiler.is_compiling():
            if self._step_stats is None:
                return self._traced_update()
            # The figures come from the eager step's buffers: a compiled
            # step with stats runs it between two graphs.
            return _updated_eagerly(self)
        self._eager_update()

    def _eager_update(self) -> None:
        hyper = self._check_options(compiling=False)
        scale, found = self._amp()
        self.last_grad_norm = None
        # Everything is read and checked before anything is written.
        detect = found is _FROM_NORM
        kept = self._step_stats
        reads_norm = self.max_norm is not None or detect or kept is not None
        step = param_rows.read(self, RULES[self._rule], self._made_state,
                               with_norm=reads_norm and self.pp_mesh is None)
        if step is None and self.pp_mesh is None:  # a stage without gradients still joins the stages' norm
            return
        leaves: list[torch.Tensor | None] = [None]  # the norm pass's per gradient, for the figures

        def norm() -> tuple[torch.Tensor, torch.Tensor | None]:
            total, nonfinite, leaves[0] = self._norm(step, detect, per_leaf=kept is not None)
            return total, nonfinite

        def update_tables(total: torch.Tensor | None, nonfinite: torch.Tensor | None) -> None:
            found_now = self._found_from(nonfinite) if detect else found
            self.last_grad_norm = total
            if step is None:
                return
            sums = None if kept is None else kept.sums_for(step.table.updates, step.params,
                                                           lambda: self._keys(step.params))
            update(self._rule, step.table, self.param_groups, total, self.max_norm, scale, found_now,
                   lambda: self._read_by_address(step.params), hyper, sums)
            if kept is not None:
                kept.finish(leaves[0], None if scale is None else unscale_factor(scale), self._order())

        clipping.step_(norm, update_tables, reads_norm=reads_norm, unscale=None if scale is None else _unscaler(scale))

    def _keys(self, params: Sequence[torch.Tensor]) -> list[Any]:
        """Each parameter's key in ``stats``: its name where its group has
        ``param_names`` (``named_parameters()`` given), else its index
        across ``param_groups``."""
        key_of: dict[int, Any] = {}
        k = 0
        for group in self.param_groups:
            names = group.get("param_names")
            for i, p in enumerate(group["params"]):
                key_of.setdefault(id(p), names[i] if names else k)
                k += 1
        return [key_of[id(p)] for p in params]

    def _made_state(self, state: dict[str, Any], p: torch.Tensor, group: dict[str, Any]) -> None:
        """``_lazy_state``, refused inside a CUDA-graph capture: every replay
        would make the state again (at 0: a new momentum buffer, a step count
        of 0), so it must exist before, made by a warm-up step."""
        local = _local(p)
        if tensor_table.backend_for(local.device).name == "cuda" and launch_stream(local).is_capturing():
            where = next(f"param_groups[{g}]['params'][{i}]" for g, group_ in enumerate(self.param_groups)
                         for i, q in enumerate(group_["params"]) if q is p)
            raise CaptureError(f"{where}: its optimizer state would be made inside a CUDA-graph capture, where "
                               f"every replay would make it again; take a step before capturing (PyTorch's "
                               f"warm-up), after any change that needs new state (momentum or amsgrad switched on)")
        self._lazy_state(state, p, group)

    def _read_by_address(self, params: Sequence[torch.Tensor]) -> list:
        """The tensors a step over ``params`` reads through their addresses."""
        state = [t for p in params for t in self.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
        return [*params, *(p.grad for p in params), *state]

    def _traced_update(self) -> None:
        """The step as TorchDynamo traces it, with no host read of a tensor:
        the lists made by ``_init_group``, then the norm and the update as
        gpuflat's operators (``gpuflat._src.torch_optim_ops``) over plain tensors
        (a DTensor's local shard). A norm over the ranks (DTensors, pipeline
        stages) is a collective, run between two graphs, outside any
        operator, where every rank reaches it in the same order."""
        self._check_options(compiling=True)
        scale, found = self._amp()
        self.last_grad_norm = None
        params: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        indices: list[int] = []
        groups: list[int] = []
        columns: list = [[] for _ in param_rows.state_names(RULES[self._rule])]
        for g, group in enumerate(self.param_groups):
            lists: tuple = tuple([] for _ in range(3 + len(columns)))
            self._init_group(group, *lists)
            for whole, piece in zip((params, grads, *columns, indices), lists):
                whole.extend(piece)
            groups.extend([g] * len(lists[0]))
        if not params and self.pp_mesh is None:
            return
        detect = found is _FROM_NORM
        sharded = any(dtensor.is_dtensor(p) for p in params)

        def norm() -> tuple[torch.Tensor | None, torch.Tensor | None]:
            if sharded or self.pp_mesh is not None:
                return _norm_between_graphs(self, grads, sharded, detect)
            return torch_optim_ops.norm_and_nonfinite(grads, clip_arguments(1.0, self.norm_type, CLIP_EPS)[1], detect)

        def update_lists(total: torch.Tensor | None, nonfinite: torch.Tensor | None) -> None:
            found_now = self._found_from(nonfinite) if detect else found
            self.last_grad_norm = total
            if not params:
                return
            lr = [0.0 if isinstance(g["lr"], torch.Tensor) else float(g["lr"]) for g in self.param_groups]
            lr_tensor = [g["lr"] if isinstance(g["lr"], torch.Tensor) else None for g in self.param_groups]
            self._traced_step(dtensor.local_shards(params), dtensor.local_shards(grads),
                              [dtensor.local_shards(column) for column in columns], groups=groups, indices=indices,
                              lr=lr, lr_tensor=lr_tensor, total=total,
                              max_norm=None if self.max_norm is None else _max_norm_by_value(self.max_norm),
                              grad_scale=scale, found_inf=found_now)

        clipping.step_(norm, update_lists, reads_norm=self.max_norm is not None or detect, unscale=_unscaler(scale))

    def _check_options(self, compiling: bool) -> np.ndarray | None:
        """PyTorch's checks of each group's options, at every step too: a
        loop may change them. An eager step checks the groups whose options
        differ from those it last checked (a host tensor ``lr`` compared by
        its value), the usual step none, and returns the groups'
        hyperparameter rows (``Rule.hyper_rows``), each made again with its
        check."""
        if compiling:  # TorchDynamo traces the checks themselves, and keeps no record between graphs
            for i, group in enumerate(self.param_groups):
                self._check_group(i, group, True)
            return None
        groups = self.param_groups
        checked = self.__dict__.setdefault("_checked_options", [])
        hyper = self.__dict__.get("_hyper_rows")
        if hyper is None or len(hyper) != HYPER * len(groups):
            hyper = self.__dict__["_hyper_rows"] = np.zeros(HYPER * len(groups))
            checked.clear()
        for i, group in enumerate(groups):
            options = tuple((k, _option_value(v)) for k, v in group.items() if k != "params")
            if i < len(checked) and checked[i] == options:
                continue
            self._check_group(i, group, False)
            hyper[i * HYPER:(i + 1) * HYPER] = RULES[self._rule].hyper_row(group)
            if i < len(checked):
                checked[i] = options
            else:
                checked.append(options)
        return hyper

    def _check_group(self, i: int, group: dict[str, Any], compiling: bool) -> None:
        """PyTorch's checks of group ``i``'s options; inside a compiled step a
        tensor ``lr``'s value is not read (the update reads it)."""
        if group.get("differentiable"):
            raise ValueError(f"gpuflat.torch.{type(self).__name__}: parameter group {i}: differentiable=True is "
                             f"not implemented; expected differentiable=False, or use "
                             f"torch.optim.{type(self).__name__}")
        if compiling and isinstance(group["lr"], torch.Tensor):
            group = dict(group, lr=0.0)
        optimizer_options(self._rule, group, i)
        _check_precision(RULES[self._rule], group, i)

    def _found_from(self, nonfinite: torch.Tensor | None) -> torch.Tensor:
        """gpuflat.torch.GradScaler's found_inf, written from the norm pass's finding."""
        assert nonfinite is not None  # the norm pass gives it wherever it is asked to detect
        found = self.found_inf
        found.copy_(nonfinite.to(found.device, found.dtype).reshape(found.shape))
        return found

    def _amp(self) -> tuple[torch.Tensor | None, Any]:
        """(the GradScaler's scale or None, its found_inf: a tensor, None, or
        _FROM_NORM where gpuflat.torch.GradScaler leaves it to the norm pass)."""
        scale, found = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        if getattr(self, "_found_inf_from_norm", False):
            return scale, _FROM_NORM
        if found is not None and not isinstance(found, torch.Tensor):
            # torch.amp.GradScaler sums the flags of the devices it checked:
            # with no gradient at all there were none.
            raise RuntimeError(f"gpuflat.torch.{type(self).__name__}: no inf checks were recorded for this "
                               f"optimizer: the GradScaler found no gradient in its param_groups")
        return scale, found

    def _norm(self, step: param_rows.Step | None, detect: bool,
              per_leaf: bool = False) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(the gradients' norm as a float64 tensor, still scaled; with
        ``detect``, a 0-d tensor that is 1 where some gradient holds NaN or
        inf; with ``per_leaf``, each gradient's norm from the same pass
        (of this rank's shard, over the ranks), else None, where the pass
        spans several devices). ``step`` is
        None on a pipeline stage without gradients, which adds nothing to
        the norm."""
        p = self._order()
        grads = [] if step is None else step.grads
        # step is None only on a pipeline stage (pp_mesh set) without gradients.
        if self.pp_mesh is not None or step is None or not step.plain:  # DTensors or pipeline stages: over the ranks
            tied = None if self.tied is None else [(q.grad, stage) for q, stage in self.tied]
            found = ranks.global_norm(grads, p, pp_mesh=self.pp_mesh, tied=tied, per_leaf=per_leaf)
            # Per leaf: this rank's shards', from its share of the pass.
            total, leaves = found if per_leaf else (found, None)
            total = torch.as_tensor(total.to_local() if dtensor.is_dtensor(total) else total).double()
            nonfinite = (~torch.isfinite(total)).double() if detect else None
        else:  # the norm rows of the step's table
            total, nonfinite, leaves = tensor_table.leaf_norm_pass(step.table, p, detect, per_leaf)
        return total, nonfinite, leaves

    def _lazy_state(self, state: dict[str, Any], p: torch.Tensor, group: dict[str, Any]) -> None:
        """The rule's state where ``p`` lacks what ``group``'s steps read
        (``param_rows.needed``), made at its first gradient as PyTorch's
        optimizers make theirs: each tensor at 0 (a flag's state too when
        the flag is switched on later: AdamW's maximum then starts at 0, as at
        a first step), and ``step``, a 0-d float32 tensor on its device (as
        PyTorch's fused paths keep it). Where a rule's steps count only with
        a hyperparameter (``counted_when``: SGD's momentum), the count is of
        its state's updates: 0 with new state (the first update, which
        makes SGD's buffer the gradient itself, is the one that finds 0: a
        step a GradScaler skips leaves it new, as ``torch.optim``, which
        never ran that step, has none yet), 1 for state found without a
        count (loaded, or set by the loop). A moment's dtype is its group's
        choice (``exp_avg_dtype``...; the parameter's by default); a 16-bit
        parameter of a group with ``master_weights`` gets its float32 copy
        ``master_param``, with ``kahan_sum`` a compensation ``kahan_comp`` at 0."""
        rule = RULES[self._rule]
        keep, needs = param_rows.needs_of(rule, p, group)
        made = False
        for name, need in zip(param_rows.state_names(rule, keep), needs):
            if not need or name == "step" or state.get(name) is not None:
                continue
            dtype = param_rows.expected_dtype(rule, name, p, group)
            state[name] = made_state = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            if name == param_rows.KEPT_STATE["master"]:
                made_state.copy_(p.detach())
            made = made or name not in param_rows.KEPT_STATE.values()
        counted_by_state = rule.counted_when is not None
        if needs[-1] and ("step" not in state or (made and counted_by_state)):
            # A count kept for stochastic rounding alone (SGD without momentum) counts steps from 0.
            new = made or not counted_by_state or not needs[0]
            state["step"] = torch.full((), 0.0 if new else 1.0, dtype=torch.float32, device=_local(p).device)

    @property
    def _unapplied(self) -> tuple:
        """The state a parameter keeps once a step applied to it: left out of
        a state dict while its count is 0."""
        return tuple(name for name in param_rows.state_names(RULES[self._rule]) if name is not None)

    def _traced_step(self, params: list[torch.Tensor], grads: list[torch.Tensor], columns: list[list[torch.Tensor]], *, lr: list[float],
                     lr_tensor: list[torch.Tensor | None], **common: Any) -> None:
        """The update of a compiled step: ``gpuflat::update_``, the state
        columns (``_init_group``'s) one after the other."""
        hyper = [x for g, group in enumerate(self.param_groups)
                 for x in RULES[self._rule].hyper_row(dict(group, lr=lr[g]))]
        torch_optim_ops.update_(self._rule, params, grads, [t for column in columns[:-1] for t in column],
                                columns[-1], hyper=hyper, lr_tensor=lr_tensor,
                                keeps=[KEEPS.index(param_rows.keep_of(group)) for group in self.param_groups],
                                seeds=[int(group.get("rounding_seed", 0)) for group in self.param_groups], **common)

    def _order(self) -> float:
        """``norm_type`` as the norm's order p, read again where the loop changed it."""
        kept = self.__dict__.get("_order_of")
        if kept is None or kept[0] != self.norm_type:
            kept = self.__dict__["_order_of"] = (self.norm_type, clip_arguments(1.0, self.norm_type, CLIP_EPS)[1])
        return kept[1]

    def state_dict(self) -> dict:
        """PyTorch's, as ``torch.optim`` would hold it: a parameter's state
        made at a step that a GradScaler skipped on the device (its count
        still 0: nothing was applied) is left out, as ``torch.optim``, which
        never ran that step, has none (one host read of the counts). The
        state dicts are plain dicts."""
        packed = super().state_dict()
        applied = _host_values({k: s["step"] for k, s in packed["state"].items()
                                if isinstance(s.get("step"), torch.Tensor)})
        state = {}
        for k, s in packed["state"].items():
            s = dict(s)
            if applied.get(k, 1.0) == 0.0:
                for name in self._unapplied:
                    s.pop(name, None)
            if s:
                state[k] = s
        packed["state"] = state
        return packed

    def load_state_dict(self, state_dict: dict) -> None:
        """PyTorch's, then each state as this optimizer reads it (its dicts
        watched, a ``step`` made a 0-d float32 tensor on its parameter's
        device where the step reads it). PyTorch casts every floating state
        to its parameter's dtype; here a state keeps the dtype it was saved
        in (a float32 ``master_param`` or moment of a bfloat16 parameter
        comes back float32), and the next step takes it to the dtype its
        group chooses. A group saved without a precision option
        (``master_weights``...) takes this optimizer's."""
        super().load_state_dict(state_dict)
        self._keep_saved_dtypes(state_dict)
        chosen = {k: v for k, v in self.defaults.items() if k in _precision_options(RULES[self._rule])}
        for group in self.param_groups:
            for key, value in chosen.items():
                group.setdefault(key, value)
        param_rows.forget(self)
        param_rows.watch(self)
        for p, state in self.state.items():
            self._loaded(state, p)

    def _keep_saved_dtypes(self, state_dict: dict) -> None:
        """Each floating state that ``torch.optim.Optimizer.load_state_dict``
        cast to its parameter's dtype, put back in the dtype it was saved in
        (matched to the parameters as PyTorch matches them: the saved groups'
        indices in order)."""
        saved_ids = [k for group in state_dict["param_groups"] for k in group["params"]]
        params = [p for group in self.param_groups for p in group["params"]]
        for k, p in zip(saved_ids, params):
            loaded = self.state.get(p, {})
            for name, value in state_dict["state"].get(k, {}).items():
                now = loaded.get(name)
                if name != "step" and isinstance(value, torch.Tensor) and isinstance(now, torch.Tensor) and \
                        value.is_floating_point() and value.dtype != now.dtype:
                    loaded[name] = value.to(device=now.device)

    def _loaded(self, state: dict[str, Any], p: torch.Tensor) -> None:
        """A loaded ``step`` as the update reads it: a 0-d float32 tensor on
        its parameter's device; loaded state without one counts as applied
        where the count is of the state's updates (``torch.optim.SGD``
        keeps none)."""
        rule = RULES[self._rule]
        if rule.counted_when is not None and "step" not in state and \
                any(state.get(name) is not None for name in rule.state_names):
            state["step"] = torch.ones((), dtype=torch.float32, device=_local(p).device)
        step = state.get("step")
        if step is not None and (not isinstance(step, torch.Tensor) or step.device != _local(p).device
                                 or step.dtype != torch.float32 or step.dim() != 0):
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=_local(p).device)


_FROM_NORM = object()


def _check_precision(rule: Rule, group: dict[str, Any], i: int) -> None:
    """Group ``i``'s precision options: a moment's dtype (``exp_avg_dtype``...)
    None or one the update takes, and at most one of ``master_weights``,
    ``kahan_sum`` and ``bf16_stochastic_round`` (each is a way to keep a
    16-bit parameter's updates).

    >>> _check_precision(RULES["adamw"], {"exp_avg_dtype": torch.int8}, 1)
    Traceback (most recent call last):
    ...
    TypeError: parameter group 1: expected exp_avg_dtype None or torch.float16, torch.bfloat16, torch.float32 or torch.float64, got torch.int8
    """
    chosen = [option for option in param_rows.KEEP_OPTIONS.values() if group.get(option)]
    if len(chosen) > 1:
        raise ValueError(f"parameter group {i}: expected at most one of "
                         f"{', '.join(param_rows.KEEP_OPTIONS.values())}, got {' and '.join(chosen)}: each is "
                         f"a way to keep a 16-bit parameter's updates")
    for name in rule.state_names:
        option = rule.dtype_option(name)
        dtype = group.get(option) if option is not None else None
        if dtype is not None and dtype not in param_rows.STEPPED:
            expected = ", ".join(map(str, param_rows.STEPPED[:-1])) + f" or {param_rows.STEPPED[-1]}"
            raise TypeError(f"parameter group {i}: expected {option} None or {expected}, got {dtype!r}")


def _precision_options(rule: Rule) -> tuple[str, ...]:
    """The names of a rule's precision options, as a group holds them."""
    dtypes = (rule.dtype_option(name) for name in rule.state_names)
    return (*param_rows.KEEP_OPTIONS.values(), "rounding_seed", *(d for d in dtypes if d is not None))


def precision_defaults(rule: str, master_weights: bool, kahan_sum: bool, bf16_stochastic_round: bool,
                       rounding_seed: int, **dtypes: torch.dtype | None) -> dict:
    """The precision options of an optimizer's constructor that differ from
    the plain ones, for its ``defaults``: a state dict then says which
    options made its state, and one made without any is ``torch.optim``'s.

    >>> precision_defaults("adamw", True, False, False, 0, exp_avg_dtype=None, exp_avg_sq_dtype=torch.float32)
    {'master_weights': True, 'exp_avg_sq_dtype': torch.float32}
    """
    assert set(dtypes) <= {RULES[rule].dtype_option(name) for name in RULES[rule].state_names}
    if not isinstance(rounding_seed, int) or not 0 <= rounding_seed < 1 << 23:
        raise ValueError(f"rounding_seed: expected an int in [0, 2**23), got {rounding_seed!r}")
    chosen = dict(master_weights=master_weights, kahan_sum=kahan_sum, bf16_stochastic_round=bf16_stochastic_round,
                  rounding_seed=rounding_seed or None, **dtypes)
    return {k: v for k, v in chosen.items() if v not in (False, None)}


def _option_value(value: Any) -> Any:
    """An option as a step's checks compare it: a tensor on the host by its
    value (a scheduler writes it in place), one elsewhere by its identity
    (never read: that would wait for its device), a list or tuple by its
    items' values (``betas`` as a list may be edited in place), anything
    else itself.

    >>> betas = [0.9, torch.tensor(0.99)]
    >>> before = _option_value(betas); betas[0] = 0.5
    >>> before == _option_value(betas), before
    (False, (0.9, 0.9900000095367432))
    """
    if isinstance(value, torch.Tensor):
        return float(value) if value.device.type == "cpu" and value.numel() == 1 else id(value)
    if isinstance(value, (list, tuple)):
        return tuple(map(_option_value, value))
    return value


def _host_values(tensors: dict) -> dict:
    """The values of 0-d ``tensors`` (by key) as floats: one host read per device.

    >>> _host_values({"a": torch.tensor(2.0), "b": torch.tensor(0.0)})
    {'a': 2.0, 'b': 0.0}
    """
    by_device: dict = {}
    for k, t in tensors.items():
        local = _local(t).detach().reshape(())
        by_device.setdefault(local.device, []).append((k, local))
    values: dict[Any, float] = {}
    for pairs in by_device.values():
        read = torch.stack([t for _, t in pairs]).double().cpu().tolist()
        values.update(zip([k for k, _ in pairs], read))
    return values


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, any other tensor itself."""
    return dtensor.local(t) if dtensor.is_dtensor(t) else t


@torch.compiler.disable
def _updated_eagerly(optimizer: FlatOptimizer) -> None:
    """``optimizer``'s eager update, run between two graphs of a compiled step."""
    optimizer._eager_update()


@torch.compiler.disable
def _norm_between_graphs(optimizer: FlatOptimizer, grads: list[torch.Tensor], sharded: bool,
                         detect: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``optimizer._norm`` of ``grads`` (DTensors, or a pipeline stage's), run
    as it is between two graphs of a compiled step: its collective stays out
    of the graph and of any operator."""
    step = None if not grads else param_rows.Step(tensor_table.Table([]), params=[], grads=grads, plain=not sharded)
    total, nonfinite, _ = optimizer._norm(step, detect)
    return total, nonfinite


def _unscaler(scale: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """What a step's norm is multiplied by to be that of the unscaled
    gradients, as after ``GradScaler.unscale_``; None without a scaler."""
    if scale is None:
        return None
    return lambda total: total * unscale_factor(scale).to(total.device)


def _max_norm_by_value(max_norm: float | torch.Tensor) -> float:
    """``max_norm`` as a compiled step's update takes it: a number (its
    kernels take it by value; the drop-in's compiled clip reads a 0-d
    tensor where it lies, ``gpuflat.torch._compiled_max_norm``)."""
    if isinstance(max_norm, torch.Tensor):
        raise TypeError("max_norm: a flat optimizer's compiled step takes a number, got a tensor (its update "
                        "kernels take max_norm by value); pass float(max_norm) to the optimizer, or step outside "
                        "the compiled function")
    return float(max_norm)


class AdamW(FlatOptimizer):
    """``torch.optim.AdamW``, with the clip inside the step.

    >>> import torch, gpuflat.torch as gft
    >>> net = torch.nn.Linear(3, 2)
    >>> opt = gft.AdamW(net.parameters(), lr=1e-2, max_norm=1.0)
    >>> net(torch.ones(4, 3)).sum().backward()
    >>> opt.step()
    >>> sorted(opt.state[net.weight]), opt.state[net.weight]["step"], opt.last_grad_norm.dtype
    (['exp_avg', 'exp_avg_sq', 'step'], tensor(1.), torch.float64)

    A 16-bit parameter keeps the updates that rounding to its dtype would
    lose in a float32 copy (``master_weights=True``) or a compensation
    (``kahan_sum=True``); ``exp_avg_dtype`` and ``exp_avg_sq_dtype`` choose
    the moments' dtypes (None: the parameter's):

    >>> w = torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    >>> opt = gft.AdamW([w], lr=1e-4, master_weights=True, exp_avg_dtype=torch.float32)
    >>> w.grad = torch.ones(2, dtype=torch.bfloat16)
    >>> opt.step()
    >>> w.detach(), opt.state[w]["master_param"], opt.state[w]["exp_avg"].dtype
    (tensor([1., 1.], dtype=torch.bfloat16), tensor([0.9999, 0.9999]), torch.float32)

    ``stats=True`` keeps each step's per-parameter figures on the device
    (``opt.stats``; ``gpuflat.torch.read_stats`` reads them to the host):
    a DTensor's (FSDP2) are of this rank's shard. ``stats="global"`` makes
    them its whole tensor's, the same on every rank, for one more
    collective per step: an all-reduce over each DTensor's mesh dimensions
    that shard it, of three float64 numbers per parameter, made on the
    device, with no host read and no allocation after the first step. A
    plain tensor's, or a replicated DTensor's, figures are whole already:

    >>> net = torch.nn.Linear(3, 2)
    >>> opt = gft.AdamW(net.named_parameters(), stats="global")
    >>> net(torch.ones(4, 3)).sum().backward()
    >>> opt.step()
    >>> round(float(opt.stats["bias"]["grad_norm"]), 4)  # the bias's gradient is 4 in each of 2 elements
    5.6569
    """

    _rule = "adamw"

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, capturable: bool = False, differentiable: bool = False,
                 fused: bool | None = None, max_norm: float | None = None, norm_type: float | str = 2.0,
                 pp_mesh: Any = None, tied: Iterable | None = None, master_weights: bool = False,
                 kahan_sum: bool = False, bf16_stochastic_round: bool = False, rounding_seed: int = 0,
                 exp_avg_dtype: torch.dtype | None = None, exp_avg_sq_dtype: torch.dtype | None = None,
                 stats: bool | str = False):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=True,
                        **precision_defaults("adamw", master_weights, kahan_sum, bf16_stochastic_round,
                                             rounding_seed, exp_avg_dtype=exp_avg_dtype,
                                             exp_avg_sq_dtype=exp_avg_sq_dtype))
        super().__init__(params, defaults, max_norm, norm_type, pp_mesh, tied, stats)


class SGD(FlatOptimizer):
    """``torch.optim.SGD``, with the clip inside the step.

    >>> import torch, gpuflat.torch as gft
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = gft.SGD([w], lr=0.5, momentum=0.9)
    >>> w.grad = torch.ones(2)
    >>> opt.step()
    >>> w.detach(), opt.state[w]["momentum_buffer"]
    (tensor([0.5000, 0.5000]), tensor([1., 1.]))

    ``master_weights``, ``kahan_sum`` and ``momentum_buffer_dtype`` are
    :class:`AdamW`'s precision options, and ``stats`` (True, or
    ``"global"`` for a DTensor's whole tensor) its figures.
    """

    _rule = "sgd"

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, differentiable: bool = False, fused: bool | None = None,
                 max_norm: float | None = None, norm_type: float | str = 2.0, pp_mesh: Any = None,
                 tied: Iterable | None = None, master_weights: bool = False, kahan_sum: bool = False,
                 bf16_stochastic_round: bool = False, rounding_seed: int = 0,
                 momentum_buffer_dtype: torch.dtype | None = None, stats: bool | str = False):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused, **precision_defaults("sgd", master_weights, kahan_sum, bf16_stochastic_round,
                                                          rounding_seed, momentum_buffer_dtype=momentum_buffer_dtype))
        super().__init__(params, defaults, max_norm, norm_type, pp_mesh, tied, stats)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose ``step`` makes a gpuflat optimizer's
    scaled step two passes over the gradients instead of three.

    For an optimizer that takes the scale itself, the stock ``step`` first
    reads every gradient for NaN and inf (``_check_inf_per_device``). Here a
    gpuflat optimizer takes that flag from its own norm pass instead (from
    the gradients' finiteness, not the norm's: float64 gradients above about
    1e154 overflow a 2-norm but are finite) and records it where
    ``update()`` reads it; everything else (other optimizers, a step after
    ``unscale_``) is the stock scaler's.

    >>> import torch, gpuflat.torch as gft
    >>> net = torch.nn.Linear(3, 2)
    >>> opt, scaler = gft.AdamW(net.parameters(), max_norm=1.0), gft.GradScaler("cpu", init_scale=2.0**8)
    >>> scaler.scale(net(torch.ones(4, 3)).sum()).backward()
    >>> net.bias.grad[0] = float("inf")
    >>> scaler.step(opt); scaler.update()
    >>> scaler.get_scale(), float(opt.state[net.bias]["step"]), float(opt.last_grad_norm)
    (128.0, 0.0, inf)
    """

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """As ``torch.amp.GradScaler.step``; a gpuflat optimizer finds NaN and inf in its own norm pass."""
        from torch.amp.grad_scaler import OptState

        if not self._enabled or not isinstance(optimizer, FlatOptimizer):
            return super().step(optimizer, *args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("Closure use is not currently supported if GradScaler is enabled.")
        scale, _ = self._check_scale_growth_tracker("step")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:  # unscaled already, or stepped twice: the stock rules
            return super().step(optimizer, *args, **kwargs)
        found = torch.zeros((), dtype=torch.float32, device=scale.device)
        state["found_inf_per_device"] = {scale.device: found}
        optimizer.grad_scale, optimizer.found_inf, optimizer._found_inf_from_norm = scale, found, True
        try:
            result = optimizer.step(*args, **kwargs)
        finally:
            del optimizer.grad_scale, optimizer.found_inf, optimizer._found_inf_from_norm
        state["stage"] = OptState.STEPPED
        return result
