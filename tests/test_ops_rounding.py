"""A float64 flat written into 16-bit leaves rounds once, the same on every backend."""
from __future__ import annotations

import numpy as np
import pytest

import gpuflat as gf

from conftest import BF16, assert_bits_equal

ONE_AND_A_BIT = 1 + 2.0**-11 + 2.0**-40  # just past float16's halfway point above 1


def _write_both_ways(leaf_dtype, values, backend):
    tree = {"w": np.zeros(len(values), leaf_dtype), "x": np.zeros(1, np.float32)}
    flat = np.array(list(values) + [0.0])
    gf.scatter(gf.plan(tree), flat, tree, backend=backend)
    _, re = gf.destructure(tree, backend=backend)
    return tree["w"], re(flat)["w"], gf.unflatten(gf.plan(tree), flat, backend=backend)["w"]


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=["float16", "bfloat16"])
def test_scatter_and_re_round_float64_once(dtype, backend):
    rng = np.random.default_rng(1)
    values = np.concatenate([[ONE_AND_A_BIT, 1 + 2.0**-8 + 2.0**-40, 1 + 2.0**-8, 1 + 2.0**-9,
                              3 * 2.0**-26, 2.0**-25 + 2.0**-60],
                             rng.standard_normal(3000) * np.exp2(rng.integers(-30, 30, 3000))])
    # NumPy converts float64 to float16 directly, in one correct rounding: the reference.
    with np.errstate(over="ignore", invalid="ignore"):  # the reference overflows as it should
        ref = values.astype(np.float16) if dtype == np.float16 else _nearest_bf16(values)
    specials = np.array([1e300, -1e300, -1e-300, np.nan, np.inf])
    values = np.concatenate([values, specials])
    ref = np.concatenate([ref, np.array([np.inf, -np.inf, -0.0, np.nan, np.inf], dtype)])
    scattered, rebuilt, unflattened = _write_both_ways(dtype, values, backend)
    assert_bits_equal(scattered, ref)
    assert_bits_equal(rebuilt, ref)
    assert_bits_equal(unflattened, ref)


def _nearest_bf16(x):
    """Correctly rounded float64 -> bfloat16 (ties to even) of finite values in range:
    the nearer of the two neighbours in the table of every finite bfloat16."""
    table = np.arange(1 << 16, dtype=np.uint16).view(BF16)
    with np.errstate(invalid="ignore"):  # the table holds NaN bit patterns
        table = table.astype(np.float64)
    table = np.unique(table[np.isfinite(table)])
    above = np.searchsorted(table, x).clip(1, len(table) - 1)
    lo, hi = table[above - 1], table[above]
    d_lo, d_hi = x - lo, hi - x  # exact: each is below one bfloat16 step of x
    lo_even = lo.astype(BF16).view(np.uint16) % 2 == 0
    return np.where((d_hi < d_lo) | ((d_hi == d_lo) & ~lo_even), hi, lo).astype(BF16)


def test_three_tied_bf16_gradients_flatten_the_same_on_every_backend(backend):
    w = np.zeros(1, BF16)
    model = {"a": w, "b": w, "c": w}
    grads = {k: np.array([v], BF16) for k, v in zip("abc", (1.0, 2.0**-8, 2.0**-40))}
    got = gf.flatten(gf.plan(model), grads, backend=backend)
    assert_bits_equal(got, np.array([1.0078125], BF16))
