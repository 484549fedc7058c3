"""Distinct leaves that share memory: read-only operations accept them, in-place ones refuse."""
from __future__ import annotations

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

import gpuflat as gf
from gpuflat._src.overlap import find_overlap

from conftest import exact_norm, rel_err, snapshot


def _pairs():
    base = np.arange(20.0)
    m = np.arange(12.0).reshape(3, 4)
    sq = np.arange(9.0).reshape(3, 3)
    buf = bytearray(80)
    return {
        "a and a.T": (sq, sq.T),
        "overlapping slices": (base[:8], base[5:12]),
        "view of a view": (base[2:10][::2], base[4:6]),
        "row and column": (m[1], m[:, 2]),
        "reversed": (base[::-1][:5], base[15:16]),
        "a and a[:]": (sq, sq[:]),
        "as_strided views": (as_strided(base, (5,), (8,)), as_strided(base[3:], (5,), (8,))),
        "frombuffer views": (np.frombuffer(buf), np.frombuffer(buf, offset=8)[:2]),
        "reshape of a view": (base[:6].reshape(2, 3), base[4:10]),
    }


def _disjoint():
    base = np.arange(20.0)
    m = np.arange(12.0).reshape(3, 4)
    return {
        "adjacent slices": (base[:6], base[6:]),
        "interleaved": (base[::2], base[1::2]),
        "different columns": (m[:, 0], m[:, 1]),
        "separate arrays": (np.ones(3), np.ones(3)),
        "empty slice inside": (base[:10], base[5:5]),
    }


PAIRS = list(_pairs())
DISJOINT = list(_disjoint())


@pytest.mark.parametrize("name", PAIRS)
def test_find_overlap_detects(name):
    x, y = _pairs()[name]
    assert find_overlap([np.ones(2), x, np.zeros(1), y]) == (1, 3)


@pytest.mark.parametrize("name", DISJOINT)
def test_find_overlap_accepts_disjoint(name):
    x, y = _disjoint()[name]
    assert find_overlap([x, y]) is None


@pytest.mark.parametrize("name", PAIRS)
def test_read_only_ops_accept_overlap(name, backend):
    x, y = _pairs()[name]
    tree = {"first": x, "mid": np.ones(2), "second": y}
    assert rel_err(gf.global_norm(tree, backend=backend), exact_norm([x, np.ones(2), y])) < 1e-12
    flat, re = gf.destructure(tree, backend=backend)
    assert flat.tolist() == list(x.reshape(-1)) + [1.0, 1.0] + list(y.reshape(-1))
    assert gf.total("count", tree) == x.size + y.size + 2


@pytest.mark.parametrize("name", PAIRS)
def test_clip_refuses_overlap_naming_both_paths(name, backend):
    x, y = _pairs()[name]
    tree = {"first": x, "mid": np.ones(2), "deep": [{"second": y}]}
    before = snapshot(tree)
    with pytest.raises(gf.OverlapError) as info:
        gf.clip_grad_norm_(tree, 1e-3, backend=backend)
    assert "['first']" in str(info.value) and "['deep'][0]['second']" in str(info.value)
    assert snapshot(tree) == before


@pytest.mark.parametrize("name", PAIRS)
def test_scatter_refuses_overlap_naming_both_paths(name, backend):
    x, y = _pairs()[name]
    tree = {"first": x, "mid": np.ones(2), "deep": [{"second": y}]}
    p = gf.plan(tree)
    before = snapshot(tree)
    with pytest.raises(gf.OverlapError) as info:
        gf.scatter(p, np.full(p.size, 7.0), tree, backend=backend)
    assert "['first']" in str(info.value) and "['deep'][0]['second']" in str(info.value)
    assert snapshot(tree) == before


@pytest.mark.parametrize("name", DISJOINT)
def test_in_place_ops_accept_disjoint_views(name, backend):
    x, y = _disjoint()[name]
    tree = {"x": x, "y": y}
    p = gf.plan(tree)
    gf.scatter(p, np.arange(p.size, dtype=np.float64), tree, backend=backend)
    assert list(x.reshape(-1)) + list(y.reshape(-1)) == list(range(p.size))
    gf.clip_grad_norm_(tree, 1.0, backend=backend)


def test_a_tie_is_not_an_overlap(backend):
    a = np.arange(4.0)
    tree = {"x": a, "z": a}
    gf.clip_grad_norm_(tree, 1.0, backend=backend)
    np.testing.assert_allclose(a, np.arange(4.0) / (np.sqrt(14.0) + 1e-6))


def test_scatter_broken_tie_overlapping_another_leaf_is_refused(backend):
    # The plan has one slot for x and z; the tree given has z as a view overlapping y.
    a = np.zeros(3)
    p = gf.plan({"x": a, "y": np.zeros(3), "z": a})
    base = np.zeros(6)
    tree = {"x": np.zeros(3), "y": base[:3], "z": base[1:4]}
    before = snapshot(tree)
    with pytest.raises(gf.OverlapError, match=r"\['y'\].*\['z'\]"):
        gf.scatter(p, np.arange(6.0), tree, backend=backend)
    assert snapshot(tree) == before


# ---------------------------------------------------------------- views whose bases differ

class _Pointer:
    """An array interface onto memory it does not own: its arrays' base chains end here."""

    def __init__(self, a):
        self.__array_interface__ = dict(a.__array_interface__)


def _foreign_view(a):
    return np.asarray(_Pointer(a))


def _torch_pairs():
    import torch

    x = torch.arange(12.0)
    return {
        "overlapping slices": (x[:6], x[4:]),
        "a view and a transposed view": (x[:6].view(2, 3), x[:6].view(3, 2).t()),
        "as_strided": (x.as_strided((3,), (2,), 1), x.as_strided((2,), (3,), 2)),  # both hold x[5]
        "a row and a column": (x.view(3, 4)[1], x.view(3, 4)[:, 2]),
    }


def test_find_overlap_detects_torch_views_of_one_storage():
    for name, (a, b) in _torch_pairs().items():
        assert find_overlap([np.ones(2), a.numpy(), b.numpy()]) == (1, 2), name


def test_find_overlap_accepts_disjoint_torch_views():
    import torch

    x = torch.arange(12.0)
    assert find_overlap([x[:6].numpy(), x[6:].numpy()]) is None
    assert find_overlap([x[::2].numpy(), x[1::2].numpy()]) is None
    assert find_overlap([x.view(3, 4)[:, 0].numpy(), x.view(3, 4)[:, 1].numpy()]) is None



def test_find_overlap_reads_numpy_views_of_a_tensors_array_at_their_own_offset():
    import torch

    x = torch.arange(12.0)
    assert find_overlap([x.numpy()[6:], x[:6].numpy()]) is None
    assert find_overlap([x.numpy()[5:], x[:6].numpy()]) == (0, 1)
    assert find_overlap([x.numpy().view(np.int32)[12:], x[:6].numpy()]) is None


def test_find_overlap_whatever_the_base_chain():
    base = np.arange(20.0)
    a, b = _foreign_view(base[:8]), _foreign_view(base[5:])
    assert a.base is not b.base and find_overlap([a, b]) == (0, 1)
    c = as_strided(_foreign_view(base[1:]), (4,), (16,))
    assert find_overlap([c, base[::2]]) is None  # c reads odd elements only
    assert find_overlap([c, base[3:4]]) == (0, 1)


def test_find_overlap_among_ten_thousand_leaves():
    import torch

    storage = torch.zeros(20_000)
    tensors = [torch.zeros(1) for _ in range(5_000)] + list(storage.split(3)[:5_000])
    views = [t.numpy() for t in tensors]
    assert len(views) == 10_000 and find_overlap(views) is None
    assert find_overlap(views + [storage[2:4].numpy()]) == (5_000, 10_000)  # splits 0 and 1
    owned = [np.ones(1) for _ in range(10_000)]
    assert find_overlap(owned) is None
    assert find_overlap(owned + [owned[7][:]]) == (7, 10_000)


@pytest.mark.parametrize("name", list(_torch_pairs()))
def test_in_place_ops_refuse_overlapping_torch_views(name, backend):
    a, b = _torch_pairs()[name]
    storage = a._base if a._base is not None else a
    before = storage.clone()
    with pytest.raises(gf.OverlapError, match=r"\['a'\].*\['b'\]"):
        gf.clip_grad_norm_({"a": a, "b": b}, 1e-3, backend=backend)
    p = gf.plan({"a": a, "b": b})
    with pytest.raises(gf.OverlapError, match=r"\['a'\].*\['b'\]"):
        gf.scatter(p, np.full(p.size, 7.0), {"a": a, "b": b}, backend=backend)
    assert storage.equal(before)


def test_a_tree_and_a_tensor_list_refuse_shared_memory_alike():
    # Arrays (a tree's walk) and leaf rows (a tensor list's table) are swept
    # by one function and refused with one message.
    import torch

    import gpuflat.torch as gft
    from gpuflat.errors import OverlapError

    base = torch.zeros(6)
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(2)]
    params[0].grad, params[1].grad = base[:4], base[2:]
    with pytest.raises(OverlapError) as from_tree:
        gf.clip_grad_norm_([base[:4], base[2:]], 1.0)
    with pytest.raises(OverlapError) as from_list:
        gft.clip_grad_norm_(params, 1.0)
    assert str(from_tree.value) == str(from_list.value).replace("parameters[0].grad", "[0]").replace(
        "parameters[1].grad", "[1]")
    assert base.tolist() == [0.0] * 6
