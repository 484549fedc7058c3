"""JAX with optax: ravel_pytree, global_norm, clip_by_global_norm, all jitted.

Each function is lowered and compiled before timing and the compile time is
reported apart, so the medians are steady-state calls. Each call waits for
its result (``block_until_ready``) and is timed on the host clock: on a GPU
JAX runs its kernels on streams of its own, which CUDA events recorded on
CuPy's stream do not see (they would time nothing). JAX arrays are
immutable: there is no in-place scatter and no resident model to clip in
place, so those operations are listed as not applicable.
"""
from __future__ import annotations

import time

from .. import arrays
from ..case import Case, skipped

# XLA's compile time grows faster than linearly with the number of leaves
# (seconds at a few hundred, far longer at 10,000 on a small CPU), so larger
# trees are reported as not attempted rather than stalling the run.
MAX_LEAVES = 1000


def library_name(device) -> str:
    return "jax"


def absent(device):
    import importlib.util

    missing = [m for m in ("jax", "jaxlib", "optax") if importlib.util.find_spec(m) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (the JAX rows need jax, jaxlib and optax)"
    import jax

    want = "cpu" if device.name == "cpu" else "gpu"
    if jax.default_backend() != want:
        return f"default backend is {jax.default_backend()}, not {want}"
    return None


def _compiled(impl, f, *args):
    """A Case timing the compiled ``f(*args)``, with its lower+compile time."""
    import jax

    t0 = time.perf_counter()
    try:
        run = jax.jit(f).lower(*args).compile()
    except Exception as exc:  # a dtype XLA lacks on this device, say
        return skipped(impl, "jax", f"compile failed: {type(exc).__name__}: {exc}"[:200])
    spent = time.perf_counter() - t0
    return Case(impl, "jax", lambda: jax.block_until_ready(run(*args)), compile_s=spent, own_streams=True)


def to_jax(a):
    """A NumPy or CuPy array as a JAX array of the same dtype and values.

    bfloat16 crosses as its 16 bits, reinterpreted by JAX as ``jnp.bfloat16``
    (ml_dtypes' type): CuPy's array interface describes a bfloat16 array as
    raw 2-byte void, which JAX refuses ("Unknown NumPy dtype dtype('V2')").

    >>> import ml_dtypes, numpy as np
    >>> x = to_jax(np.array([1.5, -2.0], ml_dtypes.bfloat16))
    >>> str(x.dtype), x.tolist()
    ('bfloat16', [1.5, -2.0])
    """
    import jax
    import jax.numpy as jnp

    if a.dtype.name == "bfloat16":
        return jax.lax.bitcast_convert_type(jnp.asarray(a.view("uint16")), jnp.bfloat16)
    return jnp.asarray(a)


def _leaves(ctx):
    if "jax" not in ctx.cache:
        ctx.cache["jax"] = [to_jax(a) for a in ctx.leaves]
    return ctx.cache["jax"]


def _build(op, ctx):
    import jax.numpy as jnp
    from jax.flatten_util import ravel_pytree

    leaves = _leaves(ctx)
    if op == "flatten":
        case = _compiled("jax ravel_pytree", lambda ls: ravel_pytree(ls)[0], leaves)
        case.value = arrays.norm_of_flat
    elif op == "unflatten":
        flat, unravel = ravel_pytree(leaves)
        case = _compiled("jax ravel_pytree unravel", unravel, flat)
        case.value = arrays.norm_of
    elif op == "global_norm":
        import optax

        case = _compiled("optax global_norm", optax.global_norm, leaves)
        case.value = arrays.values
    elif op == "per_leaf_norm":
        case = _compiled("jax tree_map(linalg.norm)", lambda ls: [jnp.linalg.norm(x) for x in ls], leaves)
        case.value = arrays.values
    else:
        import optax

        clip = optax.clip_by_global_norm(ctx.max_norm)
        case = _compiled("optax clip_by_global_norm", lambda ls: clip.update(ls, clip.init(ls))[0], leaves)
        # optax returns the clipped leaves, not the norm: undo the scale to compare it with the norm met
        case.value = lambda clipped: arrays.norm_of(clipped) / ctx.clip_coef
    return case


def cases(op, ctx) -> list:
    if op in ("scatter", "resident_norm", "resident_clip"):
        return []  # immutable arrays: not applicable (module docstring)
    if len(ctx.leaves) > MAX_LEAVES:
        return [skipped("jax", "jax", f"not attempted: {len(ctx.leaves)} leaves > {MAX_LEAVES}, "
                        "XLA compile time grows superlinearly with leaf count")]
    return [_build(op, ctx)]
