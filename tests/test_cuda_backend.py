"""The CUDA backend on the emulated device: the kernels, tables and
launch path that run on a GPU, compared with NumPy and exact references.

Every dtype, sizes on and around the work-item size, empty and 0-d leaves,
10,000 tiny leaves, ties, strided leaves, mixed dtypes, NaN and inf, launch /
sync / upload counts, and the same bits for any grid.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src.backends import cuda, get_backend
from gpuflat._src.backends.cuda import ITEM, CudaBackend
from gpuflat._src.backends.cuda_runtime import EmulatedRuntime

from conftest import cupy_with_device, nonfinite_cases, torch_scaled

try:
    import ml_dtypes

    BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    BF16 = None

DTYPES = [np.dtype(np.float16)] + ([BF16] if BF16 is not None else []) + [
    np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.complex64), np.dtype(np.complex128)]
IDS = [str(d) for d in DTYPES]

# One emulated device for the module: its library is built (or loaded) once.
_RUNTIME = EmulatedRuntime()


@pytest.fixture
def be():
    _RUNTIME.stats.reset()
    return CudaBackend(_RUNTIME)


# ---------------------------------------------------------------- references

def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float64 -> bfloat16 rounded once (nearest even): round to odd into
    float32 first, which a second rounding cannot spoil."""
    x = np.asarray(x, np.float64)
    f = x.astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        inexact = np.isfinite(x) & (f.astype(np.float64) != x) & np.isfinite(f)
        toward_zero = inexact & (np.abs(f.astype(np.float64)) > np.abs(x))
    f = np.where(toward_zero, np.nextafter(f, np.float32(0)), f)
    bits = f.view(np.uint32) | inexact.astype(np.uint32)
    return bits.view(np.float32).astype(BF16)


def cast(x, dtype):
    """The kernels' conversion: through complex128 / float64, rounded once."""
    dtype = np.dtype(dtype)
    x = np.asarray(x)
    if dtype.kind != "c" and x.dtype.kind == "c":
        x = x.real
    if dtype == BF16:
        return _to_bf16(x)
    with np.errstate(over="ignore"):
        return x.astype(np.complex128 if x.dtype.kind == "c" else np.float64).astype(dtype)


def same(a, b):
    """Bitwise-equal values, any NaN equal to any NaN (and -0.0 != 0.0)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    if a.dtype.kind == "c":
        return same(a.real, b.real) and same(a.imag, b.imag)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    both_nan = np.isnan(a64) & np.isnan(b64)
    return bool(np.all(both_nan | ((a64 == b64) & (np.signbit(a64) == np.signbit(b64)))))


def ref_norm(arrays, p):
    """(per-leaf norms, total) from exactly rounded sums (math.fsum) of float64 terms."""
    per, sums = [], []
    for a in arrays:
        a = np.asarray(a)
        mag = np.abs(a.astype(np.complex128)) if a.dtype.kind == "c" else np.abs(a.astype(np.float64))
        if p == math.inf:
            s = float(np.max(mag)) if mag.size else 0.0
            if np.isnan(mag).any():
                s = math.nan
            per.append(s)
        else:
            if p == 2 and a.dtype.kind == "c":
                terms = np.concatenate([a.real.astype(np.float64).ravel() ** 2,
                                        a.imag.astype(np.float64).ravel() ** 2])
            else:
                terms = mag.ravel() ** p
            s = math.fsum(terms) if np.isfinite(terms).all() else float(np.sum(terms))
            sums.append(s)
            per.append(s ** (1.0 / p))
    if p == math.inf:
        total = max(per, default=0.0) if not any(map(math.isnan, per)) else math.nan
    else:
        s = math.fsum(sums) if all(map(math.isfinite, sums)) else float(np.sum(sums))
        total = s ** (1.0 / p)
    return np.array(per, np.float64), total


def check_norm(result, arrays, p, rtol=1e-12):
    per, total = ref_norm(arrays, p)
    np.testing.assert_allclose(result.per_leaf, per, rtol=rtol, atol=0, equal_nan=True)
    np.testing.assert_allclose(result.total, total, rtol=rtol, atol=0, equal_nan=True)


def planned(arrays):
    """(plan, leaves) of a tree holding ``arrays`` in this order."""
    tree = {f"l{i:05d}": a for i, a in enumerate(arrays)}
    plan = gf.plan(tree)
    return plan, gf.trainables(tree)


def rand(shape, dtype, rng, scale=1.0):
    dtype = np.dtype(dtype)
    x = rng.standard_normal(shape) * scale
    if dtype.kind == "c":
        x = x + 1j * rng.standard_normal(shape) * scale
    return np.asarray(cast(x, dtype))


def gather(be, plan, sources):
    out = np.full(plan.size, np.nan, plan.dtype)
    be.gather(plan, sources, out)
    return out


def ref_gather(plan, sources):
    pieces = []
    for leaf, srcs in zip(plan.leaves, sources):
        wide = np.complex128 if any(s.dtype.kind == "c" for s in srcs) else np.float64
        acc = np.zeros(leaf.size, wide)
        if srcs:
            acc = srcs[0].reshape(-1).astype(wide)
            for s in srcs[1:]:
                acc = acc + s.reshape(-1).astype(wide)
        pieces.append(cast(acc, plan.dtype))
    return np.concatenate(pieces) if pieces else np.zeros(0, plan.dtype)


# ---------------------------------------------------------------- conversions

def test_reference_bf16_rounding_is_one_step():
    x = np.array([1 + 2.0**-8 + 2.0**-40, 1 + 2.0**-8, 1 + 3 * 2.0**-8, -3.0e38, 1e-45, np.inf, np.nan])
    got = _to_bf16(x).astype(np.float64)
    assert got[0] == 1 + 2.0**-7  # above the midpoint: a float32 detour rounds to 1
    assert got[1] == 1.0 and got[2] == 1 + 4 * 2.0**-8  # exact midpoints: to even
    # -3e38 is inside bfloat16's range (max about 3.39e38): a finite negative
    # value, the nearest one, never an infinity of either sign.
    nearest = min((np.float64(b) for b in np.array([-2.99e38, -3.0e38, -3.01e38]).astype(np.float32).astype(BF16)),
                  key=lambda b: abs(b + 3.0e38))
    assert np.isfinite(got[3]) and got[3] < 0 and got[3] == nearest
    assert got[4] == 0.0 and got[5] == np.inf and np.isnan(got[6])  # 1e-45 is below bfloat16's subnormals


@pytest.mark.parametrize("small", [np.float16, "bf16"])
def test_double_to_16_bit_rounds_once(be, small):
    small = BF16 if small == "bf16" else np.dtype(small)
    if small is None:
        pytest.skip("ml_dtypes missing")
    m = 11 if small == np.float16 else 8  # significant bits
    tricky = [1 + 2.0**-m + 2.0**-40, 1 + 2.0**-m, 1 + 3 * 2.0**-m, -(1 + 2.0**-m + 2.0**-45),
              65504.0, 65519.0, 65520.0, 1e6, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 5.9e-8,
              2.0**-133, 2.0**-134, 2.0**-134 * 1.5, 1e-300, -0.0, 0.0, np.inf, -np.inf, np.nan, 3.0e38,
              3.3961776e38, 3.40e38]
    rng = np.random.default_rng(0)
    x = np.concatenate([np.array(tricky), rng.standard_normal(3000) * 10.0 ** rng.integers(-12, 12, 3000)])
    # A float64 leaf scattered into a 16-bit leaf: flat float64 -> small.
    leaves = [np.zeros(x.size, small), np.zeros(1)]
    plan, leaves = planned(leaves)
    assert plan.dtype == np.float64
    be.scatter(plan, np.concatenate([x, [0.0]]), leaves)
    assert same(leaves[0], cast(x, small))


# ---------------------------------------------------------------- gather / scatter

SIZES = [ITEM - 1, ITEM, ITEM + 1, 2 * ITEM + 3, 0, 1, 3, 33]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gather_scatter_every_dtype_and_size(be, dtype):
    rng = np.random.default_rng(1)
    arrays = [rand(n, dtype, rng) for n in SIZES] + [rand((), dtype, rng), rand((0, 3), dtype, rng)]
    plan, leaves = planned(arrays)
    out = gather(be, plan, [[a] for a in leaves])
    assert same(out, ref_gather(plan, [[a] for a in leaves]))
    back = [np.full_like(a, 7) for a in leaves]
    be.scatter(plan, out, back)
    for a, b in zip(leaves, back):
        assert same(a, b)


def test_mixed_dtypes_are_one_launch(be):
    rng = np.random.default_rng(2)
    real = [d for d in DTYPES if d.kind != "c"]
    arrays = [rand(n, d, rng, scale=100) for d in real for n in (5, ITEM + 7)]
    plan, leaves = planned(arrays)
    assert plan.dtype == np.float64
    out = gather(be, plan, [[a] for a in leaves])
    assert be.stats.launches == 1
    assert same(out, ref_gather(plan, [[a] for a in leaves]))
    # Scatter rounds every slice once into its leaf's dtype.
    flat = rng.standard_normal(plan.size) * 1e3
    back = [np.zeros_like(a) for a in leaves]
    be.scatter(plan, flat, back)
    for leaf, b in zip(plan.leaves, back):
        assert same(b, cast(flat[leaf.offset : leaf.offset + leaf.size].reshape(leaf.shape), leaf.dtype))

    # With complex leaves the flat buffer is complex; real leaves take the real part back.
    arrays = [rand(9, np.complex64, rng), rand(4, np.float32, rng), rand(ITEM + 1, np.float16, rng)]
    plan, leaves = planned(arrays)
    assert plan.dtype == np.complex64
    out = gather(be, plan, [[a] for a in leaves])
    assert same(out, ref_gather(plan, [[a] for a in leaves]))
    flat = (rng.standard_normal(plan.size) + 1j * rng.standard_normal(plan.size)).astype(plan.dtype)
    back = [np.zeros_like(a) for a in leaves]
    be.scatter(plan, flat, back)
    for leaf, b in zip(plan.leaves, back):
        assert same(b, cast(flat[leaf.offset : leaf.offset + leaf.size].reshape(leaf.shape), leaf.dtype))


def _strided_views(rng, dtype):
    """Strided views, each of its own base (so scatter targets never overlap)."""
    b2 = lambda: rand((70, 90), dtype, rng)  # noqa: E731
    b3 = lambda: rand((6, 7, 8), dtype, rng)  # noqa: E731
    return [
        b2().T,                                 # transposed
        b2()[3:60:2, 1:],                       # sliced
        b2()[::-1],                             # negative stride, rows
        b2()[:, ::-3],                          # negative stride, columns
        b3().transpose(2, 0, 1)[1:, ::2],       # 3-D, nothing merges
        b3()[:, :, 0],                          # dropped axis
        rand(ITEM * 3, dtype, rng)[1::3],       # 1-D strided across items
        rand(ITEM + 9, dtype, rng)[1:],         # contiguous but misaligned
        np.broadcast_to(rand(5, dtype, rng), (4, 5)),  # zero stride (read only)
    ]


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.complex128], ids=str)
def test_strided_leaves_in_place(be, dtype):
    rng = np.random.default_rng(3)
    views = _strided_views(rng, dtype)
    plan, leaves = planned(views)
    out = gather(be, plan, [[a] for a in leaves])
    assert same(out, ref_gather(plan, [[a] for a in leaves]))
    # Scatter writes through the views themselves, no staging copy.
    writable = [v for v in views if v.flags.writeable]
    plan, leaves = planned(writable)
    flat = rand(plan.size, plan.dtype, rng)
    be.scatter(plan, flat, leaves)
    for leaf, v in zip(plan.leaves, writable):
        assert same(v, cast(flat[leaf.offset : leaf.offset + leaf.size].reshape(v.shape), v.dtype))


def test_scatter_leaves_the_rest_of_the_base_alone(be):
    base = np.arange(200, dtype=np.float32).reshape(10, 20)
    view = base[2:8:2, ::-3]
    plan, leaves = planned([view])
    be.scatter(plan, np.full(plan.size, -1.0, np.float32), leaves)
    expected = np.arange(200, dtype=np.float32).reshape(10, 20)
    expected[2:8:2, ::-3] = -1
    assert same(base, expected)


def test_too_many_dimensions_names_the_leaf(be):
    base = np.zeros((3,) * 9, np.float32)
    bad = base[(slice(None, None, 2),) * 9]
    plan, leaves = planned([np.ones(2, np.float32), bad])
    with pytest.raises(ValueError, match=r"leaf \"\['l00001'\]\".*at most 8"):
        gather(be, plan, [[a] for a in leaves])
    # Eight dims after merging is fine.
    ok = np.zeros((3,) * 8, np.float32)[(slice(None, None, 2),) * 8]
    plan, leaves = planned([ok])
    assert same(gather(be, plan, [[ok]]), ok.ravel())


def test_ties_sum_sources_in_order_and_empty_slots_are_zero(be):
    rng = np.random.default_rng(4)
    for dtype in (np.float32, np.float16, np.complex64):
        arrays = [rand((3, ITEM // 2 + 1), dtype, rng), rand(10, dtype, rng), rand((2, 2), dtype, rng)]
        plan, leaves = planned(arrays)
        sources = [
            [rand((3, ITEM // 2 + 1), dtype, rng).T.copy().T, rand((3, ITEM // 2 + 1), dtype, rng)],
            [],
            [rand((2, 2), dtype, rng), rand((2, 2), dtype, rng).T, rand((2, 2), dtype, rng)],
        ]
        out = gather(be, plan, sources)
        assert same(out, ref_gather(plan, sources))
        assert not out[plan.leaves[1].offset : plan.leaves[1].offset + 10].any()
    assert be.stats.launches == 3
    # Tied gradients through the public API: Optimisers.jl's contract.
    a, b = np.zeros(2, np.float32), np.zeros(2, np.float32)
    plan = gf.plan({"x": a, "y": b, "z": a})
    g = {"x": np.full(2, 3, np.float32), "y": None, "z": np.full(2, 13, np.float32)}
    assert gf.flatten(plan, g, backend="emulated").tolist() == [16, 16, 0, 0]


def test_negative_zero_survives_a_lone_source(be):
    plan, leaves = planned([np.array([-0.0, 0.0]), np.array([-0.0])])
    out = gather(be, plan, [[leaves[0]], [leaves[1], leaves[1]]])
    assert same(out, np.array([-0.0, 0.0, -0.0]))


def test_ten_thousand_tiny_leaves(be):
    rng = np.random.default_rng(5)
    arrays = [rand(int(n), np.float32, rng) for n in rng.integers(0, 12, 10_000)]
    plan, leaves = planned(arrays)
    t0 = time.perf_counter()
    out = gather(be, plan, [[a] for a in leaves])
    result = be.norms(plan, leaves, 2, True)
    elapsed = time.perf_counter() - t0
    assert same(out, ref_gather(plan, [[a] for a in leaves]))
    check_norm(result, leaves, 2)
    assert be.stats.launches == 3
    assert elapsed < 60



def test_a_repeated_norm_of_ten_thousand_leaves_uploads_nothing(be):
    # 10,000 leaves of 100 float32 (10,000 work items): the first norm
    # uploads the plan's static table and the leaves' table; a repeat over
    # the same arrays finds both kept and launches the one-launch norm
    # (gpuflat_norm_one) alone, with the same bits.
    rng = np.random.default_rng(15)
    arrays = [rand(100, np.float32, rng) for _ in range(10_000)]
    plan, leaves = planned(arrays)
    first = be.norms(plan, leaves, 2, False)
    assert be.stats.uploads == 2
    before = be.stats.snapshot()
    again = be.norms(plan, leaves, 2, False)
    launches, syncs, uploads = (a - b for a, b in zip(be.stats.snapshot(), before))
    assert (launches, syncs, uploads) == (1, 0, 0)
    assert same(again.total, first.total) and int(again.first_nonfinite) == -1
    check_norm(be.norms(plan, leaves, 2, True), leaves, 2)

# ---------------------------------------------------------------- norms

ORDS = [1, 2, math.inf, 3.5, 0.5]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_norms_every_dtype_and_ord(be, dtype):
    rng = np.random.default_rng(6)
    arrays = [rand(n, dtype, rng) for n in (ITEM * 17 + 5, ITEM - 1, 0, 1)] + [rand((), dtype, rng)]
    plan, leaves = planned(arrays)
    for p in ORDS:
        r = be.norms(plan, leaves, p, True)
        assert r.total.shape == () and r.total.dtype == np.float64
        assert r.per_leaf.shape == (len(leaves),) and r.per_leaf.dtype == np.float64
        assert r.first_nonfinite.dtype == np.int64 and int(r.first_nonfinite) == -1
        check_norm(r, leaves, p)
        assert r.per_leaf[2] == 0.0  # the empty leaf
    assert be.stats.launches == 2 * len(ORDS)


def test_norms_of_strided_and_mixed_leaves(be):
    rng = np.random.default_rng(7)
    arrays = _strided_views(rng, np.float32) + [rand(50, d, rng) for d in DTYPES]
    plan, leaves = planned(arrays)
    for p in (1, 2, math.inf, 3.0):
        check_norm(be.norms(plan, leaves, p, True), leaves, p)


def test_squares_that_overflow_the_input_dtype(be):
    big32 = np.full(ITEM + 3, 1e30, np.float32)
    big16 = np.full(100, 300.0, np.float16)  # 300**2 > float16 max
    plan, leaves = planned([big32, big16])
    r = be.norms(plan, leaves, 2, True)
    assert np.isfinite(r.total) and int(r.first_nonfinite) == -1
    check_norm(r, leaves, 2)


def test_nan_and_inf(be):
    cases = nonfinite_cases(ITEM)
    for arrays, first in cases:
        plan, leaves = planned(arrays)
        for p in ORDS:
            r = be.norms(plan, leaves, p, True)
            assert int(r.first_nonfinite) == first
            check_norm(r, leaves, p)
    # inf-norm: NaN anywhere in a slot makes that slot, and the total, NaN.
    _, with_inf, with_nan = cases[0][0]
    plan, leaves = planned([with_inf, with_nan])
    r = be.norms(plan, leaves, math.inf, True)
    assert r.per_leaf[0] == np.inf and np.isnan(r.per_leaf[1]) and np.isnan(r.total)


def test_empty_plan(be):
    plan, leaves = planned([np.zeros(0, np.float32), np.zeros((2, 0))])
    r = be.norms(plan, leaves, 2, True)
    assert float(r.total) == 0.0 and r.per_leaf.tolist() == [0.0, 0.0] and int(r.first_nonfinite) == -1
    out = gather(be, plan, [[a] for a in leaves])
    assert out.size == 0


@pytest.mark.parametrize("p", [1, 2, math.inf, 2.5])
def test_same_bits_for_any_grid_and_alignment(p):
    rng = np.random.default_rng(8)
    arrays = [rand(ITEM * 20 + 11, np.float32, rng), rand(ITEM * 3, np.float16, rng), rand(999, np.complex64, rng)]
    arrays += [rand(int(n), np.float64, rng) for n in rng.integers(1, 50, 40)]
    plan, leaves = planned(arrays)
    results = []
    for grid in (1, 3, 7):
        r = CudaBackend(_RUNTIME, grid=grid).norms(plan, leaves, p, True)
        results.append((r.total.tobytes(), r.per_leaf.tobytes()))
    assert results[0] == results[1] == results[2]
    # The same values at a misaligned address take the element-wise path: same bits.
    moved = []
    for a in leaves:
        buf = np.empty(a.size + 1, a.dtype)[1:]
        buf[...] = a.ravel()
        moved.append(buf.reshape(a.shape))
    r = CudaBackend(_RUNTIME, grid=2).norms(plan, moved, p, True)
    assert (r.total.tobytes(), r.per_leaf.tobytes()) == results[0]


def _tiny_leaf_trees(rng):
    """(name, arrays) of trees whose slots mostly hold one work item each, in
    counts on and around multiples of the finishing block's 256 threads and
    of the slots one of its threads takes at once: slot s's item is item s;
    the same shifted by empty leaves (slot s's item is not item s), with
    slots of 2, 16 and 17 items among them; NaN and inf in a few slots."""
    trees = []
    for n in (1, 255, 256, 257, 2047, 2049, 4613):
        trees.append((f"one item each, {n}", [rand(int(k), np.float32, rng) for k in rng.integers(1, 8, n)]))
    arrays = [rand(int(k), np.float32, rng) for k in rng.integers(0, 8, 3000)]
    arrays[0] = np.zeros(0, np.float32)
    for i, items in ((5, 2), (700, 16), (1500, 17), (2900, 3)):
        arrays[i] = rand(items * ITEM - 1, np.float32, rng)
    arrays[2600] = rand(3, np.float32, rng)
    trees.append(("empty and multi-item leaves", arrays))
    bad = [a.copy() for a in arrays]
    bad[1500][0], bad[2600][-1], bad[700][15 * ITEM] = np.inf, np.nan, np.nan
    trees.append(("NaN and inf", bad))
    bad = [a.copy() for a in trees[6][1]]
    bad[2100][0], bad[300][-1] = np.nan, -np.inf
    trees.append(("NaN and inf in one-item slots", bad))
    return trees


@pytest.mark.parametrize("p", [1, 2, math.inf, 3])
def test_finisher_gives_the_host_backends_bits_for_trees_of_tiny_leaves(p):
    """The host backend finishes the norm on one thread in the finishing
    block's order: the same bits for every slot, the total and its unrooted
    sum, and the same first non-finite slot (a NaN only has to be a NaN)."""
    from gpuflat._src.backends.host import HostBackend

    for name, arrays in _tiny_leaf_trees(np.random.default_rng(17)):
        plan, leaves = planned(arrays)
        got = CudaBackend(_RUNTIME, grid=3).norms(plan, leaves, p, True)
        want = HostBackend().norms(plan, leaves, p, True)
        for field in ("total", "per_leaf", "power_sum"):
            assert same(getattr(got, field), getattr(want, field)), (name, field)
        assert int(got.first_nonfinite) == int(want.first_nonfinite), name
    assert int(got.first_nonfinite) == 300


# ---------------------------------------------------------------- clipping

@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_clip_scales_on_device(be, dtype):
    rng = np.random.default_rng(10)
    arrays = [rand(n, dtype, rng, scale=10) for n in (ITEM + 1, 5, 0)] + [rand((), dtype, rng)]
    plan, leaves = planned(arrays)
    before = [a.copy() for a in leaves]
    r = be.norms(plan, leaves, 2, False)
    be.stats.reset()
    be.clip_(plan, leaves, r.total, 1.0, 1e-6)
    assert be.stats.snapshot() == (1, 0, 0)  # one launch, no sync, table reused from norms
    coef = min(1.0, 1.0 / (float(r.total) + 1e-6))
    for a, b in zip(leaves, before):
        assert same(a, torch_scaled(b, coef))


def test_clip_below_the_threshold_and_with_nan_total(be):
    g = [np.array([3.0, 4.0], np.float32), np.array([np.nan, 1.0])]
    plan, leaves = planned(g)
    r = be.norms(plan, leaves, 2, False)
    be.clip_(plan, leaves, r.total, 1.0, 1e-6)
    assert np.isnan(leaves[0]).all() and np.isnan(leaves[1]).all()  # PyTorch: NaN norm -> NaN grads
    g = [np.array([0.3, 0.4], np.float32)]
    plan, leaves = planned(g)
    r = be.norms(plan, leaves, 2, False)
    be.clip_(plan, leaves, r.total, 1.0, 1e-6)
    assert leaves[0].tolist() == [np.float32(0.3), np.float32(0.4)]


def test_clip_through_the_public_api():
    g = {"w": np.array([3.0, 4.0]), "b": np.zeros(1, np.float32), "h": np.full(ITEM + 1, 0.0, np.float16)}
    total = gf.clip_grad_norm_(g, 1.0, backend="emulated")
    assert float(total) == 5.0
    np.testing.assert_allclose(g["w"], [0.6, 0.8], rtol=1e-6)


# ---------------------------------------------------------------- counts

def test_launch_sync_and_upload_counts(be):
    rng = np.random.default_rng(11)
    arrays = [rand(n, np.float32, rng) for n in (ITEM * 3 + 1, 10, 0, 1)]
    plan, leaves = planned(arrays)
    stats = be.stats

    def count(fn):
        stats.reset()
        fn()
        return stats.snapshot()

    out = np.empty(plan.size, plan.dtype)
    assert count(lambda: be.gather(plan, [[a] for a in leaves], out)) == (1, 0, 2)  # plan + sources
    assert count(lambda: be.gather(plan, [[a] for a in leaves], out)) == (1, 0, 0)
    assert count(lambda: be.scatter(plan, out, leaves)) == (1, 0, 0)  # same pointer table
    holder = {}
    assert count(lambda: holder.update(r=be.norms(plan, leaves, 2, True))) == (2, 0, 0)
    assert count(lambda: be.clip_(plan, leaves, holder["r"].total, 1.0, 1e-6)) == (1, 0, 0)
    # A new array at one slot: the pointer table goes up again, once.
    leaves2 = list(leaves)
    leaves2[1] = leaves[1].copy()
    assert count(lambda: be.norms(plan, leaves2, 2, True)) == (2, 0, 1)
    assert count(lambda: be.norms(plan, leaves2, 2, True)) == (2, 0, 0)
    # A different stride for the same shape is a new table too.
    leaves3 = list(leaves)
    leaves3[0] = np.empty(leaves[0].size * 2, np.float32)[::2]
    assert count(lambda: be.norms(plan, leaves3, 2, True)) == (2, 0, 1)
    # Ties: the CSR rides in the same upload.
    assert count(lambda: be.gather(plan, [[leaves[0], leaves[0]], [], [leaves[2]], [leaves[3]]], out)) == (1, 0, 1)
    # error_if_nonfinite is the one synchronisation.
    assert count(lambda: int(be.to_host(holder["r"].first_nonfinite))) == (0, 1, 0)


def test_public_api_on_the_emulated_backend_matches_numpy():
    rng = np.random.default_rng(12)
    tree = {"a": rand((30, 40), np.float32, rng), "b": [rand(ITEM + 2, np.float64, rng), rand(3, np.float16, rng)]}
    for p in (1, 2, math.inf):
        e_total, e_per = gf.global_norm(tree, p, per_leaf=True, backend="emulated")
        n_total, n_per = gf.global_norm(tree, p, per_leaf=True, backend="numpy")
        np.testing.assert_allclose(e_total, n_total, rtol=1e-13)
        np.testing.assert_allclose(e_per, n_per, rtol=1e-13)
    flat_e, re_e = gf.destructure(tree, backend="emulated")
    flat_n, _ = gf.destructure(tree, backend="numpy")
    assert same(flat_e, flat_n)
    rebuilt = re_e(flat_e * 2)
    assert same(rebuilt["b"][1], (tree["b"][1].astype(np.float64) * 2).astype(np.float16))


def test_bad_ord_is_rejected(be):
    plan, leaves = planned([np.ones(3)])
    for bad in (0, -1, math.nan):
        with pytest.raises(ValueError, match="ord"):
            be.norms(plan, leaves, bad, True)


def test_plan_items_split_big_leaves_and_keep_tiny_ones_whole():
    plan, _ = planned([np.zeros(2 * ITEM + 1), np.zeros(0), np.zeros(()), np.zeros(5)])
    items = cuda.plan_items(plan)
    assert items.tolist() == [[0, 0, ITEM, 0], [0, ITEM, ITEM, ITEM], [0, 2 * ITEM, 1, 2 * ITEM],
                              [2, 0, 1, 2 * ITEM + 1], [3, 0, 5, 2 * ITEM + 2]]


# ---------------------------------------------------------------- on a real GPU

_cp = cupy_with_device()
gpu = pytest.mark.skipif(_cp is None, reason="needs CuPy and a CUDA device")


@pytest.mark.gpu
@gpu
def test_gpu_gives_the_emulated_bits():
    """The same tables and launches on a GPU: the same bits as the emulator
    (both compile a*b+c as two roundings), except ulps in pow and hypot."""
    from gpuflat._src.backends.cuda_runtime import CupyRuntime

    cp = _cp
    gbe, ebe = CudaBackend(CupyRuntime()), CudaBackend(_RUNTIME)
    rng = np.random.default_rng(13)
    host = [rand(n, d, rng) for d in DTYPES for n in (ITEM - 1, ITEM * 3 + 1, 3, 0)] + [rand((), np.float32, rng)]
    bases = [rand((70, 90), np.float32, rng), rand((6, 7, 8), np.complex64, rng), rand((50, 9), np.float16, rng)]
    dbases = [cp.asarray(b) for b in bases]
    host += [bases[0].T, bases[1].transpose(2, 0, 1)[1:, ::2], bases[2][::-1, 1::2]]
    dev = [cp.asarray(a) for a in host[: -3]] + [dbases[0].T, dbases[1].transpose(2, 0, 1)[1:, ::2],
                                                  dbases[2][::-1, 1::2]]
    plan, leaves = planned(host)
    real = [i for i, a in enumerate(host) if a.dtype.kind != "c"]

    out_e = gather(ebe, plan, [[a] for a in leaves])
    out_g = cp.empty(plan.size, plan.dtype)
    gbe.stats.reset()
    gbe.gather(plan, [[a] for a in dev], out_g)
    assert gbe.stats.launches == 1 and gbe.stats.syncs == 0
    assert same(cp.asnumpy(out_g), out_e)

    for p in (1, 2, math.inf, 3.5):
        re_, rg = ebe.norms(plan, leaves, p, True), gbe.norms(plan, dev, p, True)
        rg2 = CudaBackend(gbe.runtime, grid=3).norms(plan, dev, p, True)
        per_g = cp.asnumpy(rg.per_leaf)
        assert per_g.tobytes() == cp.asnumpy(rg2.per_leaf).tobytes()  # any grid, same bits
        if p != 3.5:
            assert same(per_g[real], re_.per_leaf[real])
        np.testing.assert_allclose(per_g, re_.per_leaf, rtol=1e-14)
        np.testing.assert_allclose(cp.asnumpy(rg.total), re_.total, rtol=1e-14)
        assert int(cp.asnumpy(rg.first_nonfinite)) == -1

    flat = rand(plan.size, plan.dtype, rng)
    back_e = [np.zeros_like(a) for a in host[:-3]] + [v.copy() for v in host[-3:]]
    back_g = [cp.asarray(a) for a in back_e[:-3]] + dev[-3:]
    ebe.scatter(plan, flat, back_e)
    gbe.scatter(plan, cp.asarray(flat), back_g)
    for a, b in zip(back_e, back_g):
        assert same(cp.asnumpy(b), a)

    r = gbe.norms(plan, back_g, 2, False)
    gbe.stats.reset()
    gbe.clip_(plan, back_g, r.total, 1.0, 1e-6)
    assert gbe.stats.snapshot() == (1, 0, 0)
    ebe.clip_(plan, back_e, ebe.norms(plan, back_e, 2, False).total, 1.0, 1e-6)
    for a, b in zip(back_e, back_g):
        np.testing.assert_allclose(cp.asnumpy(b).astype(np.complex128), a.astype(np.complex128), rtol=1e-6)


def test_work_items_past_two_to_the_31_are_exact_int64():
    # The kernels index with the table's int64 fields; prove the table is
    # right past 2**31 elements without allocating them (0-strided views).
    huge = 2**31 + 5
    tree = [np.broadcast_to(np.zeros(1, np.float32), (huge,)), np.zeros(3, np.float32),
            np.broadcast_to(np.zeros(1, np.float32), (2, 2**31))]
    items = cuda.plan_items(gf.plan(tree))
    assert items.dtype == np.int64
    first_small = -(-huge // ITEM)
    assert items[first_small - 1].tolist() == [0, (first_small - 1) * ITEM, huge - (first_small - 1) * ITEM,
                                               (first_small - 1) * ITEM]
    assert items[first_small].tolist() == [1, 0, 3, huge]
    last = items[-1].tolist()
    assert last[0] == 2 and last[1] + last[2] == 2**32 and last[3] + last[2] == huge + 3 + 2**32
    assert int(items[:, 2].sum()) == huge + 3 + 2**32


def test_per_call_tables_keep_no_array_alive_and_follow_new_arrays():
    import gc
    import weakref

    be = get_backend("emulated")
    tree = [np.ones(5, np.float32), np.ones(3)]
    plan = gf.plan(tree)
    be.norms(plan, tree, 2.0, per_leaf=False)
    ref = weakref.ref(tree[0])
    del tree
    gc.collect()
    assert ref() is None  # the cache held no strong reference
    # New arrays (perhaps at recycled ids or addresses) get their own values.
    for fill in (2.0, 3.0, 4.0):
        fresh = [np.full(5, fill, np.float32), np.full(3, fill)]
        got = float(be.norms(plan, fresh, 2.0, per_leaf=False).total)
        assert got == pytest.approx(fill * math.sqrt(8))


def test_row_stats_reuse_their_scratch_with_the_step_tables():
    # A step with stats: the update, the finisher and the step counts (3
    # launches, no synchronisation); its scratch is uploaded once with the
    # step's tables, so a repeated step uploads nothing and gives the same
    # stats, whatever the grid.
    from gpuflat._src.layout import PARAM_ROW_FIELDS, RULES

    def table():
        rng = np.random.default_rng(0)
        tensors = [{k: rng.standard_normal(n).astype(np.float32) if k != "step" else np.zeros(1, np.float32)
                    for k in ("p", "g", "m", "v", "step")} for n in (ITEM + 5, 0, 7)]
        for t in tensors:
            t["m"][...], t["v"][...] = 0.0, 0.0
        rows = np.zeros((len(tensors), len(PARAM_ROW_FIELDS)), np.int64)
        for i, t in enumerate(tensors):
            for field, k in (("param", "p"), ("grad", "g"), ("state0", "m"), ("state1", "v"), ("step", "step")):
                rows[i, PARAM_ROW_FIELDS.index(field)] = t[k].ctypes.data
            rows[i, PARAM_ROW_FIELDS.index("numel")] = t["p"].size
        return tensors, rows

    hyper = RULES["adamw"].hyper_rows([{"lr": 0.01, "weight_decay": 0.1, "betas": (0.9, 0.99), "eps": 1e-8}])
    found = []
    for grid in (None, 1):
        be = CudaBackend(EmulatedRuntime(), grid=grid)
        tensors, rows = table()
        stats = np.full((3, 2), np.nan)
        be.step_rows("adamw", 2, rows, hyper, np.zeros(2, np.int64), None, 0.0, 0.0, np.array([1.0, 0.0]), stats)
        launches, uploads = be.stats.launches, be.stats.uploads
        found.append(stats.copy())
        for t, b in zip(tensors, table()[0]):  # back to the values before, in place
            for k in t:
                t[k][...] = b[k]
        be.step_rows("adamw", 2, rows, hyper, np.zeros(2, np.int64), None, 0.0, 0.0, np.array([1.0, 0.0]), stats)
        assert (be.stats.launches - launches, be.stats.uploads - uploads, be.stats.syncs) == (3, 0, 0)
        assert stats.tobytes() == found[-1].tobytes() and stats[1].tolist() == [0.0, 0.0] and (stats[[0, 2]] > 0).all()
    assert found[0].tobytes() == found[1].tobytes()
