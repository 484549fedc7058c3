"""The one list of dtypes gpuflat handles, and their tags in the kernel tables.

Every module that needs to know which dtypes are trainable, how a dtype is
called in the CUDA sources, or which integer tag marks it in a device table,
reads it from here; the rows themselves are gpuflat._src.layout's DTYPES, so
adding a dtype is a row there (and its C++ type in the kernels).

A dtype NumPy lacks comes from the package its row names (``DType.module``:
bfloat16 from ml_dtypes, whose import takes most of a second); it is
imported when such a value is first met or made, not with gpuflat. An array
can only hold such a dtype once its package is imported, so :func:`admit`
registers it at the moment the first such array is seen.

>>> admit(np.dtype(np.float32)), admit(np.dtype(np.int32))
(True, False)
"""
from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt
    import torch

from .layout import DTYPES, DType

# The rows whose dtype a package defines, by name.
FROM_PACKAGE = {row.name: row for row in DTYPES if row.module is not None}

# dtype -> tag and dtype -> C++ name, of the dtypes NumPy knows now: those
# of FROM_PACKAGE join them when registered (see imported).
TAGS = {np.dtype(row.name): row.tag for row in DTYPES if row.name not in FROM_PACKAGE}
CUDA_NAMES = {dtype: DTYPES[tag].c_name for dtype, tag in TAGS.items()}
_DTYPE_OF_TAG = {tag: dtype for dtype, tag in TAGS.items()}
# The dtype each row is summed in across ranks (DType.wider), by tag.
_WIDER = {row.tag: np.dtype(row.wider) for row in DTYPES if row.wider is not None}
# FROM_PACKAGE's dtypes imported so far, by name (None: the package is not installed).
_imported: dict[str, np.dtype | None] = {}
_when_registered: list[Callable[[np.dtype], object]] = []
# The table's dtypes as a message lists them.
_LISTED = " or ".join((", ".join(row.name for row in DTYPES[:-1]), DTYPES[-1].name))
# Each row's NumPy name, by that name and by its C++ name.
_NUMPY_NAME = {**{row.c_name: row.name for row in DTYPES}, **{row.name: row.name for row in DTYPES}}


def imported(name: str) -> np.dtype | None:
    """The dtype of the row of :data:`FROM_PACKAGE` called ``name``, its
    package imported now and the dtype registered in :data:`TAGS`; None
    where the package is not installed.

    >>> imported("bfloat16") in TAGS
    True
    """
    if name not in _imported:
        _imported[name] = _register(FROM_PACKAGE[name])
    return _imported[name]


def _register(row: DType) -> np.dtype | None:
    try:
        scalar = getattr(importlib.import_module(str(row.module)), row.name)
    except ImportError:
        return None
    dtype = np.dtype(scalar)
    TAGS[dtype] = row.tag
    CUDA_NAMES[dtype] = row.c_name
    _DTYPE_OF_TAG[row.tag] = dtype
    for callback in _when_registered:
        callback(dtype)
    return dtype


def bfloat16() -> np.dtype | None:
    """ml_dtypes' bfloat16 (imported now, and registered in :data:`TAGS`), or
    None where ml_dtypes is not installed.

    >>> bfloat16().name
    'bfloat16'
    """
    return imported("bfloat16")


def when_registered(callback: Callable[[np.dtype], object]) -> None:
    """Call ``callback(dtype)`` for each dtype of :data:`FROM_PACKAGE` once
    it is registered: now for those that are, later for the others (a
    native library that must know their type numbers)."""
    _when_registered.append(callback)
    for dtype in list(_imported.values()):
        if dtype is not None:
            callback(dtype)


def torch_dtype(name: str) -> torch.dtype:
    """The PyTorch dtype of a row of the table, named by its NumPy name or its
    C++ name (as ``layout.OPTIM_DTYPES`` names them). PyTorch calls each of
    them by its NumPy name. Imports torch, which nothing else here needs.

    >>> torch_dtype("bfloat16"), [torch_dtype(c) for c in ("f16", "double")]
    (torch.bfloat16, [torch.float16, torch.float64])
    """
    if name not in _NUMPY_NAME:
        raise ValueError(f"expected the NumPy or C++ name of a dtype of the table, got {name!r}")
    import torch

    return getattr(torch, _NUMPY_NAME[name])


def is_imported(dtype: npt.DTypeLike) -> bool:
    """Whether ``dtype`` is one of :data:`FROM_PACKAGE` (ml_dtypes'
    bfloat16), without importing its package.

    >>> is_imported(np.dtype(np.float16))
    False
    """
    row = FROM_PACKAGE.get(getattr(dtype, "name", ""))
    return row is not None and row.module in sys.modules and np.dtype(dtype) == imported(row.name)


def is_bfloat16(dtype: npt.DTypeLike) -> bool:
    """Whether ``dtype`` is ml_dtypes' bfloat16, without importing ml_dtypes.

    >>> is_bfloat16(np.dtype(np.float16))
    False
    """
    return getattr(dtype, "name", None) == "bfloat16" and is_imported(dtype)


def admit(dtype: npt.DTypeLike) -> bool:
    """Whether gpuflat computes on arrays of ``dtype``; one of
    :data:`FROM_PACKAGE` is registered the first time it is asked about.
    Callers test ``dtype in TAGS`` first, the fast path, and this where that
    misses."""
    return dtype in TAGS or is_imported(dtype)


def dtype_of_tag(tag: int) -> np.dtype:
    """The NumPy dtype a kernel-table tag stands for.

    >>> dtype_of_tag(2)
    dtype('float32')
    """
    if DTYPES[tag].name in FROM_PACKAGE:
        imported(DTYPES[tag].name)
    return _DTYPE_OF_TAG[tag]


def wider(dtype: npt.DTypeLike) -> np.dtype | None:
    """The dtype that sums of ``dtype`` are computed in across ranks (its
    row's ``wider``), or None: ``dtype`` itself.

    >>> wider(np.float16), wider(np.float32)
    (dtype('float32'), None)
    """
    dtype = np.dtype(dtype)
    return _WIDER.get(TAGS[dtype]) if admit(dtype) else None


def bits_dtype(itemsize: int) -> np.dtype:
    """The signed integer dtype of ``itemsize`` bytes: what a dtype of
    :data:`FROM_PACKAGE` crosses DLPack and PyTorch's ``numpy()`` as, which
    know it not.

    >>> bits_dtype(bfloat16().itemsize)
    dtype('int16')
    """
    return np.dtype(f"int{8 * itemsize}")


def c_name(dtype: npt.DTypeLike) -> str:
    """The C++ type name of ``dtype`` in kernels/.

    >>> c_name(np.float64)
    'double'
    """
    dtype = np.dtype(dtype)
    if dtype not in CUDA_NAMES:
        admit(dtype)
    return CUDA_NAMES[dtype]


def flat_dtype(dtypes: Iterable[npt.DTypeLike]) -> np.dtype:
    """The dtype of a flat buffer holding leaves of these dtypes.

    NumPy promotion, as JAX's ravel_pytree does; a dtype of
    :data:`FROM_PACKAGE` promotes with any other dtype as its row's
    ``wider`` would (bfloat16 as float32), since NumPy knows no common type
    for it and the others (bfloat16 and float16). An empty tree gives float32.

    >>> flat_dtype([np.float16, np.float32])
    dtype('float32')
    >>> flat_dtype([])
    dtype('float32')
    """
    unique = {np.dtype(d) for d in dtypes}
    if not unique:
        return np.dtype(np.float32)
    if len(unique) == 1:
        return unique.pop()
    widened = [_promoted_as(d) for d in unique]
    return np.result_type(*widened)


def _promoted_as(dtype: np.dtype) -> np.dtype:
    # A dtype with no wider row promotes as itself, as NumPy may know it.
    wide = wider(dtype) if is_imported(dtype) else None
    return dtype if wide is None else wide


def unsupported_float(dtype: npt.DTypeLike) -> str | None:
    """Why a floating dtype outside the table cannot be a leaf, or None.

    Such an array holds trainable values, so leaving it out of a norm
    silently would be wrong; it is refused by name instead. Integer, boolean
    and other non-floating dtypes give None: they are kept as statics.

    >>> unsupported_float(np.dtype(">f4"))
    "expected a native-byte-order float16, bfloat16, float32, float64, complex64 or complex128 array, got dtype '>f4' (byte-swapped): convert it with a.astype(a.dtype.newbyteorder('='))"
    >>> unsupported_float(np.dtype(np.int32)) is None
    True
    """
    dtype = np.dtype(dtype)
    if admit(dtype):
        return None
    expected = f"expected a native-byte-order {_LISTED} array"
    if dtype.kind in "fc" and not dtype.isnative:
        return (f"{expected}, got dtype '{dtype.str}' (byte-swapped): convert it with "
                f"a.astype(a.dtype.newbyteorder('='))")
    if dtype.kind in "fc" or (dtype.kind == "V" and dtype.name.startswith(("float", "bfloat"))):
        return f"{expected}, got {dtype.name}: cast it to one of these first"
    return None

def cast_copy(target: npt.NDArray[Any], source: npt.NDArray[Any]) -> None:
    """target[...] = source, rounded once into ``target``'s dtype (as the kernels round).

    >>> import ml_dtypes
    >>> out = np.empty(1, ml_dtypes.bfloat16)
    >>> cast_copy(out, np.array([1 + 2.0**-8 + 2.0**-40])); float(out[0])
    1.0078125
    """
    # Complex to real keeps the real part, as the kernels do (and without NumPy's warning).
    if source.dtype.kind == "c" and target.dtype.kind != "c":
        source = source.real
    if target.dtype.itemsize == 2 and source.dtype == np.float64:
        source = _float32_rounded_to_odd(source)
    # Past a 16-bit dtype's range the value becomes inf, as in the kernels, silently.
    with np.errstate(over="ignore"):
        np.copyto(target, source, casting="unsafe")


def _float32_rounded_to_odd(x: npt.NDArray[np.float64]) -> npt.NDArray[np.float32]:
    """``x`` (float64) rounded to float32 towards the neighbour whose last bit is odd.

    ml_dtypes converts float64 to bfloat16 through float32, rounding twice.
    Rounding to odd first keeps the sticky information of the dropped bits
    in float32's last bit, so the second rounding (to nearest even, into 16
    bits) gives the correctly rounded result, as the kernels' one rounding
    does (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums:
    proved algorithms using rounding to odd",
    https://doi.org/10.1109/TC.2007.70819).

    >>> _float32_rounded_to_odd(np.array([1.0, 1 + 2.0**-40, 1e300]))
    array([1.0000000e+00, 1.0000001e+00, 3.4028235e+38], dtype=float32)
    """
    with np.errstate(over="ignore", invalid="ignore"):
        nearest = np.asarray(x, np.float32)
        inexact = (nearest.astype(np.float64) != x) & ~np.isnan(x)
    even = inexact & ((nearest.view(np.uint32) & 1) == 0)
    if even.any():
        toward = np.where(nearest[even] < x[even], np.float32(np.inf), np.float32(-np.inf))
        nearest[even] = np.nextafter(nearest[even], toward)
    return nearest
