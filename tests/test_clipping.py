"""gpuflat._src.clipping: the one clip every front end composes its own from.

Each front end (a tree, a tree read through its model, a resident model,
gpuflat.distributed, gpuflat.torch's drop-in) is driven the same way here:
one orchestration call per clip, the same norm against an independent
float64 reference, the same refusal of a non-finite norm before any write,
and the same error naming the same leaf.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import gpuflat as gf
import gpuflat.torch as gft
from gpuflat import distributed as gfd
from gpuflat._src import clipping
from gpuflat._src.backends import get_backend
from gpuflat.errors import NonFiniteError, NonFiniteNormError


class Tree:
    """Gradients as a dict of NumPy arrays, clipped by ``gf.clip_grad_norm_``."""

    kind = NonFiniteError
    norm = "the total 2-norm is non-finite, so no gradient was scaled"

    def __init__(self, values):
        self.grads = {f"g{i}": v.copy() for i, v in enumerate(values)}

    def culprit(self, i):
        return f"leaf \"['g{i}']\""

    def clip(self, max_norm, p, error):
        return gf.clip_grad_norm_(self.grads, max_norm, p, error_if_nonfinite=error)

    def values(self):
        return [np.array(v) for v in self.grads.values()]


class TreeWithModel(Tree):
    """The same, read through the model's plan (``model=``)."""

    def clip(self, max_norm, p, error):
        model = {k: np.zeros_like(v) for k, v in self.grads.items()}
        return gf.clip_grad_norm_(self.grads, max_norm, p, error_if_nonfinite=error, model=model)


class Distributed(Tree):
    """The same on one rank, by ``gpuflat.distributed.clip_grad_norm_``."""

    norm = "the global 2-norm over 1 ranks is non-finite, so no gradient was scaled on any rank"

    def culprit(self, i):
        return f"leaf \"['g{i}']\" on rank 0"

    def clip(self, max_norm, p, error):
        return gfd.clip_grad_norm_(self.grads, max_norm, p, error_if_nonfinite=error)


class Resident:
    """A resident model's gradient buffers, clipped by ``Resident.clip_grad_norm_``."""

    kind = NonFiniteError
    norm = Tree.norm

    def __init__(self, values):
        self.model = gf.resident({f"g{i}": np.zeros_like(v) for i, v in enumerate(values)})
        for i, v in enumerate(values):
            self.model.grads[f"g{i}"][...] = v

    culprit = Tree.culprit

    def clip(self, max_norm, p, error):
        return self.model.clip_grad_norm_(max_norm, p, error_if_nonfinite=error)

    def values(self):
        return [np.array(v) for v in self.model.grads.values()]


class Torch:
    """Parameters' gradients, clipped by ``gpuflat.torch.clip_grad_norm_``."""

    kind = NonFiniteNormError
    rounds_norm = True  # returned in the gradients' dtype, as PyTorch returns it
    norm = Tree.norm

    def __init__(self, values):
        self.params = [torch.nn.Parameter(torch.zeros(v.shape, dtype=torch.from_numpy(v).dtype)) for v in values]
        for q, v in zip(self.params, values):
            q.grad = torch.from_numpy(v.copy())

    def culprit(self, i):
        return f"leaf 'parameters[{i}].grad'"

    def clip(self, max_norm, p, error):
        return gft.clip_grad_norm_(self.params, max_norm, p, error_if_nonfinite=error)

    def values(self):
        return [q.grad.numpy().copy() for q in self.params]


class TorchCompiled(Torch):
    """The same inside ``torch.compile`` (TorchDynamo alone: gpuflat's
    operators in the graph, run as they are)."""

    def clip(self, max_norm, p, error):
        torch._dynamo.reset()  # a fresh trace each time, never the eager fallback past the recompile limit

        def clipped(params):
            assert torch.compiler.is_compiling()
            return gft.clip_grad_norm_(params, max_norm, p, error_if_nonfinite=error)

        return torch.compile(clipped, backend="eager")(self.params)


FRONT_ENDS = [Tree, TreeWithModel, Distributed, Resident, Torch, TorchCompiled]


def gradients(dtype, rng=None):
    rng = rng or np.random.default_rng(0)
    return [rng.standard_normal(shape).astype(dtype) for shape in [(3, 4), (), (0,), (7,)]]


def reference_norm(values, p):
    flat = np.concatenate([v.astype(np.float64).reshape(-1) for v in values])
    if p == math.inf:
        return float(np.abs(flat).max())
    return float((np.abs(flat) ** p).sum() ** (1 / p))


@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=lambda f: f.__name__)
def test_every_front_end_clips_through_the_one_orchestration(front_end, monkeypatch):
    calls = []
    real = clipping.clip_

    def counted(bound, *args, **kwargs):
        calls.append(type(bound).__name__)
        return real(bound, *args, **kwargs)

    monkeypatch.setattr(clipping, "clip_", counted)
    front_end(gradients(np.float32)).clip(1.0, 2.0, False)
    assert len(calls) == 1


@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("p", [1.0, 2.0, math.inf, 3.0])
def test_every_front_end_returns_the_norm_and_scales_by_it(front_end, dtype, p):
    values = gradients(dtype)
    clipped = front_end(values)
    total = float(clipped.clip(0.5, p, True))
    expected = reference_norm(values, p)
    rounded = getattr(front_end, "rounds_norm", False) and dtype == np.float32
    assert total == pytest.approx(expected, rel=6e-8 if rounded else 1e-12)
    factor = min(1.0, 0.5 / (expected + 1e-6))
    rtol = 1e-6 if dtype == np.float32 else 1e-12
    for got, v in zip(clipped.values(), values):
        np.testing.assert_allclose(got, v.astype(np.float64) * factor, rtol=rtol, atol=0)


@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=lambda f: f.__name__)
def test_a_nonfinite_norm_raises_naming_the_first_leaf_and_writes_nothing(front_end):
    values = gradients(np.float64)
    values[0][1, 2], values[3][0] = np.nan, np.inf
    clipped = front_end(values)
    with pytest.raises(front_end.kind) as err:
        clipped.clip(0.5, 2.0, True)
    assert str(err.value) == (f"{clipped.culprit(0)} holds NaN or inf; {front_end.norm} (error_if_nonfinite=True; "
                              f"set it to False to scale by the non-finite norm anyway)")
    for got, v in zip(clipped.values(), values):
        np.testing.assert_array_equal(got, v)


@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=lambda f: f.__name__)
def test_an_overflowing_sum_names_no_leaf_and_writes_nothing(front_end):
    values = [np.full(3, 1e200), np.full(2, 1e200)]
    clipped = front_end(values)
    with pytest.raises(front_end.kind, match="^no leaf holds NaN or inf, but the sum overflowed float64"):
        clipped.clip(1.0, 2.0, True)
    for got, v in zip(clipped.values(), values):
        np.testing.assert_array_equal(got, v)


@pytest.mark.parametrize("front_end", FRONT_ENDS, ids=lambda f: f.__name__)
def test_without_the_check_a_nan_norm_scales_to_nan_as_pytorch_does(front_end):
    values = gradients(np.float64)
    values[3][0] = np.nan
    clipped = front_end(values)
    assert math.isnan(float(clipped.clip(1.0, 2.0, False)))
    assert all(np.isnan(v).all() for v in clipped.values() if v.size)


# ---------------------------------------------------------------- Bound itself

def numpy_part(arrays, positions=None, name="a"):
    return clipping.Part(gf.plan(arrays), arrays, get_backend("numpy"), positions=positions,
                         path=lambda slot: f"{name}{slot}")


def test_the_first_leaf_named_is_the_callers_first_across_parts():
    # The caller's list [x0, y0, x1, y1] split into two parts (two devices,
    # say), the part holding y first: the caller's first NaN is x1's.
    xs, ys = [np.ones(1), np.array([np.nan])], [np.ones(1), np.array([np.nan])]
    first, second = numpy_part(ys, positions=[1, 3], name="y"), numpy_part(xs, positions=[0, 2], name="x")

    def combined(bound, results, p):
        total = np.asarray(math.hypot(*(float(r.total) for r in results)))
        return total, total

    bound = clipping.Bound([first, second], combine=combined)
    with pytest.raises(NonFiniteError, match="^leaf 'x1' holds NaN"):
        clipping.clip_(bound, 1.0, 2.0, 0.0, True)
    # Parts without positions (a resident model's dtype buffers): their order decides.
    bound = clipping.Bound([numpy_part(ys, name="y"), numpy_part(xs, name="x")], combine=combined)
    with pytest.raises(NonFiniteError, match="^leaf 'y1' holds NaN"):
        clipping.clip_(bound, 1.0, 2.0, 0.0, True)


def test_max_norm_is_converted_once_per_backend(monkeypatch):
    seen = []
    real = clipping.max_norm_for
    monkeypatch.setattr(clipping, "max_norm_for", lambda be, m: seen.append(be.name) or real(be, m))
    a, b = [np.array([3.0])], [np.array([4.0])]

    def combined(bound, results, p):
        total = np.asarray(5.0)
        return total, total

    clipping.clip_(clipping.Bound([numpy_part(a), numpy_part(b)], combine=combined), 1.0, 2.0, 0.0, False)
    assert seen == ["numpy"]
    assert (a[0][0], b[0][0]) == (3.0 * (1.0 / 5.0), 4.0 * (1.0 / 5.0))  # one factor, min(1, 1 / 5)


def test_a_norm_given_in_the_callers_kind_is_converted_for_each_part():
    given = []
    grads = [np.array([3.0, 4.0])]
    bound = clipping.Bound([numpy_part(grads)], total_for=lambda part, total: given.append(total) or np.asarray(total))
    clipping.scale_by(bound, 10.0, 1.0, 0.0)
    assert given == [10.0]
    np.testing.assert_array_equal(grads[0], [3.0 * 0.1, 4.0 * 0.1])


def test_one_place_is_entered_once_for_the_whole_clip(monkeypatch):
    entered = []
    real = clipping._arrays.device_scope

    def counted(backend, like):
        entered.append(backend.name)
        return real(backend, like)

    monkeypatch.setattr(clipping._arrays, "device_scope", counted)
    params = [torch.nn.Parameter(torch.zeros(3)) for _ in range(4)]
    for q in params:
        q.grad = torch.ones(3)
    gft.clip_grad_norm_(params, 1.0)
    gf.clip_grad_norm_({"a": np.ones(2), "b": np.ones(3)}, 1.0)
    assert len(entered) == 2
