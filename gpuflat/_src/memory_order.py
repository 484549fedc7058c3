"""Reading a leaf in memory order: the order norms and clips read a leaf in.

A leaf whose elements fill one dense block of memory in some permutation of
its dims (a transposed matrix, a channels_last gradient, a reversed or
permuted array: its strides, size-1 dims aside and signs dropped, are a
C-contiguous layout's in another order) is read as the contiguous run of
that block, lowest address first. Every backend then reads it at full
bandwidth through its contiguous path, and a norm sums it in memory order,
as PyTorch's own reductions do. Any other strided leaf (a slice with a step,
a broadcast view) is read in its logical (C) order. Gather, scatter and
flatten always use the logical order: it is what a flat buffer means.
"""
from __future__ import annotations

from typing import Collection

import numpy as np


def dense_start(shape: Collection[int], strides: Collection[int], itemsize: int) -> int | None:
    """The byte offset from an array's address to the lowest address of its
    elements, when they fill one dense block of memory (``strides`` in bytes,
    sorted by magnitude with size-1 dims dropped, are a C-contiguous layout's);
    None when they do not, or there are none.

    >>> dense_start((2, 3), (8, 16), 8), dense_start((4,), (-4,), 4), dense_start((4,), (8,), 4)
    (0, -12, None)
    """
    if 0 in shape:
        return None
    start, expected = 0, itemsize
    for step, n, stride in sorted((abs(s), n, s) for n, s in zip(shape, strides) if n != 1):
        if step != expected:
            return None
        expected *= n
        if stride < 0:
            start += (n - 1) * stride
    return start


def in_memory_order(a: np.ndarray) -> np.ndarray:
    """``a`` as the 1-D view of its memory, lowest address first, when its
    elements fill one dense block in another order than C's (see
    :func:`dense_start`); ``a`` itself otherwise (C-contiguous, 0-d, empty,
    or not dense).

    >>> a = np.arange(6.0).reshape(2, 3)
    >>> in_memory_order(a.T), in_memory_order(a[::-1])
    (array([0., 1., 2., 3., 4., 5.]), array([0., 1., 2., 3., 4., 5.]))
    >>> in_memory_order(a[:, ::2]).shape, in_memory_order(a) is a
    ((2, 2), True)
    """
    if a.ndim == 0 or a.flags.c_contiguous or dense_start(a.shape, a.strides, a.itemsize) is None:
        return a
    a = np.asarray(a)  # an ndarray subclass (np.matrix) would stay 2-D under reshape
    flips = tuple(slice(None, None, -1) if s < 0 else slice(None) for s in a.strides)
    outer_first = sorted(range(a.ndim), key=lambda d: -abs(a.strides[d]))
    return a[flips].transpose(outer_first).reshape(-1)  # C-contiguous now: a view
