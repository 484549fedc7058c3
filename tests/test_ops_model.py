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


# ---------------------------------------------------------------- PyTorch parameters

def _tied_net(torch):
    """A small module with a weight tied between two layers and a frozen parameter, after backward."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4),
                              torch.nn.Linear(4, 2))
    net[2].weight = net[0].weight
    net[3].bias.requires_grad_(False)
    net(torch.randn(3, 4)).pow(2).sum().backward()
    return net


def _copies(tensors):
    return [None if t is None else t.detach().clone() for t in tensors]


@pytest.mark.parametrize("as_tree", [lambda net: net, lambda net: list(net.parameters()),
                                     lambda net: dict(net.named_parameters())],
                         ids=["module", "parameter-list", "parameter-dict"])
def test_clip_grad_norm_of_a_module_clips_its_gradients_as_torch_does(as_tree, backend):
    torch = pytest.importorskip("torch")
    ours, theirs = _tied_net(torch), _tied_net(torch)
    weights = _copies(ours.parameters())
    grads64 = [p.grad.double().numpy() for p in ours.parameters() if p.grad is not None]
    norm = gf.clip_grad_norm_(as_tree(ours), 0.1, backend=backend)
    ref_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    # An independent float64 reference of the norm, and torch's own clip.
    assert math.isclose(float(norm), exact_norm(grads64), rel_tol=1e-12)
    assert math.isclose(float(norm), float(ref_norm), rel_tol=1e-6)
    for p, q, w in zip(ours.parameters(), theirs.parameters(), weights):
        assert torch.equal(p.detach(), w)  # the weights are untouched
        assert (p.grad is None) == (q.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def test_global_norm_of_a_module_stays_the_parameters_norm(backend):
    torch = pytest.importorskip("torch")
    net = _tied_net(torch)
    weights = [p.detach().double().numpy() for _, p in net.named_parameters() if p.requires_grad]
    assert math.isclose(float(gf.global_norm(net, backend=backend)), exact_norm(weights), rel_tol=1e-12)


def test_a_tree_mixing_parameters_and_plain_arrays_is_refused_naming_the_leaf(backend):
    torch = pytest.importorskip("torch")
    w = torch.nn.Parameter(torch.ones(2))
    w.grad = torch.ones(2)
    tree = {"w": w, "g": np.ones(2)}
    with pytest.raises(gf.TreeMismatchError, match=r"leaf \"\['g'\]\": expected a PyTorch tensor, as the tree holds parameters"):
        gf.clip_grad_norm_(tree, 0.1, backend=backend)
    assert tree["g"].tolist() == [1, 1] and w.grad.tolist() == [1, 1]
