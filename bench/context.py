"""Everything one workload in one dtype needs while its cases run.

The context owns the model tree, one flat buffer shared by every flatten
implementation, and, from the first resident operation (the last ones
run), one ``gf.resident`` model per gpuflat backend (parameter and gradient
buffers, one pair per dtype). With GPT-2 small at 500 MB a copy, that bounds
the live copies: tree, flat buffer, two per resident model (PyTorch's rows
add one more model), plus what a peer allocates while it runs; all go with
the context when the workload and dtype are done.
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
# embedding are off by about 1e-3, https://github.com/pytorch/pytorch/issues/186881),
# which is reported as a figure of its own.
WRONG_ABOVE = {"float32": 1e-2, "float16": 2e-2, "bfloat16": 5e-2, "mixed": 2e-2}


@dataclass
class Device:
    """Where a run happens: the array module, gpuflat's backends to time, the timer."""

    name: str  # "cpu" or "cuda"
    xp: object
    backends: tuple  # gpuflat backend names, each timed as its own row
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
    ref_norm: float
    ref_per_leaf: np.ndarray
    max_norm: float
    nbytes: int
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
        """What a correct run of ``op`` reports (see ``Case.value``): a clip
        reports the norm it met, the built one, as every call starts from
        the built gradients (:meth:`restore`)."""
        if op == "per_leaf_norm":
            return self.ref_per_leaf
        return np.array([self.ref_norm])

    @property
    def clip_coef(self) -> float:
        """The factor a clip of the built gradients scales them by (PyTorch's formula)."""
        return min(self.max_norm / (self.ref_norm + 1e-6), 1.0)

    def restore(self, op: str):
        """What puts back, untimed, the gradients a call of ``op`` scales
        (None for the other operations), so every timed clip meets the built
        norm, twice ``max_norm``, and really scales.

        A tree clip scales the tree's leaves (and the PyTorch tensors sharing
        them): the flat buffer, which holds the built values, is scattered
        back. A resident clip scales resident gradient buffers: each is
        copied back from the copy :meth:`keep_grads` took.
        """
        if op == "clip":
            return lambda: gpuflat.scatter(self.plan, self.out, self.tree, backend=self.device.backends[0])
        if op == "resident_clip":
            return lambda: [arrays.copy_into(buffer, saved) for buffer, saved in self.cache["saved grads"]]
        return None

    def keep_grads(self, r):
        """Keeps a copy of resident model ``r``'s gradient buffers, for :meth:`restore`."""
        self.cache.setdefault("saved grads", []).extend((b, arrays.copy_of(b)) for b in r.grad_buffers)

    def resident(self, backend: str):
        """The model resident in flat buffers for ``backend`` (``gf.resident``), its
        gradient views holding the workload's values; built on first use."""
        key = ("resident", backend)
        if key not in self.cache:
            r = gpuflat.resident(self.tree, backend=backend)
            for grad, value in zip(gpuflat.trainables(r.grads), self.built_values()):
                grad[...] = value
            self.keep_grads(r)
            self.cache[key] = r
        return self.cache[key]

    def built_values(self) -> list:
        """The trainables' values as the workload built them, in plan order.

        Read from the flat buffer: the clip cases have scaled the tree itself
        by then, while every operation before the resident ones (OPS order)
        either writes the built values into the buffer or leaves it alone.
        """
        return gpuflat.trainables(gpuflat.unflatten(self.plan, self.out))

    @property
    def resident_grads(self) -> list:
        """The gradient views of the first backend's resident model, which the
        peers' resident rows work on."""
        if "resident grads" not in self.cache:
            r = self.resident(self.device.backends[0])
            self.cache["resident grads"] = gpuflat.trainables(r.grads)
        return self.cache["resident grads"]


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
    gpuflat.flatten(plan, tree, out=out, backend=device.backends[0])
    return Context(
        workload=host.name,
        dtype=host.dtype,
        device=device,
        tree=tree,
        leaves=leaves,
        plan=plan,
        out=out,
        ref_norm=ref,
        ref_per_leaf=per_leaf,
        max_norm=0.5 * ref,  # every timed clip meets the built norm (Context.restore) and halves it
        nbytes=host.nbytes,
    )
