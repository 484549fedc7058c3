"""The CUDA backend through CuPy (a GPU, or the stand-in) against the NumPy and emulated backends.

Every test runs twice. "cupy": on real CuPy, marked ``gpu`` and skipped
where CuPy is missing or sees no device. "stand-in": on the contract check
of CuPy (tests/cupy_stand_in.py), whose arrays live in host memory and whose
launches run the same kernels on the host emulator, so CI executes every
test body and every CuPy call gpuflat makes; the few tests that need the
hardware itself (memory, the pool) are marked ``gpu`` and skip there.
Trees are built twice from the same host bases: NumPy views of
them, and CuPy views of their device copies, with the same slicing done on
the device (transposed, sliced, negative strides). Then:

- flatten, destructure / re, unflatten and scatter give the NumPy backend's
  bits on the host copies;
- norms (ord 1, 2, inf, 3) give the emulated backend's bits for 1, 2 and inf
  (both compile a*b+c as two roundings; only hypot, used by the 1- and
  inf-norms of complex leaves, and pow may differ in the last place), and
  are within 1e-12 of an exact float64 reference;
- clip_grad_norm_ gives the emulated backend's bits, in 3 launches and no
  synchronisation (1 with error_if_nonfinite);
- repeats and grids change no bit; a leaf of 2**31 + 1000 elements is normed,
  clipped and flattened exactly; 1,000 clips leave the memory pool flat;
- subnormals give the emulated backend's bits (the GPU runs the cubin built
  without flush-to-zero); tables uploaded on one stream serve launches on
  other streams and on an ExternalStream.
"""
from __future__ import annotations

import math
import sys
import time

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src.backends import selection as backends_selection
from gpuflat._src.backends import get_backend
from gpuflat._src.backends.cuda import ITEM, CudaBackend

import cupy_stand_in
from conftest import BF16, DTYPES, cupy_with_device, exact_norm, nonfinite_cases, random_array, rel_err


# The CuPy of the running variant (set by the ``cupy_variant`` fixture); the
# helpers below use it as the tests do.
cp = None
ON_STAND_IN = False


@pytest.fixture(scope="module", autouse=True, params=[pytest.param("cupy", marks=pytest.mark.gpu), "stand-in"])
def cupy_variant(request):
    """Every test twice: on real CuPy (marked gpu, skipped without a device),
    and on the contract check of CuPy, which runs the kernels on the host
    emulator (no GPU needed, so CI runs it)."""
    global cp, ON_STAND_IN
    module = cupy_with_device() if request.param == "cupy" else cupy_stand_in.make_cupy(("90", "80"))
    if module is None:
        pytest.skip("needs CuPy and a CUDA device")
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(sys.modules, "cupy", module)
        # The "cuda" backends hold the CuPy they were made with: start from none.
        mp.setattr(backends_selection, "_backends", {})
        cp, ON_STAND_IN = module, request.param == "stand-in"
        yield request.param
        cp, ON_STAND_IN = None, False


def needs_real_gpu(reason):
    """Skip on the stand-in (the test is marked gpu, so it may): ``reason`` is what only a GPU gives."""
    if ON_STAND_IN:
        pytest.skip(f"needs a real GPU: {reason}")


def _cupy_holds_bf16() -> bool:
    """CuPy 14 holds ml_dtypes' bfloat16; CuPy 13 refuses the dtype."""
    if BF16 is None:
        return False
    try:
        host = np.array([1.5, -2.0, 0.0], BF16)
        dev = cp.asarray(host)
        empty = cp.empty(3, BF16)
        return dev.dtype == BF16 and empty.dtype == BF16 and cp.asnumpy(dev[::-1]).tobytes() == host[::-1].tobytes()
    except Exception:
        return False


IDS = [str(d) for d in DTYPES]
ORDS = [1, 2, math.inf, 3]


def need_dtype(dtype):
    if np.dtype(dtype) == BF16 and not _cupy_holds_bf16():
        pytest.skip("this CuPy cannot hold ml_dtypes.bfloat16 arrays (CuPy 14 can)")


def device_dtypes():
    return [d for d in DTYPES if d != BF16 or _cupy_holds_bf16()]


# ---------------------------------------------------------------- comparisons

def host(x):
    """A CuPy array (or anything) as a NumPy array."""
    return cp.asnumpy(x) if isinstance(x, cp.ndarray) else np.asarray(x)


def assert_same(got, want, what=""):
    """Bit-equal values: -0.0 is not 0.0; any NaN equals any NaN (payloads differ between devices)."""
    got, want = host(got), host(want)
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if got.dtype.kind == "c":
        assert_same(got.real, want.real, f"{what}.real")
        assert_same(got.imag, want.imag, f"{what}.imag")
        return
    g, w = got.astype(np.float64), want.astype(np.float64)  # exact for every float dtype
    ok = (np.isnan(g) & np.isnan(w)) | ((g == w) & (np.signbit(g) == np.signbit(w)))
    if not ok.all():
        bad = np.flatnonzero(~ok.reshape(-1))
        raise AssertionError(f"{what}: {bad.size} elements differ, first at {bad[0]}: "
                             f"{g.reshape(-1)[bad[0]]!r} != {w.reshape(-1)[bad[0]]!r}")


def assert_near_exact(got, ref, what=""):
    """Within 1e-12 of an exact reference; NaN where it is NaN, inf where it is inf."""
    x = float(host(got))
    if math.isnan(ref) or math.isinf(ref):
        assert x == ref or (math.isnan(x) and math.isnan(ref)), (what, x, ref)
    else:
        assert rel_err(x, ref) < 1e-12, (what, x, ref)


def assert_close(got, want, rtol, what=""):
    np.testing.assert_allclose(host(got), host(want), rtol=rtol, atol=0, equal_nan=True, err_msg=what)


# ---------------------------------------------------------------- twin trees

# layout: (shape of the base for a view of `shape`, the view of a base). The
# same view is taken of the host base and, on the device, of its copy.
LAYOUTS = {
    "c": (lambda s: s, lambda b: b),
    "transposed": (lambda s: tuple(reversed(s)), lambda b: b.T),
    "sliced": (lambda s: tuple(2 * n + 1 for n in s),
               lambda b: b[tuple(slice(1, None, 2) for _ in range(b.ndim))]),
    "reversed": (lambda s: s, lambda b: b[tuple(slice(None, None, -1) for _ in range(b.ndim))]),
    "negative": (lambda s: (2 * s[0], s[1] + 3), lambda b: b[::-2, 3:]),  # negative stride and an offset
}


def leaves_for(dtype):
    """(shape, dtype, layout) of a tree: sizes on and around ITEM, empty, 0-d, big, strided."""
    return [((ITEM - 1,), dtype, "c"), ((ITEM,), dtype, "c"), ((ITEM + 1,), dtype, "c"),
            ((0,), dtype, "c"), ((2, 0), dtype, "c"), ((), dtype, "c"), ((3 * ITEM + 5,), dtype, "c"),
            ((3, ITEM // 2 + 1), dtype, "transposed"), ((5, 7), dtype, "sliced"),
            ((ITEM + 3,), dtype, "reversed"), ((40, 50), dtype, "negative"),
            ((2, 3, 4), dtype, "transposed")]


def make(seed, specs, scale=1.0, device=True):
    """(host leaves, device leaves or None): the same values, the same layouts."""
    rng = np.random.default_rng(seed)
    hosts, devs = [], []
    for shape, dtype, layout in specs:
        base_shape, view = LAYOUTS[layout if len(shape) else "c"]
        # np.asarray: random_array gives a NumPy scalar, not a 0-d array, for complex shape ().
        base = np.asarray(random_array(rng, base_shape(shape), dtype, scale))
        hosts.append(view(base))
        if device:
            devs.append(view(cp.asarray(base)))
    return hosts, (devs if device else None)


def tree_of(leaves, tie=True):
    """A dict tree holding ``leaves`` in order, leaf 0 tied at a second place, and statics."""
    tree = {f"l{i:05d}": a for i, a in enumerate(leaves)}
    if tie and leaves:
        tree["again"] = (leaves[0], "relu", None)
    return tree


def twins(seed, specs, scale=1.0, tie=True):
    """(device tree, host tree for the NumPy backend, host tree for the emulated backend)."""
    h1, d = make(seed, specs, scale)
    h2, _ = make(seed, specs, scale, device=False)
    return tree_of(d, tie), tree_of(h1, tie), tree_of(h2, tie)


def leaves_of(tree):
    return gf.trainables(tree)


def cuda_backend():
    be = get_backend("cuda")
    assert be.xp is cp
    return be


# ---------------------------------------------------------------- flatten, destructure, unflatten, scatter

@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_flatten_destructure_unflatten_scatter_every_dtype(dtype):
    need_dtype(dtype)
    dev, hst, _ = twins(1, leaves_for(dtype))
    plan = gf.plan(dev)
    assert gf.plan(hst) == plan  # one structure, one plan, whatever the device

    flat_d, re_d = gf.destructure(dev)
    flat_h, re_h = gf.destructure(hst, backend="numpy")
    assert isinstance(flat_d, cp.ndarray) and flat_d.dtype == dtype and flat_d.shape == (plan.size,)
    assert_same(flat_d, flat_h, "destructure")
    assert_same(gf.flatten(plan, dev, backend="cuda"), flat_h, "plan.flatten")
    out = cp.full(plan.size, 7, flat_d.dtype) if dtype != BF16 else cp.empty(plan.size, dtype)
    assert gf.flatten(plan, dev, out=out) is out
    assert_same(out, flat_h, "gf.flatten(plan, out=)")

    # re: new arrays, cast back, the tie kept as one object.
    rng = np.random.default_rng(2)
    new_h = random_array(rng, (plan.size,), dtype)
    t_d, t_h = re_d(cp.asarray(new_h)), re_h(new_h)
    assert t_d["again"][0] is t_d["l00000"] and t_d["again"][1] == "relu"
    for (p1, a), (p2, b) in zip(gf.trainables(t_d, path=True), gf.trainables(t_h, path=True)):
        assert p1 == p2 and isinstance(a, cp.ndarray)
        assert_same(a, b, f"re {p1}")
    for a, b in zip(leaves_of(t_d), leaves_of(dev)):
        assert a is not b

    # unflatten: views into the buffer (the resident model), same values.
    resident = gf.unflatten(plan, flat_d)
    assert resident["again"][0] is resident["l00000"]
    for leaf, v in zip(plan.leaves, leaves_of(resident)):
        assert isinstance(v, cp.ndarray) and v.shape == leaf.shape
        if leaf.size:
            assert v.data.ptr == flat_d.data.ptr + leaf.offset * flat_d.itemsize
    for (path, a), b in zip(gf.trainables(resident, path=True), leaves_of(hst)):
        assert_same(a, b, f"unflatten {path}")

    # scatter: into the tree's own (strided, device-sliced) arrays, in place.
    before = [id(a) for a in leaves_of(dev)]
    gf.scatter(plan, cp.asarray(new_h), dev)
    gf.scatter(plan, new_h, hst, backend="numpy")
    assert [id(a) for a in leaves_of(dev)] == before
    for (path, a), b in zip(gf.trainables(dev, path=True), leaves_of(hst)):
        assert_same(a, b, f"scatter {path}")


def test_mixed_dtypes_and_layouts():
    dtypes = device_dtypes()
    specs = [(shape, d, layout) for d in dtypes
             for shape, layout in [((ITEM + 1,), "c"), ((3, 5), "transposed"), ((4, 6), "negative"), ((), "c")]]
    dev, hst, emu = twins(3, specs)
    plan = gf.plan(dev)
    flat_d, re_d = gf.destructure(dev)
    flat_h, re_h = gf.destructure(hst, backend="numpy")
    assert flat_d.dtype == flat_h.dtype == plan.dtype
    assert_same(flat_d, flat_h, "destructure")

    # Values every leaf dtype holds exactly come back the same through re on both backends.
    exact = (np.arange(plan.size) % 64 - 32).astype(plan.dtype) * plan.dtype.type(0.25)
    for (path, a), b in zip(gf.trainables(re_d(cp.asarray(exact)), path=True), leaves_of(re_h(exact))):
        assert_same(a, b, f"re {path}")
    # Values that round going back (float64 / complex128 into 16-bit leaves): the kernels' one rounding,
    # which the emulated backend computes the same way.
    rng = np.random.default_rng(4)
    noisy = random_array(rng, (plan.size,), plan.dtype)
    t_d, t_e = re_d(cp.asarray(noisy)), gf.destructure(emu, backend="emulated")[1](noisy)
    for (path, a), b in zip(gf.trainables(t_d, path=True), leaves_of(t_e)):
        assert_same(a, b, f"re (rounding) {path}")

    for p in ORDS:
        _check_norms(dev, emu, p)
    n_d = gf.clip_grad_norm_(dev, 0.25)
    n_e = gf.clip_grad_norm_(emu, 0.25, backend="emulated")
    assert_same(n_d, n_e, "clip norm")
    for (path, a), b in zip(gf.trainables(dev, path=True), leaves_of(emu)):
        assert_same(a, b, f"clipped {path}")


# ---------------------------------------------------------------- norms

def _check_norms(dev, emu, p):
    """gf.global_norm on the device against the emulated backend and an exact reference."""
    total_d, per_d = gf.global_norm(dev, p, per_leaf=True)
    total_e, per_e = gf.global_norm(emu, p, per_leaf=True, backend="emulated")
    assert isinstance(total_d, cp.ndarray) and total_d.shape == () and total_d.dtype == np.float64
    assert per_d.dtype == np.float64 and per_d.shape == (len(leaves_of(emu)),)
    leaves = leaves_of(emu)
    cplx = np.array([a.dtype.kind == "c" for a in leaves], bool)
    per_d, per_e = host(per_d), host(per_e)
    if p == 2:
        assert_same(per_d, per_e, f"per-leaf {p}-norms")
        assert_same(total_d, total_e, f"total {p}-norm")
    elif p in (1, math.inf):
        # Real leaves: the same bits. Complex ones: |z| is hypot, whose CUDA and
        # C library versions may differ in the last place.
        assert_same(per_d[~cplx], per_e[~cplx], f"per-leaf {p}-norms")
        assert_close(per_d[cplx], per_e[cplx], 1e-15, f"complex per-leaf {p}-norms")
        if cplx.any():
            assert_close(total_d, total_e, 1e-15, f"total {p}-norm")
        else:
            assert_same(total_d, total_e, f"total {p}-norm")
    else:
        assert_close(per_d, per_e, 1e-14, f"per-leaf {p}-norms")
        assert_close(total_d, total_e, 1e-14, f"total {p}-norm")
    assert rel_err(host(total_d), exact_norm(leaves, p)) < 1e-12, p
    for i, a in enumerate(leaves):
        assert rel_err(per_d[i], exact_norm([a], p)) < 1e-12, (p, i)
    # per_leaf=False gives the same total bits.
    assert_same(gf.global_norm(dev, p), total_d, "total without per_leaf")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_norms_every_dtype(dtype):
    need_dtype(dtype)
    dev, _, emu = twins(5, leaves_for(dtype))
    for p in ORDS:
        _check_norms(dev, emu, p)
    # The fused totals follow the norms.
    assert_same(gf.total("l1", dev), gf.global_norm(dev, 1), "total l1")
    assert rel_err(host(gf.total("sumsq", dev)), exact_norm(leaves_of(emu)) ** 2) < 1e-12
    assert_same(gf.total("sumsq", dev), gf.total("sumsq", emu, backend="emulated"), "total sumsq")
    assert gf.total("count", dev) == sum(a.size for a in leaves_of(emu))


def test_sumsq_is_the_sum_of_squares_not_the_squared_norm():
    # sqrt(3) ** 2 rounds to 2.9999999999999996.
    assert float(host(gf.total("sumsq", [cp.asarray(np.ones(3))]))) == 3.0


def test_squares_that_overflow_the_input_dtype():
    big32 = np.full(ITEM + 3, 1e30, np.float32)
    big16 = np.full(100, 300.0, np.float16)  # 300**2 > float16 max
    dev = {"a": cp.asarray(big32), "b": cp.asarray(big16)[::-1]}
    emu = {"a": big32.copy(), "b": big16.copy()[::-1]}
    total, per = gf.global_norm(dev, per_leaf=True)
    assert math.isfinite(float(host(total)))
    assert_same(total, gf.global_norm(emu, backend="emulated"), "total")
    assert rel_err(host(total), exact_norm([big32, big16])) < 1e-12
    assert rel_err(host(per)[1], 300.0 * math.sqrt(100)) < 1e-15
    assert int(host(get_backend("cuda").norms(gf.plan(dev), leaves_of(dev), 2, False).first_nonfinite)) == -1
    n_d = gf.clip_grad_norm_(dev, 1.0)
    n_e = gf.clip_grad_norm_(emu, 1.0, backend="emulated")
    assert_same(n_d, n_e, "clip norm")
    assert_same(dev["a"], emu["a"], "clipped float32")
    assert_same(dev["b"], emu["b"], "clipped float16")


def test_nan_and_inf_name_the_first_leaf():
    be_d, be_e = get_backend("cuda"), get_backend("emulated")
    for arrays, first in nonfinite_cases(ITEM):
        emu = tree_of([a.copy() for a in arrays], tie=False)
        dev = tree_of([cp.asarray(a) for a in arrays], tie=False)
        plan = gf.plan(dev)
        for p in ORDS:
            r_d = be_d.norms(plan, leaves_of(dev), p, True)
            r_e = be_e.norms(plan, leaves_of(emu), p, True)
            assert int(host(r_d.first_nonfinite)) == first
            assert_close(r_d.per_leaf, r_e.per_leaf, 1e-14, f"per-leaf {p}")
            assert_close(r_d.total, r_e.total, 1e-14, f"total {p}")
            assert_near_exact(r_d.total, exact_norm(arrays, p), f"total {p}")
        if first < 0:
            continue
        # error_if_nonfinite names the first bad leaf and scales nothing.
        before = [host(a).tobytes() for a in leaves_of(dev)]
        with pytest.raises(gf.NonFiniteError, match=rf"leaf \"\['l{first:05d}'\]\" holds NaN or inf"):
            gf.clip_grad_norm_(dev, 1.0, error_if_nonfinite=True)
        assert [host(a).tobytes() for a in leaves_of(dev)] == before
        # Without it, PyTorch's semantics: a NaN or inf norm, applied anyway, as on the emulated device.
        n_d = gf.clip_grad_norm_(dev, 1.0)
        n_e = gf.clip_grad_norm_(emu, 1.0, backend="emulated")
        assert_same(n_d, n_e, "non-finite norm")
        for (path, a), b in zip(gf.trainables(dev, path=True), leaves_of(emu)):
            assert_same(a, b, f"clipped {path}")


# ---------------------------------------------------------------- clipping and counts

@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_clip_matches_the_emulated_device(dtype):
    need_dtype(dtype)
    dev, _, emu = twins(6, leaves_for(dtype), scale=10)
    for max_norm in (0.5, 1e9):  # clipped, then not (the factor clamps to 1)
        n_d = gf.clip_grad_norm_(dev, max_norm)
        n_e = gf.clip_grad_norm_(emu, max_norm, backend="emulated")
        assert isinstance(n_d, cp.ndarray) and n_d.shape == ()
        assert_same(n_d, n_e, f"norm (max_norm={max_norm})")
        for (path, a), b in zip(gf.trainables(dev, path=True), leaves_of(emu)):
            assert_same(a, b, f"clipped {path} (max_norm={max_norm})")
    assert dev["again"][0] is dev["l00000"]


def test_clip_resident_model_matches_the_emulated_device():
    dtype = np.float32
    dev, _, emu = twins(7, leaves_for(dtype), tie=False)
    plan = gf.plan(dev)
    res_d = gf.unflatten(plan, gf.flatten(plan, dev))
    res_e = gf.unflatten(plan, gf.flatten(plan, emu, backend="emulated"), backend="emulated")
    n_d = gf.clip_grad_norm_(res_d, 0.1)
    n_e = gf.clip_grad_norm_(res_e, 0.1, backend="emulated")
    assert_same(n_d, n_e, "resident norm")
    for (path, a), b in zip(gf.trainables(res_d, path=True), leaves_of(res_e)):
        assert_same(a, b, f"clipped resident {path}")


def test_a_mixed_dtype_resident_model_matches_the_emulated_device():
    rng = np.random.default_rng(8)
    shapes = {"a": ((300,), np.float32), "b": ((5, 7), np.float64), "c": ((9,), np.float16), "d": ((4,), np.float32)}
    host = {k: random_array(rng, shape, dtype) for k, (shape, dtype) in shapes.items()}
    r_d = gf.resident({k: cp.asarray(v) for k, v in host.items()})
    r_e = gf.resident(host, backend="emulated")
    for k, (shape, dtype) in shapes.items():
        g = random_array(rng, shape, dtype)
        r_d.grads[k][...] = cp.asarray(g)
        r_e.grads[k][...] = g
    r_d.grads["c"][3] = cp.asarray(np.float16(np.nan))  # a NaN step first
    r_e.grads["c"][3] = np.float16(np.nan)
    for r in (r_d, r_e):
        assert math.isnan(float(r.clip_grad_norm_(0.5)))
    for k, (shape, dtype) in shapes.items():
        g = random_array(rng, shape, dtype)
        r_d.grads[k][...] = cp.asarray(g)
        r_e.grads[k][...] = g
    for ord in (1, 2, math.inf):
        (t_d, per_d), (t_e, per_e) = r_d.grad_norm(ord, per_leaf=True), r_e.grad_norm(ord, per_leaf=True)
        assert_same(t_d, t_e, f"resident total, ord {ord}")
        assert_same(per_d, per_e, f"resident per leaf, ord {ord}")
    assert_same(r_d.clip_grad_norm_(0.5), r_e.clip_grad_norm_(0.5), "resident clip norm")
    for k in shapes:
        assert_same(r_d.grads[k], r_e.grads[k], f"clipped resident {k}")


def test_launch_sync_and_upload_counts():
    dev, _, _ = twins(8, leaves_for(np.float32))
    be = cuda_backend()
    stats = be.stats

    def count(fn):
        cp.cuda.get_current_stream().synchronize()
        stats.reset()
        fn()
        return stats.snapshot()  # (launches, syncs, uploads)

    plan = gf.plan(dev)
    out = cp.empty(plan.size, plan.dtype)
    count(lambda: gf.flatten(plan, dev, out=out))  # first call: the plan's tables go up
    assert count(lambda: gf.flatten(plan, dev, out=out)) == (1, 0, 0)
    # The norms read strided leaves in memory order: their own table, uploaded once.
    count(lambda: gf.global_norm(dev, per_leaf=True))
    assert count(lambda: gf.global_norm(dev, per_leaf=True)) == (2, 0, 0)
    # Without per-leaf norms, one launch: the last block to finish adds the partials.
    assert count(lambda: gf.global_norm(dev, math.inf)) == (1, 0, 0)
    count(lambda: gf.clip_grad_norm_(dev, 1.0))
    assert count(lambda: gf.clip_grad_norm_(dev, 1.0)) == (2, 0, 0)  # norm 1 + scale 1, no sync, no upload
    assert count(lambda: gf.clip_grad_norm_(dev, 1.0, error_if_nonfinite=True)) == (2, 1, 0)
    assert count(lambda: gf.scatter(plan, out, dev)) == (1, 0, 0)


def test_ten_thousand_tiny_leaves():
    rng = np.random.default_rng(9)
    sizes = rng.integers(0, 12, 10_000)
    specs = [((int(n),), np.float32, "c" if i % 3 else "reversed") for i, n in enumerate(sizes)]
    dev, hst, emu = twins(10, specs, tie=False)
    be = cuda_backend()
    plan = gf.plan(dev)
    t0 = time.perf_counter()
    be.stats.reset()
    flat = gf.flatten(plan, dev)
    total, per = gf.global_norm(dev, per_leaf=True)
    assert be.stats.launches == 3 and be.stats.syncs == 0
    assert_same(flat, gf.flatten(plan, hst, backend="numpy"), "flatten")
    total_e, per_e = gf.global_norm(emu, per_leaf=True, backend="emulated")
    assert_same(per, per_e, "per-leaf norms")
    assert_same(total, total_e, "total")
    assert rel_err(host(total), exact_norm(leaves_of(emu))) < 1e-12
    be.stats.reset()
    n_d = gf.clip_grad_norm_(dev, 1.0)
    assert be.stats.launches == 2  # the norm in one launch, then the scale
    n_e = gf.clip_grad_norm_(emu, 1.0, backend="emulated")
    assert_same(n_d, n_e, "clip norm")
    assert_same(gf.flatten(plan, dev), gf.flatten(plan, emu, backend="emulated"), "clipped leaves")
    assert time.perf_counter() - t0 < 60


# ---------------------------------------------------------------- ties

@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_tied_gradients_follow_the_contract(dtype):
    need_dtype(dtype)
    a, b = cp.asarray(np.zeros(2, dtype)), cp.asarray(np.zeros(2, dtype))
    model = {"x": a, "y": b, "z": a}
    grads = {"x": cp.asarray(np.full(2, 3, dtype)), "y": None, "z": cp.asarray(np.full(2, 13, dtype))}
    got = gf.flatten(gf.plan(model), grads)
    assert isinstance(got, cp.ndarray)
    assert_same(got, np.array([16, 16, 0, 0], dtype), "tied gradients")
    # The same gradient object met twice counts once.
    g = cp.asarray(np.array([1, 2], dtype))
    assert_same(gf.flatten(gf.plan(model), {"x": g, "y": cp.asarray(np.ones(2, dtype)), "z": g}),
                np.array([1, 2, 1, 1], dtype), "one object twice")
    # destructure / re keep the tie as one object.
    flat, re = gf.destructure(model)
    assert flat.shape == (4,)
    m2 = re(cp.asarray(np.arange(4).astype(dtype)))
    assert m2["x"] is m2["z"] and m2["x"] is not a
    assert_same(m2["x"], np.array([0, 1], dtype), "re tie")


# ---------------------------------------------------------------- determinism

def test_same_bits_on_every_repeat_and_any_grid():
    from gpuflat._src.backends.cuda_runtime import CupyRuntime

    specs = [((ITEM * 20 + 11,), np.float32, "c"), ((ITEM * 3,), np.float16, "reversed"),
             ((999,), np.complex64, "c"), ((64, 70), np.float64, "negative")]
    specs += [((int(n),), np.float64, "c") for n in np.random.default_rng(11).integers(1, 50, 40)]
    dev, _, emu = twins(12, specs, tie=False)
    plan, leaves = gf.plan(dev), leaves_of(dev)
    emu_be = get_backend("emulated")
    for p in ORDS:
        first = [host(x).tobytes() for x in gf.global_norm(dev, p, per_leaf=True)]
        for _ in range(3):
            assert [host(x).tobytes() for x in gf.global_norm(dev, p, per_leaf=True)] == first
        for grid in (1, 2, 7, 33, 1024):
            r = CudaBackend(CupyRuntime(), grid=grid).norms(plan, leaves, p, True)
            assert [host(r.total).tobytes(), host(r.per_leaf).tobytes()] == first, (p, grid)
        if p == 2:
            r = emu_be.norms(plan, leaves_of(emu), p, True)
            assert [r.total.tobytes(), r.per_leaf.tobytes()] == first
    flat = host(gf.destructure(dev)[0]).tobytes()
    for grid in (1, 3, 1024):
        out = cp.empty(plan.size, plan.dtype)
        CudaBackend(CupyRuntime(), grid=grid).gather(plan, [[a] for a in leaves], out)
        assert host(out).tobytes() == flat
    # Clipping copies of one tree on several grids: the same bits.
    results = []
    for grid in (1, 5, 1024):
        copies = [a.copy() for a in leaves]
        be = CudaBackend(CupyRuntime(), grid=grid)
        be.clip_(plan, copies, be.norms(plan, copies, 2, False).total, 0.5, 1e-6)
        results.append(b"".join(host(a).tobytes() for a in copies))
    assert results[0] == results[1] == results[2]


# ---------------------------------------------------------------- memory

@pytest.mark.gpu
def test_repeated_clipping_leaves_the_memory_pool_flat():
    needs_real_gpu("CuPy's memory pool (the stand-in caches no blocks) and 1,020 clips")
    dev, _, _ = twins(13, leaves_for(np.float32))
    pool = cp.get_default_memory_pool()
    for _ in range(20):  # warm-up: the plan's tables, the kernels
        gf.clip_grad_norm_(dev, 1.0)
    cp.cuda.get_current_stream().synchronize()
    used, held = pool.used_bytes(), pool.total_bytes()
    for _ in range(1000):
        gf.clip_grad_norm_(dev, 1.0)
    cp.cuda.get_current_stream().synchronize()
    assert pool.used_bytes() - used <= 64 * 1024, (used, pool.used_bytes())
    assert pool.total_bytes() - held <= 1 << 20, (held, pool.total_bytes())


# ---------------------------------------------------------------- past 2**31 elements

HUGE = 2**31 + 1000
C = 0.5  # float16-exact; every partial sum of C**2 and of |C| is exact in float64


@pytest.fixture(scope="module")
def huge(cupy_variant):
    needs_real_gpu(f"{4 * HUGE * 2 / 2**30:.0f} GiB of device memory")
    free, _ = cp.cuda.runtime.memGetInfo()
    if free < 4 * HUGE * 2 + (1 << 30):
        pytest.skip(f"needs about {4 * HUGE * 2 / 2**30:.0f} GiB of free device memory, has {free / 2**30:.1f}")
    big = cp.full(HUGE, C, np.float16)
    yield big
    del big
    cp.get_default_memory_pool().free_all_blocks()


@pytest.mark.gpu
def test_huge_leaf_norms_in_closed_form(huge):
    tree = {"big": huge}
    total, per = gf.global_norm(tree, per_leaf=True)
    # C * C * HUGE is exact, and so is every partial sum; sqrt rounds once.
    assert float(host(total)) == math.sqrt(C * C * HUGE) == abs(C) * math.sqrt(HUGE)
    assert float(host(per)[0]) == float(host(total))
    assert float(host(gf.global_norm(tree, 1))) == abs(C) * HUGE
    assert float(host(gf.global_norm(tree, math.inf))) == abs(C)
    assert rel_err(host(gf.global_norm(tree, 3)), abs(C) * HUGE ** (1 / 3)) < 1e-12
    assert gf.total("count", tree) == HUGE


@pytest.mark.gpu
def test_huge_leaf_flatten_past_two_to_the_31(huge):
    small = cp.asarray(np.arange(1, 6, dtype=np.float16))
    marks = {2**31 - 1: 2.0, 2**31: 3.0, 2**31 + 1: -3.0, HUGE - 1: 4.0}
    for i, v in marks.items():
        huge[i] = v
    try:
        tree = {"big": huge, "small": small}
        plan = gf.plan(tree)
        assert plan.size == HUGE + 5 and plan.leaves[1].offset == HUGE
        flat = gf.flatten(plan, tree)
        assert flat.shape == (HUGE + 5,) and flat.dtype == np.float16
        assert host(flat[:2]).tolist() == [C, C]
        assert host(flat[2**31 - 2 : 2**31 + 3]).tolist() == [C, 2.0, 3.0, -3.0, C]
        assert host(flat[HUGE - 2 :]).tolist() == [C, 4.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert int(cp.count_nonzero(flat[:HUGE] != np.float16(C))) == len(marks)
        # The norm of the marked tree, in closed form (exact sums again).
        sumsq = C * C * (HUGE - len(marks)) + sum(v * v for v in marks.values()) + 55.0
        assert float(host(gf.global_norm(tree))) == math.sqrt(sumsq)
        # scatter writes back across the same offsets.
        flat[2**31] = 7.0
        flat[HUGE + 4] = -1.0
        del tree
        gf.scatter(plan, flat, {"big": huge, "small": small})
        assert float(host(huge[2**31])) == 7.0 and host(small).tolist() == [1.0, 2.0, 3.0, 4.0, -1.0]
        del flat
    finally:
        huge.fill(C)


@pytest.mark.gpu
def test_huge_leaf_clip(huge):
    max_norm = 1.0
    norm = abs(C) * math.sqrt(HUGE)
    got = gf.clip_grad_norm_({"big": huge}, max_norm)
    assert float(host(got)) == norm
    # The factor as the kernel computes it (double), cast to float32, one rounding to float16.
    coef = min(1.0, max_norm / (norm + 1e-6))
    want = (np.float32(C) * np.float32(coef)).astype(np.float16)
    assert int(cp.count_nonzero(huge != want)) == 0
    assert float(host(huge[-1])) == float(want) and float(host(huge[2**31])) == float(want)


# ---------------------------------------------------------------- subnormals and streams

def subnormal_tree(dtype):
    """Leaves of only subnormals (each part, for complex), beside a normal leaf."""
    dtype = np.dtype(dtype)
    part = np.dtype(dtype.char.lower()) if dtype.kind == "c" else dtype
    bits = np.uint16 if part.itemsize == 2 else np.uint32
    tiny = np.arange(1, 65, dtype=bits).view(part)  # 1..64 times the smallest subnormal
    leaf = tiny.astype(dtype) if dtype.kind != "c" else (tiny + 1j * tiny[::-1]).astype(dtype)
    return {"tiny": leaf, "one": np.ones(8, dtype)}


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.complex64], ids=str)
def test_subnormals_give_the_emulated_bits(dtype):
    need_dtype(dtype)
    host_tree = subnormal_tree(dtype)
    dev_tree = {k: cp.asarray(v) for k, v in host_tree.items()}
    flat_d, re_d = gf.destructure(dev_tree)
    flat_e, _ = gf.destructure(host_tree, backend="emulated")
    assert_same(flat_d, flat_e, "flat")
    assert (host(flat_d)[:64] != 0).all()
    assert_same(re_d(flat_d)["tiny"], host_tree["tiny"], "rebuilt")
    for ord in (1, 2, math.inf):
        assert_same(gf.global_norm(dev_tree, ord), gf.global_norm(host_tree, ord, backend="emulated"), ord)
    gf.clip_grad_norm_(dev_tree, 0.25)
    gf.clip_grad_norm_(host_tree, 0.25, backend="emulated")
    assert_same(dev_tree["tiny"], host_tree["tiny"], "clipped")


def test_tables_serve_launches_on_other_streams():
    from gpuflat._src.backends.cuda_runtime import CupyRuntime

    rng = np.random.default_rng(11)
    host_leaves = [random_array(rng, (n,), np.float32) for n in (5, 70_000, 1)]
    leaves = [cp.asarray(a) for a in host_leaves]
    plan = gf.plan({f"l{i}": a for i, a in enumerate(host_leaves)})
    be = CudaBackend(CupyRuntime())
    want = exact_norm(host_leaves)
    a, b, c = (cp.cuda.Stream(non_blocking=True) for _ in range(3))
    with a:
        first = be.norms(plan, leaves, 2, per_leaf=True)  # uploads the tables
    with cp.cuda.ExternalStream(b.ptr):  # as PyTorch's current stream is used
        again = be.norms(plan, leaves, 2, per_leaf=True)
    with c:
        third = be.norms(plan, leaves, 2, per_leaf=True)
    for stream in (a, b, c):
        stream.synchronize()  # the reads below run on the null stream
    for r in (first, again, third):
        assert_near_exact(r.total, want)
        assert_same(r.per_leaf, first.per_leaf)


def test_flatten_and_scatter_refuse_a_device_buffer_sharing_a_leaf():
    s = cp.asarray(np.arange(6.0))
    tree = {"a": s[:3], "b": cp.asarray(np.ones(3))}
    plan = gf.plan(tree)
    with pytest.raises(gf.OverlapError, match=r"leaf \"\['a'\]\" and out share memory"):
        gf.flatten(plan, tree, out=s)
    with pytest.raises(gf.OverlapError, match=r"leaf \"\['a'\]\" and flat share memory"):
        gf.scatter(plan, s, tree)
    np.testing.assert_array_equal(host(s), np.arange(6.0))
    out = cp.asarray(np.zeros(6))
    assert gf.flatten(plan, tree, out=out) is out
    np.testing.assert_array_equal(host(out), [0, 1, 2, 1, 1, 1])
