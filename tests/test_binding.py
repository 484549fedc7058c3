"""Binding a call to its trees: each tree is walked once per call, whatever the arguments."""
from __future__ import annotations

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src import tree as _tree


@pytest.fixture
def walks(monkeypatch):
    """The trees walked during a call, by identity."""
    seen = []
    real = _tree.walk

    def counting(tree, *args, **kwargs):
        seen.append(id(tree))
        return real(tree, *args, **kwargs)

    monkeypatch.setattr(_tree, "walk", counting)
    return seen


def _tied():
    w = np.ones(3)
    model = {"emb": w, "head": w, "b": np.zeros(2)}
    grads = {"emb": np.full(3, 1.0), "head": np.full(3, 2.0), "b": np.full(2, 4.0)}
    return model, grads


@pytest.mark.parametrize("call", [
    lambda g, m: gf.clip_grad_norm_(g, 1.0, model=m),
    lambda g, m: gf.global_norm(g, model=m),
    lambda g, m: gf.total("sumsq", g, model=m),
    lambda g, m: gf.total(np.sum, g, model=m),
], ids=["clip_grad_norm_", "global_norm", "total", "total of a callable"])
def test_model_calls_walk_the_gradients_and_the_model_once_each(walks, call):
    model, grads = _tied()
    call(grads, model)
    assert sorted(walks) == sorted([id(grads), id(model)])


def test_the_walked_gradients_are_read_through_the_model_plan_as_a_fresh_walk_would_be():
    model, grads = _tied()
    expected = np.sqrt(3 * 3.0**2 + 2 * 4.0**2)  # the tied slot adds 1 + 2 first
    assert float(gf.global_norm(grads, model=model)) == pytest.approx(expected, rel=1e-15)
    gf.clip_grad_norm_(grads, 1.0, model=model)
    factor = 1.0 / (expected + 1e-6)
    np.testing.assert_allclose(grads["b"], 4.0 * factor, rtol=1e-15)
