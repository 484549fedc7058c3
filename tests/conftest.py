"""Shared fixtures, reference implementations and hypothesis strategies.

The references here are written independently of gpuflat (their own tree
walk, plain NumPy, exact arithmetic with fractions / math.fsum), so a test
comparing gpuflat against them can fail.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections import namedtuple

import numpy as np
import pytest
from hypothesis import strategies as st

import gpuflat as gf
import gpuflat._src.dtypes

# ml_dtypes' bfloat16, registered with gpuflat now, so that tables of dtypes
# read at collection (gpuflat._src.dtypes.CUDA_NAMES) hold it.
BF16 = gpuflat._src.dtypes.bfloat16()

DTYPES = [np.dtype(np.float16)] + ([BF16] if BF16 is not None else []) + [
    np.dtype(np.float32),
    np.dtype(np.float64),
    np.dtype(np.complex64),
    np.dtype(np.complex128),
]
DTYPE_IDS = [str(d) for d in DTYPES]


# ---------------------------------------------------------------- backends

def nonfinite_cases(item):
    """(arrays, index of the first leaf holding NaN or inf): item-boundary and complex cases."""
    ok = np.ones(item + 5, np.float32)
    with_inf = np.ones(item * 2, np.float32)
    with_inf[item + 3] = np.inf
    with_nan = np.ones(7, np.float64)
    with_nan[2] = np.nan
    cplx = np.ones(3, np.complex64)
    cplx[1] = complex(0, np.inf)
    return [([ok, with_inf, with_nan], 1), ([ok, with_nan, with_inf], 1),
            ([ok, ok.copy(), cplx], 2), ([ok, ok.copy()], -1)]


def cupy_with_device():
    """CuPy if it is installed and sees a CUDA device, else None (the gpu tests skip)."""
    try:
        import cupy

        return cupy if cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:  # no CuPy, no driver, or no device
        return None


# The emulated backend is the CUDA kernels run on the host: it must run
# wherever the tests do (g++ is a test requirement), so it is never skipped.
BACKENDS = ["numpy", "host", "emulated"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Every backend that runs without a GPU: "numpy", "host" (the native C++
    path) and "emulated" (the CUDA kernels on the host)."""
    if request.param == "host":
        from gpuflat._src.native import available

        # The native path must build wherever the tests run (g++ and the
        # Python headers are test requirements): a silent NumPy fallback
        # would make every "host" test a second NumPy test.
        assert available(), "the native host backend did not build"
    return request.param


@pytest.fixture(autouse=True)
def _fresh_plan_cache():
    gf.plan_cache_clear()
    yield
    gf.plan_cache_clear()


# ---------------------------------------------------------------- containers used in tests

Pair = namedtuple("Pair", "first second")


@dataclasses.dataclass
class Linear:
    weight: object
    bias: object


@dataclasses.dataclass
class BatchNorm:
    __trainable__ = ("weight", "bias")
    weight: object
    bias: object
    running_mean: object


# ---------------------------------------------------------------- independent reference walk

def is_float_array(x):
    return isinstance(x, np.ndarray) and x.dtype in DTYPES


def ref_walk(tree, path=""):
    """(path, array) for every trainable occurrence, in walk order (ties repeated)."""
    out = []
    if isinstance(tree, np.ndarray):
        if is_float_array(tree):
            out.append((path or "<root>", tree))
    elif isinstance(tree, dict):
        for k, v in tree.items():
            out += ref_walk(v, f"{path}[{k!r}]")
    elif isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        for n, v in zip(type(tree)._fields, tree):
            out += ref_walk(v, f"{path}.{n}" if path else n)
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out += ref_walk(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        names = getattr(type(tree), "__trainable__", None) or [f.name for f in dataclasses.fields(tree)]
        for n in names:
            out += ref_walk(getattr(tree, n), f"{path}.{n}" if path else n)
    return out


def ref_unique(tree):
    """(path, array) per unique trainable (ties once, first path)."""
    seen, out = set(), []
    for p, a in ref_walk(tree):
        if id(a) not in seen:
            seen.add(id(a))
            out.append((p, a))
    return out


def ref_flat_dtype(dtypes):
    dtypes = {np.dtype(d) for d in dtypes}
    if not dtypes:
        return np.dtype(np.float32)
    if len(dtypes) == 1:
        return dtypes.pop()
    return np.result_type(*[np.float32 if d == BF16 else d for d in dtypes])


def cast(a, dtype):
    """astype without the complex->real warning (the real part is kept)."""
    a = np.asarray(a)
    if a.dtype.kind == "c" and np.dtype(dtype).kind != "c":
        a = a.real
    return a.astype(dtype)


def torch_scaled(a, coef):
    """``a * coef`` as torch's ``mul_`` computes it: the factor in the leaf's
    compute type (float32 for 16- and 32-bit leaves, float64 for 64-bit
    ones), real and imaginary parts scaled apart, one rounding."""
    wide = a.dtype in (np.dtype(np.float64), np.dtype(np.complex128))
    factor = np.float64(coef) if wide else np.float32(coef)
    real = np.float64 if wide else np.float32
    if a.dtype.kind == "c":
        scaled = np.empty(a.shape, a.dtype)
        scaled.real = a.real.astype(real) * factor
        scaled.imag = a.imag.astype(real) * factor
        return scaled
    return cast(a.astype(real) * factor, a.dtype)


def ref_flatten(tree):
    arrays = [a for _, a in ref_unique(tree)]
    dt = ref_flat_dtype(a.dtype for a in arrays)
    if not arrays:
        return np.zeros(0, dt)
    return np.concatenate([cast(a.reshape(-1), dt) for a in arrays])


def ref_flatten_grads(model, grads):
    """Optimisers.jl's contract: per slot, the sum of the distinct gradients found at its occurrences."""
    occ_m = ref_walk(model)
    occ_g = ref_grad_leaves(model, grads)
    slots, order = {}, []
    for (_, a), g in zip(occ_m, occ_g):
        if id(a) not in slots:
            slots[id(a)] = (a, [], set())
            order.append(id(a))
        _, gs, seen = slots[id(a)]
        if g is not None and id(g) not in seen:
            seen.add(id(g))
            gs.append(g)
    dt = ref_flat_dtype(slots[k][0].dtype for k in order)
    acc_dt = np.complex128 if dt.kind == "c" else np.float64
    parts = []
    for k in order:
        a, gs, _ = slots[k]
        acc = np.zeros(a.size, acc_dt)
        for g in gs:
            acc += cast(g.reshape(-1), acc_dt)
        parts.append(cast(acc, dt))
    return np.concatenate(parts) if parts else np.zeros(0, dt)


def ref_grad_leaves(model, grads):
    """What ``grads`` holds at every trainable occurrence of ``model``."""
    out = []

    def go(m, g):
        if isinstance(m, np.ndarray):
            if is_float_array(m):
                out.append(g)
        elif isinstance(m, dict):
            for k in m:
                go(m[k], g[k])
        elif isinstance(m, (list, tuple)):
            for a, b in zip(m, g):
                go(a, b)
        elif dataclasses.is_dataclass(m) and not isinstance(m, type):
            names = getattr(type(m), "__trainable__", None) or [f.name for f in dataclasses.fields(m)]
            for n in names:
                go(getattr(m, n), getattr(g, n))

    go(model, grads)
    return out


def tree_map(f, tree, memo=None):
    """Apply f to every float array (ties mapped once, so the result keeps them)."""
    memo = {} if memo is None else memo
    if isinstance(tree, np.ndarray):
        if not is_float_array(tree):
            return tree
        if id(tree) not in memo:
            memo[id(tree)] = f(tree)
        return memo[id(tree)]
    if isinstance(tree, dict):
        return type(tree)((k, tree_map(f, v, memo)) for k, v in tree.items())
    if isinstance(tree, tuple) and hasattr(type(tree), "_fields"):
        return type(tree)(*[tree_map(f, v, memo) for v in tree])
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(f, v, memo) for v in tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        names = getattr(type(tree), "__trainable__", None) or [f_.name for f_ in dataclasses.fields(tree)]
        return dataclasses.replace(tree, **{n: tree_map(f, getattr(tree, n), memo) for n in names})
    return tree


def all_arrays(tree, out=None, seen=None):
    """Every ndarray anywhere in the tree (trainable or not), once each."""
    out = [] if out is None else out
    seen = set() if seen is None else seen
    if isinstance(tree, np.ndarray):
        if id(tree) not in seen:
            seen.add(id(tree))
            out.append(tree)
    elif isinstance(tree, dict):
        for v in tree.values():
            all_arrays(v, out, seen)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            all_arrays(v, out, seen)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for f in dataclasses.fields(tree):
            all_arrays(getattr(tree, f.name), out, seen)
    return out


def snapshot(*trees):
    """Bytes of every array in the trees (and their bases), for byte-for-byte 'nothing changed' checks."""
    arrays = []
    for t in trees:
        arrays += all_arrays(t)
    snap = []
    for a in arrays:
        base = a
        while isinstance(base.base, np.ndarray):
            base = base.base
        snap.append((a.tobytes(), base.tobytes()))
    return snap


def assert_bits_equal(a, b):
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape, (a.shape, b.shape)
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes(), (a, b)


# ---------------------------------------------------------------- exact references for norms

def _parts(arrays):
    """Every element as float64 real numbers (a complex element gives its two parts)."""
    out = []
    for a in arrays:
        flat = np.asarray(a).reshape(-1)
        if flat.dtype.kind == "c":
            flat = flat.astype(np.complex128)
            out += [flat.real, flat.imag]
        else:
            out.append(flat.astype(np.float64))
    return np.concatenate(out) if out else np.zeros(0)


def _magnitudes(arrays):
    out = [np.abs(np.asarray(a).reshape(-1).astype(
        np.complex128 if np.asarray(a).dtype.kind == "c" else np.float64)) for a in arrays]
    return np.concatenate(out) if out else np.zeros(0)


def exact_sumsq(arrays) -> float:
    """The sum of |x|**2 over all elements, correctly rounded to a double.

    Each square is split exactly into three doubles (Dekker's split), and
    math.fsum adds all of them exactly before its one rounding.
    """
    x = np.abs(_parts(arrays))
    c = x * 134217729.0  # 2**27 + 1
    hi = c - (c - x)
    lo = x - hi
    return math.fsum(np.concatenate([hi * hi, 2 * hi * lo, lo * lo]).tolist())


def exact_norm(arrays, ord=2):
    """The p-norm of all elements taken as one vector, as exactly as a double can hold it."""
    parts = _parts(arrays)
    if np.isnan(parts).any():
        return math.nan
    mags = _magnitudes(arrays)
    if ord == math.inf:
        return float(mags.max()) if mags.size else 0.0
    if np.isinf(mags).any():
        return math.inf
    if ord == 2:
        return math.sqrt(exact_sumsq(arrays))  # two roundings: within 2.3e-16
    if ord == 1:
        return math.fsum(mags.tolist())  # |complex| is hypot: one rounding each
    return math.fsum((mags ** ord).tolist()) ** (1 / ord)


def rel_err(x, ref):
    x = float(x)
    if ref == 0:
        return abs(x)
    return abs(x - ref) / abs(ref)


# ---------------------------------------------------------------- rounding error bounds

def rounding_bound(eps: float, roundings: int) -> float:
    """gamma_n = n u / (1 - n u), u = eps / 2: the relative error that a chain
    of n roundings to nearest may leave in a result, against the magnitudes of
    the values it came from (Higham, Accuracy and Stability of Numerical
    Algorithms, 2nd ed., Lemma 3.1). A reduction of n terms counts n.

    >>> rounding_bound(2.0 ** -52, 1) == 2.0 ** -53 / (1 - 2.0 ** -53)
    True
    """
    u = eps / 2
    if roundings * u >= 1:
        raise ValueError(f"expected fewer than {1 / u:.0f} roundings for eps {eps}, got {roundings}")
    return roundings * u / (1 - roundings * u)


def apart_at_most(eps: float, roundings: int, scale: float) -> float:
    """How far apart two implementations of one computation may end, each
    within rounding_bound of exact arithmetic: twice that bound, times
    ``scale``, the largest magnitude among the values (an absolute tolerance,
    with rtol 0). PyTorch's CPU kernels round differently on each CPU
    (AVX-512, AVX2 or none: ATEN_CPU_CAPABILITY), so a comparison with them
    holds on every CPU only within such a bound.

    >>> apart_at_most(2.0 ** -23, 10, 4.0) == 2 * rounding_bound(2.0 ** -23, 10) * 4.0
    True
    """
    return 2 * rounding_bound(eps, roundings) * scale


# ---------------------------------------------------------------- array construction

def random_array(rng, shape, dtype, scale=1.0):
    dtype = np.dtype(dtype)
    real = rng.standard_normal(shape) * scale
    if dtype.kind == "c":
        real = real + 1j * rng.standard_normal(shape) * scale
    # np.asarray: a 0-d complex product is a NumPy scalar, which is no leaf at all.
    return cast(real, dtype) if dtype.kind != "c" else np.asarray(real).astype(dtype)


def strided_variant(rng, shape, dtype, kind):
    """An array of ``shape`` laid out as ``kind``: c, transposed, sliced, reversed."""
    if kind == "c" or len(shape) == 0:
        return random_array(rng, shape, dtype)
    if kind == "transposed":
        return random_array(rng, tuple(reversed(shape)), dtype).T
    if kind == "sliced":
        big = random_array(rng, tuple(2 * n + 1 for n in shape), dtype)
        return big[tuple(slice(1, None, 2) for _ in shape)]
    if kind == "reversed":
        return random_array(rng, shape, dtype)[tuple(slice(None, None, -1) for _ in shape)]
    raise ValueError(kind)


def read_order_copy(a):
    """A C-contiguous 1-D copy of ``a`` in the order norms and clips read it:
    by address where its elements fill one dense block of memory (each of its
    bytes once), else in logical (C) order. Worked out from every element's
    address, independently of gpuflat."""
    a = np.asarray(a)
    if a.size <= 1:
        return a.reshape(-1).copy()
    index = np.indices(a.shape).reshape(a.ndim, -1)
    addresses = (np.asarray(a.strides, np.int64)[:, None] * index).sum(axis=0)
    order = np.argsort(addresses, kind="stable")
    step = np.diff(addresses[order])
    dense = bool((step == a.itemsize).all())
    return a.reshape(-1)[order] if dense else a.reshape(-1).copy()


# ---------------------------------------------------------------- hypothesis strategies

SHAPES = [(), (0,), (1,), (3,), (2, 3), (3, 2), (2, 0), (1, 4, 2)]
LAYOUTS = ["c", "transposed", "sliced", "reversed"]


@st.composite
def trees(draw, dtypes=DTYPES, max_leaves=6, allow_statics=True):
    """A random nested tree with ties, mixed dtypes, strided/empty/0-d leaves and statics."""
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n_pool = draw(st.integers(0, max_leaves))
    pool = []
    for _ in range(n_pool):
        shape = draw(st.sampled_from(SHAPES))
        dtype = draw(st.sampled_from(dtypes))
        layout = draw(st.sampled_from(LAYOUTS))
        pool.append(strided_variant(rng, shape, dtype, layout))

    statics = [None, 3, "relu", np.arange(3), np.array(True), np.sin, 2.5]

    def leaf():
        if pool and (not allow_statics or draw(st.integers(0, 3)) > 0):
            return pool[draw(st.integers(0, len(pool) - 1))]  # repeats make ties
        return statics[draw(st.integers(0, len(statics) - 1))] if allow_statics else None

    def node(depth):
        kind = draw(st.sampled_from(["leaf", "dict", "list", "tuple", "pair", "linear"]
                                    if depth < 3 else ["leaf"]))
        if kind == "leaf":
            return leaf()
        if kind == "dict":
            n = draw(st.integers(0, 3))
            return {f"k{i}": node(depth + 1) for i in range(n)}
        if kind == "list":
            return [node(depth + 1) for _ in range(draw(st.integers(0, 3)))]
        if kind == "tuple":
            return tuple(node(depth + 1) for _ in range(draw(st.integers(0, 3))))
        if kind == "pair":
            return Pair(node(depth + 1), node(depth + 1))
        return Linear(node(depth + 1), node(depth + 1))

    tree = {"root": node(0)}
    # Make sure every pool array appears at least once most of the time.
    tree["pool"] = pool[: draw(st.integers(0, len(pool)))]
    return tree


@st.composite
def grads_for(draw, model):
    """A gradient tree for ``model``: None, a fresh array, or a gradient reused at another occurrence."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    made = []

    def grad(a):
        choice = draw(st.integers(0, 5))
        if choice == 0:
            return None
        same = [g for g in made if g.shape == a.shape and g.dtype == a.dtype]
        if choice == 1 and same:
            return same[draw(st.integers(0, len(same) - 1))]
        g = random_array(rng, a.shape, a.dtype)
        made.append(g)
        return g

    def go(m):
        if isinstance(m, np.ndarray):
            return grad(m) if is_float_array(m) else m
        if isinstance(m, dict):
            return {k: go(v) for k, v in m.items()}
        if isinstance(m, tuple) and hasattr(type(m), "_fields"):
            return type(m)(*[go(v) for v in m])
        if isinstance(m, (list, tuple)):
            return type(m)(go(v) for v in m)
        if dataclasses.is_dataclass(m) and not isinstance(m, type):
            return dataclasses.replace(m, **{f.name: go(getattr(m, f.name)) for f in dataclasses.fields(m)})
        return m

    return go(model)


def counted(calls: list, name: str, fn):
    """``fn``, appending ``name`` to ``calls`` at each call: for tests
    counting which calls an operation makes."""
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapper


# The files whose tests build with g++ or NVRTC (a compile each, or the
# benchmark's and the GPU script's builds) or launch ranks: `make test-fast`
# leaves out what is marked slow. A test elsewhere that builds (Inductor
# compiles C++ with g++) is marked in its own file.
SLOW_FILES = {
    "test_bench.py", "test_kernel_loader.py", "test_kernel_resources.py", "test_kernel_sass.py",
    "test_host_compiler.py", "kernel_loader.py",  # NVRTC and g++ builds
    "test_distributed.py", "test_dtensor.py", "test_meshes.py", "test_torch_optim_fsdp.py",  # ranks
}


def pytest_collection_modifyitems(items):
    for item in items:
        if item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)


# The libraries a lane leaves out on purpose (make test-floor: "torch,jax"):
# there a test that needs one of them skips, as it runs in make test.
LANE_WITHOUT = tuple(filter(None, os.environ.get("GPUFLAT_LANE_WITHOUT", "").split(",")))


def _left_out_by_the_lane(report) -> bool:
    """Whether ``report`` is a skip for a library this lane leaves out
    (pytest.importorskip's reason names the missing top-level package)."""
    return any(f"No module named '{name}'" in str(report.longrepr) for name in LANE_WITHOUT)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """In CI only tests marked ``gpu`` may skip, and those needing a library
    the lane leaves out: any other skip hides a check, so it fails."""
    outcome = yield
    report = outcome.get_result()
    if (os.environ.get("CI") and report.skipped and "gpu" not in item.keywords
            and not _left_out_by_the_lane(report)):
        report.outcome = "failed"
        report.longrepr = f"skipped in CI, where only tests marked gpu may skip: {report.longrepr}"
