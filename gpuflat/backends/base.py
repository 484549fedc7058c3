"""What every backend returns, and how a backend is chosen for a call."""
from __future__ import annotations

import math
import sys
import threading


BACKEND_NAMES = ("numpy", "cuda", "emulated")


def check_ord(ord) -> float:
    """The norm order as a float: 1, 2, inf or any p > 0; else ValueError.

    >>> check_ord(2), check_ord(float("inf"))
    (2.0, inf)
    """
    try:
        p = float(ord)
    except (TypeError, ValueError):
        p = math.nan
    if isinstance(ord, bool) or not (p > 0):
        raise ValueError(f"ord: expected 1, 2, inf or a number p > 0, got {ord!r}")
    return p


_backends: dict = {}
_lock = threading.Lock()


def get_backend(name: str):
    """The backend instance called ``name`` ("numpy", "cuda" or "emulated").

    >>> get_backend("numpy").name
    'numpy'
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend: expected one of {BACKEND_NAMES}, got {name!r}")
    with _lock:
        if name not in _backends:
            _backends[name] = _make(name)
        return _backends[name]


def _make(name):
    if name == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    from .cuda import CudaBackend
    from ..runtime import CupyRuntime, EmulatedRuntime

    return CudaBackend(EmulatedRuntime() if name == "emulated" else CupyRuntime())


def _is_cupy(x) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def select(backend, arrays, path_of):
    """The backend for a call on ``arrays``; ``path_of(i)`` names the i-th (only on error).

    The default follows the arrays: NumPy arrays take "numpy", CuPy arrays
    "cuda". A mix raises, naming one leaf of each; so does a backend that
    cannot reach the arrays' memory.
    """
    on_gpu = list(map(_is_cupy, arrays)) if "cupy" in sys.modules else [False] * len(arrays)
    first_cupy = on_gpu.index(True) if True in on_gpu else None
    first_numpy = on_gpu.index(False) if False in on_gpu else None
    if first_numpy is not None and first_cupy is not None:
        raise TypeError(
            f"tree mixes NumPy and CuPy arrays: leaf {path_of(first_numpy)!r} is a NumPy array, "
            f"leaf {path_of(first_cupy)!r} is a CuPy array"
        )
    name = backend or ("cuda" if first_cupy is not None else "numpy")
    wants_cupy = name == "cuda"
    wrong = first_numpy if wants_cupy else first_cupy
    if wrong is not None:
        kind = "CuPy" if wants_cupy else "NumPy"
        raise TypeError(
            f"backend {name!r} works on {kind} arrays; leaf {path_of(wrong)!r} is a "
            f"{type(arrays[wrong]).__module__}.{type(arrays[wrong]).__name__}"
        )
    return get_backend(name)
