"""gpuflat: a model's parameter tree as one contiguous buffer.

Walk the tree once, cache an offset plan, and do every whole-tree operation
(flatten, scatter, norms, clipping) in a few kernel launches on a GPU, or with
NumPy on the host.

>>> import numpy as np, gpuflat as gf
>>> grads = {"w": np.array([3.0, 4.0]), "b": np.zeros(2, np.float32)}
>>> float(gf.clip_grad_norm_(grads, max_norm=1.0))
5.0
"""
from .errors import NonFiniteError, OverlapError, TreeMismatchError
from .ops import clip_grad_norm_, destructure, global_norm, total, trainables
from .plan import FlatPlan, LeafSpec, plan, plan_cache_clear, plan_cache_info
from .tree import register

__all__ = [
    "FlatPlan",
    "LeafSpec",
    "NonFiniteError",
    "OverlapError",
    "TreeMismatchError",
    "clip_grad_norm_",
    "destructure",
    "global_norm",
    "plan",
    "plan_cache_clear",
    "plan_cache_info",
    "register",
    "total",
    "trainables",
]
__version__ = "0.1.0"
