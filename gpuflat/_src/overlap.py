"""Finding distinct leaves that share memory, before an in-place write.

Leaves are compared by the byte ranges they can touch, not by their base
objects: each ``torch.Tensor.numpy()`` call (and each DLPack import) gives a
view with a base of its own, so two views of one storage need not share any
base. Ranges are sorted by start and swept once (in NumPy); only ranges that
intersect are tested exactly. Reading a pointer costs about a microsecond, so a tree
whose every leaf owns its memory (separately allocated arrays, which cannot
share bytes) is passed on one flag read per leaf.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt


def _byte_ranges(arrays: Sequence[Any], index: Sequence[int]) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
    """(lo, hi): int64 arrays of the [lo, hi) byte ranges that ``arrays[i]``, i in ``index``, can touch."""
    pointer = _pointer_reader()
    lo = np.array([pointer(arrays[i]) for i in index], np.int64)
    hi = lo + np.array([arrays[i].nbytes for i in index], np.int64)
    for k, i in enumerate(index):
        if not arrays[i].flags.c_contiguous:
            lo[k], hi[k] = _strided_range(arrays[i], int(lo[k]))
    return lo, hi


def _strided_range(a: Any, start: int) -> tuple[int, int]:
    lo = hi = start
    for n, stride in zip(a.shape, a.strides):
        reach = (n - 1) * stride
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + a.itemsize


def _pointer_reader() -> Callable[[Any], int]:
    """A function giving an array's data pointer, as cheaply as its kind allows."""
    torch = sys.modules.get("torch")
    tensor = torch.Tensor if torch is not None else ()

    def pointer(a: Any) -> int:
        if not isinstance(a, np.ndarray):
            return a.data.ptr  # CuPy
        if isinstance(a.base, tensor):
            # Tensor.numpy() views the tensor from its data_ptr() and keeps
            # the tensor as base; data_ptr() costs a fifth of NumPy's pointer
            # read, which builds an __array_interface__ dict on every call.
            return a.base.data_ptr()
        return a.__array_interface__["data"][0]

    return pointer


def _owns_memory(a: Any) -> bool:
    # Arrays without the flag (array kinds that do not report it) are views for this purpose.
    return getattr(a.flags, "owndata", False)


def really_overlap(a: Any, b: Any) -> bool:
    """Whether two arrays whose byte ranges meet share an element: exact on
    the CPU, and True on a GPU, which has no exact test.

    >>> base = np.zeros(4)
    >>> really_overlap(base[::2], base[1::2]), really_overlap(base[:3], base[2:])
    (False, True)
    """
    if isinstance(a, np.ndarray):
        # Exact for any strides, whatever the two arrays' bases (it reads
        # only pointers, shapes and strides).
        return bool(np.shares_memory(a, b))
    return True  # CuPy has no exact test; overlapping byte ranges are refused


def find_overlap(arrays: Sequence[Any]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of distinct arrays that share memory, or None.

    Works on NumPy and CuPy arrays, whatever their base objects: two NumPy
    views of one PyTorch tensor are found too.

    >>> base = np.zeros(10)
    >>> find_overlap([base[:6], base[6:]]), find_overlap([base[:6], base[5:]])
    (None, (0, 1))
    >>> find_overlap([base[::2], base[1::2]]) is None  # interleaved, but no element shared
    True
    """
    if all(map(_owns_memory, arrays)):
        return None
    index = [i for i, a in enumerate(arrays) if a.size]
    if len(index) < 2:
        return None
    lo, hi = _byte_ranges(arrays, index)
    return first_pair(lo, hi, index, lambda i, j: really_overlap(arrays[i], arrays[j]))


def first_pair(lo: npt.NDArray[np.integer[Any]], hi: npt.NDArray[np.integer[Any]],
               index: Sequence[int] | npt.NDArray[np.integer[Any]],
               overlap: Callable[[int, int], bool]) -> tuple[int, int] | None:
    """The first pair (i, j), i < j, of ``index`` whose byte ranges
    [``lo``, ``hi``) meet and for which ``overlap(i, j)`` holds, or None:
    the ranges sorted by start and swept once. The one sweep of every
    overlap check, over arrays or over leaf rows.

    >>> first_pair(np.array([0, 8, 4]), np.array([4, 12, 9]), [0, 1, 2], lambda i, j: True)
    (1, 2)
    """
    order = np.argsort(lo, kind="stable")
    lo, hi, index = lo[order], hi[order], np.asarray(index)[order]
    # In address order, a span can only overlap an earlier one if it starts
    # before the furthest end so far; a tree without overlaps stops here.
    furthest = np.maximum.accumulate(hi)
    for m in np.flatnonzero(lo[1:] < furthest[:-1]) + 1:
        for k in np.flatnonzero(hi[:m] > lo[m]):
            i, j = sorted((int(index[k]), int(index[m])))
            if overlap(i, j):
                return i, j
    return None


def first_sharing(arrays: Sequence[Any], buffer: Any) -> int | None:
    """The index of the first array sharing memory with ``buffer``, or None.

    For a buffer about to be written while ``arrays`` are read (or the other
    way round); ``buffer`` itself among the arrays counts as sharing. One
    sweep for all arrays: an array that owns its memory (``base`` None)
    shares none with another such array, so only views are compared by byte
    range.

    >>> base = np.zeros(10)
    >>> first_sharing([np.ones(3), base[::-1]], base), first_sharing([base[:5]], base[5:])
    (1, None)
    """
    if buffer.base is None:  # it owns its memory: only itself and views can share it
        index = [i for i, a in enumerate(arrays) if a is buffer or a.base is not None]
    else:
        index = list(range(len(arrays)))
    index = [i for i in index if arrays[i] is buffer or arrays[i].size]
    if not index or buffer.size == 0:
        return index[0] if index and arrays[index[0]] is buffer else None
    lo, hi = _byte_ranges(arrays, index)
    (blo,), (bhi,) = _byte_ranges([buffer], [0])
    for k in np.flatnonzero((lo < bhi) & (hi > blo)):
        i = index[k]
        if arrays[i] is buffer or really_overlap(arrays[i], buffer):
            return i
    return None

