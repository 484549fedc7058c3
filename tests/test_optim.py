"""gpuflat.optim: the flat AdamW, SGD and Lion over a resident model.

The update kernel runs on the emulated device (the CUDA source on the host)
and in the host backend's native build, the NumPy backend is the reference:
all three must give the same bits, step after step, for every real dtype,
with and without the clip, with several parameter groups; and the result
must be PyTorch's formulas (checked here against a plain float64 loop, and
against torch.optim in test_torch_optim); Lion's are lion-pytorch's.
"""
import ast
import math
import sys
from pathlib import Path

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src.backends.cuda import ITEM
from gpuflat._src.backends.selection import get_backend
from gpuflat._src.dtypes import TAGS, dtype_of_tag
from gpuflat._src.layout import PARAM_ROW_FIELDS, RULES, TAG_OF_NAME, precision_word
from gpuflat.optim import SGD, AdamW, Lion

from conftest import BACKENDS, BF16, assert_bits_equal

CLIP_EPS = 1e-6  # PyTorch's clip_grad_norm_: max_norm / (norm + 1e-6), the reference's own

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
    "adamw-maximize-amsgrad-clip": lambda r: AdamW(r, lr=0.01, betas=(0.8, 0.7), amsgrad=True, maximize=True,
                                              max_norm=2.0, groups=[{"params": ["['b']"], "amsgrad": False}]),
    "sgd-maximize": lambda r: SGD(r, lr=0.1, momentum=0.9, dampening=0.2, maximize=True,
                                  groups=[{"params": ["['e']"], "maximize": False, "momentum": 0.0}]),
    "lion": lambda r: Lion(r, lr=0.01, weight_decay=0.1),
    "lion-maximize-clip-groups": lambda r: Lion(r, lr=0.02, betas=(0.8, 0.95), weight_decay=0.1, maximize=True,
                                                max_norm=1.0, groups=[{"params": ["['b']"], "weight_decay": 0.0,
                                                                       "maximize": False, "lr": 0.05}]),
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
    """PyTorch's formulas in plain float64, leaf by leaf; ``hyper[k]`` per
    step (a list) or for every step (a dict of the rule's options)."""
    params = {k: v.astype(np.float64) for k, v in params.items()}
    state = {k: {"m": np.zeros_like(v), "v": np.zeros_like(v), "vmax": np.zeros_like(v), "step": 0}
             for k, v in params.items()}
    for t, grads in enumerate(grads_per_step):
        coef = 1.0
        if max_norm is not None:
            norm = math.sqrt(sum(float(np.sum(g.astype(np.float64) ** 2)) for g in grads.values()))
            coef = min(1.0, max_norm / (norm + 1e-6))
        for k, p in params.items():
            h = hyper[k][t] if isinstance(hyper[k], list) else hyper[k]
            g = grads[k].astype(np.float64) * coef
            g = -g if h.get("maximize") else g
            st = state[k]
            if rule == "adamw":
                (a, b), eps = h["betas"], h["eps"]
                st["step"] += 1
                n = st["step"]
                p *= 1 - h["lr"] * h["weight_decay"]
                st["m"] = a * st["m"] + (1 - a) * g
                st["v"] = b * st["v"] + (1 - b) * g * g
                if h.get("amsgrad"):
                    st["vmax"] = np.maximum(st["vmax"], st["v"])
                w = st["vmax"] if h.get("amsgrad") else st["v"]
                p -= h["lr"] / (1 - a**n) * st["m"] / (np.sqrt(w) / math.sqrt(1 - b**n) + eps)
            elif rule == "lion":  # lion-pytorch's order: decay, the sign's step, then the moment
                a, b = h["betas"]
                st["step"] += 1
                p *= 1 - h["lr"] * h["weight_decay"]
                p -= h["lr"] * np.sign(a * st["m"] + (1 - a) * g)
                st["m"] = b * st["m"] + (1 - b) * g
            else:
                d = g + h["weight_decay"] * p
                if h["momentum"]:
                    new = st["step"] == 0  # the buffer's updates so far: none, so it is made
                    st["m"] = d if new else h["momentum"] * st["m"] + (1 - h["dampening"]) * d
                    st["step"] += 1
                    d = d + h["momentum"] * st["m"] if h["nesterov"] else st["m"]
                p -= h["lr"] * d
    return params, state


ADAMW = {"lr": 0.01, "betas": (0.9, 0.99), "eps": 1e-8, "weight_decay": 0.1}
SGD_OPTIONS = {"lr": 0.05, "momentum": 0.9, "dampening": 0.2, "weight_decay": 0.01, "nesterov": False}
LION = {"lr": 0.01, "betas": (0.9, 0.99), "weight_decay": 0.1}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rule,flags", [("adamw", {}), ("adamw", {"maximize": True}), ("adamw", {"amsgrad": True}),
                                        ("adamw", {"amsgrad": True, "maximize": True}), ("sgd", {}),
                                        ("sgd", {"maximize": True}), ("lion", {}), ("lion", {"maximize": True})],
                         ids=str)
def test_formulas_are_pytorchs(backend, rule, flags):
    rng = np.random.default_rng(1)
    tree = {"w": rng.standard_normal(300), "b": rng.standard_normal(4)}
    # Large gradients, then small ones: amsgrad's maximum then differs from the second moment.
    grads = [{k: rng.standard_normal(v.shape) * (3.0 if t < 2 else 0.1) for k, v in tree.items()} for t in range(5)]
    r = gf.resident(tree, backend=backend)
    if rule == "adamw":
        opt = AdamW(r, **ADAMW, **flags, max_norm=3.0, groups=[{"params": ["['b']"], "weight_decay": 0.0}])
        hyper = {"['w']": {**ADAMW, **flags}, "['b']": {**ADAMW, **flags, "weight_decay": 0.0}}
    elif rule == "lion":
        opt = Lion(r, **LION, **flags, max_norm=3.0, groups=[{"params": ["['b']"], "weight_decay": 0.0}])
        hyper = {"['w']": {**LION, **flags}, "['b']": {**LION, **flags, "weight_decay": 0.0}}
    else:
        opt = SGD(r, **SGD_OPTIONS, **flags, max_norm=3.0)
        hyper = {k: {**SGD_OPTIONS, **flags} for k in ("['w']", "['b']")}
    for g in grads:
        for k, v in g.items():
            r.grads[k][...] = v
        opt.step()
    want, state = reference(rule, {f"['{k}']": v for k, v in tree.items()},
                            [{f"['{k}']": v for k, v in g.items()} for g in grads], hyper, max_norm=3.0)
    for k, v in want.items():
        np.testing.assert_allclose(r.params[k[2:-2]], v, rtol=1e-12, atol=1e-14)
        if flags.get("amsgrad"):
            np.testing.assert_allclose(opt.state[k]["max_exp_avg_sq"], state[k]["vmax"], rtol=1e-12, atol=1e-14)
        if rule == "lion":
            np.testing.assert_allclose(opt.state[k]["exp_avg"], state[k]["m"], rtol=1e-12, atol=1e-14)
            assert float(opt.state[k]["step"]) == state[k]["step"] == len(grads)
    opt = SGD(r, lr=0.1)
    opt.groups[0]["lr"] = -1.0
    before = np.array(r.param_buffers[0])
    with pytest.raises(ValueError, match="group 0: expected lr >= 0, got -1.0"):
        opt.step()
    assert_bits_equal(np.asarray(r.param_buffers[0]), before)
    with pytest.raises(ValueError, match="grads=False"):
        SGD(gf.resident({"w": np.ones(2)}, grads=False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sgd_counts_its_buffers_updates_so_momentum_switched_on_later_starts_one(backend):
    # PyTorch makes a momentum buffer at the first step with momentum (buf =
    # d, not damped), whenever that is; the step count says which step that is.
    rng = np.random.default_rng(2)
    tree = {"w": rng.standard_normal(50)}
    grads = [{"['w']": rng.standard_normal(50)} for _ in range(5)]
    r = gf.resident(tree, backend=backend)
    opt = SGD(r, **{**SGD_OPTIONS, "momentum": 0.0, "dampening": 0.5})
    momentum = [0.0, 0.0, 0.9, 0.9, 0.0]
    for g, mu in zip(grads, momentum):
        opt.groups[0]["momentum"] = mu
        r.grads["w"][...] = g["['w']"]
        opt.step()
    want, state = reference("sgd", {"['w']": tree["w"]}, grads,
                            {"['w']": [{**SGD_OPTIONS, "momentum": mu, "dampening": 0.5} for mu in momentum]})
    np.testing.assert_allclose(r.params["w"], want["['w']"], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(opt.state["['w']"]["momentum_buffer"], state["['w']"]["m"], rtol=1e-12)
    assert float(opt.state["['w']"]["step"]) == 2.0 == state["['w']"]["step"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_skipped_sgd_step_leaves_its_buffer_and_count(backend):
    r = gf.resident({"w": np.ones(3)}, backend=backend)
    opt = SGD(r, lr=0.1, momentum=0.9, dampening=0.5)
    r.grads["w"][...] = 2.0
    opt._flat.step(None, skip=np.asarray(1.0))
    assert float(opt.state["['w']"]["step"]) == 0.0
    assert_bits_equal(opt.state["['w']"]["momentum_buffer"], np.zeros(3))
    opt.step()  # the buffer's first update: d itself, not damped
    assert_bits_equal(opt.state["['w']"]["momentum_buffer"], np.full(3, 2.0))
    assert float(opt.state["['w']"]["step"]) == 1.0


def scaled_run(backend):
    """Steps with a loss scale of 1024 folded into the update, a NaN on step 2."""
    rng = np.random.default_rng(3)
    r = gf.resident(model(np.float32, rng), backend=backend)
    opt = AdamW(r, lr=0.01, max_norm=1.0)
    opt._flat.set_hyper([RULES["adamw"].hyper_row({**ADAMW, "betas": (0.9, 0.999), "weight_decay": 0.01})])
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


# ---------------------------------------------------------------- the row update
# Every backend's step_rows, the update of PyTorch's parameters where they lie
# (one ParamRow each), on host memory: the emulated CUDA kernels, the host
# library and the NumPy reference, against float64 and against each other.

ROW_SIZES = (0, 1, 5, ITEM + 3, 2 * ITEM)  # empty, tiny, ragged, past an item, whole items
# A row's state words, by the key of a test's tensor set that holds each.
STATE_WORDS = {"state0": "s0", "state1": "s1", "state2": "s2", "step": "step"}


def param_row(**words) -> list:
    """A parameter row (PARAM_ROW_FIELDS) of the words given by name, 0 elsewhere."""
    row = [0] * len(PARAM_ROW_FIELDS)
    for field, word in words.items():
        row[PARAM_ROW_FIELDS.index(field)] = word
    return row


def _eps(dtype) -> float:
    return 2.0**-7 if dtype == BF16 else float(np.finfo(dtype).eps)


class Rows:
    """Parameters, gradients, state and step counts in host memory, each a
    slice ``offset`` elements into an array of its own (an offset of 1 puts
    every 16-bit tensor off its 16-byte vectors), and their rows."""

    def __init__(self, rule, dtype, groups, seed, offset=0, sizes=ROW_SIZES):
        rng = np.random.default_rng(seed)
        self.rule, self.dtype, self.groups = RULES[rule], np.dtype(dtype), groups
        self.tensors = []
        for i, n in enumerate(sizes * len(groups)):
            group = i // len(sizes)
            t = {name: self._array(rng.standard_normal(n) if name == "p" else np.zeros(n), offset)
                 for name in ("p", "g", "s0", "s1", "s2")}
            t["step"], t["group"] = np.zeros(1, np.float32), group
            self.tensors.append(t)

    def _array(self, values, offset):
        whole = np.zeros(len(values) + offset, self.dtype)
        whole[offset:] = values
        return whole[offset:]

    def rows(self, keeps, precision=0) -> np.ndarray:
        """The table: ``keeps(t)`` names the words of tensor set t's row that
        are kept (state0, state1, state2, step); the others are 0. Every
        row's precision word is ``precision`` (no extra address: plain)."""
        rows = []
        for t in self.tensors:
            kept = keeps(t)
            words = {f: t[k].ctypes.data for f, k in STATE_WORDS.items() if k in kept}
            rows.append(param_row(param=t["p"].ctypes.data, grad=t["g"].ctypes.data, numel=t["p"].size,
                                  group=t["group"], precision=precision, **words))
        return np.array(rows, np.int64).reshape(-1, len(PARAM_ROW_FIELDS))

    def hyper(self) -> np.ndarray:
        return np.array([self.rule.hyper_row(g) for g in self.groups], np.float64).reshape(-1)

    def gradients(self, rng, scale):
        for t in self.tensors:
            t["g"][...] = (rng.standard_normal(t["g"].size) * scale).astype(self.dtype)

    def snapshot(self) -> list:
        return [{k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in t.items()} for t in self.tensors]


def _step_rows(backend, table, rows, factor=None, skip=0.0):
    """One step_rows; ``factor`` = (norm, max_norm, unscale)."""
    be = get_backend(backend)
    total, max_norm, unscale = (None, 0.0, 1.0) if factor is None else factor
    be.step_rows(table.rule.name, TAGS[table.dtype], rows, table.hyper(), np.zeros(2 * len(table.groups), np.int64),
                 None if total is None else np.asarray(total, np.float64), max_norm, CLIP_EPS,
                 np.array([unscale, skip]))


def _row_reference(rule, before, h, factor, keeps):
    """One step of PyTorch's formulas in float64 from the tensors ``before``
    (a snapshot's entry), for the words ``keeps`` says a row has."""
    f64 = {k: v.astype(np.float64) for k, v in before.items() if isinstance(v, np.ndarray)}
    g = f64["g"] * factor
    g = -g if h.get("maximize") else g
    p, count = f64["p"], float(before["step"][0])
    out = {}
    if rule == "adamw":
        (b1, b2), n = h["betas"], count + 1
        p = p * (1 - h["lr"] * h["weight_decay"])
        out["s0"] = b1 * f64["s0"] + (1 - b1) * g
        out["s1"] = b2 * f64["s1"] + (1 - b2) * g * g
        w = out["s1"]
        if h.get("amsgrad"):
            out["s2"] = w = np.maximum(f64["s2"], out["s1"])
        out["p"] = p - h["lr"] / (1 - b1**n) * out["s0"] / (np.sqrt(w) / math.sqrt(1 - b2**n) + h["eps"])
        out["step"] = n
    elif rule == "lion":
        b1, b2 = h["betas"]
        p = p * (1 - h["lr"] * h["weight_decay"])
        out["p"] = p - h["lr"] * np.sign(b1 * f64["s0"] + (1 - b1) * g)
        out["s0"] = b2 * f64["s0"] + (1 - b2) * g
        out["step"] = count + 1
    else:
        d = g + h["weight_decay"] * p
        if h["momentum"]:
            buf = d if count == 0 else h["momentum"] * f64["s0"] + (1 - h["dampening"]) * d
            out["s0"], out["step"] = buf, count + 1
            d = d + h["momentum"] * buf if h["nesterov"] else buf
        out["p"] = p - h["lr"] * d
    return out


def _assert_step_is_pytorchs(table, before, factor, keeps):
    """Each tensor after the step within a few roundings of the float64 step
    from the same values before it; the rest unchanged."""
    eps = _eps(table.dtype)
    for t, b in zip(table.tensors, before):
        want = _row_reference(table.rule.name, b, table.groups[t["group"]], factor, keeps(t))
        for name in ("p", "s0", "s1", "s2"):
            found = t[name].astype(np.float64)
            if name not in want:
                assert_bits_equal(t[name], b[name])
                continue
            scale = float(np.max(np.abs(want[name]), initial=0.0))
            np.testing.assert_allclose(found, want[name], rtol=4 * eps, atol=8 * eps * scale, err_msg=name)
        assert float(t["step"][0]) == want.get("step", float(b["step"][0]))


ADAMW_ROWS = [{**ADAMW, "betas": (0.8, 0.7)}, {**ADAMW, "betas": (0.8, 0.7), "maximize": True},
              {**ADAMW, "betas": (0.8, 0.7), "amsgrad": True, "weight_decay": 0.0},
              {**ADAMW, "betas": (0.8, 0.7), "amsgrad": True, "maximize": True}]


def _adamw_keeps(table):
    return lambda t: {"s0", "s1", "step"} | ({"s2"} if table.groups[t["group"]].get("amsgrad") else set())


@pytest.mark.parametrize("dtype", REAL, ids=str)
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("groups", [ADAMW_ROWS[:2], ADAMW_ROWS], ids=["maximize", "amsgrad"])
def test_adamw_rows_follow_pytorch_and_give_every_backends_bits(groups, offset, dtype):
    # Groups with and without maximize and amsgrad in one table (the amsgrad
    # instantiation takes the others' rows too); large gradients, then small
    # ones, so the running maximum differs from the second moment.
    rng = np.random.default_rng(4)
    tables = {be: Rows("adamw", dtype, groups, seed=3, offset=offset) for be in BACKENDS}
    keeps = _adamw_keeps(tables["numpy"])
    for k, (scale, factor) in enumerate([(3.0, None), (0.1, (40.0, 1.0, 0.5)), (0.1, None)]):
        grads_seed = int(rng.integers(1 << 30))
        for be, table in tables.items():
            table.gradients(np.random.default_rng(grads_seed), scale)
            before = table.snapshot()
            _step_rows(be, table, table.rows(keeps), factor)
            coef = 1.0 if factor is None else min(1.0, factor[1] / (factor[0] + CLIP_EPS)) * factor[2]
            _assert_step_is_pytorchs(table, before, coef, keeps)
    for be in ("numpy", "host"):
        for t, u in zip(tables[be].tensors, tables["emulated"].tensors):
            for name in ("p", "s0", "s1", "s2", "step"):
                assert_bits_equal(t[name], u[name])


def _step_every_backend(tables, keeps_of, grads_seed, scale, factor, skip):
    """One step of every backend's table over the same gradients (``scale``
    times seeded normals), each row keeping what ``keeps_of(table)(row)``
    names: a skipped step leaves every parameter, state and count as it
    was; any other is PyTorch's."""
    for be, table in tables.items():
        keeps = keeps_of(table)
        table.gradients(np.random.default_rng(grads_seed), scale)
        before = table.snapshot()
        _step_rows(be, table, table.rows(keeps), factor, skip)
        if skip:
            for t, b in zip(table.tensors, before):
                for name in ("p", "s0", "step"):
                    assert_bits_equal(t[name], b[name])
            continue
        coef = 1.0 if factor is None else min(1.0, factor[1] / (factor[0] + CLIP_EPS)) * factor[2]
        _assert_step_is_pytorchs(table, before, coef, keeps)


SGD_ROWS = [{**SGD_OPTIONS, "dampening": 0.3}, {**SGD_OPTIONS, "momentum": 0.0, "maximize": True},
            {**SGD_OPTIONS, "nesterov": True, "dampening": 0.0, "maximize": True}]


def _sgd_keeps(table):
    # A row keeps its buffer and count once its group has momentum (the
    # front end makes them then, at 0).
    return lambda t: {"s0", "step"} if table.groups[t["group"]]["momentum"] or t["step"][0] else set()


@pytest.mark.parametrize("dtype", REAL, ids=str)
@pytest.mark.parametrize("offset", [0, 1])
def test_sgd_rows_count_their_buffers_updates(offset, dtype):
    # Count 0: the buffer is new (d itself, not damped). A skipped step
    # leaves buffers and counts. Momentum switched off leaves a kept buffer
    # and its count; switched on, a group without one starts one at count 0.
    rng = np.random.default_rng(5)
    tables = {be: Rows("sgd", dtype, [dict(g) for g in SGD_ROWS], seed=6, offset=offset) for be in BACKENDS}
    plan = [(None, 0.0), ((40.0, 1.0, 0.5), 1.0), ((40.0, 1.0, 0.5), 0.0), (None, 0.0), (None, 0.0)]
    for k, (factor, skip) in enumerate(plan):
        if k == 3:  # momentum on in group 1 (no buffer yet), off in group 0 (its buffer kept)
            for table in tables.values():
                table.groups[1]["momentum"], table.groups[0]["momentum"] = 0.9, 0.0
        if k == 4:  # and on again in group 0: its buffer goes on from its count
            for table in tables.values():
                table.groups[0]["momentum"] = 0.5
        _step_every_backend(tables, _sgd_keeps, int(rng.integers(1 << 30)), 1.0, factor, skip)
    counts = [float(t["step"][0]) for t in tables["numpy"].tensors]
    assert counts == [3.0] * len(ROW_SIZES) + [2.0] * len(ROW_SIZES) + [4.0] * len(ROW_SIZES)
    for be in ("numpy", "host"):
        for t, u in zip(tables[be].tensors, tables["emulated"].tensors):
            for name in ("p", "s0", "step"):
                assert_bits_equal(t[name], u[name])


LION_ROWS = [dict(LION, betas=(0.8, 0.7)), dict(LION, betas=(0.8, 0.7), maximize=True),
             dict(LION, betas=(0.5, 0.9), weight_decay=0.0)]


@pytest.mark.parametrize("dtype", REAL, ids=str)
@pytest.mark.parametrize("offset", [0, 1])
def test_lion_rows_follow_lion_pytorch_and_give_every_backends_bits(offset, dtype):
    # Groups with and without maximize and decay in one table; a clipped and
    # unscaled step between plain ones, and a skipped one that leaves every
    # parameter, exp_avg and count as it was.
    rng = np.random.default_rng(6)
    tables = {be: Rows("lion", dtype, [dict(g) for g in LION_ROWS], seed=8, offset=offset) for be in BACKENDS}
    plan = [(3.0, None, 0.0), (0.1, (40.0, 1.0, 0.5), 0.0), (1.0, None, 1.0), (0.1, None, 0.0)]
    for scale, factor, skip in plan:
        _step_every_backend(tables, lambda table: lambda t: {"s0", "step"}, int(rng.integers(1 << 30)), scale,
                            factor, skip)
    assert [float(t["step"][0]) for t in tables["numpy"].tensors] == [3.0] * len(ROW_SIZES) * len(LION_ROWS)
    for be in ("numpy", "host"):
        for t, u in zip(tables[be].tensors, tables["emulated"].tensors):
            for name in ("p", "s0", "s1", "s2", "step"):
                assert_bits_equal(t[name], u[name])


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_without_a_word_its_group_needs_is_refused_before_any_write(backend):
    sgd = Rows("sgd", np.float32, [dict(SGD_OPTIONS)], seed=0, sizes=(3, 4))
    before = sgd.snapshot()
    with pytest.raises(ValueError, match=r"parameter row 1 \(group 0\): expected the address of its step count"):
        _step_rows(backend, sgd, sgd.rows(lambda t: {"s0", "step"} if t["p"].size == 3 else {"s0"}))
    adamw = Rows("adamw", np.float32, ADAMW_ROWS[1:3], seed=0, sizes=(3,))
    with pytest.raises(ValueError, match=r"parameter row 1 \(group 1\): expected the address of its max_exp_avg_sq"):
        _step_rows(backend, adamw, adamw.rows(lambda t: {"s0", "s1", "step"}))
    for t, b in zip(sgd.tensors, before):
        assert_bits_equal(t["p"], b["p"])


@pytest.mark.parametrize("dtype", REAL, ids=str)
def test_amsgrad_rows_keep_nan_as_torch_maximum_does(dtype):
    # A NaN or inf gradient makes exp_avg_sq NaN or inf; torch.maximum takes
    # NaN from either side, so max_exp_avg_sq is NaN where exp_avg_sq is.
    groups = [{**ADAMW, "amsgrad": True}]
    tables = {be: Rows("adamw", dtype, groups, seed=7, sizes=(40,)) for be in BACKENDS}
    keeps = _adamw_keeps(tables["numpy"])
    for be, table in tables.items():
        for k, bad in enumerate([np.nan, np.inf, 1.0]):
            table.gradients(np.random.default_rng(k), 1.0)
            table.tensors[0]["g"][3 * k : 3 * k + 2] = bad
            _step_rows(be, table, table.rows(keeps))
    t = tables["numpy"].tensors[0]
    assert np.array_equal(np.isnan(t["s2"].astype(np.float64)), np.isnan(t["s1"].astype(np.float64)))
    # (std::max, as PyTorch's fused kernels take it, would keep 0 at the NaNs.)
    assert np.isnan(t["s2"].astype(np.float64)[[0, 1]]).all() and np.isinf(t["s2"].astype(np.float64)[[3, 4]]).all()
    for be in ("host", "emulated"):
        for name in ("p", "s0", "s1", "s2", "step"):
            assert_bits_equal(tables[be].tensors[0][name], t[name])


# ---------------------------------------------------------------- rows of mixed precision
# A row's precision word (gpuflat._src.layout.precision_word) gives each of
# its states a dtype of its own and keeps its parameter in place, through a
# float32 master copy or with a compensation buffer. Any nonzero word in a
# table sends it through the mixed kernel (element by element), whose bits
# must be the NumPy reference's (numpy_backend._kept_update) on the emulated
# device and in the host library, and whose plain rows must give the tuned
# kernels' bits.

# A state's dtype: None is the word's field 0 (the parameter's dtype), "own"
# names the parameter's dtype explicitly.
STATE_CHOICES = (None, "own", "float32") + (("bfloat16",) if BF16 is not None else ())
MIXED_SIZES = (0, 1, 37)  # empty, tiny, a few lanes' worth with specials
MIXED_GROUPS = {
    "adamw": [dict(ADAMW, betas=(0.8, 0.7)), dict(ADAMW, betas=(0.8, 0.7), maximize=True),
              dict(ADAMW, betas=(0.8, 0.7), amsgrad=True, weight_decay=0.0),
              dict(ADAMW, betas=(0.8, 0.7), amsgrad=True, maximize=True)],
    "sgd": [dict(SGD_OPTIONS, dampening=0.3), dict(SGD_OPTIONS, momentum=0.0, maximize=True),
            dict(SGD_OPTIONS, nesterov=True, dampening=0.0, maximize=True)],
    "lion": [dict(LION, betas=(0.8, 0.7)), dict(LION, betas=(0.5, 0.9), maximize=True, weight_decay=0.0)],
}


def _keeps_for(dtype) -> tuple:
    # A float32 master copy is what a 16-bit parameter keeps; wider ones keep
    # a compensation at most; stochastic rounding is bfloat16's.
    if np.dtype(dtype).itemsize != 2:
        return ("plain", "kahan")
    return ("plain", "master", "kahan") + (("stochastic",) if np.dtype(dtype).name == "bfloat16" else ())


class MixedRows:
    """Rows of parameters of ``dtype``, one set of MIXED_SIZES rows per
    (state dtype choice, keep, group), each tensor an array of its own in
    host memory: states of the chosen dtype (nonzero, so every conversion
    shows), a float32 master copy or a compensation buffer at ``extra`` (a
    plain row has one too, never read or written), parameters holding 0."""

    def __init__(self, rule, dtype, seed):
        rng = np.random.default_rng(seed)
        self.rule, self.dtype = RULES[rule], np.dtype(dtype)
        self.groups = [dict(g) for g in MIXED_GROUPS[rule]]
        n_states = len(self.rule.state_names) + len(self.rule.flag_states)
        self.tensors = []
        for choice in STATE_CHOICES:
            name = None if choice is None else self.dtype.name if choice == "own" else choice
            sdtype = self.dtype if name is None else dtype_of_tag(TAG_OF_NAME[name])
            for keep in _keeps_for(self.dtype):
                for group in range(len(self.groups)):
                    for n in MIXED_SIZES:
                        exact = rng.standard_normal(n)
                        exact[::5] = 0.0
                        t = {"p": exact.astype(self.dtype), "g": np.zeros(n, self.dtype),
                             "s0": (0.1 * rng.standard_normal(n)).astype(sdtype),
                             "s1": (0.01 * np.abs(rng.standard_normal(n))).astype(sdtype),
                             "s2": (0.02 * np.abs(rng.standard_normal(n))).astype(sdtype),
                             "step": np.full(1, float(group), np.float32), "group": group, "keep": keep,
                             "index": len(self.tensors)}
                        if keep == "master":
                            t["extra"] = exact.astype(np.float32)
                        else:
                            t["extra"] = (_eps(self.dtype) * 0.3 * rng.standard_normal(n)).astype(self.dtype)
                        # Each stochastically rounded row with a key of its own.
                        t["precision"] = precision_word([name] * n_states, keep,
                                                        len(self.tensors) + 1 if keep == "stochastic" else 0)
                        self.tensors.append(t)

    def keeps(self, t) -> set:
        """The state and count words a row has: every state AdamW may use
        (max_exp_avg_sq without amsgrad too: never read or written then);
        SGD's buffer and count with momentum, and in every other row
        without; Lion's exp_avg and count."""
        if self.rule.name == "sgd":
            with_buffer = self.groups[t["group"]]["momentum"] or t["index"] % 2
            return {"s0", "step"} if with_buffer else set()
        return {"s0", "s1", "s2", "step"} if self.rule.name == "adamw" else {"s0", "step"}

    def rows(self) -> np.ndarray:
        rows = []
        for t in self.tensors:
            kept = self.keeps(t)
            words = {f: t[k].ctypes.data for f, k in STATE_WORDS.items() if k in kept}
            rows.append(param_row(param=t["p"].ctypes.data, grad=t["g"].ctypes.data, numel=t["p"].size,
                                  group=t["group"], extra=t["extra"].ctypes.data, precision=t["precision"],
                                  **words))
        return np.array(rows, np.int64).reshape(-1, len(PARAM_ROW_FIELDS))

    def hyper(self) -> np.ndarray:
        return np.array([self.rule.hyper_row(g) for g in self.groups], np.float64).reshape(-1)

    def gradients(self, rng, scale, specials):
        """Seeded normals times ``scale``; with ``specials``, NaN, inf, -inf
        and 0 at elements 1 to 4 of every row holding them."""
        for t in self.tensors:
            g = rng.standard_normal(t["g"].size) * scale
            if specials and g.size > 4:
                g[1:5] = [np.nan, np.inf, -np.inf, 0.0]
            t["g"][...] = g.astype(self.dtype)


NAMES = ("p", "g", "s0", "s1", "s2", "extra", "step")


@pytest.mark.parametrize("dtype", REAL, ids=str)
@pytest.mark.parametrize("rule", list(MIXED_GROUPS))
def test_mixed_rows_give_the_numpy_references_bits(rule, dtype):
    # Every state dtype choice and keep, plain rows (word 0) among them, in
    # one table over groups with and without amsgrad, maximize and momentum:
    # a step, a clipped and unscaled one with NaN and inf gradients, a
    # skipped one and a small one.
    rng = np.random.default_rng(11)
    tables = {be: MixedRows(rule, dtype, seed=12) for be in BACKENDS}
    before = [{k: v.copy() for k, v in t.items() if isinstance(v, np.ndarray)} for t in tables["numpy"].tensors]
    for scale, factor, skip, specials in [(1.0, None, 0.0, False), (3.0, (40.0, 1.0, 0.5), 0.0, True),
                                          (1.0, None, 1.0, False), (0.1, None, 0.0, False)]:
        seed = int(rng.integers(1 << 30))
        for be, table in tables.items():
            table.gradients(np.random.default_rng(seed), scale, specials)
            total, max_norm, unscale = (None, 0.0, 1.0) if factor is None else factor
            get_backend(be).step_rows(rule, TAGS[table.dtype], table.rows(), table.hyper(),
                                      np.zeros(2 * len(table.groups), np.int64),
                                      None if total is None else np.asarray(total, np.float64), max_norm, CLIP_EPS,
                                      np.array([unscale, skip]))
    ref = tables["numpy"]
    for be in ("host", "emulated"):
        for t, u in zip(tables[be].tensors, ref.tensors):
            for name in NAMES:
                assert_bits_equal(t[name], u[name])
    # What a row does not use is never written: a plain row's extra, AdamW's
    # max_exp_avg_sq without amsgrad, SGD's buffer without momentum.
    for t, b in zip(ref.tensors, before):
        untouched = ["extra"] if t["keep"] in ("plain", "stochastic") else []
        if rule == "adamw" and not ref.groups[t["group"]].get("amsgrad"):
            untouched.append("s2")
        if rule == "sgd" and not ref.groups[t["group"]]["momentum"]:
            untouched.append("s0")
        for name in untouched:
            assert_bits_equal(t[name], b[name])
    # Every row of a nonempty size moved, and its specials made NaN or inf.
    moved = [t for t in ref.tensors if t["p"].size > 4]
    assert all(not np.isfinite(t["p"][1:4].astype(np.float64)).all() for t in moved)


@pytest.mark.parametrize("dtype", REAL, ids=str)
@pytest.mark.parametrize("rule", list(MIXED_GROUPS))
def test_plain_rows_through_the_mixed_kernel_give_the_tuned_kernels_bits(rule, dtype):
    # A word naming the parameter's own dtype for every state is a plain row
    # that the backends send through the mixed kernel (the word is not 0);
    # with the word 0 they take the tuned (or generic) row kernel, whose 16-byte
    # vectors and whose division through a reciprocal (float AdamW) must not
    # change a bit. Offset 1 puts every 16-bit tensor off its vectors.
    groups = MIXED_GROUPS[rule]
    n_states = len(RULES[rule].state_names) + len(RULES[rule].flag_states)
    explicit = precision_word([np.dtype(dtype).name] * n_states)
    sizes = (0, 1, 5, 300)
    rng = np.random.default_rng(13)
    for offset in (0, 1):
        tables = {(be, word): Rows(rule, dtype, [dict(g) for g in groups], seed=14, offset=offset, sizes=sizes)
                  for be in ("host", "emulated") for word in (0, explicit)}
        keeps = {"adamw": _adamw_keeps, "sgd": _sgd_keeps, "lion": lambda table: lambda t: {"s0", "step"}}[rule]
        for factor in (None, (40.0, 1.0, 0.5), None):
            seed = int(rng.integers(1 << 30))
            for (be, word), table in tables.items():
                table.gradients(np.random.default_rng(seed), 1.0)
                rows = table.rows(keeps(table), word)
                total, max_norm, unscale = (None, 0.0, 1.0) if factor is None else factor
                get_backend(be).step_rows(rule, TAGS[table.dtype], rows, table.hyper(),
                                          np.zeros(2 * len(groups), np.int64),
                                          None if total is None else np.asarray(total, np.float64), max_norm,
                                          CLIP_EPS, np.array([unscale, 0.0]))
        for be in ("host", "emulated"):
            for t, u in zip(tables[be, 0].tensors, tables[be, explicit].tensors):
                for name in ("p", "s0", "s1", "s2", "step"):
                    assert_bits_equal(t[name], u[name])
        assert not np.array_equal(tables["host", 0].tensors[-1]["p"], tables["host", 0].tensors[-1]["g"])


def _same_bits_or_both_nan(found, want):
    """The same bits, except that a NaN may be any NaN (which operand's NaN
    an operation passes on is the compiler's choice)."""
    nan = np.isnan(want.astype(np.float32))
    assert_bits_equal(np.isnan(found.astype(np.float32)), nan)
    assert_bits_equal(found[~nan], want[~nan])


@pytest.mark.parametrize("dtype", [d for d in REAL if d.itemsize == 2], ids=str)
@pytest.mark.parametrize("rule", list(MIXED_GROUPS))
def test_every_16_bit_pattern_through_each_keep_gives_the_numpy_references_bits(rule, dtype):
    # The host library widens a 16-bit row's tensors, updates them and
    # narrows them back a chunk at a time in vector loops: every bit pattern
    # (zeros, subnormals, the largest values, whose updates overflow to inf,
    # infinities and NaNs of every payload) as a parameter, a gradient, a
    # state, a compensation and a master copy, in rows kept plain (word 0),
    # through a master copy, with a compensation and stochastically rounded,
    # for every group, against the NumPy reference and the emulated kernels.
    patterns = np.arange(1 << 16, dtype=np.uint16)
    n_states = len(RULES[rule].state_names) + len(RULES[rule].flag_states)
    groups = [dict(g, lr=2.0) for g in MIXED_GROUPS[rule]]  # steps that take the largest values past inf
    hyper = np.array([RULES[rule].hyper_row(g) for g in groups], np.float64).reshape(-1)
    found = {}
    for be in BACKENDS:
        rng = np.random.default_rng(31)
        for keep in _keeps_for(dtype):
            word = 0 if keep == "plain" else precision_word([None] * n_states, keep, 7 if keep == "stochastic" else 0)
            tensors = []
            for group in range(len(groups)):
                t = {name: rng.permutation(patterns).view(dtype) for name in ("p", "g", "s0", "s1", "s2")}
                t["extra"] = rng.permutation(patterns).view(dtype)
                if keep == "master":
                    t["extra"] = t["extra"].astype(np.float32)
                t["step"] = np.full(1, float(group), np.float32)
                tensors.append(t)
            rows = np.array([param_row(param=t["p"].ctypes.data, grad=t["g"].ctypes.data, numel=t["p"].size,
                                       group=group, extra=t["extra"].ctypes.data, precision=word,
                                       **{f: t[k].ctypes.data for f, k in STATE_WORDS.items()})
                             for group, t in enumerate(tensors)], np.int64)
            get_backend(be).step_rows(rule, TAGS[np.dtype(dtype)], rows, hyper,
                                      np.zeros(2 * len(groups), np.int64), None, 0.0, CLIP_EPS,
                                      np.array([0.5, 0.0]))
            found[be, keep] = tensors
    for (be, keep), tensors in found.items():
        for t, u in zip(tensors, found["numpy", keep]):
            for name in NAMES:
                _same_bits_or_both_nan(t[name], u[name])
    # The patterns reached every kind of result: subnormal, NaN and, but for
    # Lion (whose steps are +-lr and whose moment is a convex combination),
    # overflowed: more infinities than the two each tensor started with.
    tiny = np.float32(2.0**-14 if np.dtype(dtype) == np.float16 else 2.0**-126)
    out = np.concatenate([t[name] for t in found["numpy", "plain"] for name in ("p", "s0", "s1")]).astype(np.float32)
    assert ((np.abs(out) < tiny) & (out != 0)).any() and np.isnan(out).any()
    assert rule == "lion" or np.isinf(out).sum() > 2 * 3 * len(groups)


# (rule, its options without lr): updates of about lr per step for
# gradients of about 1 with a fixed sign per element.
TRACKED = {"adamw": dict(ADAMW, betas=(0.9, 0.99), weight_decay=0.0),
           "sgd": dict(SGD_OPTIONS, momentum=0.0, dampening=0.0, weight_decay=0.0),
           "lion": dict(LION, betas=(0.9, 0.99), weight_decay=0.0)}


def _tracked_reference(rule, p, grads, h):
    """The float64 run of ``rule`` over ``grads`` (PyTorch's and lion-pytorch's formulas)."""
    p, m, v = p.astype(np.float64), np.zeros(p.size), np.zeros(p.size)
    for n, g in enumerate(grads, start=1):
        if rule == "adamw":
            (b1, b2) = h["betas"]
            m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
            p = p - h["lr"] / (1 - b1**n) * m / (np.sqrt(v) / math.sqrt(1 - b2**n) + h["eps"])
        elif rule == "lion":
            (b1, b2) = h["betas"]
            p = p - h["lr"] * np.sign(b1 * m + (1 - b1) * g)
            m = b2 * m + (1 - b2) * g
        else:
            p = p - h["lr"] * g
    return p


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [np.dtype(np.float16)] + ([BF16] if BF16 is not None else []), ids=str)
@pytest.mark.parametrize("rule", list(TRACKED))
def test_master_and_kahan_rows_track_float64_where_plain_16_bit_stalls(rule, dtype, backend):
    # Steps of an eighth of a 16-bit unit in the last place on parameters in
    # [1, 2): a plain 16-bit parameter rounds each away and stays put; the
    # float32 master copy and the compensated sum keep them, so after 64
    # steps (8 units) their parameter is the float64 run's rounded (within
    # half a unit, and what a compensation buffer of 16 bits loses on the
    # way). Every backend, the NumPy reference too, since the bits are the same.
    ulp = _eps(dtype)
    h = dict(TRACKED[rule], lr=ulp / 8)
    rng = np.random.default_rng(15)
    start = rng.uniform(1.0, 2.0, 256).astype(dtype)
    sign = np.where(rng.uniform(size=256) < 0.5, -1.0, 1.0)
    grads = [(sign * rng.uniform(0.75, 1.25, 256)).astype(dtype) for _ in range(64)]
    tensors = []
    for keep in ("plain", "master", "kahan"):
        # float32 states, so that the parameter's keep is the only difference from the float64 run's precision.
        t = {"p": start.copy(), "g": np.zeros(256, dtype), "s0": np.zeros(256, np.float32),
             "s1": np.zeros(256, np.float32), "step": np.zeros(1, np.float32),
             "extra": start.astype(np.float32) if keep == "master" else np.zeros(256, dtype)}
        tensors.append(t)
    n_states = len(RULES[rule].state_names)
    states = {"adamw": ("s0", "s1"), "sgd": (), "lion": ("s0",)}[rule]
    rows = np.array([param_row(param=t["p"].ctypes.data, grad=t["g"].ctypes.data, numel=256,
                               extra=t["extra"].ctypes.data, precision=precision_word(["float32"] * n_states, keep),
                               **{f: t[k].ctypes.data for f, k in STATE_WORDS.items() if k in (*states, "step")
                                  and (k != "step" or states)})
                     for t, keep in zip(tensors, ("plain", "master", "kahan"))], np.int64)
    hyper = np.array(RULES[rule].hyper_row(h), np.float64)
    for g in grads:
        for t in tensors:
            t["g"][...] = g
        get_backend(backend).step_rows(rule, TAGS[np.dtype(dtype)], rows, hyper, np.zeros(2, np.int64), None, 0.0,
                                       CLIP_EPS, np.array([1.0, 0.0]))
    want = _tracked_reference(rule, start, [g.astype(np.float64) for g in grads], h)
    unit = ulp * 2.0 ** np.floor(np.log2(np.abs(want)))  # the unit in the last place at each element
    plain, master, kahan = (np.abs(t["p"].astype(np.float64) - want) / unit for t in tensors)
    assert np.mean(plain) > 4.0, "the plain 16-bit parameter was expected to stall"
    assert np.max(master) <= 0.5 + 1e-3 and np.max(kahan) <= 0.75
    # The master copy is the float64 run to float32's precision; the compensated sum nearly so.
    assert np.max(np.abs(tensors[1]["extra"] - want) / unit) <= 1e-2
    compensated = tensors[2]["p"].astype(np.float64) + tensors[2]["extra"].astype(np.float64)
    assert np.max(np.abs(compensated - want) / unit) <= 0.25


# ---------------------------------------------------------------- update statistics
# With ``stats``, step_rows also writes each row's (sum of d**2, sum of w**2)
# over its elements, w the value the rule produced in the compute type before
# rounding into storage and d = w - held (held: the parameter, its master
# copy, or parameter + compensation): the NumPy backend's reference, the host
# library's own loops and the kernels' per-item partials with their
# finisher. The parameters and states get the bits a step without them gets.


def _stats_call(backend, table, rows, stats, factor=None, skip=0.0):
    be = get_backend(backend)
    total, max_norm, unscale = (None, 0.0, 1.0) if factor is None else factor
    be.step_rows(table.rule.name, TAGS[table.dtype], rows, table.hyper(), np.zeros(2 * len(table.groups), np.int64),
                 None if total is None else np.asarray(total, np.float64), max_norm, CLIP_EPS,
                 np.array([unscale, skip]), stats)


def _restore(table, snapshot):
    for t, b in zip(table.tensors, snapshot):
        for name, v in b.items():
            if isinstance(v, np.ndarray):
                t[name][...] = v


def _float64_stats(held, after):
    d = after.astype(np.float64) - held.astype(np.float64)
    return [float(np.sum(d * d)), float(np.sum(after.astype(np.float64) ** 2))]


STATS_GROUPS = {"adamw": ADAMW_ROWS[:2], "adamw-amsgrad": ADAMW_ROWS[1:3], "sgd": SGD_ROWS,
                "lion": LION_ROWS[:2]}
STATS_KEEPS = {"adamw": _adamw_keeps, "adamw-amsgrad": _adamw_keeps, "sgd": _sgd_keeps,
               "lion": lambda table: lambda t: {"s0", "step"}}


@pytest.mark.parametrize("dtype", REAL, ids=str)
@pytest.mark.parametrize("case", list(STATS_GROUPS))
def test_row_stats_leave_the_bits_and_sum_each_rows_update(case, dtype):
    # The tuned kernels (their 16-byte vectors at offset 0, one element at a
    # time at offset 1 for 16-bit tensors), AMSGrad's, and the generic one
    # (Lion), on every backend: a step with stats gives the bits of one
    # without; the stats are the NumPy reference's, which for float32 and
    # float64 (storage holds w) is the float64 sum over the values before
    # and after; the same call again gives the same bits; a skipped step
    # writes zeros, and so does an empty row.
    rule = case.split("-")[0]
    found = {}
    for offset in (0, 1):
        for be in BACKENDS:
            plain, timed = (Rows(rule, dtype, [dict(g) for g in STATS_GROUPS[case]], seed=21, offset=offset)
                            for _ in range(2))
            keeps = STATS_KEEPS[case](plain)
            stats = np.full((len(timed.tensors), 2), np.nan)
            for table in (plain, timed):
                table.gradients(np.random.default_rng(22), 1.0)
            before = timed.snapshot()
            _stats_call(be, plain, plain.rows(keeps), None, (40.0, 1.0, 0.5))
            _stats_call(be, timed, timed.rows(keeps), stats, (40.0, 1.0, 0.5))
            for t, u in zip(plain.tensors, timed.tensors):
                for name in ("p", "s0", "s1", "s2", "step"):
                    assert_bits_equal(t[name], u[name])
            if np.dtype(dtype).itemsize >= 4:
                want = [_float64_stats(b["p"], t["p"]) for b, t in zip(before, timed.tensors)]
                np.testing.assert_allclose(stats, want, rtol=1e-5, atol=0, err_msg=be)
            assert [list(s) for s, t in zip(stats, timed.tensors) if t["p"].size == 0] == [[0.0, 0.0]] * len(timed.groups)
            found[offset, be] = stats
            again = np.full_like(stats, np.nan)
            _restore(timed, before)
            _stats_call(be, timed, timed.rows(keeps), again, (40.0, 1.0, 0.5))
            assert_bits_equal(again, stats)
            skipped = np.full_like(stats, np.nan)
            _stats_call(be, timed, timed.rows(keeps), skipped, (40.0, 1.0, 0.5), skip=1.0)
            assert_bits_equal(skipped, np.zeros_like(stats))
        for be in ("host", "emulated"):
            np.testing.assert_allclose(found[offset, be], found[offset, "numpy"], rtol=1e-5, atol=0, err_msg=be)
        assert (found[offset, "numpy"][[t["p"].size > 0 for t in timed.tensors]] > 0).all()


@pytest.mark.parametrize("dtype", REAL, ids=str)
@pytest.mark.parametrize("rule", list(MIXED_GROUPS))
def test_mixed_row_stats_sum_the_kept_values_update(rule, dtype):
    # The mixed kernel's rows, every keep (plain, master, kahan, stochastic)
    # and state dtype: the same bits as without stats, the NumPy reference's
    # stats, and for master rows the float64 sums over the master copy
    # before and after; a skipped step writes zeros.
    found = {}
    for be in BACKENDS:
        plain, timed = MixedRows(rule, dtype, seed=23), MixedRows(rule, dtype, seed=23)
        stats = np.full((len(timed.tensors), 2), np.nan)
        for table in (plain, timed):
            table.gradients(np.random.default_rng(24), 1.0, False)
        before = [{k: v.copy() for k, v in t.items() if isinstance(v, np.ndarray)} for t in timed.tensors]
        for table, out in ((plain, None), (timed, stats)):
            get_backend(be).step_rows(rule, TAGS[table.dtype], table.rows(), table.hyper(),
                                      np.zeros(2 * len(table.groups), np.int64), None, 0.0, CLIP_EPS,
                                      np.array([1.0, 0.0]), out)
        for t, u in zip(plain.tensors, timed.tensors):
            for name in NAMES:
                assert_bits_equal(t[name], u[name])
        for s, t, b in zip(stats, timed.tensors, before):
            if t["keep"] == "master":
                np.testing.assert_allclose(s, _float64_stats(b["extra"], t["extra"]), rtol=1e-5, atol=0)
            if t["p"].size == 0:
                assert list(s) == [0.0, 0.0]
        found[be] = stats
        skipped = np.full_like(stats, np.nan)
        get_backend(be).step_rows(rule, TAGS[timed.dtype], timed.rows(), timed.hyper(),
                                  np.zeros(2 * len(timed.groups), np.int64), None, 0.0, CLIP_EPS,
                                  np.array([1.0, 1.0]), skipped)
        assert_bits_equal(skipped, np.zeros_like(stats))
    for be in ("host", "emulated"):
        np.testing.assert_allclose(found[be], found["numpy"], rtol=1e-5, atol=0, err_msg=be)


def test_row_stats_are_checked():
    table = Rows("sgd", np.float32, [dict(SGD_OPTIONS)], seed=0, sizes=(3, 4))
    for be in BACKENDS:
        with pytest.raises(ValueError, match=r"stats: expected a C-contiguous float64 array of shape \(2, 2\)"):
            _stats_call(be, table, table.rows(_sgd_keeps(table)), np.zeros((2, 3)))
