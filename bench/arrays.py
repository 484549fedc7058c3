"""Reading any library's result back as host float64 figures, for the checks.

Results come from NumPy, CuPy, PyTorch or JAX; each is brought to a NumPy
array on the host without going through float64 copies of whole models.
"""
from __future__ import annotations

import numpy as np

_CHUNK = 1 << 22  # elements per float64 pass: bounded extra memory on 124M-element models


def _library(x) -> str:
    return type(x).__module__.split(".")[0]


def to_numpy(x) -> np.ndarray:
    """A host NumPy array with ``x``'s values (its dtype, or float32 for torch bfloat16)."""
    lib = _library(x)
    if lib == "numpy" or isinstance(x, (float, int)):
        return np.asarray(x)
    if lib == "cupy":
        return x.get()
    if lib == "torch":
        x = x.detach().cpu()
        return (x.float() if str(x.dtype) == "torch.bfloat16" else x).numpy()
    return np.asarray(x)  # JAX arrays and anything else with __array__


def sumsq(x) -> float:
    """Sum of squares of every element of ``x``, accumulated in float64."""
    flat = to_numpy(x).reshape(-1)
    total = 0.0
    for i in range(0, flat.size, _CHUNK):
        piece = flat[i : i + _CHUNK].astype(np.float64)
        total += float(np.dot(piece, piece))
    return total


def norm_of(arrays) -> np.ndarray:
    """The 2-norm of a list of arrays taken as one vector, as a 1-element array."""
    return np.array([np.sqrt(sum(sumsq(a) for a in arrays))])


def values(x) -> np.ndarray:
    """A scalar, a 1-D array or a list of 0-d arrays as a float64 vector."""
    if isinstance(x, (list, tuple)):
        return np.array([float(to_numpy(v).astype(np.float64)) for v in x])
    return to_numpy(x).astype(np.float64).reshape(-1)


def rel_err(got, want) -> float:
    """Largest relative error of ``got`` against ``want`` (inf if the shapes differ)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    if got.shape != want.shape:
        return float("inf")
    scale = np.maximum(np.abs(want), 1e-30)
    return float(np.max(np.abs(got - want) / scale, initial=0.0))


def norm_of_flat(flat) -> np.ndarray:
    """The 2-norm of one flat buffer, as a 1-element array."""
    return np.array([np.sqrt(sumsq(flat))])
