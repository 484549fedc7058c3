"""The one list of dtypes gpuflat handles, and their tags in the kernel tables.

Every module that needs to know which dtypes are trainable, how a dtype is
called in the CUDA sources, or which integer tag marks it in a device table,
reads it from here, so adding a dtype is a one-line change.
"""
from __future__ import annotations

import numpy as np

try:  # bfloat16 is optional: NumPy has none, ml_dtypes provides one.
    from ml_dtypes import bfloat16 as _bfloat16
except ImportError:  # pragma: no cover - ml_dtypes is a test dependency
    _bfloat16 = None

BFLOAT16 = np.dtype(_bfloat16) if _bfloat16 is not None else None

# (numpy dtype, tag in the kernel tables, C++ type name in kernels/)
_TABLE = [
    (np.dtype(np.float16), 0, "f16"),
    (BFLOAT16, 1, "bf16"),
    (np.dtype(np.float32), 2, "float"),
    (np.dtype(np.float64), 3, "double"),
    (np.dtype(np.complex64), 4, "c64"),
    (np.dtype(np.complex128), 5, "c128"),
]
TAGS = {dt: tag for dt, tag, _ in _TABLE if dt is not None}
CUDA_NAMES = {dt: name for dt, _, name in _TABLE if dt is not None}


def flat_dtype(dtypes) -> np.dtype:
    """The dtype of a flat buffer holding leaves of these dtypes.

    NumPy promotion, as JAX's ravel_pytree does; bfloat16 promotes with any
    other dtype as float32 would, since NumPy knows no common type for it and
    float16. An empty tree gives float32.

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
    widened = [np.dtype(np.float32) if d == BFLOAT16 else d for d in unique]
    return np.result_type(*widened)


def unsupported_float(dtype) -> str | None:
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
    if dtype in TAGS:
        return None
    expected = ("expected a native-byte-order float16, bfloat16, float32, float64, complex64 or "
                "complex128 array")
    if dtype.kind in "fc" and not dtype.isnative:
        return (f"{expected}, got dtype '{dtype.str}' (byte-swapped): convert it with "
                f"a.astype(a.dtype.newbyteorder('='))")
    if dtype.kind in "fc" or (dtype.kind == "V" and dtype.name.startswith(("float", "bfloat"))):
        return f"{expected}, got {dtype.name}: cast it to one of these first"
    return None
