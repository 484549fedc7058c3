"""Recognising the very same arrays again, without keeping them alive.

A training loop hands gpuflat the same arrays step after step; whatever was
worked out from them (their in-place fitness, a device table of their
addresses) holds as long as the same objects come back unchanged. A weak
reference makes sure a dead array never matches and nothing is kept alive;
what an array's identity does not pin (its shape, dtype and strides, which
NumPy lets a caller set in place) is read again and compared.
"""
from __future__ import annotations

import operator
import weakref
from operator import attrgetter

_deref = weakref.ref.__call__
_strides = attrgetter("strides")


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


class Layout:
    """The strides of a list of arrays: with their shapes and dtypes, all of
    their memory layout that a caller can change in place (NumPy still lets
    ``a.strides = ...`` through). Only the strides are kept, never the
    arrays (a NumPy flags object would keep its array alive).

    >>> import numpy as np
    >>> a, b = np.ones(4), np.ones((4, 4))[:, 0]
    >>> layout = Layout([a, b])
    >>> layout.holds([a, b]), layout.holds([b, a])
    (True, False)
    """

    __slots__ = ("_strides",)

    def __init__(self, arrays):
        self._strides = list(map(_strides, arrays))

    def holds(self, arrays) -> bool:
        """Whether ``arrays`` (the same objects, of the same shapes and dtypes) still have this layout."""
        return list(map(_strides, arrays)) == self._strides
