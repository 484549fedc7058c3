"""gpuflat._src.memory_order: which leaves are read as their dense block of memory,
and how; every backend's norms and clips read them so."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src.backends import get_backend
from gpuflat._src.backends.protocol import LeafRows
from gpuflat._src.memory_order import dense_start, in_memory_order

from conftest import DTYPES, assert_bits_equal, exact_norm, random_array, read_order_copy, rel_err, torch_scaled


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


# ---------------------------------------------------------------- the backends read in this order

BACKENDS = ["numpy", "host", "emulated"]
ORDS = [1, 2, 3, math.inf]
NORM_DTYPES = [d for d in DTYPES if d != np.complex128]
ITEM = 4096  # elements per work item of every backend's norms


def _leaves(dtype, seed=0):
    """Dense-permuted leaves of sizes crossing ITEM boundaries, beside a
    non-dense strided one and a contiguous one."""
    rng = np.random.default_rng(seed)
    return {
        "transposed": random_array(rng, (130, 70), dtype).T,  # 2.2 items
        "channels_last": random_array(rng, (2, 9, 9, 64), dtype).transpose(0, 3, 1, 2),  # 2.5 items
        "reversed": random_array(rng, (ITEM + 3,), dtype)[::-1],
        "permuted": random_array(rng, (17, 31, 16), dtype).transpose(2, 0, 1)[:, ::-1],
        "stepped": random_array(rng, (2 * ITEM + 2,), dtype)[::2],  # not dense: logical order
        "contiguous": random_array(rng, (ITEM - 1,), dtype),
    }


def _norms(backend, leaves, p):
    be = get_backend(backend)
    r = be.norms(gf.plan(leaves), gf.trainables(leaves), p, per_leaf=True)
    return be.to_host(r.total), be.to_host(r.per_leaf), int(be.to_host(r.first_nonfinite))


def _same_norms(got, want):
    assert_bits_equal(got[0], want[0])
    assert_bits_equal(got[1], want[1])
    assert got[2] == want[2]


@pytest.mark.parametrize("dtype", NORM_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_norms_of_strided_leaves_are_right(backend, dtype):
    leaves = _leaves(dtype)
    tol = 1e-6 if dtype.kind == "c" or dtype.itemsize >= 4 else 1e-5
    for p in ORDS:
        total, per, first = _norms(backend, leaves, p)
        assert rel_err(total, exact_norm(list(leaves.values()), p)) < tol, p
        for got, leaf in zip(per, leaves.values()):
            assert rel_err(got, exact_norm([leaf], p)) < tol, p
        assert first == -1


@pytest.mark.parametrize("dtype", NORM_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dense_permuted_leaf_has_the_bits_of_its_memory(backend, dtype):
    """Each leaf's norm is its read-order copy's, bit for bit: memory order
    for the dense-permuted ones, logical order for the stepped one."""
    leaves = _leaves(dtype)
    copies = {k: read_order_copy(a) for k, a in leaves.items()}
    for p in ORDS:
        _same_norms(_norms(backend, leaves, p), _norms(backend, copies, p))


@pytest.mark.parametrize("dtype", NORM_DTYPES, ids=str)
def test_the_backends_agree_on_strided_leaves(dtype):
    """The host and the emulated CUDA backends share the kernels' order, bit
    for bit; the NumPy backend sums its own pieces (the same bits for the max
    of real leaves; a complex magnitude is its own hypot's)."""
    leaves = _leaves(dtype)
    for p in ORDS:
        host = _norms("host", leaves, p)
        _same_norms(_norms("emulated", leaves, p), host)
        numpy = _norms("numpy", leaves, p)
        if p == math.inf and dtype.kind == "f":
            _same_norms(numpy, host)
        assert rel_err(numpy[0], float(host[0])) < 1e-14
        np.testing.assert_allclose(numpy[1], host[1], rtol=1e-14)


@pytest.mark.parametrize("dtype", NORM_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_clip_scales_strided_leaves_elementwise(backend, dtype):
    leaves = _leaves(dtype)
    bases = {k: a.base if a.base is not None else a for k, a in leaves.items()}
    before = {k: b.copy() for k, b in bases.items()}
    be = get_backend(backend)
    plan = gf.plan(leaves)
    total = be.norms(plan, gf.trainables(leaves), 2, per_leaf=False).total
    be.clip_(plan, gf.trainables(leaves), total, 0.5, 1e-6)
    coef = min(1.0, 0.5 / (float(be.to_host(total)) + 1e-6))
    for k in leaves:
        # Every element of the base scaled once, the stepped leaf's gaps untouched.
        want = before[k].copy()
        target = want[::2] if k == "stepped" else want
        target[...] = torch_scaled(target, coef)
        assert_bits_equal(bases[k], want)


@pytest.mark.parametrize("dtype", NORM_DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("slot,where", [(0, (69, 3)), (3, (5, 2, 30)), (4, (ITEM,))])
def test_the_first_nonfinite_slot_of_strided_leaves(backend, dtype, slot, where):
    leaves = _leaves(dtype)
    key = list(leaves)[slot]
    leaves[key][where] = np.nan
    leaves["contiguous"][0] = np.inf  # a later slot: not the first
    for p in ORDS:
        total, per, first = _norms(backend, leaves, p)
        assert first == slot and np.isnan(total), p
        assert np.isnan(per[slot]) and not np.isnan(np.delete(per, slot)).any(), p


# ---------------------------------------------------------------- tensors, read from their rows

TORCH_DTYPES = ["float16", "bfloat16", "float32", "float64", "complex64"]


def _tensors(dtype, seed=0):
    """Gradients: dense-permuted ones of sizes crossing ITEM boundaries, a
    contiguous one, and a stepped one last."""
    torch = pytest.importorskip("torch")
    g = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, dtype)
    return [torch.randn(2, 64, 9, 9, generator=g).to(dtype).contiguous(memory_format=torch.channels_last),
            torch.randn(130, 70, generator=g).to(dtype).t(),
            torch.randn(16, 17, 31, generator=g).to(dtype).permute(2, 0, 1),
            torch.randn(ITEM - 1, generator=g).to(dtype),
            torch.randn(2 * ITEM + 2, generator=g).to(dtype)[::2]]


def _read_order(tensors):
    """Views of ``tensors`` (as :func:`_tensors` makes them) in read order: the
    dense ones' memory from their first element on (torch strides are never
    negative), the stepped one as it is."""
    return [t.as_strided((t.numel(),), (1,)) for t in tensors[:-1]] + tensors[-1:]


def _tensor_norms(backend, tensors, p):
    """The float64 norms the backend computes from the tensors' leaf-table rows."""
    from gpuflat._src import tensor_table

    be = get_backend(backend)
    with tensor_table.serve_with(be):
        (group,) = tensor_table.read(tensors, str).groups
    assert isinstance(group.leaves, LeafRows)
    r = be.norms(group.plan, group.leaves, p, per_leaf=True)
    return be.to_host(r.total), be.to_host(r.per_leaf), int(be.to_host(r.first_nonfinite))


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
def test_tensor_rows_of_dense_permuted_gradients_are_read_in_memory_order(dtype):
    tensors = _tensors(dtype)
    copies = [t.clone() for t in _read_order(tensors)]
    for p in ORDS:
        host = _tensor_norms("host", tensors, p)
        _same_norms(_tensor_norms("host", copies, p), host)
        _same_norms(_tensor_norms("emulated", tensors, p), host)
        _same_norms(_tensor_norms("emulated", copies, p), host)


@pytest.mark.parametrize("dtype", TORCH_DTYPES)
@pytest.mark.parametrize("backend", ["host", "emulated"])
def test_tensor_rows_of_dense_permuted_gradients_clip_elementwise(backend, dtype):
    """The same norm bits, so the same factor, scaling every element once:
    the gradients' and their read-order copies' elements end up the same bits."""
    torch = pytest.importorskip("torch")
    import gpuflat.torch as gft
    from gpuflat._src import tensor_table

    tensors = _tensors(dtype, seed=1)
    copies = [t.clone() for t in _read_order(tensors)]
    with tensor_table.serve_with(get_backend(backend)):
        for grads in (tensors, copies):
            params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
            for param, g in zip(params, grads):
                param.grad = g
            gft.clip_grad_norm_(params, max_norm=0.5)
    for got, want in zip(_read_order(tensors), copies):
        bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
        assert torch.equal(got.contiguous().view(bits), want.view(bits))


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_and_scatter_keep_the_logical_order_beside_norms_and_clips(backend):
    """Norms and clips of the very same arrays before and after (whose
    tables a backend may keep) leave flatten and scatter in logical order."""
    be = get_backend(backend)
    leaves = _leaves(np.dtype(np.float32))
    plan, arrays = gf.plan(leaves), gf.trainables(leaves)
    for _ in range(2):
        total = be.norms(plan, arrays, 2, per_leaf=True).total
        be.clip_(plan, arrays, total, 1e6, 0.0)
        flat = be.to_host(gf.flatten(plan, leaves, backend=backend))
        assert_bits_equal(flat, np.concatenate([a.reshape(-1) for a in leaves.values()]))
        gf.scatter(plan, -flat, leaves, backend=backend)
        assert_bits_equal(np.concatenate([a.reshape(-1) for a in leaves.values()]), -flat)
