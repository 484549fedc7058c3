"""Backends: the same whole-tree operations over NumPy ("numpy"), CuPy ("cuda")
and the CUDA kernels run on the host ("emulated")."""
from .selection import BACKEND_NAMES, get_backend
from .protocol import Backend, NormResult

__all__ = ["BACKEND_NAMES", "Backend", "NormResult", "get_backend"]
