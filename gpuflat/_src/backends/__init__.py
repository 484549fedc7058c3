"""Backends: the same whole-tree operations over NumPy ("numpy"), in native
code on the host ("host"), on CuPy arrays ("cuda") and with the CUDA kernels
run on the host ("emulated").

Front ends reach a backend through :func:`get_backend` (``selection``) and
the contract in ``protocol``, never by importing an implementation.

>>> sorted(BACKEND_NAMES)
['cuda', 'emulated', 'host', 'numpy']
"""
from .selection import BACKEND_NAMES, get_backend
from .protocol import Backend, NormResult

__all__ = ["BACKEND_NAMES", "Backend", "NormResult", "get_backend"]
