"""The offset plan: offsets, sizes, dtype promotion, ties, the bounded cache, staleness."""
from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

import gpuflat as gf
import importlib

gplan = importlib.import_module("gpuflat._src.flatplan")

from conftest import BF16, DTYPES, DTYPE_IDS, ref_flat_dtype


def info():
    i = gf.plan_cache_info()
    return i.hits, i.misses, i.size


def test_offsets_sizes_shapes():
    a = np.ones((2, 3), np.float32)
    b = np.ones((4, 5))[:, ::2]  # strided
    c = np.array(2.0, np.float32)  # 0-d
    e = np.ones((0, 7), np.float32)  # empty
    p = gf.plan({"a": a, "b": b, "c": c, "e": e, "n": np.arange(3)})
    assert [l.path for l in p.leaves] == ["['a']", "['b']", "['c']", "['e']"]
    assert [l.offset for l in p.leaves] == [0, 6, 18, 19]
    assert [l.size for l in p.leaves] == [6, 12, 1, 0]
    assert [l.shape for l in p.leaves] == [(2, 3), (4, 3), (), (0, 7)]
    assert [l.dtype for l in p.leaves] == [a.dtype, b.dtype, c.dtype, e.dtype]
    # Strides are not part of a plan: a plan serves every tree of its structure.
    assert not hasattr(p.leaves[1], "strides")
    assert p.size == 19 and p.dtype == np.float64
    assert p.offsets.tolist() == [0, 6, 18, 19, 19] and p.offsets.dtype == np.int64
    with pytest.raises(ValueError):
        p.offsets[0] = 1


@pytest.mark.parametrize("d1,d2", list(itertools.combinations_with_replacement(DTYPES, 2)),
                         ids=[f"{a}-{b}" for a, b in itertools.combinations_with_replacement(DTYPE_IDS, 2)])
def test_flat_dtype_promotion(d1, d2):
    p = gf.plan([np.zeros(1, d1), np.zeros(2, d2)])
    assert p.dtype == ref_flat_dtype([d1, d2])


def test_bf16_promotion():
    assert gf.plan([np.zeros(1, BF16)]).dtype == BF16
    assert gf.plan([np.zeros(1, BF16), np.zeros(1, np.float16)]).dtype == np.float32
    assert gf.plan([np.zeros(1, BF16), np.zeros(1, np.float64)]).dtype == np.float64
    assert gf.plan([np.zeros(1, BF16), np.zeros(1, np.complex64)]).dtype == np.complex64


def test_empty_tree_plan():
    p = gf.plan({"a": [], "b": "x"})
    assert p.size == 0 and p.dtype == np.float32 and p.leaves == () and p.offsets.tolist() == [0]


def test_tie_map():
    a, b = np.ones(2), np.ones(3)
    p = gf.plan({"x": a, "y": b, "z": [a, b, a]})
    assert p.slot_of == (0, 1, 0, 1, 0)
    assert len(p.leaves) == 2 and p.size == 5
    assert p.occurrence_paths == ("['x']", "['y']", "['z'][0]", "['z'][1]", "['z'][2]")


def test_plan_is_frozen():
    p = gf.plan({"w": np.ones(2)})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.size = 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.leaves[0].offset = 1
    assert isinstance(p.leaves, tuple) and isinstance(p.slot_of, tuple)


def test_cache_hit_on_same_shaped_tree():
    p1 = gf.plan({"w": np.ones((2, 3), np.float32), "act": "relu"})
    assert info() == (0, 1, 1)
    p2 = gf.plan({"w": np.zeros((2, 3), np.float32), "act": "relu"})
    # Equal plans of one cached structure; each carries its own tree's statics.
    assert p2 == p1 and p2.structure is p1.structure and info() == (1, 1, 1)
    # every public entry point reads the same cache
    gf.global_norm({"w": np.ones((2, 3), np.float32), "act": "relu"})
    gf.trainables({"w": np.ones((2, 3), np.float32), "act": "relu"})
    assert info() == (3, 1, 1)


def _tied():
    a = np.ones(2)
    return {"x": a, "y": np.ones(3, np.float32), "z": a}


CHANGES = {
    "shape": lambda t: {**t, "y": np.ones(4, np.float32)},
    "dtype": lambda t: {**t, "y": np.ones(3, np.float64)},
    "key added": lambda t: {**t, "extra": np.ones(1)},
    "key removed": lambda t: {k: v for k, v in t.items() if k != "y"},
    "key renamed": lambda t: {("Y" if k == "y" else k): v for k, v in t.items()},
    "key order": lambda t: {"y": t["y"], "x": t["x"], "z": t["z"]},
    "tie broken": lambda t: {**t, "z": t["x"].copy()},
    "tie made": None,  # built in the test: needs a tree without a tie first
    "container": lambda t: {**t, "y": [t["y"]]},
    "static type": lambda t: {**t, "act": 3},
    "static array shape": lambda t: {**t, "act": np.arange(4)},
}


@pytest.mark.parametrize("change", list(CHANGES), ids=list(CHANGES))
def test_changed_tree_is_a_miss_and_gets_fresh_offsets(change):
    base = {**_tied(), "act": "relu"} if change == "static type" else _tied()
    if change == "static array shape":
        base = {**_tied(), "act": np.arange(3)}
    p1 = gf.plan(base)
    if change != "tie made":
        changed = CHANGES[change](base)
    else:  # make a tie where there was none
        gf.plan_cache_clear()
        a, b = np.ones(2), np.ones(2)
        base = {"x": a, "y": np.ones(3, np.float32), "z": b}
        p1 = gf.plan(base)
        changed = {"x": a, "y": base["y"], "z": a}
    misses = gf.plan_cache_info().misses
    p2 = gf.plan(changed)
    assert p2 != p1
    assert gf.plan_cache_info().misses == misses + 1
    # The new plan describes the new tree, never the cached one.
    arrays = [a for a in gf.trainables(changed)]
    assert [l.shape for l in p2.leaves] == [a.shape for a in arrays]
    assert [l.dtype for l in p2.leaves] == [a.dtype for a in arrays]
    assert p2.size == sum(a.size for a in arrays)
    flat, _ = gf.destructure(changed)
    assert flat.size == p2.size
    np.testing.assert_array_equal(flat, np.concatenate([a.reshape(-1) for a in arrays]).astype(p2.dtype))


def test_stale_plan_used_on_changed_tree_raises():
    p = gf.plan(_tied())
    with pytest.raises(gf.TreeMismatchError, match=r"\['y'\].*\(3,\).*\(4,\)"):
        gf.flatten(p, CHANGES["shape"](_tied()))
    with pytest.raises(gf.TreeMismatchError, match=r"\['y'\].*float32.*float64"):
        gf.flatten(p, CHANGES["dtype"](_tied()))
    with pytest.raises(gf.TreeMismatchError, match="extra"):
        gf.flatten(p, CHANGES["key added"](_tied()))
    with pytest.raises(gf.TreeMismatchError, match="missing"):
        gf.flatten(p, CHANGES["key removed"](_tied()))


def test_cache_is_bounded():
    maxsize = gf.plan_cache_info().maxsize
    for n in range(maxsize + 20):
        gf.plan({"w": np.ones(n + 1)})
    hits, misses, size = info()
    assert size == maxsize and misses == maxsize + 20 and hits == 0
    # The most recent plans are kept, the oldest evicted.
    gf.plan({"w": np.ones(maxsize + 20)})
    assert info()[0] == 1
    gf.plan({"w": np.ones(1)})
    assert info()[1] == maxsize + 21


def test_cache_clear_resets():
    gf.plan({"w": np.ones(2)})
    gf.plan({"w": np.ones(2)})
    gf.plan_cache_clear()
    assert info() == (0, 0, 0)
    gf.plan({"w": np.ones(2)})
    assert info() == (0, 1, 1)


def test_cached_plan_does_not_hold_arrays_of_the_tree_alive():
    import weakref

    w = np.ones(1000)
    ref = weakref.ref(w)
    gf.plan({"w": w})
    del w
    assert ref() is None


def test_same_shape_different_strides_gives_correct_results():
    # A hit on a plan made for a C-ordered leaf must still read a transposed leaf by its own strides.
    a = np.arange(6.0).reshape(2, 3)
    b = np.asfortranarray(a * 2)  # same shape and dtype, other strides
    assert b.strides != a.strides
    gf.plan({"w": a})
    flat, _ = gf.destructure({"w": b})
    np.testing.assert_array_equal(flat, b.reshape(-1))


def test_statics_replaced_every_step_hit_the_cache_and_rebuild_with_their_new_value():
    # Integer statistics and a step counter replaced each step: same structure, so
    # one plan; the rebuilt tree carries this step's values, not the first.
    w = np.ones(3, np.float32)
    for step in range(5):
        tree = {"w": w, "mean": np.full(2, step), "step": np.array(step), "n": step, "act": f"a{step}"}
        flat, re = gf.destructure(tree)
        rebuilt = re(flat)
        assert rebuilt["mean"] is tree["mean"] and rebuilt["step"] is tree["step"]
        assert rebuilt["n"] == step and rebuilt["act"] == f"a{step}"
    assert gf.plan_cache_info().misses == 1 and gf.plan_cache_info().size == 1


def test_a_plan_keeps_no_array_of_the_trees_after_the_first():
    import gc
    import weakref

    gf.plan({"w": np.ones(2), "mean": np.zeros(2, int)})
    later = np.zeros(2, int)
    ref = weakref.ref(later)
    gf.plan({"w": np.ones(2), "mean": later})
    del later
    gc.collect()
    assert ref() is None


def test_large_synthetic_offsets_are_python_ints():
    # Leaves of 2**31 + k elements, without allocating them: 0-strided broadcast views.
    big = [np.broadcast_to(np.zeros(1, np.float32), (2**31 + k,)) for k in (1, 7, 3)]
    tiny = np.zeros(5, np.float32)
    p = gf.plan({"a": big[0], "b": tiny, "c": big[1], "d": (big[2],)})
    sizes = [2**31 + 1, 5, 2**31 + 7, 2**31 + 3]
    expected_offsets = [0, 2**31 + 1, 2**31 + 6, 2**32 + 13]
    assert [l.size for l in p.leaves] == sizes
    assert [l.offset for l in p.leaves] == expected_offsets
    assert all(type(l.offset) is int and type(l.size) is int for l in p.leaves)
    assert p.size == sum(sizes) == 3 * 2**31 + 16
    assert p.offsets.dtype == np.int64
    assert [int(o) for o in p.offsets] == expected_offsets + [sum(sizes)]


def test_offsets_of_multi_dimensional_leaves_past_2_32():
    # 2-D leaves of 2**43 elements each: the size is a product that overflows 32 bits.
    leaf = np.broadcast_to(np.zeros(1, np.float32), (2**22, 2**21))
    p = gf.plan([leaf, np.broadcast_to(np.zeros(1, np.float32), (2**22, 2**21))])
    assert p.size == 2**44
    assert [int(o) for o in p.offsets] == [0, 2**43, 2**44]


def test_signature_helpers_agree():
    a = np.ones(2)
    slot_of, unique, (shapes, dtypes) = gplan.signature([a, np.ones(3), a])
    assert slot_of == (0, 1, 0) and unique[0] is a and shapes == ((2,), (3,)) and dtypes == (a.dtype,) * 2


def test_the_cache_keeps_no_user_value_alive():
    import gc
    import weakref

    class Net:
        __trainable__ = ("w",)

        def __init__(self):
            self.w, self.running = np.ones(3), np.zeros(3)

    refs = []
    for _ in range(3):  # a static array replaced every step, inside a walked object
        net = Net()
        refs.append(weakref.ref(net.running))
        gf.global_norm(net)
        plan = gf.plan(net)
        del net, plan
    gc.collect()
    assert gf.plan_cache_info().size == 1
    assert all(ref() is None for ref in refs)


def test_unflatten_rebuilds_with_the_planned_trees_statics():
    p_relu = gf.plan({"w": np.ones(2), "act": "relu"})
    p_gelu = gf.plan({"w": np.ones(2), "act": "gelu"})
    assert p_relu == p_gelu and gf.plan_cache_info().size == 1
    assert gf.unflatten(p_relu, np.zeros(2))["act"] == "relu"
    assert gf.unflatten(p_gelu, np.zeros(2))["act"] == "gelu"


def test_the_cache_keeps_no_module_alive():
    import gc
    import weakref

    torch = pytest.importorskip("torch")
    refs = []
    for _ in range(3):
        net = torch.nn.Linear(3, 2)
        refs += [weakref.ref(net), weakref.ref(net.weight)]
        gf.global_norm(net)
        gf.plan(net)
        del net
    gc.collect()
    assert gf.plan_cache_info().size == 1
    assert all(ref() is None for ref in refs)
