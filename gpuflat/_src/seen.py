"""Trees walked before, read again without a walk while they stay unchanged.

A training loop hands gpuflat the same tree step after step: the same
containers holding the same arrays. Its walk and plan key hold as long as
every container still holds the same objects, of the same shapes and
dtypes; what the checks found (fit for an in-place write, apart from a flat
buffer) as long as, besides, the arrays' layout (``identity.Layout``: flags
and the strides that matter) is the one they were found in. All of that is
read again at C speed instead of walking the tree in Python: NumPy arrays'
facts in one native pass (``native.array_facts``), CuPy arrays' identities
and shapes (all a live CuPy array can change of itself:
``identity.device_array_facts``) in one native call (``native.same_shapes``),
or one ``map`` each where the host library is not built. Nothing of the
caller's is kept alive: arrays are weakly referenced, and only small
immutable statics (numbers, strings, None) are held.
"""
from __future__ import annotations

import itertools
import operator
import weakref
from itertools import repeat
from operator import attrgetter
from typing import Any

import numpy as np

from . import caches, flatplan
from . import tree as _tree
from .dtypes import TAGS
from .identity import Layout, Recorded, device_array_facts, equal_facts
from .native import array_facts, same_shapes

_shape, _dtype = attrgetter("shape"), attrgetter("dtype")

# Statics of these exact types are immutable and small: a record holds them
# outright (they cannot be weakly referenced) and compares them by identity.
_HELD = (type(None), bool, int, float, complex, str)
# The containers a record re-reads without a walk: those with no values of
# their own (a defaultdict's factory, a module, an object's other fields).
_PLAIN = (dict, list, tuple)
# A record's token, never given twice in a process (see Recorded).
_TOKENS = itertools.count(1)


class SeenTree:
    """One tree walked before: enough to read the same tree again without a
    walk, and what was found out about it (see :class:`SeenTrees`).

    Only plain trees are recorded: dicts, lists and tuples holding arrays of
    one kind (NumPy's or CuPy's) and immutable scalars (None, numbers,
    strings).

    >>> import numpy as np
    >>> tree = {"w": np.ones(2), "b": [np.ones(3), "relu"]}
    >>> seen = SeenTree.of(tree, _tree.walk(tree))
    >>> seen.walk_again(tree).statics
    ['relu']
    >>> tree["b"][0] = np.ones(3)
    >>> seen.walk_again(tree) is None
    True
    """

    __slots__ = ("node", "treedef", "refs", "ids", "alive", "array_at", "static_at", "held", "static_arrays",
                 "shapes", "dtypes", "kind", "facts", "token", "slot_of", "first", "key", "_plans", "_verdicts", "__weakref__")

    node: tuple[Any, ...]
    treedef: object
    refs: list[weakref.ref[Any]]
    ids: list[int]
    alive: list[bool]
    array_at: list[int] | None
    static_at: list[int]
    held: list[Any]
    static_arrays: list[tuple[int, tuple[int, ...], np.dtype]]
    shapes: list[tuple[int, ...]]
    dtypes: list[np.dtype]
    kind: type
    facts: Any
    token: int
    slot_of: tuple[int, ...]
    first: list[int] | None
    key: flatplan.Key
    _plans: weakref.WeakSet[flatplan.FlatPlan]
    _verdicts: Verdicts | None

    @classmethod
    def of(cls, tree: Any, walked: _tree.Walked) -> "SeenTree | None":
        """The record of ``tree`` (``walked`` its walk), or None for a tree that is not plain."""
        if walked.foreign or type(tree) not in _PLAIN:
            return None
        values: list = []
        node = _plain_node(tree, values)
        if node is None:
            return None
        kinds = list(map(type, values))
        kind = type(walked.arrays[0]) if walked.arrays else np.ndarray
        if kind not in _tree._array_types():
            return None  # a subclass, or a PyTorch or JAX view: walked as it says
        array_at = [i for i, k in enumerate(kinds) if k is kind and values[i].dtype in TAGS]
        trainable = set(array_at)
        static_at = [i for i in range(len(values)) if i not in trainable] if len(array_at) < len(values) else []
        if any(kinds[i] is not np.ndarray and kinds[i] is not kind and kinds[i] not in _HELD for i in static_at):
            return None
        arrays, statics = [values[i] for i in array_at], [values[i] for i in static_at]
        if len(arrays) != len(walked.arrays) or not all(map(operator.is_, arrays, walked.arrays)):
            return None  # not the tree walked (changed meanwhile): nothing is recorded
        return cls(node, walked.treedef, values, array_at, static_at, statics, kind)

    def __init__(self, node: tuple[Any, ...], treedef: object, values: list[Any], array_at: list[int],
                 static_at: list[int], statics: list[Any], kind: type = np.ndarray) -> None:
        arrays = [values[i] for i in array_at]
        self.node, self.treedef = node, treedef
        # An array's id is its address, taken again only after it died; the
        # weak references are kept for their callback, run before an array's
        # memory is freed, which marks the record dead: equal ids in a live
        # record are the very same arrays.
        self.alive = alive = [True]
        self.refs = list(map(weakref.ref, arrays, repeat(lambda _, alive=alive: alive.__setitem__(0, False))))
        self.ids = list(map(id, arrays))
        self.array_at = None if len(array_at) == len(values) else array_at
        self.static_at = static_at
        self.held = [s if type(s) in _HELD else weakref.ref(s) for s in statics]
        self.static_arrays = [(k, s.shape, s.dtype) for k, s in enumerate(statics) if type(s) not in _HELD]
        self.shapes, self.dtypes = list(map(_shape, arrays)), list(map(_dtype, arrays))
        # Identities, addresses, shapes, dtypes, flags and strides: of NumPy
        # arrays in one native read, where the host library is built (None:
        # identities, shapes and dtypes compared in Python, the layout by the
        # verdicts); of CuPy arrays the shapes alone (the identities are
        # compared first, and the rest of a live CuPy array follows from its
        # shape or never changes: identity.device_array_facts).
        self.kind = kind
        self.facts = (array_facts(arrays, 4 * len(arrays) + 2 * sum(map(len, self.shapes))) if kind is np.ndarray
                      else self.shapes)
        # Where those facts are compared, arrays read again are the very arrays
        # recorded, unchanged: a native backend may keep what it read from them.
        self.token = next(_TOKENS) if self.facts is not None else 0
        self.slot_of, unique, self.key = flatplan.key_of(treedef, arrays)
        self.first = None if len(unique) == len(arrays) else [self.slot_of.index(s) for s in range(len(unique))]
        self._plans = weakref.WeakSet()
        self._verdicts = None

    def walk_again(self, tree: Any) -> _tree.Walked | None:
        """``tree``'s Walked if it is the tree recorded, unchanged (the same
        containers' contents, the same objects, of the same shapes and
        dtypes), else None."""
        values = Recorded()
        if not _read_again(tree, self.node, values):
            return None
        arrays = values if self.array_at is None else Recorded(values[i] for i in self.array_at)
        # The ids before the liveness: an array that died while they were
        # read has marked the record dead by the time it is asked.
        if self.facts is not None:
            if not self._same_facts(arrays) or not self.alive[0]:
                return None
        elif (list(map(id, arrays)) != self.ids or not self.alive[0]
              or list(map(_shape, arrays)) != self.shapes or list(map(_dtype, arrays)) != self.dtypes):
            return None
        statics = [values[i] for i in self.static_at]
        if statics and not self._same_statics(statics):
            return None
        arrays.token = self.token
        return _tree.Walked(self.treedef, arrays, statics, {})

    def _same_facts(self, arrays: list[Any]) -> bool:
        if self.kind is not np.ndarray:
            # The ids, then the liveness, before any CuPy attribute is read:
            # only the recorded arrays themselves have them (a tree of NumPy
            # arrays can take a dead CuPy tree's identity). In native code
            # where the host library is built: no list of ids or of shapes made.
            same = same_shapes(arrays, self.ids, self.alive, self.facts)
            if same is not None:
                return same
            if list(map(id, arrays)) != self.ids or not self.alive[0]:
                return False
            with _tree.collector_paused():  # the shapes' tuples: thousands, none in a cycle
                return device_array_facts(arrays) == self.facts
        now = array_facts(arrays, len(self.facts))
        return now is not None and equal_facts(now, self.facts)

    def _same_statics(self, statics: list[Any]) -> bool:
        # An immutable is held, so the same object is the same value; an
        # array static is weakly held, and its shape or dtype may have changed.
        held = [h if type(h) in _HELD else h() for h in self.held]
        return (all(map(operator.is_, held, statics))
                and all(statics[k].shape == shape and statics[k].dtype == dtype
                        for k, shape, dtype in self.static_arrays))

    def unique(self, arrays: list[Any]) -> list[Any]:
        """The unique arrays (ties once) of the recorded tree read again as ``arrays``."""
        return arrays if self.first is None else [arrays[i] for i in self.first]

    def plan(self, arrays: list[Any]) -> tuple[flatplan.FlatPlan, list[Any]]:
        """(plan, unique arrays) of the recorded tree read again as ``arrays``,
        from the plan cache (as ``flatplan.cached`` gives them)."""
        unique = self.unique(arrays)
        return flatplan.cache.get(self.key, lambda: flatplan.build(self.treedef, self.slot_of, unique)), unique

    def exact_for(self, plan: flatplan.FlatPlan) -> bool:
        """Whether the tree is shaped exactly like ``plan``'s (as ``checks.occurrences`` asks)."""
        core = plan.structure or plan
        if core in self._plans:
            return True
        shapes, dtypes = core.occurrence_signature
        exact = self.treedef == core.treedef and self.shapes == list(shapes) and self.dtypes == list(dtypes)
        if exact:
            self._plans.add(core)
        return exact

    def ties_as(self, plan: flatplan.FlatPlan) -> bool:
        """Whether the tree ties its arrays as ``plan`` does (each occurrence in the same slot)."""
        if plan.slot_of is self.slot_of:
            return True
        if plan.slot_of != self.slot_of:
            return False
        self.slot_of = plan.slot_of  # an equal tuple: the next time, one identity test
        return True

    def verdicts(self, unique: list[Any]) -> "Verdicts":
        """What was found about the tree's unique arrays (``unique``: this
        tree's, read again), while their layout is the one it was found on;
        a new, empty Verdicts when it has changed. Where the record reads its
        arrays' facts (natively, or a CuPy tree's shapes, which pin its
        strides where they matter), a tree read again has the layout it was
        recorded with, so the verdicts always stand."""
        verdicts = self._verdicts
        if verdicts is None or (self.facts is None and verdicts.layout is not None
                                and not verdicts.layout.holds(unique)):
            verdicts = self._verdicts = Verdicts(None if self.facts is not None else Layout(unique))
        return verdicts


class Verdicts:
    """Checks passed by a recorded tree's unique arrays in one layout: fit
    for an in-place write, and apart from one buffer (a weak reference and
    its layout), so that neither is made again while nothing changed.

    >>> import numpy as np
    >>> a, buf = np.ones(2), np.ones(4)
    >>> v = Verdicts(Layout([a]))
    >>> v.apart_from(buf)
    False
    >>> v.found_apart(buf); v.apart_from(buf), v.apart_from(buf[:2])
    (True, False)
    """

    __slots__ = ("layout", "in_place", "_apart")
    layout: Layout | None
    in_place: bool
    _apart: tuple[weakref.ref[Any], tuple[tuple[int, ...], tuple[int, ...], np.dtype]] | None

    def __init__(self, layout: Layout | None) -> None:
        self.layout, self.in_place, self._apart = layout, False, None

    def apart_from(self, buffer: Any) -> bool:
        apart = self._apart
        return apart is not None and apart[0]() is buffer and apart[1] == _buffer_layout(buffer)

    def found_apart(self, buffer: Any) -> None:
        try:
            self._apart = (weakref.ref(buffer), _buffer_layout(buffer))
        except TypeError:  # a buffer kind without weak references is checked every time
            pass


def _buffer_layout(buffer: Any) -> tuple[tuple[int, ...], tuple[int, ...], np.dtype]:
    return buffer.shape, buffer.strides, buffer.dtype


def _plain_node(x: dict[Any, Any] | list[Any] | tuple[Any, ...], values: list[Any]) -> tuple[Any, ...] | None:
    """The node of plain container ``x`` (its type, its keys or length, and
    where its containers sit), its other values appended to ``values`` in
    walk order; None if ``x`` holds a container that is not plain."""
    children = list(x.values()) if type(x) is dict else x
    subs = []
    for i, child in enumerate(children):
        if isinstance(child, (dict, list, tuple)):
            if type(child) not in _PLAIN:
                return None  # a subclass (a namedtuple, an OrderedDict) is walked as it says
            sub = _plain_node(child, values)
            if sub is None:
                return None
            subs.append((i, sub))
        else:
            values.append(child)
    return type(x), tuple(x) if type(x) is dict else len(x), tuple(subs) or None


def _read_again(x: Any, node: tuple[Any, ...], values: list[Any]) -> bool:
    """Append ``x``'s values to ``values`` as ``_plain_node`` did, if ``x``
    still has ``node``'s type, keys (or length) and containers."""
    cls, names, subs = node
    if type(x) is not cls:
        return False
    if cls is dict:
        if len(x) != len(names) or tuple(x) != names:
            return False
        children = x.values()
    elif len(x) != names:
        return False
    else:
        children = x
    if subs is None:
        values.extend(children)
        return True
    children = list(children)
    start = 0
    for i, sub in subs:
        values.extend(children[start:i])
        if not _read_again(children[i], sub, values):
            return False
        start = i + 1
    values.extend(children[start:])
    return True


class SeenTrees:
    """The last few plain trees walked, read again without a walk when they come back.

    A tree is recorded the second time it is walked unchanged (the same
    root, the same first and last arrays), so a loop that builds a new tree
    every call pays nothing for records it would never use. Lookups are by
    the root's identity, and every recorded fact is checked again against
    the tree at hand, so a dead tree whose address was reused never matches.
    Safe under threads: records are only ever replaced whole.

    >>> import numpy as np
    >>> trees, tree = SeenTrees(), {"w": np.ones(2)}
    >>> [trees.walk(tree)[1] is not None for _ in range(3)]
    [False, True, True]
    >>> tree["w"] = np.ones(2)
    >>> trees.walk(tree)[1] is None
    True
    """

    def __init__(self, maxsize: int = 8) -> None:
        self._entries = caches.LRU("trees seen", maxsize)

    def walk(self, tree: Any) -> tuple[_tree.Walked, SeenTree | None]:
        """(``tree``'s Walked, its SeenTree or None where it is not recorded)."""
        entry = self._entries.find(id(tree))
        if type(entry) is SeenTree:
            walked = entry.walk_again(tree)
            if walked is not None:
                return walked, entry
        with _tree.collector_paused():
            walked = _tree.walk(tree)
            arrays = walked.arrays
            mark = (id(arrays[0]), id(arrays[-1]), len(arrays)) if arrays else None
            seen = None
            if mark is not None and entry == ("walked", mark):
                seen = SeenTree.of(tree, walked)
            elif entry == ("not plain", mark):
                return walked, None  # known: recording it is not tried every call
        self._entries.put(id(tree), seen or ("walked" if entry != ("walked", mark) else "not plain", mark))
        return walked, seen

    def clear(self) -> None:
        self._entries.clear()


# The trees every front end walks (``gpuflat._src.binding`` and ``gpuflat._src.checks``).
trees = SeenTrees()
