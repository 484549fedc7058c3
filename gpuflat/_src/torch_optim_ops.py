"""The flat optimizers' update, and the same update as PyTorch operators for
``torch.compile``.

``gpuflat.torch.AdamW`` and ``SGD`` keep PyTorch's lazy state and lists in
Python. Inside a compiled ``step()`` TorchDynamo traces that Python
(``_init_group`` it runs as it is, while tracing) down to gpuflat's
operators: ``gpuflat::norm_and_nonfinite``, the norm pass (a norm over a
mesh or pipeline stages is a collective: it runs between two graphs,
outside any operator, where every rank reaches it in the same order), then
one update, ``gpuflat::update_``, for every rule, modelled on PyTorch's
``_fused_adamw_``: the rule's name, the lists it writes (parameters,
state, step counts) marked mutated, the gradients read, each parameter
group's hyperparameter row with each parameter's group and index in it, a
tensor ``lr`` beside the row, the norm and ``max_norm``, a GradScaler's
``grad_scale`` and ``found_inf``. The operators take plain tensors (a DTensor's local shard)
and find their rows at every call: the update's again while everything that
decides them holds (``gpuflat._src.param_rows.of_lists``: one native read
of the tensors' facts, the new gradients' addresses patched in), so new
gradient tensors in a later step neither recompile, re-trace nor rebuild
anything. Inductor hands the update the tensors themselves; ``aot_eager``,
which does not reinplace mutated arguments, hands it copies of the mutated
lists and copies them back.

Eager steps call :func:`update` directly: a Python operator's dispatch costs
milliseconds on lists of 10,000 tensors. Every gpuflat operator, these and
``gpuflat._src.torch_ops``', is registered by :func:`operator` below, with
less Python per call than ``torch.library.custom_op``.

>>> w, g = torch.ones(2), torch.full((2,), 4.0)
>>> torch.ops.gpuflat.update_("sgd", [w], [g], [], [], groups=[0], indices=[0], hyper=[0.5] + [0.0] * 6,
...                           lr_tensor=[None])
>>> w
tensor([-1., -1.])
>>> [float(x) for x in torch.ops.gpuflat.norm_and_nonfinite([torch.tensor([3.0, 4.0])], 2.0, True)]
[5.0, 0.0]
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Optional, cast

import numpy as np
import torch
from torch._ops import OpOverload

from . import caches, param_rows, tensor_table
from .arrays import adopt, device_scope, launch_stream
from .layout import CLIP_EPS, HYPER, KEEPS, RULES, TAG_OF_NAME

__all__ = ["CLIP_EPS", "fake", "name_of", "norm_and_nonfinite", "operator", "unscale_factor", "update", "update_"]


def update(rule: str, table: tensor_table.Table, groups: Sequence[dict[str, Any]],
           total: torch.Tensor | None, max_norm: float | torch.Tensor | None, scale: torch.Tensor | None,
           found: torch.Tensor | None, read: Any = (), hyper: np.ndarray | None = None,
           stats: Sequence[torch.Tensor] | None = None) -> None:
    """One update by the rule named ``rule`` (``layout.RULES``) of the parameters of
    ``table``'s update rows (``gpuflat._src.param_rows``), each group's hyperparameters and
    flags read from ``groups`` (dicts as ``param_groups`` holds them), the
    gradients clipped by their norm ``total`` to ``max_norm`` (None: no
    clip), unscaled by a GradScaler's ``scale`` and skipped on the device
    where its ``found`` is not 0; one launch per device and dtype. Under a CUDA-graph
    capture, everything the launches read by address (``read``: the
    tensors of the rows, or a function giving them; the (unscale, skip) flags, the norm, a tensor
    ``lr``) is kept as long as the process: the graph may be replayed at any
    time, whatever ``gpuflat.cache_clear()`` drops. ``hyper``: the groups'
    rows (``Rule.hyper_rows``), where the caller holds them already.
    ``stats``: per update rows, a float64 [rows, 2] tensor on its device that the
    update fills with each row's sums of squares of its update and of its
    new value (``gpuflat._src.step_stats``).

    >>> w, g = torch.ones(2), torch.full((2,), 4.0)
    >>> sgd = param_rows.RULES["sgd"]
    >>> table = param_rows.table_of(sgd, [w], [g], [[None]] * 4, [0], [param_rows.needed(sgd, {"momentum": 0})], str)
    >>> update("sgd", table, [dict(lr=0.5, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)],
    ...        torch.tensor(8.0, dtype=torch.float64), 2.0, None, None)
    >>> w  # 1 - 0.5 * 4 * 2 / 8
    tensor([0.5000, 0.5000])
    """
    if hyper is None:
        hyper = RULES[rule].hyper_rows(groups)
    for k, rows in enumerate(table.updates):
        like, backend = rows.like, rows.backend
        row_hyper, lr_at = _learning_rates(groups, like.device, hyper)
        # PyTorch's own work (it runs on PyTorch's current stream), before the launch's scope.
        amp = _amp_tensor(scale, found, like.device)
        # ``total`` is given wherever ``max_norm`` is.
        norm = None if max_norm is None else cast(torch.Tensor, total).to(like.device).reshape(())
        with device_scope(backend, like):
            if backend.name == "cuda" and launch_stream(like).is_capturing():
                _READ_BY_GRAPHS.append((amp, norm, [g["lr"] for g in groups], read() if callable(read) else read))
            sums = {} if stats is None else {"stats": adopt(stats[k])}
            backend.step_rows(rule, TAG_OF_NAME[str(like.dtype).removeprefix("torch.")], rows.rows, row_hyper,
                              lr_at, None if norm is None else adopt(norm),
                              0.0 if max_norm is None else float(max_norm), CLIP_EPS, adopt(amp), **sums)


# What captured CUDA graphs' launches read by address, kept for good (as the
# CUDA runtime keeps the tables a captured launch reads): a replay may come
# at any time, after gpuflat.cache_clear() and after the optimizer's state
# was edited, and must find them where they were.
_READ_BY_GRAPHS: list[Any] = []


def unscale_factor(scale: torch.Tensor) -> torch.Tensor:
    """What GradScaler's ``unscale_`` multiplies by, as float64: ``scale.double().reciprocal().float()``.

    >>> unscale_factor(torch.tensor(3.0))
    tensor(0.3333, dtype=torch.float64)
    """
    return scale.double().reciprocal().float().double()


def _learning_rates(groups: Sequence[dict[str, Any]], device: torch.device,
                    hyper: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


# Per device, the flags of a step without a loss scaler: made once, as they never change.
_PLAIN_AMP: dict[torch.device, torch.Tensor] = {}
caches.register("plain amp flags", _PLAIN_AMP.__len__, _PLAIN_AMP.clear)


def _amp_tensor(scale: torch.Tensor | None, found: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """(the unscale factor, the skip flag) as a float64 tensor on ``device``."""
    if scale is None and found is None:
        amp = _PLAIN_AMP.get(device)
        if amp is None:
            amp = _PLAIN_AMP[device] = torch.tensor([1.0, 0.0], dtype=torch.float64, device=device)
        return amp
    one, zero = (torch.full((), v, dtype=torch.float64, device=device) for v in (1.0, 0.0))
    inv = one if scale is None else unscale_factor(scale).reshape(()).to(device)
    flag = zero if found is None else found.double().reshape(()).to(device)
    return torch.stack((inv, flag))


def name_of(groups: Sequence[int], indices: Sequence[int]) -> Callable[[int], str]:
    """A function naming the j-th parameter of a step as ``param_groups`` place it.

    >>> name_of([1], [4])(0)
    "param_groups[1]['params'][4]"
    """
    return lambda j: f"param_groups[{groups[j]}]['params'][{indices[j]}]"


# ---------------------------------------------------------------- how gpuflat's operators are registered

# The library of every gpuflat operator (these and gpuflat._src.torch_ops'),
# each defined by operator() below.
_LIBRARY = torch.library.Library("gpuflat", "DEF")


def operator(name: str, mutates: tuple[str, ...] = ()) -> Callable[[Callable[..., Any]], OpOverload]:
    """Define the operator ``gpuflat::<name>`` with the decorated function as
    its kernel, its schema read from the function's annotations (``mutates``:
    the arguments it writes in place); gives the operator
    (``torch.ops.gpuflat.<name>.default``) with the function's docstring.
    Its fake implementation is registered with :func:`fake`.

    What ``torch.library.custom_op`` registers, with less Python at each
    call: a compiled graph calls the operator at every step. The kernel bumps
    the version of every tensor it writes, in one call per list (custom_op's
    ADInplaceOrView kernel does it in Python, one call per tensor, then
    redispatches; here that key falls through). An operator that returns
    tensors keeps custom_op's autograd: where an input requires grad under
    grad mode, so do its outputs, and a backward through them raises. One
    that returns nothing skips the autograd key (custom_op's kernel there
    only redispatched). Nothing checks at each call that no output aliases
    an input, as custom_op's backend kernel did: the kernels return new
    tensors.

    >>> str(torch.ops.gpuflat.scale_by_norm_.default._schema)  # made by operator("scale_by_norm_", mutates=...)
    'gpuflat::scale_by_norm_(Tensor(a0!)[] tensors, float max_norm, Tensor total, float eps) -> ()'
    """
    def define(fn: Callable[..., Any]) -> OpOverload:
        _LIBRARY.define(name + torch.library.infer_schema(fn, mutates_args=mutates),
                        tags=(torch.Tag.pt2_compliant_tag,))
        op: OpOverload = getattr(torch.ops.gpuflat, name).default
        arguments = op._schema.arguments
        written = [i for i, a in enumerate(arguments) if a.name in mutates]
        # The dispatcher hands the kernel its arguments by position and leaves
        # out trailing defaults: a written argument must have none.
        assert all(not arguments[i].has_default_value() for i in written), name

        def kernel(*args: Any, **kwargs: Any) -> Any:
            for i in written:
                torch.autograd.graph.increment_version(args[i])
            return fn(*args, **kwargs)

        # TorchDynamo never traces the kernel, as custom_op's: under a
        # compiled call it runs as it is.
        _LIBRARY.impl(name, torch.compiler.disable(kernel if written else fn), "CompositeExplicitAutograd")
        if op._schema.returns:
            _LIBRARY.impl(name, _autograd_kernel(op), "Autograd", with_keyset=True)
        else:
            _LIBRARY.impl(name, torch.library.fallthrough_kernel, "Autograd")
        op.__doc__ = fn.__doc__
        return op

    return define


def fake(op: OpOverload) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as ``op``'s fake implementation: its
    result's metadata from its arguments', without running it (tracing).

    >>> from torch._subclasses.fake_tensor import FakeTensorMode
    >>> with FakeTensorMode():  # total_norm's fake: a 0-d float64 tensor, nothing run
    ...     torch.ops.gpuflat.total_norm([torch.ones(2)], 2.0).dtype
    torch.float64
    """
    return cast(Callable[[Callable[..., Any]], Callable[..., Any]], torch.library.register_fake(op, lib=_LIBRARY))


def _autograd_kernel(op: OpOverload) -> Callable[..., Any]:
    """``op``'s Autograd kernel: below autograd at once, unless an input
    requires grad under grad mode (then through :class:`_NoFormula`)."""
    below = torch._C._after_autograd_keyset

    def kernel(keyset: torch._C.DispatchKeySet, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args, **kwargs):
            tensors = [t for a in (*args, *kwargs.values()) for t in (a if isinstance(a, (list, tuple)) else (a,))
                       if isinstance(t, torch.Tensor)]
            return _NoFormula.apply(op, keyset & below, args, kwargs, *tensors)
        return op.redispatch(keyset & below, *args, **kwargs)

    return kernel


class _NoFormula(torch.autograd.Function):
    """An operator's call below autograd whose outputs require grad where one
    of its ``tensors`` does, with a backward that raises: gpuflat's operators
    have no derivative."""

    @staticmethod
    def forward(ctx: Any, op: OpOverload, keyset: torch._C.DispatchKeySet, args: tuple[Any, ...],
                kwargs: dict[str, Any], *tensors: torch.Tensor) -> Any:
        ctx.op = op
        return op.redispatch(keyset, *args, **kwargs)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(f"Trying to backward through {ctx.op} but no autograd formula was registered.")


# ---------------------------------------------------------------- the operators

@operator("norm_and_nonfinite")
def norm_and_nonfinite(grads: list[torch.Tensor], norm_type: float,
                       detect: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(the float64 norm of ``grads`` as one vector, a float64 0-d tensor that
    is 1 where ``detect`` and some element is NaN or inf, else 0), from one
    pass: gpuflat's GradScaler takes the flag from the gradients themselves,
    not from the norm, which can overflow alone."""
    table = tensor_table.read(grads, "grads[{}]".format)
    assert table is not None, "the operators take plain tensors: read gives None only for DTensors"
    total, nonfinite = tensor_table.norm_pass(table, norm_type, detect)
    # norm_pass gives the flag exactly when asked to detect.
    return total.clone(), nonfinite if nonfinite is not None else torch.zeros_like(total)


@fake(norm_and_nonfinite)
def _(grads: list[torch.Tensor], norm_type: float, detect: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return grads[0].new_empty((), dtype=torch.float64), grads[0].new_empty((), dtype=torch.float64)


@operator("update_", mutates=("params", "states", "state_steps"))
def update_(rule: str, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[torch.Tensor],
            state_steps: list[torch.Tensor], groups: list[int], indices: list[int], hyper: list[float],
            lr_tensor: list[Optional[torch.Tensor]], total: Optional[torch.Tensor] = None,
            max_norm: Optional[float] = None, grad_scale: Optional[torch.Tensor] = None,
            found_inf: Optional[torch.Tensor] = None, keeps: Optional[list[int]] = None,
            seeds: Optional[list[int]] = None) -> None:
    """One update of ``params`` by the rule named ``rule``
    (``gpuflat._src.layout.RULES``), parameter j in group ``groups[j]`` at
    ``indices[j]`` of it. ``hyper`` holds each group's hyperparameter row
    (HYPER floats; its lr is read from ``lr_tensor[group]`` where that is a
    tensor). ``states`` holds, state after state in the rows' order
    (``param_rows.state_names``), the tensors of the parameters whose group
    needs that state (``param_rows.needs_of``), and ``state_steps`` their
    step counts likewise; the counts move unless the step is skipped.
    ``keeps``: per group, how it keeps its 16-bit parameters (a number of
    ``gpuflat._src.layout.KEEPS``; None: plain), and ``seeds`` its
    ``rounding_seed`` (None: 0)."""
    rule_of = RULES[rule]
    rows = np.asarray(hyper, np.float64).reshape(-1, HYPER)
    named = [{**dict(zip(rule_of.hyper, row.tolist())), "lr": float(row[0]) if t is None else t,
              **_keep_options(KEEPS[keeps[g]] if keeps else "plain"), "rounding_seed": seeds[g] if seeds else 0}
             for g, (row, t) in enumerate(zip(rows, lr_tensor))]
    table = param_rows.of_lists(rule_of, params, grads, states, state_steps, groups, indices, named,
                                name_of(groups, indices))
    update(rule, table, named, total, max_norm, grad_scale, found_inf, lambda: [*params, *grads, *states, *state_steps])


@fake(update_)
def _(rule: str, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[torch.Tensor],
      state_steps: list[torch.Tensor], *_: Any) -> None:
    return None


def _keep_options(keep: str) -> dict[str, bool]:
    """A group's options that keep its 16-bit parameters as ``keep`` (``param_rows.keep_of`` read back).

    >>> param_rows.keep_of(_keep_options("kahan"))
    'kahan'
    """
    return {option: keep == kept for kept, option in param_rows.KEEP_OPTIONS.items()}
