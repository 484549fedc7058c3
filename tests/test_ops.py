"""The public API against plain NumPy references, for every dtype and backend.

Norms are checked against exact references (fractions, math.fsum); round trips bit for bit.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuflat as gf

from conftest import (
    cupy_with_device,
    torch_scaled,
    BF16, DTYPES, DTYPE_IDS, Linear, assert_bits_equal, cast, exact_norm, grads_for,
    ref_flat_dtype, ref_flatten, ref_flatten_grads, ref_unique, rel_err, random_array,
    snapshot, strided_variant, trees,
)

SETTINGS = settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))


def mixed_tree(rng, dtype):
    """Every layout kind: C, transposed, sliced, reversed, 0-d, empty; one tie; statics."""
    t = strided_variant(rng, (3, 4), dtype, "transposed")
    return {
        "enc": {"layers": [Linear(strided_variant(rng, (2, 3), dtype, "c"), random_array(rng, (), dtype)),
                           Linear(strided_variant(rng, (3, 2), dtype, "sliced"), np.zeros((0, 2), dtype))]},
        "rev": strided_variant(rng, (5,), dtype, "reversed"),
        "tied": t,
        "again": (t, "relu", np.arange(2)),
    }


# ---------------------------------------------------------------- trainables / destructure

def test_trainables_with_paths():
    a = np.ones(2)
    tree = {"enc": {"layers": [None, None, Linear(a, np.zeros(1))]}, "dec": a}
    got = gf.trainables(tree, path=True)
    assert [p for p, _ in got] == ["['enc']['layers'][2].weight", "['enc']['layers'][2].bias"]
    assert got[0][1] is a
    assert [x is y for x, (_, y) in zip(gf.trainables(tree), got)] == [True, True]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_destructure_round_trip_bit_exact(dtype, backend):
    rng = np.random.default_rng(0)
    tree = mixed_tree(rng, dtype)
    flat, re = gf.destructure(tree, backend=backend)
    assert flat.ndim == 1 and flat.dtype == dtype
    assert_bits_equal(flat, ref_flatten(tree))
    t2 = re(flat)
    for (p1, a), (p2, b) in zip(ref_unique(tree), ref_unique(t2)):
        assert p1 == p2
        assert_bits_equal(a, b)
        assert b is not a
    assert t2["tied"] is t2["again"][0]
    assert t2["again"][1] == "relu" and t2["again"][2] is tree["again"][2]


@pytest.mark.parametrize("d1,d2", [(np.float16, np.float32), (BF16, np.float16), (np.float32, np.complex64),
                                   (BF16, np.float64), (np.float16, np.complex128)])
def test_destructure_mixed_dtypes_casts_back(d1, d2, backend):
    rng = np.random.default_rng(1)
    tree = [random_array(rng, (3,), d1), random_array(rng, (2, 2), d2)[::-1]]
    flat, re = gf.destructure(tree, backend=backend)
    assert flat.dtype == ref_flat_dtype([d1, d2])
    assert_bits_equal(flat, ref_flatten(tree))
    t2 = re(flat)
    for a, b in zip(tree, t2):
        assert_bits_equal(a, b)  # the promotion is exact, so the way back is too
    # New values are cast back to each leaf's dtype.
    new = (np.arange(7) * 1.25).astype(flat.dtype)
    t3 = re(new)
    assert_bits_equal(t3[0], cast(new[:3], d1))
    assert_bits_equal(t3[1], cast(new[3:], d2).reshape(2, 2))


def test_destructure_empty_tree(backend):
    flat, re = gf.destructure({"a": [], "b": "static", "c": np.arange(3)}, backend=backend)
    assert flat.shape == (0,) and flat.dtype == np.float32
    t2 = re(np.zeros(0, np.float32))
    assert t2["b"] == "static" and t2["a"] == []


def test_destructure_only_empty_and_0d_leaves(backend):
    tree = [np.zeros((0,), np.float64), np.array(3.5), np.zeros((2, 0))]
    flat, re = gf.destructure(tree, backend=backend)
    assert flat.tolist() == [3.5]
    t2 = re(np.array([-1.0]))
    assert t2[0].shape == (0,) and t2[1].shape == () and float(t2[1]) == -1.0 and t2[2].shape == (2, 0)


def test_unflatten_views_and_scatter(backend):
    rng = np.random.default_rng(2)
    tree = mixed_tree(rng, np.float32)
    p = gf.plan(tree)
    flat = gf.flatten(p, tree, backend=backend)
    resident = gf.unflatten(p, flat)
    leaves = gf.trainables(resident)
    assert all(np.shares_memory(a, flat) for a in leaves if a.size)
    assert resident["tied"] is resident["again"][0]
    # Writing the buffer is seen through the views.
    flat[:] = np.arange(flat.size)
    assert_bits_equal(ref_flatten(resident), np.arange(flat.size, dtype=np.float32))
    # scatter writes into the tree's own (strided) arrays.
    before = [id(a) for a in gf.trainables(tree)]
    gf.scatter(p, flat * 2, tree, backend=backend)
    assert [id(a) for a in gf.trainables(tree)] == before
    assert_bits_equal(ref_flatten(tree), np.arange(flat.size, dtype=np.float32) * 2)


def test_flatten_into_out(backend):
    tree = {"a": np.ones(3, np.float32), "b": np.full((2, 2), 2, np.float32).T}
    p = gf.plan(tree)
    out = np.full(7, -1, np.float32)
    got = gf.flatten(p, tree, out=out, backend=backend)
    assert got is out and out.tolist() == [1, 1, 1, 2, 2, 2, 2]


# ---------------------------------------------------------------- tied gradients

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_optimisers_tie_contract(dtype, backend):
    a, b = np.zeros(2, dtype), np.zeros(2, dtype)
    model = {"x": a, "y": b, "z": a}
    grads = {"x": np.full(2, 3, dtype), "y": None, "z": np.full(2, 13, dtype)}
    got = gf.flatten(gf.plan(model), grads, backend=backend)
    assert_bits_equal(got, np.array([16, 16, 0, 0], dtype))


def test_same_gradient_object_counts_once(backend):
    a = np.zeros(2)
    model = {"x": a, "y": np.zeros(1), "z": a}
    g = np.array([1.0, 2.0])
    got = gf.flatten(gf.plan(model), {"x": g, "y": np.ones(1), "z": g}, backend=backend)
    assert got.tolist() == [1, 2, 1]
    got = gf.flatten(gf.plan(model), {"x": g, "y": None, "z": g.copy()}, backend=backend)
    assert got.tolist() == [2, 4, 0]
    got = gf.flatten(gf.plan(model), {"x": None, "y": None, "z": None}, backend=backend)
    assert got.tolist() == [0, 0, 0]


# ---------------------------------------------------------------- total

def test_total_optimisers_example(backend):
    model = {"x": np.array([3.0, 4.0]), "y": (np.sin, np.array([5.0])), "z": (6, 7)}
    assert float(gf.total("l2", model, backend=backend)) == 10.0
    assert gf.total("count", model, backend=backend) == 3
    # sumsq is the pass's own sum of squares: exactly 50.
    assert float(gf.total("sumsq", model, backend=backend)) == 50.0
    assert float(gf.total("l1", model, backend=backend)) == 12.0
    assert float(gf.total(np.sum, model)) == 12.0
    assert float(gf.total(lambda a: np.linalg.norm(a), model)) == 10.0


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_total_every_dtype_against_exact(dtype, backend):
    rng = np.random.default_rng(3)
    tree = mixed_tree(rng, dtype)
    leaves = [a for _, a in ref_unique(tree)]
    tol = 1e-12
    assert rel_err(gf.total("l2", tree, backend=backend), math.fsum(exact_norm([a]) for a in leaves)) < tol
    assert rel_err(gf.total("sumsq", tree, backend=backend), exact_norm(leaves) ** 2) < tol
    assert rel_err(gf.total("l1", tree, backend=backend), exact_norm(leaves, 1)) < tol
    assert gf.total("count", tree, backend=backend) == sum(a.size for a in leaves)
    calls = []
    gf.total(lambda a: calls.append(a) or 0, tree)
    assert len(calls) == len(leaves) and all(x is y for x, y in zip(calls, leaves))


def test_total_counts_ties_once():
    a = np.array([3.0, 4.0])
    assert float(gf.total("l2", {"x": a, "z": a})) == 5.0
    assert gf.total("count", [a, a, a]) == 2


@pytest.mark.parametrize("f", ["l3", "norm", "", None, 2, "L2"])
def test_total_unknown_f(f):
    with pytest.raises(ValueError, match="sumsq"):
        gf.total(f, {"w": np.ones(2)})


# ---------------------------------------------------------------- global_norm

ORDS = [1, 2, math.inf, 0.5, 3]


@pytest.mark.parametrize("ord", ORDS, ids=[str(o) for o in ORDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_global_norm_against_exact(dtype, ord, backend):
    rng = np.random.default_rng(4)
    tree = mixed_tree(rng, dtype)
    leaves = [a for _, a in ref_unique(tree)]
    total, per = gf.global_norm(tree, ord, per_leaf=True, backend=backend)
    assert np.asarray(total).shape == () and np.asarray(total).dtype == np.float64
    assert np.asarray(per).dtype == np.float64 and np.asarray(per).shape == (len(leaves),)
    tol = 1e-12
    assert rel_err(total, exact_norm(leaves, ord)) < tol
    for got, a in zip(np.asarray(per), leaves):
        assert rel_err(got, exact_norm([a], ord)) < tol
    # per_leaf=False gives the same total.
    assert rel_err(gf.global_norm(tree, ord, backend=backend), exact_norm(leaves, ord)) < tol


_EXACT_CACHE: dict = {}


def test_global_norm_many_leaves_float64_exact(backend):
    rng = np.random.default_rng(5)
    tree = [rng.standard_normal(int(n)) * 10.0 ** rng.integers(-5, 5) for n in rng.integers(0, 600, 30)]
    tree.append(rng.standard_normal(33_000))  # a leaf larger than the NumPy backend's piece
    for ord in ORDS:
        ref = _EXACT_CACHE.setdefault(ord, exact_norm(tree, ord)) if ord not in _EXACT_CACHE else _EXACT_CACHE[ord]
        assert rel_err(gf.global_norm(tree, ord, backend=backend), ref) < 1e-12, ord


@pytest.mark.parametrize("ord", [0, -1, -math.inf, math.nan, "fro", None, True, "2x"])
def test_global_norm_unknown_ord(ord):
    with pytest.raises(ValueError, match="ord"):
        gf.global_norm({"w": np.ones(2)}, ord)


def test_global_norm_empty(backend):
    total, per = gf.global_norm({}, per_leaf=True, backend=backend)
    assert float(total) == 0.0 and np.asarray(per).shape == (0,)
    assert float(gf.global_norm([np.zeros(0)], math.inf, backend=backend)) == 0.0


# ---------------------------------------------------------------- clip_grad_norm_

def torch_clip_reference(leaves, max_norm, ord=2, eps=1e-6, norm=None):
    """PyTorch's clip_grad_norm_: coef = max_norm / (norm + eps), clamped to 1, always applied."""
    norm = exact_norm(leaves, ord) if norm is None else norm
    coef = min(np.float64(max_norm) / (np.float64(norm) + eps), 1.0)
    out = [torch_scaled(a, coef) for a in leaves]
    return norm, out


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_clip_grad_norm_against_torch_formula(dtype, max_norm, backend):
    rng = np.random.default_rng(6)
    tree = mixed_tree(rng, dtype)
    leaves = [a for _, a in ref_unique(tree)]
    copies = [a.copy() for a in leaves]
    ref_norm, _ = torch_clip_reference(copies, max_norm)
    norm = gf.clip_grad_norm_(tree, max_norm, backend=backend)
    assert np.asarray(norm).shape == () and rel_err(norm, ref_norm) < 1e-12
    # The factor is PyTorch's, computed from the norm returned; products rounded once.
    _, ref_leaves = torch_clip_reference(copies, max_norm, norm=float(norm))
    for a, ref in zip(leaves, ref_leaves):
        assert a.dtype == ref.dtype and np.array_equal(a, ref), (a, ref)
    assert tree["tied"] is tree["again"][0]  # a tie is scaled once, in place


@pytest.mark.parametrize("ord", ORDS, ids=[str(o) for o in ORDS])
def test_clip_grad_norm_ords(ord, backend):
    rng = np.random.default_rng(7)
    tree = [rng.standard_normal((4, 5)), rng.standard_normal(3).astype(np.float32)]
    ref_norm, ref_leaves = torch_clip_reference([a.copy() for a in tree], 1.0, ord)
    norm = gf.clip_grad_norm_(tree, 1.0, ord, backend=backend)
    assert rel_err(norm, ref_norm) < 1e-12
    for a, ref in zip(tree, ref_leaves):
        np.testing.assert_allclose(a, ref, rtol=1e-6)


def test_clip_grad_norm_eps_and_no_clip_below(backend):
    g = [np.array([3.0, 4.0])]
    gf.clip_grad_norm_(g, 10.0, backend=backend)
    assert g[0].tolist() == [3.0, 4.0]  # coef clamped to 1
    gf.clip_grad_norm_(g, 1.0, eps=1.0, backend=backend)
    assert g[0].tolist() == [0.5, 4.0 / 6.0]


def test_clip_returns_norm_before_clipping(backend):
    g = {"w": np.array([30.0, 40.0])}
    assert float(gf.clip_grad_norm_(g, 5.0, backend=backend)) == 50.0
    np.testing.assert_allclose(g["w"], [3.0, 4.0], rtol=1e-6)


def test_clip_resident_model(backend):
    rng = np.random.default_rng(8)
    tree = {"a": rng.standard_normal((3, 3)), "b": rng.standard_normal(4)}
    p = gf.plan(tree)
    flat = gf.flatten(p, tree, backend=backend)
    resident = gf.unflatten(p, flat)
    copies = [resident["a"].copy(), resident["b"].copy()]
    norm = gf.clip_grad_norm_(resident, 0.1, backend=backend)
    assert rel_err(norm, exact_norm(copies)) < 1e-12
    _, ref_leaves = torch_clip_reference(copies, 0.1, norm=float(norm))
    assert_bits_equal(resident["a"], ref_leaves[0])
    assert_bits_equal(resident["b"], ref_leaves[1])


# ---------------------------------------------------------------- errors: named, and nothing changed

def _model():
    a = np.ones((2, 3), np.float32)
    return {"enc": {"layers": [Linear(a, np.zeros(3, np.float32)), Linear(np.ones((3, 3), np.float32), None)]},
            "head": a}


def _check_raises_and_unchanged(fn, trees, exc, *patterns):
    before = snapshot(*trees)
    with pytest.raises(exc) as info:
        fn()
    msg = str(info.value)
    for pat in patterns:
        assert pat in msg, (pat, msg)
    assert snapshot(*trees) == before
    return msg


def test_flatten_errors_name_path_and_values():
    m = _model()
    p = gf.plan(m)
    g = _model()
    g["enc"]["layers"][1].weight = np.ones((3, 4), np.float32)
    _check_raises_and_unchanged(lambda: gf.flatten(p, g), [g], gf.TreeMismatchError,
                                "['enc']['layers'][1].weight", "(3, 3)", "(3, 4)")
    g = _model()
    g["enc"]["layers"][0].bias = np.zeros(3, np.float64)
    _check_raises_and_unchanged(lambda: gf.flatten(p, g), [g], gf.TreeMismatchError,
                                "['enc']['layers'][0].bias", "float32", "float64")
    g = _model()
    g["head"] = [1.0, 2.0]
    _check_raises_and_unchanged(lambda: gf.flatten(p, g), [g], gf.TreeMismatchError, "['head']", "list")
    g = _model()
    del g["head"]
    _check_raises_and_unchanged(lambda: gf.flatten(p, g), [g], gf.TreeMismatchError, "head")
    g = _model()
    g["extra"] = np.ones(1, np.float32)
    _check_raises_and_unchanged(lambda: gf.flatten(p, g), [g], gf.TreeMismatchError, "extra")


def test_flatten_out_errors_change_nothing():
    m = _model()
    p = gf.plan(m)
    for out in [np.zeros(p.size + 1, np.float32), np.zeros(p.size, np.float64), np.zeros((p.size, 1), np.float32)]:
        _check_raises_and_unchanged(lambda: gf.flatten(p, m, out=out), [m, out], gf.TreeMismatchError, "out")


def test_re_and_unflatten_errors():
    m = _model()
    flat, re = gf.destructure(m)
    p = gf.plan(m)
    for bad, what in [(np.zeros(flat.size - 1, np.float32), f"({flat.size},)"),
                      (np.zeros(flat.size, np.int64), "int64"),
                      (np.zeros(2 * flat.size, np.float32)[::2], "C-contiguous"),
                      (np.zeros((flat.size, 1), np.float32), f"({flat.size},)"),
                      ([0.0] * flat.size, "list")]:
        for fn in (lambda: re(bad), lambda: gf.unflatten(p, bad)):
            _check_raises_and_unchanged(fn, [m, bad] if isinstance(bad, np.ndarray) else [m],
                                        gf.TreeMismatchError, what)


def test_re_and_scatter_take_any_floating_flat_and_cast_it_back(backend):
    # A float64 norm makes float64 updates: Optimisers' Restructure casts them back.
    m = _model()
    flat, re = gf.destructure(m, backend=backend)
    norm = gf.global_norm(m, backend=backend)
    scaled = flat / norm
    assert scaled.dtype == np.float64 and flat.dtype == np.float32
    rebuilt = re(scaled)
    want = (flat.astype(np.float64) / norm).astype(np.float32)
    assert_bits_equal(gf.flatten(gf.plan(rebuilt), rebuilt, backend=backend), want)
    gf.scatter(gf.plan(m), scaled, m, backend=backend)
    assert_bits_equal(gf.flatten(gf.plan(m), m, backend=backend), want)


def test_out_must_be_contiguous_and_exact(backend):
    m = _model()
    p = gf.plan(m)
    for out, what in [(np.zeros(2 * p.size, np.float32)[::2], "strides"),
                      (np.zeros(p.size, np.float64), "float64")]:
        before = out.copy()
        with pytest.raises(gf.TreeMismatchError, match=what):
            gf.flatten(p, m, out=out, backend=backend)
        assert_bits_equal(out, before)


def test_scatter_errors_change_nothing():
    m = _model()
    p = gf.plan(m)
    flat = np.arange(p.size, dtype=np.float32)
    _check_raises_and_unchanged(lambda: gf.scatter(p, flat[:-1], m), [m], gf.TreeMismatchError, "flat")
    _check_raises_and_unchanged(lambda: gf.scatter(p, flat.astype(np.int32), m), [m], gf.TreeMismatchError, "int32")
    strided = np.arange(2 * p.size, dtype=np.float32)[::2]
    _check_raises_and_unchanged(lambda: gf.scatter(p, strided, m), [m], gf.TreeMismatchError, "strides (8,)")
    reversed_view = np.arange(p.size, dtype=np.float32)[::-1]
    _check_raises_and_unchanged(lambda: gf.scatter(p, reversed_view, m), [m], gf.TreeMismatchError, "strides (-4,)")
    bad = _model()
    bad["enc"]["layers"][1].weight = np.ones((3, 4), np.float32)  # the last leaf is wrong
    _check_raises_and_unchanged(lambda: gf.scatter(p, flat, bad), [bad], gf.TreeMismatchError,
                                "['enc']['layers'][1].weight", "(3, 3)", "(3, 4)")
    bad = _model()
    bad["enc"]["layers"][1].weight = None
    _check_raises_and_unchanged(lambda: gf.scatter(p, flat, bad), [bad], gf.TreeMismatchError,
                                "['enc']['layers'][1].weight", "NoneType")


@pytest.mark.parametrize("max_norm", [-1.0, math.nan, "x", None, -math.inf])
def test_clip_bad_max_norm_changes_nothing(max_norm):
    g = _model()
    _check_raises_and_unchanged(lambda: gf.clip_grad_norm_(g, max_norm), [g], ValueError, "max_norm", repr(max_norm))


@pytest.mark.parametrize("ord", [0, -2, "fro", None])
def test_clip_bad_ord_changes_nothing(ord):
    g = _model()
    _check_raises_and_unchanged(lambda: gf.clip_grad_norm_(g, 1.0, ord), [g], ValueError, "ord")


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        gf.global_norm({"w": np.ones(1)}, backend="tpu")


@pytest.mark.gpu
def test_mixed_numpy_and_cupy_leaves_name_one_of_each():
    cp = cupy_with_device()
    if cp is None:
        pytest.skip("needs CuPy and a CUDA device")
    tree = {"host": np.ones(2), "device": cp.ones(2)}
    with pytest.raises(TypeError, match=r"leaf \"\['host'\]\" is a NumPy array.*\['device'\]"):
        gf.global_norm(tree)


# ---------------------------------------------------------------- hypothesis properties

@SETTINGS
@given(trees())
def test_property_flatten_unflatten_round_trip(tree):
    flat, re = gf.destructure(tree)
    assert_bits_equal(flat, ref_flatten(tree))
    t2 = re(flat)
    flat2, _ = gf.destructure(t2)
    assert_bits_equal(flat2, flat)
    for (p1, a), (p2, b) in zip(ref_unique(tree), ref_unique(t2)):
        assert p1 == p2
        assert_bits_equal(a, b)
    p = gf.plan(tree)
    # The resident pattern: views into the flat buffer, same values.
    assert_bits_equal(ref_flatten(gf.unflatten(p, flat.copy())), flat)


@SETTINGS
@given(st.data())
def test_property_gradient_flatten_matches_contract(data):
    model = data.draw(trees())
    grads = data.draw(grads_for(model))
    got = gf.flatten(gf.plan(model), grads)
    assert_bits_equal(got, ref_flatten_grads(model, grads))


@SETTINGS
@given(st.data())
def test_property_adjoint_identity(data):
    # <flatten(x), v> == <x, unflatten(v)> for a tree without ties, in float64.
    model = data.draw(trees(dtypes=[np.dtype(np.float64)]))
    p = gf.plan(model)
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    v = rng.standard_normal(p.size).astype(p.dtype)
    x = gf.flatten(p, model)
    lhs = math.fsum((x * v).tolist())
    u = gf.unflatten(p, v)
    rhs = math.fsum(math.fsum((a.reshape(-1) * b.reshape(-1)).tolist())
                    for (_, a), (_, b) in zip(ref_unique(model), ref_unique(u)))
    assert math.isclose(lhs, rhs, rel_tol=1e-12, abs_tol=1e-12)
    # With ties, flatten of a gradient tree is the adjoint of unflatten: <flatten(g), v> = sum over occurrences.
    grads = data.draw(grads_for(model))
    gflat = gf.flatten(p, grads)
    occ = [g for g in __import__("conftest").ref_grad_leaves(model, grads)]
    u_occ = __import__("conftest").ref_walk(u)
    seen_pairs = set()
    terms = []
    for g, (_, ua) in zip(occ, u_occ):
        if g is None or (id(g), id(ua)) in seen_pairs:
            continue
        seen_pairs.add((id(g), id(ua)))
        terms.append(math.fsum((g.reshape(-1) * ua.reshape(-1)).tolist()))
    assert math.isclose(math.fsum((gflat * v).tolist()), math.fsum(terms), rel_tol=1e-9, abs_tol=1e-9)


@SETTINGS
@given(trees(dtypes=[np.dtype(np.float64), np.dtype(np.complex128)]), st.sampled_from(ORDS))
def test_property_norms_exact_for_float64(tree, ord):
    leaves = [a for _, a in ref_unique(tree)]
    total, per = gf.global_norm(tree, ord, per_leaf=True)
    assert rel_err(total, exact_norm(leaves, ord)) < 1e-12
    for got, a in zip(np.asarray(per), leaves):
        assert rel_err(got, exact_norm([a], ord)) < 1e-12


@SETTINGS
@given(trees(), st.sampled_from(ORDS))
def test_property_determinism(tree, ord):
    first = [np.asarray(x).tobytes() for x in gf.global_norm(tree, ord, per_leaf=True)]
    flat1 = gf.destructure(tree)[0].tobytes()
    for _ in range(2):
        assert [np.asarray(x).tobytes() for x in gf.global_norm(tree, ord, per_leaf=True)] == first
        assert np.asarray(gf.global_norm(tree, ord)).tobytes() == first[0]
        assert gf.destructure(tree)[0].tobytes() == flat1


def test_unflatten_complex_flat_into_real_leaf_without_warning():
    import warnings

    tree = {"r": np.zeros(2, np.float32), "c": np.zeros(1, np.complex64)}
    p = gf.plan(tree)
    flat = np.array([1 + 5j, 2 + 6j, 3 + 4j], np.complex64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = gf.unflatten(p, flat)
        m2 = gf.destructure(tree)[1](flat)
    for t in (m, m2):
        assert t["r"].dtype == np.float32 and t["r"].tolist() == [1.0, 2.0]
        assert t["c"].tolist() == [3 + 4j]


# ---------------------------------------------------------------- in-place safety and arguments


def test_clip_refuses_a_read_only_model_made_by_unflatten(backend):
    m = _model()
    p = gf.plan(m)
    flat, _ = gf.destructure(m)
    flat.flags.writeable = False
    resident = gf.unflatten(p, flat)
    before = flat.copy()
    with pytest.raises(gf.TreeMismatchError, match="read-only"):
        gf.clip_grad_norm_(resident, 1e-3, backend=backend)
    assert_bits_equal(flat, before)


@pytest.mark.parametrize("make", [
    lambda: np.lib.stride_tricks.as_strided(np.ones(1, np.float32), (4,), (0,)),
    lambda: np.lib.stride_tricks.as_strided(np.arange(8.0), (3, 3), (16, 8)),
], ids=["zero stride", "self-overlap"])
def test_in_place_ops_refuse_leaves_that_overlap_themselves(make, backend):
    leaf = make()
    base = leaf.base
    while getattr(base, "base", None) is not None:
        base = base.base
    tree = {"ok": np.ones(3), "bad": leaf}
    before = np.array(base, copy=True)
    # The same error class as two leaves sharing memory: both are overlaps.
    with pytest.raises(gf.OverlapError, match=r"\['bad'\].*distinct memory"):
        gf.clip_grad_norm_(tree, 1e-3, backend=backend)
    p = gf.plan(tree)
    with pytest.raises(gf.OverlapError, match=r"\['bad'\].*distinct memory"):
        gf.scatter(p, np.zeros(p.size), tree, backend=backend)
    assert_bits_equal(np.asarray(base), before)
    gf.global_norm(tree, backend=backend)  # reading such a leaf is fine


@pytest.mark.parametrize("kwargs, what", [
    ({"max_norm": "1.0"}, "max_norm"), ({"max_norm": True}, "max_norm"),
    ({"max_norm": 1.0, "eps": -1}, "eps"), ({"max_norm": 1.0, "eps": "0"}, "eps"),
    ({"max_norm": 1.0, "ord": "2"}, "ord"),
])
def test_clip_arguments_are_checked(kwargs, what):
    g = {"w": np.array([3.0, 4.0])}
    with pytest.raises(ValueError, match=what):
        gf.clip_grad_norm_(g, **kwargs)
    assert g["w"].tolist() == [3.0, 4.0]


def test_clipping_an_inf_gradient_warns_nothing(backend):
    import warnings

    g = {"w": np.array([np.inf, 1.0], np.float32), "b": np.ones(2)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        norm = gf.clip_grad_norm_(g, 1.0, backend=backend)
    # An inf norm gives a zero factor, as in PyTorch: inf * 0 is NaN, the rest 0.
    assert np.isinf(norm) and np.isnan(g["w"][0]) and g["w"][1] == 0 and (g["b"] == 0).all()


def test_model_argument_adds_tied_gradients_as_flatten_does(backend):
    # The README's example: enc.w and dec are one array; their gradients add.
    w = np.ones((64, 64), np.float32)
    model = {"enc": {"w": w, "b": np.zeros(64, np.float32)}, "act": "relu", "dec": w}
    grads = {"enc": {"w": np.ones((64, 64), np.float32), "b": None}, "act": None,
             "dec": np.ones((64, 64), np.float32)}
    assert float(gf.global_norm(grads, backend=backend)) == pytest.approx(math.sqrt(2 * 4096))
    norm = gf.global_norm(grads, model=model, backend=backend)
    assert float(norm) == float(np.linalg.norm(gf.flatten(gf.plan(model), grads))) == 128.0
    clipped = gf.clip_grad_norm_(grads, 1.0, model=model, backend=backend)
    assert float(clipped) == 128.0
    coef = np.float32(1.0 / (128.0 + 1e-6))
    for g in (grads["enc"]["w"], grads["dec"]):  # every occurrence scaled by the one factor
        assert_bits_equal(g, np.full((64, 64), np.float32(1) * coef, np.float32))


def test_model_argument_refuses_a_gradient_tree_of_another_shape():
    model = {"w": np.ones(3)}
    with pytest.raises(gf.TreeMismatchError, match=r"\['w'\].*\(3,\).*\(4,\)"):
        gf.global_norm({"w": np.ones(4)}, model=model)


def test_clip_by_global_norm_leaves_its_input_untouched(backend):
    rng = np.random.default_rng(3)
    a = rng.standard_normal(5).astype(np.float32)
    tree = {"x": a, "y": rng.standard_normal((2, 3)), "z": a, "n": "relu"}
    before = [a.copy(), tree["y"].copy()]
    clipped, norm = gf.clip_by_global_norm(tree, 0.5, backend=backend)
    assert_bits_equal(tree["x"], before[0]) and assert_bits_equal(tree["y"], before[1])
    assert clipped["x"] is clipped["z"] and clipped["n"] == "relu"
    reference = {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in tree.items()}
    reference["z"] = reference["x"]
    ref_norm = gf.clip_grad_norm_(reference, 0.5, backend=backend)
    assert float(norm) == float(ref_norm)
    assert_bits_equal(clipped["x"], reference["x"]) and assert_bits_equal(clipped["y"], reference["y"])


def test_a_leaf_made_read_only_after_a_clip_is_refused_on_the_next(backend):
    g = {"w": np.array([3.0, 4.0]), "b": np.ones(2, np.float32)}
    gf.clip_grad_norm_(g, 1.0, backend=backend)
    g["b"].flags.writeable = False
    before = g["w"].copy()
    with pytest.raises(ValueError, match=r"\['b'\].*read-only"):
        gf.clip_grad_norm_(g, 1e-3, backend=backend)
    assert_bits_equal(g["w"], before)


def test_total_reads_a_gradient_tree_through_the_model(backend):
    w = np.ones(3)
    model = {"a": w, "b": w, "c": np.ones(2, np.float32)}
    grads = {"a": np.full(3, 2.0), "b": np.full(3, 1.0), "c": None}
    assert float(gf.total("sumsq", grads, model=model, backend=backend)) == pytest.approx(27.0)
    assert float(gf.total("l1", grads, model=model, backend=backend)) == pytest.approx(9.0)
    assert gf.total("count", grads, model=model, backend=backend) == 5


def test_clip_keeps_no_gradient_alive_after_it_returns(backend):
    import gc
    import weakref

    g = {"w": np.ones(4, np.float32), "b": np.ones(2)}
    gf.clip_grad_norm_(g, 1.0, backend=backend)
    ref = weakref.ref(g["w"])
    del g
    gc.collect()
    assert ref() is None  # set_to_none gradients must be freed, not held by a cache


def test_gradients_made_with_create_graph_are_clipped_as_gradients():
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.tensor([3.0, 4.0]))
    (g,) = torch.autograd.grad((w**2).sum() / 2, w, create_graph=True)  # requires grad, not a leaf
    assert g.requires_grad and not g.is_leaf
    with torch.no_grad():
        assert float(gf.clip_grad_norm_([g], 1.0)) == 5.0
    np.testing.assert_allclose(g.detach().numpy(), [0.6, 0.8], rtol=1e-6)


def test_restructure_prints_and_rebuilds_with_the_same_statics_rule_as_unflatten():
    tree = {"w": np.ones((2, 3), np.float32), "act": "relu", "b": np.zeros(3)}
    flat, re = gf.destructure(tree)
    assert repr(re) == "Restructure(dict, ..., 9)"
    assert isinstance(re, gf.Restructure)
    via_re = re(np.arange(9.0))
    via_unflatten = gf.unflatten(gf.plan(tree), np.arange(9.0))
    assert via_re["act"] is via_unflatten["act"] is tree["act"]
    for k in ("w", "b"):
        np.testing.assert_array_equal(via_re[k], via_unflatten[k])
        assert via_re[k].dtype == tree[k].dtype
    # A bare array's Restructure names it as such.
    assert repr(gf.destructure(np.ones(4))[1]) == "Restructure(array, ..., 4)"


def test_a_clip_of_a_gradient_tree_is_one_binding_call_and_one_backend_call_each_for_the_norm_and_the_scale(
        monkeypatch):
    from gpuflat._src import ops
    from gpuflat._src.backends import get_backend

    from conftest import counted

    calls = []
    backend = get_backend("numpy")
    monkeypatch.setattr(ops, "Call", counted(calls, "bind", ops.Call))
    monkeypatch.setattr(backend, "norms", counted(calls, "norms", backend.norms))
    monkeypatch.setattr(backend, "clip_", counted(calls, "clip_", backend.clip_))
    grads = {"w": np.full((3, 4), 2.0), "b": np.full(5, 2.0, np.float32)}
    for _ in range(3):
        calls.clear()
        gf.clip_grad_norm_(grads, 1.0, backend="numpy")
        assert calls == ["bind", "norms", "clip_"]
