"""Backends: the same whole-tree operations over NumPy ("numpy"), CuPy ("cuda")
and the CUDA kernels run on the host ("emulated")."""
from .base import BACKEND_NAMES, NormResult, get_backend

__all__ = ["BACKEND_NAMES", "NormResult", "get_backend"]
