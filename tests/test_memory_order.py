"""gpuflat.memory_order: which leaves are read as their dense block of memory, and how."""
from __future__ import annotations

import numpy as np
import pytest

from gpuflat.memory_order import dense_start, in_memory_order


def _buffer(n, dtype=np.float32):
    return np.arange(n, dtype=dtype)


def _dense_layouts():
    """(name, a view of a fresh buffer holding all of it in another order than C's)."""
    return [
        ("transposed", _buffer(12).reshape(3, 4).T),
        ("channels_last", _buffer(2 * 3 * 4 * 5).reshape(2, 4, 5, 3).transpose(0, 3, 1, 2)),
        ("reversed", _buffer(7)[::-1]),
        ("reversed_2d", _buffer(12).reshape(3, 4)[::-1, ::-1]),
        ("reversed_inner", _buffer(12).reshape(3, 4)[:, ::-1]),
        ("permuted_3d", _buffer(24).reshape(2, 3, 4).transpose(1, 2, 0)),
        ("permuted_reversed", _buffer(24).reshape(2, 3, 4).transpose(2, 0, 1)[::-1, :, ::-1]),
        ("size_one_dims", _buffer(6).reshape(2, 1, 3).transpose(2, 1, 0)[:, :, :, None]),
        ("fortran", _buffer(30).reshape(6, 5).T),  # F-contiguous
    ]


@pytest.mark.parametrize("name,a", _dense_layouts(), ids=[n for n, _ in _dense_layouts()])
def test_a_dense_permuted_array_is_its_memory_lowest_address_first(name, a):
    got = in_memory_order(a)
    assert got.ndim == 1 and got.flags.c_contiguous and np.shares_memory(got, a)
    # The buffer is arange: memory order is increasing values, every one once.
    np.testing.assert_array_equal(got, np.sort(a, axis=None))
    lowest = min(a.__array_interface__["data"][0] + sum((n - 1) * s for n, s in zip(a.shape, a.strides) if s < 0),
                 a.__array_interface__["data"][0])
    assert got.__array_interface__["data"][0] == lowest
    assert dense_start(a.shape, a.strides, a.itemsize) == lowest - a.__array_interface__["data"][0]


@pytest.mark.parametrize("a", [
    _buffer(12).reshape(3, 4),  # C-contiguous: already in memory order
    _buffer(12)[::2],  # a step: holes
    _buffer(12).reshape(3, 4)[:, :3],  # a slice: holes
    np.broadcast_to(_buffer(4), (3, 4)),  # overlapping
    np.lib.stride_tricks.as_strided(_buffer(8), (3, 4), (8, 4)),  # overlapping rows
    np.float32(2.0) * np.ones(()),  # 0-d
    np.zeros((0, 3), np.float32).T,  # empty
], ids=["c", "step", "slice", "broadcast", "overlap", "0-d", "empty"])
def test_any_other_array_is_returned_unchanged(a):
    assert in_memory_order(a) is a


@pytest.mark.parametrize("shape,strides,want", [
    ((2, 3), (24, 8), 0),
    ((2, 3), (8, 16), 0),
    ((2, 3), (-24, 8), -24),
    ((3,), (-8,), -16),
    ((2, 1, 3), (8, 1000, -16), -32),
    ((2, 3), (16, 8), None),  # holes
    ((2, 2), (8, 8), None),  # overlap
    ((4,), (0,), None),  # broadcast
    ((2, 0), (8, 8), None),  # no elements
], ids=str)
def test_dense_start(shape, strides, want):
    assert dense_start(shape, strides, 8) == want


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
def test_a_subclass_comes_back_as_a_plain_1d_view():
    m = np.asmatrix(np.arange(6.0).reshape(2, 3)).T
    got = in_memory_order(m)
    assert type(got) is np.ndarray and got.shape == (6,)
    np.testing.assert_array_equal(got, np.arange(6.0))
