"""The operations the benchmark times, what each moves and which floor bounds it.

Bytes moved (:func:`moved_bytes`): flatten reads the tree's N bytes and
writes its flat buffer's F, scatter the other way (N + F: 2N where every
leaf has the buffer's dtype, more for a mixed tree, whose buffer holds every
leaf in the widest dtype); a norm reads the tree once (N); clipping reads it
for the norm and then reads and writes it to scale (3N). Unflatten makes
views in gpuflat and copies in JAX, so it has no single floor and no bytes
figure.
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

# The operations that copy between the tree and its flat buffer.
TREE_AND_BUFFER = ("flatten", "scatter")
# The others, in multiples of the tree's bytes (None: no bytes figure).
TREE_READS = {"unflatten": None, "global_norm": 1, "per_leaf_norm": 1, "clip": 3, "resident_norm": 1,
              "resident_clip": 3}


def moved_bytes(op, tree_bytes, buffer_bytes):
    """The bytes ``op`` reads and writes, for a tree of ``tree_bytes`` whose
    flat buffer holds ``buffer_bytes``; None where it has no such figure.

    >>> moved_bytes("flatten", 1000, 2000), moved_bytes("clip", 1000, 2000), moved_bytes("unflatten", 1000, 2000)
    (3000, 3000, None)
    """
    if op in TREE_AND_BUFFER:
        return tree_bytes + buffer_bytes
    factor = TREE_READS[op]
    return None if factor is None else factor * tree_bytes


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
