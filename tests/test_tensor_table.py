"""gpuflat._src.tensor_table: tensors read from their metadata, on the native host
backend and on the CUDA kernels (emulated), against float64 references; what
is remembered from call to call, and when it must not be."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import gpuflat.torch as gft
from conftest import exact_norm
from gpuflat._src import tensor_table
from gpuflat._src.backends import get_backend
from gpuflat._src.backends.protocol import LeafRows
from gpuflat.errors import NonFloatingTensorError, OverlapError, UnsupportedLeafError

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
BACKENDS = ["host", "emulated"]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """Run gpuflat.torch on the named backend, the tensors being CPU tensors."""
    with tensor_table.serve_with(get_backend(request.param)):
        yield request.param


def values(t):
    """A copy of a tensor's values as a float64 (or complex128) NumPy array, exactly."""
    t = t.detach()
    return (t.to(torch.complex128) if t.is_complex() else t.to(torch.float64)).numpy().copy()


def gradient_tensors(dtype, seed=0):
    """Contiguous, transposed, sliced, 0-d, empty and item-boundary tensors of one dtype."""
    g = torch.Generator().manual_seed(seed)
    matrices = torch.randn(2, 9, 7, generator=g).to(dtype)
    return [torch.randn(4097, generator=g).to(dtype), matrices[0].t(), matrices[1, ::2, 1:], torch.tensor(2.5).to(dtype),
            torch.zeros(0, dtype=dtype), torch.randn(3, 4, 5, generator=g).to(dtype).permute(2, 0, 1)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [1.0, 2.0, math.inf, 3.0])
def test_norm_of_every_layout_matches_the_float64_reference(backend, dtype, norm_type):
    tensors = gradient_tensors(dtype)
    got = gft.get_total_norm(tensors, norm_type)
    want = exact_norm([values(t) for t in tensors], norm_type)
    assert got.dtype == dtype.to_real()
    assert float(got) == pytest.approx(float(torch.tensor(want, dtype=torch.float64).to(dtype.to_real())), rel=1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_clip_scales_every_layout_as_pytorch_rounds(backend, dtype):
    tensors = gradient_tensors(dtype, seed=1)
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t
    before = [values(t) for t in tensors]
    norm = exact_norm(before)
    total = gft.clip_grad_norm_(params, max_norm=0.5)
    assert float(total) == pytest.approx(float(torch.tensor(norm, dtype=torch.float64).to(total.dtype)), rel=1e-12)
    # One rounding of value * factor in the dtype (the factor from a float64
    # norm within an ulp of the exact one, so within an ulp of the dtype, or
    # of float16's smallest subnormal).
    ulp = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 2e-7, torch.complex64: 2e-7}.get(dtype, 1e-15)
    tiny = 2.0 ** -24 if dtype == torch.float16 else 0.0
    for p, old in zip(params, before):
        np.testing.assert_allclose(values(p.grad), old * (0.5 / (norm + 1e-6)), rtol=ulp, atol=tiny)


def test_rows_are_read_without_importing_a_tensor(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a tensor was imported")

    params = [torch.nn.Parameter(torch.ones(3)) for _ in range(4)]
    for p in params:
        p.grad = torch.full((3,), 2.0)
    gft.clip_grad_norm_(params, 1.0)
    monkeypatch.setattr(torch.Tensor, "numpy", refused)
    monkeypatch.setattr(torch.Tensor, "__dlpack__", refused)
    total = gft.get_total_norm([p.grad for p in params])
    assert float(total) == pytest.approx(1.0, rel=1e-6)
    assert isinstance(tensor_table.read([p.grad for p in params], str).groups[0].leaves, LeafRows)


def test_the_same_tensors_find_their_table_again():
    grads = [torch.ones(5), torch.ones(2, 3).t()]
    first = tensor_table.read(grads, str, in_place=True)
    assert tensor_table.read(grads, str) is first and first.fit_in_place


def test_new_tensor_objects_in_the_same_memory_find_the_same_table():
    storage = [torch.randn(6), torch.randn(4)]
    first = tensor_table.read([s.view_as(s) for s in storage], str, in_place=True)
    again = tensor_table.read([s.view_as(s) for s in storage], str, in_place=True)
    assert again is first


@pytest.mark.parametrize("change", ["size", "dtype", "layout", "moved"])
def test_a_change_behind_the_same_address_gives_a_new_table(backend, change):
    buf = torch.arange(1.0, 13.0)
    before = [buf[:6]]
    after = {"size": [buf[:12]],
             "dtype": [buf.view(torch.float16)[:12]],
             "layout": [buf[::2]],
             "moved": [buf[6:12]]}[change]
    tensor_table.read(before, str)
    table = tensor_table.read(after, str)
    assert table.reading.facts[:, 0].tolist() == [after[0].data_ptr()]
    got = float(gft.get_total_norm(after))
    assert got == pytest.approx(exact_norm([values(after[0])]), rel=1e-3 if change == "dtype" else 1e-6)


def test_a_tensor_passed_twice_counts_once_and_two_views_of_one_memory_count_twice(backend):
    x = torch.tensor([3.0, 4.0])
    assert float(gft.get_total_norm([x, x])) == 5.0
    assert float(gft.get_total_norm([x, x.view(2)])) == pytest.approx(5.0 * math.sqrt(2), rel=1e-7)
    p, q = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    p.grad, q.grad = x, x.view(2)
    with pytest.raises(OverlapError, match=r"parameters\[0\]\.grad.*parameters\[1\]\.grad"):
        gft.clip_grad_norm_([p, q], 1.0)
    assert x.tolist() == [3.0, 4.0]


def test_interleaved_views_are_clipped_and_overlapping_ones_refused_by_name():
    base = torch.arange(1.0, 9.0)
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(3)]
    params[0].grad, params[1].grad = base[::2], base[1::2]
    gft.clip_grad_norm_(params[:2], 1.0)
    assert float(base.norm()) == pytest.approx(1.0, rel=1e-6)
    params[2].grad = base[2:6]
    snapshot = base.clone()
    with pytest.raises(OverlapError, match=r"'parameters\[0\]\.grad' and 'parameters\[2\]\.grad'"):
        gft.clip_grad_norm_(params, 1e-3)
    assert torch.equal(base, snapshot)


def test_an_expanded_gradient_is_refused_by_name():
    p = torch.nn.Parameter(torch.zeros(3, 2))
    p.grad = torch.ones(2).expand(3, 2)
    with pytest.raises(OverlapError, match=r"'parameters\[0\]\.grad'.*strides \(0, 1\)"):
        gft.clip_grad_norm_([p], 0.1)


def test_errors_name_the_leaf_counting_parameters_without_a_gradient():
    with pytest.raises(NonFloatingTensorError, match=r"'tensors\[1\]'.*torch.int32"):
        gft.get_total_norm([torch.ones(2), torch.ones(2, dtype=torch.int32)])
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    params[0].grad, params[2].grad = torch.ones(2), torch.ones(2).to_sparse()
    with pytest.raises(UnsupportedLeafError, match=r"'parameters\[2\]\.grad'.*layout"):
        gft.clip_grad_norm_(params, 1.0)
    assert params[0].grad.tolist() == [1.0, 1.0]


def test_a_tensor_subclass_that_keeps_its_own_memory_is_read_and_remembered():
    class Marked(torch.Tensor):
        pass

    grads = [torch.tensor([3.0, 4.0]).as_subclass(Marked)]
    assert float(gft.get_total_norm(grads)) == 5.0
    assert tensor_table.read(grads, str) is tensor_table.read(grads, str)


def test_a_backend_reading_arrays_only_gets_views():
    grads = [torch.tensor([3.0, 4.0]), torch.tensor([[12.0]])]
    with tensor_table.serve_with(get_backend("numpy")):
        table = tensor_table.read(grads, str)
        assert isinstance(table.groups[0].leaves, list)
        assert float(gft.get_total_norm(grads)) == 13.0


def test_a_leaf_with_more_dims_than_a_row_holds_is_read_as_an_array_on_the_host():
    base = torch.randn(3 ** 9, dtype=torch.float64)
    nine = base.as_strided((2,) * 9, tuple(3 ** k for k in range(8, -1, -1)))
    with tensor_table.serve_with(get_backend("host")):
        table = tensor_table.read([nine], str)
        assert isinstance(table.groups[0].leaves, list)
        assert float(gft.get_total_norm([nine])) == pytest.approx(exact_norm([values(nine)]), rel=1e-12)


def test_tensors_on_two_backends_are_kept_apart():
    grads = [torch.tensor([3.0, 4.0])]
    with tensor_table.serve_with(get_backend("emulated")):
        emulated = tensor_table.read(grads, str)
    assert tensor_table.read(grads, str) is not emulated
    assert emulated.groups[0].backend.name == "emulated"


# ---------------------------------------------------------------- CUDA tensors (the stand-ins)

@pytest.fixture
def cuda(monkeypatch):
    """PyTorch's CUDA side and CuPy stood in for: CUDA tensors are CPU tensors that say cuda:0."""
    import cupy_stand_in
    import torch_cuda_stand_in as tcs

    cp = cupy_stand_in.install(monkeypatch)
    with tcs.install(monkeypatch, cp):
        yield cp, tcs


def test_cuda_gradients_are_clipped_with_no_import(cuda):
    cp, tcs = cuda
    params = [tcs.parameter(torch.zeros(7)) for _ in range(20)]
    for k, p in enumerate(params):
        p.grad = tcs.cuda(torch.full((7,), float(k)))
    want = exact_norm([values(p.grad) for p in params])
    for _ in range(2):  # the second call finds its table: no upload either
        start = len(cp.events)
        total = gft.clip_grad_norm_(params, max_norm=want / 2)
        events = [e.kind for e in cp.events[start:]]
        assert events.count("from_dlpack") == 0  # no gradient, and the clip reads the norm where it lies
    assert events.count("upload") == 0 and events.count("launch") == 2  # the norm in one launch, the scale
    assert float(total) == pytest.approx(want / 2, rel=1e-6)  # the second call saw the clipped gradients
    assert float(gft.get_total_norm([p.grad for p in params])) == pytest.approx(want / 2, rel=1e-6)


def test_cpu_and_cuda_tensors_in_one_call_are_reduced_per_device(cuda):
    _, tcs = cuda
    host, device = torch.tensor([3.0, 4.0]), tcs.cuda(torch.tensor([12.0]))
    assert float(gft.get_total_norm([host, device])) == 13.0
    table = tensor_table.read([host, device], str)
    assert sorted(g.backend.name for g in table.groups) == ["cuda", "host"]
    p, q = torch.nn.Parameter(torch.zeros(2)), tcs.parameter(torch.zeros(1))
    p.grad, q.grad = host, device
    gft.clip_grad_norm_([p, q], 1.3)
    assert host.tolist() == pytest.approx([0.3, 0.4], rel=1e-6) and device.tolist() == pytest.approx([1.2], rel=1e-6)


# ---------------------------------------------------------------- a PyTorch training loop, as users break it

class TiedFrozen(torch.nn.Module):
    """A tied embedding and output, a frozen layer, a trainable one."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(11, 8)
        self.frozen = torch.nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.hidden = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 11, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, tokens):
        return self.out(torch.tanh(self.hidden(torch.tanh(self.frozen(self.embed(tokens))))))


def test_a_training_loop_with_the_drop_in_trains_as_plain_pytorch():
    """AdamW with zero_grad()'s default set_to_none, a GradScaler that skips a
    step, model.to(float64), load_state_dict(assign=True), a layer unfrozen:
    the drop-in's tables follow every change, step by step as
    torch.nn.utils.clip_grad_norm_."""
    torch.manual_seed(0)
    ours = TiedFrozen()
    theirs = TiedFrozen()
    theirs.load_state_dict(ours.state_dict())
    runs = [(ours, gft.clip_grad_norm_), (theirs, torch.nn.utils.clip_grad_norm_)]
    frozen_at_first = ours.frozen.weight.detach().clone()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m, _ in runs]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) for _ in runs]
    for step in range(8):
        if step == 4:
            for m, _ in runs:
                m.to(torch.float64)  # the same parameters, new storage and dtype
            # AdamW's float32 state cannot take float64 gradients: PyTorch users start a new optimizer.
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m, _ in runs]
        if step == 5:
            loaded = TiedFrozen().to(torch.float64).state_dict()
            for m, _ in runs:
                # New parameter objects: the tied pair becomes two parameters
                # over one memory (PyTorch's assign wraps each key on its own).
                m.load_state_dict(copy.deepcopy(loaded), assign=True)
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m, _ in runs]
            assert ours.out.weight is not ours.embed.weight
            assert ours.out.weight.data_ptr() == ours.embed.weight.data_ptr()
        if step == 6:
            for m, _ in runs:
                m.frozen.requires_grad_(True)  # new gradients appear
        tokens = torch.randint(0, 11, (5, 3), generator=torch.Generator().manual_seed(step))
        norms = []
        for (model, clip), opt, scaler in zip(runs, opts, scalers):
            scaler.scale(model(tokens).square().mean()).backward()
            if step == 2:
                model.hidden.weight.grad[0, 0] = float("inf")  # an overflow: this step is skipped
            scaler.unscale_(opt)
            norms.append(float(clip(model.parameters(), max_norm=0.05)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()  # set_to_none: the next backward makes new gradient tensors
        if step == 2:
            assert math.isinf(norms[0]) and math.isinf(norms[1])
        else:
            assert norms[0] == pytest.approx(norms[1], rel=1e-5), step
        for (name, p), q in zip(ours.named_parameters(), theirs.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=f"step {step}: {name}")
    assert all(s.get_scale() == scalers[0].get_scale() for s in scalers)
    # The unfrozen layer trained in float64 (and equally in both runs, above).
    assert ours.frozen.weight.dtype == torch.float64
    assert not torch.equal(ours.frozen.weight.float(), frozen_at_first)
