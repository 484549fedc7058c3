"""What a public module shows: ``dir()`` lists its ``__all__`` and nothing
else (PEP 562's module ``__dir__``), and the names it used to show besides
keep working for one more release, each access warning
``DeprecationWarning`` with what to use instead (a module ``__getattr__``,
which Python calls only for a name the module does not hold).

A public module says, after its ``__all__``::

    __dir__ = _public.listing(__all__)
    if not TYPE_CHECKING:
        __getattr__ = _public.deprecations(__name__, {"old": "gpuflat._src.where.old"})

and holds what it needs itself under private names (``from ._src import x
as _x``), so that the deprecated names are misses that reach ``__getattr__``.
The warning sends the user to the object's public home, or says it has none.
Type checkers do not see the ``__getattr__``: mypy would take it to define
every name, a misspelt one too, so it reports the deprecated names (and
any typo) as missing instead.

>>> import types, warnings
>>> m = types.ModuleType("demo")
>>> m.__dir__ = listing(["kept"])
>>> m.__getattr__ = deprecations("demo", {"old": "math.pi", "hidden": "gpuflat._src.caches"})
>>> dir(m)
['kept']
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     round(m.old, 2)
3.14
>>> str(caught[0].message)
'demo.old is deprecated and will be removed in gpuflat 0.9.0; use math.pi'
>>> with warnings.catch_warnings(record=True) as caught:
...     warnings.simplefilter("always")
...     m.hidden.__name__
'gpuflat._src.caches'
>>> str(caught[0].message)
'demo.hidden is deprecated and will be removed in gpuflat 0.9.0; it is internal, with no public replacement'
>>> m.nothing
Traceback (most recent call last):
AttributeError: module 'demo' has no attribute 'nothing'
"""
from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Iterable, Mapping

REMOVED_IN = "0.9.0"  # one release after the names left dir()


def listing(public: Iterable[str]) -> Callable[[], list[str]]:
    """A module's ``__dir__``: its public names, sorted, and nothing else."""
    shown = sorted(public)

    def __dir__() -> list[str]:
        return list(shown)

    return __dir__


def deprecations(module: str, moved: Mapping[str, str]) -> Callable[[str], object]:
    """``module``'s ``__getattr__``: ``moved`` maps each name that left it to
    where its object lives (a dotted path), returned with a warning; any
    other missing name raises AttributeError as a module without
    ``__getattr__`` does."""

    def __getattr__(name: str) -> object:
        if name not in moved:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        home = moved[name]
        warnings.warn(f"{module}.{name} is deprecated and will be removed in gpuflat {REMOVED_IN}; {_instead(home)}",
                      DeprecationWarning, stacklevel=2)
        where, _, attribute = home.rpartition(".")
        return getattr(importlib.import_module(where), attribute)

    return __getattr__


def _instead(home: str) -> str:
    """What a deprecation warning advises: the public home of the object, if it has one."""
    if any(part.startswith("_") for part in home.split(".")):
        return "it is internal, with no public replacement"
    return f"use {home}"
