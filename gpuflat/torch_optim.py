"""``gpuflat.torch.AdamW`` and ``SGD``: PyTorch optimizers over a resident model.

Constructed as ``torch.optim.AdamW`` and ``SGD`` are, plus ``max_norm=`` and
``norm_type=``: with ``max_norm`` the step clips the gradients by their
global norm inside the update (``gpuflat.optim``), so a clipped step reads
the gradients twice (the norm, then the update) instead of four times, and
``opt.last_grad_norm`` keeps that norm, before the clip, as a device tensor.

The parameters that require grad become resident (``gf.resident``) unless a
``Resident`` is passed as ``params``; the state lives in flat buffers beside
them and ``opt.state[p]`` holds views into those (after the first step, as
in PyTorch). ``state_dict()`` and ``load_state_dict()`` use PyTorch's format,
so a state saved from ``torch.optim.AdamW`` loads here and back.

Differences, on purpose:

- ``amsgrad``, ``maximize`` and ``differentiable`` are refused;
  ``foreach``, ``fused`` and ``capturable`` are accepted and change nothing
  (the step is always one launch per dtype buffer, with its step counts on
  the device);
- ``add_param_group`` after construction is refused: the buffers are fixed.
"""
from __future__ import annotations

import torch

from .arrays import adopt
from .checks import clip_arguments
from .optim import CLIP_EPS, STATE, FlatStep, _check_hyper, _row
from .residency import Resident

__all__ = ["AdamW", "GradScaler", "SGD"]

REFUSED = ("amsgrad", "maximize", "differentiable")


class _FlatOptimizer(torch.optim.Optimizer):
    """What AdamW and SGD share: the resident model, the flat step, the state views."""

    _rule = ""
    # torch.amp.GradScaler hands the scale and found_inf to step() instead of
    # unscaling the gradients itself: the update unscales, and skips on the device.
    _step_supports_amp_scaling = True

    def __init__(self, params, defaults, max_norm, norm_type):
        name = type(self).__name__
        for option in REFUSED:
            if defaults.get(option):
                raise ValueError(f"gpuflat.torch.{name}: {option}=True is not implemented; expected "
                                 f"{option}=False, or use torch.optim.{name}")
        if max_norm is not None:
            clip_arguments(max_norm, norm_type, CLIP_EPS)
        resident = params if isinstance(params, Resident) else None
        if resident is not None:
            if resident._binding is None:
                raise TypeError(f"gpuflat.torch.{name}: expected a Resident of PyTorch parameters, got one "
                                f"of NumPy or CuPy arrays (use gpuflat.optim.{name})")
            params = list(resident._binding.params)
        self._ready = False
        super().__init__(params, defaults)
        self._ready = True
        group_of = {id(p): i for i, g in enumerate(self.param_groups) for p in g["params"]}
        if resident is None:
            resident = Resident([p for g in self.param_groups for p in g["params"] if p.requires_grad])
        self.resident, self.max_norm, self.norm_type = resident, max_norm, norm_type
        self._params = list(resident._binding.params)
        self._leaf_group = [group_of[id(p)] for p in self._params]
        self._flat = FlatStep(resident, self._rule, self._leaf_group)
        self._views = [self._flat.state_views(k) for k in range(len(self._params))]
        self._stepped = False
        self.last_grad_norm = None

    def add_param_group(self, param_group):
        """As PyTorch's during construction; refused afterwards (the buffers are fixed).

        >>> opt = SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
        >>> opt.add_param_group({"params": [torch.nn.Parameter(torch.ones(1))]})
        Traceback (most recent call last):
        ...
        ValueError: gpuflat.torch.SGD: a parameter group cannot be added after construction (the resident buffers are fixed); make a new optimizer over every parameter instead
        """
        if self._ready:
            raise ValueError(f"gpuflat.torch.{type(self).__name__}: a parameter group cannot be added after "
                             f"construction (the resident buffers are fixed); make a new optimizer over every "
                             f"parameter instead")
        super().add_param_group(param_group)

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every resident parameter (one launch per dtype
        buffer, after one norm pass with ``max_norm``); returns the closure's loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._update()
        return loss

    # Inside a torch.compile'd step the update is not traced: it runs as it
    # is between two graphs (its native calls and host-side tables are
    # nothing TorchDynamo can trace faithfully).
    @torch.compiler.disable
    def _update(self):
        for i, group in enumerate(self.param_groups):
            _check_hyper(self._rule, group, i)
        self._flat.set_hyper([_row(self._rule, g) for g in self.param_groups])
        self.last_grad_norm = self._scaled_step()  # skipped steps, as fused AdamW's, leave a state of step 0
        if not self._stepped:  # every resident parameter has a state from now on
            self._expose_state(range(len(self._params)))
            self._stepped = True

    def _scaled_step(self):
        """The flat step, given what a GradScaler left on the optimizer: its
        scale (unscaled inside the update) and its found_inf (skip on the
        device), or, from gpuflat.torch.GradScaler, a found_inf to fill from
        the step's own norm pass. Returns the norm, unscaled."""
        scale, found = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        detect = found is not None and getattr(self, "_found_inf_from_norm", False)
        inv_scale = skip = None
        if scale is not None:  # GradScaler's unscale_: scale.double().reciprocal().float()
            inv_scale = adopt(scale.double().reciprocal().float().double().reshape(()))
        if found is not None and not detect:
            skip = adopt(found.double().reshape(()))
        total, flag = self._flat.step(self.max_norm, self.norm_type, inv_scale=inv_scale, skip=skip, detect=detect)
        if detect:
            found.copy_(flag.reshape(found.shape))
        return total

    def load_state_dict(self, state_dict) -> None:
        """PyTorch's, then the loaded state copied into the flat buffers (views
        of which become ``self.state``); the state of a parameter it lacks is zero."""
        super().load_state_dict(state_dict)
        loaded = []
        with torch.no_grad():
            for k, p in enumerate(self._params):
                if self._load(self._views[k], self.state.pop(p, {})):
                    loaded.append(k)
        self._expose_state(loaded)
        self._stepped = len(loaded) == len(self._params)

    def _load(self, views, saved) -> bool:
        """Copy one parameter's saved state in (zeros where it has none); whether it had one."""
        names = STATE[self._rule]
        present = all(saved.get(n) is not None for n in names)
        for n in names:
            if present:
                views[n].copy_(saved[n])
            else:
                views[n].zero_()
        # SGD keeps no count: a saved momentum buffer means the first step is past.
        views["step"].fill_(float(saved["step"]) if present and "step" in saved else float(present))
        return present

    def _expose_state(self, leaves) -> None:
        """self.state[p]: views of the state of the parameters ``leaves``, PyTorch's keys."""
        for k in leaves:
            public = self._public(self._views[k], k)
            if public:
                self.state[self._params[k]] = public

    def _public(self, views, k):
        return views


class AdamW(_FlatOptimizer):
    """``torch.optim.AdamW`` over flat buffers, with the clip inside the step.

    >>> import torch, gpuflat.torch as gft
    >>> net = torch.nn.Linear(3, 2)
    >>> opt = gft.AdamW(net.parameters(), lr=1e-2, max_norm=1.0)
    >>> net(torch.ones(4, 3)).sum().backward()
    >>> opt.step()
    >>> sorted(opt.state[net.weight]), float(opt.state[net.weight]["step"]), opt.last_grad_norm.dtype
    (['exp_avg', 'exp_avg_sq', 'step'], 1.0, torch.float64)
    """

    _rule = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 max_norm=None, norm_type=2.0):
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=capturable,
                        differentiable=differentiable, fused=fused, decoupled_weight_decay=True)
        super().__init__(params, defaults, max_norm, norm_type)


class SGD(_FlatOptimizer):
    """``torch.optim.SGD`` over flat buffers, with the clip inside the step.

    >>> import torch, gpuflat.torch as gft
    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> opt = gft.SGD([w], lr=0.5, momentum=0.9)
    >>> w.grad = torch.ones(2)
    >>> opt.step()
    >>> w.detach(), opt.state[w]["momentum_buffer"]
    (tensor([0.5000, 0.5000]), tensor([1., 1.]))
    """

    _rule = "sgd"

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, max_norm=None, norm_type=2.0):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable,
                        fused=fused)
        super().__init__(params, defaults, max_norm, norm_type)

    def _public(self, views, k):
        # PyTorch's SGD keeps a momentum buffer only where momentum is used, and no step.
        group = self.param_groups[self._leaf_group[k]]
        return {"momentum_buffer": views["momentum_buffer"]} if group["momentum"] != 0 else {}


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose ``step`` makes a flat optimizer's
    scaled step two passes over the gradients instead of three.

    For an optimizer that takes the scale itself, the stock ``step`` first
    reads every gradient for NaN and inf (``_check_inf_per_device``). Here a
    gpuflat optimizer takes that flag from its own norm pass instead and
    records it where ``update()`` reads it; everything else (other
    optimizers, a step after ``unscale_``) is the stock scaler's.

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
