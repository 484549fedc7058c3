"""The tree walk: which containers are opened, which leaves are trainable, paths, ties, rebuilds."""
from __future__ import annotations

import dataclasses
from collections import namedtuple

import numpy as np
import pytest

import gpuflat as gf

from conftest import BF16, DTYPES, DTYPE_IDS, BatchNorm, Linear, Pair, ref_unique


def paths(tree):
    return [p for p, _ in gf.trainables(tree, path=True)]


def test_dict_keeps_insertion_order():
    a, b, c = np.ones(1), np.ones(2), np.ones(3)
    tree = {"z": a, "a": b, "m": c}
    got = gf.trainables(tree)
    assert [x is y for x, y in zip(got, [a, b, c])] == [True] * 3
    assert paths(tree) == ["['z']", "['a']", "['m']"]


def test_list_tuple_namedtuple():
    a, b, c, d = (np.full(2, i, np.float32) for i in range(4))
    tree = [a, (b, Pair(c, d))]
    got = gf.trainables(tree)
    assert len(got) == 4 and all(x is y for x, y in zip(got, [a, b, c, d]))
    assert paths(tree) == ["[0]", "[1][0]", "[1][1].first", "[1][1].second"]


def test_dataclass_all_fields_trainable():
    lin = Linear(np.ones((2, 3)), np.zeros(3))
    assert paths(lin) == ["weight", "bias"]
    assert paths({"l": lin}) == ["['l'].weight", "['l'].bias"]


def test_dataclass_with_trainable_attribute_keeps_running_stats_out():
    bn = BatchNorm(np.ones(3), np.zeros(3), np.full(3, 7.0))
    got = gf.trainables(bn, path=True)
    assert [p for p, _ in got] == ["weight", "bias"]
    flat, re = gf.destructure(bn)
    assert flat.tolist() == [1, 1, 1, 0, 0, 0]
    bn2 = re(np.arange(6.0))
    assert type(bn2) is BatchNorm
    assert bn2.weight.tolist() == [0, 1, 2] and bn2.bias.tolist() == [3, 4, 5]
    # The running statistics are kept by reference, untouched.
    assert bn2.running_mean is bn.running_mean
    assert bn.running_mean.tolist() == [7, 7, 7]


class Conv:
    def __init__(self, w, b, stride):
        self.w, self.b, self.stride = w, b, stride


def test_register_fields_and_trainable():
    gf.register(Conv, fields=("w", "b", "stride"), trainable=("w",))
    c = Conv(np.ones(2), np.ones(3), 2)
    assert paths({"conv": c}) == ["['conv'].w"]
    flat, re = gf.destructure({"conv": c})
    c2 = re(flat * 2)["conv"]
    assert type(c2) is Conv and c2.w.tolist() == [2, 2] and c2.b is c.b and c2.stride == 2


def test_register_rejects_unknown_trainable_name():
    class Thing:
        pass

    with pytest.raises(ValueError, match="nope"):
        gf.register(Thing, fields=("a",), trainable=("nope",))


class Attention:
    __trainable__ = ("q", "k")

    def __init__(self):
        self.q, self.k = np.ones(2), np.ones((2, 2))
        self.mask = np.ones(2)  # a float array, but not listed: not trainable
        self.heads = 4


def test_class_attribute_trainable():
    att = Attention()
    assert paths([att]) == ["[0].q", "[0].k"]
    flat, re = gf.destructure([att])
    assert flat.size == 6
    att2 = re(flat + 1)[0]
    assert type(att2) is Attention and att2.mask is att.mask and att2.heads == 4
    assert att2.q.tolist() == [2, 2]


def test_opaque_objects_are_static_leaves():
    class Opaque:
        def __init__(self):
            self.w = np.ones(3)  # hidden inside an object gpuflat does not open

    o = Opaque()
    tree = {"o": o, "f": np.sin, "s": "relu", "n": None, "w": np.ones(2)}
    assert paths(tree) == ["['w']"]
    _, re = gf.destructure(tree)
    t2 = re(np.zeros(2))
    assert t2["o"] is o and t2["f"] is np.sin and t2["s"] == "relu" and t2["n"] is None


@pytest.mark.parametrize("value", [
    np.arange(3), np.array([True, False]), np.array(5), np.int32(3), np.float64(2.0), 2.0, 1, True,
    np.arange(4, dtype=np.uint8), "text", None, b"bytes",
])
def test_non_trainable_values(value):
    assert gf.trainables({"v": value}) == []
    _, re = gf.destructure({"v": value, "w": np.ones(1)})
    assert re(np.zeros(1))["v"] is value


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_trainable_dtype(dtype):
    a = np.zeros((2, 2), dtype)
    assert gf.trainables({"a": a})[0] is a


def test_bf16_is_trainable():
    assert BF16 is not None
    b = np.zeros(1, BF16)
    assert gf.trainables([b])[0] is b


def test_zero_d_and_empty_leaves_are_trainable():
    a, e = np.array(1.5), np.zeros((0, 3), np.float32)
    assert [x is y for x, y in zip(gf.trainables([a, e]), [a, e])] == [True, True]


def test_deep_paths():
    w = np.ones(1)
    tree = {"enc": Pair(first={"layers": [None, None, Linear(w, None)]}, second=None)}
    assert paths(tree) == ["['enc'].first['layers'][2].weight"]
    model = {"enc": Linear(weight={"layers": [1, 2, {"weight": w}]}, bias=0)}
    assert paths(model) == ["['enc'].weight['layers'][2]['weight']"]


def test_root_array_path():
    assert paths(np.ones(2)) == ["<root>"]


def test_ties_listed_once_with_first_path():
    a, b = np.ones(2), np.zeros(3)
    tree = {"x": a, "y": [b, a], "z": Pair(a, b)}
    got = gf.trainables(tree, path=True)
    assert [p for p, _ in got] == ["['x']", "['y'][0]"]
    assert got[0][1] is a and got[1][1] is b


def test_equal_values_are_not_ties():
    tree = {"x": np.ones(2), "y": np.ones(2)}
    assert len(gf.trainables(tree)) == 2


def test_ties_rebuilt_as_one_object():
    a, b = np.ones(2), np.zeros(3)
    tree = {"x": a, "y": b, "z": [a, {"again": a}], "p": Pair(b, 1)}
    flat, re = gf.destructure(tree)
    assert flat.size == 5
    t2 = re(np.arange(5.0))
    assert t2["x"] is t2["z"][0] is t2["z"][1]["again"]
    assert t2["y"] is t2["p"].first
    assert t2["x"] is not a
    assert t2["x"].tolist() == [0, 1] and t2["y"].tolist() == [2, 3, 4]


def test_rebuild_keeps_statics_and_container_types():
    ints, fn = np.arange(3), np.tanh
    tree = {"layers": [Linear(np.ones(2), None), ("relu", 0.5, ints)], "act": fn, "step": 7}
    _, re = gf.destructure(tree)
    t2 = re(np.zeros(2))
    assert type(t2) is dict and type(t2["layers"]) is list and type(t2["layers"][1]) is tuple
    assert t2["layers"][1][0] == "relu" and t2["layers"][1][1] == 0.5 and t2["layers"][1][2] is ints
    assert t2["act"] is fn and t2["step"] == 7 and t2["layers"][0].bias is None


def test_rebuild_keeps_the_statics_of_the_tree_it_was_made_from():
    # Two trees of one structure share a cached plan; each rebuild must keep its own statics.
    for value in [0.0, -0.0, 1, True, "a"]:
        _, re = gf.destructure({"w": np.ones(1), "s": value})
        got = re(np.ones(1))["s"]
        assert type(got) is type(value) and repr(got) == repr(value), (value, got)


def test_trainables_match_reference_walk():
    a = np.ones(3, np.float16)
    tree = {"m": [Linear(a, np.zeros(2)), BatchNorm(np.ones(1), a, np.ones(1))], "t": (a, np.ones(2, np.complex64))}
    got = gf.trainables(tree, path=True)
    ref = ref_unique(tree)
    assert [p for p, _ in got] == [p for p, _ in ref]
    assert all(x is y for (_, x), (_, y) in zip(got, ref))


def test_walk_does_not_copy_leaves():
    a = np.ones(4)[::2]
    assert gf.trainables([a])[0] is a


def test_namedtuple_rebuilt_as_namedtuple():
    NT = namedtuple("NT", "w b")
    _, re = gf.destructure(NT(np.ones(1), "x"))
    t2 = re(np.zeros(1))
    assert type(t2) is NT and t2.b == "x"


def test_frozen_dataclass_rebuilt():
    @dataclasses.dataclass(frozen=True)
    class Frozen:
        w: object
        tag: str = "t"

    _, re = gf.destructure(Frozen(np.ones(2)))
    f2 = re(np.zeros(2))
    assert type(f2) is Frozen and f2.tag == "t" and f2.w.tolist() == [0, 0]


def test_nan_static_still_hits_the_plan_cache():
    gf.plan({"w": np.ones(1), "s": float("nan")})
    gf.plan({"w": np.ones(1), "s": float("nan")})
    info = gf.plan_cache_info()
    assert (info.hits, info.misses, info.size) == (1, 1, 1)


# ---------------------------------------------------------------- what a walk refuses or rebuilds


def test_defaultdict_is_rebuilt_with_its_default_factory():
    from collections import defaultdict

    tree = defaultdict(list, {"w": np.ones(2), "b": np.zeros(1)})
    flat, re = gf.destructure(tree)
    rebuilt = re(flat * 2)
    assert type(rebuilt) is defaultdict and rebuilt.default_factory is list
    assert rebuilt["w"].tolist() == [2, 2] and rebuilt["missing"] == []


@pytest.mark.parametrize("make", [
    lambda: (np.ones(2) for _ in range(2)),
    lambda: iter([np.ones(2)]),
    lambda: {1, 2},
    lambda: {"a": np.ones(2)}.values(),
    lambda: {"a": np.ones(2)}.keys(),
], ids=["generator", "iterator", "set", "dict_values", "dict_keys"])
def test_one_shot_iterables_are_refused_naming_where(make):
    with pytest.raises(gf.UnwalkableError, match="<root>.*cannot be walked twice"):
        gf.global_norm(make())
    with pytest.raises(gf.UnwalkableError, match=r"\['enc'\]\[1\]"):
        gf.global_norm({"enc": [np.ones(1), make()]})


def test_a_tree_that_contains_itself_is_refused_naming_the_path():
    tree = {"w": np.ones(2), "layers": [np.ones(1)]}
    tree["layers"].append(tree)
    with pytest.raises(gf.UnwalkableError, match=r"\['layers'\]\[1\].*contains itself"):
        gf.global_norm(tree)


def test_unknown_array_likes_are_refused_not_static():
    class Frame:
        def __array__(self, dtype=None, copy=None):
            return np.ones(3)

    with pytest.raises(gf.UnwalkableError, match=r"\['x'\].*Frame"):
        gf.global_norm({"x": Frame(), "w": np.ones(2)})


def _without_bias():
    grad = Linear(np.ones((2, 3)), np.zeros(3))
    del grad.bias
    return grad


@pytest.mark.parametrize("call", [
    lambda m, g: gf.flatten(gf.plan(m), g),
    lambda m, g: gf.global_norm(g, model=m),
    lambda m, g: gf.clip_grad_norm_(g, 1.0),
    lambda m, g: gf.total("l2", g),
], ids=["flatten", "global_norm-model", "clip", "total"])
def test_a_gradient_dataclass_missing_a_field_names_the_path_and_the_field(call):
    model = {"enc": [Linear(np.ones((2, 3)), np.zeros(3))]}
    grads = {"enc": [_without_bias()]}
    kept = grads["enc"][0].weight.copy()
    with pytest.raises(gf.TreeMismatchError, match=r"leaf \"\['enc'\]\[0\]\": expected a Linear with field 'bias'"):
        call(model, grads)
    assert np.array_equal(grads["enc"][0].weight, kept)


def test_arrays_like_names_a_missing_field_too():
    treedef = gf._src.tree.walk({"l": Linear(np.ones(2), np.ones(1))}).treedef
    with pytest.raises(gf.TreeMismatchError, match=r"leaf \"\['l'\]\": expected a Linear with field 'bias'"):
        gf._src.tree.arrays_like(treedef, {"l": _without_bias()})


def test_register_enters_the_one_kind_table_and_wins_over_dict():
    # A registered dict subclass is opened by its registered fields, not as a
    # dict: registration and the built-in kinds are one table.
    from gpuflat._src import tree as _tree

    class Params(dict):
        def __init__(self, w, scale):
            super().__init__()
            self.w, self.scale = w, scale

    assert _tree.kind_of(Params(np.ones(1), 2.0)) is _tree.DICT
    gf.register(Params, fields=("w", "scale"), trainable=("w",))
    p = Params(np.ones(2), 2.0)
    assert _tree.kind_of(p) is not _tree.DICT
    assert paths(p) == ["w"]
    flat, re = gf.destructure(p)
    q = re(flat * 3)
    assert type(q) is Params and q.w.tolist() == [3, 3] and q.scale == 2.0


def test_mismatch_messages_per_kind_name_the_path():
    from collections import defaultdict

    cases = [
        ({"a": [np.ones(1)]}, {"a": [np.ones(1), np.ones(1)]}, r"\['a'\]\": expected 1 items, got 2"),
        ({"a": np.ones(1)}, {"b": np.ones(1)}, r"missing keys \['a'\], extra keys \['b'\]"),
        (defaultdict(list, a=np.ones(1)), {"a": np.ones(1)}, "expected defaultdict, got dict"),
        (Pair(np.ones(1), [np.ones(1)]), Pair(np.ones(1), []), r"second': expected 1 items, got 0"),
    ]
    for model, grads, message in cases:
        with pytest.raises(gf.TreeMismatchError, match=message):
            gf.flatten(gf.plan(model), grads)
