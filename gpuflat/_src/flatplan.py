"""The offset plan: where each unique trainable array lives in the flat buffer.

A plan is plain frozen data built once per tree *structure* (containers,
keys, what each static is, leaf shapes and dtypes, tie pattern) and kept in
a bounded, thread-safe LRU cache, so a training loop pays the host-side walk
of its tree once and afterwards only reads the leaves. The cache holds
structure only, never a value of the user's: the plan ``gf.plan(tree)``
returns is a copy that carries ``tree``'s non-trainable values, equal to the
cached plan it was made from. The operations that
use a plan live in ``gpuflat._src.ops``; backends read plans and keep their own
per-plan caches, keyed weakly by the plan.
"""
from __future__ import annotations

import threading
from collections import namedtuple
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from operator import attrgetter
from typing import Any

import numpy as np

from . import caches
from . import tree as _tree
from .dtypes import flat_dtype


@dataclass(frozen=True)
class LeafSpec:
    """One unique trainable array: its path (first occurrence) and its slice of the flat buffer."""

    path: str
    offset: int
    size: int
    shape: tuple[int, ...]
    dtype: np.dtype

    def describe(self) -> str:
        """How error messages print the expected leaf.

        >>> LeafSpec("['w']", 0, 12, (3, 4), np.dtype("float32")).describe()
        'shape (3, 4) float32'
        """
        return f"shape {self.shape} {self.dtype}"


@dataclass(frozen=True, eq=False)
class FlatPlan:
    """The frozen offset plan of one tree structure.

    ``leaves`` has one LeafSpec per unique trainable array (a *slot*) in walk
    order; ``slot_of[i]`` is the slot of the i-th trainable occurrence, so a
    tied array appears once in ``leaves`` and several times in ``slot_of``.
    ``statics`` are the non-trainable values of the tree the plan was made
    for (what ``gpuflat.unflatten`` puts back); the cached plans hold none,
    so the cache never keeps a user's values (a module, a replaced array)
    alive. A plan with statics equals, and hashes as, the cached plan it was
    made from, so per-plan caches keyed by plan serve both.

    >>> import numpy as np, gpuflat as gf
    >>> a = np.ones(2, np.float32)
    >>> p = gf.plan({"x": a, "y": np.zeros((2, 2)), "z": a})
    >>> [(leaf.path, leaf.offset, leaf.size) for leaf in p.leaves]
    [("['x']", 0, 2), ("['y']", 2, 4)]
    >>> p.size, p.dtype, p.slot_of
    (6, dtype('float64'), (0, 1, 0))
    """

    treedef: object = field(repr=False)
    leaves: tuple[LeafSpec, ...]
    slot_of: tuple[int, ...]
    size: int
    dtype: np.dtype
    statics: tuple = field(repr=False, default=())
    structure: "FlatPlan | None" = field(repr=False, default=None)

    def with_statics(self, statics: Sequence[Any]) -> "FlatPlan":
        """This plan carrying ``statics`` (the cached plan itself when there are none).

        >>> import numpy as np, gpuflat as gf
        >>> p = gf.plan({"w": np.ones(2), "act": "relu"})
        >>> p.statics, p.with_statics(["gelu"]).statics, p.with_statics(["gelu"]) == p
        (('relu',), ('gelu',), True)
        """
        core = self.structure or self
        return replace(core, statics=tuple(statics), structure=core) if statics else core

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FlatPlan) and (self.structure or self) is (other.structure or other)

    def __hash__(self) -> int:
        return id(self.structure or self)

    @cached_property
    def offsets(self) -> np.ndarray:
        """Cumulative offsets, one more than there are slots (read-only int64)."""
        offsets = np.array([leaf.offset for leaf in self.leaves] + [self.size], dtype=np.int64)
        offsets.flags.writeable = False
        return offsets

    @cached_property
    def paths(self) -> tuple[str, ...]:
        """The path of every slot, in plan order."""
        return tuple(leaf.path for leaf in self.leaves)

    @cached_property
    def occurrence_paths(self) -> tuple[str, ...]:
        """The path of every trainable occurrence, ties included, in walk order."""
        return tuple(_tree.leaf_paths(self.treedef))

    @cached_property
    def occurrence_signature(self) -> tuple[tuple[tuple[int, ...], ...], tuple[np.dtype, ...]]:
        """(shapes, dtypes) of the trainable occurrences: what a matching tree holds."""
        return (tuple(self.leaves[s].shape for s in self.slot_of), tuple(self.leaves[s].dtype for s in self.slot_of))


_shape, _dtype = attrgetter("shape"), attrgetter("dtype")


def signature(arrays: list[Any]) -> tuple[tuple[int, ...], list[Any],
                                         tuple[tuple[tuple[int, ...], ...], tuple[np.dtype, ...]]]:
    """(slot_of, unique arrays, key part): ties by identity, then shapes and dtypes.

    >>> a = np.ones(2)
    >>> slot_of, unique, key = signature([a, np.ones(3), a])
    >>> slot_of, len(unique)
    ((0, 1, 0), 2)
    """
    if len(set(map(id, arrays))) == len(arrays):  # no ties: the common case
        slot_of, unique = tuple(range(len(arrays))), arrays
    else:
        slots: dict[int, int] = {}
        slot_of = tuple([slots.setdefault(id(a), len(slots)) for a in arrays])
        unique = [None] * len(slots)
        for a, s in zip(arrays, slot_of):
            unique[s] = a
    # Shapes and dtypes as two tuples: one C loop each, no pair per leaf.
    return slot_of, unique, (tuple(map(_shape, unique)), tuple(map(_dtype, unique)))


class Key:
    """A plan cache key whose hash is taken once, when first asked: a recorded
    tree asks for its plan with the same Key every call, found again
    without hashing or comparing a treedef of thousands of nodes.

    >>> Key((1, 2)) == Key((1, 2)), Key((1, 2)) == Key((2, 1))
    (True, False)
    """

    __slots__ = ("parts", "_hash")
    parts: tuple[Any, ...]
    _hash: int | None

    def __init__(self, parts: tuple[Any, ...]) -> None:
        self.parts, self._hash = parts, None

    def __hash__(self) -> int:
        if self._hash is None:
            self._hash = hash(self.parts)
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is Key and self.parts == other.parts)


def key_of(treedef: object, arrays: list[Any]) -> tuple[tuple[int, ...], list[Any], Key]:
    """(slot_of, unique arrays, cache Key) of a walked tree.

    >>> slot_of, unique, key = key_of(None, [np.ones(2)])
    >>> key == key_of(None, [np.zeros(2)])[2]
    True
    """
    slot_of, unique, part = signature(arrays)
    return slot_of, unique, Key((treedef, part, slot_of))


def build(treedef: object, slot_of: tuple[int, ...], unique: Sequence[Any]) -> FlatPlan:
    """The plan of a walked tree's structure (uncached; see :func:`cached`).

    >>> treedef, arrays, statics, _ = _tree.walk({"w": np.ones(3, np.float32), "n": "relu"})
    >>> build(treedef, (0,), arrays).leaves[0]
    LeafSpec(path="['w']", offset=0, size=3, shape=(3,), dtype=dtype('float32'))
    """
    paths = _tree.leaf_paths(treedef)
    first_path: dict[int, str] = {}
    for path, s in zip(paths, slot_of):
        first_path.setdefault(s, path)
    leaves, offset = [], 0
    for s, a in enumerate(unique):
        size = int(a.size)
        leaves.append(LeafSpec(first_path[s], offset, size, tuple(a.shape), a.dtype))
        offset += size
    return FlatPlan(treedef, tuple(leaves), slot_of, offset, flat_dtype(a.dtype for a in unique))


class PlanCache:
    """A bounded LRU of plans keyed by tree signature (a registered
    ``gpuflat._src.caches.LRU``), with hit and miss counts; safe under threads.

    >>> c = PlanCache(maxsize=1)
    >>> c.get("a", lambda: 1), c.get("a", lambda: 2), c.get("b", lambda: 3), c.info()
    (1, 1, 3, CacheInfo(hits=1, misses=2, size=1, maxsize=1))
    """

    def __init__(self, maxsize: int = 256) -> None:
        self.maxsize = maxsize
        self._plans = caches.LRU("plans", maxsize)
        self._lock = threading.Lock()
        self.hits = self.misses = 0
        self._last: tuple[Hashable, FlatPlan | None] = (None, None)
        caches.track("plans (counts and the last plan)", self)

    def get(self, key: Hashable, make: Callable[[], FlatPlan]) -> FlatPlan:
        # Comparing with the last key first skips hashing a long key: a
        # training loop asks for the same plan every step. The key kept is
        # the one asked with, so a recorded tree's own Key is then found by
        # identity, with no comparison.
        last_key, last_plan = self._last
        plan = last_plan if key == last_key and last_plan is not None else self._plans.find(key)
        with self._lock:
            if plan is not None:
                self.hits += 1
            else:
                self.misses += 1
        if plan is None:
            plan = self._plans.get(key, make)  # make() runs outside every lock: building is the slow part
        self._last = (key, plan)
        return plan

    def info(self) -> CacheInfo:
        with self._lock:
            return CacheInfo(self.hits, self.misses, len(self._plans), self.maxsize)

    def clear(self) -> None:
        self._plans.clear()
        with self._lock:
            self.hits = self.misses = 0
            self._last = (None, None)

    def __len__(self) -> int:
        return int(self._last[1] is not None)


CacheInfo = namedtuple("CacheInfo", "hits misses size maxsize")
cache = PlanCache()


def cached(treedef: object, arrays: list[Any]) -> tuple[FlatPlan, list[Any]]:
    """(plan, unique trainable arrays in slot order) of a walked tree, from the cache.

    >>> treedef, arrays, statics, _ = _tree.walk([np.ones(2), np.ones(2)])
    >>> plan, unique = cached(treedef, arrays)
    >>> plan.size, len(unique)
    (4, 2)
    """
    slot_of, unique, key = key_of(treedef, arrays)
    return cache.get(key, lambda: build(treedef, slot_of, unique)), unique
