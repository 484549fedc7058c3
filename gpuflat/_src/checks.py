"""Every validation gpuflat makes before it computes or writes anything.

The public operations call these first, so a bad call raises naming the leaf
path and what was expected against what was found, and changes nothing.
Backends never validate: what reaches them fits the plan.
"""
from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import TYPE_CHECKING, Any

import numpy as np

from . import arrays, caches
from . import tree as _tree
from .dtypes import admit
from ..errors import OverlapError, TreeMismatchError, UnsupportedLeafError
from .identity import CONTIGUOUS, Layout, SameArrays, flag_bits
from .layout import ORDERS_TAKEN, RULES, takes_order
from .overlap import find_overlap
from .seen import trees

if TYPE_CHECKING:
    from .flatplan import FlatPlan, LeafSpec
    from .seen import SeenTree, Verdicts

_shape, _dtype, _writeable = attrgetter("shape"), attrgetter("dtype"), attrgetter("flags.writeable")


def occurrences(plan: FlatPlan, tree: Any, *, allow_none: bool, walked: _tree.Walked | None = None,
                seen: SeenTree | None = None) -> tuple[list[Any], bool, Any, SeenTree | None]:
    """(values, exact, like, seen): what ``tree`` holds at each trainable place of
    ``plan``, checked, as NumPy or CuPy arrays.

    ``like`` is one of the caller's own objects behind them (a PyTorch
    tensor, say), or None when they are NumPy or CuPy arrays. ``exact`` is
    True when the tree is shaped exactly like the plan's, so every value is
    an array of the expected shape and dtype (no None). A tree
    shaped exactly like the plan's costs one walk and a comparison of its
    shapes and dtypes (a recorded tree, read again, one test per plan);
    anything else takes the slow path that finds and names the first
    difference. ``walked`` is ``tree``'s walk, where the caller has it (and
    ``seen`` its record, if any). ``seen`` comes back where the tree was
    read through its record (``gpuflat._src.seen.SeenTree``) and is exact.

    >>> import numpy as np, gpuflat as gf
    >>> p = gf.plan({"w": np.ones(2)})
    >>> occurrences(p, {"w": np.ones(3)}, allow_none=False)
    Traceback (most recent call last):
    ...
    gpuflat.errors.TreeMismatchError: leaf "['w']": expected shape (2,), got (3,)
    """
    if walked is None:
        walked, seen = trees.walk(tree)
    arrays = walked.arrays
    like = next(iter(walked.foreign.values()), None)
    if seen is not None and seen.exact_for(plan):
        return arrays, True, like, seen
    shapes, dtypes = plan.occurrence_signature
    if walked.treedef == plan.treedef and tuple(map(_shape, arrays)) == shapes and tuple(map(_dtype, arrays)) == dtypes:
        return arrays, True, like, None
    values = _tree.arrays_like(plan.treedef, tree)
    views: dict = {}  # one view per object, so the same gradient met twice stays one
    checked = []
    for path, slot, value in zip(plan.occurrence_paths, plan.slot_of, values):
        if id(value) not in views:
            views[id(value)] = check_leaf(plan.leaves[slot], path, value, allow_none=allow_none)
            if like is None and views[id(value)] is not value and value is not None:
                like = value
        checked.append(views[id(value)])
    return checked, False, like, None


def check_leaf(spec: LeafSpec, path: str, value: Any, *, allow_none: bool) -> Any:
    """``value`` as a NumPy or CuPy array if it fits ``spec`` (None stays None
    where allowed); else TreeMismatchError naming the path."""
    if value is None and allow_none:
        return None
    adopted = value if isinstance(value, _tree._array_types()) else _adopt(path, value)
    if adopted is None:
        expected = f"an array of {spec.describe()}" + (" or None" if allow_none else "")
        raise TreeMismatchError(f"leaf {path!r}: expected {expected}, got {type(value).__name__}")
    if tuple(adopted.shape) != spec.shape:
        raise TreeMismatchError(f"leaf {path!r}: expected shape {spec.shape}, got {tuple(adopted.shape)}")
    if adopted.dtype != spec.dtype:
        raise TreeMismatchError(f"leaf {path!r}: expected dtype {spec.dtype}, got {adopted.dtype}")
    return adopted


def _adopt(path: str, value: Any) -> Any:
    try:
        return arrays.adopt(value)
    except UnsupportedLeafError as e:
        raise TreeMismatchError(f"leaf {path!r}: {e}") from None


def check_flat(plan: FlatPlan, flat: Any, name: str = "flat", *, exact_dtype: bool = True) -> None:
    """A flat buffer: 1-D, ``plan.size`` elements, C-contiguous, and of
    ``plan.dtype`` (any real or complex floating dtype if not ``exact_dtype``).

    >>> import numpy as np, gpuflat as gf
    >>> p = gf.plan([np.ones(3)])
    >>> check_flat(p, np.arange(6.0)[::2])
    Traceback (most recent call last):
    ...
    gpuflat.errors.TreeMismatchError: flat: expected a C-contiguous array, got strides (16,)
    """
    shape = getattr(flat, "shape", None)
    if shape is None:
        raise TreeMismatchError(f"{name}: expected a 1-D array, got {type(flat).__name__}")
    if tuple(shape) != (plan.size,):
        raise TreeMismatchError(f"{name}: expected shape ({plan.size},), got {tuple(shape)}")
    if exact_dtype and flat.dtype != plan.dtype:
        raise TreeMismatchError(f"{name}: expected dtype {plan.dtype}, got {flat.dtype}")
    if not exact_dtype and not admit(flat.dtype):
        raise TreeMismatchError(f"{name}: expected a floating or complex dtype, got {flat.dtype}")
    # The kernels address a flat buffer as base + i: a strided view would be
    # read and written in its gaps and past its end.
    if not flat.flags.c_contiguous:
        raise TreeMismatchError(f"{name}: expected a C-contiguous array, got strides {tuple(flat.strides)}")


def check_in_place(paths: Sequence[str], arrays: Sequence[Any]) -> None:
    """Arrays about to be written in place: writable, each free of self-overlap
    (no zero stride), and no two sharing memory.

    >>> import numpy as np
    >>> check_in_place(["['w']"], [np.lib.stride_tricks.as_strided(np.ones(1), (3,), (0,))])
    Traceback (most recent call last):
    ...
    gpuflat.errors.OverlapError: leaf "['w']": expected an array whose elements are distinct memory, got shape (3,) with strides (0,) (a broadcast or self-overlapping view); an in-place write would race. Pass a copy
    """
    _check_writable(paths, arrays)
    for k in _not_contiguous(arrays):
        path, a = paths[k], arrays[k]
        if may_overlap_itself(a):
            raise overlapping_itself(path, "an array", a.shape, a.strides, "a broadcast")
    pair = find_overlap(arrays)
    if pair is not None:
        raise sharing_memory(*(paths[k] for k in pair))


def overlapping_itself(path: str, what: str, shape: Sequence[int], strides: Sequence[int], made_by: str) -> OverlapError:
    """The error for a leaf about to be written in place whose elements may
    share an address: ``what`` it is, ``made_by`` what usually makes one.

    >>> print(overlapping_itself("w", "a tensor", (2,), (0,), "an expanded"))
    leaf 'w': expected a tensor whose elements are distinct memory, got shape (2,) with strides (0,) (an expanded or self-overlapping view); an in-place write would race. Pass a copy
    """
    return OverlapError(f"leaf {path!r}: expected {what} whose elements are distinct memory, got shape "
                        f"{tuple(shape)} with strides {tuple(strides)} ({made_by} or self-overlapping view); "
                        f"an in-place write would race. Pass a copy")


def sharing_memory(first: str, second: str) -> OverlapError:
    """The error for two leaves about to be written in place that share memory.

    >>> print(sharing_memory("a", "b"))
    leaves 'a' and 'b' share memory; an in-place operation would write one through the other (expected distinct memory, found overlapping views)
    """
    return OverlapError(f"leaves {first!r} and {second!r} share memory; an in-place operation would "
                        f"write one through the other (expected distinct memory, found overlapping views)")


def _not_contiguous(arrays: Sequence[Any]) -> Sequence[int]:
    """The indices of the arrays that are neither C- nor F-contiguous (only
    those can overlap themselves), read from NumPy's flags in one C loop;
    every index for arrays without them."""
    bits = flag_bits(arrays)
    return range(len(arrays)) if bits is None else np.flatnonzero((bits & CONTIGUOUS) == 0).tolist()


class InPlaceChecked:
    """Remembers, per plan, the arrays last found fit for an in-place write.

    A training loop clips the same gradient arrays every step; the overlap
    tests cost far more than the write on a tree of tiny leaves. When the
    very same arrays come again (of the plan's shapes and dtypes, as every
    caller has checked) in the same layout (``gpuflat._src.identity.Layout``:
    their flags, writable among them, and the strides of those not
    contiguous, which NumPy lets a caller change in place), the verdict
    stands. CuPy arrays have no such flags: their device memory is always
    writable, and their strides are compared.
    The arrays are held by weak reference: a dead array never matches, and
    the memo never keeps a step's gradients alive. A recorded tree keeps
    its verdict itself (``verdicts``, see ``gpuflat._src.seen.SeenTree``).

    >>> import numpy as np
    >>> memo, arrays = InPlaceChecked(), [np.ones(2), np.ones(3)]
    >>> memo.check(InPlaceChecked, ["a", "b"], arrays); memo.check(InPlaceChecked, ["a", "b"], arrays)
    >>> arrays[1].flags.writeable = False
    >>> memo.check(InPlaceChecked, ["a", "b"], arrays)
    Traceback (most recent call last):
    ...
    gpuflat.errors.TreeMismatchError: leaf 'b': expected a writable array, got a read-only one
    """

    def __init__(self) -> None:
        self._last: weakref.WeakKeyDictionary[Any, tuple[SameArrays, Layout]] = weakref.WeakKeyDictionary()  # by plan: bounded by the plans alive
        caches.track("in-place verdicts", self)

    def clear(self) -> None:
        self._last.clear()

    def __len__(self) -> int:
        return len(self._last)

    def check(self, plan: Any, paths: Sequence[str], arrays: Sequence[Any], verdicts: Verdicts | None = None) -> None:
        """OverlapError or TreeMismatchError naming the leaf (``paths[i]``)
        unfit for an in-place write, unless ``arrays`` were found fit as they are."""
        if verdicts is not None:
            # The verdicts stand for the arrays' flags as they were when found
            # writable: a leaf made read-only since has new, empty verdicts.
            if not verdicts.in_place:
                check_in_place(paths, arrays)
                verdicts.in_place = True
            return
        last = self._last.get(plan)
        if last is not None and last[0].holds(arrays) and last[1].holds(arrays):
            return
        check_in_place(paths, arrays)
        self._last[plan] = (SameArrays(arrays), Layout(arrays))


def _check_writable(paths: Sequence[str], arrays: Sequence[Any]) -> None:
    try:
        if all(map(_writeable, arrays)):  # one C loop where every array is writable
            return
    except AttributeError:  # a CuPy array has no writeable flag
        pass
    for path, a in zip(paths, arrays):
        # CuPy arrays have no writeable flag: device memory is always writable.
        if not getattr(getattr(a, "flags", None), "writeable", True):
            raise TreeMismatchError(f"leaf {path!r}: expected a writable array, got a read-only one")


def may_overlap_itself(a: Any) -> bool:
    """True when two elements of ``a`` may share an address (a zero stride,
    or strides too small for the dimensions inside them).

    Sufficient, not exact: dims sorted by stride must each step past the
    whole extent of the smaller ones, so a few exotic interleaved layouts
    that do not overlap are refused too.

    >>> import numpy as np
    >>> x = np.zeros((4, 4))
    >>> may_overlap_itself(x.T), may_overlap_itself(x[::-2]), may_overlap_itself(np.broadcast_to(x[0], (2, 4)))
    (False, False, True)
    """
    if a.size == 0:
        return False
    dims = sorted((abs(s), n) for n, s in zip(a.shape, a.strides) if n > 1)
    extent = a.dtype.itemsize
    for stride, n in dims:
        if stride < extent:
            return True
        extent = stride * (n - 1) + extent
    return False


def clip_arguments(max_norm: Any, ord: Any, eps: Any) -> tuple[Any, float, float]:
    """(max_norm, p, eps) of a clip, checked: ``max_norm`` and ``eps`` real
    numbers >= 0, ``ord`` 1, 2, inf or any p > 0 (no strings, no NaN).
    ``max_norm`` may also be a 0-d device tensor, kept as it is (see
    ``clipping.max_norm_for``).

    >>> clip_arguments(1, 2, 1e-6)
    (1.0, 2.0, 1e-06)
    >>> clip_arguments("1.0", 2, 1e-6)
    Traceback (most recent call last):
    ...
    ValueError: max_norm: expected a number >= 0, got '1.0'
    >>> clip_arguments(1.0, 2, -1)
    Traceback (most recent call last):
    ...
    ValueError: eps: expected a number >= 0, got -1
    """
    if _on_device(max_norm):
        max_norm = _device_scalar("max_norm", max_norm)
    else:
        max_norm = _real("max_norm", max_norm, "a number >= 0", lambda v: v >= 0)
    eps = _real("eps", eps, "a number >= 0", lambda v: v >= 0)
    return max_norm, check_ord(ord), eps


def _on_device(x: Any) -> bool:
    """A CuPy array or a PyTorch CUDA tensor: reading its value would wait on the device."""
    kind = arrays.kind(x)
    return kind == "cupy" or kind == "torch" and x.is_cuda


def _device_scalar(name: str, x: Any) -> Any:
    """A 0-d real floating device array, kept on the device: its value is not
    checked, as that would be a host read (a CUDA graph could not capture it)."""
    shape, dtype = tuple(x.shape), str(x.dtype).removeprefix("torch.")
    if shape != () or not (dtype.startswith("float") or dtype.startswith("bfloat")):
        raise ValueError(f"{name}: expected a number >= 0 or a 0-d real floating device tensor, got one of "
                         f"shape {shape} and dtype {dtype}")
    return x


def check_ord(ord: Any, name: str = "ord") -> float:
    """The norm order as a float: 1, 2, inf or any p > 0; else ValueError
    naming the argument ``name``.

    >>> check_ord(2), check_ord(float("inf"))
    (2.0, inf)
    """
    return _real(name, ord, ORDERS_TAKEN, takes_order)


def torch_norm_type(norm_type: Any, name: str = "norm_type") -> float:
    """``norm_type`` read as PyTorch's ``clip_grad_norm_`` reads it
    (``float(norm_type)``, so the string ``'inf'`` too), checked as
    :func:`check_ord` checks it.

    >>> torch_norm_type("inf"), torch_norm_type(1.5)
    (inf, 1.5)
    """
    if isinstance(norm_type, str):
        try:
            norm_type = float(norm_type)
        except ValueError:
            pass
    return check_ord(norm_type, name)


def _real(name: str, x: Any, expected: str, accept: Callable[[float], bool]) -> float:
    """``x`` as a float if it is a real number (not a string or bool) that ``accept``s."""
    value = math.nan
    if not isinstance(x, (str, bytes, bool)):
        try:
            value = float(x)
        except (TypeError, ValueError):
            pass
    if not accept(value):  # NaN fails every comparison
        raise ValueError(f"{name}: expected {expected}, got {x!r}")
    return value


def optimizer_options(rule: str, group: dict, i: int) -> None:
    """PyTorch's checks of an optimizer's options, naming the group. A
    tensor ``lr`` on a GPU is not read (that would wait for the device).

    >>> optimizer_options("sgd", {"lr": -1.0, "weight_decay": 0.0, "momentum": 0.0, "dampening": 0.0,
    ...                           "nesterov": False}, 2)
    Traceback (most recent call last):
    ...
    ValueError: parameter group 2: expected lr >= 0, got -1.0
    """
    def need(ok: bool, what: str, value: Any) -> None:
        if not ok:
            raise ValueError(f"parameter group {i}: expected {what}, got {value!r}")

    lr = group["lr"]
    if not hasattr(lr, "device") or lr.device.type == "cpu":
        need(float(lr) >= 0.0, "lr >= 0", lr)
        need(math.isfinite(float(lr)), "a finite lr", lr)
    need(float(group["weight_decay"]) >= 0.0, "weight_decay >= 0", group["weight_decay"])
    for check in RULES[rule].checks:
        need(check.accept(group), check.expected, check.shown(group))