"""gf.resident: a model in flat buffers, per-step calls without a tree walk."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src import tree as gtree
from gpuflat._src.residency import ALIGN_BYTES

from conftest import DTYPES, DTYPE_IDS, assert_bits_equal, exact_norm, random_array, ref_unique, rel_err


def _mixed_model(rng):
    w = random_array(rng, (5, 7), np.float32)
    return {
        "enc": {"w": w, "b": random_array(rng, (7,), np.float32), "scale": random_array(rng, (), np.float64)},
        "half": random_array(rng, (3, 3), np.float16),
        "z": random_array(rng, (4,), np.complex64),
        "empty": np.zeros((0, 3), np.float32),
        "dec": w,  # tied to enc.w
        "steps": np.arange(3),  # not trainable
        "act": "relu",
    }


def _fill_grads(r, rng):
    for path, g in gf.trainables(r.grads, path=True):
        g[...] = random_array(rng, g.shape, g.dtype)


def test_params_are_aligned_views_into_one_buffer_per_dtype(backend):
    rng = np.random.default_rng(0)
    model = _mixed_model(rng)
    r = gf.resident(model, backend=backend)
    assert [b.dtype for b in r.param_buffers] == [np.float32, np.float64, np.float16, np.complex64]
    assert r.params["enc"]["w"] is r.params["dec"] and r.params["act"] == "relu"
    assert r.params["steps"] is model["steps"]
    for (path, view), (_, original) in zip(gf.trainables(r.params, path=True), ref_unique(model)):
        assert_bits_equal(view, original)
        s = next(s for s in r.layout if s.path == path)
        buffer = r.param_buffers[s.buffer]
        assert np.shares_memory(view, buffer) or view.size == 0
        assert (s.offset * buffer.itemsize) % ALIGN_BYTES == 0
    # Padding is zero: the buffer's norm is the model's.
    total = math.sqrt(sum(exact_norm([b]) ** 2 for b in r.param_buffers))
    assert rel_err(total, exact_norm([a for _, a in ref_unique(model)])) < 1e-12


@pytest.mark.parametrize("ord", [1, 2, math.inf, 3])
def test_grad_norm_and_per_leaf_match_the_tree_functions(ord, backend):
    rng = np.random.default_rng(1)
    r = gf.resident(_mixed_model(rng), backend=backend)
    _fill_grads(r, rng)
    grads = [a for _, a in ref_unique(r.grads)]
    total, per = r.grad_norm(ord, per_leaf=True)
    assert rel_err(total, exact_norm(grads, ord)) < 1e-12
    ref_total, ref_per = gf.global_norm(r.grads, ord, per_leaf=True, backend=backend)
    assert per.shape == ref_per.shape
    for got, a in zip(per, grads):  # plan order, paddings left out
        assert rel_err(got, exact_norm([a], ord)) < 1e-12
    assert rel_err(r.param_norm(ord), gf.global_norm(r.params, ord, backend=backend)) < 1e-12


@pytest.mark.parametrize("ord", [1, 2, math.inf, 3])
def test_total_norm_is_the_tree_norms_bits_on_every_backend(ord):
    # The norm reads the leaves' slots in the tree's order, never the
    # padding: the bits of gf.global_norm of the same gradients on every
    # backend, and the kernels' order gives the host and the emulated device
    # the same bits (NumPy keeps its own order).
    rng = np.random.default_rng(11)
    model = {f"l{i}": random_array(rng, (int(n),), np.float32) for i, n in enumerate(rng.integers(1, 300, 40))}
    got = []
    for backend in ("numpy", "host", "emulated"):
        r = gf.resident(model, backend=backend)
        for k, v in model.items():
            r.grads[k][...] = v
        total = np.asarray(r.grad_norm(ord))
        assert_bits_equal(total, np.asarray(gf.global_norm(r.grads, ord, backend=backend)))
        assert rel_err(total, exact_norm(list(model.values()), ord)) < 1e-12
        got.append(total)
    assert_bits_equal(got[1], got[2])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_clip_gives_the_tree_clip_bits_for_one_dtype(dtype, backend):
    rng = np.random.default_rng(2)
    sizes = [1, 4095, 4096, 4097, 0, 33]
    r = gf.resident({f"l{i}": random_array(rng, (n,), dtype) for i, n in enumerate(sizes)}, backend=backend)
    _fill_grads(r, rng)
    copies = {k: v.copy() for k, v in r.grads.items()}
    norm = r.clip_grad_norm_(0.25)
    ref = gf.clip_grad_norm_(copies, 0.25, backend=backend)
    assert rel_err(norm, float(ref)) < 1e-13
    for k in copies:
        np.testing.assert_allclose(r.grads[k].astype(np.complex128), copies[k].astype(np.complex128),
                                   rtol=2e-3 if np.dtype(dtype).itemsize <= 2 else 1e-6)


def test_error_if_nonfinite_names_the_leaf_and_scales_nothing(backend):
    rng = np.random.default_rng(3)
    r = gf.resident(_mixed_model(rng), backend=backend)
    _fill_grads(r, rng)
    r.grads["half"][1, 2] = np.inf
    before = [b.copy() for b in r.grad_buffers]
    with pytest.raises(gf.NonFiniteError, match=r"\['half'\]"):
        r.clip_grad_norm_(1.0, error_if_nonfinite=True)
    for b, old in zip(r.grad_buffers, before):
        assert_bits_equal(b, old)


def test_zero_grad_and_no_grads():
    r = gf.resident({"w": np.ones(3)})
    r.grads["w"][...] = 2.0
    r.zero_grad()
    assert (r.grad_buffers[0] == 0).all()
    frozen = gf.resident({"w": np.ones(3)}, grads=False)
    assert frozen.grads is None and float(frozen.param_norm()) == pytest.approx(math.sqrt(3))
    with pytest.raises(ValueError, match="grads=False"):
        frozen.grad_norm()


def test_buffers_are_the_resident_memory_cut_at_the_leaves(backend):
    rng = np.random.default_rng(6)
    r = gf.resident(_mixed_model(rng), backend=backend)
    _fill_grads(r, rng)
    bufs = r.buffers()
    assert len(bufs.dtypes) == len(r.param_buffers)
    held = {}
    for b, d in enumerate(bufs.dtypes):
        assert np.shares_memory(d.params, r.param_buffers[b]) and d.params.size == r.param_buffers[b].size
        assert np.shares_memory(d.grads, r.grad_buffers[b]) and d.grads.size == r.grad_buffers[b].size
        assert d.plan.size == d.params.size and d.plan.dtype == r.param_buffers[b].dtype
        for k, slot in d.slot_of.items():
            s, leaf = r.layout[k], d.plan.leaves[slot]
            assert (s.buffer, s.offset, s.size, s.path) == (b, leaf.offset, leaf.size, leaf.path)
            held[k] = b
        padding = [leaf for i, leaf in enumerate(d.plan.leaves) if i not in d.slot_of.values()]
        assert all(not np.asarray(d.params[leaf.offset : leaf.offset + leaf.size]).any() for leaf in padding)
    assert sorted(held) == list(range(len(r.layout)))
    bufs.follow()
    with bufs.scope():
        for ord in (1, 2, math.inf):
            assert_bits_equal(np.asarray(bufs.grad_norm(float(ord))), np.asarray(r.grad_norm(ord)))
        table = bufs.zeros(5, np.int64)
    assert table.array.shape == (5,) and table.array.dtype == np.int64 and not np.asarray(table.array).any()
    assert bufs.gradless() == frozenset() and bufs.to_caller(bufs.dtypes[0].params) is bufs.dtypes[0].params


def test_buffers_need_gradients():
    with pytest.raises(ValueError, match="grads=False"):
        gf.resident({"w": np.ones(3)}, grads=False).buffers()


def test_per_step_calls_never_walk_the_tree(monkeypatch, backend):
    r = gf.resident({f"w{i}": np.ones(10, np.float32) for i in range(300)}, backend=backend)
    _fill_grads(r, np.random.default_rng(4))

    def no_walk(*args, **kwargs):
        raise AssertionError("a per-step call walked the tree")

    monkeypatch.setattr(gtree, "walk", no_walk)
    r.grad_norm(per_leaf=True)
    r.clip_grad_norm_(1.0)
    r.param_norm()
    r.zero_grad()


def test_backend_calls_per_step_do_not_grow_with_the_leaves():
    from gpuflat._src.backends import get_backend

    be = get_backend("numpy")
    counts = []
    for n in (10, 1000):
        r = gf.resident({f"w{i}": np.ones(1000 // n * 10, np.float32) for i in range(n)}, backend="numpy")
        calls = []
        original = be.norms
        be.norms = lambda *a, **k: calls.append(1) or original(*a, **k)
        try:
            r.clip_grad_norm_(1.0)
        finally:
            be.norms = original
        counts.append(len(calls))
    assert counts == [1, 1]


@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_a_host_clip_reads_a_table_of_the_leaves_whatever_the_leaf_count(kind, monkeypatch):
    # One native norm over the table of the leaves' places built once (no
    # array read per leaf) and one native scale per buffer, never the
    # per-leaf ones, for 20 leaves or 10,000 holding the same elements. A PyTorch model's checks
    # read the parameters in one native pass for their storage and one for
    # their gradients, and follow nothing when nothing changed.
    from gpuflat._src import native, tensor_facts

    lib = native.host_library()[0]
    if lib is None or (kind == "torch" and not tensor_facts.available()):
        pytest.skip(f"the native libraries do not build here: {native.unavailable_reason()}")
    calls = []
    for name in ("gf_host_norms", "gf_host_norms_rows",
                 "gf_host_clip", "gf_host_clip_flat", "gf_host_clip_rows"):
        monkeypatch.setattr(lib, name, lambda *a, _f=getattr(lib, name), _n=name: calls.append(_n) or _f(*a))
    if kind == "torch":
        for name in ("of_tensors", "gradients"):
            f = getattr(tensor_facts, name)
            monkeypatch.setattr(tensor_facts, name, lambda *a, _f=f, _n=name: calls.append(_n) or _f(*a))
    for leaves in (20, 10_000):
        if kind == "numpy":
            model = {f"w{i}": np.ones(200_000 // leaves, np.float32) for i in range(leaves)}
        else:
            model = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(200_000 // leaves)) for _ in range(leaves))
            for p in model:
                p.grad = torch.ones_like(p)
        r = gf.resident(model, backend="host")
        if kind == "numpy":
            for g in r.grads.values():
                g[:] = 1
        else:
            monkeypatch.setattr(r._binding, "_adopt_grad", lambda *a: calls.append("a gradient followed"))
        del calls[:]
        assert float(r.clip_grad_norm_(1.0)) == pytest.approx(math.sqrt(200_000))
        checks = ["of_tensors", "gradients"] if kind == "torch" else []
        assert calls == [*checks, "gf_host_norms_rows", "gf_host_clip_flat"], leaves


def test_jax_trees_are_refused_with_the_functional_way_named():
    jnp = pytest.importorskip("jax.numpy")
    with pytest.raises(TypeError, match="clip_by_global_norm"):
        gf.resident({"w": jnp.ones(3)})


# ---------------------------------------------------------------- PyTorch


torch = pytest.importorskip("torch")


class TiedNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))
        self.norm = torch.nn.BatchNorm1d(8)
        self.out = torch.nn.Linear(8, 11, bias=False)
        self.out.weight = self.embed.weight  # tied embedding and output layer
        self.body[0].bias.requires_grad_(False)  # frozen

    def forward(self, x):
        return self.out(self.norm(self.body(self.embed(x))))


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _step(net, opt, x, y, clip):
    loss = torch.nn.functional.cross_entropy(net(x), y)
    loss.backward()
    norm = clip()
    opt.step()
    opt.zero_grad()  # set_to_none=True: the next backward allocates new gradients
    return float(norm)


def test_a_resident_training_loop_matches_plain_pytorch(one_thread):
    torch.manual_seed(0)
    net = TiedNet()
    plain = copy.deepcopy(net)
    r = gf.resident(net)
    names = [n for n, p in net.named_parameters() if p.requires_grad]
    assert list(r.grads) == names and r.params is net
    for name, p in net.named_parameters():
        if p.requires_grad:  # the parameter's storage is its view into the buffer
            buf = r.param_buffers[0]
            assert buf.data_ptr() <= p.data_ptr() < buf.data_ptr() + buf.numel() * buf.element_size()
            assert p.grad is None and not r.grads[name].any()  # no gradient yet: None stays None
    opt = torch.optim.SGD([p for p in net.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    opt_plain = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        x, y = torch.randint(0, 11, (6,), generator=gen), torch.randint(0, 11, (6,), generator=gen)
        got = _step(net, opt, x, y, lambda: r.clip_grad_norm_(0.5))
        want = _step(plain, opt_plain, x, y,
                     lambda: torch.nn.utils.clip_grad_norm_([p for p in plain.parameters() if p.requires_grad], 0.5))
        assert got == pytest.approx(want, rel=1e-5)
    for (name, a), (_, b) in zip(net.state_dict().items(), plain.state_dict().items()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_rebound_pytorch_gradients_are_copied_in_and_rebound(one_thread):
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    r = gf.resident(net)
    views = r.grads
    net.zero_grad(set_to_none=True)
    net(torch.ones(2, 4)).sum().backward()  # autograd allocates new gradients
    fresh = {n: p.grad.clone() for n, p in net.named_parameters()}
    assert all(p.grad is not views[n] for n, p in net.named_parameters())
    norm = r.grad_norm()
    want = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in fresh.values()]).double())
    assert float(norm) == pytest.approx(float(want), rel=1e-12)
    for n, p in net.named_parameters():
        assert p.grad is r.grads[n] and torch.equal(p.grad, fresh[n])
    net.weight.grad = None  # None counts as zero
    assert float(r.grad_norm()) == pytest.approx(float(torch.linalg.vector_norm(fresh["bias"].double())))


def test_buffers_of_a_pytorch_model_follow_it_and_name_its_gradless_leaves():
    net = torch.nn.Linear(3, 2)
    r = gf.resident(net)
    bufs = r.buffers()
    (d,) = bufs.dtypes
    index = {s.path: k for k, s in enumerate(r.layout)}
    new = torch.arange(6.0).reshape(2, 3)
    net.weight.grad, net.bias.grad = new, None  # a new tensor, and None
    bufs.follow()
    leaf = d.plan.leaves[d.slot_of[index["weight"]]]
    np.testing.assert_array_equal(d.grads[leaf.offset : leaf.offset + leaf.size], new.reshape(-1).numpy())
    assert bufs.gradless() == {index["bias"]}
    own = bufs.to_caller(d.params)
    assert isinstance(own, torch.Tensor) and own.data_ptr() == r.param_buffers[0].data_ptr()
    with bufs.scope():
        table = bufs.zeros(4, np.float64)
    assert isinstance(table.own, torch.Tensor) and table.own.dtype == torch.float64
    table.array[2] = 5.0  # one memory in two guises
    assert table.own.tolist() == [0.0, 0.0, 5.0, 0.0]


def test_mixed_pytorch_and_numpy_leaves_are_refused():
    with pytest.raises(TypeError, match=r"\['b'\].*torch.Tensor"):
        gf.resident({"a": torch.ones(2), "b": np.ones(2)})


# ---------------------------------------------------------------- the padding stays zero


def test_a_nan_step_leaves_no_trace_in_the_next_norm(backend):
    r = gf.resident({"w": np.ones(3, np.float32), "b": np.ones(5, np.float32)}, backend=backend)
    r.grads["w"][:] = np.nan
    assert math.isnan(float(r.clip_grad_norm_(1.0)))
    r.grads["w"][:] = 1
    r.grads["b"][:] = 0
    assert float(r.grad_norm()) == pytest.approx(math.sqrt(3), rel=1e-12)
    total, per = r.grad_norm(per_leaf=True)
    np.testing.assert_allclose(per, [math.sqrt(3), 0.0], rtol=1e-12)
    (buffer,) = r.grad_buffers
    padding = np.ones(buffer.size, bool)
    for s in r.layout:
        padding[s.offset : s.offset + s.size] = False
    assert padding.any() and (buffer[padding] == 0).all()
    with pytest.raises(gf.NonFiniteError, match=r"\['b'\]"):
        r.grads["b"][2] = np.inf
        r.clip_grad_norm_(1.0, error_if_nonfinite=True)


@pytest.mark.parametrize("ord", [1, 2, math.inf])
def test_a_mixed_dtype_clip_matches_the_tree_clip(ord, backend):
    rng = np.random.default_rng(5)
    r = gf.resident(_mixed_model(rng), backend=backend)
    _fill_grads(r, rng)
    copies = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in r.grads.items()}
    copies["enc"] = {k: v.copy() for k, v in r.grads["enc"].items()}
    copies["dec"] = copies["enc"]["w"]
    norm = r.clip_grad_norm_(0.5, ord)
    ref = gf.clip_grad_norm_(copies, 0.5, ord, backend=backend)
    assert rel_err(norm, float(ref)) < 1e-12
    total, per = r.grad_norm(ord, per_leaf=True)
    assert per.shape == (len(r.layout),)
    for (path, got), (_, want) in zip(gf.trainables(r.grads, path=True), gf.trainables(copies, path=True)):
        np.testing.assert_allclose(got.astype(np.complex128), want.astype(np.complex128), rtol=2e-3, err_msg=path)


def test_per_step_table_lookups_do_not_look_at_each_leaf(monkeypatch):
    from gpuflat._src.backends import cuda

    r = gf.resident({f"w{i}": np.ones(10, np.float32) for i in range(300)}, backend="emulated")
    looked_at = []
    table = cuda._StaticTables.table
    monkeypatch.setattr(cuda._StaticTables, "table",
                        lambda self, arrays, key, build: looked_at.append(len(arrays)) or table(self, arrays, key, build))
    r.grad_norm()
    r.clip_grad_norm_(1.0)
    # The norm's table found by the identity of the one table of rows, the
    # scale's by the buffer's address alone.
    assert looked_at and all(n <= 1 for n in looked_at)


# ---------------------------------------------------------------- threads


def test_two_threads_each_get_their_own_norm():
    # Each call of a mixed-dtype model norms into scratch of its own: a
    # thread must never read another thread's.
    import sys
    import threading

    rng = np.random.default_rng(6)
    r = gf.resident({"w": random_array(rng, (300,), np.float32), "d": random_array(rng, (200,), np.float64)})
    _fill_grads(r, rng)
    want = {"grad": float(r.grad_norm()), "param": float(r.param_norm())}
    assert want["grad"] != want["param"]
    # The gradient thread alternates a clip (its factor 1: nothing scaled) and a norm.
    calls = {"grad": lambda i: r.clip_grad_norm_(1e30) if i % 2 else r.grad_norm(), "param": lambda i: r.param_norm()}
    wrong = {"grad": 0, "param": 0}
    start = threading.Barrier(2)

    def run(which):
        start.wait()
        for i in range(10_000):
            wrong[which] += float(calls[which](i)) != want[which]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        threads = [threading.Thread(target=run, args=(which,)) for which in calls]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert wrong == {"grad": 0, "param": 0}
