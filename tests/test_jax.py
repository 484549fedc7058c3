"""JAX arrays: read-only zero-copy views, tracers refused, results handed back as JAX arrays."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import DTYPES, DTYPE_IDS, random_array
from gpuflat._src.arrays import UnsupportedLeafError, adopt, kind, to_caller

SHAPES = [(), (0,), (3,), (2, 0), (3, 4)]


@pytest.fixture(autouse=True)
def x64():
    # float64 and complex128 leaves exist only with 64-bit types enabled.
    with jax.enable_x64(True):
        yield


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_cpu_array_is_a_read_only_zero_copy_view(dtype, shape):
    source = random_array(np.random.default_rng(0), shape, dtype)
    x = jnp.asarray(source)
    assert x.dtype == dtype
    view = adopt(x)
    assert type(view) is np.ndarray and kind(x) == "jax"
    assert view.dtype == dtype and view.shape == shape
    np.testing.assert_array_equal(view, source)
    assert not view.flags.writeable
    if x.size:
        assert view.ctypes.data == x.unsafe_buffer_pointer()
        with pytest.raises(ValueError, match="read-only"):
            view[(0,) * view.ndim] = 1


def test_nonfinite_values_survive():
    x = jnp.asarray([np.nan, np.inf, -np.inf, 1.0], jnp.float32)
    np.testing.assert_array_equal(adopt(x), [np.nan, np.inf, -np.inf, 1.0])


@pytest.mark.parametrize("transform", [
    lambda f: jax.jit(f),
    lambda f: jax.grad(lambda x: (f(x), x.sum())[1]),
    lambda f: jax.vmap(f),
], ids=["jit", "grad", "vmap"])
def test_tracers_are_refused(transform):
    def call_adopt(x):
        with pytest.raises(UnsupportedLeafError, match="inside jax.jit.*not supported"):
            adopt(x)
        return x

    transform(call_adopt)(jnp.ones(3))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_to_caller_gives_a_jax_array_on_likes_device(dtype):
    result = random_array(np.random.default_rng(1), (2, 3), dtype)
    like = jnp.zeros(1)
    back = to_caller(result, like)
    assert isinstance(back, jax.Array) and back.dtype == dtype
    assert back.device == like.device
    np.testing.assert_array_equal(np.asarray(back), result)


def test_to_caller_keeps_a_0d_norm_0d():
    back = to_caller(np.asarray(5.0), jnp.zeros(3, jnp.float16))
    assert back.shape == () and back.dtype == np.float64 and float(back) == 5.0


# ---------------------------------------------------------------- trees of JAX arrays

import gpuflat as gf  # noqa: E402

from conftest import exact_norm, rel_err  # noqa: E402


def _jax_tree():
    rng = np.random.default_rng(5)
    w = jnp.asarray(rng.standard_normal((3, 4)).astype(np.float32))
    return {"w": w, "b": jnp.asarray(rng.standard_normal(4)), "tied": w, "act": "relu"}, rng


def test_read_only_operations_take_jax_trees_and_answer_in_jax():
    tree, _ = _jax_tree()
    unique = [np.asarray(tree["w"]), np.asarray(tree["b"])]
    norm = gf.global_norm(tree)
    assert isinstance(norm, jax.Array) and norm.shape == () and norm.dtype == jnp.float64
    assert rel_err(norm, exact_norm(unique)) < 1e-12
    assert [p for p, _ in gf.trainables(tree, path=True)] == ["['w']", "['b']"]
    assert gf.trainables(tree)[0] is tree["w"]  # the caller's own arrays
    assert rel_err(gf.total("l1", tree), exact_norm(unique, 1)) < 1e-12
    flat, re = gf.destructure(tree)
    assert isinstance(flat, jax.Array) and flat.shape == (16,)
    rebuilt = re(flat * 2)
    assert isinstance(rebuilt["w"], jax.Array) and rebuilt["w"] is rebuilt["tied"]
    np.testing.assert_array_equal(np.asarray(rebuilt["b"]), 2 * unique[1])


def test_clip_by_global_norm_returns_new_jax_arrays_and_leaves_the_input():
    tree, _ = _jax_tree()
    before = {k: np.array(v) for k, v in tree.items() if k != "act"}
    clipped, norm = gf.clip_by_global_norm(tree, 0.5)
    assert isinstance(clipped["w"], jax.Array) and clipped["w"] is clipped["tied"]
    for k, v in before.items():
        np.testing.assert_array_equal(np.asarray(tree[k]), v)
    coef = 0.5 / (float(norm) + 1e-6)
    np.testing.assert_allclose(np.asarray(clipped["b"]), before["b"] * coef, rtol=1e-15)


def test_in_place_operations_refuse_jax_arrays_naming_the_leaf():
    tree, _ = _jax_tree()
    with pytest.raises(ValueError, match=r"\['w'\].*read-only"):
        gf.clip_grad_norm_(tree, 0.1)


def test_calls_inside_jit_are_refused_clearly():
    @jax.jit
    def step(x):
        return gf.global_norm({"x": x})

    with pytest.raises(TypeError, match=r"\['x'\].*jax.jit"):
        step(jnp.ones(3))


# ---------------------------------------------------------------- result dtypes with jax_enable_x64 off

from gpuflat._src.arrays import Float32OverflowError  # noqa: E402


def test_x64_off_a_norm_past_float32_raises_instead_of_becoming_inf():
    with jax.enable_x64(False):
        tree = {"w": jnp.full(4, 3e38, jnp.float32)}
        with pytest.raises(Float32OverflowError, match="jax_enable_x64") as info:
            gf.global_norm(tree)
        assert isinstance(info.value, OverflowError)
        with pytest.raises(Float32OverflowError):
            gf.global_norm(tree, per_leaf=True)
    with jax.enable_x64(True):
        norm = gf.global_norm(tree)
    assert norm.dtype == jnp.float64 and rel_err(norm, exact_norm([np.full(4, np.float32(3e38))])) < 1e-15


@pytest.mark.parametrize("values, expected", [
    ([3.0, 4.0], 5.0),
    ([3e38], 3e38),  # the float64 norm rounds to float32's largest finite values: no error
    ([np.inf, 1.0], np.inf),  # a norm that is inf in float64 stays inf
], ids=["small", "at the edge", "inf"])
def test_x64_off_norms_are_float32_jax_arrays(values, expected):
    with jax.enable_x64(False):
        norm, per = gf.global_norm({"w": jnp.asarray(values, jnp.float32)}, per_leaf=True)
    assert isinstance(norm, jax.Array) and norm.dtype == per.dtype == jnp.float32
    ref = np.float32(np.linalg.norm(np.asarray(values, np.float64)))
    assert np.asarray(norm) == ref == np.float32(expected) and np.asarray(per)[0] == ref


def test_x64_off_any_64_bit_result_that_overflows_float32_is_refused():
    with jax.enable_x64(False):
        like = jnp.zeros(1)
        with pytest.raises(Float32OverflowError, match="complex64"):
            to_caller(np.array([1.0, 1e39 + 0j]), like)
        back = to_caller(np.array([1.5, -2.0]), like)
        assert back.dtype == jnp.float32 and np.asarray(back).tolist() == [1.5, -2.0]
        tree = {"w": jnp.ones(2, jnp.float32), "big": np.array([1e300])}
        with pytest.raises(Float32OverflowError, match="1e\\+300"):
            gf.flatten(gf.plan(tree), tree)
