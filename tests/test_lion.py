"""gpuflat.torch.Lion and gpuflat.optim.Lion against a float64 reference of
Lion written here from the paper's formulas (Chen et al. 2023,
https://arxiv.org/abs/2302.06675), on every backend: the host library, the
CUDA kernels on the emulated device and the NumPy backend.

Lion is a rule of the layout and nothing else: its classes hold options and
a docstring, and every other behaviour (the clip, scalers, state dicts,
compile, capture, ranks) is the seam's, tested with AdamW's in the modules
that mirror it.
"""
import numpy as np
import pytest

import gpuflat as gf
import gpuflat.optim
from gpuflat._src.backends.selection import get_backend

from conftest import BF16

torch = pytest.importorskip("torch")

import gpuflat.torch as gft  # noqa: E402
from gpuflat._src import tensor_table  # noqa: E402

BACKENDS = ["host", "emulated", "numpy"]
CLIP_EPS = 1e-6  # PyTorch's clip_grad_norm_: max_norm / (norm + 1e-6)
SHAPES = [(70, 3), (5000,), (), (0,), (4, 1)]
# Two groups: (lr, betas, weight_decay, maximize).
GROUPS = [(0.01, (0.9, 0.99), 0.1, False), (0.03, (0.8, 0.95), 0.0, True)]


def reference(params, grads_per_step, groups, max_norm=None):
    """Lion in float64, per the paper: u = sign(b1 m + (1 - b1) g),
    p = p - lr (u + wd p) taken as p (1 - lr wd) - lr u, m = b2 m + (1 - b2) g,
    the gradients clipped by their global 2-norm first. Returns the
    parameters, the moments and the smallest |b1 m + (1 - b1) g| met."""
    p = [np.array(x, np.float64) for x in params]
    m = [np.zeros_like(x) for x in p]
    closest = np.inf
    for grads in grads_per_step:
        norm = np.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in grads))
        factor = 1.0 if max_norm is None else min(1.0, max_norm / (norm + CLIP_EPS))
        for k, g in enumerate(grads):
            lr, (b1, b2), wd, maximize = groups[k % len(groups)]
            g = np.asarray(g, np.float64) * factor * (-1.0 if maximize else 1.0)
            c = b1 * m[k] + (1.0 - b1) * g
            if c.size:
                closest = min(closest, float(np.abs(c).min()))
            p[k] = p[k] * (1.0 - lr * wd) - lr * np.sign(c)
            m[k] = b2 * m[k] + (1.0 - b2) * g
    return p, m, closest


def data(seed, steps=4):
    rng = np.random.default_rng(seed)
    params = [rng.standard_normal(s) for s in SHAPES]
    grads = [[rng.standard_normal(s) * (3.0 if k % 2 else 0.2) for s in SHAPES] for k in range(steps)]
    return params, grads


def torch_groups(params):
    return [{"params": params[i::len(GROUPS)], "lr": lr, "betas": betas, "weight_decay": wd, "maximize": mx}
            for i, (lr, betas, wd, mx) in enumerate(GROUPS)]


@pytest.mark.parametrize("max_norm", [None, 1.0])
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_torch_front_end_is_the_float64_reference(backend, max_norm):
    start, steps = data(1)
    want_p, want_m, closest = reference(start, steps, GROUPS, max_norm)
    # No sign is decided within rounding (the terms of b1 m + (1 - b1) g are
    # below 10, so float64 rounds it by less than 1e-14, the clip factor's
    # other summation order included): a flip would move a weight by 2 lr.
    assert closest > 1e-12
    params = [torch.nn.Parameter(torch.tensor(x)) for x in start]
    opt = gft.Lion(torch_groups(params), max_norm=max_norm)
    with tensor_table.serve_with(get_backend(backend)):
        for grads in steps:
            for p, g in zip(params, grads):
                p.grad = torch.tensor(g)
            opt.step()
    for p, want, m in zip(params, want_p, want_m):
        np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(opt.state[p]["exp_avg"].numpy(), m, rtol=1e-12, atol=1e-15)
        assert float(opt.state[p]["step"]) == len(steps)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_resident_front_end_is_the_float64_reference(backend):
    start, steps = data(2)
    groups = GROUPS[:1]
    want_p, want_m, closest = reference(start, steps, groups, max_norm=2.0)
    assert closest > 1e-12  # as above
    r = gf.resident({f"p{k}": x.copy() for k, x in enumerate(start)}, backend=backend)
    lr, betas, wd, maximize = groups[0]
    opt = gpuflat.optim.Lion(r, lr=lr, betas=betas, weight_decay=wd, maximize=maximize, max_norm=2.0)
    for grads in steps:
        for k, g in enumerate(grads):
            r.grads[f"p{k}"][...] = g
        opt.step()
    for k, (want, m) in enumerate(zip(want_p, want_m)):
        np.testing.assert_allclose(np.asarray(r.params[f"p{k}"]), want, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(np.asarray(opt.state[f"['p{k}']"]["exp_avg"]), m, rtol=1e-12, atol=1e-15)


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_sign_of_zero_is_zero(backend, dtype):
    # betas (0.5, 0.5): the first step's gradient 2 makes m = 1, the second's
    # -1 makes 0.5 * 1 + 0.5 * -1 exactly 0 in every dtype: no step, only
    # the decay. A zero gradient on a new moment is 0 too.
    w = torch.nn.Parameter(torch.tensor([1.0, 1.0], dtype=dtype))
    opt = gft.Lion([w], lr=0.25, betas=(0.5, 0.5), weight_decay=0.5)
    with tensor_table.serve_with(get_backend(backend)):
        w.grad = torch.tensor([2.0, 0.0], dtype=dtype)
        opt.step()
        assert w.tolist() == [0.875 - 0.25, 0.875]  # decay by 1 - 0.125, then - lr * sign
        w.grad = torch.tensor([-1.0, 0.0], dtype=dtype)
        opt.step()
    assert w.tolist() == [0.625 * 0.875, 0.875 * 0.875]
    assert opt.state[w]["exp_avg"].tolist() == [0.5 * 1.0 + 0.5 * -1.0, 0.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + ([torch.bfloat16] if BF16 is not None else []),
                         ids=str)
def test_the_host_library_and_the_kernels_give_the_same_bits(dtype):
    # The same element arithmetic (kernels/gpuflat_lion.cuh) on the host and
    # on the emulated device, after norms of the same bits; NumPy's norm sums
    # in another order, so its clip factor may differ in the last place.
    results = {}
    for backend in BACKENDS:
        g = torch.Generator().manual_seed(3)
        params = [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in (5000, 3, 0, 70)]
        opt = gft.Lion(params, lr=1e-2, weight_decay=0.1, max_norm=1.0)
        with tensor_table.serve_with(get_backend(backend)):
            for _ in range(3):
                for p in params:
                    p.grad = torch.randn(p.shape, generator=g).to(dtype)
                opt.step()
        results[backend] = [(p.detach().clone(), opt.state[p]["exp_avg"].clone()) for p in params]
    for (p_h, m_h), (p_e, m_e), (p_n, m_n) in zip(results["host"], results["emulated"], results["numpy"]):
        assert torch.equal(p_h.view(torch.int16 if dtype != torch.float32 else torch.int32),
                           p_e.view(torch.int16 if dtype != torch.float32 else torch.int32))
        assert torch.equal(m_h, m_e)
        torch.testing.assert_close(p_n, p_h, rtol=1e-2, atol=0)


def test_a_nan_gradient_makes_its_weight_nan_as_sign_does():
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = gft.Lion([w], lr=0.1)
    w.grad = torch.tensor([float("nan"), 1.0])
    opt.step()
    assert torch.isnan(w.detach()[0]) and float(w.detach()[1]) == pytest.approx(1.9)


def test_bad_options_are_refused_naming_the_group():
    w = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"parameter group 0: expected betas in \[0, 1\), got \(0.9, 1.5\)"):
        gft.Lion([w], betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="parameter group 0: expected weight_decay >= 0"):
        gft.Lion([w], weight_decay=-1.0)


@pytest.mark.parametrize("cls", [gft.Lion, gpuflat.optim.Lion])
def test_lion_holds_its_options_and_nothing_else(cls):
    # Every behaviour comes through the seam: a Lion class defines its
    # constructor (the options), its docstring and the rule it names.
    own = set(vars(cls)) - {"__module__", "__qualname__", "__doc__", "__firstlineno__", "__static_attributes__"}
    if "step" in own:
        # torch.optim.Optimizer wraps the step of an instance's class with its
        # hooks, on that class (Optimizer._patch_step_function): the seam's step.
        assert cls.step.__wrapped__ is gft.AdamW.__mro__[1].step
        own.remove("step")
    assert own == ({"__init__", "_rule"} if cls is gft.Lion else {"__init__", "rule"})
