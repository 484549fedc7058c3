"""The native host backend against independent NumPy references of the CUDA
kernels' summation order, the NumPy backend, and the emulated CUDA backend."""
from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src.backends import get_backend
from gpuflat._src.backends.host import HostBackend
from gpuflat._src.layout import RULES
from gpuflat._src.native import available, unavailable_reason

from conftest import (BF16, DTYPE_IDS, DTYPES, assert_bits_equal, random_array, read_order_copy, strided_variant,
                      torch_scaled)

# The references convert NaN bit patterns on purpose.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered")


@pytest.fixture(autouse=True)
def native_library():
    """The native path must build wherever the tests run (g++ and the Python and
    NumPy headers are test requirements): without it every test here would
    test the NumPy fallback, so each fails with the reason instead."""
    assert available(), f"the native host backend did not build: {unavailable_reason()}"

ITEM = 4096  # elements per work item of the CUDA kernels
ORDS = [1, 2, math.inf, 3]
SIZES = [0, 1, ITEM - 1, ITEM, ITEM + 1, 2 * ITEM + 1]
LAYOUTS = ["c", "transposed", "sliced", "reversed"]


# ---------------------------------------------------------------- the kernels' order in NumPy

def _nanmax(a, b):
    return np.where(np.isnan(a), a, np.where(np.isnan(b), b, np.where(a > b, a, b)))


def _combine(a, b, p):
    return _nanmax(a, b) if p == math.inf else a + b


def _pow(a, p):
    """C's pow element by element (NumPy's power has its own fast paths for some exponents)."""
    return np.array([math.pow(v, p) for v in np.ravel(a).tolist()], np.float64).reshape(np.shape(a))


def _terms(x, p):
    """Each element's share in float64: |x|**2 as re*re + im*im, |x|, |x|**p."""
    if x.dtype.kind == "c":
        re, im = x.real.astype(np.float64), x.imag.astype(np.float64)
        return re * re + im * im if p == 2 else (np.hypot(re, im) if p in (1, math.inf) else _pow(np.hypot(re, im), p))
    w = x.astype(np.float64)
    return w * w if p == 2 else (np.abs(w) if p in (1, math.inf) else _pow(np.abs(w), p))


def _item_partial(terms, lanes_per_vector, p):
    """32 lanes; vector j (V elements) is lane j % 32's; then the shuffle-down tree."""
    step = 32 * lanes_per_vector
    padded = np.zeros(-(-terms.size // step) * step)  # +0.0 changes no sum or max of terms
    padded[: terms.size] = terms
    acc = np.zeros(32)
    for block in padded.reshape(-1, 32, lanes_per_vector):
        for k in range(lanes_per_vector):
            acc = _combine(acc, block[:, k], p)
    for off in (16, 8, 4, 2, 1):
        acc[:off] = _combine(acc[:off], acc[off : 2 * off], p)
    return acc[0]


def _block_tree(red, p):
    for w in (128, 64, 32, 16, 8, 4, 2, 1):
        red[:w] = _combine(red[:w], red[w : 2 * w], p)
    return red[0]


def _strided_sum(values, p):
    """256 threads, thread t taking values t, t + 256, ... in order, then the block tree."""
    red = np.zeros(256)
    for start in range(0, len(values), 256):
        chunk = values[start : start + 256]
        red[: len(chunk)] = _combine(red[: len(chunk)], chunk, p)
    return _block_tree(red, p)


def _root(v, p):
    return np.sqrt(v) if p == 2 else (v if p in (1, math.inf) else _pow(v, 1.0 / p))


def ref_norms(leaves, p):
    """(total, per-leaf norms, first non-finite slot) in the order of kernels/norms.cu,
    each leaf in the order norms read it."""
    raw, every_partial, first_bad = [], [], -1
    for slot, leaf in enumerate(leaves):
        x = read_order_copy(leaf)
        lanes_per_vector = 16 // x.dtype.itemsize
        partials = [_item_partial(_terms(x[i : i + ITEM], p), lanes_per_vector, p) for i in range(0, x.size, ITEM)]
        every_partial += partials
        if len(partials) <= 16:
            v = 0.0
            for part in partials:
                v = float(_combine(np.float64(v), np.float64(part), p))
        else:
            v = _strided_sum(np.array(partials), p)
        raw.append(v)
        parts = x.astype(np.complex128) if x.dtype.kind == "c" else x.astype(np.float64)
        if first_bad < 0 and not np.isfinite(parts).all():
            first_bad = slot
    # The total from every chunk's partial, whatever leaf it belongs to.
    total = _root(_strided_sum(np.array(every_partial, np.float64), p), p)
    return np.float64(total), _root(np.array(raw, np.float64), p), first_bad


def host_norms(leaves, p, threads=None):
    tree = list(leaves)
    r = HostBackend(threads).norms(gf.plan(tree), gf.trainables(tree), p, per_leaf=True)
    return r.total, r.per_leaf, int(r.first_nonfinite)


def emulated_norms(leaves, p):
    tree = list(leaves)
    be = get_backend("emulated")
    r = be.norms(gf.plan(tree), gf.trainables(tree), p, per_leaf=True)
    return be.to_host(r.total), be.to_host(r.per_leaf), int(be.to_host(r.first_nonfinite))


def assert_same_bits_or_nan(got, want):
    """Bitwise equal, but a NaN only has to be a NaN: which payload survives a sum
    of several NaNs is the hardware's choice (a GPU returns a canonical NaN)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert_bits_equal(np.isnan(got), np.isnan(want))
    assert_bits_equal(np.where(np.isnan(got), 0.0, got), np.where(np.isnan(want), 0.0, want))


def assert_same_norms(got, want):
    assert_same_bits_or_nan(got[0], want[0])
    assert_same_bits_or_nan(got[1], want[1])
    assert got[2] == want[2]


# ---------------------------------------------------------------- norms

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("p", ORDS)
def test_norms_follow_the_kernels_order(dtype, p):
    rng = np.random.default_rng(7)
    leaves = [random_array(rng, (n,), dtype) for n in SIZES] + [random_array(rng, (), dtype)]
    assert_same_norms(host_norms(leaves, p), ref_norms(leaves, p))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("p", [2, math.inf])
def test_norms_bitwise_equal_emulated_cuda(dtype, p):
    rng = np.random.default_rng(8)
    leaves = [random_array(rng, (n,), dtype) for n in (ITEM - 1, 2 * ITEM + 1, 0)] + [
        random_array(rng, (), dtype), strided_variant(rng, (67, 129), dtype, "transposed")]
    assert_same_norms(host_norms(leaves, p), emulated_norms(leaves, p))


def test_big_slot_uses_the_block_tree():
    """A leaf of more than 16 items is summed by 256 strided threads and the fixed tree."""
    rng = np.random.default_rng(9)
    leaves = [rng.standard_normal(17 * ITEM + 5).astype(np.float32), rng.standard_normal(300).astype(np.float32)]
    want = ref_norms(leaves, 2)
    assert_same_norms(host_norms(leaves, 2), want)
    assert_same_norms(emulated_norms(leaves, 2), want)


@pytest.mark.parametrize("p", [1, 2, math.inf])
def test_big_slots_of_any_item_count_give_the_block_tree_bits(p):
    """Slots of 17 to 301 items, which the CUDA finisher sums one warp each
    (lane l playing threads l + 32 r of the 256-thread tree), eight at once,
    give the tree's bits; a NaN in one of them is found by its slot."""
    rng = np.random.default_rng(10)
    leaves = [rng.standard_normal(n).astype(np.float32) for n in
              (300 * ITEM + 7, 40 * ITEM, 9, 17 * ITEM + 1, 257 * ITEM, 33 * ITEM - 1)]
    want = ref_norms(leaves, p)
    assert_same_norms(host_norms(leaves, p), want)
    assert_same_norms(emulated_norms(leaves, p), want)
    leaves[3][5 * ITEM + 2] = np.nan
    got = emulated_norms(leaves, p)
    assert got[2] == 3 and np.isnan(got[0])
    assert_same_norms(got, host_norms(leaves, p))


def test_the_largest_slots_summed_by_the_whole_block_keep_the_tree_bits():
    """A slot of more than 4096 items is summed by the CUDA finisher's whole
    block, the others one warp each: the same tree, so the same bits, on any
    grid, as the host backend's."""
    from gpuflat._src.backends.cuda import CudaBackend
    from gpuflat._src.backends.cuda_runtime import EmulatedRuntime
    from gpuflat._src.layout import BLOCK_SLOT_ITEMS

    rng = np.random.default_rng(11)
    leaves = [rng.standard_normal((BLOCK_SLOT_ITEMS + 3) * ITEM + 5).astype(np.float32),
              rng.standard_normal(40 * ITEM).astype(np.float32), rng.standard_normal(9).astype(np.float32)]
    want = host_norms(leaves, 2)
    assert_same_norms(want, ref_norms(leaves, 2))
    plan = gf.plan(leaves)
    for grid in (1, 3):
        r = CudaBackend(EmulatedRuntime(), grid=grid).norms(plan, leaves, 2, per_leaf=True)
        assert_same_norms((r.total, r.per_leaf, int(r.first_nonfinite)), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_leaves_give_the_contiguous_bits(dtype, layout):
    """A transposed or reversed leaf is summed in memory order, a sliced one in logical order."""
    rng = np.random.default_rng(10)
    leaf = strided_variant(rng, (70, 130), dtype, layout)
    for p in ORDS:
        got = host_norms([leaf], p)
        assert_same_norms(got, host_norms([read_order_copy(leaf)], p))
        assert_same_norms(got, ref_norms([leaf], p))


def test_unaligned_leaf():
    raw = np.zeros(4 * 5000 + 1, np.uint8)[1:]
    leaf = raw.view(np.float32)
    leaf[:] = np.random.default_rng(11).standard_normal(5000)
    assert not leaf.flags.aligned
    assert_same_norms(host_norms([leaf], 2), ref_norms([leaf.copy()], 2))


# More than 3 x 2M elements: work enough for 3 threads (the library starts a
# thread only for at least 2M elements), each claiming chunks of 256K.
THREADED_SIZES = (3_000_000, 5, 70_001, 0, 1 << 18, 3_500_000)


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_thread_count_changes_no_bit(threads):
    rng = np.random.default_rng(12)
    leaves = [rng.standard_normal(n).astype(np.float32) for n in THREADED_SIZES]
    one = host_norms(leaves, 2, 1)
    assert_same_norms(host_norms(leaves, 2, threads), one)
    for p in (1, math.inf):
        assert_same_norms(host_norms(leaves, p, threads), host_norms(leaves, p, 1))
    if threads == 2:
        assert_same_norms(one, ref_norms(leaves, 2))


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_gather_scatter_clip_bits(threads):
    rng = np.random.default_rng(18)
    leaves = [rng.standard_normal(n).astype(np.float32) for n in THREADED_SIZES]
    plan = gf.plan(leaves)
    out = np.empty(plan.size, plan.dtype)
    HostBackend(threads).gather(plan, [[a] for a in leaves], out)
    assert_bits_equal(out, np.concatenate(leaves))
    back = [np.empty_like(a) for a in leaves]
    HostBackend(threads).scatter(plan, out * 2, back)
    for a, b in zip(leaves, back):
        assert_bits_equal(b, a * 2)
    HostBackend(threads).clip_(plan, back, np.float64(8.0), 1.0, 1e-6)
    for a, b in zip(leaves, back):
        assert_bits_equal(b, torch_scaled(a * 2, 1.0 / (8.0 + 1e-6)))


@pytest.mark.parametrize("dtype, big", [(np.float32, 1e30), (np.float16, 300.0), (np.complex64, 1e30)])
def test_overflow_prone_values(dtype, big):
    leaf = np.full(3 * ITEM + 7, big, dtype)
    total, _, bad = host_norms([leaf], 2)
    assert total == pytest.approx(abs(np.asarray(big, dtype).astype(np.complex128)) * math.sqrt(leaf.size),
                                  rel=1e-12)
    assert bad == -1


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_first_nonfinite_slot(value, dtype):
    leaves = [np.ones(ITEM + 3, dtype), np.ones(2 * ITEM + 1, dtype), np.ones(5, dtype)]
    leaves[1][ITEM + 2] = value
    leaves[2][0] = value
    for p in ORDS:
        total, per, bad = host_norms(leaves, p)
        want = ref_norms(leaves, p)
        assert bad == 1 == want[2]
        assert_same_norms((total, per, bad), want)


def test_finite_overflow_is_not_a_nonfinite_leaf():
    leaves = [np.full(10, 1e300), np.ones(3)]
    total, _, bad = host_norms(leaves, 2)
    assert total == np.inf and bad == -1


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=["float16", "bfloat16"])
def test_every_16_bit_pattern(dtype):
    """Every float16 / bfloat16 bit pattern (NaNs of every payload included) in norms and clip."""
    patterns = np.arange(1 << 16, dtype=np.uint16).view(dtype)
    leaves = [patterns[i : i + 4096 + 512] for i in range(0, 1 << 16, 4096)]
    for p in (2, 1):
        assert_same_norms(host_norms(leaves, p), ref_norms(leaves, p))
    for coef_total in (3.0, 0.7e-3):
        host, ref = patterns.copy(), patterns.copy()
        tree_h, tree_r = [host], [ref]
        HostBackend().clip_(gf.plan(tree_h), tree_h, np.float64(coef_total), 1.0, 1e-6)
        get_backend("numpy").clip_(gf.plan(tree_r), tree_r, np.float64(coef_total), 1.0, 1e-6)
        finite = np.isfinite(ref.astype(np.float32))
        assert_bits_equal(host[finite], ref[finite])
        assert np.isnan(host[~finite].astype(np.float32)).sum() == np.isnan(ref[~finite].astype(np.float32)).sum()


# ---------------------------------------------------------------- SIMD steps and flat buffers

# Sizes on and next to the SIMD steps (32 vectors of 16 bytes: 32 to 256
# elements by dtype) and the work items.
SIMD_SIZES = [0, 1, 3, 31, 32, 33, 64, 65, 127, 128, 129, 255, 256, 257, ITEM - 1, ITEM, ITEM + 1, 2 * ITEM + 1, 2]


def flat_slots(flat, sizes):
    """Consecutive slices of ``flat`` of ``sizes`` and their plan (slot s is flat[offsets[s]:offsets[s + 1]])."""
    bounds = np.cumsum([0] + list(sizes))
    leaves = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    plan = gf.plan(leaves)
    assert_bits_equal(plan.offsets, bounds.astype(np.int64))
    return leaves, plan


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("p", ORDS)
def test_norms_at_the_simd_steps_follow_the_kernels_order(dtype, p):
    rng = np.random.default_rng(19)
    leaves, _ = flat_slots(random_array(rng, (sum(SIMD_SIZES),), dtype), SIMD_SIZES)
    assert_same_norms(host_norms(leaves, p), ref_norms(leaves, p))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_resident_grad_norm_on_host(dtype):
    """gf.resident's per-step norms read a table of its leaves: each leaf's norm is
    the reference's bits; the total, whose finishing order includes the zero
    padding slots, matches to rounding."""
    rng = np.random.default_rng(22)
    shapes = [(ITEM + 1,), (), (0,), (3, 70), (129,), (2 * ITEM + 1,)]
    tree = {f"x{i}": random_array(rng, shape, dtype) for i, shape in enumerate(shapes)}
    r = gf.resident(tree, backend="host")
    for name, a in tree.items():
        r.grads[name][...] = a
    leaves = list(tree.values())
    for p in ORDS:
        total, per = r.grad_norm(p, per_leaf=True)
        want_total, want_per, _ = ref_norms(leaves, p)
        assert_bits_equal(np.asarray(per), want_per)
        assert float(total) == pytest.approx(float(want_total), rel=1e-14)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_flat_clip_is_the_leaves_bits(dtype):
    rng = np.random.default_rng(23)
    flat = random_array(rng, (sum(SIMD_SIZES),), dtype)
    original, copy = flat.copy(), flat.copy()
    leaves, plan = flat_slots(flat, SIMD_SIZES)
    copies, _ = flat_slots(copy, SIMD_SIZES)
    HostBackend().clip_(plan, leaves, np.float64(3.0), 1.0, 1e-6, flat=flat)
    HostBackend().clip_(plan, copies, np.float64(3.0), 1.0, 1e-6)
    assert_bits_equal(flat, copy)
    assert_bits_equal(flat, torch_scaled(original, 1.0 / (3.0 + 1e-6)))


@pytest.mark.parametrize("total", [3.0, math.nan], ids=["finite", "nan"])
def test_flat_clip_keeps_the_zeros_between_leaves_zero(total):
    # A resident buffer: leaves with zero padding between them. A finite
    # factor scales the whole buffer at once (zeros stay +0.0), a NaN factor
    # the leaves alone; the leaves get the per-leaf clip's bits either way.
    rng = np.random.default_rng(29)
    flat = np.zeros(3 * 64 + 5, np.float32)
    spans = [(0, 20), (64, 64 + ITEM // 64), (128, 128 + 61), (192, 197)]
    for a, b in spans:
        flat[a:b] = rng.standard_normal(b - a)
    copy = flat.copy()
    leaves, copies = [flat[a:b] for a, b in spans], [copy[a:b] for a, b in spans]
    plan = gf.plan(copies)
    HostBackend().clip_(plan, leaves, np.float64(total), 1.0, 1e-6, flat=flat)
    HostBackend().clip_(plan, copies, np.float64(total), 1.0, 1e-6)
    assert_bits_equal(flat, copy)
    gaps = np.ones(flat.size, bool)
    for a, b in spans:
        gaps[a:b] = False
    assert_bits_equal(flat[gaps], np.zeros(int(gaps.sum()), np.float32))
    assert np.isnan(flat[~gaps]).all() == math.isnan(total)


# ---------------------------------------------------------------- gather and scatter

def _tree(rng, dtypes):
    return {f"x{i}": strided_variant(rng, shape, dt, layout)
            for i, (dt, (shape, layout)) in enumerate(zip(dtypes, [
                ((ITEM + 1,), "c"), ((70, 130), "transposed"), ((), "c"), ((0,), "c"),
                ((33, 65), "reversed"), ((2 * ITEM + 1,), "sliced")]))}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather_bits_equal_numpy_and_emulated(dtype):
    rng = np.random.default_rng(13)
    tree = _tree(rng, [dtype, np.float32, dtype, dtype, np.float64, dtype])
    plan, leaves = gf.plan(tree), gf.trainables(tree)
    outs = []
    for be in (HostBackend(), get_backend("numpy"), get_backend("emulated")):
        out = be.xp.zeros(plan.size, plan.dtype)
        be.gather(plan, [[a] for a in leaves], out)
        outs.append(be.to_host(out))
    assert_bits_equal(outs[0], outs[1])
    assert_bits_equal(outs[0], outs[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gather_ties_and_missing_sources(dtype):
    """Tied sources added in complex double in list order, rounded once; none gives zeros."""
    rng = np.random.default_rng(14)
    a = random_array(rng, (ITEM + 9,), dtype)
    tree = {"a": a, "b": random_array(rng, (5,), dtype)}
    plan = gf.plan(tree)
    sources = [[random_array(rng, a.shape, dtype), random_array(rng, (2 * a.size,), np.float64)[::-2],
                random_array(rng, a.shape, np.complex128)], []]
    out = np.full(plan.size, 7, plan.dtype)
    HostBackend().gather(plan, sources, out)
    acc = sum((s.astype(np.complex128) for s in sources[0][1:]), sources[0][0].astype(np.complex128))
    want = np.concatenate([acc.real if plan.dtype.kind != "c" else acc, np.zeros(5)]).astype(plan.dtype)
    assert_bits_equal(out, want)
    emulated = get_backend("emulated")
    dev = emulated.xp.full(plan.size, 7, plan.dtype)
    emulated.gather(plan, sources, dev)
    assert_bits_equal(out, emulated.to_host(dev))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scatter_in_place_through_strides(dtype):
    rng = np.random.default_rng(15)
    mixed = [dtype, np.float32, dtype, dtype, np.float64, dtype]
    trees = [_tree(np.random.default_rng(15), mixed) for _ in range(2)]
    plan = gf.plan(trees[0])
    flat = random_array(rng, (plan.size,), plan.dtype)
    HostBackend().scatter(plan, flat, gf.trainables(trees[0]))
    get_backend("numpy").scatter(plan, flat, gf.trainables(trees[1]))
    for a, b in zip(gf.trainables(trees[0]), gf.trainables(trees[1])):
        assert_bits_equal(a, b)
    start = plan.leaves[1].offset
    assert_bits_equal(trees[0]["x1"].reshape(-1), flat[start : start + trees[0]["x1"].size].real.astype(np.float32))


# ---------------------------------------------------------------- clip

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("total", [4.0, 0.5, np.nan, np.inf])
def test_clip_bits_equal_torch_rounding(dtype, total):
    rng = np.random.default_rng(16)
    tree = _tree(rng, [dtype] * 6)
    before = [a.copy() for a in gf.trainables(tree)]
    HostBackend().clip_(gf.plan(tree), gf.trainables(tree), np.float64(total), 1.0, 1e-6)
    coef = min(1.0, 1.0 / (total + 1e-6)) if not np.isnan(total) else np.nan
    for got, old in zip(gf.trainables(tree), before):
        if coef == 1.0:
            assert_bits_equal(got, old)  # never rewritten
        else:
            assert_bits_equal(got, torch_scaled(old, coef))


def test_clip_matches_emulated_and_uses_flat():
    rng = np.random.default_rng(17)
    flat = rng.standard_normal(3 * ITEM + 5).astype(np.float32)
    leaves = [flat[: ITEM + 1].reshape(1, -1), flat[ITEM + 1 :]]
    tree = {"a": leaves[0].copy(), "b": leaves[1].copy()}
    plan = gf.plan(tree)
    HostBackend().clip_(plan, leaves, np.float64(9.0), 2.0, 1e-6, flat=flat)
    emulated = get_backend("emulated")
    dev = [emulated.xp.asarray(a) for a in gf.trainables(tree)]
    emulated.clip_(plan, dev, emulated.xp.asarray(np.float64(9.0)), 2.0, 1e-6)
    assert_bits_equal(flat, np.concatenate([emulated.to_host(d).reshape(-1) for d in dev]))


# ---------------------------------------------------------------- errors

def test_unreadable_leaf_is_named_and_nothing_written():
    a = np.ones(3, np.float32)
    plan = gf.plan({"a": a, "b": np.ones(2, np.float32)})
    with pytest.raises(TypeError, match=r"leaf \"\['b'\]\".*list"):
        HostBackend().clip_(plan, [a, [1.0, 2.0]], np.float64(10.0), 1.0, 1e-6)
    assert_bits_equal(a, np.ones(3, np.float32))


def test_gather_names_the_slot_of_an_unreadable_source_and_writes_nothing():
    a, b = np.ones(3, np.float32), np.ones(2, np.float32)
    plan = gf.plan({"a": a, "b": b})
    out = np.full(plan.size, 7.0, np.float32)
    with pytest.raises(TypeError, match=r"leaf \"\['b'\]\".*int64"):
        HostBackend().gather(plan, [[a, a], [b, np.ones(2, np.int64)]], out)
    assert_bits_equal(out, np.full(plan.size, 7.0, np.float32))
    with pytest.raises(TypeError, match=r"leaf \"\['a'\]\".*shape \(4,\)"):
        HostBackend().gather(plan, [[np.ones(4, np.float32)], [b]], out)
    assert_bits_equal(out, np.full(plan.size, 7.0, np.float32))


def test_the_optimizer_step_refuses_a_dtype_it_has_no_update_for():
    p = np.ones(3, np.complex64)
    g, m, v = p.copy(), np.zeros(3, np.complex64), np.zeros(3, np.complex64)
    hyper = np.array(RULES["adamw"].hyper_row(dict(lr=0.1, weight_decay=0.0, betas=(0.9, 0.999), eps=1e-8)))
    with pytest.raises(TypeError, match=r"expected buffers of a real floating dtype \(float16, bfloat16, float32, "
                                        r"float64\), found complex64"):
        HostBackend().step_("adamw", gf.plan([p]), p, g, (m, v), np.zeros(1, np.int64), hyper, np.ones(1), None,
                            0.0, 0.0, np.array([1.0, 0.0]))
    assert p.tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("rule", ["adamw", "sgd", "lion"])
def test_without_the_optimizer_library_the_steps_are_the_numpy_backends_bits(rule, monkeypatch):
    from gpuflat._src import native

    rng = np.random.default_rng(5)
    p0, g = rng.standard_normal(37).astype(np.float32), rng.standard_normal(37).astype(np.float32)
    group = {"adamw": dict(lr=0.1, weight_decay=0.01, betas=(0.9, 0.999), eps=1e-8),
             "sgd": dict(lr=0.1, weight_decay=0.01, momentum=0.9, dampening=0.1, nesterov=False),
             "lion": dict(lr=0.1, weight_decay=0.01, betas=(0.9, 0.99))}[rule]
    hyper = np.array(RULES[rule].hyper_row(group))

    def step():
        p, states = p0.copy(), [np.full(37, 0.5, np.float32), np.full(37, 0.25, np.float32)]
        states = states if rule == "adamw" else states[:1]
        HostBackend().step_(rule, gf.plan([p]), p, g, states, np.zeros(1, np.int64), hyper, np.full(1, 3.0),
                            np.float64(2.0), 1.0, 1e-6, np.array([1.0, 0.0]))
        return p, *states

    native_bits = step()
    monkeypatch.setattr(native, "optim_library", lambda: (None, "disabled by GPUFLAT_NATIVE=0"))
    for ours, theirs in zip(native_bits, step()):
        assert_bits_equal(ours, theirs)


# A process whose C++ compiler does not exist: the default falls back to
# NumPy, an explicit backend="host" says why it cannot run.
_NO_COMPILER = r"""
import numpy as np, gpuflat as gf
from gpuflat._src.backends.selection import host_default
tree = {"w": np.array([3.0, 4.0])}
print(host_default(), float(gf.global_norm(tree)))
try:
    gf.global_norm(tree, backend="host")
except RuntimeError as err:
    print(err)
"""


def test_an_explicit_host_backend_that_cannot_be_built_says_why(tmp_path):
    env = {**os.environ, "GPUFLAT_CXX": str(tmp_path / "no-such-g++"), "GPUFLAT_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.run([sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    default, message = proc.stdout.split("\n", 1)
    assert default == "numpy 5.0"
    assert message.startswith('backend="host": expected gpuflat\'s native host library, but it cannot be built')
    assert 'backend="numpy" is the portable choice' in message
    assert f"cannot run the C++ compiler {str(tmp_path / 'no-such-g++')!r}" in message


def _recorded_list(arrays, token):
    from gpuflat._src.identity import Recorded

    out = Recorded(arrays)
    out.token = token
    return out


def test_a_token_holds_only_for_the_very_arrays_it_came_with():
    # What the library keeps under a token is checked against the list's
    # array objects: other arrays under the same token are read afresh.
    be = HostBackend()
    first = [np.full(3, 1.0, np.float32), np.full(2, 2.0)]
    other = [np.full(3, 5.0, np.float32), np.full(2, 7.0)]
    plan = gf.plan(first)
    for arrays in (first, other, first):
        out = np.empty(plan.size)
        be.gather(plan, [[a] for a in arrays], out)
        want = out.copy()
        be.gather(plan, gf._src.backends.protocol.OneSourcePerSlot(_recorded_list(arrays, 991)), out)
        assert out.tolist() == want.tolist()
        assert float(be.norms(plan, _recorded_list(arrays, 991), 2, per_leaf=False).total) == pytest.approx(
            math.sqrt(sum(float(np.sum(a.astype(np.float64) ** 2)) for a in arrays)))


def test_kept_leaves_are_found_again_among_several_tokens_and_plans():
    be = HostBackend()
    trees = [[np.full(n, float(n), np.float32), np.full(2 * n, -1.0)] for n in (1, 2, 3, 4, 5, 6)]
    for _ in range(3):
        for token, arrays in enumerate(trees, start=500):
            plan = gf.plan(arrays)
            leaves = _recorded_list(arrays, token)
            out = np.empty(plan.size)
            be.gather(plan, gf._src.backends.protocol.OneSourcePerSlot(leaves), out)
            assert out.tolist() == np.concatenate(arrays).astype(np.float64).tolist()
            be.scatter(plan, out * 2, leaves)
            be.scatter(plan, out, leaves)
            assert np.concatenate(arrays).tolist() == out.tolist()
