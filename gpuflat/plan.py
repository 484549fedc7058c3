"""The offset plan: where each unique trainable array lives in the flat buffer.

A plan is frozen data built once per tree *structure* (containers, keys,
statics, leaf shapes and dtypes, tie pattern) and kept in a bounded,
thread-safe LRU cache, so a training loop pays the host-side walk of its tree
once and afterwards only reads the leaves (#2). Backends read the plan; they
never walk trees.
"""
from __future__ import annotations

import threading
from collections import OrderedDict, namedtuple
from dataclasses import dataclass, field
from functools import cached_property
from operator import attrgetter

import numpy as np

from . import tree as _tree
from .backends.base import select
from .dtypes import flat_dtype
from .errors import TreeMismatchError


@dataclass(frozen=True)
class LeafSpec:
    """One unique trainable array: its path (first occurrence) and its slice of the flat buffer."""

    path: str
    offset: int
    size: int
    shape: tuple
    dtype: np.dtype
    strides: tuple

    def describe(self) -> str:
        """How error messages print the expected leaf.

        >>> LeafSpec("['w']", 0, 12, (3, 4), np.dtype("float32"), (16, 4)).describe()
        'shape (3, 4) float32'
        """
        return f"shape {self.shape} {self.dtype}"


@dataclass(frozen=True, eq=False)
class FlatPlan:
    """The frozen offset plan of one tree structure.

    ``leaves`` has one LeafSpec per unique trainable array (a *slot*) in walk
    order; ``slot_of[i]`` is the slot of the i-th trainable occurrence, so a
    tied array appears once in ``leaves`` and several times in ``slot_of``.

    >>> import numpy as np, gpuflat as gf
    >>> a = np.ones(2, np.float32)
    >>> p = gf.plan({"x": a, "y": np.zeros((2, 2)), "z": a})
    >>> [(leaf.path, leaf.offset, leaf.size) for leaf in p.leaves]
    [("['x']", 0, 2), ("['y']", 2, 4)]
    >>> p.size, p.dtype, p.slot_of
    (6, dtype('float64'), (0, 1, 0))
    """

    treedef: object = field(repr=False)
    leaves: tuple
    slot_of: tuple
    size: int
    dtype: np.dtype
    # Backends memoise per-device tables here (#3); not part of the plan's value.
    device_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def offsets(self) -> np.ndarray:
        """Cumulative offsets, one more than there are slots (read-only int64)."""
        offsets = np.array([leaf.offset for leaf in self.leaves] + [self.size], dtype=np.int64)
        offsets.flags.writeable = False
        return offsets

    @cached_property
    def occurrence_paths(self) -> tuple:
        """The path of every trainable occurrence, ties included, in walk order."""
        return tuple(_tree.leaf_paths(self.treedef))

    @cached_property
    def occurrence_signature(self) -> tuple:
        """(shape, dtype) of every trainable occurrence: what a matching tree holds."""
        return tuple((self.leaves[s].shape, self.leaves[s].dtype) for s in self.slot_of)

    def flatten(self, tree, out=None, *, backend=None):
        """Gather the tree's trainables (or gradients) into one 1-D buffer.

        Gradients of a tied array, found at several places, are added into its
        one slot; the same gradient object found twice counts once; None
        counts as zero (Optimisers.jl's destructure contract).

        >>> import numpy as np, gpuflat as gf
        >>> a, b = np.zeros(2, np.float32), np.zeros(2, np.float32)
        >>> p = gf.plan({"x": a, "y": b, "z": a})
        >>> g = {"x": np.full(2, 3, np.float32), "y": None, "z": np.full(2, 13, np.float32)}
        >>> p.flatten(g)
        array([16., 16.,  0.,  0.], dtype=float32)
        """
        from .ops import plan_flatten

        return plan_flatten(self, tree, out, backend)

    def unflatten(self, flat, *, backend=None):
        """A tree whose trainables are views into ``flat`` (zero copy where dtypes match).

        This is the *resident* pattern: the model lives inside one buffer, and
        every later operation on it works on that buffer directly.

        >>> import numpy as np, gpuflat as gf
        >>> p = gf.plan({"w": np.ones(3), "n": "relu"})
        >>> flat = np.arange(3.0)
        >>> m = p.unflatten(flat)
        >>> m["w"].base is flat, m["n"]
        (True, 'relu')
        """
        from .ops import plan_unflatten

        return plan_unflatten(self, flat, backend)

    def scatter(self, flat, tree, *, backend=None):
        """Write ``flat`` into the tree's own arrays, in place; returns None.

        Every check happens before the first write, so a bad call changes nothing.

        >>> import numpy as np, gpuflat as gf
        >>> m = {"w": np.zeros(2, np.float32), "b": np.zeros(1)}
        >>> gf.plan(m).scatter(np.array([1.0, 2.0, 3.0]), m)
        >>> m["w"], m["b"]
        (array([1., 2.], dtype=float32), array([3.]))
        """
        from .ops import plan_scatter

        return plan_scatter(self, flat, tree, backend)


# ---------------------------------------------------------------- building

def _signature(arrays):
    """(slot_of, unique arrays, key part): ties by identity, then shapes and dtypes."""
    if len(set(map(id, arrays))) == len(arrays):  # no ties: the common case
        slot_of, unique = tuple(range(len(arrays))), arrays
    else:
        slots: dict[int, int] = {}
        slot_of = tuple([slots.setdefault(id(a), len(slots)) for a in arrays])
        unique = [None] * len(slots)
        for a, s in zip(arrays, slot_of):
            unique[s] = a
    return slot_of, unique, tuple(map(_shape_and_dtype, unique))


_shape_and_dtype = attrgetter("shape", "dtype")


def _build(treedef, slot_of, unique) -> FlatPlan:
    paths = _tree.leaf_paths(treedef)
    first_path: dict[int, str] = {}
    for path, s in zip(paths, slot_of):
        first_path.setdefault(s, path)
    leaves, offset = [], 0
    for s, a in enumerate(unique):
        size = int(a.size)
        leaves.append(LeafSpec(first_path[s], offset, size, tuple(a.shape), a.dtype, tuple(a.strides)))
        offset += size
    return FlatPlan(treedef, tuple(leaves), slot_of, offset, flat_dtype(a.dtype for a in unique))


class _PlanCache:
    """A bounded LRU of plans keyed by tree signature; safe under threads."""

    def __init__(self, maxsize=256):
        self.maxsize = maxsize
        self._plans: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self._last_key = self._last_plan = None

    def get(self, key, build):
        with self._lock:
            # Comparing with the last key first skips hashing a long key: a
            # training loop asks for the same plan every step (#2).
            if key == self._last_key:
                self.hits += 1
                return self._last_plan
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                self.hits += 1
                self._last_key, self._last_plan = key, plan
                return plan
            self.misses += 1
        plan = build()  # outside the lock: building is the slow part
        with self._lock:
            plan = self._plans.setdefault(key, plan)
            self._plans.move_to_end(key)
            while len(self._plans) > self.maxsize:
                self._plans.popitem(last=False)
            self._last_key, self._last_plan = key, plan
        return plan

    def clear(self):
        with self._lock:
            self._plans.clear()
            self.hits = self.misses = 0
            self._last_key = self._last_plan = None


_cache = _PlanCache()
CacheInfo = namedtuple("CacheInfo", "hits misses size maxsize")


def occurrences(plan, tree, *, allow_none):
    """(values, exact): what ``tree`` holds at each trainable place of ``plan``, checked.

    ``exact`` is True when the tree is shaped exactly like the plan's, so
    every value is an array of the expected shape and dtype (no None).

    A tree shaped exactly like the plan's costs one walk and one tuple
    comparison; anything else takes the slow path that finds and names the
    first difference (#2, #5).
    """
    treedef, arrays = _tree.walk(tree)
    if treedef == plan.treedef and tuple(map(_shape_and_dtype, arrays)) == plan.occurrence_signature:
        return arrays, True
    values = _tree.arrays_like(plan.treedef, tree)
    array_types = _tree._array_types()
    for path, slot, value in zip(plan.occurrence_paths, plan.slot_of, values):
        check_leaf(plan.leaves[slot], path, value, allow_none=allow_none, array_types=array_types)
    return values, False


def plan_and_arrays(tree):
    """(plan, unique trainable arrays in slot order): one walk."""
    treedef, arrays = _tree.walk(tree)
    slot_of, unique, shapes = _signature(arrays)
    key = (treedef, shapes, slot_of)
    return _cache.get(key, lambda: _build(treedef, slot_of, unique)), unique


def plan(tree, *, backend=None) -> FlatPlan:
    """The cached FlatPlan of ``tree``'s structure.

    ``backend`` is checked against the leaves: a tree mixing NumPy and CuPy
    arrays, or leaves the backend cannot reach, raise here already.

    >>> import numpy as np, gpuflat as gf
    >>> gf.plan_cache_clear()
    >>> m = {"w": np.ones((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    >>> p = gf.plan(m)
    >>> gf.plan({"w": np.ones((2, 3), np.float32), "b": np.ones(3, np.float32)}) is p
    True
    >>> gf.plan_cache_info()
    CacheInfo(hits=1, misses=1, size=1, maxsize=256)
    """
    built, unique = plan_and_arrays(tree)
    select(backend, unique, lambda i: built.leaves[i].path)
    return built


def plan_cache_info() -> CacheInfo:
    """Hits, misses and size of the plan cache.

    >>> import gpuflat as gf
    >>> gf.plan_cache_info().maxsize
    256
    """
    with _cache._lock:
        return CacheInfo(_cache.hits, _cache.misses, len(_cache._plans), _cache.maxsize)


def plan_cache_clear() -> None:
    """Empty the plan cache and reset its counters.

    >>> import gpuflat as gf
    >>> gf.plan_cache_clear(); gf.plan_cache_info().size
    0
    """
    _cache.clear()


def check_leaf(spec: LeafSpec, path: str, value, *, allow_none: bool, array_types):
    """Raise TreeMismatchError unless ``value`` fits ``spec`` (None allowed if asked)."""
    if value is None and allow_none:
        return
    if not isinstance(value, array_types):
        expected = f"an array of {spec.describe()}" + (" or None" if allow_none else "")
        raise TreeMismatchError(f"leaf {path!r}: expected {expected}, got {type(value).__name__}")
    if value.shape != spec.shape:
        raise TreeMismatchError(
            f"leaf {path!r}: expected shape {spec.shape}, got {tuple(value.shape)}"
        )
    if value.dtype != spec.dtype:
        raise TreeMismatchError(f"leaf {path!r}: expected dtype {spec.dtype}, got {value.dtype}")
