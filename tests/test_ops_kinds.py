"""Trees mixing array kinds: every rebuilt leaf comes back in its own kind;
results standing for the whole tree (norms) in the first foreign kind."""
from __future__ import annotations

import numpy as np
import pytest

import gpuflat as gf

torch = pytest.importorskip("torch")
jnp = pytest.importorskip("jax.numpy")
jax = pytest.importorskip("jax")


def _mixed():
    return {"np": np.array([3.0, 0.0], np.float32), "t": torch.tensor([4.0]), "jax": jnp.array([12.0])}


def _as_numpy(tree):
    return {k: np.asarray(v, np.float64) for k, v in tree.items()}


def test_clip_by_global_norm_keeps_each_leafs_kind(backend):
    tree = _mixed()
    clipped, norm = gf.clip_by_global_norm(tree, 1.0, backend=backend)
    assert {k: isinstance(v, t) for (k, v), t in zip(
        clipped.items(), (np.ndarray, torch.Tensor, jax.Array))} == {"np": True, "t": True, "jax": True}
    assert clipped["np"].dtype == np.float32
    # Independent float64 reference: 13 is the norm, each value scaled by 1 / (13 + eps).
    ref = {k: v * (1.0 / (13.0 + 1e-6)) for k, v in _as_numpy(tree).items()}
    for k, v in _as_numpy(clipped).items():
        np.testing.assert_allclose(v, ref[k], rtol=1e-6)
    # The norm keeps the first foreign kind (here torch).
    assert isinstance(norm, torch.Tensor) and float(norm) == 13.0


def test_numpy_and_jax_tree_keeps_numpy_leaves_numpy(backend):
    tree = {"np": np.array([3.0]), "jax": jnp.array([4.0])}
    clipped, norm = gf.clip_by_global_norm(tree, 10.0, backend=backend)
    assert type(clipped["np"]) is np.ndarray and isinstance(clipped["jax"], jax.Array)
    assert isinstance(norm, jax.Array) and float(norm) == 5.0


def test_re_rebuilds_each_leaf_in_its_own_kind(backend):
    tree = _mixed()
    flat, re = gf.destructure(tree, backend=backend)
    rebuilt = re(np.arange(4.0))
    assert type(rebuilt["np"]) is np.ndarray
    assert isinstance(rebuilt["t"], torch.Tensor) and rebuilt["t"].dtype == torch.float32
    assert isinstance(rebuilt["jax"], jax.Array)
    np.testing.assert_array_equal(np.concatenate(list(_as_numpy(rebuilt).values())), np.arange(4.0))
