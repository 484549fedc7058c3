"""Walking a model tree: which containers are opened, which leaves are trainable.

A walk turns a tree into a *treedef* (hashable nested tuples that describe the
containers and where the trainable arrays sit), the list of trainable arrays
met, one per occurrence, in walk order, and the list of *statics*: everything
the walk does not open, kept by reference and rebuilt as it was.

A treedef records what a static *is* (its type; shape and dtype for an
array), never its value: a running mean or a step counter replaced every
step leaves the structure, and so the cached plan, unchanged. Rebuilding
takes the values from the statics list of the tree at hand.

The walk is the only per-call Python work over the leaves, so it reads each
leaf once and builds no path strings; paths are derived from the treedef when
a plan is built or an error is reported.
"""
from __future__ import annotations

import copy
import dataclasses
import gc
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence, Set
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import numpy as np

from . import arrays
from .dtypes import TAGS, admit, unsupported_float
from ..errors import TreeMismatchError, UnsupportedLeafError, UnwalkableError

if TYPE_CHECKING:
    from typing import NoReturn, TypeAlias

    # A treedef is opaque to its callers (``object``); inside, a node is LEAF,
    # a Static or a tuple (kind, type, names, children[, static kinds]) whose
    # fields differ in type, so the walk reads its nodes as Any.
    # What a walk collects besides the arrays: the statics, and the foreign
    # objects adopted so far by id (the object, its view).
    _Side: TypeAlias = "tuple[list[Any], dict[int, tuple[Any, Any]]]"
    # An object's (trainable field names, other field names).
    _Fields: TypeAlias = "tuple[tuple[str, ...], tuple[str, ...]]"

class _Leaf:
    """Marks the place of a trainable array in a treedef."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "LEAF"


LEAF = _Leaf()

class Static:
    """The place of a non-trainable value in a treedef: equal by what the value is.

    >>> Static.of(np.zeros(3)) == Static.of(np.ones(3)), Static.of(1) == Static.of(1.0)
    (True, False)
    """

    __slots__ = ("kind",)

    def __init__(self, kind: tuple[Any, ...]) -> None:
        self.kind = kind

    @classmethod
    def of(cls, value: object) -> "Static":
        shape = getattr(value, "shape", None)
        dtype = getattr(value, "dtype", None)
        if type(shape) is tuple and dtype is not None:
            return cls((type(value), shape, dtype))
        return cls((type(value),))

    def __eq__(self, other: object) -> bool:
        return type(other) is Static and self.kind == other.kind

    def __hash__(self) -> int:
        return hash(self.kind)

    def __repr__(self) -> str:
        return f"Static({self.kind[0].__name__})"


def _array_types() -> tuple[type[Any], ...]:
    # CuPy is never imported by gpuflat itself: a CuPy leaf can only exist if
    # the caller imported it already.
    cupy = sys.modules.get("cupy")
    return (np.ndarray, cupy.ndarray) if cupy is not None else (np.ndarray,)


# ---------------------------------------------------------------- node kinds
#
# One table says how each kind of container is opened and rebuilt, as optree's
# registry and JAX's tree_util do (https://github.com/metaopt/optree,
# https://docs.jax.dev/en/latest/pytrees.html). A treedef node is
# (kind, type, names, children[, static kinds]); the walk, the matching of a
# gradient tree, the paths and the rebuild all ask the node's kind.


class _Kind:
    """How one kind of container is opened and rebuilt.

    ``open(x)`` returns (names, children, kept): what the treedef records,
    the values to walk, and the values kept by reference (statics). ``kept``
    values are consumed ``kept_first`` (before the children) or after them.
    """

    kept_first = True
    holds_parameters = False  # children are all PyTorch parameters: no container among them

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name

    # ``names`` is what a node records of its container, by kind: None, the
    # keys, the field names, or (trainable fields, other fields).
    def open(self, x: Any) -> tuple[Any, Iterable[Any], Sequence[Any]]:
        return None, x, ()

    def children_like(self, x: Any, names: Any, count: int, path: str) -> Iterable[Any]:
        """The values of ``x`` at the node's child places (``x`` is of the node's type)."""
        if len(x) != count:
            raise TreeMismatchError(f"leaf {display(path)!r}: expected {count} items, got {len(x)}")
        return x

    def kept_count(self, cls: type, names: Any) -> int:
        """How many statics a node of this kind took."""
        return 0

    def keys(self, names: Any, count: int) -> list[str]:
        """The path step of each child."""
        return [f"[{i}]" for i in range(count)]

    def build(self, cls: type[Any], names: Any, children: list[Any], kept: Sequence[Any]) -> Any:
        return cls(children)


class _Dict(_Kind):
    def open(self, x: Any) -> tuple[Any, Iterable[Any], Sequence[Any]]:
        kept = (x.default_factory,) if isinstance(x, defaultdict) else ()
        return tuple(x), x.values(), kept

    def children_like(self, x: Any, names: Any, count: int, path: str) -> Iterable[Any]:
        if tuple(x) != names:
            _raise_keys(path, names, tuple(x))
        return x.values()

    def kept_count(self, cls: type, names: Any) -> int:
        return 1 if issubclass(cls, defaultdict) else 0

    def keys(self, names: Any, count: int) -> list[str]:
        return [f"[{k!r}]" for k in names]

    def build(self, cls: type[Any], names: Any, children: list[Any], kept: Sequence[Any]) -> Any:
        if kept:
            return cls(kept[0], zip(names, children))
        return cls(zip(names, children))


class _NamedTuple(_Kind):
    def open(self, x: Any) -> tuple[Any, Iterable[Any], Sequence[Any]]:
        return type(x)._fields, x, ()

    def keys(self, names: Any, count: int) -> list[str]:
        return [f".{n}" for n in names]

    def build(self, cls: type[Any], names: Any, children: list[Any], kept: Sequence[Any]) -> Any:
        return cls._make(children)


class _Module(_Kind):
    """A PyTorch module: its trainable parameters under their qualified names.

    The module itself is kept among the statics: rebuilding copies it with
    new parameter values.
    """

    holds_parameters = True

    def open(self, x: Any) -> tuple[Any, Iterable[Any], Sequence[Any]]:
        named = arrays.module_parameters(x)
        return tuple(n for n, _ in named), [p for _, p in named], (x,)

    def children_like(self, x: Any, names: Any, count: int, path: str) -> Iterable[Any]:
        named = arrays.module_parameters(x)
        found = tuple(n for n, _ in named)
        if found != names:
            _raise_keys(path, names, found)
        return [p for _, p in named]

    def kept_count(self, cls: type, names: Any) -> int:
        return 1

    keys = _NamedTuple.keys

    def build(self, cls: type[Any], names: Any, children: list[Any], kept: Sequence[Any]) -> Any:
        return _build_module(kept[0], names, children)


class _Object(_Kind):
    """An object opened by its fields: registered, a dataclass, or declaring
    ``__trainable__``. The trainable fields are children, the others statics."""

    kept_first = False

    def __init__(self, name: str, fields: _Fields | None = None) -> None:
        super().__init__(name)
        self.fields = fields  # (trainable, others) of a registered class

    def fields_of(self, x: Any) -> _Fields:
        # Only asked of an object kind_of gave this kind: of a registered
        # class, or declaring its fields, so never None.
        return self.fields or cast("_Fields", _declared_fields(x))

    def open(self, x: Any) -> tuple[Any, Iterable[Any], Sequence[Any]]:
        trainable, others = self.fields_of(x)
        return (trainable, others), _field_values(x, trainable), _field_values(x, others)

    def kept_count(self, cls: type, names: Any) -> int:
        return len(names[1])

    def children_like(self, x: Any, names: Any, count: int, path: str) -> Iterable[Any]:
        try:
            return _field_values(x, names[0])
        except _MissingField as missing:
            raise TreeMismatchError(f"leaf {display(path)!r}: {missing.reason}") from None

    def keys(self, names: Any, count: int) -> list[str]:
        return [f".{n}" for n in names[0]]

    # ``cls`` is Any, not type[Any]: mypy reads ``cls.__new__`` of a
    # type[Any] as the metaclass's own and refuses the call below.
    def build(self, cls: Any, names: Any, children: list[Any], kept: Sequence[Any]) -> Any:
        # Objects are rebuilt without calling __init__, as copy.copy does, so a
        # model class needs no special constructor. A subclass of a built-in
        # (a dict, say) must be made by its own __new__.
        new = object.__new__(cls) if cls.__new__ is object.__new__ else cls.__new__(cls)
        for name, value in zip(names[0] + names[1], list(children) + list(kept)):
            object.__setattr__(new, name, value)
        return new


DICT, SEQUENCE, NAMEDTUPLE = _Dict("dict"), _Kind("sequence"), _NamedTuple("namedtuple")
MODULE, OBJECT = _Module("module"), _Object("object")

# Exact types -> kind: the walk's first and only lookup for the common
# containers; ``register`` adds its classes here.
_kinds: dict[type, _Kind] = {dict: DICT, defaultdict: DICT, list: SEQUENCE, tuple: SEQUENCE}
_kinds_lock = threading.Lock()


def kind_of(x: object) -> _Kind | None:
    """The kind of container ``x`` is, or None for a value the walk does not open.

    >>> kind_of({}), kind_of([1]), kind_of(np.ones(2))
    (dict, sequence, None)
    """
    kind = _kinds.get(type(x))
    if kind is not None:
        return kind
    if isinstance(x, dict):
        return DICT
    if isinstance(x, tuple) and hasattr(type(x), "_fields"):
        return NAMEDTUPLE
    if arrays.is_module(x):
        return MODULE
    if isinstance(x, (np.ndarray, type)) or _declared_fields(x) is None:
        return None
    return OBJECT


def register(cls: type, fields: Sequence[str], trainable: Sequence[str] | None = None) -> None:
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
    others = tuple(f for f in fields if f not in trainable)
    with _kinds_lock:
        _kinds[cls] = _Object(f"registered {cls.__name__}", (trainable, others))


def _declared_fields(x: object) -> _Fields | None:
    """(trainable names, other names) of a dataclass or an object declaring
    ``__trainable__``, or None."""
    cls = type(x)
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


class _Refused(Exception):
    """Raised inside the walk at a value it refuses; ``walk`` adds the path."""

    def __init__(self, value: object, reason: str) -> None:
        super().__init__(reason)
        self.value, self.reason = value, reason


class _MissingField(_Refused):
    """Raised inside the walk at an object lacking one of its class's fields."""


def _field_values(x: object, names: Sequence[str]) -> list[Any]:
    """``x``'s attributes ``names``; _MissingField naming the first one it lacks."""
    try:
        return [getattr(x, n) for n in names]
    except AttributeError:
        missing = next(n for n in names if not hasattr(x, n))
        raise _MissingField(x, _missing_reason(x, missing, names)) from None


def _missing_reason(x: object, missing: str, names: Sequence[str]) -> str:
    return (f"expected a {type(x).__name__} with field {missing!r} (fields {list(names)}), "
            f"found none: it has no attribute {missing!r}")


# One-shot iterables cannot be rebuilt (and model.parameters() is a
# generator): taken as statics they would hide every array inside.
_ONE_SHOT: tuple[type[Any], ...] = (Iterator, Set, type({}.keys()), type({}.values()),
                                    type({}.items()))


class collector_paused:  # noqa: N801 - used as a function, like contextlib's context managers
    """Hold Python's cyclic garbage collector while a walk builds its tuples.

    A walk of 10,000 leaves makes tens of thousands of small tuples, enough
    to start several collections that each traverse every live object of
    the program (a model, an optimizer): measured, 6 ms of a 7 ms signature.
    None of these tuples can form a cycle, so nothing is lost by waiting.
    A class rather than a generator: entering and leaving cost a third as much.

    >>> import gc
    >>> with collector_paused():
    ...     gc.isenabled()
    False
    """

    __slots__ = ("_was_enabled",)

    def __enter__(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc: object) -> None:
        if self._was_enabled:
            gc.enable()


class Walked(NamedTuple):
    """What one walk found.

    ``arrays`` holds NumPy or CuPy arrays: a PyTorch or JAX leaf appears as
    its zero-copy view, and ``foreign`` maps ``id(view)`` to the caller's own
    object (one view per object, so a tied tensor stays tied).
    """

    treedef: object
    arrays: list[Any]
    statics: list[Any]
    foreign: dict[int, Any]


def walk(tree: Any, array_types: tuple[type[Any], ...] | None = None) -> Walked:
    """(treedef, arrays, statics, foreign): the tree's structure, its trainable
    arrays per occurrence, its non-trainable values, each in walk order, and
    the caller's own objects behind adopted arrays.

    >>> treedef, arrays, statics, foreign = walk({"w": np.ones(2), "n": 3})
    >>> len(arrays), statics, foreign
    (1, [3], {})
    """
    arrays: list[Any] = []
    statics: list[Any] = []
    foreign: dict[int, tuple[Any, Any]] = {}
    try:
        treedef = _walk(tree, arrays, (statics, foreign), array_types or _array_types())
    except _MissingField as missing:
        raise TreeMismatchError(f"leaf {_path_of(tree, missing.value)!r}: {missing.reason}") from None
    except _Refused as refused:
        raise UnwalkableError(f"leaf {_path_of(tree, refused.value)!r}: {refused.reason}") from None
    except RecursionError:
        raise UnwalkableError(f"leaf {_cycle_path(tree)!r}: expected a tree, found a container "
                              "that contains itself") from None
    return Walked(treedef, arrays, statics, {id(v): x for x, v in foreign.values()})


def _walk(x: Any, out: list[Any], side: _Side, array_types: tuple[type[Any], ...]) -> object:
    if isinstance(x, array_types):
        if admit(x.dtype):
            out.append(x)
            return LEAF
        _refuse_unsupported_float(x, x.dtype)
        side[0].append(x)
        return Static.of(x)
    kind = _kinds.get(type(x)) or kind_of(x)
    if kind is None:
        return _leaf(x, out, side)
    names, values, kept = kind.open(x)
    if not kept:  # the common containers: no statics of their own
        return (kind, type(x), names, _walk_children(values, out, side, array_types), ())
    if kind.kept_first:
        side[0].extend(kept)
    if kind.holds_parameters:
        children = tuple([_leaf(p, out, side) for p in values])
    else:
        children = _walk_children(values, out, side, array_types)
    if not kind.kept_first:
        side[0].extend(kept)
    return (kind, type(x), names, children, tuple(map(Static.of, kept)))


def _leaf(x: Any, out: list[Any], side: _Side) -> object:
    """A value the walk does not open: a trainable array of another kind, or a static."""
    statics, foreign = side
    seen = foreign.get(id(x))
    if seen is not None:  # the same tensor again: the same view, so the tie holds
        out.append(seen[1])
        return LEAF
    if isinstance(x, _ONE_SHOT):
        raise _Refused(x, f"expected an array or a container, got a {type(x).__name__}, which "
                          "cannot be walked twice or rebuilt; pass a list")
    try:
        adopted = arrays.adopt(x)
    except UnsupportedLeafError as e:
        raise _Refused(x, str(e)) from None
    if adopted is not None and admit(adopted.dtype):
        foreign[id(x)] = (x, adopted)
        out.append(adopted)
        return LEAF
    if adopted is not None:
        _refuse_unsupported_float(x, adopted.dtype)
    statics.append(x)
    return Static.of(x)


def _refuse_unsupported_float(x: object, dtype: Any) -> None:
    # A floating array gpuflat cannot compute on holds trainable values: kept
    # as a static, it would silently drop out of every norm and clip.
    reason = unsupported_float(dtype)
    if reason is not None:
        raise _Refused(x, reason)


def _walk_children(values: Iterable[Any], out: list[Any], side: _Side,
                   array_types: tuple[type[Any], ...]) -> tuple[object, ...]:
    # Arrays are handled inline: a model with thousands of leaves pays one
    # loop step per leaf, not one recursive call.
    nodes: list[object] = []
    for v in values:
        if type(v) is np.ndarray and v.dtype in TAGS:
            out.append(v)
            nodes.append(LEAF)
        else:
            nodes.append(_walk(v, out, side, array_types))
    return tuple(nodes)


def _children_with_paths(x: object, prefix: str) -> list[tuple[str, Any]]:
    """(path, child) of a container the walk opens; [] for anything else."""
    kind = kind_of(x)
    if kind is None:
        return []
    if isinstance(kind, _Object):
        # A field the object lacks is skipped: this search only words an error.
        names = [n for n in sum(kind.fields_of(x), ()) if hasattr(x, n)]
        return [(f"{prefix}.{n}", getattr(x, n)) for n in names]
    names, values, _ = kind.open(x)
    values = list(values)
    return [(prefix + key, v) for key, v in zip(kind.keys(names, len(values)), values)]


def _path_of(tree: object, target: object) -> str:
    """The path of ``target`` (by identity) in ``tree``: only called to word an error."""
    stack: list[tuple[str, object]] = [("", tree)]
    seen: set[int] = set()
    while stack:
        prefix, x = stack.pop()
        if x is target:
            return display(prefix)
        if id(x) in seen:
            continue
        seen.add(id(x))
        stack.extend(reversed(_children_with_paths(x, prefix)))
    return "<unknown>"


def _cycle_path(tree: object) -> str:
    """The path at which ``tree`` first contains one of its own ancestors."""
    def search(x: object, prefix: str, ancestors: set[int]) -> str | None:
        for path, child in _children_with_paths(x, prefix):
            if id(child) in ancestors:
                return path
            if _children_with_paths(child, path):
                found = search(child, path, ancestors | {id(child)})
                if found is not None:
                    return found
        return None

    return display(search(tree, "", {id(tree)}) or "")


# ---------------------------------------------------------------- paths

def _child_paths(node: tuple[Any, ...], prefix: str) -> list[tuple[str, object]]:
    kind, _, names, children = node[:4]
    return [(prefix + key, c) for key, c in zip(kind.keys(names, len(children)), children)]


def leaf_paths(treedef: object) -> list[str]:
    """The path of every trainable occurrence, in walk order.

    >>> leaf_paths(walk({"enc": [np.ones(1), {"w": np.ones(1)}]})[0])
    ["['enc'][0]", "['enc'][1]['w']"]
    """
    paths: list[str] = []
    stack: list[tuple[str, object]] = [("", treedef)]
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

def arrays_like(treedef: object, tree: Any,
                array_types: tuple[type[Any], ...] | None = None) -> list[Any]:
    """What ``tree`` holds at each trainable place of ``treedef``, in walk order.

    Containers must match; at a trainable place any value is returned (the
    caller checks it); statics of ``tree`` are not looked at, so a gradient
    tree with None or other values there still matches. A mismatch raises
    TreeMismatchError naming the first differing path.

    >>> treedef = walk({"w": np.ones(2), "act": "relu"}).treedef
    >>> arrays_like(treedef, {"w": None, "act": None})
    [None]
    """
    out: list[Any] = []
    _match(treedef, tree, out, "")
    return out


def _match(node: object, x: Any, out: list[Any], path: str) -> None:
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
    values = kind.children_like(x, names, len(children), path)
    for (child_path, child), v in zip(_child_paths(node, path), values):
        _match(child, v, out, child_path)


def _raise_keys(path: str, expected: Sequence[Any], found: Sequence[Any]) -> NoReturn:
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

def rebuild(treedef: object, values: Iterable[Any], statics: Iterable[Any]) -> Any:
    """A new tree shaped like ``treedef``: ``values`` at the trainable places,
    ``statics`` (from a walk of a tree of this structure) everywhere else.

    >>> treedef, arrays, statics, _ = walk({"w": np.ones(2), "act": "relu"})
    >>> rebuild(treedef, [np.zeros(2)], statics)
    {'w': array([0., 0.]), 'act': 'relu'}
    """
    return _build(treedef, iter(values), iter(statics))


def _build(node: Any, values: Iterator[Any], statics: Iterator[Any]) -> Any:
    if node is LEAF:
        return next(values)
    if type(node) is Static:
        return next(statics)
    kind, cls, names, children = node[:4]
    count = kind.kept_count(cls, names)
    kept = [next(statics) for _ in range(count)] if kind.kept_first else ()
    built = [_build(c, values, statics) for c in children]
    if not kind.kept_first:
        kept = [next(statics) for _ in range(count)]
    return kind.build(cls, names, built, kept)


def _build_module(module: Any, names: Sequence[str], values: Iterable[Any]) -> Any:
    """A deep copy of ``module`` whose trainable parameters hold ``values``."""
    new = copy.deepcopy(module)
    for name, value in zip(names, values):
        param = new.get_parameter(name)
        param.data = value if type(value) is type(param.data) else arrays.to_caller(value, param.data)
    return new
