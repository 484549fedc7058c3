"""Gradient trees read through a model (``model=``): one term per model slot,
in the model's plan order; and PyTorch modules and parameters, whose
gradients are clipped, never their weights."""
from __future__ import annotations

import math

import numpy as np
import pytest

import gpuflat as gf

from conftest import exact_norm


def _slot_grads_reference(model_slots, grads_per_slot):
    """Per slot, the float64 sum of its gradients (zeros for none): independent of gpuflat."""
    return [sum((np.asarray(g, np.float64) for g in gs), np.zeros(m.shape)) for m, gs in
            zip(model_slots, grads_per_slot)]


def _none_and_tie():
    w = np.ones(2, np.float32)
    model = {"a": np.ones(1), "w1": w, "b": np.ones(1), "w2": w, "c": np.ones(3, np.float32)}
    grads = {"a": np.array([3.0]), "w1": np.array([1.0, 2.0], np.float32), "b": np.array([4.0]),
             "w2": np.array([5.0, 0.5], np.float32), "c": None}
    slots = [model["a"], w, model["b"], model["c"]]
    per_slot = [[grads["a"]], [grads["w1"], grads["w2"]], [grads["b"]], []]
    return model, grads, _slot_grads_reference(slots, per_slot)


def test_reported_case_keeps_one_term_per_slot(backend):
    model = {"a": np.ones(1), "b": np.ones(1), "c": np.ones(1)}
    grads = {"a": np.array([3.0]), "b": np.array([4.0]), "c": None}
    assert float(gf.total("l2", grads, model=model, backend=backend)) == 7.0
    total, per = gf.global_norm(grads, per_leaf=True, model=model, backend=backend)
    assert float(total) == 5.0 and np.asarray(per).tolist() == [3.0, 4.0, 0.0]


def test_named_totals_and_per_leaf_norms_against_float64_reference(backend):
    model, grads, ref = _none_and_tie()
    assert math.isclose(float(gf.total("l2", grads, model=model, backend=backend)),
                        math.fsum(exact_norm([r]) for r in ref), rel_tol=1e-15)
    assert math.isclose(float(gf.total("l1", grads, model=model, backend=backend)),
                        math.fsum(np.abs(np.concatenate(ref)).tolist()), rel_tol=1e-15)
    for ord in (1, 2, 3, math.inf):
        total, per = gf.global_norm(grads, ord, per_leaf=True, model=model, backend=backend)
        np.testing.assert_allclose(np.asarray(per), [exact_norm([r], ord) for r in ref], rtol=1e-15)
        assert math.isclose(float(total), exact_norm(ref, ord), rel_tol=1e-15)


def test_a_callable_receives_one_array_per_model_slot(backend):
    model, grads, ref = _none_and_tie()
    seen = []
    got = gf.total(lambda g: seen.append(g) or float(np.sum(g)), grads, model=model, backend=backend)
    assert len(seen) == 4
    assert seen[0] is grads["a"] and seen[2] is grads["b"]  # a slot's one gradient: the caller's own
    assert [g.dtype for g in seen] == [np.float64, np.float32, np.float64, np.float32]
    for g, r in zip(seen, ref):
        np.testing.assert_array_equal(np.asarray(g, np.float64), r)
    assert got == math.fsum(float(np.sum(r)) for r in ref)


def test_clip_with_model_scales_each_occurrence_by_the_per_slot_norm(backend):
    model, grads, ref = _none_and_tie()
    before = {k: None if v is None else v.astype(np.float64) for k, v in grads.items()}
    norm = gf.clip_grad_norm_(grads, 1.0, model=model, backend=backend)
    assert math.isclose(float(norm), exact_norm(ref), rel_tol=1e-15)
    coef = 1.0 / (exact_norm(ref) + 1e-6)
    for k, v in before.items():
        if v is not None:
            np.testing.assert_allclose(np.asarray(grads[k], np.float64), v * coef, rtol=1e-6)
