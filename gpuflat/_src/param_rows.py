"""What a flat optimizer's step updates: PyTorch's parameters that have a
gradient, with their gradients, state and step counts, as rows of
addresses (one row of ``gpuflat._src.layout.PARAM_ROW_FIELDS`` per parameter)
in the step's ``gpuflat._src.tensor_table.Table``: its update rows, one set
per device and dtype, beside the norm rows of the gradients.

A training loop may change anything between two steps: the parameters in
``param_groups`` (``group['params'][i] = new``, ``add_param_group``), each
group's hyperparameters and flags, and the state (``state.clear()``,
``del state[p]``, a new ``exp_avg`` tensor, ``load_state_dict``). Each step
reads what decides its rows, or proves it unchanged, before it writes
anything:

- the groups' lists, compared by identity with the parameters found (one
  native pass, ``gpuflat._src.tensor_facts.same_items``), and each group's
  flags that decide which state it keeps (SGD's ``momentum``, AdamW's
  ``amsgrad``); its other hyperparameters are read by every update;
- the gradients, and the parameters' addresses, element counts, dtypes,
  devices and layouts, in one native pass per list, so memory that moved
  (``p.data = t``, ``model.to()``, ``zero_grad()``'s new gradients) is
  followed;
- the state: the optimizer's state dict and each parameter's dict are
  :class:`WatchedState` dicts, which count every edit made through them, so
  a step with no edit since the last one needs no read. After an edit (or
  every step, for a dict that is not watched: one a loop assigned itself)
  the state's words are read in one native pass
  (``tensor_facts.state_words``: identities and data pointers), and only
  the parameters whose words changed are checked again. A state tensor
  moved in place (``t.data = other``, ``t.set_()``) without an edit of its
  dict is not seen: replace it in the dict instead.

A change rebuilds only the rows it touches. What cannot be updated raises
naming ``param_groups[g]['params'][i]``.

A compiled step's update operator is handed lists of tensors, with no
optimizer to keep anything on: :func:`of_lists` keeps its last few tables
(in gpuflat's caches), each found again by everything that decides it, the
tensors' facts read in one native pass.

>>> import torch
>>> w = torch.nn.Parameter(torch.ones(3)); w.grad = torch.ones(3)
>>> opt = torch.optim.SGD([w, torch.nn.Parameter(torch.ones(2))], lr=0.1)
>>> step = read(opt, RULES["sgd"], lambda state, p, group: None)
>>> [t.rows[:, ROW_NUMEL].tolist() for t in step.table.updates], step.grads[0] is w.grad
([[3]], True)
"""
from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch

from . import caches, dtensor, tensor_facts, tensor_table
from .dtypes import torch_dtype
from .layout import (KEEP_SHIFT, KEEPS, KEPT_BESIDE, KEY_SHIFT, OPTIM_DTYPES, PARAM_ROW_FIELDS, PARAM_ROW_WORDS,
                     PRECISION_TAG_BITS, ROW_GROUP, ROW_NUMEL, ROW_PRECISION, RULES, TAG_OF_NAME, Rule, keep_numbers,
                     stochastic_bits)
from .memory_order import dense_start

if TYPE_CHECKING:
    from numpy.typing import ArrayLike
    from typing_extensions import Self

    from .backends.protocol import Backend

__all__ = ["KEEP_OPTIONS", "KEPT_STATE", "Step", "WatchedState", "WatchedStates", "expected_dtype", "forget", "keep_of",
           "needed", "needs_of", "of_lists", "plain", "read", "state_names", "stochastic_keys", "table_of", "takes_keep",
           "watch"]

# The dtypes the update kernels take, by their tensor_facts codes.
STEPPED = tuple(map(torch_dtype, OPTIM_DTYPES))
# Their names as an error lists them: "float16, bfloat16, float32 or float64".
_STEPPED_NAMES = " or ".join([", ".join(str(d).removeprefix("torch.") for d in STEPPED[:-1]),
                              str(STEPPED[-1]).removeprefix("torch.")])
_STEPPED_CODES = np.array([d in STEPPED for d in tensor_facts.DTYPES])
# The 16-bit dtypes, whose parameters a group's master weights or Kahan sum
# keep beside them (a float32 or float64 parameter is its own master).
_NARROW = (torch.float16, torch.bfloat16)
_NARROW_CODES = np.array([d in _NARROW for d in tensor_facts.DTYPES])
_BF16_CODE = tensor_facts.DTYPES.index(torch.bfloat16)
# The state a 16-bit parameter keeps beside it, by keep (gpuflat._src.layout.KEEPS),
# under Transformer Engine's and optimi's names.
KEPT_STATE = {"master": "master_param", "kahan": "kahan_comp"}
# The rows' words of the state, in the order of state_names(rule): state0,
# state1, state2, what the parameter keeps beside it, then the step count.
_STATE_FIELDS = [PARAM_ROW_FIELDS.index(f) for f in ("state0", "state1", "state2", "extra", "step")]
_EXTRA = _STATE_FIELDS.index(PARAM_ROW_FIELDS.index("extra"))
_BESIDE = [KEEPS.index(keep) for keep in KEPT_BESIDE]
# The layout's dtype tag of each tensor_facts code (-1: none).
_TAG_OF_CODE = np.array([TAG_OF_NAME.get(str(d).removeprefix("torch."), -1) for d in tensor_facts.DTYPES], np.int64)
_ROW_PARAM, _ROW_GRAD = PARAM_ROW_FIELDS.index("param"), PARAM_ROW_FIELDS.index("grad")
# Those words as a slice where they are adjacent (a view: no gather per step).
_STATE_WORDS = slice(_STATE_FIELDS[0], _STATE_FIELDS[-1] + 1) \
    if _STATE_FIELDS == list(range(_STATE_FIELDS[0], _STATE_FIELDS[-1] + 1)) else _STATE_FIELDS


def state_names(rule: Rule, keep: str = "plain") -> tuple:
    """The state a rule's rows address, in the rows' order: its tensors
    (``state0`` to ``state2``, None where unused), what a 16-bit parameter
    kept as ``keep`` keeps beside it (``KEPT_STATE``; None for "plain"),
    then ``"step"``.

    >>> state_names(RULES["adamw"]), state_names(RULES["sgd"], "master")
    (('exp_avg', 'exp_avg_sq', 'max_exp_avg_sq', None, 'step'), ('momentum_buffer', None, None, 'master_param', 'step'))
    """
    tensors = rule.state_names + tuple(name for _, name in rule.flag_states)
    return tensors + (None,) * (_EXTRA - len(tensors)) + (KEPT_STATE.get(keep), "step")


# Each keep but "plain" by the group option that asks for it.
KEEP_OPTIONS = {"master": "master_weights", "kahan": "kahan_sum", "stochastic": "bf16_stochastic_round"}


def keep_of(group: dict) -> str:
    """How ``group`` keeps its 16-bit parameters (gpuflat._src.layout.KEEPS):
    through a float32 master copy (``master_weights``), with a Kahan
    compensation (``kahan_sum``), rounded stochastically
    (``bf16_stochastic_round``), else plain.

    >>> keep_of({"master_weights": True}), keep_of({"lr": 0.1})
    ('master', 'plain')
    """
    return next((keep for keep, option in KEEP_OPTIONS.items() if group.get(option)), "plain")


def takes_keep(p: torch.Tensor, keep: str) -> bool:
    """Whether a group's ``keep`` applies to ``p``: a master copy and a
    compensation to a 16-bit parameter, stochastic rounding to a bfloat16 one.

    >>> takes_keep(torch.zeros(1, dtype=torch.float16), "stochastic")
    False
    """
    return p.dtype == torch.bfloat16 if keep == "stochastic" else p.dtype in _NARROW


def stochastic_keys(seeds: np.ndarray, groups: np.ndarray, indices: np.ndarray) -> np.ndarray:
    """The stochastic rounding keys (below 2**31) of parameters at
    ``indices`` in ``groups``, whose groups' seeds are ``seeds``: the same
    parameter gets the same key in an eager and a compiled step, and each
    parameter its own draws.

    >>> stochastic_keys(np.array([0, 0]), np.array([0, 0]), np.array([0, 1])).tolist()
    [1725399352, 855247679]
    """
    word = (np.asarray(seeds, np.int64) << 40) ^ (np.asarray(groups, np.int64) << 32) ^ np.asarray(indices, np.int64)
    return (stochastic_bits(0, 0, word.astype(np.uint64)).astype(np.int64) << 15) ^ \
        (stochastic_bits(1, 0, word.astype(np.uint64)).astype(np.int64) & 0x7FFF)


def expected_dtype(rule: Rule, name: str, p: torch.Tensor, group: dict) -> torch.dtype:
    """The dtype of ``p``'s state ``name`` in ``group``: a moment's is the
    group's option for it (``Rule.dtype_option``; None: the parameter's),
    a master copy's float32, anything else the parameter's.

    >>> w = torch.zeros(2, dtype=torch.bfloat16)
    >>> expected_dtype(RULES["adamw"], "max_exp_avg_sq", w, {"exp_avg_sq_dtype": torch.float32})
    torch.float32
    """
    if name == KEPT_STATE["master"]:
        return torch.float32
    option = rule.dtype_option(name)
    chosen = None if option is None else group.get(option)
    return p.dtype if chosen is None else chosen


def needed(rule: Rule, group: dict, keep: str | None = None) -> tuple:
    """Per name of :func:`state_names`, whether ``group``'s steps read it: a
    rule's state and count where its steps count (SGD's only with momentum),
    a flag's state where the group sets the flag, what a parameter kept as
    ``keep`` (None: ``keep_of(group)``) keeps beside it, and a count for
    stochastic rounding, whose draws it keys (:func:`needs_of` gives a
    parameter's, which takes its group's keep or not).

    >>> needed(RULES["sgd"], {"momentum": 0.0}), needed(RULES["adamw"], {"amsgrad": True, "kahan_sum": True})
    ((False, False, False, False, False), (True, True, True, True, True))
    >>> needed(RULES["sgd"], {"momentum": 0.0, "bf16_stochastic_round": True})
    (False, False, False, False, True)
    """
    keep = keep_of(group) if keep is None else keep
    counted = rule.counted_when is None or float(group[rule.counted_when]) != 0.0
    flags = tuple(bool(group.get(flag, False)) and counted for flag, _ in rule.flag_states)
    base = (counted,) * len(rule.state_names) + flags
    return base + (False,) * (_EXTRA - len(base)) + (keep in KEPT_BESIDE, counted or keep == "stochastic")


def needs_of(rule: Rule, p: torch.Tensor, group: dict) -> tuple[str, tuple]:
    """(how parameter ``p`` of ``group`` is kept: ``keep_of(group)`` where
    it takes it, else "plain"; :func:`needed` for it, per name of
    ``state_names(rule, keep)``).

    >>> needs_of(RULES["sgd"], torch.zeros(1), {"momentum": 0.0, "master_weights": True})
    ('plain', (False, False, False, False, False))
    """
    keep = keep_of(group)
    keep = keep if takes_keep(_local(p), keep) else "plain"
    return keep, needed(rule, group, keep)


# ---------------------------------------------------------------- watched state

# Edits made through any WatchedState since the process began: a step that
# finds the count it saw last knows its optimizer's state unchanged.
_EDITS = [0]


if TYPE_CHECKING:
    # The mixin is only ever mixed into a dict: its super() calls are dict's.
    _DictMixin = dict[Any, Any]
else:
    _DictMixin = object


class _Counting(_DictMixin):
    """Every edit of a dict counted in _EDITS. Plain methods calling
    ``super()``: TorchDynamo traces them where a compiled step makes state."""

    __slots__ = ()

    def __setitem__(self, key: Any, value: Any) -> None:
        _EDITS[0] += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        _EDITS[0] += 1
        super().__delitem__(key)

    # mypy checks __ior__ against dict's overloaded __or__ (whose second form widens the
    # key and value types), which no in-place form returning Self satisfies; dict's own
    # __ior__ returns Self as this does.
    def __ior__(self, other: Any) -> Self:  # type: ignore[misc]
        _EDITS[0] += 1
        return super().__ior__(other)

    def clear(self) -> None:
        _EDITS[0] += 1
        super().clear()

    def pop(self, *args: Any) -> Any:
        _EDITS[0] += 1
        return super().pop(*args)

    def popitem(self) -> Any:
        _EDITS[0] += 1
        return super().popitem()

    def setdefault(self, *args: Any) -> Any:
        _EDITS[0] += 1
        return super().setdefault(*args)

    def update(self, *args: Any, **kwargs: Any) -> None:
        _EDITS[0] += 1
        super().update(*args, **kwargs)


class WatchedState(_Counting, dict):
    """A parameter's state dict that counts its edits (a plain ``dict``
    otherwise, pickled as one): a step knows it unchanged without reading it.

    >>> s = WatchedState(step=0); before = _EDITS[0]; s["exp_avg"] = 1; _EDITS[0] - before
    1
    """

    __slots__ = ()

    def __reduce__(self) -> tuple[Any, ...]:
        return dict, (dict(self),)


class WatchedStates(_Counting, collections.defaultdict):
    """An optimizer's state (PyTorch's ``defaultdict(dict)``) that counts its
    edits, and makes each missing parameter's dict a :class:`WatchedState`;
    pickled as PyTorch keeps it, a ``defaultdict(dict)`` of dicts.

    >>> states = WatchedStates(); type(states["w"]).__name__
    'WatchedState'
    """

    def __init__(self, *args: Any) -> None:
        super().__init__(WatchedState, *args)

    def __reduce__(self) -> tuple[Any, ...]:
        return collections.defaultdict, (dict,), None, None, ((k, dict(v)) for k, v in self.items())


def watch(optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer.state`` (fresh from PyTorch: its constructor or
    ``load_state_dict``, no other holder) and its dicts watched ones.

    >>> opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    >>> watch(opt); type(opt.state).__name__, _watched(opt.state)
    ('WatchedStates', True)
    """
    optimizer.state = WatchedStates((p, WatchedState(s) if type(s) is dict else s)
                                    for p, s in optimizer.state.items())


def _watched(state: object) -> bool:
    return type(state) is WatchedStates and all(type(s) is WatchedState for s in state.values())


# ---------------------------------------------------------------- tables

@dataclass(frozen=True)
class Step:
    """A step's table (``tensor_table.Table``: its update rows, and where
    the step reads its gradients' norm over one rank, their norm rows),
    the parameters it updates and their gradients (for a norm over ranks)."""

    table: tensor_table.Table
    params: list
    grads: list
    plain: bool  # no DTensor or other tensor subclass among the parameters and gradients


@dataclass
class _Found:
    """What was found for an optimizer's parameters, one entry per parameter
    of ``param_groups`` in order, kept while it holds."""

    # Each group's parameter count as found: a parameter moved across a
    # group's end leaves the parameters' order alone, not their groups.
    sizes: tuple
    everything: list
    group_of: np.ndarray
    needs: np.ndarray  # per group, per name of state_names: whether its steps read it
    needs_key: tuple  # the same as tuples
    state: object  # the optimizer's state dict, as found
    edits: int  # _EDITS when it was last read; -1 where it is not watched
    words: np.ndarray  # per parameter, the addresses of its state (state_names' order), 0 where none
    seen: np.ndarray  # per parameter, its state's words as tensor_facts.state_words reads them, 0 where none
    plain: bool  # no DTensor or other tensor subclass among the parameters
    checked: np.ndarray  # per parameter, the (element count, code) its state was checked against
    present: np.ndarray  # per parameter, per name of state_names: whether its state holds it
    narrow: np.ndarray  # per parameter, whether it is 16-bit (takes_keep)
    precision: np.ndarray  # per parameter, its precision word as its state was read (precision_word)
    # Derived by _derive: per parameter, whether its state lacks what its
    # group's steps read, its rows' state words (0 where not read) and
    # precision word (no keep where nothing is kept beside it).
    lacking: np.ndarray | None = None
    masked: np.ndarray | None = None
    row_precision: np.ndarray | None = None
    kept: _Kept | None = None  # the last step's rows, while they hold


def _derive(found: _Found, ks: np.ndarray | None = None) -> None:
    """``found.lacking``, ``found.masked`` and ``found.row_precision`` for
    the parameters at ``ks`` (all for None, and whenever one is missing:
    the three are derived together)."""
    lacking, masked, row_precision = found.lacking, found.masked, found.row_precision
    at: np.ndarray | slice = slice(None) if ks is None else ks
    if ks is None or lacking is None or masked is None or row_precision is None:
        at = slice(None)
        lacking, masked = np.zeros(len(found.everything), bool), np.zeros_like(found.words)
        row_precision = np.zeros_like(found.precision)
        found.lacking, found.masked, found.row_precision = lacking, masked, row_precision
    need = found.needs[found.group_of[at]]
    need[:, _EXTRA] &= found.narrow[at]
    lacking[at] = (need & ~found.present[at]).any(axis=1)
    masked[at] = words = found.words[at] * need
    # A keep with a buffer beside the parameter holds where the step reads the buffer.
    keeps = keep_numbers(found.precision[at])
    unread = np.isin(keeps, _BESIDE) & (words[:, _EXTRA] == 0)
    row_precision[at] = found.precision[at] - (keeps << KEEP_SHIFT) * unread


def read(optimizer: torch.optim.Optimizer, rule: Rule,
         lazy_state: Callable[[dict[str, Any], torch.Tensor, dict[str, Any]], object],
         with_norm: bool = False) -> Step | None:
    """The step of ``optimizer`` (a ``torch.optim.Optimizer``) over its
    parameters that have a gradient, their state made first where it lacks
    what their group needs (``lazy_state(state, p, group)``), its table
    with the gradients' norm rows too where ``with_norm`` (and they are
    plain: a norm over ranks reads the gradients themselves); None when no
    parameter has a gradient."""
    groups = optimizer.param_groups
    found, (grads, grad_facts, all_facts) = _found(optimizer, rule, [g["params"] for g in groups])
    everything = found.everything
    if not grads:
        return None
    whole = len(grads) == len(everything)
    have = np.arange(len(everything)) if whole else np.flatnonzero([p.grad is not None for p in everything])
    names = _Names(found, have)
    kept = found.kept
    if kept is not None and kept.fits(have, all_facts, grad_facts):
        # The parameters and their gradients' kinds as at the last step: its
        # rows hold, with the new gradients' addresses.
        params, param_facts, buckets, all_plain = kept.params, kept.param_facts, kept.buckets, True
        rows = kept.rows.copy()
        rows[:, _ROW_GRAD] = cast(np.ndarray, grad_facts)[:, 0]
    else:
        params = everything if whole else [everything[k] for k in have]
        # Facts read natively are of plain gradients only (tensor_facts.gradients).
        all_plain = found.plain and grad_facts is not None and all_facts is not None
        locals_, local_grads = (params, grads) if all_plain else (dtensor.local_shards(params),
                                                                  dtensor.local_shards(grads))
        param_facts = cast(np.ndarray, all_facts)[have] if all_plain else _facts(locals_)
        local_grad_facts = grad_facts if all_plain else _facts(local_grads)
        _check_dense(rule, locals_, param_facts, local_grads, local_grad_facts, names.parameter)
        assert local_grad_facts is not None  # _check_dense raised otherwise
        rows = _param_rows(locals_, param_facts, local_grads, local_grad_facts, found.group_of[have], names.parameter)
        buckets = _buckets(param_facts)
        found.kept = _Kept(have, param_facts, rows.copy(), params, buckets) \
            if all_plain and (param_facts[:, 2] & tensor_facts.CONTIGUOUS).all() else None
    # The state, once the parameters and gradients are known good.
    _follow_state(optimizer, rule, found, names.of_all)
    assert found.lacking is not None and found.masked is not None  # derived by _found
    lacking = found.lacking if whole else found.lacking[have]
    if lacking.any():
        missing = have[lacking]
        for k in missing.tolist():
            lazy_state(optimizer.state[everything[k]], everything[k], groups[int(found.group_of[k])])
        _reread(optimizer, rule, found, missing, names.of_all)
    checked = found.checked if whole else found.checked[have]
    # Compared fact by fact (transposed: one long run each, not a run of two per parameter).
    if not np.array_equal(checked.T, param_facts.T[1:]):  # a parameter moved or changed: its state is checked again
        _reread(optimizer, rule, found, have[(checked != param_facts[:, 1:]).any(axis=1)], names.of_all)
    rows[:, _STATE_WORDS] = found.masked if whole else found.masked[have]
    assert found.row_precision is not None  # derived with found.masked
    rows[:, ROW_PRECISION] = found.row_precision if whole else found.row_precision[have]
    # Plain gradients' facts are read natively (all_plain says they were).
    gradients = (grads, cast(np.ndarray, grad_facts), rows[:, _ROW_GRAD], names.gradient) \
        if with_norm and all_plain else None
    return Step(tensor_table.of_step(rows, buckets, params, gradients), params, grads, all_plain)


@dataclass(frozen=True, eq=False)
class _Kept:
    """A plain step's rows but their state words, kept for the next step:
    they hold while the same parameters have gradients, and the
    parameters' facts and their gradients' kinds (element count, dtype,
    device, contiguity) are as they were. Kept only where every parameter
    is contiguous, so a gradient of its parameter's kind starts at its
    data pointer."""

    have: np.ndarray  # the positions of the parameters with a gradient
    param_facts: np.ndarray  # theirs
    rows: np.ndarray
    params: list
    buckets: list  # the rows' positions by device and dtype (_buckets)

    @functools.cached_property
    def kinds(self) -> np.ndarray:
        """The parameters' facts but their addresses, one row per fact:
        compared with the gradients' facts read the same way (a column of
        10,000 facts at a time, not 10,000 rows of two)."""
        return np.ascontiguousarray(self.param_facts.T[1:])

    def fits(self, have: np.ndarray, all_facts: np.ndarray | None, grad_facts: np.ndarray | None) -> bool:
        if all_facts is None or grad_facts is None or len(have) != len(self.have):
            return False
        # Every parameter with a gradient, now as then: nothing to pick out.
        whole = len(have) == len(all_facts)
        facts = all_facts if whole else all_facts[have]
        return ((whole or np.array_equal(have, self.have)) and np.array_equal(facts, self.param_facts)
                and np.array_equal(grad_facts.T[1:], self.kinds))


def _found(optimizer: torch.optim.Optimizer, rule: Rule,
           lists: list[list[torch.Tensor]]) -> tuple[_Found, tuple[list, np.ndarray | None, np.ndarray | None]]:
    """(what was found for the parameters of ``lists`` (the groups' params
    lists): found again where they hold the same parameters, else found
    anew, each parameter found before keeping what was read of its state;
    their gradients and facts, ``tensor_facts.of_step``). A group whose
    flags change which state it needs has its parameters' state checked
    again."""
    found = optimizer.__dict__.get("_gpuflat_found")
    facts = None if found is None or tuple(map(len, lists)) != found.sizes \
        else tensor_facts.of_step(lists, found.everything)
    if found is None or facts is None:
        found = _relist(optimizer, rule, found, lists)
        facts = tensor_facts.of_step(lists, found.everything)
        assert facts is not None  # the lists hold what was just found in them
    needs = tuple((needed(rule, g), (keep_of(g), g.get("rounding_seed", 0))) for g in optimizer.param_groups)
    if needs != found.needs_key:
        keeps_before = [keep for _, keep in found.needs_key]
        found.needs_key = needs
        found.needs = np.array([need for need, _ in needs], bool).reshape(-1, len(_STATE_FIELDS))
        _derive(found)
        if keeps_before and keeps_before != [keep for _, keep in needs]:
            # A group's keep or seed changed: its parameters' words name
            # another state, their precision words another keep or key.
            changed = [g for g, (keep, (_, now)) in enumerate(zip(keeps_before, needs)) if keep != now]
            _reread(optimizer, rule, found, np.flatnonzero(np.isin(found.group_of, changed)),
                    _Names(found, np.arange(len(found.everything))).of_all)
    return found, facts


def _relist(optimizer: torch.optim.Optimizer, rule: Rule, kept: _Found | None,
            lists: list[list[torch.Tensor]]) -> _Found:
    everything = [p for ps in lists for p in ps]
    group_of = np.repeat(np.arange(len(lists)), [len(ps) for ps in lists]).astype(np.int64)
    n, width = len(everything), len(_STATE_FIELDS)
    found = _Found(tuple(map(len, lists)), everything, group_of, np.zeros((0, width), bool), (), None, -1,
                   np.zeros((n, width), np.int64), np.zeros((n, 1 + 2 * len(_tensor_names(rule))), np.int64),
                   plain(everything), np.full((n, 2), -1, np.int64), np.zeros((n, width), bool),
                   np.array([takes_keep(_local(p), "master") for p in everything], bool), np.zeros(n, np.int64))
    if kept is not None:
        before = {id(p): k for k, p in enumerate(kept.everything)}
        at = np.array([before.get(id(p), -1) for p in everything], np.int64)
        # What was read of a parameter holds where it keeps its place (its
        # group, its index there): its stochastic rounding key is of that
        # place. One moved is read again, as a new one.
        old = np.flatnonzero(at >= 0)
        old = old[(kept.group_of[at[old]] == group_of[old])
                  & (_places(kept.group_of)[at[old]] == _places(group_of)[old])]
        for name in ("words", "seen", "checked", "present", "precision"):
            getattr(found, name)[old] = getattr(kept, name)[at[old]]
        found.state, found.edits = kept.state, kept.edits
    optimizer.__dict__["_gpuflat_found"] = found  # where _found and forget look for it
    _holders.add(optimizer)
    return found


def _places(group_of: np.ndarray) -> np.ndarray:
    """Each parameter's index in its group, from the groups in order."""
    return np.arange(len(group_of)) - np.searchsorted(group_of, group_of)


def _follow_state(optimizer: torch.optim.Optimizer, rule: Rule, found: _Found, of_all: Callable[[int], str]) -> None:
    """Check again the state of the parameters whose state words changed
    since they were read; nothing to read where the state is watched and
    no edit was made since."""
    state = optimizer.state
    if state is found.state and found.edits == _EDITS[0]:
        return
    keys, words = tensor_facts.state_words(state, _tensor_names(rule))
    index = {id(p): k for k, p in enumerate(found.everything)}
    at = np.fromiter((index.get(id(key), -1) for key in keys), np.int64, len(keys))
    seen = np.zeros_like(found.seen)
    known = at >= 0
    seen[at[known]] = words[known]
    changed = np.flatnonzero((seen != found.seen).any(axis=1))
    found.seen, found.state = seen, state
    if len(changed):
        _reread(optimizer, rule, found, changed, of_all)
    found.edits = _EDITS[0] if _watched(state) else -1


def _tensor_names(rule: Rule) -> tuple:
    """Every name of a rule's state, whatever the groups keep: the words a step watches."""
    return tuple(n for n in state_names(rule) if n is not None) + tuple(KEPT_STATE.values())


def _reread(optimizer: torch.optim.Optimizer, rule: Rule, found: _Found, ks: ArrayLike, of_all: Callable[[int], str]) -> None:
    """Check the state of the parameters at ``ks`` (positions in
    ``found.everything``) and keep its addresses: each tensor alike its
    parameter, one of another real floating dtype (the parameter's changed,
    as by ``model.double()``) replaced by its value in the parameter's
    dtype, a step count made the kind PyTorch's fused optimizers keep (0-d
    float32 on the parameter's device)."""
    state, groups = optimizer.state, optimizer.param_groups
    ks = np.asarray(ks, np.int64)
    for k in ks.tolist():
        g = int(found.group_of[k])
        p, group = found.everything[k], groups[g]
        local_p = _local(p)
        keep, _ = needs_of(rule, local_p, group)
        names = state_names(rule, keep)
        s = state.get(p) if isinstance(state, dict) else None
        words, present = np.zeros(len(names), np.int64), np.zeros(len(names), bool)
        codes = np.full(len(names), -1, np.int64)
        for w, name in enumerate(names):
            t = None if name is None or not isinstance(s, dict) else s.get(name)
            if t is None:
                continue
            local = _local(_conformed(s, name, t, local_p, expected_dtype(rule, name, local_p, group),
                                      lambda: of_all(k)))
            facts = _facts([local])
            words[w] = _nonzero(_starts([local], facts, lambda j: of_all(k), "state"), [local])[0]
            present[w], codes[w] = True, tensor_facts.dtype_codes(facts)[0]
        found.words[k], found.present[k] = words, present
        param_facts = _facts([local_p])
        found.narrow[k] = takes_keep(local_p, "master")
        kept = keep not in KEPT_BESIDE or present[_EXTRA]
        key = stochastic_keys(np.array([group.get("rounding_seed", 0)]), np.array([g]),
                              np.array([k - int(np.searchsorted(found.group_of, g))]))
        found.precision[k] = _precision_words(tensor_facts.dtype_codes(param_facts), codes[:_EXTRA],
                                              np.array([KEEPS.index(keep) if kept else 0]),
                                              key * (keep == "stochastic"))[0]
        found.checked[k] = (local_p.numel(), int(param_facts[0, 2]))
    _, fresh = tensor_facts.state_words({found.everything[k]: state.get(found.everything[k], {})
                                         for k in ks.tolist()}, _tensor_names(rule))
    found.seen[ks] = fresh
    _derive(found, ks)
    if found.edits >= 0 and _watched(state):  # the edits made here are read already
        found.edits = _EDITS[0]


def _precision_words(param_codes: np.ndarray, state_codes: np.ndarray, keeps: np.ndarray,
                     keys: np.ndarray) -> np.ndarray:
    """Each row's precision word (``gpuflat._src.layout.precision_word``):
    from its parameter's and its states' dtypes by tensor_facts code
    (``state_codes``: one column per state word, -1 where absent), each
    state's tag set where its dtype is not the parameter's, ``keeps`` (a
    number of ``KEEPS`` per row) and ``keys`` (stochastic rounding's)."""
    words = (np.asarray(keeps, np.int64) << KEEP_SHIFT) | (np.asarray(keys, np.int64) << KEY_SHIFT)
    for k, codes in enumerate(np.asarray(state_codes, np.int64).reshape(len(words), -1).T):
        other = (codes >= 0) & (codes != param_codes)
        words |= np.where(other, _TAG_OF_CODE[codes] + 1, 0) << (PRECISION_TAG_BITS * k)
    return words


def _conformed(s: Any, name: str, t: Any, p: torch.Tensor, dtype: torch.dtype,
               parameter: Callable[[], str]) -> torch.Tensor:
    """``s[name]`` (``t``) as the step reads it for parameter ``p`` (local),
    of ``dtype`` (``expected_dtype``)."""
    if name == "step":
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.dim() != 0 or t.device != p.device:
            t = s[name] = torch.tensor(float(t), dtype=torch.float32, device=p.device)
        return t
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{parameter()}: expected its state {name!r} to be a tensor, got {type(t).__name__}")
    local = _local(t)
    if local.dtype != dtype and local.dtype in STEPPED and p.dtype in STEPPED and \
            (local.numel(), local.device) == (p.numel(), p.device):
        # The parameter's dtype changed under the optimizer (``model.double()``),
        # or the group's choice of the state's: the state follows, as a
        # module's buffers follow the module.
        t = s[name] = t.to(dtype)
        local = _local(t)
    if t is local and local.shape == p.shape and local.stride() != p.stride() and \
            not (local.is_contiguous() and p.is_contiguous()) and \
            (local.numel(), local.dtype, local.device) == (p.numel(), dtype, p.device):
        # The parameter's layout changed under the optimizer (``p.data =`` a
        # transposed copy): its state follows it, element for element, as
        # torch.optim's element-wise updates follow it.
        t = s[name] = torch.empty_like(p, dtype=dtype, memory_format=torch.preserve_format).copy_(local)
        local = t
    if (local.numel(), local.dtype, local.device) != (p.numel(), dtype, p.device) or \
            (not (local.is_contiguous() and p.is_contiguous()) and
             (local.stride() != p.stride() or local.shape != p.shape)):
        raise ValueError(f"{parameter()}: expected its state {name!r} of shape {tuple(p.shape)}, dtype "
                         f"{dtype}, device {p.device} and strides {p.stride()}, got {tuple(local.shape)}, "
                         f"{local.dtype}, {local.device} and strides {local.stride()}")
    return t


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, any other tensor itself."""
    return dtensor.local(t) if dtensor.is_dtensor(t) else t


def forget(optimizer: torch.optim.Optimizer) -> None:
    """Drop what was kept for ``optimizer``: its next step finds everything again."""
    optimizer.__dict__.pop("_gpuflat_found", None)


def _forget_all() -> None:
    for o in list(_holders):
        forget(o)


# The optimizers keeping what was found (on themselves, so it goes with
# them), weakly: gpuflat.cache_clear() makes each find it again.
_holders: weakref.WeakSet = weakref.WeakSet()
caches.register("optimizers' parameters found", lambda: sum("_gpuflat_found" in o.__dict__ for o in list(_holders)),
                _forget_all)


def table_of(rule: Rule, params: list[torch.Tensor], grads: list[torch.Tensor], columns: Sequence[list[torch.Tensor | None]],
              groups: ArrayLike, needs: Sequence[Sequence[bool]], name_of: Callable[[int], str],
              keeps: Sequence[str] = (), keys: np.ndarray | None = None) -> tensor_table.Table:
    """The table of a step given as lists of plain tensors (its update
    rows: the norm is another operator's), checked as
    :func:`read` checks an optimizer's: a compiled step's operator, which
    holds no optimizer to keep what it found on. ``columns``: per name of
    :func:`state_names`, each parameter's tensor or None; ``groups``: each
    parameter's group; ``needs``: per group, per name, whether its steps
    read it (:func:`needed`); ``name_of(i)`` names the i-th parameter;
    ``keeps``: per group, how it keeps its 16-bit parameters (``keep_of``;
    none given: plain); ``keys``: each parameter's stochastic rounding key
    (:func:`stochastic_keys`; None: 0).

    >>> w, g, buf, count = torch.ones(3), torch.ones(3), torch.zeros(3), torch.zeros(())
    >>> sgd = RULES["sgd"]
    >>> table = table_of(sgd, [w], [g], [[buf], [None], [None], [None], [count]], [0],
    ...                   [needed(sgd, {"momentum": 0.9})], str)
    >>> [t.rows[:, ROW_NUMEL].tolist() for t in table.updates]
    [[3]]
    """
    param_facts, grad_facts = _facts(params), _facts(grads)
    _check_dense(rule, params, param_facts, grads, grad_facts, name_of)
    groups = np.asarray(groups, np.int64)
    rows = _param_rows(params, param_facts, grads, grad_facts, groups, name_of)
    mask = np.asarray(needs, bool).reshape(-1, len(_STATE_FIELDS))[groups]
    mask[:, _EXTRA] &= _NARROW_CODES[tensor_facts.dtype_codes(param_facts)]
    codes = np.full((len(params), len(_STATE_FIELDS)), -1, np.int64)
    for w, (field, name, column) in enumerate(zip(_STATE_FIELDS, state_names(rule, "master"), columns)):
        kept = np.flatnonzero([t is not None for t in column])
        if name is None or not len(kept):
            continue
        tensors = cast("list[torch.Tensor]", [column[j] for j in kept])  # kept: those not None
        facts = _facts(tensors)
        if name != "step":
            _check_alike([params[j] for j in kept], param_facts[kept], tensors, facts,
                         lambda i: name_of(kept[i]), "state", any_dtype=True)
            codes[kept, w] = tensor_facts.dtype_codes(facts)
        rows[kept, field] = _nonzero(_starts(tensors, facts, lambda i: name_of(kept[i]), "state"), tensors) * \
            mask[kept, w]
    param_codes = tensor_facts.dtype_codes(param_facts)
    kept = np.array([KEEPS.index(keep) for keep in keeps] or [0], np.int64)[groups if keeps else 0]
    # A buffer beside the parameter where the step reads one; stochastic rounding of bfloat16 ones.
    kept = np.where(np.isin(kept, _BESIDE), kept * (rows[:, _STATE_FIELDS[_EXTRA]] != 0),
                    kept * (param_codes == _BF16_CODE))
    stochastic = kept == KEEPS.index("stochastic")
    rows[:, ROW_PRECISION] = _precision_words(param_codes, codes[:, :_EXTRA], kept,
                                              (np.zeros(len(params), np.int64) if keys is None else keys) * stochastic)
    return tensor_table.of_step(rows, _buckets(param_facts), params)


# ---------------------------------------------------------------- a compiled step's tables

# A compiled step's operator holds no optimizer to keep what it found on
# (read's _Found and _Kept): its tables are kept here, a few (the steps of a
# few optimizers, or of one under a few backends), found again by comparing
# words, as tensor_table's tables are.
LISTS_KEPT = 4
_lists_tables = caches.Recent("compiled steps' tables", LISTS_KEPT)


def of_lists(rule: Rule, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[torch.Tensor],
             steps: list[torch.Tensor], groups: list[int], indices: list[int], hyper: Sequence[dict[str, Any]],
             name_of: Callable[[int], str]) -> tensor_table.Table:
    """The table of a compiled step's update (``gpuflat::update_``) over
    lists of plain tensors: ``states`` holds, state after state in the rows'
    order (:func:`state_names`), the tensors of the parameters whose group
    needs that state (:func:`needs_of`), ``steps`` their step counts
    likewise; parameter j is at ``indices[j]`` of group ``groups[j]``,
    whose options ``hyper[g]`` holds (a dict as ``param_groups`` holds one,
    its keep options and ``rounding_seed`` included); ``name_of(j)`` names
    parameter j in errors.

    Found again where everything that decides it is as at a recent call
    (:class:`_ListsKey`): one native read of the tensors' facts and a
    comparison, with the gradients' addresses patched in where every
    gradient is contiguous (new gradient tensors at every step). Anything
    else is read and checked in full, as :func:`table_of` checks, before
    the update writes anything.

    >>> w, count = torch.ones(3), torch.zeros(())
    >>> sgd, group = RULES["sgd"], {"momentum": 0.9, "rounding_seed": 0}
    >>> tables = [of_lists(sgd, [w], [g], [torch.zeros(3)], [count], [0], [0], [group], str)
    ...           for g in (torch.ones(3), torch.ones(3))]
    >>> [t.updates[0].rows[:, ROW_NUMEL].tolist() for t in tables], caches.sizes()["compiled steps' tables"] > 0
    ([[3], [3]], True)
    """
    tensors = [*params, *grads, *states, *steps]
    facts = tensor_facts.of_tensors(tensors)
    if facts is None:  # a tensor subclass, or one without strided storage: read and checked in full, never kept
        return _lists_built(rule, params, grads, states, steps, groups, indices, hyper, name_of)
    key, starts = _ListsKey.read(rule, tensors, facts, (len(params), len(grads), len(states), len(steps)),
                                 groups, indices, hyper)
    kept = _lists_tables.find(lambda entry: entry.key.same(key))
    if kept is not None:
        return kept.table(params, starts)
    table = _lists_built(rule, params, grads, states, steps, groups, indices, hyper, name_of)
    # Kept only once built: a call that raised keeps nothing, and raises again.
    _lists_tables.add(_KeptLists(key, [(rows.rows, rows.positions, rows.backend) for rows in table.updates]))
    return table


@dataclass(frozen=True, eq=False)
class _ListsKey:
    """Everything that decides the table of :func:`of_lists`' lists: the rule,
    the backend put in place (``tensor_table.serve_with``: the rows' backends
    are resolved as the table is built), the lists' lengths, each group's
    keep, needs (as a parameter that takes the keep and as one that does
    not) and rounding seed, each parameter's group and index, and the
    tensors' facts (address, element count; dtype, contiguity and device in
    one code), with the shape and strides of each tensor that is not
    contiguous (where the facts alone do not place its elements)."""

    head: tuple
    groups: list[int]
    indices: list[int]
    facts: bytes  # the gradients' addresses 0 where they are patched in
    layouts: tuple

    @classmethod
    def read(cls, rule: Rule, tensors: list[torch.Tensor], facts: np.ndarray, counts: tuple[int, int, int, int],
             groups: list[int], indices: list[int],
             hyper: Sequence[dict[str, Any]]) -> tuple[_ListsKey, np.ndarray | None]:
        """(the key of a call's ``tensors`` from their ``facts``, in which the
        gradients' addresses are zeroed in place where the key leaves them
        out; those addresses, else None). A contiguous gradient alike its
        parameter starts at its address wherever it lies; a strided one's
        start and checks depend on its layout, so its address stays in."""
        n_params, n_grads = counts[:2]
        grad_facts = facts[n_params:n_params + n_grads]
        starts = None
        if n_grads == n_params and (grad_facts[:, 2] & tensor_facts.CONTIGUOUS).all():
            starts = grad_facts[:, 0].copy()
            grad_facts[:, 0] = 0
        strided = np.flatnonzero((facts[:, 2] & tensor_facts.CONTIGUOUS) == 0).tolist()
        layouts = tuple((tuple(tensors[j].shape), tensors[j].stride()) for j in strided)
        needs = tuple((keep_of(h), needed(rule, h), needed(rule, h, "plain"), h.get("rounding_seed", 0))
                      for h in hyper)
        head = (rule, tensor_table.served_with(), counts, needs)
        return cls(head, list(groups), list(indices), facts.tobytes(), layouts), starts

    def same(self, other: _ListsKey) -> bool:
        # The cheap parts first; bytes compare with memcmp and stop at the first difference.
        return (self.head == other.head and self.facts == other.facts and self.groups == other.groups
                and self.indices == other.indices and self.layouts == other.layouts)


@dataclass(frozen=True, eq=False)
class _KeptLists:
    """A table of :func:`of_lists` as kept: its key and, per update rows (one
    device and dtype), the rows, their positions among the parameters and
    their backend. No tensor: a kept table must not hold a step's memory, so
    each call places the rows by its own parameters."""

    key: _ListsKey
    updates: list[tuple[np.ndarray, np.ndarray | None, Backend]]

    def table(self, params: list[torch.Tensor], starts: np.ndarray | None) -> tensor_table.Table:
        """The table of a call over ``params`` whose gradients start at ``starts`` (None: as kept)."""
        updates = []
        for rows, positions, backend in self.updates:
            if starts is not None:
                # In a copy: rows handed to an update are never written again (a device may still read them).
                rows = rows.copy()
                rows[:, _ROW_GRAD] = starts if positions is None else starts[positions]
            like = params[0 if positions is None else int(positions[0])]
            updates.append(tensor_table.UpdateRows(rows, like, backend, positions))
        return tensor_table.Table([], updates=updates)


def _lists_built(rule: Rule, params: list[torch.Tensor], grads: list[torch.Tensor], states: list[torch.Tensor],
                 steps: list[torch.Tensor], groups: list[int], indices: list[int], hyper: Sequence[dict[str, Any]],
                 name_of: Callable[[int], str]) -> tensor_table.Table:
    """The table of :func:`of_lists` read in full: each parameter's state
    from its needs, then :func:`table_of`'s rows and checks."""
    needs = [needs_of(rule, p, hyper[g])[1] for p, g in zip(params, groups)]
    kept = iter(states)
    columns = [[next(kept) if need[c] else None for need in needs] for c in range(len(needs[0]) - 1)] if needs else []
    columns.append(_spread(steps, [need[-1] for need in needs]))
    keys = stochastic_keys(np.array([h.get("rounding_seed", 0) for h in hyper])[groups], np.asarray(groups),
                           np.asarray(indices)) if groups else None
    return table_of(rule, params, grads, columns, groups, [needed(rule, h) for h in hyper], name_of,
                    [keep_of(h) for h in hyper], keys)


def _spread(tensors: Sequence[torch.Tensor], kept: Sequence[bool]) -> list[torch.Tensor | None]:
    """``tensors`` placed at the positions where ``kept`` is true, None elsewhere.

    >>> _spread(["a"], [False, True])
    [None, 'a']
    """
    it = iter(tensors)
    return [next(it) if k else None for k in kept]


def _param_rows(params: Sequence[torch.Tensor], param_facts: np.ndarray, grads: Sequence[torch.Tensor], grad_facts: np.ndarray, groups: np.ndarray,
                name_of: Callable[[int], str]) -> np.ndarray:
    """The rows with their parameters', gradients' and groups' words."""
    rows = np.zeros((len(params), PARAM_ROW_WORDS), np.int64)
    rows[:, _ROW_PARAM] = _starts(params, param_facts, name_of, "parameter")
    _check_alike(params, param_facts, grads, grad_facts, name_of, "gradient")
    rows[:, _ROW_GRAD] = _starts(grads, grad_facts, name_of, "gradient")
    rows[:, ROW_NUMEL] = param_facts[:, 1]
    rows[:, ROW_GROUP] = groups
    return rows


def _nonzero(starts: np.ndarray, tensors: Sequence[torch.Tensor]) -> np.ndarray:
    """``starts`` with the word of an empty tensor (address 0: it has no
    memory) made its Python identity: the rows' state words are nonzero
    where a state is kept, and no element of an empty one is read."""
    empty = np.flatnonzero(starts == 0)
    for j in empty.tolist():
        starts[j] = id(tensors[j])
    return starts


def _check_dense(rule: Rule, params: Sequence[torch.Tensor], param_facts: np.ndarray | None, grads: Sequence[torch.Tensor],
                 grad_facts: np.ndarray | None, name_of: Callable[[int], str]) -> None:
    """A sparse or otherwise unstrided gradient (or parameter) named, with what to use instead."""
    if param_facts is not None and grad_facts is not None:
        return
    optimizer = rule.torch_name
    for j, g in enumerate(grads):
        if g.layout != torch.strided:
            raise TypeError(f"{name_of(j)}: its gradient is sparse ({g.layout}); gpuflat.torch.{optimizer} "
                            f"supports dense gradients, as torch.optim.AdamW does; for sparse gradients use "
                            f"torch.optim.SparseAdam")
    raise TypeError(f"{name_of(0)}, or another parameter or gradient: expected strided tensors with storage of "
                    f"their own")


def _facts(tensors: list[torch.Tensor]) -> Any:
    """The tensors' facts (gpuflat._src.tensor_facts), read in Python for a tensor
    subclass the native reader leaves out; None where one is not strided
    (typed Any: :func:`_check_dense` refuses that for parameters and
    gradients, and the other callers index the facts as they are)."""
    facts = tensor_facts.of_tensors(tensors)
    return facts if facts is not None else tensor_facts.in_python(tensors)


def plain(tensors: Iterable[Any]) -> bool:
    """Whether every tensor is of a plain type (no DTensor, no subclass)."""
    return set(map(type, tensors)) <= tensor_facts.PLAIN


def _buckets(facts: np.ndarray) -> list[np.ndarray]:
    """Row positions by device and dtype, in order."""
    keys = (tensor_facts.device_keys(facts) << 16) | tensor_facts.dtype_codes(facts)
    if (keys == keys[0]).all():
        return [np.arange(len(keys))]
    return [np.flatnonzero(keys == k) for k in dict.fromkeys(keys.tolist())]


def _starts(tensors: Sequence[torch.Tensor], facts: np.ndarray, name_of: Callable[[int], str], what: str) -> np.ndarray:
    """Each tensor's lowest element address: its data pointer where it is
    contiguous, else where its one dense block of memory begins. A tensor
    whose memory is not one dense block, or of a dtype the update does not
    take, raises naming its parameter."""
    codes = tensor_facts.dtype_codes(facts)
    if not _STEPPED_CODES[codes].all():
        j = int(np.flatnonzero(~_STEPPED_CODES[codes])[0])
        dtype = tensors[j].dtype
        raise TypeError(f"{name_of(j)}: expected a {_STEPPED_NAMES} {what}, got {dtype}"
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


def _check_alike(params: Sequence[torch.Tensor], param_facts: np.ndarray, tensors: Sequence[torch.Tensor], facts: np.ndarray, name_of: Callable[[int], str],
                 what: str, any_dtype: bool = False) -> None:
    """Each tensor of its parameter's element count, dtype (any the update
    takes, with ``any_dtype``), device and memory layout (shape and strides,
    read where either is not contiguous)."""
    ignored = tensor_facts.CONTIGUOUS - 1 if any_dtype else 0  # the code word's dtype bits
    same = (facts[:, 1] == param_facts[:, 1]) & ((facts[:, 2] | ignored) == (param_facts[:, 2] | ignored))
    strided = np.flatnonzero((param_facts[:, 2] & tensor_facts.CONTIGUOUS) == 0).tolist()
    bad = np.flatnonzero(~same).tolist() + [j for j in strided if tensors[j].stride() != params[j].stride()
                                           or tensors[j].shape != params[j].shape]
    if bad:
        j = min(bad)
        p, t = params[j], tensors[j]
        dtype = "a dtype the update takes" if any_dtype else p.dtype
        raise ValueError(f"{name_of(j)}: expected its {what} of shape {tuple(p.shape)}, dtype {dtype}, "
                         f"device {p.device} and strides {p.stride()}, got {tuple(t.shape)}, {t.dtype}, "
                         f"{t.device} and strides {t.stride()}")


class _Names:
    """The parameters named as the user's param_groups place them (made on error)."""

    def __init__(self, found: _Found, have: np.ndarray) -> None:
        self.found, self.have = found, have

    def of_all(self, k: int) -> str:
        """The k-th parameter of param_groups, counting across groups."""
        g = int(self.found.group_of[k])
        return f"param_groups[{g}]['params'][{int(k) - int(np.searchsorted(self.found.group_of, g))}]"

    def parameter(self, j: int) -> str:
        """The j-th parameter of the step (those with a gradient)."""
        return self.of_all(self.have[int(j)])

    def gradient(self, j: int) -> str:
        """The j-th gradient of the step."""
        return f"{self.parameter(j)}.grad"
