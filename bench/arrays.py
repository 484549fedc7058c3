"""Reading any library's result back as host float64 figures, for the checks.

Results come from NumPy, CuPy, PyTorch or JAX; each is brought to a NumPy
array on the host without going through float64 copies of whole models.
"""
from __future__ import annotations

import sys

import numpy as np

_CHUNK = 1 << 22  # elements per float64 pass: bounded extra memory on 124M-element models


def _library(x) -> str:
    return type(x).__module__.split(".")[0]


def _is_cupy(x) -> bool:
    """Whether ``x`` is an array of the module imported as ``cupy`` (CuPy, or
    the stand-in a dry run of the device script installs under that name)."""
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def to_numpy(x) -> np.ndarray:
    """A host NumPy array with ``x``'s values (its dtype, or float32 for torch bfloat16)."""
    lib = _library(x)
    if lib == "numpy" or isinstance(x, (float, int)):
        return np.asarray(x)
    if _is_cupy(x):
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


def copy_of(x):
    """A copy of a NumPy, CuPy or PyTorch array on its device.

    >>> copy_of(np.arange(3)).tolist()
    [0, 1, 2]
    """
    return x.clone() if _library(x) == "torch" else x.copy()


def copy_into(dest, src) -> None:
    """Copies ``src`` into ``dest`` in place (NumPy, CuPy or PyTorch, same kind).

    >>> a = np.zeros(2); copy_into(a, np.ones(2)); a.tolist()
    [1.0, 1.0]
    """
    if _library(dest) == "torch":
        dest.copy_(src)
    else:
        dest[...] = src
