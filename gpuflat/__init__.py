"""gpuflat: a model's parameter tree as one contiguous buffer.

Walk the tree once, cache an offset plan, and do every whole-tree operation
(flatten, scatter, norms, clipping) in a few kernel launches on a GPU, or in
native code or NumPy on the host.

>>> import numpy as np, gpuflat as gf
>>> grads = {"w": np.array([3.0, 4.0]), "b": np.zeros(2, np.float32)}
>>> float(gf.clip_grad_norm_(grads, max_norm=1.0))
5.0
"""
from . import distributed
from ._src import public as _public
from .errors import (
    CaptureError,
    CollectiveError,
    Float32OverflowError,
    NonFiniteError,
    NonFiniteNormError,
    NonFloatingTensorError,
    OverlapError,
    StaleResidentError,
    TreeMismatchError,
    UnsupportedLeafError,
    UnwalkableError,
)
from ._src.flatplan import FlatPlan, LeafSpec
from ._src.native import native_info
from ._src.ops import (
    Restructure,
    cache_clear,
    cache_info,
    clip_by_global_norm,
    clip_grad_norm_,
    destructure,
    flatten,
    global_norm,
    plan,
    plan_cache_clear,
    plan_cache_info,
    scatter,
    total,
    trainables,
    unflatten,
)
from ._src.residency import Resident, resident
from ._src.tree import register

__all__ = [
    "CaptureError",
    "CollectiveError",
    "FlatPlan",
    "Float32OverflowError",
    "LeafSpec",
    "NonFiniteError",
    "NonFiniteNormError",
    "NonFloatingTensorError",
    "OverlapError",
    "Resident",
    "Restructure",
    "StaleResidentError",
    "TreeMismatchError",
    "UnsupportedLeafError",
    "UnwalkableError",
    "cache_clear",
    "cache_info",
    "clip_by_global_norm",
    "clip_grad_norm_",
    "destructure",
    "distributed",
    "flatten",
    "global_norm",
    "native_info",
    "plan",
    "plan_cache_clear",
    "plan_cache_info",
    "register",
    "resident",
    "scatter",
    "total",
    "trainables",
    "unflatten",
]
__version__ = "0.7.0"

__dir__ = _public.listing(__all__)
