"""What a backend is: the whole-tree operations every backend implements, and
the result of a fused norm pass.

The public operations (``gpuflat._src.ops``) check everything, then hand a backend
a frozen plan and arrays already known to fit it; a backend never walks a
tree and never validates. Backends keep their own per-plan caches, keyed
weakly by the plan, so a dropped plan frees them.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np

    from gpuflat._src.flatplan import FlatPlan


@dataclass(frozen=True)
class NormResult:
    """The result of one fused norm pass, all arrays on the backend's device.

    ``total`` is a 0-d float64 array; ``per_leaf`` a float64 array with one
    norm per slot (None where the backend was not asked for it and skipped
    it); ``first_nonfinite`` a 0-d int64 array: the first slot holding a NaN
    or inf, or -1; ``power_sum`` a 0-d float64 array: the raw accumulated
    value the total is the root of, sum |x|**p (for ord 2 the sum of
    squares, exactly as accumulated, not the total squared), or for ord inf
    the max |x| itself (then equal to ``total``, as for ord 1).

    >>> import numpy as np
    >>> r = NormResult(np.asarray(5.0), None, np.asarray(-1), np.asarray(25.0))
    >>> float(r.total), int(r.first_nonfinite), float(r.power_sum)
    (5.0, -1, 25.0)
    """

    total: Any
    per_leaf: Any
    first_nonfinite: Any
    power_sum: Any


class OneSourcePerSlot(Sequence[tuple[Any]]):
    """``sources`` for ``gather`` where every slot has exactly one array:
    item ``s`` is ``(arrays[s],)``, made only when asked for. A backend that
    reads the arrays itself takes ``arrays`` as they are, with no tuple per
    slot.

    >>> import numpy as np
    >>> sources = OneSourcePerSlot([np.ones(2), np.zeros(1)])
    >>> len(sources), [len(s) for s in sources], sources[1]
    (2, [1, 1], (array([0.]),))
    """

    __slots__ = ("arrays",)

    def __init__(self, arrays: Sequence[Any]) -> None:
        self.arrays = arrays

    def __len__(self) -> int:
        return len(self.arrays)

    # A slice is accepted as Sequence declares it, giving one tuple of the sliced arrays.
    def __getitem__(self, s: int | slice) -> tuple[Any]:
        return (self.arrays[s],)

    def __iter__(self) -> Iterator[tuple[Any]]:
        return zip(self.arrays)


class LeafRows:
    """Leaves given by address instead of as arrays: one leaf-table row per
    slot (``words``, int64, shape (slots, LEAF_ROW_WORDS): the address,
    then ``gpuflat._src.layout.leaf_row``: dtype tag, merged dims, byte strides),
    built from tensors' metadata without importing them. The backends whose
    ``reads_rows`` is true take it as ``leaves`` in ``norms`` and
    ``clip_``; the caller keeps the memory alive and has checked every
    row against the plan. ``words`` never changes once built, so a backend
    may key what it derives from it by the object's identity.

    >>> import numpy as np
    >>> LeafRows(np.zeros((2, 29), np.int64)).words.shape
    (2, 29)
    """

    __slots__ = ("words", "__weakref__")

    def __init__(self, words: np.ndarray) -> None:
        self.words = words
        words.flags.writeable = False

    def __len__(self) -> int:
        return len(self.words)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.words[i]


@runtime_checkable
class Backend(Protocol):
    """The operations a backend implements over a plan's slots.

    ``leaves`` holds one array per slot of ``plan`` (its unique trainables in
    plan order); ``sources`` one list of arrays per slot (tied gradients are
    added); ``flat`` is a C-contiguous 1-D array of ``plan.size`` elements of
    ``plan.dtype``. ``flat=`` on ``clip_`` is a buffer the leaves are fixed
    views of, when the caller knows one (a resident model's), so a backend
    may find them from its address alone: the same results, found faster.
    ``clip_`` writes the leaves only, never the rest of ``flat``.

    ``reads_rows`` says whether ``norms`` and ``clip_`` also take
    :class:`LeafRows` as ``leaves`` (leaves given by address, read in native
    code or on the device); a backend whose ``reads_rows`` is false is
    given arrays.

    >>> from gpuflat._src.backends import get_backend
    >>> isinstance(get_backend("numpy"), Backend), get_backend("numpy").reads_rows
    (True, False)
    """

    name: str
    reads_rows: bool

    @property
    def xp(self) -> Any:
        """The array module of this backend's memory (NumPy or CuPy)."""

    def gather(self, plan: FlatPlan, sources: Sequence[Sequence[Any]], out: Any) -> None:
        """out[slot] = sum of the slot's sources, cast to ``plan.dtype``."""

    def scatter(self, plan: FlatPlan, flat: Any, leaves: Sequence[Any]) -> None:
        """leaves[slot][...] = flat[slot's range], cast to the leaf's dtype, in place."""

    def norms(self, plan: FlatPlan, leaves: Sequence[Any], ord: float, per_leaf: bool) -> NormResult:
        """Total and per-leaf norms, accumulated in float64 in a fixed order that
        depends on the leaves alone (kernels/norms.cu's, or the NumPy
        backend's own): a leaf filling one dense block of memory in another
        order than C's in memory order (``gpuflat._src.memory_order``), any
        other in logical order. The total is the same with or without
        ``per_leaf``."""

    def clip_(self, plan: FlatPlan, leaves: Sequence[Any], total: Any, max_norm: Any, eps: float,
              flat: Any = None) -> None:
        """Every leaf *= min(1, max_norm / (total + eps)), computed where ``total``
        lives; ``max_norm`` is a float, or for the CUDA backend a 0-d float64
        device array it reads there."""

    def to_host(self, x: Any) -> np.ndarray:
        """``x`` as a NumPy array (one synchronisation on a device)."""

    def empty(self, shape: int | tuple[int, ...], dtype: Any) -> Any:
        """An uninitialised array of this backend's memory (inside ``on_device``)."""

    def zeros(self, shape: int | tuple[int, ...], dtype: Any) -> Any:
        """A zeroed array of this backend's memory (a fill, no upload)."""

    def copy(self, x: Any) -> Any:
        """A C-contiguous copy of ``x`` in this backend's memory."""

    def sum(self, x: Any) -> Any:
        """The sum of ``x``'s elements, a 0-d array where ``x`` lives (no host read)."""

    def on_device(self) -> AbstractContextManager[Any]:
        """A context in which new arrays land on this backend's device (and
        array-module calls run there): callers allocate inside it."""

    def step_(self, rule: str, plan: FlatPlan, params: Any, grads: Any, states: Sequence[Any], slot_group: Any,
              hyper: Any, steps: Any, total: Any, max_norm: float, eps: float, amp: Any) -> None:
        """One optimizer update of a resident buffer, in place: ``rule`` is
        "adamw" (``states``: exp_avg, exp_avg_sq, and max_exp_avg_sq where
        some group sets amsgrad) or "sgd" (momentum_buffer).

        ``params``, ``grads`` and ``states`` are 1-D buffers of one real
        floating dtype laid out as ``plan``'s slots; ``slot_group[slot]`` is
        the slot's row of ``hyper`` (gpuflat._src.layout.HYPER float64 per
        parameter group, flags included: see ``Rule.hyper_row``), -1 for
        padding, which is never written; ``steps[slot]`` its step count,
        already incremented (SGD's: its buffer's updates, 1 for a new
        buffer). With ``total``
        (the gradients' norm, on the device) the gradients are first scaled
        by min(1, max_norm / (total + eps)), never written back. ``amp`` holds
        two float64: every gradient is also multiplied by ``amp[0]`` (a loss
        scaler's 1 / scale), and a nonzero ``amp[1]`` skips the update."""

    def step_rows(self, rule: str, tag: int, rows: np.ndarray, hyper: np.ndarray, lr_at: np.ndarray, total: Any,
                  max_norm: float, eps: float, amp: Any, stats: Any = None) -> None:
        """One optimizer update of parameters where they are (PyTorch's, one
        table row each), in place: ``rows`` is a host int64 array of
        gpuflat._src.layout.PARAM_ROW_FIELDS per parameter, the parameter and
        its gradient of dtype tag ``tag``, every tensor dense and laid out
        alike, addressed at its lowest element; ``hyper`` the groups' rows
        (host float64) and ``lr_at`` where a tensor ``lr`` is read instead
        (host int64, address and dtype tag per group). A row's precision
        word (``layout.precision_word``) gives each state's dtype (0: the
        parameter's; a plain row's word is 0) and how the parameter is kept
        (``layout.KEEPS``): updated in place, through the float32 master copy
        at the row's ``extra`` address, or with the compensation buffer of
        the parameter's dtype there. A table with any nonzero word is
        updated element by element (the rule's mixed kernel), to the bits of
        the NumPy backend's ``_kept_update``. ``total``, ``max_norm``,
        ``eps`` and ``amp`` as for :meth:`step_`. Each row's float32 step
        count is read as the count before this step and then incremented,
        unless ``amp[1]`` skips, where
        its group's steps count (``Rule.counted_when``: SGD's only with
        momentum, a count of 0 marking a new buffer). A row lacking a word
        its group needs, or a kept row its ``extra`` address, is refused
        (``Rule.check_rows``) before any write.

        ``stats``: None, or a C-contiguous float64 array of shape
        (len(rows), 2) in this backend's memory (a device array for the
        CUDA backend, host memory for the others), whose row j the step
        overwrites with the update statistics of row j: (sum of d**2, sum
        of w**2) over its elements, where w is the value the rule produced
        in the compute type (float for 16- and 32-bit parameters, double for
        float64), before it is rounded into storage, and d = w - held, held
        the value its arithmetic started from (the parameter; its float32
        master copy for a "master" row; parameter + compensation for a
        "kahan" row). They come from the update pass itself (no other read,
        no host wait); a skipped step (``amp[1]``) and an empty row write
        zeros. Each backend adds them in a fixed order of its own (the same
        bits on every call; the backends agree to about 1e-6 relative), and
        the parameters and states get the bits of a step without them."""
