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
