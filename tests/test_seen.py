"""Trees read again without a walk: a changed tree never reuses what was found
about it before (its walk, plan, in-place fitness, apartness from a buffer)."""
from __future__ import annotations

import gc
import threading
import warnings
import weakref

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src import native
from gpuflat._src import seen as _seen
from gpuflat.errors import OverlapError, TreeMismatchError

# A tree is recorded on its second walk, and read through its record from the third.
REPEATS = 3


@pytest.fixture(autouse=True, params=["native facts", "facts read in Python"])
def facts_reader(request, monkeypatch):
    """Every test twice: records reading their arrays' facts in the host
    library, and (as where it is not built) in Python."""
    if request.param == "facts read in Python":
        monkeypatch.setattr(_seen, "array_facts", lambda arrays, words: None)
        monkeypatch.setattr(_seen, "same_shapes", lambda arrays, ids, alive, shapes: None)
    _seen.trees.clear()
    yield request.param
    _seen.trees.clear()


def test_the_native_facts_are_what_a_record_compares(facts_reader):
    tree = _recorded(_tree())
    record = _seen.trees._entries.find(id(tree))
    assert (record.facts is not None) == (facts_reader == "native facts" and native.available())


def _recorded(tree, call=lambda t: gf.global_norm(t)):
    for _ in range(REPEATS):
        call(tree)
    assert type(_seen.trees._entries.find(id(tree))) is _seen.SeenTree
    return tree


def _tree():
    return {"a": np.full(4, 1.0, np.float32), "b": [np.full(3, 2.0), "relu", None], "c": (np.full(2, 3.0),)}


def _norm(arrays):
    return float(np.sqrt(sum(float(np.sum(np.asarray(a, np.float64) ** 2)) for a in arrays)))


def test_a_repeated_tree_is_read_through_its_record():
    tree = _recorded(_tree())
    walked, seen = _seen.trees.walk(tree)
    assert seen is not None and walked.statics == ["relu", None]
    assert [a is b for a, b in zip(walked.arrays, (tree["a"], tree["b"][0], tree["c"][0]))] == [True] * 3


def test_the_record_still_counts_plan_cache_hits():
    tree = _recorded(_tree())
    hits = gf.plan_cache_info().hits
    gf.global_norm(tree)
    assert gf.plan_cache_info().hits == hits + 1


@pytest.mark.parametrize("change, leaves", [
    (lambda t: t.__setitem__("a", np.full(4, 5.0, np.float32)), [5.0] * 4 + [2.0] * 3 + [3.0] * 2),
    (lambda t: t["b"].__setitem__(0, np.full(5, 1.0)), [1.0] * 4 + [1.0] * 5 + [3.0] * 2),
    (lambda t: t.__setitem__("d", np.full(1, 7.0)), [1.0] * 4 + [2.0] * 3 + [3.0] * 2 + [7.0]),
    (lambda t: t["b"].append(np.full(1, 7.0)), [1.0] * 4 + [2.0] * 3 + [3.0] * 2 + [7.0]),
    (lambda t: t["b"].__setitem__(1, np.full(1, 7.0)), [1.0] * 4 + [2.0] * 3 + [7.0] + [3.0] * 2),
    (lambda t: t.__setitem__("c", [np.full(2, 3.0)]), [1.0] * 4 + [2.0] * 3 + [3.0] * 2),
    (lambda t: t.pop("a"), [2.0] * 3 + [3.0] * 2),
], ids=["leaf replaced", "leaf of another shape", "key added", "item appended", "static made a leaf",
        "tuple made a list", "key removed"])
def test_a_changed_container_is_walked_again(backend, change, leaves):
    tree = _recorded(_tree(), lambda t: gf.global_norm(t, backend=backend))
    change(tree)
    assert float(gf.global_norm(tree, backend=backend)) == pytest.approx(_norm([np.array(leaves)]))
    assert gf.plan(tree).size == len(leaves)


def test_a_leaf_reshaped_in_place_changes_the_plan_and_is_named():
    tree = _recorded(_tree())
    plan = gf.plan(tree)
    tree["a"].shape = (2, 2)
    assert gf.plan(tree).leaves[0].shape == (2, 2)
    with pytest.raises(TreeMismatchError, match=r"leaf \"\['a'\]\": expected shape \(4,\), got \(2, 2\)"):
        gf.flatten(plan, tree)


def test_a_leaf_whose_dtype_is_set_in_place_is_no_longer_trainable():
    tree = _recorded(_tree())
    tree["a"].dtype = np.int32
    assert gf.plan(tree).size == 5 and gf.plan(tree).statics[0] is tree["a"]


def test_a_static_replaced_is_the_one_the_plan_carries():
    tree = _recorded({"w": np.ones(2), "step": 10**6})
    tree["step"] = 10**6 + 1
    assert gf.plan(tree).statics == (10**6 + 1,)


def test_a_leaf_that_died_where_a_none_now_sits_is_not_mistaken_for_it():
    tree = _recorded({"w": np.ones(2), "b": np.full(1, 2.0)})
    tree["w"] = None  # the only reference: the array dies, its weak reference gives None too
    gc.collect()
    assert float(gf.global_norm(tree)) == 2.0


def test_a_leaf_replaced_by_an_overlapping_view_is_refused_by_a_clip(backend):
    base = np.ones(8)
    grads = _recorded({"x": base[:4], "y": base[4:]}, lambda g: gf.clip_grad_norm_(g, 1e9, backend=backend))
    grads["y"] = base[2:6]
    before = base.copy()
    with pytest.raises(OverlapError, match=r"\['x'\].*\['y'\]"):
        gf.clip_grad_norm_(grads, 0.5, backend=backend)
    assert np.array_equal(base, before)


def test_strides_set_in_place_are_checked_again():
    grads = _recorded({"x": np.ones(4), "y": np.ones(3)}, lambda g: gf.clip_grad_norm_(g, 1e9))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # NumPy 2.4 deprecates setting strides
        grads["x"].strides = (0,)
    with pytest.raises(OverlapError, match=r"\['x'\].*strides \(0,\)"):
        gf.clip_grad_norm_(grads, 0.5)


def test_strides_changed_between_two_strided_layouts_are_read_again(backend):
    base = np.arange(20.0)
    x = base[:12:2]  # not contiguous before and after: only the strides tell
    tree = _recorded({"x": x}, lambda t: gf.global_norm(t, backend=backend))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # NumPy 2.4 deprecates setting strides
        x.strides = (24,)
    assert float(gf.global_norm(tree, backend=backend)) == pytest.approx(_norm([base[:18:3]]), rel=1e-12)


def test_a_leaf_made_read_only_is_refused_and_nothing_is_written(backend):
    grads = _recorded({"x": np.full(4, 3.0), "y": np.full(3, 4.0)},
                      lambda g: gf.clip_grad_norm_(g, 1e9, backend=backend))
    grads["y"].flags.writeable = False
    with pytest.raises(TreeMismatchError, match=r"\['y'\]\": expected a writable array"):
        gf.clip_grad_norm_(grads, 0.5, backend=backend)
    assert np.all(grads["x"] == 3.0)


def test_a_leaf_replaced_by_a_view_of_out_is_refused_by_flatten(backend):
    tree = {"x": np.ones(4), "y": np.ones(3)}
    plan, out = gf.plan(tree), np.zeros(7)
    _recorded(tree, lambda t: gf.flatten(plan, t, out=out, backend=backend))
    tree["y"] = out[4:]
    with pytest.raises(OverlapError, match=r"leaf \"\['y'\]\" and out share memory"):
        gf.flatten(plan, tree, out=out, backend=backend)


def test_a_leaf_replaced_by_a_view_of_flat_is_refused_by_scatter():
    tree = {"x": np.zeros(2), "y": np.zeros(2)}
    plan, buffer = gf.plan(tree), np.arange(8.0)
    flat = buffer[:4]
    _recorded(tree, lambda t: gf.scatter(plan, flat, t))
    tree["y"] = buffer[2:4]  # a view of flat: scattering would read what it writes
    with pytest.raises(OverlapError, match=r"\['y'\]\" and flat share memory"):
        gf.scatter(plan, flat, tree)
    assert np.array_equal(buffer, np.arange(8.0))


def test_another_out_is_checked_again(backend):
    base = np.zeros(12)
    tree = {"x": base[:4], "y": base[4:7]}
    plan = gf.plan(tree)
    _recorded(tree, lambda t: gf.flatten(plan, t, out=np.zeros(7), backend=backend))
    with pytest.raises(OverlapError, match=r"leaf \"\['y'\]\" and out share memory"):
        gf.flatten(plan, tree, out=base[5:], backend=backend)


def test_scatter_through_the_record_writes_every_leaf(backend):
    tree = {"x": np.zeros(2, np.float32), "y": [np.zeros(3)]}
    plan = gf.plan(tree)
    for k in range(REPEATS + 2):
        gf.scatter(plan, np.arange(5.0) + k, tree, backend=backend)
        assert tree["x"].tolist() == [k, k + 1] and tree["y"][0].tolist() == [k + 2, k + 3, k + 4]


def test_a_recorded_tree_keeps_no_array_alive():
    tree = _recorded({"w": np.ones(3), "b": [np.ones(2)]}, lambda g: gf.clip_grad_norm_(g, 1.0))
    ref = weakref.ref(tree["w"])
    del tree
    gc.collect()
    assert ref() is None


def test_trees_that_are_not_plain_are_never_recorded():
    class Box:
        __trainable__ = ("w",)

        def __init__(self):
            self.w = np.ones(2)

    for tree in ({"box": Box()}, {"f": np.sin, "w": np.ones(2)}, [np.ones(2, np.float32).view(np.matrix)]):
        for _ in range(REPEATS):
            gf.global_norm(tree)
        assert type(_seen.trees._entries.find(id(tree))) is not _seen.SeenTree


def test_threads_each_get_their_own_trees_norm():
    # More trees than records, each thread changing its tree's values between
    # calls: a record read for the wrong tree, or a stale one, gives a wrong norm.
    errors = []

    def work(k):
        tree = {"w": np.full(4, float(k)), "b": [np.full(2, 1.0)]}
        for step in range(60):
            if step % 7 == 0:
                tree["w"] = np.full(4, float(k + step))
            expected = np.sqrt(4 * tree["w"][0] ** 2 + 2)
            got = float(gf.clip_grad_norm_(tree, 1e9))
            if abs(got - expected) > 1e-9 * expected:
                errors.append((k, step, got, expected))

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 2 * _seen.trees._entries.maxsize + 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_tie_broken_after_recording_is_gathered_and_scattered_as_two_arrays(backend):
    w = np.ones(2)
    tree = {"x": w, "y": np.full(1, 5.0), "z": w}
    plan = gf.plan(tree)
    for _ in range(REPEATS):
        assert gf.flatten(plan, tree, backend=backend).tolist() == [1.0, 1.0, 5.0]
        gf.scatter(plan, np.array([1.0, 1.0, 5.0]), tree, backend=backend)
    tree["z"] = np.full(2, 2.0)  # now a gradient tree: the tied slot's two gradients add up
    assert gf.flatten(plan, tree, backend=backend).tolist() == [3.0, 3.0, 5.0]
    gf.scatter(plan, np.array([7.0, 8.0, 9.0]), tree, backend=backend)
    assert tree["x"].tolist() == [7.0, 8.0] and tree["z"].tolist() == [7.0, 8.0]


def test_a_static_array_reshaped_in_place_changes_the_plan():
    tree = _recorded({"w": np.ones(2), "step": np.zeros((), np.int64)})
    before = gf.plan(tree)
    tree["step"].shape = (1,)
    assert gf.plan(tree) != before and gf.plan(tree).treedef != before.treedef


def test_an_array_at_the_address_of_a_dead_one_is_not_taken_for_it():
    tree = _recorded({"w": np.ones(4), "b": np.ones(1)})
    seen = _seen.trees._entries.find(id(tree))
    tree["w"] = np.ones(4)  # the first array dies here
    seen.ids[0] = id(tree["w"])  # as if the new one had been given its address
    assert seen.walk_again(tree) is None


@pytest.mark.parametrize("change, error", [
    (lambda a: setattr(a.flags, "writeable", False), TreeMismatchError),
    (lambda a: setattr(a, "strides", (0,)), OverlapError),
], ids=["made read-only", "strides set"])
def test_a_tree_that_is_not_plain_does_not_reuse_a_stale_in_place_verdict(change, error):
    from collections import namedtuple

    Pair = namedtuple("Pair", "x y")
    grads = Pair(np.ones(4), np.ones(3))  # a namedtuple: walked every call, checked through the per-plan memo
    for _ in range(REPEATS):
        gf.clip_grad_norm_(grads, 1e9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        change(grads.x)
    with pytest.raises(error, match=r"leaf 'x'"):
        gf.clip_grad_norm_(grads, 0.5)


def test_a_layout_of_arrays_without_numpy_flags_compares_their_strides():
    from types import SimpleNamespace

    from gpuflat._src.identity import Layout

    a = SimpleNamespace(flags=SimpleNamespace(c_contiguous=True), strides=(8,))  # as a CuPy array has them
    layout = Layout([a])
    assert layout.holds([a])
    a.strides = (0,)
    assert not layout.holds([a])


def test_a_record_gives_its_arrays_a_token_only_where_their_facts_are_compared(facts_reader):
    from gpuflat._src.identity import Recorded

    tree = _recorded(_tree())
    walked, record = _seen.trees.walk(tree)
    assert type(walked.arrays) is Recorded and walked.arrays.token == record.token
    assert (record.token != 0) == (record.facts is not None)
    again = _recorded({"a": np.ones(2)})
    assert _seen.trees.walk(again)[1].token != record.token or record.token == 0


@pytest.mark.parametrize("op", ["flatten", "scatter", "global_norm", "clip"])
def test_values_changed_in_place_are_read_through_a_recorded_tree(backend, op):
    # The native backend keeps what it read from a recorded tree's arrays:
    # their addresses and layouts, never their values.
    tree = {"w": np.ones((3, 2), np.float32).T, "b": [np.ones(4)], "s": np.ones((), np.float64)}
    plan = gf.plan(tree)
    for k in range(REPEATS + 3):
        values = [np.full((2, 3), k + 1.0, np.float32), np.arange(4.0) * k, np.full((), -k, np.float64)]
        tree["w"][...], tree["b"][0][...], tree["s"][...] = values
        flat = np.concatenate([v.ravel() for v in values]).astype(np.float64)
        if op == "flatten":
            assert gf.flatten(plan, tree, out=np.empty(plan.size), backend=backend).tolist() == flat.tolist()
        elif op == "scatter":
            gf.scatter(plan, flat * 2, tree, backend=backend)
            assert [tree["w"].tolist(), tree["b"][0].tolist(), float(tree["s"])] == [
                (values[0] * 2).tolist(), (values[1] * 2).tolist(), float(values[2]) * 2]
        elif op == "global_norm":
            assert float(gf.global_norm(tree, backend=backend)) == pytest.approx(_norm(values), rel=1e-12)
        else:
            norm = float(gf.clip_grad_norm_(tree, 1.0, backend=backend))
            assert norm == pytest.approx(_norm(values), rel=1e-12)
            scaled = _norm([tree["w"], tree["b"][0], tree["s"]])
            assert scaled == pytest.approx(min(norm, 1.0), rel=1e-6)


# ---------------------------------------------------------------- CuPy trees
#
# On the CuPy stand-in (tests/cupy_stand_in.py), whose arrays have CuPy's
# attributes and its device rules; the kernels run on the host emulator.


@pytest.fixture
def cp(monkeypatch):
    """The stand-in as ``cupy`` (device 0 sm_90, device 1 sm_80), with no device found before."""
    import cupy_stand_in

    from gpuflat._src.backends import selection

    module = cupy_stand_in.install(monkeypatch)
    selection._devices_found.clear()
    yield module
    selection._devices_found.clear()


class _Counted:
    """Calls into the tree walk, the plan signature, the per-leaf device read
    and the per-leaf identity compares of the device found and the tables
    kept (a recorded tree's token stands for them)."""

    def __init__(self, monkeypatch):
        from gpuflat._src import flatplan, tree
        from gpuflat._src.backends import selection
        from gpuflat._src.identity import SameArrays

        self.calls = {"walk": 0, "signature": 0, "device": 0, "identities": 0}
        for owner, name, key in ((tree, "_walk", "walk"), (flatplan, "signature", "signature"),
                                 (selection, "_device_id", "device"), (SameArrays, "holds", "identities"),
                                 (SameArrays, "shared_start", "identities")):
            monkeypatch.setattr(owner, name, self._counting(getattr(owner, name), key))

    def _counting(self, fn, key):
        def counted(*args, **kwargs):
            self.calls[key] += 1
            return fn(*args, **kwargs)
        return counted

    def reset(self):
        self.calls = dict.fromkeys(self.calls, 0)


def _cupy_tree(cp):
    return {"a": cp.asarray(np.full(4, 1.0, np.float32)), "b": [cp.asarray(np.full((2, 3), 2.0)), "relu", None],
            "c": (cp.asarray(np.full(2, 3.0, np.float32)),)}


def _host(cp, arrays):
    return [cp.asnumpy(a) for a in arrays]


@pytest.mark.parametrize("op", ["global_norm", "clip_grad_norm_", "flatten"])
def test_a_repeated_cupy_tree_is_read_without_a_walk_a_signature_or_a_device_read(cp, monkeypatch, op):
    tree = _cupy_tree(cp)
    plan = gf.plan(tree)
    call = {"global_norm": lambda: gf.global_norm(tree), "clip_grad_norm_": lambda: gf.clip_grad_norm_(tree, 1e9),
            "flatten": lambda: gf.flatten(plan, tree)}[op]
    counted = _Counted(monkeypatch)
    for _ in range(REPEATS):
        call()
    assert type(_seen.trees._entries.find(id(tree))) is _seen.SeenTree
    counted.reset()
    result = call()
    assert counted.calls == {"walk": 0, "signature": 0, "device": 0, "identities": 0}
    leaves = _host(cp, [tree["a"], tree["b"][0], tree["c"][0]])
    if op == "flatten":
        assert cp.asnumpy(result).tolist() == np.concatenate([x.ravel() for x in leaves]).tolist()
    else:
        assert float(result) == pytest.approx(_norm(leaves), rel=1e-12)


def test_a_cupy_records_identities_and_shapes_are_compared_natively_where_the_library_is_built(
        cp, facts_reader, monkeypatch):
    tree = _recorded(_cupy_tree(cp))
    answers, compare = [], _seen.same_shapes
    monkeypatch.setattr(_seen, "same_shapes", lambda *args: answers.append(compare(*args)) or answers[-1])
    assert float(gf.global_norm(tree)) == pytest.approx(_norm(_host(cp, [tree["a"], tree["b"][0], tree["c"][0]])))
    assert answers == [True if facts_reader == "native facts" and native.available() else None]


def test_a_recorded_trees_arrays_are_told_cupy_or_numpy_by_their_first(cp):
    from gpuflat._src.backends import selection

    for tree, kinds in ((_cupy_tree(cp), (None, 0)), (_tree(), (0, None))):
        walked, record = _seen.trees.walk(_recorded(tree))
        assert record is not None and selection._first_of_each_kind(walked.arrays) == kinds


def test_a_cupy_leaf_replaced_is_walked_again_and_read_anew(cp, monkeypatch):
    tree = _recorded(_cupy_tree(cp))
    counted = _Counted(monkeypatch)
    tree["a"] = cp.asarray(np.full(4, 5.0, np.float32))  # a new array: another object, another address
    assert float(gf.global_norm(tree)) == pytest.approx(_norm(_host(cp, [tree["a"], tree["b"][0], tree["c"][0]])))
    assert counted.calls["walk"] > 0


def test_a_cupy_array_freed_and_another_made_in_its_place_is_not_taken_for_it(cp):
    tree = _recorded({"w": cp.asarray(np.ones(4)), "b": cp.asarray(np.ones(1))})
    tree["w"] = None
    gc.collect()  # the array and its memory are gone: a new one may take both addresses
    tree["w"] = cp.asarray(np.full(4, 2.0))
    assert float(gf.global_norm(tree)) == pytest.approx(np.sqrt(4 * 4.0 + 1.0))


def test_a_dead_cupy_array_at_the_same_identity_is_not_taken_for_it(cp):
    tree = _recorded({"w": cp.asarray(np.ones(4)), "b": cp.asarray(np.ones(1))})
    seen = _seen.trees._entries.find(id(tree))
    tree["w"] = cp.asarray(np.full(4, 2.0))  # the first array dies here
    seen.ids[0] = id(tree["w"])  # as if the new one, of the same shape, had been given its identity
    assert seen.walk_again(tree) is None


def test_a_numpy_tree_at_a_cupy_records_identity_is_walked_not_read_as_cupy(cp):
    # Records are found by the root's identity, which a new tree may take once
    # the recorded one died: its NumPy leaves have no CuPy attributes to read.
    tree = _recorded({"w": cp.asarray(np.ones(4)), "b": cp.asarray(np.ones(1))})
    seen = _seen.trees._entries.find(id(tree))
    assert seen.walk_again({"w": np.ones(4), "b": np.ones(1)}) is None


def test_a_cupy_leaf_reshaped_in_place_is_read_again(cp):
    # CuPy's ``a.shape = ...`` sets a live array's shape and strides in place;
    # the stand-in's are its host array's.
    tree = _recorded(_cupy_tree(cp))
    plan = gf.plan(tree)
    tree["a"]._host.shape = (2, 2)
    assert gf.plan(tree).leaves[0].shape == (2, 2)
    with pytest.raises(TreeMismatchError, match=r"leaf \"\['a'\]\": expected shape \(4,\), got \(2, 2\)"):
        gf.flatten(plan, tree)


def test_a_strided_cupy_leaf_reshaped_in_place_to_as_many_dims_is_read_again(cp):
    # (3, 4) to (4, 3) of every other element: the same ndim, other dims and
    # strides, which follow from the new shape alone.
    base = cp.asarray(np.arange(24.0))
    tree = _recorded({"x": base[::2]})
    tree["x"]._host.shape = (3, 4)
    _recorded(tree)
    tree["x"]._host.shape = (4, 3)
    assert tree["x"].strides == (48, 16)
    plan = gf.plan(tree)
    assert plan.leaves[0].shape == (4, 3)
    assert cp.asnumpy(gf.flatten(plan, tree)).tolist() == np.arange(24.0)[::2].tolist()
    assert float(gf.global_norm(tree)) == pytest.approx(_norm([np.arange(24.0)[::2]]))


def test_a_cupy_leaf_reshaped_in_place_and_back_is_still_read_through_its_record(cp, monkeypatch):
    # The shape is all a record compares: the same shape again puts every
    # element at its address again (the reshape never copies, nor reorders).
    base = cp.asarray(np.arange(24.0, dtype=np.float32))
    tree = _recorded({"x": base[::2], "y": base[1:4].reshape(3, 1)})
    strides = [a.strides for a in tree.values()]
    counted = _Counted(monkeypatch)
    tree["x"]._host.shape, tree["y"]._host.shape = (2, 2, 3), (1, 3)
    tree["x"]._host.shape, tree["y"]._host.shape = (12,), (3, 1)
    assert [a.strides for a in tree.values()] == strides
    expected = _norm([np.arange(24.0)[::2], np.arange(24.0)[1:4]])
    assert float(gf.global_norm(tree)) == pytest.approx(expected)
    assert counted.calls["walk"] == 0


def test_a_cupy_leaf_replaced_by_one_of_other_strides_is_read_with_them(cp):
    # CuPy sets no strides in place (``strides`` has no setter): other strides
    # of the same shape come as another array, here over the same memory.
    base = cp.asarray(np.arange(20.0))
    tree = _recorded({"x": base[:6]})
    tree["x"] = base[:18:3]
    assert float(gf.global_norm(tree)) == pytest.approx(_norm([np.arange(20.0)[:18:3]]), rel=1e-12)


def test_a_cupy_leaf_made_an_overlapping_view_is_refused_by_a_clip(cp):
    base = cp.asarray(np.ones(8))
    grads = _recorded({"x": base[:4], "y": base[4:]}, lambda g: gf.clip_grad_norm_(g, 1e9))
    grads["y"] = base[2:6]
    with pytest.raises(OverlapError, match=r"\['x'\].*\['y'\]"):
        gf.clip_grad_norm_(grads, 0.5)
    assert cp.asnumpy(base).tolist() == [1.0] * 8


def test_a_cupy_leaf_moved_to_another_device_is_named(cp):
    tree = _recorded(_cupy_tree(cp))
    with cp.cuda.Device(1):
        tree["c"] = (cp.asarray(np.full(2, 3.0, np.float32)),)
    for _ in range(2):  # the tree as recorded, then as walked and recorded again
        with pytest.raises(TypeError, match=r"tree spans two GPUs: leaf \"\['a'\]\" is on device 0, "
                                            r"leaf \"\['c'\]\[0\]\" on device 1"):
            gf.global_norm(tree)


def test_a_device_found_for_some_arrays_is_not_taken_for_others(cp):
    from gpuflat._src.backends import selection

    a, b = cp.asarray(np.ones(2)), cp.asarray(np.ones(2))
    with cp.cuda.Device(1):
        c = cp.asarray(np.ones(2))
    assert selection._one_device([a, b], str) == 0 and selection._one_device([a], str) == 0
    with pytest.raises(TypeError, match="leaf '0' is on device 0, leaf '2' on device 1"):
        selection._one_device([a, b, c], str)
    assert selection._one_device([c], str) == 1


def test_cupy_ties_are_kept_and_a_broken_tie_is_seen(cp):
    w = cp.asarray(np.ones(2))
    tree = {"x": w, "y": cp.asarray(np.full(1, 5.0)), "z": w}
    plan = gf.plan(tree)
    for _ in range(REPEATS):
        assert cp.asnumpy(gf.flatten(plan, tree)).tolist() == [1.0, 1.0, 5.0]
        assert float(gf.global_norm(tree)) == pytest.approx(np.sqrt(27.0))
    assert _seen.trees._entries.find(id(tree)).first == [0, 1]
    tree["z"] = cp.asarray(np.full(2, 2.0))  # now a gradient tree: the tied slot's two gradients add up
    assert cp.asnumpy(gf.flatten(plan, tree)).tolist() == [3.0, 3.0, 5.0]


def test_empty_and_zero_dimensional_cupy_leaves_are_recorded(cp, monkeypatch):
    tree = {"empty": cp.asarray(np.zeros(0, np.float32)), "scalar": cp.asarray(np.array(3.0)),
            "w": [cp.asarray(np.full(2, 4.0))]}
    _recorded(tree)
    counted = _Counted(monkeypatch)
    assert float(gf.global_norm(tree)) == pytest.approx(np.sqrt(9.0 + 32.0))
    assert counted.calls["walk"] == 0
    assert [leaf.shape for leaf in gf.plan(tree).leaves] == [(0,), (), (2,)]


def test_a_tree_of_numpy_and_cupy_arrays_is_never_recorded_and_always_refused(cp):
    tree = {"x": np.ones(2), "y": cp.asarray(np.ones(2))}
    for _ in range(REPEATS):
        with pytest.raises(TypeError, match="tree mixes NumPy and CuPy arrays"):
            gf.global_norm(tree)
    assert type(_seen.trees._entries.find(id(tree))) is not _seen.SeenTree
