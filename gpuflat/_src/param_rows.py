"""What a flat optimizer's step updates: PyTorch's parameters that have a
gradient, with their gradients, state and step counts, as tables of
addresses (one row of ``gpuflat._src.layout.PARAM_ROW_FIELDS`` per parameter),
one table per device and dtype.

A training loop's steps mostly see the same parameters with the same state,
and gradients in the same or in new memory. Which parameters have a
gradient, and their state tensors, are kept and found again while
``param_groups``, the optimizer's state dict and the set of parameters with
a gradient stay the same; the addresses, element counts, dtypes, devices and
layouts of every tensor are read every step in one native pass per list
(``gpuflat._src.tensor_facts``), so memory that moved (``p.data = t``,
``model.to()``, ``zero_grad()``'s new gradients) is followed. Everything is
checked before the step writes anything; what cannot be updated raises
naming ``param_groups[g]['params'][i]``.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(3)); w.grad = torch.ones(3)
>>> opt = torch.optim.SGD([w, torch.nn.Parameter(torch.ones(2))], lr=0.1)
>>> step = read(opt, ("momentum_buffer",), lambda state, p, group: False)
>>> [t.rows[:, 5].tolist() for t in step.tables], step.grads[0] is w.grad
([[3]], True)
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from . import caches, dtensor, tensor_facts
from .layout import PARAM_ROW_FIRST, PARAM_ROW_WORDS
from .memory_order import dense_start

# The dtypes the update kernels take, by their tensor_facts codes.
STEPPED = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_STEPPED_CODES = np.array([d in STEPPED for d in tensor_facts.DTYPES])


@dataclass(frozen=True)
class Table:
    """One device's and dtype's rows, and a tensor placing their work (its device, its stream)."""

    rows: np.ndarray
    like: torch.Tensor


@dataclass(frozen=True)
class Step:
    """A step's tables, and the gradients of the parameters it updates (for
    the norm), with a function naming the i-th of them."""

    tables: list
    grads: list
    grad_facts: np.ndarray | None  # the gradients' tensor_facts, read once for the rows and the norm
    name_of_gradient: object
    plain: bool  # no DTensor or other tensor subclass among the parameters and gradients


@dataclass
class _Found:
    """What was found for one set of parameters with a gradient: kept while it holds."""

    key: tuple
    state: dict
    params: list
    groups: np.ndarray
    columns: list  # per state name, each parameter's tensor (None where it keeps none)
    kept: list  # per state name, the positions of the parameters that keep one
    steps: list | None
    plain: bool  # no DTensor or other tensor subclass among them
    # The state's and step counts' words of the rows (PARAM_ROW_FIELDS 2-4),
    # and the parameters' element counts and codes they were checked against:
    # the state is gpuflat's own, so it is read again only when those change.
    state_words: np.ndarray | None = None
    checked: np.ndarray | None = None


def read(optimizer, state_names, lazy_state) -> Step | None:
    """The step of ``optimizer`` (a ``torch.optim.Optimizer``) over its
    parameters that have a gradient, their state made first where it is
    missing (``lazy_state(state, p, group)``, True where it made a momentum
    buffer this step); None when no parameter has a gradient."""
    everything, group_of = _all_parameters(optimizer)
    grads, grad_facts = tensor_facts.gradients(everything)
    if not grads:
        return None
    have = None if len(grads) == len(everything) else \
        np.flatnonzero([p.grad is not None for p in everything])
    key = (_groups_key(optimizer), None if have is None else have.tobytes())
    found, firsts = _found(optimizer, key, everything, group_of, have, state_names, lazy_state)
    names = _Names(optimizer.param_groups, found.params)
    tables = _tables(found, grads, grad_facts, firsts, names.parameter)
    return Step(tables, grads, grad_facts, lambda i: f"{names.parameter(i)}.grad",
                found.plain and grad_facts is not None)


def _groups_key(optimizer) -> tuple:
    return tuple((id(g["params"]), len(g["params"])) for g in optimizer.param_groups)


def _all_parameters(optimizer):
    """Every parameter of ``param_groups`` in order, and each one's group index (kept per groups)."""
    key = _groups_key(optimizer)
    kept = getattr(optimizer, "_gpuflat_all", None)
    if kept is None or kept[0] != key:
        everything = [p for g in optimizer.param_groups for p in g["params"]]
        group_of = np.repeat(np.arange(len(optimizer.param_groups)), [len(g["params"]) for g in optimizer.param_groups])
        kept = optimizer._gpuflat_all = (key, everything, group_of)
    return kept[1], kept[2]


def _found(optimizer, key, everything, group_of, have, state_names, lazy_state):
    """(what was found for these parameters with a gradient, the momentum
    buffers made this step as PARAM_ROW_FIRST flags). Kept while the groups,
    the state dict and the parameters with a gradient are the same."""
    kept = getattr(optimizer, "_gpuflat_found", None)
    if kept is not None and kept.key == key and kept.state is optimizer.state:
        return kept, None
    params = everything if have is None else [everything[k] for k in have]
    groups = group_of if have is None else group_of[have]
    firsts = np.zeros(len(params), np.int64)
    for j, (p, g) in enumerate(zip(params, groups.tolist())):
        if lazy_state(optimizer.state[p], p, optimizer.param_groups[g]):
            firsts[j] = PARAM_ROW_FIRST
    states = [optimizer.state[p] for p in params]
    columns = [[s.get(name) for s in states] for name in state_names]
    kept = [np.flatnonzero([t is not None for t in column]) for column in columns]
    steps = [s["step"] for s in states] if states and "step" in states[0] else None
    all_plain = plain(params)
    if not all_plain:
        columns = [dtensor.local_shards(column) for column in columns]
    found = _Found(key, optimizer.state, params, groups, columns, kept, steps, all_plain)
    optimizer._gpuflat_found = found
    _holders.add(optimizer)
    return found, firsts if firsts.any() else None


def forget(optimizer) -> None:
    """Drop what was kept for ``optimizer`` (its state was loaded anew)."""
    optimizer.__dict__.pop("_gpuflat_found", None)
    optimizer.__dict__.pop("_gpuflat_all", None)


# The optimizers keeping what was found (on themselves, so it goes with
# them), weakly: gpuflat.cache_clear() makes each find it again.
_holders: weakref.WeakSet = weakref.WeakSet()
caches.register("optimizers' parameters found", lambda: sum("_gpuflat_found" in o.__dict__ for o in list(_holders)),
                lambda: [forget(o) for o in list(_holders)])


def tables_of(params, grads, columns, steps, groups, flags, name_of) -> list:
    """The tables of a step given as lists of plain tensors, checked as
    :func:`read` checks an optimizer's: a compiled step's operator, which
    holds no optimizer to keep what it found on. ``columns``: per state
    name, each parameter's tensor or None; ``steps``: the step counts or
    None; ``groups``: each parameter's group; ``flags``: the rows' flags or
    None; ``name_of(i)`` names the i-th parameter.

    >>> w, g, buf = torch.ones(3), torch.ones(3), torch.zeros(3)
    >>> [t.rows[:, 5].tolist() for t in tables_of([w], [g], [[buf]], None, [0], None, str)]
    [[3]]
    """
    kept = [np.flatnonzero([t is not None for t in column]) for column in columns]
    found = _Found(None, None, params, np.asarray(groups, np.int64), columns, kept, steps, True)
    return _tables(found, grads, _facts(grads), flags, name_of)


def _tables(found, grads, grad_facts, firsts, name_of) -> list:
    params = found.params if found.plain else dtensor.local_shards(found.params)
    param_facts = _facts(params)
    if not found.plain:
        grads = dtensor.local_shards(grads)
        grad_facts = _facts(grads)
    if param_facts is None or grad_facts is None:
        raise TypeError(f"{name_of(0)}, or another parameter or gradient: expected strided tensors "
                        f"with storage of their own")
    rows = np.zeros((len(params), PARAM_ROW_WORDS), np.int64)
    rows[:, 0] = _starts(params, param_facts, name_of, "parameter")
    _check_alike(params, param_facts, grads, grad_facts, name_of, "gradient")
    rows[:, 1] = _starts(grads, grad_facts, name_of, "gradient")
    if found.checked is None or not np.array_equal(found.checked, param_facts[:, 1:]):
        found.state_words = _state_words(found, params, param_facts, name_of)
        found.checked = param_facts[:, 1:].copy()
    rows[:, 2:5] = found.state_words
    rows[:, 5] = param_facts[:, 1]
    rows[:, 6] = found.groups
    if firsts is not None:
        rows[:, 7] = firsts
    buckets = _buckets(param_facts)
    if len(buckets) == 1:
        return [Table(rows, params[0])]
    return [Table(rows[members], params[int(members[0])]) for members in buckets]


def _state_words(found, params, param_facts, parameter) -> np.ndarray:
    """The rows' state and step-count addresses, each state tensor checked alike its parameter."""
    words = np.zeros((len(params), 3), np.int64)
    for s, (column, kept) in enumerate(zip(found.columns, found.kept)):
        whole = len(kept) == len(column)
        tensors = column if whole else [column[j] for j in kept]
        if not tensors:
            continue
        facts = _facts(tensors)
        name_of = parameter if whole else (lambda i, kept=kept: parameter(kept[i]))
        _check_alike(params if whole else [params[j] for j in kept], param_facts[kept], tensors, facts, name_of,
                     "state")
        words[kept, s] = _starts(tensors, facts, name_of, "state")
    if found.steps is not None:
        words[:, 2] = _facts(found.steps)[:, 0]
    return words


def _facts(tensors):
    """The tensors' facts (gpuflat._src.tensor_facts), read in Python for a tensor
    subclass the native reader leaves out."""
    facts = tensor_facts.of_tensors(tensors)
    return facts if facts is not None else tensor_facts.in_python(tensors)


def plain(tensors) -> bool:
    """Whether every tensor is of a plain type (no DTensor, no subclass)."""
    return set(map(type, tensors)) <= tensor_facts.PLAIN


def _buckets(facts) -> list:
    """Row positions by device and dtype, in order."""
    keys = (tensor_facts.device_keys(facts) << 16) | tensor_facts.dtype_codes(facts)
    if (keys == keys[0]).all():
        return [np.arange(len(keys))]
    return [np.flatnonzero(keys == k) for k in dict.fromkeys(keys.tolist())]


def _starts(tensors, facts, name_of, what) -> np.ndarray:
    """Each tensor's lowest element address: its data pointer where it is
    contiguous, else where its one dense block of memory begins. A tensor
    whose memory is not one dense block, or of a dtype the update does not
    take, raises naming its parameter."""
    codes = tensor_facts.dtype_codes(facts)
    if not _STEPPED_CODES[codes].all():
        j = int(np.flatnonzero(~_STEPPED_CODES[codes])[0])
        dtype = tensors[j].dtype
        raise TypeError(f"{name_of(j)}: expected a float16, bfloat16, float32 or float64 {what}, got {dtype}"
                        + (": complex parameters are not supported" if dtype.is_complex else ""))
    starts = facts[:, 0].copy()
    for j in np.flatnonzero((facts[:, 2] & tensor_facts.CONTIGUOUS) == 0).tolist():
        t = tensors[j]
        size = t.element_size()
        start = dense_start(tuple(t.shape), tuple(s * size for s in t.stride()), size)
        if start is None:
            raise ValueError(f"{name_of(j)}: expected a {what} whose memory is one dense block, got shape "
                             f"{tuple(t.shape)} and strides {t.stride()}; make the parameter contiguous")
        starts[j] += start
    return starts


def _check_alike(params, param_facts, tensors, facts, name_of, what) -> None:
    """Each tensor of its parameter's element count, dtype, device and
    memory layout (shape and strides, read where either is not contiguous)."""
    same = (facts[:, 1] == param_facts[:, 1]) & (facts[:, 2] == param_facts[:, 2])
    strided = np.flatnonzero((param_facts[:, 2] & tensor_facts.CONTIGUOUS) == 0).tolist()
    bad = np.flatnonzero(~same).tolist() + [j for j in strided if tensors[j].stride() != params[j].stride()
                                           or tensors[j].shape != params[j].shape]
    if bad:
        j = min(bad)
        p, t = params[j], tensors[j]
        raise ValueError(f"{name_of(j)}: expected its {what} of shape {tuple(p.shape)}, dtype {p.dtype}, "
                         f"device {p.device} and strides {p.stride()}, got {tuple(t.shape)}, {t.dtype}, "
                         f"{t.device} and strides {t.stride()}")


class _Names:
    """The step's parameters named as the user's param_groups place them (made on error)."""

    def __init__(self, groups, params):
        self.groups, self.params = groups, params

    def parameter(self, k) -> str:
        p = self.params[int(k)]
        for g, group in enumerate(self.groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return f"param_groups[{g}]['params'][{i}]"
        return f"parameter {k}"
