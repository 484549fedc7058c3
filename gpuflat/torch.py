"""Drop-in replacements for ``torch.nn.utils``' gradient-norm clipping.

Swap one import and keep the call::

    from gpuflat.torch import clip_grad_norm_   # was: from torch.nn.utils import clip_grad_norm_

The signatures, the returned 0-d tensor (on the gradients' device, in the
dtype PyTorch returns) and the errors are PyTorch's. What differs is inside:
the gradients are read zero-copy and the norm is accumulated in float64 in
one fused pass, and the clip factor ``min(1, max_norm / (norm + 1e-6))`` is
taken from that float64 norm, so it is closer to exact than PyTorch's, which
reduces in the gradients' dtype. CUDA gradients are worked on in PyTorch's
current stream, with no host synchronisation unless ``error_if_nonfinite``.

DTensor gradients (FSDP2, tensor parallel) are read in their local shards,
counted where their placements say and reduced with one collective per
mesh dimension that shards some of them (``gpuflat.distributed``); the
norm comes back as PyTorch returns it for them, a DTensor replicated over
their mesh, and the clip scales the local shards with no redistribution.
Experts and dense layers on different meshes of one root mesh (expert
parallelism) are reduced in one collective over the ranks their meshes
join, and ``pp_mesh=`` combines pipeline stages (``tied=`` counts a weight
two stages hold once); the norm is then a plain tensor, the same on every
rank.

Differences that remain, on purpose:

- a tensor passed twice counts once (PyTorch counts and scales it twice);
- ``error_if_nonfinite`` reads the float64 norm, so a float16 norm that only
  overflows the returned dtype (above 65504) does not raise, and the clip
  factor stays finite where PyTorch's would scale by 0;
- ``norm_type`` must be a number p > 0 or inf, and ``max_norm`` a number
  >= 0 (ValueError otherwise); ``foreach`` is accepted and ignored (gpuflat
  always uses its fused pass);
- the clips refuse, before writing anything, gradients that share memory
  with each other (OverlapError) or within themselves (an expanded tensor,
  ValueError), which PyTorch would scale twice; integer and bool tensors
  raise NonFloatingTensorError, a RuntimeError, as PyTorch's norms do;
- inside a ``torch.compile``'d function (``fullgraph=True`` too) the
  drop-ins are gpuflat's operators in the graph (``gpuflat._src.torch_ops``),
  with the eager call's bits; there ``max_norm`` must be a number, and
  DTensor gradients are not supported.
"""
from __future__ import annotations

import contextlib
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, cast

import torch

from ._src import clipping as _clipping
from ._src import dtensor as _dtensor
from ._src import public as _public
from ._src import ranks as _ranks
from ._src import tensor_facts as _tensor_facts
from ._src import tensor_table as _tensor_table
from ._src import torch_ops as _torch_ops
from ._src.checks import clip_arguments as _clip_arguments
from ._src.checks import torch_norm_type as _torch_norm_type
from ._src.layout import CLIP_EPS as _EPS  # PyTorch's: coef = max_norm / (total_norm + 1e-6)
from .errors import NonFiniteError as _NonFiniteError
from .errors import NonFiniteNormError, NonFloatingTensorError

__all__ = [
    "NonFiniteNormError",
    "NonFloatingTensorError",
    "clip_grad_norm_",
    "clip_grads_with_norm_",
    "get_total_norm",
]
__all__ += ["SGD", "AdamW", "GradScaler"]  # gpuflat._src.torch_optim: the flat optimizers
__all__ += ["Lion", "read_stats"]

__dir__ = _public.listing(__all__)
# Names this module showed in 0.7.0 beside __all__ (what it imported), deprecated.
if not TYPE_CHECKING:  # see gpuflat._src.public
    __getattr__ = _public.deprecations(__name__, {
        "NonFiniteError": "gpuflat.errors.NonFiniteError",
        "check_ord": "gpuflat._src.checks.check_ord",
        "clip_arguments": "gpuflat._src.checks.clip_arguments",
        "clipping": "gpuflat._src.clipping",
        "dtensor": "gpuflat._src.dtensor",
        "tensor_facts": "gpuflat._src.tensor_facts",
        "tensor_table": "gpuflat._src.tensor_table",
        "torch_ops": "gpuflat._src.torch_ops",
    })


@torch.no_grad()
def get_total_norm(tensors: torch.Tensor | Iterable[torch.Tensor], norm_type: float | str = 2.0,
                   error_if_nonfinite: bool = False, foreach: bool | None = None, *, pp_mesh: Any = None,
                   tied: Iterable | None = None) -> torch.Tensor:
    """The norm of all ``tensors`` taken as one vector, as ``torch.nn.utils.get_total_norm``.

    ``pp_mesh`` (a 1-D DeviceMesh or a process group over the pipeline
    stages) combines every stage's norm into the model's, the same on every
    rank, as a plain tensor; ``tied``, pairs ``(tensor, owning stage)``,
    counts a weight held by several stages on its owner only (see
    ``gpuflat.distributed.global_norm``). A stage without gradients passes
    none: its ranks still join the other stages' collective, and return the
    norm in float64, having no dtype of their own to round it to.

    >>> import torch
    >>> get_total_norm([torch.tensor([3.0]), torch.tensor([[4.0]])])
    tensor(5.)
    >>> get_total_norm([])
    tensor(0.)
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    p = _torch_norm_type(norm_type)
    if not tensors and pp_mesh is None and tied is None:  # a stage without any joins the others' collective
        return torch.tensor(0.0)
    if torch.compiler.is_compiling():  # gpuflat's operator, opaque in the graph
        if pp_mesh is not None or tied is not None or _any_dtensor(tensors):
            return _total_norm_between_graphs(tensors, norm_type, error_if_nonfinite, pp_mesh=pp_mesh, tied=tied)
        traced = _Traced(tensors, ["tensors[{}]".format(i) for i in range(len(tensors))])
        total = _clipping.total_norm(traced, p, error_if_nonfinite, kind=NonFiniteNormError).total
        return total.to(_tensor_table.returned_dtype([t.dtype for t in tensors]))
    name_of = "tensors[{}]".format
    table = _tensor_table.read(tensors, name_of) if pp_mesh is None and tied is None else None
    if table is None:  # DTensors or pipeline stages: over the ranks
        tensors, names = _unique((t, name_of(i)) for i, t in enumerate(tensors))
        _tensor_table.check_floating(tensors, names.__getitem__)
        with _torch_nonfinite_error():
            total = _ranks.global_norm(tensors, p, pp_mesh=pp_mesh, tied=tied,
                                      error_if_nonfinite=error_if_nonfinite)
        return _returned(total, tensors)
    total = _clipping.total_norm(table.bound, p, error_if_nonfinite, kind=NonFiniteNormError, name_of=name_of).total
    return total.to(table.returned_dtype)


@torch.no_grad()
def clip_grads_with_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                          total_norm: torch.Tensor, foreach: bool | None = None) -> None:
    """Scale the parameters' gradients in place by min(1, max_norm / (total_norm + 1e-6)).

    As ``torch.nn.utils.clip_grads_with_norm_``: ``total_norm`` may come from
    anywhere (e.g. reduced over a pipeline), and the factor is applied without
    reading it on the host.

    >>> import torch
    >>> w = torch.nn.Parameter(torch.zeros(2)); w.grad = torch.tensor([3.0, 4.0])
    >>> clip_grads_with_norm_([w], 1.0, torch.tensor(5.0))
    >>> w.grad
    tensor([0.6000, 0.8000])
    """
    if torch.compiler.is_compiling():  # gpuflat's operator, opaque in the graph
        parameters = _parameter_list(parameters, warn_empty=False)
        grads = [p.grad for p in parameters if p.grad is not None]
        if _any_dtensor(grads) or _dtensor.is_dtensor(total_norm):
            return _scale_between_graphs(parameters, max_norm, total_norm)
        if grads:
            _compiled_scale(grads, max_norm, total_norm)
        return
    grads, facts, name_of = _gradients(_parameter_list(parameters, warn_empty=False))
    max_norm, _, _ = _clip_arguments(max_norm, 2, _EPS)  # the norm comes given: any order passes
    if _dtensor.is_dtensor(total_norm):
        total_norm = cast(Any, total_norm).full_tensor()  # a DTensor: a replicated norm's own local value
    if not grads:
        return
    table = _tensor_table.read(grads, name_of, in_place=True, facts=facts)
    if table is None:  # DTensors: their local shards are scaled, with no redistribution
        grads = [_dtensor.local(g) if _dtensor.is_dtensor(g) else g for g in grads]
        table = cast(_tensor_table.Table, _tensor_table.read(grads, name_of, in_place=True))  # plain tensors now
    _clipping.scale_by(table.bound, total_norm, max_norm, _EPS)


@torch.no_grad()
def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor], max_norm: float,
                    norm_type: float | str = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None, *, pp_mesh: Any = None, tied: Iterable | None = None) -> torch.Tensor:
    """Clip the gradient norm of ``parameters`` in place; return the total norm before clipping.

    As ``torch.nn.utils.clip_grad_norm_``; parameters without a gradient are
    skipped. With ``error_if_nonfinite``, a NaN or inf norm raises
    NonFiniteNormError (a RuntimeError) and no gradient is scaled.
    ``pp_mesh`` and ``tied`` (pairs ``(parameter, owning stage)``) are
    taken as by ``get_total_norm``: every stage clips by the model's norm,
    a stage whose parameters have no gradient included.

    >>> import torch
    >>> net = torch.nn.Linear(3, 1)
    >>> net(torch.ones(1, 3)).sum().backward()
    >>> float(clip_grad_norm_(net.parameters(), max_norm=1.0))
    2.0
    >>> round(float(torch.cat([p.grad.flatten() for p in net.parameters()]).norm()), 5)
    1.0
    """
    if torch.compiler.is_compiling():
        parameters = _parameter_list(parameters, warn_empty=True)
        if pp_mesh is not None or tied is not None or _any_dtensor(q.grad for q in parameters):
            return _clip_between_graphs(parameters, max_norm, norm_type, error_if_nonfinite, pp_mesh=pp_mesh,
                                        tied=tied)
        return _compiled_clip(parameters, max_norm, _torch_norm_type(norm_type), error_if_nonfinite)
    parameters = _parameter_list(parameters, warn_empty=True)
    grads, facts, name_of = _gradients(parameters)
    max_norm, p, _ = _clip_arguments(max_norm, _torch_norm_type(norm_type), _EPS)
    plain = pp_mesh is None and tied is None
    if not grads and plain:  # a stage without any joins the others' collective
        return torch.tensor(0.0)
    # Each gradient is read once, for the norm and the scale, and checked before either.
    table = _tensor_table.read(grads, name_of, in_place=True, facts=facts) if plain else None
    if table is None:  # DTensors or pipeline stages: over the ranks (a DTensor norm replicated over one mesh)
        tied = _tied_gradients(parameters, tied)
        grads, names = _unique((g, name_of(i)) for i, g in enumerate(grads))
        _tensor_table.check_floating(grads, names.__getitem__)
        with _torch_nonfinite_error():
            total = _ranks.clip_grad_norm_(grads, max_norm, p, pp_mesh=pp_mesh, tied=tied, eps=_EPS,
                                          error_if_nonfinite=error_if_nonfinite)
        return _returned(total, grads)
    total = _clipping.clip_(table.bound, max_norm, p, _EPS, error_if_nonfinite, kind=NonFiniteNormError,
                           name_of=name_of)
    return total.to(table.returned_dtype)


# ---------------------------------------------------------------- inside torch.compile

# Across pipeline stages, or over DTensors, a drop-in called inside a
# torch.compile'd function runs as it is, between two graphs: it reduces
# over process groups and reads meshes on the host, and a collective hidden
# in an opaque operator could be reached by the ranks in different orders.
_total_norm_between_graphs = torch.compiler.disable(get_total_norm)
_clip_between_graphs = torch.compiler.disable(clip_grad_norm_)
_scale_between_graphs = torch.compiler.disable(clip_grads_with_norm_)


def _any_dtensor(tensors: Iterable[torch.Tensor | None]) -> bool:
    return any(t is not None and _dtensor.is_dtensor(t) for t in tensors)


def _compiled_clip(parameters: list[torch.Tensor], max_norm: Any, p: float,
                   error_if_nonfinite: bool) -> torch.Tensor:
    """clip_grad_norm_ as TorchDynamo traces it: the gradients listed in
    Python, then the eager clip (``gpuflat._src.clipping``) as one of
    gpuflat's operators, so its bits are the eager call's; with
    ``error_if_nonfinite``, the norm and the scale as two, the host check
    of the norm between them (the graph breaks there, as at PyTorch's own
    check)."""
    given = [(k, q.grad) for k, q in enumerate(parameters) if q.grad is not None]
    grads = [g for _, g in given]
    limit = _compiled_max_norm(max_norm)
    if not grads:
        return torch.tensor(0.0)
    if error_if_nonfinite:
        traced = _Traced(grads, [f"parameters[{k}].grad" for k, _ in given])
        total = _clipping.clip_(traced, max_norm, p, _EPS, True, kind=NonFiniteNormError)
    elif isinstance(limit, torch.Tensor):
        total = _torch_ops.clip_(grads, 0.0, limit, p, _EPS)
    else:
        total = _torch_ops.clip_(grads, limit, None, p, _EPS)
    return total.to(_tensor_table.returned_dtype([g.dtype for g in grads]))


class _Traced(_clipping.Bound):
    """Tensors bound as TorchDynamo traces them: the norm (in float64) and the
    scale are gpuflat's operators, opaque in the graph, whose insides are an
    eager table's bound (``gpuflat._src.torch_ops``). Checking the norm reads
    it on the host, so the graph breaks there, as at PyTorch's own check."""

    def __init__(self, tensors: list[torch.Tensor], names: list[str]) -> None:
        self.tensors, self.names = tensors, names

    def place(self) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()  # each operator places its own work

    def norm(self, p: float, per_leaf: bool = False) -> _clipping.Norm:
        return _clipping.Norm(_torch_ops.total_norm(self.tensors, p), None, [])

    def finite(self, norm: _clipping.Norm) -> bool:
        return bool(torch.isfinite(norm.total))

    def culprit(self, norm: _clipping.Norm, p: float, name_of: Callable[[int], str] | None = None) -> str | None:
        bad = next((name for name, t in zip(self.names, self.tensors) if not torch.isfinite(t).all()), None)
        return None if bad is None else f"leaf {bad!r}"

    def scale_(self, norm: _clipping.Norm, max_norm: Any, eps: float) -> None:
        _compiled_scale(self.tensors, max_norm, norm.total, eps)


def _compiled_scale(grads: list[torch.Tensor], max_norm: Any, total: torch.Tensor, eps: float = _EPS) -> None:
    """The scale by min(1, max_norm / (total + eps)) as gpuflat's operator: a
    number by value, a 0-d tensor read where it lies (no host read)."""
    max_norm = _compiled_max_norm(max_norm)
    if isinstance(max_norm, torch.Tensor):
        _torch_ops.scale_by_tensor_norm_(grads, max_norm, total, eps)
    else:
        _torch_ops.scale_by_norm_(grads, max_norm, total, eps)


def _compiled_max_norm(max_norm: Any) -> float | torch.Tensor:
    """``max_norm`` checked: a number (>= 0), or a 0-d real floating tensor,
    whose value is not read on the host (a traced function cannot branch on
    it; the eager clip reads a host tensor's value to check it)."""
    if not isinstance(max_norm, torch.Tensor):
        return _clip_arguments(max_norm, 2, _EPS)[0]
    if max_norm.dim() != 0 or not max_norm.dtype.is_floating_point:
        raise ValueError(f"max_norm: expected a number >= 0 or a 0-d real floating tensor, got one of shape "
                         f"{tuple(max_norm.shape)} and dtype {str(max_norm.dtype).removeprefix('torch.')}")
    return max_norm


# ---------------------------------------------------------------- arguments

def _parameter_list(parameters: torch.Tensor | Iterable[torch.Tensor], warn_empty: bool) -> list[torch.Tensor]:
    if isinstance(parameters, torch.Tensor):
        return [parameters]
    is_generator = isinstance(parameters, types.GeneratorType)
    parameters = list(parameters)
    if warn_empty and is_generator and not parameters:
        warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.",
                      stacklevel=4)
    return parameters


def _gradients(parameters: list[torch.Tensor]) -> tuple[list[torch.Tensor], Any, Callable[[int], str]]:
    """(the gradients of the parameters that have one, their facts
    (``tensor_facts``), a function naming the i-th of them)."""
    grads, facts = _tensor_facts.gradients(parameters)
    owners: list = []  # which parameter each gradient belongs to, found on the first call

    def name_of(i: int) -> str:  # on error, or for every gradient on the DTensor path
        if not owners:
            owners.extend(k for k, p in enumerate(parameters) if p.grad is not None)
        return f"parameters[{owners[i]}].grad"

    return grads, facts, name_of


def _tied_gradients(parameters: list[torch.Tensor], tied: Iterable | None) -> list | None:
    """``tied``'s (parameter, stage) pairs as (its gradient, stage), the pairs
    gpuflat._src.ranks counts by; a parameter without a gradient gives
    None, counted nowhere."""
    if tied is None:
        return None
    pairs = []
    for i, entry in enumerate(tied):
        if isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], torch.Tensor):
            param, stage = entry
            if not any(param is q for q in parameters):
                raise ValueError(f"tied[{i}]: expected one of `parameters`, found a {type(param).__name__} of "
                                 f"shape {tuple(param.shape)} that is none of them")
            entry = (param.grad, stage)
        pairs.append(entry)  # anything else: gpuflat._src.ranks names what it expected
    return pairs


def _unique(named: Iterable[tuple[torch.Tensor, str]]) -> tuple[list[torch.Tensor], list[str]]:
    """(tensors, names) from (tensor, name) pairs, each tensor once: a tensor met twice counts once."""
    seen, tensors, names = set(), [], []
    for tensor, name in named:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append(tensor)
            names.append(name)
    return tensors, names


def _returned(total: Any, tensors: list[torch.Tensor]) -> torch.Tensor:
    """A norm over the ranks in the dtype PyTorch returns for ``tensors``;
    where there are none (a pipeline stage without gradients) there is no
    dtype to round to, and the norm stays the float64 the stages combined."""
    if not tensors:
        return torch.as_tensor(total)
    return total.to(_tensor_table.returned_dtype([t.dtype for t in tensors]))


# ---------------------------------------------------------------- DTensors

@contextlib.contextmanager
def _torch_nonfinite_error() -> Iterator[None]:
    """gpuflat._src.ranks' NonFiniteError raised as NonFiniteNormError, the RuntimeError PyTorch raises."""
    try:
        yield
    except _NonFiniteError as err:
        raise NonFiniteNormError(str(err)) from None


from ._src.torch_optim import SGD, AdamW, GradScaler
from ._src.torch_optim import FlatOptimizer as _FlatOptimizer
from ._src.torch_optim import precision_defaults as _precision_defaults
from ._src import step_stats as _step_stats


class Lion(_FlatOptimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization
    Algorithms", https://arxiv.org/abs/2302.06675), with the clip inside the
    step: per element, with ``m`` the state ``exp_avg``,
    ``u = sign(beta1 * m + (1 - beta1) * g)``, ``p = p * (1 - lr * weight_decay)
    - lr * u``, ``m = beta2 * m + (1 - beta2) * g``, as lion-pytorch computes it
    (https://github.com/lucidrains/lion-pytorch). Everything else is
    :class:`AdamW`'s: ``max_norm``, both GradScalers, ``pp_mesh``/``tied``,
    DTensors, ``torch.compile(opt.step)``, CUDA-graph capture, state dicts,
    the precision options (``master_weights``, ``kahan_sum``,
    ``bf16_stochastic_round``, ``exp_avg_dtype``) and the figures
    (``stats=True``, or ``"global"`` for a DTensor's whole tensor).

    >>> import torch, gpuflat.torch as gft
    >>> w = torch.nn.Parameter(torch.tensor([1.0, -1.0, 0.5]))
    >>> opt = gft.Lion([w], lr=0.1, weight_decay=0.5)
    >>> w.grad = torch.tensor([2.0, -3.0, 0.0])
    >>> opt.step()
    >>> w.detach(), opt.state[w]["exp_avg"]
    (tensor([ 0.8500, -0.8500,  0.4750]), tensor([ 0.0200, -0.0300,  0.0000]))
    """

    _rule = "lion"

    def __init__(self, params: Iterable, lr: float | torch.Tensor = 1e-4, betas: tuple[float, float] = (0.9, 0.99),
                 weight_decay: float = 0.0, *, maximize: bool = False, foreach: bool | None = None,
                 differentiable: bool = False, max_norm: float | None = None, norm_type: float | str = 2.0,
                 pp_mesh: Any = None, tied: Iterable | None = None, master_weights: bool = False,
                 kahan_sum: bool = False, bf16_stochastic_round: bool = False, rounding_seed: int = 0,
                 exp_avg_dtype: torch.dtype | None = None, stats: bool | str = False):
        defaults = dict(lr=lr, betas=betas, weight_decay=weight_decay, maximize=maximize, foreach=foreach,
                        differentiable=differentiable,
                        **_precision_defaults("lion", master_weights, kahan_sum, bf16_stochastic_round, rounding_seed,
                                              exp_avg_dtype=exp_avg_dtype))
        super().__init__(params, defaults, max_norm, norm_type, pp_mesh, tied, stats)



def read_stats(optimizer: _FlatOptimizer) -> dict[str, float]:
    """The last step's figures of an optimizer made with ``stats=True`` (or
    ``"global"``: a DTensor's of its whole tensor, not this rank's shard), as
    one host dict for a logger, read in one copy per device (the one
    synchronisation): ``grad_norm``, the global norm (unscaled, before the
    clip), then per parameter ``<key>/grad_norm``, ``<key>/update_norm`` and
    ``<key>/update_ratio`` (its update's norm over its new value's), the key
    its name where the optimizer was given ``named_parameters()``, else its
    index across ``param_groups``. ``opt.stats`` holds the same as device
    tensors, rewritten by each step.

    >>> import torch, gpuflat.torch as gft
    >>> w = torch.nn.Parameter(torch.ones(4))
    >>> opt = gft.SGD([w], lr=0.25, stats=True)
    >>> w.grad = torch.full((4,), 2.0)
    >>> opt.step()
    >>> gft.read_stats(opt)
    {'grad_norm': 4.0, '0/grad_norm': 4.0, '0/update_norm': 1.0, '0/update_ratio': 1.0}
    """
    return _step_stats.to_host(optimizer)
