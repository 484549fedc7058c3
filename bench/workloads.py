"""Parameter trees shaped like real models, built from bench/workloads.json.

Names such as ``h.0.attn.c_attn.weight`` or ``blocks[1].w`` become nested
containers (numeric parts and ``[i]`` become list items), so gpuflat walks a
tree like the ones users hand it, not a flat list.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DEFAULT_FILE = Path(__file__).with_name("workloads.json")
DTYPE_LABELS = ("float32", "float16", "bfloat16")
_TIED = re.compile(r"tied to (\S+)")
_INIT_STD = 0.02  # GPT-2's weight init scale: realistic magnitudes, no fp16 overflow


@dataclass
class HostWorkload:
    """A host tree plus its unique trainable leaves in tree order (ties once)."""

    name: str
    dtype: str  # "float32", "float16", "bfloat16" or "mixed"
    tree: object
    leaves: list = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.leaves)


def load(path=DEFAULT_FILE) -> dict:
    with open(path) as f:
        return json.load(f)


def numpy_dtype(label: str) -> np.dtype:
    if label == "bfloat16":
        import ml_dtypes  # NumPy has no bfloat16; ml_dtypes adds one

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(label)


def dtypes_for(spec: dict, wanted) -> list:
    """The dtype labels to run: a tree with its own dtypes runs once, as "mixed"."""
    return ["mixed"] if "dtypes" in spec else [d for d in wanted if d in DTYPE_LABELS]


def _param_list(spec: dict) -> list:
    if "repeat" in spec:
        r = spec["repeat"]
        return [[r["name"].format(i=i), r["shape"]] for i in range(r["count"])]
    return spec["params"]


def _parts(name: str) -> list:
    """``blocks[1].w`` -> ["blocks", 1, "w"]; ``h.0.ln_1`` -> ["h", 0, "ln_1"]."""
    out = []
    for token in name.replace("]", "").replace("[", ".").split("."):
        out.append(int(token) if token.isdigit() else token)
    return out


def _insert(tree: dict, name: str, value) -> None:
    parts, node = _parts(name), tree
    for here, nxt in zip(parts, parts[1:]):
        fresh = [] if isinstance(nxt, int) else {}
        if isinstance(node, list):
            while len(node) <= here:
                node.append(None)
            node[here] = fresh if node[here] is None else node[here]
            node = node[here]
        else:
            node = node.setdefault(here, fresh)
    last = parts[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


def _random(rng, shape, dtype: np.dtype) -> np.ndarray:
    # Drawn in float32 and cast, one leaf at a time, so no float64 copy of a
    # 124M-element model ever exists.
    a = rng.standard_normal(math.prod(shape), dtype=np.float32)
    a *= _INIT_STD
    return a.astype(dtype, copy=False).reshape(shape)


def build(name: str, spec: dict, label: str, seed: int = 0, alloc=None) -> HostWorkload:
    """The workload's tree in dtype ``label`` ("mixed" uses the spec's dtypes).

    Leaves hold random values; with ``alloc(shape, dtype)``, whatever it
    returns (e.g. ``np.empty``, for timings that never read the values).
    """
    rng = np.random.default_rng(seed)
    alloc = alloc or (lambda shape, dt: _random(rng, shape, dt))
    tree, leaves, by_name = {}, [], {}
    per_leaf = spec.get("dtypes", {})
    for pname, shape in _param_list(spec):
        tied = _TIED.match(shape) if isinstance(shape, str) else None
        if tied:
            value = by_name[tied.group(1)]  # the same object: a tie
        else:
            dt = numpy_dtype(per_leaf.get(pname, label if label != "mixed" else "float32"))
            value = by_name[pname] = alloc(shape, dt)
            leaves.append(value)
        _insert(tree, pname, value)
    for pname, (dt, shape) in spec.get("non_trainable", {}).items():
        _insert(tree, pname, np.zeros(shape, dt))  # kept, never trainable
    return HostWorkload(name=name, dtype=label, tree=tree, leaves=leaves)
