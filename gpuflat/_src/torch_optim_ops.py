"""The flat optimizers' update, and the same update as PyTorch operators for
``torch.compile``.

``gpuflat.torch.AdamW`` and ``SGD`` keep PyTorch's lazy state and lists in
Python. Inside a compiled ``step()`` TorchDynamo traces that Python
(``_init_group`` it runs as it is, while tracing) down to gpuflat's
operators: ``gpuflat::norm_and_nonfinite``, the norm pass (a norm over a
mesh or pipeline stages is a collective: it runs between two graphs,
outside any operator, where every rank reaches it in the same order), then
one update, ``gpuflat::adamw_`` or ``gpuflat::sgd_``, modelled on PyTorch's
``_fused_adamw_`` and ``_fused_sgd_``: the lists it writes (parameters,
state, step counts, SGD's flags of new momentum buffers) marked mutated,
the gradients read, each parameter group's hyperparameters as lists with
each parameter's group and index in it, a tensor ``lr`` beside the float
one, the norm and ``max_norm``, a GradScaler's ``grad_scale`` and
``found_inf``. The operators take plain tensors (a DTensor's local shard)
and read their rows at every call (``gpuflat._src.param_rows.tables_of``), so
new gradient tensors in a later step neither recompile nor re-trace
anything. Inductor hands the update the tensors themselves; ``aot_eager``,
which does not reinplace mutated arguments, hands it copies of the mutated
lists and copies them back.

Eager steps call :func:`update` directly: a Python operator's dispatch costs
milliseconds on lists of 10,000 tensors.

>>> w, g = torch.ones(2), torch.full((2,), 4.0)
>>> torch.ops.gpuflat.sgd_([w], [g], [], [torch.zeros(1, dtype=torch.bool)], groups=[0], indices=[0],
...                        lr=[0.5], lr_tensor=[None], momentum=[0.0], dampening=[0.0], weight_decay=[0.0],
...                        nesterov=[False])
>>> w
tensor([-1., -1.])
>>> [float(x) for x in torch.ops.gpuflat.norm_and_nonfinite([torch.tensor([3.0, 4.0])], 2.0, True)]
[5.0, 0.0]
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import caches, param_rows, tensor_table
from .arrays import adopt, device_scope, launch_stream
from ..errors import CaptureError
from .layout import HYPER, PARAM_ROW_FIRST, TAG_OF_NAME, hyper_row

__all__ = ["CLIP_EPS", "NewBuffers", "adamw_", "name_of", "norm_and_nonfinite", "sgd_", "skipped_on_the_device",
           "unscale_factor", "update"]

CLIP_EPS = 1e-6  # PyTorch's clip_grad_norm_: max_norm / (norm + 1e-6)


def update(rule, tables, groups, total, max_norm, scale, found) -> None:
    """One ``rule`` update ("adamw" or "sgd") of the parameters of
    ``tables`` (``gpuflat._src.param_rows``), each group's hyperparameters read
    from ``groups`` (dicts as ``param_groups`` holds them), the gradients
    clipped by their norm ``total`` to ``max_norm`` (None: no clip),
    unscaled by a GradScaler's ``scale`` and skipped on the device where
    its ``found`` is not 0; one launch per table.

    >>> w, g = torch.ones(2), torch.full((2,), 4.0)
    >>> tables = param_rows.tables_of([w], [g], [[None]], None, [0], None, str)
    >>> update("sgd", tables, [dict(lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)],
    ...        torch.tensor(8.0, dtype=torch.float64), 2.0, None, None)
    >>> w  # 1 - 0.5 * 4 * 2 / 8
    tensor([0.5000, 0.5000])
    """
    hyper = np.array([hyper_row(rule, g) for g in groups], np.float64).reshape(-1)
    for table in tables:
        like = table.like
        backend = tensor_table.backend_for(like.device)
        row_hyper, lr_at = _learning_rates(groups, like.device, hyper)
        with device_scope(backend, like):
            amp = _amp_array(scale, found, like.device)
            clip = None if max_norm is None else adopt(total.to(like.device).reshape(()))
            backend.step_rows(rule, TAG_OF_NAME[str(like.dtype).removeprefix("torch.")], table.rows, row_hyper,
                              lr_at, clip, 0.0 if max_norm is None else float(max_norm), CLIP_EPS, amp)


def unscale_factor(scale):
    """What GradScaler's ``unscale_`` multiplies by, as float64: ``scale.double().reciprocal().float()``.

    >>> unscale_factor(torch.tensor(3.0))
    tensor(0.3333, dtype=torch.float64)
    """
    return scale.double().reciprocal().float().double()


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


_PLAIN_AMP = caches.LRU("plain amp flags", 8)  # by device


def _amp_array(scale, found, device):
    """(the unscale factor, the skip flag) as a float64 array of the backend's kind on ``device``."""
    if scale is None and found is None:
        amp = _PLAIN_AMP.get(device, lambda: torch.tensor([1.0, 0.0], dtype=torch.float64, device=device))
    else:
        one, zero = (torch.full((), v, dtype=torch.float64, device=device) for v in (1.0, 0.0))
        inv = one if scale is None else unscale_factor(scale).reshape(()).to(device)
        flag = zero if found is None else found.double().reshape(()).to(device)
        amp = torch.stack((inv, flag))
    return adopt(amp)


# ---------------------------------------------------------------- SGD's new momentum buffers

class NewBuffers:
    """Which parameters' momentum buffers are new: made at the parameter's
    first gradient, and in no step known to have been applied since. Their
    next update makes the buffer the gradient itself, as the first step of
    ``torch.optim.SGD`` does (dampening does not apply); a step a GradScaler
    skips on the device leaves them new, as ``torch.optim.SGD``, whose step
    never ran, has no buffer yet. Known where it matters, with dampening
    (:func:`skipped_on_the_device`); without, a buffer left zero by a skip
    takes the gradient itself at its next update anyway.

    One flag per parameter of ``param_groups``, in a CPU bool tensor per
    group: a compiled step's operator reads and clears them at every call,
    where a Python set would be a constant of the graph.

    >>> w = torch.nn.Parameter(torch.ones(2))
    >>> new = NewBuffers(); new.follow([{"params": [w]}]); new.mark(w)
    >>> new.is_new(w), new.flags
    (True, [tensor([True])])
    """

    def __init__(self):
        self.flags: list = []
        self._views: list = []  # the flags' NumPy views: read and written with no dispatch
        self._where: dict = {}  # parameter -> (group, index)
        self._key = None

    def follow(self, groups) -> None:
        """Place the flags by ``groups`` (``param_groups``) where they changed, each parameter's flag kept."""
        key = tuple((id(g["params"]), len(g["params"])) for g in groups)
        if key == self._key:
            return
        was = {p: self.is_new(p) for p in self._where}
        self.flags = [torch.tensor([was.get(p, False) for p in g["params"]], dtype=torch.bool) for g in groups]
        self._views = [f.numpy() for f in self.flags]
        self._where = {p: (g, i) for g, group in enumerate(groups) for i, p in enumerate(group["params"])}
        self._key = key

    def mark(self, p) -> None:
        """Flag ``p``'s momentum buffer new (it was made now)."""
        g, i = self._where[p]
        self._views[g][i] = True

    def is_new(self, p) -> bool:
        """Whether ``p``'s momentum buffer is new."""
        g, i = self._where[p]
        return bool(self._views[g][i])

    def stepped(self, groups) -> list:
        """(group, index) of each new buffer's parameter that has a gradient now."""
        return [(g, i) for g, v in enumerate(self._views) for i in np.flatnonzero(v).tolist()
                if groups[g]["params"][i].grad is not None]

    def clear(self, where) -> None:
        """The buffers at ``where`` (group, index) are new no more: a step updated them."""
        for g, i in where:
            self._views[g][i] = False


def skipped_on_the_device(found, damped, like) -> bool:
    """Whether a GradScaler's ``found`` skips this step, read on the host
    where that decides whether new momentum buffers with dampening stay new
    (``damped``: their parameters' names); False with none of them or no
    ``found``. Under CUDA-graph capture, where that read is impossible,
    CaptureError names the first of them.

    >>> skipped_on_the_device(torch.tensor([1.0]), ["w"], torch.ones(1)), skipped_on_the_device(None, ["w"], None)
    (True, False)
    """
    if found is None or not damped:
        return False
    if tensor_table.backend_for(like.device).name == "cuda" and launch_stream(like).is_capturing():
        raise CaptureError(f"{damped[0]}: its momentum buffer is new and its group's dampening is not 0, so "
                           f"whether a GradScaler skips this step must be read on the host, which a CUDA-graph "
                           f"capture cannot do; take a step that is not skipped before capturing, or use "
                           f"dampening=0")
    # One host read, for this configuration only (momentum, dampening, a
    # device-decided skip) and only on a step with new buffers (the first,
    # and any a GradScaler skips after it): torch.optim.SGD never ran the
    # skipped step, so its first applied step takes the gradient itself as
    # the buffer, undamped.
    return float(found) != 0.0


def name_of(groups, indices):
    """A function naming the j-th parameter of a step as ``param_groups`` place it.

    >>> name_of([1], [4])(0)
    "param_groups[1]['params'][4]"
    """
    return lambda j: f"param_groups[{groups[j]}]['params'][{indices[j]}]"


# ---------------------------------------------------------------- the operators

@torch.library.custom_op("gpuflat::norm_and_nonfinite", mutates_args=())
def norm_and_nonfinite(grads: list[torch.Tensor], norm_type: float,
                       detect: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 norm of ``grads`` as one vector, a float64 0-d tensor that
    is 1 where ``detect`` and some element is NaN or inf, else 0), from one
    pass: gpuflat's GradScaler takes the flag from the gradients themselves,
    not from the norm, which can overflow alone."""
    table = tensor_table.read(grads, "grads[{}]".format)
    total, nonfinite = tensor_table.norm_pass(table, norm_type, detect)
    return total.clone(), nonfinite if detect else torch.zeros_like(total)


@norm_and_nonfinite.register_fake
def _(grads, norm_type, detect):
    return tuple(grads[0].new_empty((), dtype=torch.float64) for _ in range(2))


@torch.library.custom_op("gpuflat::adamw_", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "state_steps"))
def adamw_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], state_steps: list[torch.Tensor], groups: list[int],
           indices: list[int], lr: list[float], lr_tensor: list[Optional[torch.Tensor]], beta1: list[float],
           beta2: list[float], weight_decay: list[float], eps: list[float], total: Optional[torch.Tensor] = None,
           max_norm: Optional[float] = None, grad_scale: Optional[torch.Tensor] = None,
           found_inf: Optional[torch.Tensor] = None) -> None:
    """One AdamW update of ``params`` (plain tensors, a DTensor's local
    shard), parameter j in group ``groups[j]`` at ``indices[j]`` of it;
    ``state_steps`` counted up unless skipped."""
    hyper = [dict(lr=t if t is not None else r, betas=(b1, b2), weight_decay=w, eps=e)
             for r, t, b1, b2, w, e in zip(lr, lr_tensor, beta1, beta2, weight_decay, eps)]
    tables = param_rows.tables_of(params, grads, [exp_avgs, exp_avg_sqs], state_steps, groups, None,
                                  name_of(groups, indices))
    update("adamw", tables, hyper, total, max_norm, grad_scale, found_inf)


@adamw_.register_fake
def _(params, grads, exp_avgs, exp_avg_sqs, state_steps, *_):
    return None


@torch.library.custom_op("gpuflat::sgd_", mutates_args=("params", "momentum_buffers", "new_buffers"))
def sgd_(params: list[torch.Tensor], grads: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
         new_buffers: list[torch.Tensor], groups: list[int], indices: list[int], lr: list[float],
         lr_tensor: list[Optional[torch.Tensor]], momentum: list[float], dampening: list[float],
         weight_decay: list[float], nesterov: list[bool], total: Optional[torch.Tensor] = None,
         max_norm: Optional[float] = None, grad_scale: Optional[torch.Tensor] = None,
         found_inf: Optional[torch.Tensor] = None) -> None:
    """One SGD update of ``params``, parameter j in group ``groups[j]`` at
    ``indices[j]`` of it; ``momentum_buffers`` in order for the parameters
    of groups with momentum; ``new_buffers``: per group, NewBuffers' flags,
    read for the rows and cleared once the step is known to apply."""
    hyper = [dict(lr=t if t is not None else r, momentum=m, dampening=d, weight_decay=w, nesterov=n)
             for r, t, m, d, w, n in zip(lr, lr_tensor, momentum, dampening, weight_decay, nesterov)]
    keeps = [momentum[g] != 0.0 for g in groups]
    buffers = iter(momentum_buffers)
    column = [next(buffers) if k else None for k in keeps]
    views = [f.numpy() for f in new_buffers]
    new = [j for j, k in enumerate(keeps) if k and views[groups[j]][indices[j]]]
    flags = np.zeros(len(params), np.int64)
    flags[new] = PARAM_ROW_FIRST
    named = name_of(groups, indices)
    tables = param_rows.tables_of(params, grads, [column], None, groups, flags, named)
    damped = [named(j) for j in new if dampening[groups[j]] != 0.0]
    skipped = skipped_on_the_device(found_inf, damped, tables[0].like)
    update("sgd", tables, hyper, total, max_norm, grad_scale, found_inf)
    if not skipped:
        for j in new:
            views[groups[j]][indices[j]] = False


@sgd_.register_fake
def _(params, grads, momentum_buffers, new_buffers, *_):
    return None
