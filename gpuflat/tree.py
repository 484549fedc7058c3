"""Walking a model tree: which containers are opened, which leaves are trainable.

A walk turns a tree into a *treedef* (hashable nested tuples that describe the
containers and where the trainable arrays sit) plus the list of trainable
arrays met, one per occurrence, in walk order. Everything the walk does not
open is a *static*: kept by reference and rebuilt as it was.

The walk is the only per-call Python work over the leaves (#2), so it reads
each leaf once and builds no path strings; paths are derived from the treedef
when a plan is built or an error is reported.
"""
from __future__ import annotations

import dataclasses
import sys
import threading

import numpy as np

from .dtypes import TAGS
from .errors import TreeMismatchError

# Container kinds in a treedef node: (kind, type, names, children[, statics]).
DICT, SEQ, NAMEDTUPLE, OBJECT = "dict", "seq", "namedtuple", "object"

_registry: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {}
_registry_lock = threading.Lock()


class _Leaf:
    """Marks the place of a trainable array in a treedef."""

    __slots__ = ()

    def __repr__(self):
        return "LEAF"


LEAF = _Leaf()

# Values compared by value in a treedef; anything else by identity, so that a
# plan never confuses two different non-trainable objects (#2).
_BY_VALUE = (type(None), bool, int, float, complex, str, bytes)


class Static:
    """A non-trainable leaf, kept by reference; equal by value or identity."""

    __slots__ = ("value", "_key")

    def __init__(self, value):
        self.value = value
        if type(value) in (float, complex):
            # By repr: -0.0 == 0.0 would rebuild a -0.0 static as 0.0 from a
            # cached plan, and nan != nan would make every such tree a miss (#2).
            self._key = repr(value)
        else:
            self._key = value if type(value) in _BY_VALUE else id(value)

    def __eq__(self, other):
        return (
            type(other) is Static
            and type(self.value) is type(other.value)
            and self._key == other._key
        )

    def __hash__(self):
        return hash((type(self.value), self._key))

    def __repr__(self):
        return f"Static({self.value!r})"


def register(cls, fields, trainable=None):
    """Open instances of ``cls`` during walks.

    ``fields`` names the attributes that hold the children; ``trainable``
    (default: all of them) names those whose arrays are trainable. The other
    attributes, e.g. a BatchNorm's running statistics, are kept by reference
    and never trained, as Optimisers.jl's ``trainable(x)`` does.

    >>> import numpy as np, gpuflat as gf
    >>> class BatchNorm:
    ...     def __init__(self, n):
    ...         self.weight, self.bias = np.ones(n), np.zeros(n)
    ...         self.running_mean = np.zeros(n)
    >>> gf.register(BatchNorm, fields=("weight", "bias", "running_mean"),
    ...             trainable=("weight", "bias"))
    >>> len(gf.trainables(BatchNorm(3)))
    2
    """
    fields = tuple(fields)
    trainable = fields if trainable is None else tuple(trainable)
    unknown = [name for name in trainable if name not in fields]
    if unknown:
        raise ValueError(
            f"register({cls.__name__}): trainable names {unknown} are not in fields {fields}"
        )
    with _registry_lock:
        _registry[cls] = (fields, trainable)


def _array_types():
    # CuPy is never imported by gpuflat itself: a CuPy leaf can only exist if
    # the caller imported it already.
    cupy = sys.modules.get("cupy")
    return (np.ndarray, cupy.ndarray) if cupy is not None else (np.ndarray,)


def _object_fields(x):
    """(trainable names, other names) of an object the walk opens, or None."""
    cls = type(x)
    if cls in _registry:
        fields, trainable = _registry[cls]
        return trainable, tuple(f for f in fields if f not in trainable)
    declared = getattr(cls, "__trainable__", None)
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        names = tuple(f.name for f in dataclasses.fields(x))
        trainable = names if declared is None else tuple(declared)
        return trainable, tuple(n for n in names if n not in trainable)
    if declared is not None and not isinstance(x, type):
        trainable = tuple(declared)
        others = tuple(n for n in getattr(x, "__dict__", ()) if n not in trainable)
        return trainable, others
    return None


def walk(tree, array_types=None):
    """(treedef, arrays): the tree's structure and its trainable arrays per occurrence.

    >>> treedef, arrays = walk({"w": np.ones(2), "n": 3})
    >>> len(arrays)
    1
    """
    arrays: list = []
    treedef = _walk(tree, arrays, array_types or _array_types())
    return treedef, arrays


def _walk(x, out, array_types):
    cls = type(x)
    if isinstance(x, array_types):
        if x.dtype in TAGS:
            out.append(x)
            return LEAF
        return Static(x)
    if cls is dict or (isinstance(x, dict) and cls not in _registry):
        return (DICT, cls, tuple(x), _walk_children(x.values(), out, array_types))
    if cls is list or cls is tuple:
        return (SEQ, cls, None, _walk_children(x, out, array_types))
    if isinstance(x, tuple) and hasattr(cls, "_fields"):
        return (NAMEDTUPLE, cls, cls._fields, _walk_children(x, out, array_types))
    fields = _object_fields(x)
    if fields is None:
        return Static(x)
    trainable, others = fields
    children = _walk_children([getattr(x, n) for n in trainable], out, array_types)
    statics = tuple([Static(getattr(x, n)) for n in others])
    return (OBJECT, cls, (trainable, others), children, statics)


def _walk_children(values, out, array_types):
    # Arrays are handled inline: a model with thousands of leaves pays one
    # loop step per leaf, not one recursive call (#2, #4).
    nodes = []
    for v in values:
        if type(v) is np.ndarray and v.dtype in TAGS:
            out.append(v)
            nodes.append(LEAF)
        else:
            nodes.append(_walk(v, out, array_types))
    return tuple(nodes)


# ---------------------------------------------------------------- paths

def _child_paths(node, prefix):
    kind, cls, names, children = node[:4]
    if kind == DICT:
        return [(f"{prefix}[{k!r}]", c) for k, c in zip(names, children)]
    if kind == SEQ:
        return [(f"{prefix}[{i}]", c) for i, c in enumerate(children)]
    if kind == NAMEDTUPLE:
        return [(f"{prefix}.{n}", c) for n, c in zip(names, children)]
    return [(f"{prefix}.{n}", c) for n, c in zip(names[0], children)]


def leaf_paths(treedef) -> list[str]:
    """The path of every trainable occurrence, in walk order.

    >>> leaf_paths(walk({"enc": [np.ones(1), {"w": np.ones(1)}]})[0])
    ["['enc'][0]", "['enc'][1]['w']"]
    """
    paths: list[str] = []
    stack = [("", treedef)]
    while stack:
        prefix, node = stack.pop()
        if node is LEAF:
            paths.append(display(prefix))
        elif type(node) is tuple:
            stack.extend(reversed(_child_paths(node, prefix)))
    return paths


def display(path: str) -> str:
    """A path as users read it: no leading dot, and ``<root>`` for the root."""
    path = path[1:] if path.startswith(".") else path
    return path or "<root>"


# ---------------------------------------------------------------- matching

def arrays_like(treedef, tree, array_types=None) -> list:
    """What ``tree`` holds at each trainable place of ``treedef``, in walk order.

    Containers must match; at a trainable place any value is returned (the
    caller checks it); statics of ``tree`` are not looked at, so a gradient
    tree with None or other values there still matches. A mismatch raises
    TreeMismatchError naming the first differing path.

    >>> treedef, _ = walk({"w": np.ones(2), "act": "relu"})
    >>> arrays_like(treedef, {"w": None, "act": None})
    [None]
    """
    out: list = []
    _match(treedef, tree, out, "")
    return out


def _match(node, x, out, path):
    if node is LEAF:
        out.append(x)
        return
    if type(node) is not tuple:
        return
    kind, cls, names, children = node[:4]
    if type(x) is not cls:
        raise TreeMismatchError(
            f"leaf {display(path)!r}: expected {cls.__name__}, got {type(x).__name__}"
        )
    if kind == DICT:
        if tuple(x) != names:
            _raise_keys(path, names, tuple(x))
        values = x.values()
    elif kind == OBJECT:
        values = [getattr(x, n, None) for n in names[0]]
    else:
        if len(x) != len(children):
            raise TreeMismatchError(
                f"leaf {display(path)!r}: expected {len(children)} items, got {len(x)}"
            )
        values = x
    for (child_path, child), v in zip(_child_paths(node, path), values):
        _match(child, v, out, child_path)


def _raise_keys(path, expected, found):
    missing = [k for k in expected if k not in found]
    extra = [k for k in found if k not in expected]
    what = (f"missing keys {missing}" if missing else "") + (
        f"{', ' if missing else ''}extra keys {extra}" if extra else ""
    )
    raise TreeMismatchError(
        f"leaf {display(path)!r}: {what or 'keys in another order'}; "
        f"expected keys {list(expected)}, got {list(found)}"
    )


# ---------------------------------------------------------------- rebuilding

def rebuild(treedef, values):
    """A new tree shaped like ``treedef`` with ``values`` at the trainable places.

    >>> treedef, arrays = walk({"w": np.ones(2), "act": "relu"})
    >>> rebuild(treedef, [np.zeros(2)])
    {'w': array([0., 0.]), 'act': 'relu'}
    """
    it = iter(values)
    return _build(treedef, it)


def _build(node, it):
    if node is LEAF:
        return next(it)
    if type(node) is Static:
        return node.value
    kind, cls, names, children = node[:4]
    built = [_build(c, it) for c in children]
    if kind == DICT:
        return cls(zip(names, built))
    if kind == SEQ:
        return cls(built)
    if kind == NAMEDTUPLE:
        return cls._make(built)
    # Objects are rebuilt without calling __init__, as copy.copy does, so a
    # model class needs no special constructor (#2).
    new = object.__new__(cls)
    trainable, others = names
    for name, value in zip(trainable, built):
        object.__setattr__(new, name, value)
    for name, static in zip(others, node[4]):
        object.__setattr__(new, name, static.value)
    return new
