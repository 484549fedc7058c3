"""Buffers the tree operations write into: ``flatten(out=)`` and ``scatter``'s
flat are refused when immutable, read-only or aliasing a leaf, and nothing
is written; ``flatten(out=)`` returns the caller's own object."""
from __future__ import annotations

import numpy as np
import pytest

import gpuflat as gf

from conftest import ref_flatten, snapshot


def _tree():
    return {"a": np.arange(3.0), "b": np.full((2, 2), 2.0).T}


def test_flatten_refuses_a_read_only_out_and_writes_nothing(backend):
    tree = _tree()
    out = np.full(7, -1.0)
    out.flags.writeable = False
    with pytest.raises(gf.TreeMismatchError, match="out: expected a writable array, got a read-only one"):
        gf.flatten(gf.plan(tree), tree, out=out, backend=backend)
    assert out.tolist() == [-1.0] * 7


def test_flatten_refuses_a_jax_out_and_writes_nothing(backend):
    jnp = pytest.importorskip("jax.numpy")
    tree = _tree()
    out = jnp.full(7, -1.0, dtype=jnp.float32)
    tree32 = {k: v.astype(np.float32) for k, v in tree.items()}
    with pytest.raises(gf.TreeMismatchError, match="out: expected a writable array, got a JAX array"):
        gf.flatten(gf.plan(tree32), tree32, out=out, backend=backend)
    assert np.asarray(out).tolist() == [-1.0] * 7


def test_flatten_returns_the_callers_torch_out(backend):
    torch = pytest.importorskip("torch")
    tree = _tree()
    out = torch.full((7,), -1.0, dtype=torch.float64)
    got = gf.flatten(gf.plan(tree), tree, out=out, backend=backend)
    assert got is out
    np.testing.assert_array_equal(out.numpy(), ref_flatten(tree))


@pytest.mark.parametrize("alias", ["reversed", "same", "strided"])
def test_flatten_refuses_an_out_aliasing_a_leaf(alias, backend):
    s = np.arange(5.0)
    leaf = {"reversed": s[::-1], "same": s, "strided": s[::2]}[alias]
    tree = {"x": np.ones(5 - leaf.size), "s": leaf} if leaf.size < 5 else {"s": leaf}
    before = snapshot(tree)
    with pytest.raises(gf.OverlapError, match=r"leaf \"\['s'\]\" and out share memory"):
        gf.flatten(gf.plan(tree), tree, out=s, backend=backend)
    assert snapshot(tree) == before


def test_scatter_refuses_a_flat_aliasing_a_leaf(backend):
    s = np.arange(4.0)
    tree = {"w": np.zeros(1), "s": s[:3][::-1]}
    flat = s
    before = snapshot(tree)
    with pytest.raises(gf.OverlapError, match=r"leaf \"\['s'\]\" and flat share memory"):
        gf.scatter(gf.plan(tree), flat, tree, backend=backend)
    assert snapshot(tree) == before


def test_flatten_and_scatter_take_buffers_apart_from_the_leaves(backend):
    storage = np.arange(10.0)
    tree = {"a": storage[:3], "b": storage[3:5][::-1]}
    out = np.empty(5)
    gf.flatten(gf.plan(tree), tree, out=out, backend=backend)
    np.testing.assert_array_equal(out, [0, 1, 2, 4, 3])
    gf.scatter(gf.plan(tree), storage[5:] * 1.0, tree, backend=backend)
    np.testing.assert_array_equal(storage[:5], [5, 6, 7, 9, 8])
