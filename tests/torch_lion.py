"""A plain PyTorch Lion, the reference the tests hold gpuflat.torch.Lion to.

PyTorch has no Lion: this is lion-pytorch's algorithm
(https://github.com/lucidrains/lion-pytorch), parameter by parameter, with
the state gpuflat keeps (``exp_avg``, and a 0-d float32 ``step`` counted as
torch.optim.AdamW counts it) so that state dicts load both ways, plus
``maximize`` and a tensor ``lr`` as torch.optim's optimizers take them.
"""
from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) as lion-pytorch computes it, per parameter:
    decay, then the sign of the interpolated moment, then the moment.

    >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.5]))
    >>> opt = Lion([w], lr=0.1, weight_decay=0.5)
    >>> w.grad = torch.tensor([2.0, -3.0, 0.0])
    >>> opt.step()
    >>> w.detach(), opt.state[w]["exp_avg"], opt.state[w]["step"]
    (tensor([ 0.8500, -0.8500,  0.4750]), tensor([ 0.0200, -0.0300,  0.0000]), tensor(1.))
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False):
        if not 0.0 <= float(lr):
            raise ValueError(f"Invalid learning rate: {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"Invalid betas: {betas}")
        # foreach and differentiable are taken, as torch.optim's optimizers
        # take them, and change nothing: the loop below is the one algorithm.
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, maximize=maximize,
                        foreach=foreach, differentiable=differentiable)
        super().__init__(params, defaults)

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("maximize", False)
            group.setdefault("foreach", None)
            group.setdefault("differentiable", False)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, wd = group["lr"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                state["step"] += 1
                p.mul_(1 - lr * wd)
                update = exp_avg.clone().mul_(beta1).add(grad, alpha=1 - beta1).sign_()
                # add_'s alpha takes a number only; update is -1, 0 or 1 (or
                # NaN), so update * lr is exact and the same as alpha=-lr.
                if torch.is_tensor(lr):
                    p.sub_(update * lr)
                else:
                    p.add_(update, alpha=-lr)
                exp_avg.mul_(beta2).add_(grad, alpha=1 - beta2)
        return loss
