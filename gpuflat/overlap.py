"""Finding distinct leaves that share memory, before an in-place write.

Two arrays can only overlap if they view one common base, so only leaves that
share a base are compared: a tree of separately allocated arrays costs one
attribute read per leaf.
"""
from __future__ import annotations

import numpy as np



def _root(a):
    # Follow every owner, not only array bases: an as_strided view hangs off a
    # DummyArray, an np.frombuffer view off a memoryview of the buffer.
    while True:
        owner = getattr(a, "base", None)
        if owner is None and isinstance(a, memoryview):
            owner = a.obj
        if owner is None:
            return a
        a = owner


def _pointer(a) -> int:
    return a.__array_interface__["data"][0] if isinstance(a, np.ndarray) else a.data.ptr


def _extent(a):
    """[lo, hi) byte range that ``a`` can touch; None for an empty array."""
    if a.size == 0:
        return None
    lo = hi = _pointer(a)
    for n, stride in zip(a.shape, a.strides):
        reach = (n - 1) * stride
        lo, hi = (lo + reach, hi) if reach < 0 else (lo, hi + reach)
    return lo, hi + a.itemsize


def _really_overlap(a, b) -> bool:
    if isinstance(a, np.ndarray):
        return bool(np.shares_memory(a, b))
    return True  # CuPy has no exact test; overlapping byte ranges are refused


def find_overlap(arrays):
    """The first pair (i, j) of distinct arrays that share memory, or None.

    >>> base = np.zeros(10)
    >>> find_overlap([base[:6], base[6:]]), find_overlap([base[:6], base[5:]])
    (None, (0, 1))
    """
    groups: dict[int, list[int]] = {}
    for i, a in enumerate(arrays):
        groups.setdefault(id(_root(a)), []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        spans = sorted((e, i) for i in members if (e := _extent(arrays[i])) is not None)
        # Sweep in address order: only spans starting before the current end can overlap.
        for k, ((_, hi), i) in enumerate(spans):
            for m in range(k + 1, len(spans)):
                (lo2, _), j = spans[m]
                if lo2 >= hi:
                    break
                if _really_overlap(arrays[i], arrays[j]):
                    return min(i, j), max(i, j)
    return None

