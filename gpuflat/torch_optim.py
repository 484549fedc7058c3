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
``exp_avg``, ``exp_avg_sq`` and ``momentum_buffer`` tensors like the
parameter, each owning its storage, created at the parameter's first
gradient (``_init_group``, as in PyTorch). ``state_dict()`` and
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

Differences, on purpose: ``amsgrad``, ``maximize`` and ``differentiable``
are refused; ``foreach``, ``fused`` and ``capturable`` are accepted and
change nothing; complex parameters, parameters whose memory is not one
dense block, and gradients laid out unlike their parameter are refused,
naming the parameter, before anything is written.
"""
from __future__ import annotations

import numpy as np
import torch

from . import distributed, dtensor, param_rows, tensor_table
from .arrays import adopt, device_scope
from .checks import clip_arguments, optimizer_options
from .layout import HYPER, TAG_OF_NAME, hyper_row
from .residency import Resident

__all__ = ["AdamW", "GradScaler", "SGD"]

REFUSED = ("amsgrad", "maximize", "differentiable")
CLIP_EPS = 1e-6  # PyTorch's clip_grad_norm_: max_norm / (norm + 1e-6)


class _FlatOptimizer(torch.optim.Optimizer):
    """What AdamW and SGD share: the lazy state, the rows, the step."""

    _rule = ""
    # torch.amp.GradScaler hands the scale and found_inf to step() instead of
    # unscaling the gradients itself: the update unscales, and skips on the device.
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults, max_norm, norm_type, pp_mesh, tied):
        name = type(self).__name__
        for option in REFUSED:
            if defaults.get(option):
                raise ValueError(f"gpuflat.torch.{name}: {option}=True is not implemented; expected "
                                 f"{option}=False, or use torch.optim.{name}")
        if max_norm is not None:
            clip_arguments(max_norm, norm_type, CLIP_EPS)
        if isinstance(params, Resident):
            raise TypeError(f"gpuflat.torch.{name}: expected parameters or param groups, as torch.optim.{name} "
                            f"takes them, got a Resident; pass model.parameters(): the optimizer follows the "
                            f"parameters wherever their memory is, a resident model's buffers included")
        super().__init__(params, defaults)
        distributed.check_pipeline(pp_mesh, tied, [p for g in self.param_groups for p in g["params"]])
        self.max_norm, self.norm_type = max_norm, norm_type
        self.pp_mesh, self.tied = pp_mesh, tied
        self.last_grad_norm = None

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter that has a gradient (one launch per
        device and dtype, after one norm pass with ``max_norm``); returns the
        closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    def _init_group(self, state, p, group) -> bool:
        """Make ``p``'s state where it has none, as PyTorch's optimizers make
        theirs at a parameter's first gradient; whether a momentum buffer was
        made now (its first update is then the gradient itself)."""
        return self._lazy_state(state, p, group)

    # Inside a torch.compile'd step the update is not traced: it runs as it
    # is between two graphs (its native calls and host-side tables are
    # nothing TorchDynamo can trace faithfully).
    @torch.compiler.disable
    def _update(self):
        for i, group in enumerate(self.param_groups):
            optimizer_options(self._rule, group, i)
        scale, found = self._amp()
        self.last_grad_norm = None
        # Everything is read and checked before anything is written.
        step = param_rows.read(self, self._state_names, self._init_group)
        if step is None and self.pp_mesh is None:  # a stage without gradients still joins the stages' norm
            return
        detect = found is _FROM_NORM
        total, nonfinite = self._norm(step, scale, detect)
        if detect:
            found = self.found_inf
            found.copy_(nonfinite.to(found.device, found.dtype).reshape(found.shape))
        self.last_grad_norm = total
        hyper = np.array([hyper_row(self._rule, g) for g in self.param_groups], np.float64).reshape(-1)
        for table in step.tables if step is not None else ():
            self._step_table(table, hyper, total, scale, found)

    def _amp(self):
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

    def _norm(self, step, scale, detect):
        """(the gradients' norm, unscaled, as a float64 tensor, or None
        without ``max_norm`` or ``detect``; with ``detect``, a 0-d tensor that
        is 1 where some gradient holds NaN or inf). ``step`` is None on a
        pipeline stage without gradients, which adds nothing to the norm."""
        if self.max_norm is None and not detect:
            return None, None
        p = clip_arguments(1.0, self.norm_type, CLIP_EPS)[1]
        grads = [] if step is None else step.grads
        if self.pp_mesh is not None or not step.plain:  # DTensors or pipeline stages: over the ranks
            tied = None if self.tied is None else [(q.grad, stage) for q, stage in self.tied]
            total = distributed.global_norm(grads, p, pp_mesh=self.pp_mesh, tied=tied)
            total = torch.as_tensor(total.to_local() if dtensor.is_dtensor(total) else total).double()
            nonfinite = (~torch.isfinite(total)).double() if detect else None
        else:
            table = tensor_table.read(grads, step.name_of_gradient, facts=step.grad_facts)
            total, _, nonfinite = tensor_table.norm_pass(table, grads, p, detect)
        if scale is not None:  # the norm of the unscaled gradients, as after GradScaler.unscale_
            total = total * scale.double().reciprocal().float().double().to(total.device)
        return total, nonfinite

    def _step_table(self, table, hyper, total, scale, found):
        like = table.like
        backend = tensor_table.backend_for(like.device)
        hyper, lr_at = _learning_rates(self.param_groups, like.device, hyper)
        with device_scope(backend, like):
            amp = _amp_array(scale, found, like.device)
            clip = None if self.max_norm is None else adopt(total.to(like.device).reshape(()))
            backend.step_rows(self._rule, TAG_OF_NAME[str(like.dtype).removeprefix("torch.")], table.rows, hyper,
                              lr_at, clip, 0.0 if self.max_norm is None else float(self.max_norm), CLIP_EPS, amp)

    def load_state_dict(self, state_dict) -> None:
        """PyTorch's, then each ``step`` as this optimizer keeps it: a 0-d
        float32 tensor on its parameter's device."""
        super().load_state_dict(state_dict)
        param_rows.forget(self)
        for p, state in self.state.items():
            step = state.get("step")
            if step is not None and (not isinstance(step, torch.Tensor) or step.device != _local(p).device
                                     or step.dtype != torch.float32 or step.dim() != 0):
                state["step"] = torch.tensor(float(step), dtype=torch.float32, device=_local(p).device)


_FROM_NORM = object()


def _local(t):
    """A DTensor's local shard, any other tensor itself."""
    return dtensor.local(t) if dtensor.is_dtensor(t) else t


def _learning_rates(groups, device, hyper) -> tuple:
    """(``hyper`` with each group's lr as the update on ``device`` reads it,
    where a tensor ``lr`` is read: its address and dtype tag per group, or
    (0, 0) where the row holds the value). A 0-d float32 or float64 ``lr``
    on ``device`` is read there, through its address (a scheduler's write
    needs no host read); any other tensor ``lr`` is read on the host into the
    row (on a GPU other than the parameters', that read waits for it).

    >>> hyper, at = _learning_rates([{"lr": torch.tensor(0.5)}], torch.device("cpu"), np.zeros(5))
    >>> bool(at[0] != 0), int(at[1])
    (True, 2)
    """
    hyper, at = hyper.copy(), np.zeros(2 * max(1, len(groups)), np.int64)
    for g, group in enumerate(groups):
        lr = group["lr"]
        if not isinstance(lr, torch.Tensor):
            continue
        if lr.device == device and lr.numel() == 1 and lr.dtype in (torch.float32, torch.float64):
            at[2 * g], at[2 * g + 1] = lr.data_ptr(), TAG_OF_NAME[str(lr.dtype).removeprefix("torch.")]
        else:
            hyper[g * HYPER] = float(lr)
    return hyper, at


_PLAIN_AMP: dict = {}


def _amp_array(scale, found, device):
    """(the unscale factor, the skip flag) as a float64 array of the backend's kind on ``device``."""
    if scale is None and found is None:
        amp = _PLAIN_AMP.get(device)
        if amp is None:
            amp = _PLAIN_AMP[device] = torch.tensor([1.0, 0.0], dtype=torch.float64, device=device)
    else:
        # GradScaler's unscale_ multiplies by scale.double().reciprocal().float().
        one, zero = (torch.full((), v, dtype=torch.float64, device=device) for v in (1.0, 0.0))
        inv = one if scale is None else scale.double().reciprocal().float().double().reshape(()).to(device)
        flag = zero if found is None else found.double().reshape(()).to(device)
        amp = torch.stack((inv, flag))
    return adopt(amp)


class AdamW(_FlatOptimizer):
    """``torch.optim.AdamW``, with the clip inside the step.

    >>> import torch, gpuflat.torch as gft
    >>> net = torch.nn.Linear(3, 2)
    >>> opt = gft.AdamW(net.parameters(), lr=1e-2, max_norm=1.0)
    >>> net(torch.ones(4, 3)).sum().backward()
    >>> opt.step()
    >>> sorted(opt.state[net.weight]), opt.state[net.weight]["step"], opt.last_grad_norm.dtype
    (['exp_avg', 'exp_avg_sq', 'step'], tensor(1.), torch.float64)
    """

    _rule = "adamw"
    _state_names = ("exp_avg", "exp_avg_sq")
    _counts_steps = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 max_norm=None, norm_type=2.0, pp_mesh=None, tied=None):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=True)
        super().__init__(params, defaults, max_norm, norm_type, pp_mesh, tied)

    def _lazy_state(self, state, p, group) -> bool:
        if len(state) == 0:
            state["step"] = torch.zeros((), dtype=torch.float32, device=_local(p).device)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return False


class SGD(_FlatOptimizer):
    """``torch.optim.SGD``, with the clip inside the step.

    >>> import torch, gpuflat.torch as gft
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = gft.SGD([w], lr=0.5, momentum=0.9)
    >>> w.grad = torch.ones(2)
    >>> opt.step()
    >>> w.detach(), opt.state[w]["momentum_buffer"]
    (tensor([0.5000, 0.5000]), tensor([1., 1.]))
    """

    _rule = "sgd"
    _state_names = ("momentum_buffer",)
    _counts_steps = False

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, max_norm=None, norm_type=2.0,
                 pp_mesh=None, tied=None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused)
        super().__init__(params, defaults, max_norm, norm_type, pp_mesh, tied)

    def _lazy_state(self, state, p, group):
        """PyTorch's SGD keeps a momentum buffer only where momentum is used,
        made at the parameter's first gradient (then it is the gradient)."""
        if group["momentum"] == 0 or state.get("momentum_buffer") is not None:
            return False
        state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        return True


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

    def step(self, optimizer, *args, **kwargs):
        """As ``torch.amp.GradScaler.step``; a gpuflat optimizer finds NaN and inf in its own norm pass."""
        from torch.amp.grad_scaler import OptState

        if not self._enabled or not isinstance(optimizer, _FlatOptimizer):
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
