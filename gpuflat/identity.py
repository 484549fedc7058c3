"""Recognising the very same arrays again, without keeping them alive.

A training loop hands gpuflat the same arrays step after step; whatever was
worked out from them (their in-place fitness, a device table of their
addresses) holds as long as the same objects come back. An array's memory
cannot change under its identity, so identity is enough; a weak reference
makes sure a dead array never matches and nothing is kept alive.
"""
from __future__ import annotations

import operator
import weakref

_deref = weakref.ref.__call__


class SameArrays:
    """Weak references to a list of arrays, to tell whether exactly these
    objects, in this order, come again.

    >>> import numpy as np
    >>> a, b = np.ones(2), np.ones(3)
    >>> seen = SameArrays([a, b])
    >>> seen.holds([a, b]), seen.holds([b, a]), seen.holds([a, b.copy()])
    (True, False, False)
    """

    __slots__ = ("_refs",)

    def __init__(self, arrays):
        try:
            self._refs = list(map(weakref.ref, arrays))
        except TypeError:  # an array type without weak references never matches
            self._refs = None

    def holds(self, arrays) -> bool:
        refs = self._refs
        return (refs is not None and len(refs) == len(arrays)
                and all(map(operator.is_, map(_deref, refs), arrays)))
