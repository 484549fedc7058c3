"""Deprecated alias: ``gpuflat.backends.base`` was renamed ``gpuflat.backends.selection`` in 0.4.0.

Importing it warns; its names are the new module's.
"""
import warnings

from . import selection as _moved

warnings.warn("gpuflat.backends.base is deprecated; import gpuflat.backends.selection", DeprecationWarning, stacklevel=2)


def __getattr__(name):
    return getattr(_moved, name)
