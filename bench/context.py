"""Everything one workload in one dtype needs while its cases run (#4).

The context owns the model tree, one flat buffer shared by every flatten
implementation, and (where every leaf has the flat dtype) a second buffer the
model lives in for the resident pattern. With GPT-2 small at 500 MB a copy,
that bounds the live copies: tree, flat buffer, resident buffer, plus what a
peer allocates while it runs (#4).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

import gpuflat

from . import arrays
from .workloads import HostWorkload

# Relative error above which a result counts as wrong, by the dtype the peers
# compute in. Loose on purpose: it catches a broken implementation, not the
# float32 accumulation error of a peer (PyTorch's CPU norms of GPT-2's 38M-element
# embedding are off by about 1e-3, pytorch #186881), which is reported as a
# figure of its own (#4).
WRONG_ABOVE = {"float32": 1e-2, "float16": 2e-2, "bfloat16": 5e-2, "mixed": 2e-2}


@dataclass
class Device:
    """Where a run happens: the array module, gpuflat's backend name, the timer."""

    name: str  # "cpu" or "cuda"
    xp: object
    backend: str
    timer: object

    def put(self, host_array):
        return host_array if self.xp is np else self.xp.asarray(host_array)


@dataclass
class Context:
    workload: str
    dtype: str
    device: Device
    tree: object
    leaves: list
    plan: object
    out: object
    resident_buf: object
    ref_norm: float
    ref_per_leaf: np.ndarray
    max_norm: float
    nbytes: int
    resident_tree: object = None
    resident_leaves: list = None
    cache: dict = field(default_factory=dict)

    @property
    def xp(self):
        return self.device.xp

    @property
    def rtol(self) -> float:
        return WRONG_ABOVE[self.dtype]

    @property
    def offsets(self) -> list:
        return [int(o) for o in self.plan.offsets]

    def expected(self, op: str) -> np.ndarray:
        """What a correct run of ``op`` reports (see ``Case.value``)."""
        if op == "per_leaf_norm":
            return self.ref_per_leaf
        if op in ("clip", "resident_clip"):
            # after the untimed warm-up call the model's norm is max_norm
            return np.array([self.max_norm])
        return np.array([self.ref_norm])

    def prepare(self, op: str) -> None:
        """Make the resident model right before its cases: gpuflat remembers only the
        latest unflatten of a plan, and the unflatten cases make others (#4)."""
        if op in ("resident_norm", "resident_clip") and self.resident_buf is not None:
            self.resident_tree = self.plan.unflatten(self.resident_buf)
            self.resident_leaves = gpuflat.trainables(self.resident_tree)
            self.cache.pop("resident", None)


def _to_device(tree, device: Device, memo: dict):
    """The same tree with every array moved, ties kept (one copy per array object)."""
    if isinstance(tree, dict):
        return {k: _to_device(v, device, memo) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_device(v, device, memo) for v in tree]
    if isinstance(tree, np.ndarray):
        if id(tree) not in memo:
            memo[id(tree)] = device.put(tree)
        return memo[id(tree)]
    return tree


def build(host: HostWorkload, device: Device) -> Context:
    per_leaf = np.sqrt([arrays.sumsq(a) for a in host.leaves])
    ref = float(np.sqrt(np.sum(per_leaf**2)))
    memo: dict = {}
    tree = _to_device(host.tree, device, memo)
    leaves = [memo[id(a)] for a in host.leaves]
    plan = gpuflat.plan(tree)
    out = device.xp.empty(plan.size, plan.dtype)
    plan.flatten(tree, out=out, backend=device.backend)
    same_dtype = all(leaf.dtype == plan.dtype for leaf in plan.leaves)
    return Context(
        workload=host.name,
        dtype=host.dtype,
        device=device,
        tree=tree,
        leaves=leaves,
        plan=plan,
        out=out,
        # a model lives in one buffer as views only if every leaf has its dtype
        resident_buf=out.copy() if same_dtype else None,
        ref_norm=ref,
        ref_per_leaf=per_leaf,
        max_norm=0.5 * ref,  # clipping really scales on the first call
        nbytes=host.nbytes,
    )
