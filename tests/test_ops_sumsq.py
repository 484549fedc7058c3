"""NormResult.power_sum, the unrooted total of a norm pass, on every backend
that runs without a GPU."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpuflat as gf
from gpuflat.backends import get_backend

from conftest import exact_norm, rel_err, random_array


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
