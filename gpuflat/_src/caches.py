"""Every cache gpuflat keeps, in one registry.

A cache keeps what a call found or built (plans, tables of addresses, facts
read from tensors) so that the next call over the same things finds it
again. Each is bounded by entries and drops the least recently used first;
each registers under a name, so that :func:`clear` empties them all and
:func:`sizes` says how full each is. Two kinds:

- :class:`LRU`, found by a hashable key;
- :class:`Recent`, found by scanning its entries, the latest first, with a
  test of the caller's (tables found again by comparing words, which
  hashing would read in full every call).

A cache that lives on an object (one per plan, one per device) registers
each instance under one name; a cache that is a function's
(:func:`function`) is ``functools.lru_cache`` registered. Loaded builds
(libraries, modules: one per build, holding no caller's data) are not
caches here: dropping them would only load the same build again.

>>> squares = LRU("doctest squares", maxsize=2)
>>> [squares.get(k, lambda k=k: k * k) for k in (2, 3, 2, 4)]
[4, 9, 4, 16]
>>> sorted(squares.keys()), sizes()["doctest squares"]
([2, 4], 2)
>>> clear(); sizes()["doctest squares"]
0
"""
from __future__ import annotations

import functools
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Hashable, Protocol, TypeVar

_T = TypeVar("_T")


class Cache(Protocol):
    """What the registry holds: something that empties and says how many entries it has."""

    def clear(self) -> None: ...

    def __len__(self) -> int: ...


_lock = threading.Lock()
# name -> the live caches registered under it (weakly: a cache goes with its owner).
_registry: dict[str, weakref.WeakSet[Cache]] = {}
# name -> (size, clear) of caches kept by another structure (a weak dictionary).
_external: dict[str, tuple[Callable[[], int], Callable[[], object]]] = {}


def track(name: str, cache: Cache) -> None:
    """Register ``cache`` (it has ``clear()`` and ``len()``) under ``name``, for as long as it lives."""
    with _lock:
        _registry.setdefault(name, weakref.WeakSet()).add(cache)


def register(name: str, size: Callable[[], int], clear_it: Callable[[], object]) -> None:
    """Register a cache kept by another structure: its size and how to empty it.

    >>> kept = {}
    >>> register("doctest dict", kept.__len__, kept.clear)
    >>> kept[1] = 1; sizes()["doctest dict"]
    1
    """
    with _lock:
        _external[name] = (size, clear_it)


def clear() -> None:
    """Empty every cache (``gpuflat.cache_clear``). Device tables they held are released."""
    with _lock:
        caches = [c for group in _registry.values() for c in list(group)]
        external = list(_external.values())
    for cache in caches:
        cache.clear()
    for _, clear_it in external:
        clear_it()


def sizes() -> dict[str, int]:
    """{name: entries held} of every registered cache (``gpuflat.cache_info``)."""
    with _lock:
        groups = {name: list(group) for name, group in _registry.items()}
        external = dict(_external)
    out = {name: sum(len(c) for c in group) for name, group in groups.items()}
    out.update({name: size() for name, (size, _) in external.items()})
    return out


class LRU:
    """A bounded mapping, the least recently used entry dropped first; safe under threads.

    ``on_evict(value)`` runs for each entry dropped or cleared (outside the lock).

    >>> c = LRU("doctest lru", maxsize=1, on_evict=lambda v: print("dropped", v))
    >>> c.get("a", lambda: 1), c.get("b", lambda: 2)
    dropped 1
    (1, 2)
    """

    def __init__(self, name: str, maxsize: int, on_evict: Callable[[Any], None] | None = None) -> None:
        self.maxsize = maxsize
        self.on_evict = on_evict
        self._entries: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()
        track(name, self)

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value under ``key``, made with ``make()`` (outside the lock) where there is none."""
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return self._entries[key]
        value = make()
        with self._lock:
            value = self._entries.setdefault(key, value)
            self._entries.move_to_end(key)
            dropped = self._trim()
        self._evicted(dropped)
        return value

    def find(self, key: Hashable) -> Any:
        """The value under ``key`` (now the most recent), or None."""
        with self._lock:
            if key not in self._entries:
                return None
            self._entries.move_to_end(key)
            return self._entries[key]

    def put(self, key: Hashable, value: Any) -> None:
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            dropped = self._trim()
        self._evicted(dropped)

    def keys(self) -> list[Hashable]:
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            dropped = list(self._entries.values())
            self._entries.clear()
        self._evicted(dropped)

    def __len__(self) -> int:
        return len(self._entries)

    def _trim(self) -> list[Any]:
        dropped = []
        while len(self._entries) > self.maxsize:
            dropped.append(self._entries.popitem(last=False)[1])
        return dropped

    def _evicted(self, dropped: list[Any]) -> None:
        if self.on_evict is not None:
            for value in dropped:
                self.on_evict(value)


class Recent:
    """A bounded list of entries found by a test, the latest first; the least
    recently used dropped first; safe under threads.

    >>> r = Recent("doctest recent", maxsize=2)
    >>> for n in (1, 2, 3):
    ...     r.add(n)
    >>> r.find(lambda n: n % 2 == 1), r.entries()
    (3, [2, 3])
    """

    def __init__(self, name: str, maxsize: int, on_evict: Callable[[Any], None] | None = None) -> None:
        self.maxsize = maxsize
        self.on_evict = on_evict
        self._entries: list[Any] = []
        self._lock = threading.Lock()
        track(name, self)

    def find(self, match: Callable[[Any], bool]) -> Any:
        """The latest entry for which ``match(entry)`` holds (now the most recent), or None."""
        with self._lock:
            for k in range(len(self._entries) - 1, -1, -1):
                entry = self._entries[k]
                if match(entry):
                    self._entries.append(self._entries.pop(k))
                    return entry
        return None

    def add(self, entry: Any) -> None:
        with self._lock:
            self._entries.append(entry)
            dropped = self._entries[:-self.maxsize]
            del self._entries[:-self.maxsize]
        self._evicted(dropped)

    def remove(self, entry: Any) -> None:
        with self._lock:
            self._entries.remove(entry)

    def entries(self) -> list[Any]:
        """The entries, the latest last."""
        with self._lock:
            return list(self._entries)

    def clear(self) -> None:
        with self._lock:
            dropped, self._entries = self._entries, []
        self._evicted(dropped)

    def __len__(self) -> int:
        return len(self._entries)

    def _evicted(self, dropped: list[Any]) -> None:
        if self.on_evict is not None:
            for entry in dropped:
                self.on_evict(entry)


class _Function:
    """A registered ``functools.lru_cache``: what :func:`function` returns."""

    def __init__(self, cached: functools._lru_cache_wrapper[Any]) -> None:
        self.cached = cached

    def clear(self) -> None:
        self.cached.cache_clear()

    def __len__(self) -> int:
        return self.cached.cache_info().currsize


_functions: list[_Function] = []  # the registered function caches, kept as long as their functions


def function(maxsize: int) -> Callable[[Callable[..., _T]], functools._lru_cache_wrapper[_T]]:
    """``functools.lru_cache(maxsize)``, registered under the function's qualified name.

    >>> @function(maxsize=4)
    ... def double(x):
    ...     return 2 * x
    >>> double(3), sizes()[f"{__name__}.double"]
    (6, 1)
    """
    def decorate(fn: Callable[..., _T]) -> functools._lru_cache_wrapper[_T]:
        cached = functools.lru_cache(maxsize=maxsize)(fn)
        holder = _Function(cached)
        _functions.append(holder)
        track(f"{fn.__module__}.{fn.__qualname__}", holder)
        return cached
    return decorate
