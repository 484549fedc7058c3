"""Deprecated alias: ``gpuflat.runtime`` was renamed ``gpuflat.backends.cuda_runtime`` in 0.4.0.

Importing it warns; its names are the new module's.
"""
import warnings

from .backends import cuda_runtime as _moved

warnings.warn("gpuflat.runtime is deprecated; import gpuflat.backends.cuda_runtime", DeprecationWarning, stacklevel=2)


def __getattr__(name):
    return getattr(_moved, name)
