"""total("sumsq") is the norm pass's own float64 sum of squares, not the
square of the rounded 2-norm, on every backend that runs without a GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src.backends import get_backend

from conftest import DTYPES, DTYPE_IDS, exact_norm, exact_sumsq, ref_unique, rel_err, random_array, strided_variant


def test_sumsq_of_three_ones_is_exactly_three(backend):
    # sqrt(3) ** 2 rounds to 2.9999999999999996: the sum must not pass through the root.
    assert float(gf.total("sumsq", {"w": np.ones(3)}, backend=backend)) == 3.0
    assert float(gf.total("sumsq", [np.ones(2, np.float32), np.ones((1, 1), np.float16)],
                          backend=backend)) == 3.0


def test_sumsq_through_a_model_adds_tied_gradients_first(backend):
    w = np.ones(3)
    model = {"a": w, "b": w, "c": np.ones(2, np.float32)}
    grads = {"a": np.full(3, 2.0), "b": np.full(3, 1.0), "c": np.ones(1, np.float32)[[0, 0]]}
    # (2 + 1)**2 * 3 + 1 + 1, exact: the tie's gradients are added before squaring.
    assert float(gf.total("sumsq", grads, model=model, backend=backend)) == 29.0


def _tree(rng, dtype):
    t = strided_variant(rng, (3, 4), dtype, "transposed")
    return {
        "t": t, "tie": t, "r": strided_variant(rng, (5,), dtype, "reversed"),
        "c": random_array(rng, (7, 3), dtype), "s": random_array(rng, (), dtype),
        "e": random_array(rng, (0, 2), dtype), "step": 4,
    }


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sumsq_against_an_exact_sum_of_squares(dtype, seed, backend):
    rng = np.random.default_rng(seed)
    tree = _tree(rng, dtype)
    leaves = [a for _, a in ref_unique(tree)]
    got = gf.total("sumsq", tree, backend=backend)
    assert np.asarray(got).dtype == np.float64
    assert rel_err(got, exact_sumsq(leaves)) < 1e-15


@pytest.mark.parametrize("ord", [1.0, 2.0, 3.0, math.inf])
def test_power_sum_is_what_the_total_is_the_root_of(ord, backend):
    rng = np.random.default_rng(7)
    leaves = [random_array(rng, (40,), np.float32), random_array(rng, (3, 5), np.float64)]
    r = get_backend(backend).norms(gf.plan(leaves), leaves, ord, per_leaf=False)
    raw, total = float(r.power_sum), float(r.total)
    assert np.asarray(r.power_sum).shape == () and np.asarray(r.power_sum).dtype == np.float64
    assert rel_err(raw, exact_norm(leaves, ord) ** ord if ord != math.inf else exact_norm(leaves, ord)) < 1e-15
    if ord in (1.0, math.inf):
        assert raw == total
    elif ord == 2.0:
        assert total == math.sqrt(raw)
    # The norm itself keeps its bits whether or not anyone reads power_sum.
    assert total == float(gf.global_norm(leaves, ord, backend=backend))
