"""Every fact the kernels and the native host libraries share with Python.

The CUDA kernels (``kernels/*.cu``, ``*.cuh``) and the host libraries
(``kernels/host/*.cpp``) read tables that Python writes: the dtype tags of
their rows, the words of a leaf row and of a work item, the hyperparameter
row of an optimizer, the numbers of the norm kinds and optimizer rules, the
block sizes whose trees fix a sum's bits. Each of those facts is written
here once. The C++ reads some from the header this module writes
(:func:`rules_header`) and spells the others out again (it cannot import
Python); tests/test_layout.py reads every such constant back from the
sources and fails when one drifts from this module.

>>> LEAF_ROW_WORDS, ITEM_WORDS, HYPER
(29, 4, 7)
>>> leaf_row((2, 3), (24, 8), "float64")[:3]
[3, 0, 6]
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from . import caches

@dataclass(frozen=True)
class DType:
    """A dtype of the kernel tables: one record of what Python knows of it;
    its C++ (the type named ``c_name``, its conversions and traits) is in
    ``kernels/gpuflat_common.cuh``.

    ``tag`` marks it in the leaf tables (``GF_TAG_<c_name>``; the kernels'
    gf_dispatch and the host libraries switch on it through the written
    header's ``GF_DTYPES``); ``name`` is NumPy's and PyTorch's name of it.
    ``optim``: the optimizers take it (``OPTIM_DTYPES``). ``module``: where
    NumPy lacks it, the package whose attribute ``name`` is its scalar type,
    imported when it is first needed (``gpuflat._src.dtypes``); such a dtype
    crosses DLPack as the bits of an integer of its size
    (``gpuflat._src.arrays``). ``wider``: the dtype its sums across ranks
    are computed in (``gpuflat._src.ranks``), which a dtype from ``module``
    also promotes as (NumPy knows no promotion for it); None where it is
    summed in itself.

    >>> DTYPES[1].c_name, DTYPES[1].module, DTYPES[1].wider
    ('bf16', 'ml_dtypes', 'float32')
    """

    tag: int
    name: str
    c_name: str
    itemsize: int
    optim: bool = False
    module: str | None = None
    wider: str | None = None


# The dtypes of the kernel tables, in tag order; gpuflat._src.dtypes maps
# NumPy's dtypes onto these rows.
DTYPES = (
    # float16 sums overflow past 65504 and round at every addition in 16
    # bits; float32 holds float16's range many times over, and gives
    # bfloat16 (whose range it shares) 16 more bits.
    DType(0, "float16", "f16", 2, optim=True, wider="float32"),
    DType(1, "bfloat16", "bf16", 2, optim=True, module="ml_dtypes", wider="float32"),
    DType(2, "float32", "float", 4, optim=True),
    DType(3, "float64", "double", 8, optim=True),
    # Complex parameters are refused by the optimizers.
    DType(4, "complex64", "c64", 8),
    DType(5, "complex128", "c128", 16),
)
TAG_OF_NAME = {row.name: row.tag for row in DTYPES}
C_NAMES = tuple(row.c_name for row in DTYPES)
ITEMSIZES = tuple(row.itemsize for row in DTYPES)

# Elements per work item. A multiple of 32 lanes * 8 elements per 16-byte
# vector, so every item of a leaf starts as aligned as the leaf itself. The
# norm partials are per item, so this constant is part of the summation order.
ITEM = 4096
# A work item's int64 words: slot, start, length, flat offset (struct Item).
ITEM_WORDS = 4
# Dimensions a strided leaf may keep after merging what its strides allow.
MAX_DIMS = 8
# A leaf table row's int64 words (struct LeafRef): address, tag, ndim, size,
# then shape, byte strides and division magic numbers of MAX_DIMS each, then
# the packed shifts. leaf_row gives all but the address.
LEAF_ROW_WORDS = 5 + 3 * MAX_DIMS
# Lanes of a warp: the kernels' unit of work per item.
WARP = 32
# Threads per block of the grid-stride kernels, and the blocks per SM their
# __launch_bounds__ ask for (256 * 4 threads at 64 registers fill an SM).
BLOCK_THREADS = 256
MIN_BLOCKS_PER_SM = 4
# Blocks per SM the AMSGrad row update asks for (GF_AMSGRAD_MIN_BLOCKS_PER_SM
# in kernels/gpuflat_optim.cuh): its fifth tensor needs more registers.
AMSGRAD_MIN_BLOCKS_PER_SM = 3
# Threads of the single block that finishes a norm: its reduction tree, and
# so the bits of the result, depend on it.
FINISH_THREADS = 256
# A slot with more work items than this is summed by the whole finishing
# block; smaller ones by one thread, in item order.
SMALL_SLOT_ITEMS = 16
# A slot with more items than this is summed by the whole finishing block, in
# the same tree that one warp plays for the other large slots.
BLOCK_SLOT_ITEMS = 4096

# The clip's default eps, PyTorch's clip_grad_norm_'s: the factor is
# min(1, max_norm / (norm + CLIP_EPS)). The kernels take it by value.
CLIP_EPS = 1e-6

# Doubles per parameter group in the hyperparameter table (GF_HYPER in
# kernels/gpuflat_optim.cuh): a rule's row holds its ``Rule.hyper`` fields,
# then zeros up to HYPER. Every rule's learning rate is field 0 and its
# maximize flag field MAXIMIZE_FIELD (GF_HYPER_MAXIMIZE), so the code they
# share reads them in one place.
HYPER = 7
MAXIMIZE_FIELD = 5
# A tensor-list step's row (struct ParamRow in kernels/gpuflat_optim.cuh):
# the addresses of the parameter, its gradient, its state tensors in the
# rule's order (``Rule.state_names``, then its ``flag_states`` kept where
# their group's flag is set; 0 where the parameter keeps none) and of its
# address of what ``KEEPS`` says it keeps beside the parameter (0 for
# none), of its float32 step count (0 where it keeps none: see
# ``Rule.counted_when``), its element count, its group (the row of the
# hyperparameter table) and its precision word (``precision_word``; 0: every
# tensor of the parameter's dtype, the parameter updated in place).
PARAM_ROW_FIELDS = ("param", "grad", "state0", "state1", "state2", "extra", "step", "numel", "group", "precision")
PARAM_ROW_WORDS = len(PARAM_ROW_FIELDS)
ROW_STEP, ROW_NUMEL, ROW_GROUP, ROW_EXTRA, ROW_PRECISION = (
    PARAM_ROW_FIELDS.index(f) for f in ("step", "numel", "group", "extra", "precision"))
# How a row keeps its parameter, by number (GF_KEEP_<NAME>):
# - "plain": the update reads the parameter and writes it, rounded once;
# - "master": ``extra`` is a float32 copy of a 16-bit parameter, which the
#   update reads and writes; the parameter gets its value rounded once;
# - "kahan": ``extra`` is a compensation buffer of the parameter's dtype.
#   The update reads parameter + compensation in the compute type, writes
#   the parameter rounded, and the compensation as what that rounding lost,
#   rounded (Kahan's compensated sum, https://doi.org/10.1145/363707.363723);
# - "stochastic": a bfloat16 parameter updated in place, rounded up or down
#   at random with the probabilities of its distances to the two
#   (``stochastic_bits``: a counter-based draw keyed by the row's key, its
#   step count and the element), so that its expected value is the update's.
KEEPS = ("plain", "master", "kahan", "stochastic")
# The keeps with a buffer at ``extra``.
KEPT_BESIDE = ("master", "kahan")
# A precision word's bits: PRECISION_TAG_BITS per state (state0 lowest)
# holding its dtype tag + 1 (0: the parameter's dtype), then KEEP_BITS of
# the keep, then from KEY_SHIFT the row's key for stochastic rounding (below
# 2**31, so that the word is never negative).
PRECISION_TAG_BITS = 4
KEEP_SHIFT = PRECISION_TAG_BITS * 3
KEEP_BITS = 4
KEY_SHIFT = 32
# The C++ names of the buffer dtypes the optimizer kernels are instantiated
# for (the rows with ``optim``).
OPTIM_DTYPES = tuple(row.c_name for row in DTYPES if row.optim)


def precision_word(state_dtypes: Sequence[str | None] = (), keep: str = "plain", key: int = 0) -> int:
    """A row's precision word: the dtype name of each state in the row's
    order (None: the parameter's), how it keeps its parameter (``KEEPS``)
    and its key for stochastic rounding (below 2**31).

    >>> precision_word(), precision_word(["float32", None, "float32"], "master")
    (0, 4867)
    >>> precision_of(4867), precision_of(precision_word(keep="stochastic", key=5))
    ((('float32', None, 'float32'), 'master', 0), ((None, None, None), 'stochastic', 5))
    """
    assert 0 <= key < 1 << 31, "a key keeps the word non-negative"
    word = KEEPS.index(keep) << KEEP_SHIFT | key << KEY_SHIFT
    for k, name in enumerate(state_dtypes):
        word |= 0 if name is None else (TAG_OF_NAME[name] + 1) << (PRECISION_TAG_BITS * k)
    return word


def _check_precision_words(rows: np.ndarray) -> None:
    """Raise ValueError, naming the first such row, where a precision word
    names a state dtype the optimizers do not take or a keep past ``KEEPS``.

    >>> _check_precision_words(np.array([[0] * (PARAM_ROW_WORDS - 1) + [precision_word(["complex64"])]]))
    Traceback (most recent call last):
    ...
    ValueError: parameter row 0: expected a precision word of optimizer dtypes and a keep of KEEPS, found 5
    """
    words = rows[:, ROW_PRECISION]
    taken = np.array([True] + [row.optim for row in DTYPES] + [False] * (16 - 1 - len(DTYPES)))
    mask = (1 << PRECISION_TAG_BITS) - 1
    bad = (words < 0) | (keep_numbers(words) >= len(KEEPS)) | \
        ((words >> (KEEP_SHIFT + KEEP_BITS)) & ((1 << (KEY_SHIFT - KEEP_SHIFT - KEEP_BITS)) - 1) != 0)
    for k in range(3):
        bad |= ~taken[(words >> (PRECISION_TAG_BITS * k)) & mask]
    if bad.any():
        j = int(np.flatnonzero(bad)[0])
        raise ValueError(f"parameter row {j}: expected a precision word of optimizer dtypes and a keep of KEEPS, "
                         f"found {words[j]}")


def precision_of(word: int) -> tuple[tuple[str | None, ...], str, int]:
    """The state dtype names (None: the parameter's), the keep and the key
    of a precision word: ``precision_word`` read back."""
    mask = (1 << PRECISION_TAG_BITS) - 1
    tags = [(word >> (PRECISION_TAG_BITS * k)) & mask for k in range(3)]
    keep = KEEPS[(word >> KEEP_SHIFT) & ((1 << KEEP_BITS) - 1)]
    return tuple(None if t == 0 else DTYPES[t - 1].name for t in tags), keep, word >> KEY_SHIFT


def keep_numbers(words: np.ndarray) -> np.ndarray:
    """The keep (a number of ``KEEPS``) of each precision word.

    >>> keep_numbers(np.array([precision_word(keep="kahan", key=3)])).tolist()
    [2]
    """
    return (words >> KEEP_SHIFT) & ((1 << KEEP_BITS) - 1)


# splitmix64's constants (Steele, Lea and Flood, "Fast splittable
# pseudorandom number generators", https://doi.org/10.1145/2714064.2660195).
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def stochastic_bits(key: int, step: int, i: np.ndarray) -> np.ndarray:
    """The 16 random bits that stochastic rounding adds below a bfloat16
    (gf_stochastic_bits): splitmix64's output function of (key, step) and
    the element's index ``i``, so that a draw is a function of the row's
    key, its step count and the element, the same on every backend and in
    every replay of a captured step at the same count.

    >>> stochastic_bits(1, 1, np.arange(3)).tolist()
    [38255, 55011, 14248]
    """
    with np.errstate(over="ignore"):
        z = np.uint64((key << 32) | (step & 0xFFFFFFFF)) ^ (np.asarray(i, np.uint64) * np.uint64(_GOLDEN))
        z = z + np.uint64(_GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        z = z ^ (z >> np.uint64(31))
    return (z & np.uint64(0xFFFF)).astype(np.uint32)


@dataclass(frozen=True)
class Check:
    """One of a rule's checks of a parameter group's options, PyTorch's where
    it has the optimizer: what is expected (for the message), whether a
    group's options meet it, and what the message shows of them.

    >>> RULES["adamw"].checks[1].accept({"eps": -1.0})
    False
    """

    expected: str
    accept: Callable[[dict], bool]
    shown: Callable[[dict], Any]


def _at_least_zero(name: str) -> Check:
    return Check(f"{name} >= 0", lambda g: float(g[name]) >= 0.0, lambda g: g[name])


def _betas_in_unit() -> Check:
    return Check("betas in [0, 1)", lambda g: len(g["betas"]) == 2 and all(0.0 <= float(b) < 1.0 for b in g["betas"]),
                 lambda g: g["betas"])


@dataclass(frozen=True)
class Rule:
    """An optimizer rule: one record of everything the kernels, the host
    library, the NumPy backend and the front ends know of it.

    ``number`` is the kernels' and host library's rule argument; ``hyper``
    the fields of its hyperparameter row, in order (at most HYPER of them;
    ``lr`` first, ``maximize`` at MAXIMIZE_FIELD, None for a field it leaves
    0). ``state_names`` is the state it keeps per parameter, in the
    kernels' order (a parameter row's ``state0``, ``state1``), and
    ``flag_states`` the (group flag, state name) pairs of the state kept
    only where the group sets that flag, in the row's words that follow
    (AdamW's ``max_exp_avg_sq``, ``state2``, with ``amsgrad``).

    Every rule keeps a float32 step count per parameter (a row's ``step``
    word), read before the update and then incremented on the device unless
    the step is skipped. ``counted_when`` names the hyperparameter that must
    be nonzero for a step to count, or is None where every step counts:
    AdamW's ``step`` counts its updates, as PyTorch's does; SGD's counts the
    updates of its ``momentum_buffer`` (steps with ``momentum`` nonzero), so
    a count of 0 tells the update that the buffer is new (it is made at 0
    with the buffer, and a step word of 0 marks a parameter with none).
    PyTorch's SGD keeps no ``step``; ``torch.optim.SGD.load_state_dict``
    keeps one it finds, unread.

    ``kernel`` is the C++ struct of its one element's arithmetic (the rule
    protocol in ``kernels/gpuflat_optim.cuh``), defined in ``header``: the
    generic kernels (``kernels/optim.cu``) and the host library's generic
    loops take it. Every rule's rows whose precision word is not 0 go
    through it (``mixed_rows_kernel``). ``tuned`` rules (AdamW, SGD) have
    kernels of their own for flat buffers and for plain rows. ``follows``
    pairs a flag's state with the state whose dtype it takes
    (``dtype_option``). ``numpy`` is the same arithmetic in NumPy: the
    NumPy backend's update, and in float64 the reference. ``checks`` are
    its options' checks beyond ``lr`` and ``weight_decay``, which every
    rule has.

    >>> sgd = RULES["sgd"]
    >>> sgd.number, sgd.state_names, sgd.counted_when, sgd.counted_field
    (1, ('momentum_buffer',), 'momentum', 2)
    >>> RULES["adamw"].flag_states, RULES["adamw"].counted_field
    ((('amsgrad', 'max_exp_avg_sq'),), -1)
    """

    name: str
    number: int
    hyper: tuple
    state_names: tuple
    flag_states: tuple = ()
    counted_when: str | None = None
    torch_name: str = ""
    numpy: Callable | None = None
    checks: tuple = ()
    kernel: str = ""
    tuned: bool = False
    follows: tuple = ()
    header: str = "gpuflat_optim.cuh"

    def rows_kernel(self, c_name: str, flag: str | None = None, stats: bool = False) -> str:
        """Name expression of the update over a table of PyTorch's parameters
        (one ParamRow each) of C++ type ``c_name``; with ``flag`` (one of the
        ``flag_states``), the instantiation for a step in which some group
        sets it, which reads that flag's state; with ``stats``, the
        instantiation that also writes each work item's update statistics
        (its sums of d**2 and w**2, kernels/optim.cu's gf_lane_stats) to one
        more argument, two float64 per item.

        >>> RULES["sgd"].rows_kernel("bf16"), RULES["adamw"].rows_kernel("f16", "amsgrad")
        ('gpuflat_sgd_rows<bf16>', 'gpuflat_adamw_amsgrad_rows<f16>')
        >>> RULES["adamw"].rows_kernel("f16", "amsgrad", stats=True), RULES["lion"].rows_kernel("float", stats=True)
        ('gpuflat_adamw_amsgrad_rows_stats<f16>', 'gpuflat_rule_rows_stats<gf_lion, float>')
        """
        suffix = "_stats" if stats else ""
        if not self.tuned:
            return f"gpuflat_rule_rows{suffix}<{self.kernel}, {c_name}>"
        return f"gpuflat_{self.name}{'_' + flag if flag else ''}_rows{suffix}<{c_name}>"

    def mixed_rows_kernel(self, c_name: str, stats: bool = False) -> str:
        """Name expression of the update over a table of rows of parameters
        of C++ type ``c_name`` whose precision words are not all 0: each
        state of its own dtype, the parameter kept as ``KEEPS`` says;
        ``stats`` as for :meth:`rows_kernel`.

        >>> RULES["adamw"].mixed_rows_kernel("bf16"), RULES["sgd"].mixed_rows_kernel("f16", stats=True)
        ('gpuflat_rule_mixed_rows<gf_adamw, bf16>', 'gpuflat_rule_mixed_rows_stats<gf_sgd, f16>')
        """
        return f"gpuflat_rule_mixed_rows{'_stats' if stats else ''}<{self.kernel}, {c_name}>"

    def dtype_option(self, name: str) -> str | None:
        """The parameter group's option choosing the dtype of state ``name``
        (``<state>_dtype``; a flag's state takes the dtype of the state it
        ``follows``), None for a name that is not its state.

        >>> RULES["adamw"].dtype_option("max_exp_avg_sq"), RULES["sgd"].dtype_option("step")
        ('exp_avg_sq_dtype', None)
        """
        name = dict(self.follows).get(name, name)
        return f"{name}_dtype" if name in self.state_names else None

    def flat_kernel(self, c_name: str) -> str:
        """Name expression of the update over a flat buffer of C++ type ``c_name``.

        >>> RULES["adamw"].flat_kernel("float")
        'gpuflat_adamw<float>'
        """
        if not self.tuned:
            return f"gpuflat_rule<{self.kernel}, {c_name}>"
        return f"gpuflat_{self.name}<{c_name}>"

    def kernel_names(self) -> list[str]:
        """Every instantiation of this rule's updates the backends may launch:
        the row updates with and without the update statistics.

        >>> len(RULES["adamw"].kernel_names()) == 7 * len(OPTIM_DTYPES)
        True
        """
        flags = (None,) if not self.tuned else (None, *(f for f, _ in self.flag_states))
        return ([self.flat_kernel(d) for d in OPTIM_DTYPES]
                + [self.rows_kernel(d, flag, stats) for stats in (False, True) for flag in flags
                   for d in OPTIM_DTYPES]
                + [self.mixed_rows_kernel(d, stats) for stats in (False, True) for d in OPTIM_DTYPES])

    @property
    def flat_states(self) -> int:
        """The state buffers its flat-buffer kernel takes: the generic one
        takes GENERIC_STATES, the others their states and flag states."""
        return GENERIC_STATES if not self.tuned else len(self.state_names) + len(self.flag_states)

    @functools.cached_property
    def counted_field(self) -> int:
        """The index of ``counted_when`` in ``hyper``, -1 for None: the
        kernels' and host library's argument to the step-counting pass."""
        return -1 if self.counted_when is None else self.hyper.index(self.counted_when)

    def hyper_row(self, group: dict) -> tuple:
        """A parameter group's row of the hyperparameter table (HYPER
        floats): ``hyper``'s fields in order, then zeros. A tensor ``lr`` is
        read as its value where it lies on the host, else as 0 (the kernels
        read the tensor itself on their device); a flag the group lacks is
        False, as PyTorch's optimizers default it when loading an older
        state dict.

        >>> RULES["adamw"].hyper_row({"lr": 0.1, "weight_decay": 0.01, "betas": (0.9, 0.99), "eps": 1e-8})
        (0.1, 0.01, 0.9, 0.99, 1e-08, 0.0, 0.0)
        >>> RULES["sgd"].hyper_row({"lr": 0.1, "weight_decay": 0.0, "momentum": 0.9, "dampening": 0.0,
        ...                         "nesterov": False, "maximize": True})
        (0.1, 0.0, 0.9, 0.0, 0.0, 1.0, 0.0)
        """
        named = {**dict.fromkeys(FLAGS, False), None: 0.0, **group}
        if "betas" in group:
            named["beta1"], named["beta2"] = group["betas"]
        lr = group["lr"]
        named["lr"] = float(lr) if not hasattr(lr, "device") or lr.device.type == "cpu" else 0.0
        row = tuple(float(named[field]) for field in self.hyper)
        return row + (0.0,) * (HYPER - len(row))

    def hyper_rows(self, groups: Sequence[dict]) -> np.ndarray:
        """Every group's ``hyper_row``, as one float64 table (HYPER per group).

        >>> RULES["sgd"].hyper_rows([{"lr": 0.5, "weight_decay": 0.0, "momentum": 0.9, "dampening": 0.0,
        ...                           "nesterov": False}]).tolist()
        [0.5, 0.0, 0.9, 0.0, 0.0, 0.0, 0.0]
        """
        return np.array([self.hyper_row(group) for group in groups], np.float64).reshape(-1)

    def flag_set(self, hyper: Sequence[float] | np.ndarray) -> str | None:
        """The flag of ``flag_states`` that some group of ``hyper`` (the
        host hyperparameter table) sets, else None: the row update to
        launch (``Rule.rows_kernel``).

        >>> RULES["adamw"].flag_set([0.1, 0, 0.9, 0.99, 1e-8, 0, 1]), RULES["sgd"].flag_set([0.1] + [0] * 6)
        ('amsgrad', None)
        """
        table = np.asarray(hyper, np.float64).reshape(-1, HYPER)
        return next((flag for flag, _ in self.flag_states if table[:, self.hyper.index(flag)].any()), None)

    def checked_flag(self, rows: np.ndarray, hyper: Sequence[float] | np.ndarray) -> str | None:
        """``check_rows``, then ``flag_set``: what a backend needs to know of
        a new table before it launches.

        >>> RULES["adamw"].checked_flag(np.zeros((0, PARAM_ROW_WORDS), np.int64), [0.1, 0, 0.9, 0.99, 1e-8, 0, 1])
        'amsgrad'
        """
        self.check_rows(rows, hyper)
        return self.flag_set(hyper)

    def check_rows(self, rows: np.ndarray, hyper: Sequence[float] | np.ndarray) -> None:
        """Raise ValueError, naming the first such row, where a row lacks
        (has 0 for) a word its update reads: its state and step count where
        its group's steps count (``counted_when``: SGD's buffer and count
        only with momentum), and each of ``flag_states`` where its group
        sets the flag.

        >>> RULES["sgd"].check_rows(np.array([[8, 8, 0, 0, 0, 0, 0, 2, 0, 0]]), [0.1, 0, 0.9, 0, 0, 0, 0])
        Traceback (most recent call last):
        ...
        ValueError: parameter row 0 (group 0): expected the address of its momentum_buffer, found 0
        """
        rows, table = np.asarray(rows, np.int64), np.asarray(hyper, np.float64).reshape(-1, HYPER)
        counted = None if self.counted_when is None else self.counted_field
        # (what, its word, the field whose nonzero value needs it, None: always).
        needs = [(name, PARAM_ROW_FIELDS.index(f"state{k}"), counted) for k, name in enumerate(self.state_names)]
        needs.append(("step count", ROW_STEP, counted))
        needs += [(name, PARAM_ROW_FIELDS.index(f"state{len(self.state_names) + k}"), self.hyper.index(flag))
                  for k, (flag, name) in enumerate(self.flag_states)]
        needs = [need for need in needs if need[2] is None or table[:, need[2]].any()]
        absent = rows[:, [word for _, word, _ in needs]] == 0
        precision = rows[:, ROW_PRECISION]
        if precision.any():
            _check_precision_words(rows)
        beside = np.isin(keep_numbers(precision), [KEEPS.index(keep) for keep in KEPT_BESIDE])
        kept_beside = beside & (rows[:, ROW_EXTRA] == 0)
        if kept_beside.any():
            bad = np.flatnonzero(kept_beside)[0]
            raise ValueError(f"parameter row {bad} (group {rows[bad, ROW_GROUP]}): expected the address of its "
                             f"{KEEPS[keep_numbers(precision)[bad]]} buffer, found 0")
        if not absent.any():  # the common case, in one pass
            return
        group = rows[:, ROW_GROUP]
        for (name, _, field), missing in zip(needs, absent.T):
            if field is not None and missing.any():
                missing = missing & (table[group, field] != 0)
            bad = np.flatnonzero(missing)
            if len(bad):
                raise ValueError(f"parameter row {bad[0]} (group {group[bad[0]]}): expected the address of its "
                                 f"{name}, found 0")


# ---------------------------------------------------------------- the rules' arithmetic in NumPy
# Each function updates one slot or row in the compute type C (float32 for
# 16- and 32-bit parameters, float64 for 64-bit ones), with the operations
# and roundings of its .cuh (--fmad=false there: no operation fused), so the
# NumPy backend gives the kernels' bits: (p, g, states, h, step, factor, C),
# ``states`` in a row's order (None where not kept), ``h`` the group's
# hyperparameter row, ``step`` the count after this step, ``factor`` the clip
# and unscale factor.


def powi(base: float, n: float) -> float:
    """base**n for a whole n >= 0 by repeated squaring, as the kernels compute it (gf_powi).

    >>> powi(0.9, 3) == 0.9 * (0.9 * 0.9)
    True
    >>> powi(0.5, 10)
    0.0009765625
    """
    r, k = 1.0, int(n)
    while k > 0:
        if k & 1:
            r *= base
        base *= base
        k >>= 1
    return r


def group_factor(h: Sequence[float], factor: float) -> float:
    """gf_group_factor: the clip and unscale factor, negated where the group maximizes.

    >>> group_factor([0.1, 0, 0, 0, 0, 1.0, 0], 0.5)
    -0.5
    """
    return -factor if h[MAXIMIZE_FIELD] != 0.0 else factor


def lerp(a: Any, b: Any, w: Any) -> Any:
    """torch.lerp's two forms, switched at weight 0.5 (gf_adamw_setup).

    >>> float(lerp(np.float32(1.0), np.float32(3.0), np.float32(0.25)))
    1.5
    """
    return a + w * (b - a) if -0.5 < w < 0.5 else b - (b - a) * (type(w)(1) - w)


def store(target: np.ndarray, values: Any) -> None:
    """``values`` rounded once into ``target``'s dtype, in place (gf_store)."""
    np.copyto(target, values, casting="unsafe")


def _adamw(p: np.ndarray, g: np.ndarray, states: Sequence[Any], h: Sequence[float], step: float, factor: float,
           C: type[np.floating]) -> None:
    """PyTorch's AdamW (gf_adamw_range): ``states`` are exp_avg, exp_avg_sq
    and max_exp_avg_sq (read only with amsgrad)."""
    m, v, vmax = (list(states) + [None])[:3]
    lr, wd, b1, b2, eps, _, amsgrad = h
    bc1, bc2 = 1.0 - powi(b1, step), 1.0 - powi(b2, step)
    gc = g.astype(C) * C(group_factor(h, factor))
    pc = p.astype(C) * C(1.0 - lr * wd)
    mc = lerp(m.astype(C), gc, C(1.0 - b1))
    vc = v.astype(C) * C(b2) + C(1.0 - b2) * gc * gc
    if amsgrad != 0.0:
        wc = vmax.astype(C)
        wc = np.where((wc > vc) | np.isnan(wc), wc, vc)  # torch.maximum: NaN from either side
        store(vmax, wc)
    else:
        wc = vc
    denom = np.sqrt(wc) / C(math.sqrt(bc2)) + C(eps)
    store(p, pc + C(-(lr / bc1)) * (mc / denom))
    store(m, mc)
    store(v, vc)


def _sgd(p: np.ndarray, g: np.ndarray, states: Sequence[Any], h: Sequence[float], step: float, factor: float,
         C: type[np.floating]) -> None:
    """PyTorch's SGD (gf_sgd_range); ``step`` counts the momentum buffer's
    updates with this one (1: it is new)."""
    lr, wd, momentum, dampening, nesterov = h[:5]
    pc = p.astype(C)
    d = g.astype(C) * C(group_factor(h, factor))
    if wd != 0.0:
        d = d + C(wd) * pc
    if momentum != 0.0:
        buf = states[0]
        b = d if step <= 1.0 else buf.astype(C) * C(momentum) + C(1.0 - dampening) * d
        store(buf, b)
        d = d + C(momentum) * b if nesterov != 0.0 else b
    store(p, pc + C(-lr) * d)


def _lion(p: np.ndarray, g: np.ndarray, states: Sequence[Any], h: Sequence[float], step: float, factor: float,
          C: type[np.floating]) -> None:
    """Lion (kernels/gpuflat_lion.cuh): u = sign(beta1 * m + (1 - beta1) * g),
    p = p * (1 - lr * weight_decay) - lr * u, m = beta2 * m + (1 - beta2) * g;
    ``states`` is exp_avg. np.sign is torch.sign: 0 at 0, NaN at NaN."""
    lr, wd, b1, b2 = h[:4]
    m = states[0]
    gc = g.astype(C) * C(group_factor(h, factor))
    mc = m.astype(C)
    u = np.sign(mc * C(b1) + C(1.0 - b1) * gc)
    store(p, p.astype(C) * C(1.0 - lr * wd) + C(-lr) * u)
    store(m, mc * C(b2) + C(1.0 - b2) * gc)


# The group flags the kernels read, each False where a group lacks it.
FLAGS = ("maximize", "amsgrad")
# The state buffers the generic kernels take (gpuflat_rule in kernels/optim.cu):
# a generic rule keeps at most this many state tensors.
GENERIC_STATES = 3
# The optimizer rules by name.
RULES = {rule.name: rule for rule in (
    Rule("adamw", number=0, hyper=("lr", "weight_decay", "beta1", "beta2", "eps", "maximize", "amsgrad"),
         state_names=("exp_avg", "exp_avg_sq"), flag_states=(("amsgrad", "max_exp_avg_sq"),),
         torch_name="AdamW", numpy=_adamw, checks=(_betas_in_unit(), _at_least_zero("eps")), kernel="gf_adamw",
         tuned=True, follows=(("max_exp_avg_sq", "exp_avg_sq"),)),
    Rule("sgd", number=1, hyper=("lr", "weight_decay", "momentum", "dampening", "nesterov", "maximize"),
         state_names=("momentum_buffer",), counted_when="momentum", torch_name="SGD", numpy=_sgd,
         checks=(_at_least_zero("momentum"),
                 Check("nesterov only with momentum > 0 and dampening 0",
                       lambda g: not g["nesterov"] or (float(g["momentum"]) > 0.0 and float(g["dampening"]) == 0.0),
                       lambda g: (float(g["momentum"]), float(g["dampening"])))), kernel="gf_sgd", tuned=True),
    Rule("lion", number=2, hyper=("lr", "weight_decay", "beta1", "beta2", None, "maximize"),
         state_names=("exp_avg",), torch_name="Lion", numpy=_lion, checks=(_betas_in_unit(),),
         kernel="gf_lion", header="gpuflat_lion.cuh"),
)}


# ---------------------------------------------------------------- the norm kinds


def _magnitudes(values: np.ndarray, p: float) -> np.ndarray:
    """|x| (a real chunk's in place). A complex magnitude is np.abs (a
    hypot): finite wherever |z| is, and inf when one part is inf even if the
    other is NaN, as C99 cabs defines."""
    return np.abs(values) if values.dtype.kind == "c" else np.abs(values, out=values)


def _squares(values: np.ndarray, p: float) -> np.ndarray:
    """|x|**2 (a real chunk's in place). A complex one is re**2 + im**2,
    which rounds once where |z|**2 rounds twice; it is only wrong (NaN) for
    an infinite part beside a NaN one, whose |z|**2 is inf."""
    if values.dtype.kind != "c":
        return np.square(values, out=values)
    squares = np.square(values.real)
    squares += np.square(values.imag)
    if np.isnan(squares).any():
        squares[np.isinf(values)] = math.inf
    return squares


def _powers(values: np.ndarray, p: float) -> np.ndarray:
    """|x|**p."""
    magnitudes = _magnitudes(values, p)
    return np.power(magnitudes, p, out=magnitudes)


def _no_root(x: Any, p: float, xp: Any = np) -> Any:
    return x


def _sqrt(x: Any, p: float, xp: Any = np) -> Any:
    # IEEE's square root, correctly rounded: math.sqrt's, np.sqrt's and C's bits alike.
    return xp.sqrt(x)


def _numpy_pth_root(x: Any, p: float) -> Any:
    # np.power, not **: a float root past float64 is inf, where Python raises OverflowError.
    return np.power(x, 1.0 / p)


def _c_pth_root(x: Any, p: float, xp: Any) -> Any:
    # A NumPy scalar's ** is C's pow, the kernels' (np.power has a vector
    # pow of its own, with other bits); a CuPy array's is CUDA's.
    return x ** (1.0 / p)


@dataclass(frozen=True)
class NormKind:
    """A norm kind: one record of what Python knows of it; its C++ (term,
    combine, root and traits) is ``gf_norm<number>`` in
    ``kernels/gpuflat_math.cuh``.

    ``number`` is the norm kernels' template argument and the host library's
    kind (``GF_NORM_<NAME>`` in the written header); ``orders`` the orders p
    it computes, () for the kind of every order no other kind takes. The
    rest is its arithmetic in NumPy, the NumPy backend's (and, in float64,
    the reference): ``terms`` gives each element's term of a float64 or
    complex128 chunk (in place where it can), ``combine`` is the ufunc that
    combines two terms or partials and ``fold`` the array method (NumPy's
    and CuPy's) that combines all of an array's, the ranks' partials too;
    ``root`` takes the norm of a combined value, NumPy's way, and
    ``kernel_root`` the kernels' way (gf_root: C's sqrt and pow) on a NumPy
    or CuPy scalar of array module ``xp``, as ``gpuflat._src.ranks`` roots
    the ranks' total. ``sum_of_squares`` marks terms that are squares,
    summed: a real chunk's partial is then a dot product.

    >>> l2 = NORMS["l2"]
    >>> l2.number, float(l2.root(9.0, 2.0)), l2.fold, float(l2.combine.reduce(l2.terms(np.array([3.0, 4.0]), 2.0)))
    (1, 3.0, 'sum', 25.0)
    >>> NORMS["inf"].fold, NORMS["p"].orders
    ('max', ())
    """

    name: str
    number: int
    orders: tuple[float, ...]
    terms: Callable[[np.ndarray, float], np.ndarray]
    combine: np.ufunc
    fold: str
    root: Callable[[Any, float], Any]
    kernel_root: Callable[[Any, float, Any], Any]
    sum_of_squares: bool = False


# The norm kinds by name.
NORMS = {kind.name: kind for kind in (
    NormKind("l1", 0, (1.0,), _magnitudes, np.add, "sum", _no_root, _no_root),
    NormKind("l2", 1, (2.0,), _squares, np.add, "sum", _sqrt, _sqrt, sum_of_squares=True),
    # np.maximum, not max(): a NaN wins.
    NormKind("inf", 2, (math.inf,), _magnitudes, np.maximum, "max", _no_root, _no_root),
    NormKind("p", 3, (), _powers, np.add, "sum", _numpy_pth_root, _c_pth_root),
)}
# Each kind's number, by name.
NORM_KINDS = {name: kind.number for name, kind in NORMS.items()}
_KIND_OF_ORDER = {order: kind.name for kind in NORMS.values() for order in kind.orders}
_OTHER_ORDERS = next(kind.name for kind in NORMS.values() if not kind.orders)


# The orders some kind computes, as an error states them, and the test of one.
ORDERS_TAKEN = "1, 2, inf or a number p > 0"


def takes_order(p: float) -> bool:
    """Whether some norm kind computes the ``p``-norm (NaN: none).

    >>> takes_order(0.5), takes_order(0.0), takes_order(float("nan"))
    (True, False, False)
    """
    return p > 0


@caches.function(maxsize=64)  # a pure function of the order, asked at every norm
def norm_kind(p: float) -> str:
    """The name of the kind of ``NORMS`` that computes the ``p``-norm (a checked order).

    >>> norm_kind(1.0), norm_kind(2.0), norm_kind(float("inf")), norm_kind(3.0)
    ('l1', 'l2', 'inf', 'p')
    """
    return _KIND_OF_ORDER.get(p, _OTHER_ORDERS)


# The generated headers' names: C++ includes them to read the facts below.
RULES_HEADER = "gpuflat_rules.h"
RULE_INCLUDES = "gpuflat_rule_includes.h"


def _x_macro(name: str, entries: Sequence[str]) -> str:
    return f"#define {name}(X) " + " ".join(f"X({entry})" for entry in entries)


def rules_header() -> str:
    """The C++ header ``gpuflat_rules.h``, written from this module (the
    kernel loader hands it to every build beside the sources; it is never
    on disk): the elements of a work item, each dtype's tag
    (``GF_TAG_<C++ name>``), their count and item sizes in tag order
    (``GF_N_TAGS``, ``GF_ITEMSIZES``), ``GF_DTYPES(X)`` calling
    ``X(tag, C++ type)`` for each dtype and ``GF_OPTIM_DTYPES(X)`` for the
    optimizers' (the switches over tags in the kernels and host libraries
    expand them), each rule's number (``GF_RULE_<NAME>``),
    ``GF_RULES(X)`` calling ``X(number, struct)`` for each rule and
    ``GF_GENERIC_RULES(X)`` for each rule not ``tuned``, which the host
    library's dispatch expands (their headers come from ``rule_includes``);
    the precision word's fields (``GF_PRECISION_TAG_BITS``,
    ``GF_KEEP_<NAME>``, ``GF_KEEP_SHIFT``, ``GF_KEEP_BITS``,
    ``GF_KEY_SHIFT``); and each norm kind's number
    (``GF_NORM_<NAME>``) and ``GF_NORM_KINDS(X)`` calling ``X(number)`` for
    each, which the host library's switch over kinds expands. It includes
    nothing: gpuflat_common.cuh includes it before any other kernel code.

    >>> "#define GF_RULE_SGD 1" in rules_header().splitlines()
    True
    >>> "#define GF_NORM_KINDS(X) X(0) X(1) X(2) X(3)" in rules_header().splitlines()
    True
    >>> "#define GF_OPTIM_DTYPES(X) X(0, f16) X(1, bf16) X(2, float) X(3, double)" in rules_header().splitlines()
    True
    """
    lines = ["// Written by gpuflat._src.layout.rules_header(): the layout's facts the C++ reads.", "#pragma once",
             f"#define GF_ITEM {ITEM}", f"#define GF_GENERIC_STATES {GENERIC_STATES}"]
    lines += [f"#define GF_TAG_{row.c_name} {row.tag}" for row in DTYPES]
    lines += [f"#define GF_N_TAGS {len(DTYPES)}", f"#define GF_ITEMSIZES {', '.join(map(str, ITEMSIZES))}"]
    lines.append(_x_macro("GF_DTYPES", [f"{row.tag}, {row.c_name}" for row in DTYPES]))
    lines.append(_x_macro("GF_OPTIM_DTYPES", [f"{row.tag}, {row.c_name}" for row in DTYPES if row.optim]))
    lines += [f"#define GF_RULE_{rule.name.upper()} {rule.number}" for rule in RULES.values()]
    lines.append(_x_macro("GF_RULES", [f"{rule.number}, {rule.kernel}" for rule in RULES.values()]))
    lines.append(_x_macro("GF_GENERIC_RULES", [f"{rule.number}, {rule.kernel}" for rule in _generic_rules()]))
    lines += [f"#define GF_PRECISION_TAG_BITS {PRECISION_TAG_BITS}", f"#define GF_KEEP_SHIFT {KEEP_SHIFT}",
              f"#define GF_KEEP_BITS {KEEP_BITS}", f"#define GF_KEY_SHIFT {KEY_SHIFT}"]
    lines += [f"#define GF_KEEP_{keep.upper()} {number}" for number, keep in enumerate(KEEPS)]
    lines += [f"#define GF_NORM_{kind.name.upper()} {kind.number}" for kind in NORMS.values()]
    lines.append(_x_macro("GF_NORM_KINDS", [str(kind.number) for kind in NORMS.values()]))
    return "\n".join(lines) + "\n"


def rule_includes() -> str:
    """The C++ header ``gpuflat_rule_includes.h``, written from this module
    as ``rules_header`` is: the headers of the rules' ``kernel`` structs,
    included, for the code that expands ``GF_RULES``. Apart
    from gpuflat_rules.h because a rule's header includes the kernels'
    common code, which includes gpuflat_rules.h first.

    >>> rule_includes().splitlines()[-1]
    '#include "gpuflat_lion.cuh"'
    """
    includes = [f'#include "{header}"' for header in dict.fromkeys(rule.header for rule in RULES.values())]
    return "\n".join(["// Written by gpuflat._src.layout.rule_includes(): the generic rules' headers.", "#pragma once",
                      *includes]) + "\n"


def written_headers() -> dict[str, str]:
    """Name -> text of the headers written from this module.

    >>> sorted(written_headers())
    ['gpuflat_rule_includes.h', 'gpuflat_rules.h']
    """
    return {RULES_HEADER: rules_header(), RULE_INCLUDES: rule_includes()}


def _generic_rules() -> list[Rule]:
    return [rule for rule in RULES.values() if not rule.tuned]


@caches.function(maxsize=4096)
def leaf_row(shape: tuple[int, ...], strides: tuple[int, ...], dtype: Any) -> list[int] | None:
    """The table row of an array but its address (``strides`` in bytes); None
    if it keeps too many dims.

    Size-1 dims are dropped and adjacent dims merged where the strides allow,
    so a transposed matrix keeps 2 dims and any C-contiguous array none
    (ndim 0 marks the contiguous fast path).

    >>> leaf_row((2, 3), (24, 8), np.float64)[:3], leaf_row((2, 3), (8, 16), np.float64)[:5]
    ([3, 0, 6], [3, 2, 6, 2, 3])
    """
    size = int(np.prod(shape, dtype=np.int64))
    dims: list[tuple[int, int]] = []
    if size > 0:
        for n, s in zip(shape, strides):
            if n == 1:
                continue
            if dims and dims[-1][1] == s * n:
                dims[-1] = (dims[-1][0] * n, s)
            else:
                dims.append((n, s))
    dtype = np.dtype(dtype)
    if size == 0 or not dims or (len(dims) == 1 and dims[0][1] == dtype.itemsize):
        dims = []
    if len(dims) > MAX_DIMS:
        return None
    pad = [0] * (MAX_DIMS - len(dims))
    # The outermost dim is never divided by (its index is what remains).
    magic, shifts = zip(*[fast_division(n) if d else (0, 0) for d, (n, _) in enumerate(dims)]) if dims else ((), ())
    return ([TAG_OF_NAME[dtype.name], len(dims), size] + [n for n, _ in dims] + pad
            + [s for _, s in dims] + pad + [m - (1 << 64) if m >= 1 << 63 else m for m in magic] + pad
            + [sum(k << (8 * d) for d, k in enumerate(shifts))])


def work_items(sizes: Sequence[int] | np.ndarray, firsts: Sequence[int] | np.ndarray | int = 0) -> np.ndarray:
    """The work items of slots of ``sizes`` elements, one int64 row of
    ITEM_WORDS each (struct Item: slot, start, length, flat): each slot cut
    into items of ITEM elements and a shorter last one, in order. ``firsts``
    is where each slot's first element lies in the flat buffer: 0 for
    parameter rows, which have none (their update reads start, never flat).
    The host libraries cut them alike (``kernels/host/host_items.h``).

    >>> work_items([3, 0, ITEM + 1], [0, 3, 3]).tolist()
    [[0, 0, 3, 0], [2, 0, 4096, 3], [2, 4096, 1, 4099]]
    """
    sizes = np.asarray(sizes, np.int64)
    counts = -(-sizes // ITEM)
    slot = np.repeat(np.arange(len(sizes), dtype=np.int64), counts)
    first = np.cumsum(counts) - counts
    start = (np.arange(len(slot), dtype=np.int64) - first[slot]) * ITEM
    length = np.minimum(ITEM, sizes[slot] - start)
    flat = np.broadcast_to(np.asarray(firsts, np.int64), sizes.shape)[slot] + start
    return np.stack([slot, start, length, flat], axis=1).astype(np.int64)


def dense_row(size: int, dtype: Any) -> list[int]:
    """``leaf_row`` of a dense 1-D array of ``size`` elements, which keeps no dims.

    >>> dense_row(6, np.float32)[:3]
    [2, 0, 6]
    """
    row = leaf_row((size,), (np.dtype(dtype).itemsize,), dtype)
    assert row is not None  # a dense array keeps no dims
    return row


def fast_division(d: int) -> tuple[int, int]:
    """(magic, shift) with ``i // d == (i * magic >> 64) >> shift`` for every
    0 <= i < 2**63 and 2 <= d < 2**63: the kernels' division by a dim's length.

    Granlund and Montgomery's theorem 4.2 with N = 63 and l = ceil(log2 d)
    (https://gmplib.org/~tege/divcnst-pldi94.pdf): m = floor(2**(63+l) / d) + 1
    has 2**(63+l) < m*d <= 2**(63+l) + 2**l, so floor(i*m / 2**(63+l)) is
    i // d; m < 2**64 fits the kernels' unsigned 64-bit word.

    >>> m, s = fast_division(3)
    >>> [(i * m >> 64) >> s for i in (0, 2, 3, 2**63 - 1)] == [0, 0, 1, (2**63 - 1) // 3]
    True
    """
    if not 2 <= d < 1 << 63:
        raise ValueError(f"d: expected 2 <= d < 2**63, got {d}")
    lg = (d - 1).bit_length()
    return (1 << (63 + lg)) // d + 1, lg - 1
