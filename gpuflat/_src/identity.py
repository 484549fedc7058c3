"""Recognising the very same arrays again, without keeping them alive.

A training loop hands gpuflat the same arrays step after step; whatever was
worked out from them (their in-place fitness, a device table of their
addresses) holds as long as the same objects come back unchanged. A weak
reference makes sure a dead array never matches and nothing is kept alive;
what an array's identity does not pin (its shape, dtype and strides, which
NumPy lets a caller set in place) is read again and compared.
"""
from __future__ import annotations

import operator
import weakref
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

_deref = weakref.ref.__call__


# Fact arrays up to this many words are compared as bytes (two copies, one
# memcmp: 0.3 against np.array_equal's 1.3 µs at 900 words); longer ones
# element by element, where the copies would cost more (18 against 13 µs
# at 60,000 words).
BYTES_COMPARED_UP_TO = 8192


def equal_facts(now: npt.NDArray[np.int64], recorded: npt.NDArray[np.int64]) -> bool:
    """Whether two 1-D int64 arrays of native facts are equal, as cheaply as
    their length allows.

    >>> equal_facts(np.arange(3), np.arange(3)), equal_facts(np.arange(3), np.arange(4))
    (True, False)
    """
    if len(now) <= BYTES_COMPARED_UP_TO:
        return now.tobytes() == recorded.tobytes()
    return np.array_equal(now, recorded)


class SameArrays:
    """Weak references to a list of arrays, to tell whether exactly these
    objects, in this order, come again.

    >>> import numpy as np
    >>> a, b = np.ones(2), np.ones(3)
    >>> seen = SameArrays([a, b])
    >>> seen.holds([a, b]), seen.holds([b, a]), seen.holds([a, b.copy()])
    (True, False, False)
    """

    __slots__ = ("_refs",)

    _refs: list[weakref.ref[Any]] | None

    def __init__(self, arrays: Iterable[Any]) -> None:
        try:
            self._refs = list(map(weakref.ref, arrays))
        except TypeError:  # an array type without weak references never matches
            self._refs = None

    def holds(self, arrays: Sequence[Any]) -> bool:
        refs = self._refs
        return (refs is not None and len(refs) == len(arrays)
                and all(map(operator.is_, map(_deref, refs), arrays)))

    def shared_start(self, arrays: Sequence[Any]) -> int:
        """How many arrays at the start of ``arrays`` are the ones held (all
        the held ones or all of ``arrays``, whichever is shorter; else 0).

        >>> import numpy as np
        >>> a, b, c = np.ones(1), np.ones(1), np.ones(1)
        >>> held = SameArrays([a, b])
        >>> held.shared_start([a, b, c]), held.shared_start([a]), held.shared_start([b, a])
        (2, 1, 0)
        """
        refs = self._refs
        if refs is None or not all(map(operator.is_, map(_deref, refs), arrays)):
            return 0
        return min(len(refs), len(arrays))


class Recorded(list):
    """Arrays that a recorded tree (``gpuflat._src.seen``) found unchanged in this
    call, all of one kind (NumPy's or CuPy's ndarray, never a subclass).
    ``token`` names exactly these arrays, at the addresses and with the
    dtypes, shapes, flags and strides they had when first read (the strides
    of dims longer than 1 at least, the only ones that address memory: see
    :func:`device_array_facts`), for the life of the process (a token is
    never given twice); a backend may keep what it read from them under it
    and skip reading them again.

    It lives here, beneath both the recorded trees that make it and the
    backends that read it: a token is an identity of arrays, recognised again.

    >>> import numpy as np
    >>> arrays = Recorded([np.ones(2)])
    >>> arrays.token = 7
    >>> len(arrays), arrays.token
    (1, 7)
    """

    __slots__ = ("token",)

    token: int


class Layout:
    """What NumPy lets a caller change in place about a list of arrays,
    besides their shapes and dtypes: their flags (writable, contiguous)
    and, for those neither C- nor F-contiguous, their strides. A contiguous
    array's strides follow from its shape and dtype (where they matter), so
    any ``a.strides = ...`` that moves its elements also clears its
    contiguity. The flags are kept as numbers, never as NumPy flags objects
    (which would keep their arrays alive); arrays of a kind without them
    (CuPy) are compared by strides alone.

    >>> import numpy as np
    >>> a, b = np.ones(4), np.ones((4, 4))[:, 0]
    >>> layout = Layout([a, b])
    >>> layout.holds([a, b]), layout.holds([b, a])
    (True, False)
    >>> a.flags.writeable = False
    >>> layout.holds([a, b])
    False
    """

    __slots__ = ("_flags", "_strided")

    _flags: npt.NDArray[np.int64] | None
    _strided: list[tuple[int, tuple[int, ...]]]

    def __init__(self, arrays: Sequence[Any]) -> None:
        self._flags = flag_bits(arrays)
        if self._flags is None:
            self._strided = [(i, a.strides) for i, a in enumerate(arrays)]
        else:
            self._strided = [(i, arrays[i].strides) for i in np.flatnonzero((self._flags & CONTIGUOUS) == 0).tolist()]

    def holds(self, arrays: Sequence[Any]) -> bool:
        """Whether ``arrays`` (the same objects, of the same shapes and dtypes) still have this layout."""
        flags = flag_bits(arrays)
        if flags is None or self._flags is None:
            same_flags = flags is None and self._flags is None
        else:
            same_flags = np.array_equal(flags, self._flags)
        return same_flags and all(arrays[i].strides == strides for i, strides in self._strided)


_shape = attrgetter("shape")


def device_array_facts(arrays: Sequence[Any]) -> list[tuple[int, ...]]:
    """What a live CuPy array can change of itself: its shape, read in one
    ``map`` (a C loop over the arrays' own attribute, with no Python of
    gpuflat's per array). The rest is fixed for the array's life: ``data``
    (so its address and device) and ``dtype`` are read-only attributes of
    ``cupy.ndarray``
    (https://github.com/cupy/cupy/blob/main/cupy/_core/core.pxd), and its
    strides have no setter: only ``a.shape = ...`` changes them, as a
    reshape without a copy (``_ndarray_shape_setter`` in
    cupy/_core/_routines_manipulation.pyx), which keeps every element at
    its address, in C order. So the same shape again means every element at
    the same address: the same strides in every dim longer than 1. The
    others address nothing, and what gpuflat reads of strides skips them
    (``layout.leaf_row``, ``checks.may_overlap_itself``, the overlap
    ranges), as CuPy's contiguity flags do. The same living arrays with
    equal shapes are the same arrays, unchanged. CuPy arrays have no flags
    a caller can set: writable always.

    >>> from types import SimpleNamespace
    >>> a = SimpleNamespace(shape=(2,))
    >>> facts = device_array_facts([a])
    >>> facts
    [(2,)]
    >>> a.shape = (1, 2)
    >>> facts == device_array_facts([a])
    False
    """
    return list(map(_shape, arrays))


_flags_num = attrgetter("flags.num")
CONTIGUOUS = 0x1 | 0x2  # NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_F_CONTIGUOUS: elements in distinct memory


def flag_bits(arrays: Sequence[Any]) -> npt.NDArray[np.int64] | None:
    """The NumPy flags of ``arrays`` as an int64 array, read in one C loop;
    None for arrays without them (CuPy's).

    >>> import numpy as np
    >>> bits = flag_bits([np.ones(3), np.ones((3, 3))[:, 0]])
    >>> (bits & CONTIGUOUS) != 0
    array([ True, False])
    """
    try:
        return np.fromiter(map(_flags_num, arrays), np.int64, len(arrays))
    except AttributeError:
        return None
