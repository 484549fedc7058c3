"""gpuflat.optim: the flat AdamW and SGD over a resident model.

The update kernel runs on the emulated device (the CUDA source on the host)
and in the host backend's native build, the NumPy backend is the reference:
all three must give the same bits, step after step, for every real dtype,
with and without the clip, with several parameter groups; and the result
must be PyTorch's formulas (checked here against a plain float64 loop, and
against torch.optim in test_torch_optim).
"""
import ast
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src.backends.cuda import ITEM
from gpuflat._src.layout import RULES
from gpuflat.optim import SGD, AdamW

from conftest import BACKENDS, BF16, assert_bits_equal

REAL = [np.dtype(np.float16)] + ([BF16] if BF16 is not None else []) + [np.dtype(np.float32), np.dtype(np.float64)]


def test_the_native_update_builds():
    # Where it does not, the host backend's step is NumPy's and the
    # comparisons below would compare NumPy with itself.
    from gpuflat._src import native

    assert native.optim_library()[0] is not None


def model(dtype, rng):
    # Sizes on and past a work item, a tiny leaf, and a second dtype (two buffers).
    return {"w": rng.standard_normal((ITEM + 3,)).astype(dtype), "b": rng.standard_normal(5).astype(dtype),
            "e": rng.standard_normal((3, 7)).astype(dtype), "x": rng.standard_normal(33).astype(np.float32)}


def train(backend, dtype, make, steps=6, seed=0):
    """Parameters and state after ``steps`` steps with seeded gradients, as NumPy copies."""
    rng = np.random.default_rng(seed)
    r = gf.resident(model(dtype, rng), backend=backend)
    opt = make(r)
    norms = []
    for k in range(steps):
        for path, g in r.grads.items():
            g[...] = (rng.standard_normal(g.shape) * (3.0 if k % 2 else 0.1)).astype(g.dtype)
        norms.append(opt.step())
    state = {p: {n: np.array(v) for n, v in s.items()} for p, s in opt.state.items()}
    return r, {p: np.array(v) for p, v in r.params.items()}, state, norms


MAKERS = {
    "adamw": lambda r: AdamW(r, lr=0.01, weight_decay=0.1),
    "adamw-clip-groups": lambda r: AdamW(r, lr=0.02, betas=(0.8, 0.99), max_norm=1.0,
                                         groups=[{"params": ["['b']", "['x']"], "weight_decay": 0.0, "lr": 0.05}]),
    "sgd": lambda r: SGD(r, lr=0.1),
    "sgd-momentum-clip": lambda r: SGD(r, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, max_norm=2.0),
    "sgd-nesterov": lambda r: SGD(r, lr=0.1, momentum=0.9, nesterov=True,
                                  groups=[{"params": ["['w']"], "lr": 0.01}]),
}


@pytest.mark.parametrize("dtype", REAL, ids=str)
@pytest.mark.parametrize("rule", list(MAKERS))
def test_backends_give_the_same_bits(rule, dtype):
    runs = dict(zip(BACKENDS, (train(be, dtype, MAKERS[rule]) for be in BACKENDS)))
    _, params, state, _ = runs["emulated"]
    for be, (_, p2, s2, _) in runs.items():
        # The updates are the same bits everywhere; a clip factor is as
        # exact as its norm, which NumPy sums in another order (float64
        # buffers see that last bit).
        same = assert_bits_equal if be != "numpy" or "clip" not in rule or dtype != np.float64 else close
        for path in params:
            same(params[path], p2[path])
        for path in state:
            for name in state[path]:
                same(state[path][name], s2[path][name])
    # The host and emulated norms are the kernels' bits; NumPy's sum in another order.
    for a, b, c in zip(*(runs[be][3] for be in ("numpy", "host", "emulated"))):
        assert a is None and b is None and c is None or float(b) == float(c) == pytest.approx(float(a), rel=1e-14)
    assert not np.array_equal(params["w"], model(dtype, np.random.default_rng(0))["w"])


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-10, atol=0)


def reference(rule, params, grads_per_step, hyper, max_norm=None):
    """PyTorch's formulas in plain float64, leaf by leaf."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    state = {k: [np.zeros_like(v), np.zeros_like(v)] for k, v in params.items()}
    for t, grads in enumerate(grads_per_step, start=1):
        coef = 1.0
        if max_norm is not None:
            norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
            coef = min(1.0, max_norm / (norm + 1e-6))
        for k, p in params.items():
            g = grads[k].astype(np.float64) * coef
            lr, wd, a, b, c = hyper[k]
            if rule == "adamw":
                m, v = state[k]
                p *= 1 - lr * wd
                m[...] = a * m + (1 - a) * g
                v[...] = b * v + (1 - b) * g * g
                p -= lr / (1 - a**t) * m / (np.sqrt(v) / math.sqrt(1 - b**t) + c)
            else:
                buf = state[k][0]
                d = g + wd * p
                buf[...] = d if t == 1 else a * buf + (1 - b) * d
                d = d + a * buf if c else buf
                p -= lr * d
    return params, state


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule", ["adamw", "sgd"])
def test_formulas_are_pytorchs(backend, rule):
    rng = np.random.default_rng(1)
    tree = {"w": rng.standard_normal(300), "b": rng.standard_normal(4)}
    grads = [{k: rng.standard_normal(v.shape) for k, v in tree.items()} for _ in range(5)]
    r = gf.resident(tree, backend=backend)
    if rule == "adamw":
        opt = AdamW(r, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, max_norm=3.0,
                    groups=[{"params": ["['b']"], "weight_decay": 0.0}])
        hyper = {"['w']": (0.01, 0.1, 0.9, 0.99, 1e-8), "['b']": (0.01, 0.0, 0.9, 0.99, 1e-8)}
    else:
        opt = SGD(r, lr=0.05, momentum=0.9, dampening=0.2, weight_decay=0.01, max_norm=3.0)
        hyper = {k: (0.05, 0.01, 0.9, 0.2, 0) for k in ("['w']", "['b']")}
    for g in grads:
        for k, v in g.items():
            r.grads[k][...] = v
        opt.step()
    want, state = reference(rule, {f"['{k}']": v for k, v in tree.items()},
                            [{f"['{k}']": v for k, v in g.items()} for g in grads], hyper, max_norm=3.0)
    for k, v in want.items():
        np.testing.assert_allclose(r.params[k[2:-2]], v, rtol=1e-12, atol=1e-14)
        name = "exp_avg" if rule == "adamw" else "momentum_buffer"
        np.testing.assert_allclose(opt.state[k][name], state[k][0], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_stays_zero_through_a_nan_step(backend):
    r = gf.resident({"a": np.ones(3, np.float32), "b": np.ones(70, np.float32)}, backend=backend)
    opt = AdamW(r, lr=0.1, max_norm=1.0)
    r.grads["a"][:] = np.nan
    opt.step()
    assert np.isnan(r.params["a"]).all() and np.isnan(r.params["b"]).all()  # PyTorch's: a NaN norm spreads
    flat = np.asarray(r.param_buffers[0])
    pad = np.ones(flat.size, bool)
    for s in r.layout:
        pad[s.offset : s.offset + s.size] = False
    assert pad.any() and not flat[pad].any()
    for buf in opt._flat.states[0]:
        assert not np.asarray(buf.array)[pad].any()


@pytest.mark.parametrize("backend", BACKENDS)
def test_group_options_are_read_at_every_step(backend):
    r = gf.resident({"w": np.ones(2)}, backend=backend)
    opt = SGD(r, lr=0.5)
    r.grads["w"][:] = 1.0
    opt.step()
    opt.groups[0]["lr"] = 0.25
    opt.step()
    np.testing.assert_array_equal(r.params["w"], [0.25, 0.25])


def test_state_views_are_the_buffers():
    r = gf.resident({"w": np.ones(2), "b": np.ones(1)})
    opt = AdamW(r, lr=0.1)
    r.grads["w"][:] = 1.0
    opt.step()
    st = opt.state["['w']"]
    assert float(st["step"]) == 1.0 and st["exp_avg"].shape == (2,)
    assert np.shares_memory(st["exp_avg"], opt._flat.states[0][0].own)


def test_the_state_names_are_torch_optims():
    torch = pytest.importorskip("torch")
    for name, make in (("adamw", torch.optim.AdamW), ("sgd", lambda ps: torch.optim.SGD(ps, momentum=0.9))):
        w = torch.nn.Parameter(torch.ones(2))
        w.grad = torch.ones(2)
        opt = make([w])
        opt.step()
        flat = (AdamW if name == "adamw" else SGD)(gf.resident({"w": np.ones(2)}))
        assert RULES[name].state_names == tuple(k for k in opt.state[w] if k != "step")
        assert RULES[name].counts_steps == ("step" in opt.state[w])
        assert set(flat.state["['w']"]) == {*RULES[name].state_names, "step"}


def test_optim_reads_a_resident_model_through_its_public_interface():
    # Only an object's own private attributes (self._x); never a resident
    # model's or its buffers' (r._x, self.resident._x).
    source = Path(gf.optim.__file__).read_text()
    private = [(node.lineno, ast.unparse(node)) for node in ast.walk(ast.parse(source))
               if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
               and not (isinstance(node.value, ast.Name) and node.value.id == "self")]
    assert private == []


def test_bad_input_is_refused_naming_the_leaf_or_group():
    r = gf.resident({"w": np.ones(2), "z": np.ones(2, np.complex64)})
    with pytest.raises(TypeError, match=r"leaf \"\['z'\]\": .*real floating parameter, got complex64"):
        AdamW(r)
    r = gf.resident({"w": np.ones(2), "b": np.ones(1)})
    with pytest.raises(ValueError, match="group 0: .q. is not a leaf of the resident model"):
        AdamW(r, groups=[{"params": ["q"]}])
    with pytest.raises(ValueError, match=r"leaf \"\['w'\]\": expected in one group, found in groups 0 and 1"):
        AdamW(r, groups=[{"params": ["['w']"]}, {"params": ["['w']"]}])
    with pytest.raises(ValueError, match=r"group 0: expected betas in \[0, 1\), got \(0.9, 1.0\)"):
        AdamW(r, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="nesterov only with momentum > 0"):
        SGD(r, nesterov=True)
    with pytest.raises(ValueError, match="unknown options"):
        SGD(r, groups=[{"params": [], "betas": (0.9, 0.9)}])
    opt = SGD(r, lr=0.1)
    opt.groups[0]["lr"] = -1.0
    before = np.array(r.param_buffers[0])
    with pytest.raises(ValueError, match="group 0: expected lr >= 0, got -1.0"):
        opt.step()
    assert_bits_equal(np.asarray(r.param_buffers[0]), before)
    with pytest.raises(ValueError, match="grads=False"):
        SGD(gf.resident({"w": np.ones(2)}, grads=False))


def scaled_run(backend):
    """Steps with a loss scale of 1024 folded into the update, a NaN on step 2."""
    rng = np.random.default_rng(3)
    r = gf.resident(model(np.float32, rng), backend=backend)
    opt = AdamW(r, lr=0.01, max_norm=1.0)
    opt._flat.set_hyper([(0.01, 0.01, 0.9, 0.999, 1e-8)])
    inv = np.asarray(1.0 / 1024)
    out = []
    for k in range(4):
        for g in r.grads.values():
            g[...] = rng.standard_normal(g.shape).astype(g.dtype) * 1024
        if k == 2:
            r.grads["b"][0] = np.nan
        before = np.array(r.param_buffers[0]), [np.array(s.array) for s in opt._flat.states[0]]
        total, found = opt._flat.step(1.0, inv_scale=inv, detect=True)
        out.append((float(total), float(found), np.array(r.param_buffers[0])))
        if k == 2:
            assert_bits_equal(r.param_buffers[0], before[0])
            for s, b in zip(opt._flat.states[0], before[1]):
                assert_bits_equal(s.array, b)
    return out, {p: np.array(s["step"]) for p, s in opt.state.items()}


def test_a_loss_scale_unscales_inside_and_a_nonfinite_step_is_skipped():
    runs = {be: scaled_run(be) for be in BACKENDS}
    steps, flags = runs["emulated"][1], [f for _, f, _ in runs["emulated"][0]]
    assert flags == [0.0, 0.0, 1.0, 0.0] and all(float(s) == 3.0 for s in steps.values())
    norms = [t for t, _, _ in runs["emulated"][0]]
    assert 5 < norms[0] < 500  # unscaled: the scaled gradients' norm is 1024 times that
    for be in ("numpy", "host"):
        for (t, f, p), (t2, f2, p2) in zip(runs[be][0], runs["emulated"][0]):
            assert f == f2 and (t == pytest.approx(t2, rel=1e-14) or math.isnan(t) and math.isnan(t2))
            assert_bits_equal(p, p2)


@pytest.mark.parametrize("variant", [pytest.param("cupy", marks=pytest.mark.gpu), "stand-in"])
def test_cupy_arrays_give_the_emulated_bits(variant, monkeypatch):
    # The CUDA backend through CuPy: on a GPU, and on the stand-in that runs
    # the same launches on the host emulator with CuPy's contract.
    import cupy_stand_in
    from conftest import cupy_with_device
    from gpuflat._src.backends import selection

    cp = cupy_with_device() if variant == "cupy" else cupy_stand_in.make_cupy(("90", "80"))
    if cp is None:
        pytest.skip("needs CuPy and a CUDA device")
    monkeypatch.setitem(sys.modules, "cupy", cp)
    monkeypatch.setattr(selection, "_backends", {})
    rng = np.random.default_rng(5)
    host = model(np.float32, rng)
    r_dev = gf.resident({k: cp.asarray(v) for k, v in host.items()})
    r_emu = gf.resident({k: v.copy() for k, v in host.items()}, backend="emulated")
    opts = [AdamW(r, lr=0.01, max_norm=1.0) for r in (r_dev, r_emu)]
    for k in range(3):
        for path, g in r_emu.grads.items():
            g[...] = rng.standard_normal(g.shape).astype(g.dtype)
            r_dev.grads[path][...] = cp.asarray(g)
        norms = [float(cp.asnumpy(opts[0].step())), float(opts[1].step())]
        assert norms[0] == norms[1]
    for path in host:
        assert_bits_equal(cp.asnumpy(r_dev.params[path]), r_emu.params[path])
    inv = cp.asarray(np.asarray(0.5))
    total, found = opts[0]._flat.step(1.0, inv_scale=inv, detect=True)
    assert float(cp.asnumpy(found)) == 0.0 and cp.asnumpy(opts[0]._flat.steps[0].array)[0] == 4.0
