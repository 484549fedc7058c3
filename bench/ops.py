"""The operations the benchmark times, what each moves and which floor bounds it.

Bytes moved, as the design reference counts them: flatten and scatter read
and write every element (2N bytes), a norm reads them once (N), clipping
reads them for the norm and then reads and writes them to scale (3N). Unflatten makes views in
gpuflat and copies in JAX, so it has no single floor and no bytes figure.
"""
from __future__ import annotations

OPS = (
    "flatten",
    "unflatten",
    "scatter",
    "global_norm",
    "per_leaf_norm",
    "clip",
    "resident_norm",
    "resident_clip",
)

# multiples of N, the bytes of the unique trainables
BYTES_FACTOR = {
    "flatten": 2,
    "unflatten": None,
    "scatter": 2,
    "global_norm": 1,
    "per_leaf_norm": 1,
    "clip": 3,
    "resident_norm": 1,
    "resident_clip": 3,
}

# the floor measurements whose times add up to each operation's floor
FLOOR_PARTS = {
    "flatten": ("copy",),
    "unflatten": (),
    "scatter": ("copy",),
    "global_norm": ("reduce",),
    "per_leaf_norm": ("reduce",),
    "clip": ("reduce", "copy"),
    "resident_norm": ("reduce",),
    "resident_clip": ("reduce", "copy"),
}
