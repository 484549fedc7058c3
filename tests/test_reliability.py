"""Reliability: hostile input, faults and scale, with nothing lost.

Every in-place operation either completes or changes nothing (checked byte for
byte); NaN/inf are reported honestly; overflow-prone dtypes give the right
norm; offsets are 64-bit; the API is thread-safe; memory stays flat; and a
fuzzer checks every operation against plain NumPy on every backend.
"""
from __future__ import annotations

import gc
import math
import threading
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gpuflat as gf

from conftest import (
    torch_scaled,
    BF16, DTYPES, DTYPE_IDS, Linear, assert_bits_equal, cast, exact_norm, grads_for, random_array,
    ref_flatten, ref_flatten_grads, ref_unique, ref_walk, rel_err, snapshot, trees,
)

ORDS = [1, 2, math.inf, 0.5, 3]


def _model(dtype=np.float32):
    rng = np.random.default_rng(0)
    return {
        "enc": {"layers": [Linear(random_array(rng, (4, 3), dtype), random_array(rng, (3,), dtype)),
                           Linear(random_array(rng, (3, 3), dtype).T, random_array(rng, (), dtype))]},
        "head": random_array(rng, (5,), dtype)[::-1],
        "n": np.arange(3),
    }


def _raises_and_unchanged(fn, tree, exc, *patterns):
    before = snapshot(tree)
    with pytest.raises(exc) as info:
        fn()
    for pat in patterns:
        assert pat in str(info.value), (pat, str(info.value))
    assert snapshot(tree) == before, "a failed in-place call changed the tree"


# ---------------------------------------------------------------- complete or change nothing

def test_scatter_bad_leaf_deep_in_tree_changes_nothing(backend):
    m = _model()
    p = gf.plan(m)
    m["enc"]["layers"][1].bias = np.zeros((1,), np.float32)  # the last-but-one leaf, deep
    _raises_and_unchanged(lambda: gf.scatter(p, np.arange(p.size, dtype=np.float32), m, backend=backend),
                          m, gf.TreeMismatchError, "['enc']['layers'][1].bias", "()", "(1,)")


@pytest.mark.parametrize("op", ["scatter", "clip", "clip_nonfinite_check"])
def test_read_only_leaf_last_changes_nothing(op, backend):
    m = _model()
    m["head"] = m["head"].copy()
    m["head"].flags.writeable = False  # the very last leaf: every earlier one would be written first
    p = gf.plan(m)
    if op == "scatter":
        fn = lambda: gf.scatter(p, np.zeros(p.size, np.float32), m, backend=backend)  # noqa: E731
    else:
        fn = lambda: gf.clip_grad_norm_(m, 1e-3, backend=backend,  # noqa: E731
                                        error_if_nonfinite=op == "clip_nonfinite_check")
    _raises_and_unchanged(fn, m, ValueError, "['head']", "read-only")


def test_read_only_second_occurrence_of_a_broken_tie_changes_nothing(backend):
    a = np.zeros(3)
    p = gf.plan({"x": a, "y": np.zeros(2), "z": a})
    z = np.zeros(3)
    z.flags.writeable = False
    tree = {"x": np.zeros(3), "y": np.zeros(2), "z": z}
    _raises_and_unchanged(lambda: gf.scatter(p, np.arange(5.0), tree, backend=backend), tree,
                          ValueError, "['z']", "read-only")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_error_if_nonfinite_names_first_bad_leaf_and_scales_nothing(dtype, bad, backend):
    m = _model(dtype)
    m["enc"]["layers"][1].weight[1, 2] = bad  # a transposed leaf
    m["head"][0] = bad  # a later one: the first is named
    _raises_and_unchanged(lambda: gf.clip_grad_norm_(m, 1e-3, error_if_nonfinite=True, backend=backend),
                          m, gf.NonFiniteError, "['enc']['layers'][1].weight")


def test_error_if_nonfinite_on_an_overflowing_norm(backend):
    # Every value is finite, but the sum of squares overflows float64: the norm is inf.
    m = {"a": np.full(4, 1e200), "b": np.ones(2)}
    with np.errstate(over="ignore"):
        assert float(gf.global_norm(m, backend=backend)) == math.inf
        _raises_and_unchanged(lambda: gf.clip_grad_norm_(m, 1.0, error_if_nonfinite=True, backend=backend),
                              m, gf.NonFiniteError)


def test_nonfinite_without_the_check_makes_grads_nan_like_pytorch(backend):
    g = {"a": np.array([1.0, np.nan]), "b": np.ones(3, np.float32)}
    with np.errstate(invalid="ignore"):
        norm = gf.clip_grad_norm_(g, 1.0, backend=backend)
    assert math.isnan(float(norm))
    assert np.isnan(g["a"]).all() and np.isnan(g["b"]).all()
    g = {"a": np.array([1.0, np.inf]), "b": np.ones(3, np.float32)}
    with np.errstate(invalid="ignore"):  # inf * 0
        norm = gf.clip_grad_norm_(g, 1.0, backend=backend)
    assert float(norm) == math.inf  # coef = max_norm / inf = 0
    assert g["b"].tolist() == [0, 0, 0]


# ---------------------------------------------------------------- NaN / inf honesty

@pytest.mark.parametrize("ord", ORDS, ids=[str(o) for o in ORDS])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_and_inf_are_reported(dtype, ord, backend):
    for values, expect in [([1, np.nan], "nan"), ([np.inf, 1], "inf"), ([-np.inf, 0], "inf"),
                           ([np.nan, np.inf], "nan"), ([np.inf, np.nan], "nan")]:
        tree = {"ok": np.ones(3, dtype), "bad": np.array(values, dtype), "tail": np.zeros(2, dtype)}
        total, per = gf.global_norm(tree, ord, per_leaf=True, backend=backend)
        got = float(total)
        assert (math.isnan(got) if expect == "nan" else got == math.inf), (values, got)
        per = np.asarray(per)
        assert per[0] == exact_norm([tree["ok"]], ord) and per[2] == 0
        assert math.isnan(per[1]) if expect == "nan" else per[1] == math.inf


def test_complex_nan_in_imaginary_part(backend):
    tree = {"c": np.array([1 + 1j, 1 + np.nan * 1j], np.complex64)}
    assert math.isnan(float(gf.global_norm(tree, backend=backend)))
    with pytest.raises(gf.NonFiniteError, match=r"\['c'\]"):
        gf.clip_grad_norm_(tree, 1.0, error_if_nonfinite=True, backend=backend)


# ---------------------------------------------------------------- overflow-prone dtypes

@pytest.mark.parametrize("dtype,value", [(np.float32, 1e30), (np.float32, 3e38), (np.float16, 300.0),
                                         (np.float16, 60000.0), ("bf16", 1e30), ("bf16", 3e38),
                                         (np.complex64, 1e30)])
@pytest.mark.parametrize("ord", [2, 3, 1, math.inf])
def test_norm_of_values_whose_powers_overflow_the_dtype(dtype, value, ord, backend):
    dtype = BF16 if dtype == "bf16" else np.dtype(dtype)
    tree = {"w": np.full(1000, value, dtype), "b": np.full(7, -value, dtype)}
    ref = exact_norm([tree["w"], tree["b"]], ord)
    assert math.isfinite(ref)
    assert rel_err(gf.global_norm(tree, ord, backend=backend), ref) < 1e-12
    g = {k: v.copy() for k, v in tree.items()}
    norm = gf.clip_grad_norm_(g, 1.0, ord, backend=backend)
    assert rel_err(norm, ref) < 1e-12
    assert np.isfinite(g["w"].astype(np.complex128)).all() and float(np.abs(g["w"][0])) > 0


def test_float32_1e30_and_float16_300_two_norm(backend):
    assert rel_err(gf.global_norm([np.full(4, 1e30, np.float32)], backend=backend),
                   2 * float(np.float32(1e30))) < 1e-12
    assert float(gf.global_norm([np.full(4, 300, np.float16)], backend=backend)) == 600.0
    assert float(gf.total("l2", [np.full(4, 300, np.float16)], backend=backend)) == 600.0


def test_bf16_norm_of_norms_keeps_precision(backend):
    # https://github.com/pytorch/pytorch/issues/68107: a norm of norms in the input dtype loses precision; here it is float64.
    rng = np.random.default_rng(1)
    tree = [rng.standard_normal(257).astype(BF16) for _ in range(50)]
    assert rel_err(gf.global_norm(tree, backend=backend), exact_norm(tree)) < 1e-12


def test_many_small_float32_values_accumulate_exactly(backend):
    # https://github.com/pytorch/pytorch/issues/186881: one fp32 sum over a flat cat has relative error ~3e-5 on 1M elements.
    x = np.full(1 << 20, 0.1, np.float32)
    ref = exact_norm([x[:1]]) * 1024  # sqrt(2**20 * v**2) = 2**10 * |v|, exactly
    assert rel_err(gf.global_norm({"x": x}, backend=backend), ref) < 1e-12


def test_empty_leaves_among_others(backend):
    # https://github.com/pytorch/pytorch/issues/140066: empty tensors in a list gave wrong foreach norms.
    tree = [np.zeros(0, np.float32), np.array([3.0, 4.0], np.float32), np.zeros((0, 5)), np.array([12.0])]
    total, per = gf.global_norm(tree, per_leaf=True, backend=backend)
    assert float(total) == 13.0 and np.asarray(per).tolist() == [0.0, 5.0, 0.0, 12.0]


# ---------------------------------------------------------------- 64-bit sizes without allocating

def test_plan_offsets_past_2_31_elements():
    big = np.broadcast_to(np.zeros(1, np.float16), (2**31 + 3,))  # 0-strided: no memory
    p = gf.plan({"small": np.zeros(5, np.float16), "big": big, "after": np.zeros(2, np.float16),
                 "big2": np.broadcast_to(np.zeros(1, np.float16), (3, 2**31))})
    offsets = [0, 5, 5 + 2**31 + 3, 5 + 2**31 + 3 + 2]
    assert [leaf.offset for leaf in p.leaves] == offsets
    assert p.size == offsets[-1] + 3 * 2**31
    assert p.offsets.dtype == np.int64 and [int(o) for o in p.offsets] == offsets + [p.size]
    assert p.size > 2**32 and all(isinstance(leaf.offset, int) for leaf in p.leaves)
    assert gf.total("count", {"big": big}) == 2**31 + 3


def test_size_past_2_31_is_not_truncated_in_flat_checks():
    big = np.broadcast_to(np.zeros(1, np.float32), (2**31 + 1,))
    p = gf.plan({"big": big})
    # A flat of the 32-bit-wrapped length must be refused by its true length.
    with pytest.raises(gf.TreeMismatchError, match=str(2**31 + 1)):
        gf.unflatten(p, np.zeros(1, np.float32))


# ---------------------------------------------------------------- staleness

def test_tree_changed_after_its_plan_was_cached(backend):
    m = {"w": np.ones((2, 3)), "b": np.ones(3), "t": None}
    gf.plan(m)
    m["w"] = np.full((3, 3), 2.0)  # replaced by another shape
    assert float(gf.total("count", m)) == 12
    assert rel_err(gf.global_norm(m, backend=backend), exact_norm([m["w"], m["b"]])) < 1e-12
    m["b"] = np.ones(3, np.float32)  # another dtype
    flat, _ = gf.destructure(m, backend=backend)
    assert_bits_equal(flat, ref_flatten(m))
    m["extra"] = np.full(2, 5.0)  # a key added
    g = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in m.items()}
    norm = gf.clip_grad_norm_(g, 1e9, backend=backend)
    assert rel_err(norm, exact_norm([m["w"], m["b"], m["extra"]])) < 1e-12
    del m["w"]  # a key removed
    assert_bits_equal(gf.destructure(m, backend=backend)[0], ref_flatten(m))


def test_tie_broken_after_caching(backend):
    a = np.arange(3.0)
    m = {"x": a, "z": a}
    assert gf.destructure(m, backend=backend)[0].tolist() == [0, 1, 2]
    m["z"] = a + 10  # tie broken: two slots now
    assert gf.destructure(m, backend=backend)[0].tolist() == [0, 1, 2, 10, 11, 12]
    g = {"x": np.ones(3), "z": np.ones(3)}
    assert float(gf.clip_grad_norm_(g, 1e9, backend=backend)) == math.sqrt(6)


def test_stale_plan_used_explicitly_raises(backend):
    m = {"w": np.ones((2, 3)), "b": np.ones(3)}
    p = gf.plan(m)
    m2 = dict(m, w=np.ones((3, 2)))
    _raises_and_unchanged(lambda: gf.scatter(p, np.zeros(9), m2, backend=backend), m2,
                          gf.TreeMismatchError, "['w']", "(2, 3)", "(3, 2)")
    with pytest.raises(gf.TreeMismatchError, match=r"\['w'\]"):
        gf.flatten(p, m2, backend=backend)


# ---------------------------------------------------------------- threads

def test_returned_norms_are_not_overwritten_by_later_calls(backend):
    a, b = {"w": np.full(4, 1.0)}, {"w": np.full(4, 2.0)}
    n1 = gf.global_norm(a, backend=backend)
    t1, per1 = gf.global_norm(a, per_leaf=True, backend=backend)
    c1 = gf.clip_grad_norm_({"w": np.full(4, 3.0)}, 1.0, backend=backend)
    for _ in range(3):
        gf.global_norm(b, backend=backend)
        gf.global_norm(b, per_leaf=True, backend=backend)
        gf.clip_grad_norm_({"w": np.full(4, 5.0)}, 1.0, backend=backend)
    assert float(n1) == 2.0 and float(t1) == 2.0 and np.asarray(per1).tolist() == [2.0] and float(c1) == 6.0


def test_eight_threads_different_and_same_shaped_trees(backend):
    n_threads, n_iter = 8, 30
    shapes = [[(3, 4), (5,)], [(2, 2), (7,), ()], [(6,)], [(3, 4), (5,)]]  # 0 and 3 share a shape
    errors, lookups = [], [0] * n_threads
    start = threading.Barrier(n_threads)

    def work(k):
        try:
            local = np.random.default_rng(k)
            start.wait()
            for _ in range(n_iter):
                tree = {f"l{j}": local.standard_normal(s) for j, s in enumerate(shapes[k % len(shapes)])}
                ref = exact_norm(list(tree.values()))
                assert rel_err(gf.global_norm(tree, backend=backend), ref) < 1e-12
                flat, re = gf.destructure(tree, backend=backend)
                assert_bits_equal(flat, ref_flatten(tree))
                assert_bits_equal(ref_flatten(re(flat)), flat)
                g = {key: v.copy() for key, v in tree.items()}
                norm = gf.clip_grad_norm_(g, 0.5, backend=backend)
                assert rel_err(norm, ref) < 1e-12
                assert rel_err(gf.global_norm(g, backend=backend), 0.5 / (float(norm) + 1e-6) * ref) < 1e-6
                lookups[k] += 4
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    info = gf.plan_cache_info()
    distinct = 3  # shapes[0] and shapes[3] are one structure
    assert info.size == distinct
    assert info.hits + info.misses == sum(lookups)
    assert distinct <= info.misses <= distinct * n_threads


def test_threads_share_one_plan_object():
    plans, start = [], threading.Barrier(8)

    def work():
        start.wait()
        for _ in range(50):
            plans.append(gf.plan({"w": np.ones(3), "b": np.ones(2, np.float32)}))

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Two threads may both build on their first miss, but the cache keeps one plan.
    assert gf.plan_cache_info().size == 1
    final = gf.plan({"w": np.ones(3), "b": np.ones(2, np.float32)})
    assert sum(p is final for p in plans) >= 400 - 8
    assert all(p.size == 5 and p.leaves == final.leaves for p in plans)


# ---------------------------------------------------------------- memory

def test_memory_flat_over_10000_clip_calls(backend):
    # 10,000 calls on the NumPy backend; the emulated device runs every kernel
    # thread as a host thread, so it gets 1,000 calls (the same bound per call is far stricter).
    calls = 10_000 if backend == "numpy" else 1_000
    rng = np.random.default_rng(3)
    g = {"w": rng.standard_normal((8, 8)).astype(np.float32), "b": rng.standard_normal(8),
         "layers": [rng.standard_normal(4).astype(np.float16) for _ in range(3)]}
    for _ in range(200):  # warm-up: plan cache, backend tables, interned objects
        gf.clip_grad_norm_(g, 1e3, backend=backend)
    gc.collect()
    tracemalloc.start()
    try:
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(calls):
            gf.clip_grad_norm_(g, 1e3, backend=backend)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert after - before < 32 * 1024, f"memory grew by {after - before} bytes over {calls} calls"
    assert gf.plan_cache_info().size == 1


# ---------------------------------------------------------------- fuzzing every operation

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))


def _copy_tree_keep_ties(tree):
    memo = {}

    def cp(x):
        if isinstance(x, np.ndarray) and x.dtype in DTYPES:
            if id(x) not in memo:
                # Keep the layout (strides) of the original: copy into a same-strided view.
                base = np.empty_like(x, order="K")
                base[...] = x
                memo[id(x)] = base
            return memo[id(x)]
        if isinstance(x, dict):
            return {k: cp(v) for k, v in x.items()}
        if isinstance(x, tuple) and hasattr(type(x), "_fields"):
            return type(x)(*[cp(v) for v in x])
        if isinstance(x, (list, tuple)):
            return type(x)(cp(v) for v in x)
        if isinstance(x, Linear):
            return Linear(cp(x.weight), cp(x.bias))
        return x

    return cp(tree)


@FUZZ
@given(data=st.data())
def test_fuzz_every_operation_against_numpy(backend, data):
    tree = data.draw(trees())
    unique = [a for _, a in ref_unique(tree)]
    p = gf.plan(tree)
    # trainables
    got = gf.trainables(tree, path=True)
    assert [path for path, _ in got] == [path for path, _ in ref_unique(tree)]
    # destructure / re
    flat, re = gf.destructure(tree, backend=backend)
    assert_bits_equal(flat, ref_flatten(tree))
    assert_bits_equal(ref_flatten(re(flat)), flat)
    # flatten of gradients (ties summed, same object once, None as zero)
    grads = data.draw(grads_for(tree))
    assert_bits_equal(gf.flatten(p, grads, backend=backend), ref_flatten_grads(tree, grads))
    # unflatten: views where dtypes match
    assert_bits_equal(ref_flatten(gf.unflatten(p, flat.copy())), flat)
    # scatter into a copy (ties kept) of the tree
    target = _copy_tree_keep_ties(tree)
    new = (np.arange(p.size) % 7 - 3).astype(p.dtype)
    gf.scatter(p, new, target, backend=backend)
    offset = 0
    for _, a in ref_unique(target):  # each leaf holds its slice, cast to its own dtype
        assert_bits_equal(a.reshape(-1), cast(new[offset : offset + a.size], a.dtype))
        offset += a.size
    # norms, per leaf, every ord
    ord = data.draw(st.sampled_from(ORDS))
    total, per = gf.global_norm(tree, ord, per_leaf=True, backend=backend)
    assert rel_err(total, exact_norm(unique, ord)) < 1e-12
    for value, a in zip(np.asarray(per), unique):
        assert rel_err(value, exact_norm([a], ord)) < 1e-12
    # total
    assert rel_err(gf.total("l1", tree, backend=backend), exact_norm(unique, 1)) < 1e-12
    assert rel_err(gf.total("l2", tree, backend=backend), math.fsum(exact_norm([a]) for a in unique)) < 1e-12
    assert gf.total("count", tree, backend=backend) == sum(a.size for a in unique)
    # clip_grad_norm_ on a copy, against PyTorch's formula applied to the returned norm
    g = _copy_tree_keep_ties(tree)
    copies = [a.copy() for _, a in ref_unique(g)]
    max_norm = data.draw(st.sampled_from([0.0, 0.5, 1e9]))
    norm = gf.clip_grad_norm_(g, max_norm, ord, backend=backend)
    assert rel_err(norm, exact_norm(copies, ord)) < 1e-12
    coef = min(np.float64(max_norm) / (np.float64(norm) + 1e-6), 1.0)
    for (_, a), c in zip(ref_unique(g), copies):
        assert np.array_equal(a, torch_scaled(c, coef), equal_nan=True)
    # the original tree was never written
    assert_bits_equal(gf.destructure(tree, backend=backend)[0], flat)
    assert len(ref_walk(g)) == len(ref_walk(tree))
