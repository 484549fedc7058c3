"""CUDA-graph capture on the stand-ins (tests/cupy_stand_in.py,
tests/torch_cuda_stand_in.py): after one warm call, a resident model's
``clip_grad_norm_`` and ``grad_norm`` and ``gpuflat.torch.clip_grad_norm_``
capture with no pool allocation, synchronisation, upload or host read (the
stand-ins raise on each), and replaying the graph gives the bits of eager
calls; a call that would need an upload raises CaptureError naming the
missing warm-up. tests/test_gpu_interop.py replays ``torch.cuda.graph`` on
a real GPU.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import gpuflat as gf
import gpuflat.torch as gft

import cupy_stand_in
import torch_cuda_stand_in as tcs


@pytest.fixture
def cp(monkeypatch):
    return cupy_stand_in.install(monkeypatch)


@pytest.fixture
def tc(cp, monkeypatch):
    stand_in = tcs.install(monkeypatch, cp)
    with stand_in:
        yield stand_in


def net(seed):
    """Parameters of two dtypes (the resident model combines two buffers' norms)."""
    rng = np.random.default_rng(seed)
    model = torch.nn.Module()
    model.w = tcs.parameter(torch.from_numpy(rng.standard_normal((40, 3))).float())
    model.b = tcs.parameter(torch.from_numpy(rng.standard_normal(7)).float())
    model.d = tcs.parameter(torch.from_numpy(rng.standard_normal(5)))
    return model


def set_grads(parameters, step):
    rng = np.random.default_rng(100 + step)
    for p in parameters:
        g = torch.from_numpy(rng.standard_normal(tuple(p.shape)) * (step + 1)).to(p.dtype)
        if p.grad is None:
            p.grad = tcs.cuda(g)
        else:
            p.grad.copy_(g)


def bits(t):
    with torch._C.DisableTorchFunction():
        return t.detach().numpy().tobytes()


def test_a_resident_training_loop_captures_and_replays_like_eager_calls(cp, tc):
    model, twin = net(0), net(0)
    r, eager = gf.resident(model), gf.resident(twin)
    with torch.cuda.stream(torch.cuda.Stream()):
        set_grads(model.parameters(), 0)
        r.clip_grad_norm_(0.5)  # the warm-up: uploads every table
        r.grad_norm()
        graph, (clipped_norm, norm_after) = tc.capture(lambda: (r.clip_grad_norm_(0.5), r.grad_norm()))
    for step in range(1, 4):
        set_grads(model.parameters(), step)
        set_grads(twin.parameters(), step)
        allocations = len(tc.allocations)
        graph.replay()
        assert len(tc.allocations) == allocations  # a replay allocates nothing
        want_clipped, want_after = eager.clip_grad_norm_(0.5), eager.grad_norm()
        assert bits(clipped_norm) == bits(want_clipped) and bits(norm_after) == bits(want_after)
        assert float(want_clipped) > 0.5  # the clip really scales
        for p, q in zip(model.parameters(), twin.parameters()):
            assert bits(p.grad) == bits(q.grad)
    assert cp.freed_in_flight == []


def test_gpuflat_torch_clip_captures_and_replays_like_eager_calls(cp, tc):
    # float32 gradients: the float64 norm is returned as float32, a PyTorch
    # operation the graph captures too.
    params, twins = list(net(1).parameters())[:2], list(net(1).parameters())[:2]
    with torch.cuda.stream(torch.cuda.Stream()):
        set_grads(params, 0)
        gft.clip_grad_norm_(params, 0.5)
        graph, norm = tc.capture(lambda: gft.clip_grad_norm_(params, 0.5))
    for step in range(1, 4):
        set_grads(params, step)
        set_grads(twins, step)
        graph.replay()
        want = gft.clip_grad_norm_(twins, 0.5)
        assert norm.dtype == want.dtype == torch.float32 and bits(norm) == bits(want)
        assert float(want) > 0.5  # the clip really scales
        for p, q in zip(params, twins):
            assert bits(p.grad) == bits(q.grad)


def test_capturing_without_the_warm_up_call_names_it(cp, tc):
    model = net(2)
    r = gf.resident(model)
    set_grads(model.parameters(), 0)
    before = [bits(p.grad) for p in model.parameters()]
    with pytest.raises(gf.CaptureError, match=r"make the same call once before capturing \(a warm-up call"):
        tc.capture(lambda: r.clip_grad_norm_(0.5))
    assert [bits(p.grad) for p in model.parameters()] == before
    r.clip_grad_norm_(0.5)  # the warm-up, then the capture works
    tc.capture(lambda: r.clip_grad_norm_(0.5))


def test_error_if_nonfinite_is_a_host_read_the_capture_refuses(cp, tc):
    model = net(3)
    r = gf.resident(model)
    set_grads(model.parameters(), 0)
    r.clip_grad_norm_(0.5, error_if_nonfinite=True)
    with pytest.raises(cp.ContractError, match="device-to-host read while a CUDA graph is being captured"):
        tc.capture(lambda: r.clip_grad_norm_(0.5, error_if_nonfinite=True))


def test_gf_clip_on_a_tree_of_tensors_captures_and_replays_like_eager_calls(cp, tc):
    # The walk imports every tensor through DLPack on PyTorch's stream, so the
    # capture sees no event from another stream; the plan and tables are warm.
    params, twins = list(net(4).parameters()), list(net(4).parameters())
    grads = lambda ps: {"w": ps[0].grad, "b": ps[1].grad, "d": ps[2].grad}  # noqa: E731
    with torch.cuda.stream(torch.cuda.Stream()):
        set_grads(params, 0)
        gf.clip_grad_norm_(grads(params), 0.5)
        graph, norm = tc.capture(lambda: gf.clip_grad_norm_(grads(params), 0.5))
    for step in range(1, 3):
        set_grads(params, step)
        set_grads(twins, step)
        graph.replay()
        want = gf.clip_grad_norm_(grads(twins), 0.5)
        assert bits(norm) == bits(want) and float(want) > 0.5
        for p, q in zip(params, twins):
            assert bits(p.grad) == bits(q.grad)


def test_max_norm_as_a_device_tensor_is_read_at_every_replay(cp, tc):
    # The clip reads max_norm from device memory: a graph captured once
    # follows a schedule that changes the tensor in place, with no host read.
    model, twin = net(5), net(5)
    r, eager = gf.resident(model), gf.resident(twin)
    max_norm = tcs.cuda(torch.tensor(0.5, dtype=torch.float64))
    with torch.cuda.stream(torch.cuda.Stream()):
        set_grads(model.parameters(), 0)
        r.clip_grad_norm_(max_norm)
        graph, norm = tc.capture(lambda: r.clip_grad_norm_(max_norm))
    for step, value in enumerate([0.25, 2.0, 0.125], start=1):
        with torch._C.DisableTorchFunction():
            max_norm.fill_(value)
        set_grads(model.parameters(), step)
        set_grads(twin.parameters(), step)
        graph.replay()
        want = eager.clip_grad_norm_(value)
        assert bits(norm) == bits(want)
        for p, q in zip(model.parameters(), twin.parameters()):
            assert bits(p.grad) == bits(q.grad)


def test_gpuflat_torch_clip_takes_a_device_max_norm_without_a_host_read(cp, tc):
    params, twins = list(net(6).parameters()), list(net(6).parameters())
    set_grads(params, 1)
    set_grads(twins, 1)
    max_norm = tcs.cuda(torch.tensor(0.75, dtype=torch.float32))
    gft.clip_grad_norm_(params, max_norm)
    gft.clip_grad_norm_(twins, 0.75)
    for p, q in zip(params, twins):
        assert bits(p.grad) == bits(q.grad)
    graph, norm = tc.capture(lambda: gft.clip_grad_norm_(params, max_norm))  # a host read would raise here
    set_grads(params, 2)
    set_grads(twins, 2)
    graph.replay()
    want = gft.clip_grad_norm_(twins, 0.75)
    assert bits(norm) == bits(want) and float(want) > 0.75
    for p, q in zip(params, twins):
        assert bits(p.grad) == bits(q.grad)


def test_a_device_max_norm_must_be_a_real_floating_scalar(cp, tc):
    model = net(7)
    r = gf.resident(model)
    set_grads(model.parameters(), 0)
    before = [bits(p.grad) for p in model.parameters()]
    with pytest.raises(ValueError, match=r"max_norm: expected a number >= 0 or a 0-d real floating device "
                                         r"tensor, got one of shape \(2,\) and dtype float64"):
        r.clip_grad_norm_(tcs.cuda(torch.ones(2, dtype=torch.float64)))
    with pytest.raises(ValueError, match="got one of shape \\(\\) and dtype int64"):
        gf.clip_grad_norm_({"w": model.w.grad}, tcs.cuda(torch.tensor(1)))
    assert [bits(p.grad) for p in model.parameters()] == before


def test_a_cupy_max_norm_is_read_on_the_device(cp):
    # CuPy arrays, no PyTorch: a 0-d float32 CuPy max_norm is cast on the
    # device and read by the kernel, with the float's bits.
    rng = np.random.default_rng(8)
    host = {"w": rng.standard_normal((9, 4)).astype(np.float32), "b": rng.standard_normal(5)}
    dev = {k: cp.asarray(v) for k, v in host.items()}
    norm = gf.clip_grad_norm_(dev, cp.asarray(np.float32(0.5)))
    assert [e.detail[0] for e in cp.events if e.kind == "launch"][-1] == "gpuflat_scale_at"
    want = gf.clip_grad_norm_(host, 0.5, backend="emulated")
    assert float(norm) == float(want) > 0.5
    for k in host:
        assert cp.asnumpy(dev[k]).tobytes() == host[k].tobytes()


def test_a_max_norm_on_another_gpu_is_refused_before_any_write(cp):
    host = {"w": np.full(4, 3.0, np.float32)}
    dev = {"w": cp.asarray(host["w"])}
    with cp.cuda.Device(1):
        elsewhere = cp.asarray(np.float32(0.5))
    with pytest.raises(ValueError, match="max_norm: expected a number or a 0-d tensor on CUDA device 0, the "
                                         "gradients' device, got one on CUDA device 1"):
        gf.clip_grad_norm_(dev, elsewhere)
    assert cp.asnumpy(dev["w"]).tobytes() == host["w"].tobytes()


# ---------------------------------------------------------------- event queries
# The stand-ins refuse an event query while any stream captures (it would
# invalidate the capture): every capture test above fails on a runtime that
# asks whether a table's upload landed before it checks for a capture.

def test_a_table_released_during_a_capture_is_freed_after_it(cp):
    # A garbage collector's finaliser may release a table at any moment: the
    # release queries no event while a stream captures, and the table is
    # freed by the first release after the capture.
    from gpuflat._src.backends.cuda_runtime import CupyRuntime

    rt = CupyRuntime(0)
    uploaded = rt.upload_table(np.arange(4, dtype=np.int64))
    other = rt.upload_table(np.arange(2, dtype=np.int64))
    cp.cuda.get_current_stream().synchronize()
    capturing = cp.cuda.Stream()
    with capturing:
        capturing.begin_capture()
        rt.release(uploaded)
        capturing.end_capture()
    assert uploaded in rt._retired
    rt.release(other)
    assert uploaded not in rt._retired and other not in rt._retired


# ---------------------------------------------------------------- the flat optimizers

@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_a_flat_optimizer_step_captures_after_a_warm_up_and_replays_like_eager_steps(cp, tc, name):
    # Gradients written in place keep their memory (zero_grad(set_to_none=False),
    # or a whole-step capture's gradients, allocated at the same addresses of
    # the graph's pool at every replay): after one warm-up step, the step's
    # tables are found again and nothing is uploaded, so the step captures.
    make = {"adamw": lambda ps: gft.AdamW(ps, lr=1e-2, weight_decay=0.1, max_norm=0.5),
            "sgd": lambda ps: gft.SGD(ps, lr=1e-2, momentum=0.9, max_norm=0.5),
            "lion": lambda ps: gft.Lion(ps, lr=1e-3, weight_decay=0.1, max_norm=0.5)}[name]
    model, twin = net(3), net(3)
    opt, twin_opt = make(list(model.parameters())), make(list(twin.parameters()))
    with torch.cuda.stream(torch.cuda.Stream()):
        # The warm-up, two steps as PyTorch's whole-step capture recipe takes
        # several: the state is made and the tables uploaded (a momentum
        # buffer's first step, which sets it to the gradient, has tables of its own).
        for warm in range(2):
            for ps, o in ((model.parameters(), opt), (twin.parameters(), twin_opt)):
                set_grads(ps, warm)
                o.step()
        graph, _ = tc.capture(opt.step)
    for step in range(2, 5):
        set_grads(model.parameters(), step)
        set_grads(twin.parameters(), step)
        graph.replay()
        twin_opt.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert bits(p) == bits(q)
        assert bits(opt.last_grad_norm) == bits(twin_opt.last_grad_norm)
    assert cp.freed_in_flight == []


@pytest.mark.parametrize("name", ["adamw-master", "sgd-stochastic", "lion-kahan"])
def test_a_16_bit_step_captures_after_a_warm_up_and_replays_like_eager_steps(cp, tc, name):
    # What a bfloat16 parameter keeps beside it is made by the warm-up;
    # stochastic rounding's draws are keyed by the counts, which each replay
    # moves on the device: the replays draw what eager steps draw.
    make = {"adamw-master": lambda ps: gft.AdamW(ps, lr=1e-2, master_weights=True, exp_avg_dtype=torch.float32,
                                                 max_norm=0.5),
            "sgd-stochastic": lambda ps: gft.SGD(ps, lr=1e-2, bf16_stochastic_round=True, max_norm=0.5),
            "lion-kahan": lambda ps: gft.Lion(ps, lr=1e-3, kahan_sum=True, max_norm=0.5)}[name]

    def bf16_net(seed):
        rng = np.random.default_rng(seed)
        return [tcs.parameter(torch.from_numpy(rng.standard_normal(n)).to(torch.bfloat16)) for n in (40, 7)]

    params, twins = bf16_net(3), bf16_net(3)
    opt, twin_opt = make(params), make(twins)
    with torch.cuda.stream(torch.cuda.Stream()):
        for warm in range(2):
            for ps, o in ((params, opt), (twins, twin_opt)):
                set_grads(ps, warm)
                o.step()
        graph, _ = tc.capture(opt.step)
    for step in range(2, 5):
        set_grads(params, step)
        set_grads(twins, step)
        graph.replay()
        twin_opt.step()
        for p, q in zip(params, twins):
            assert raw(p) == raw(q)
            for key in opt.state[p]:
                assert raw(opt.state[p][key]) == raw(twin_opt.state[q][key]), key
    assert float(opt.state[params[0]]["step"]) == 5 and cp.freed_in_flight == []


def raw(t):
    """A tensor's bytes, whatever its dtype."""
    with torch._C.DisableTorchFunction():
        return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def make_whole_step(params, inputs, opt, scaler):
    """One training step as PyTorch's whole-step capture records it: the
    gradients are made anew (a backward after ``zero_grad()``, which sets
    them to None), scaled by the GradScaler, then the clipped step and the
    scaler's update."""
    def whole_step():
        scaled_one = scaler.scale(tcs.cuda(torch.ones((), dtype=torch.float32)))
        for p, x in zip(params, inputs):
            p.grad = x * scaled_one.to(x.dtype)
        scaler.step(opt)
        scaler.update()
    return whole_step


@pytest.mark.parametrize("flat_cls", [gft.AdamW, gft.Lion], ids=["adamw", "lion"])
def test_a_whole_step_with_gradients_made_inside_the_capture_replays_like_eager_steps(cp, tc, monkeypatch, flat_cls):
    # The gradients are new memory inside the capture, so the step's tables
    # are new too: written into the pinned memory set aside before the
    # capture, and read there by every replay. A scheduler writes the tensor
    # lr between replays; replay 4 holds an inf, which the scaler skips.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GradScaler's check for a GPU
    runs = []
    for _ in range(2):
        model = net(9)
        params = list(model.parameters())
        lr = tcs.cuda(torch.tensor(1e-2, dtype=torch.float32))
        opt = flat_cls(params, lr=lr, weight_decay=0.1, max_norm=0.5)
        scaler = gft.GradScaler("cuda", init_scale=2.0**10, growth_interval=2)
        inputs = [tcs.cuda(torch.zeros_like(p)) for p in params]
        runs.append((params, lr, opt, scaler, inputs, make_whole_step(params, inputs, opt, scaler)))
    (params, lr, opt, scaler, inputs, step), (twins, twin_lr, twin_opt, twin_scaler, twin_inputs, twin_step) = runs

    def feed(number):
        rng = np.random.default_rng(200 + number)
        with torch._C.DisableTorchFunction():
            for x, y in zip(inputs, twin_inputs):
                value = torch.from_numpy(rng.standard_normal(tuple(x.shape)) * (number + 1)).to(x.dtype)
                x.copy_(value)
                y.copy_(value)
            if number == 4:
                inputs[1][0] = twin_inputs[1][0] = float("inf")
            lr.fill_(1e-2 / (number + 1))
            twin_lr.fill_(1e-2 / (number + 1))

    with torch.cuda.stream(torch.cuda.Stream()):
        for warm in range(2):
            feed(warm)
            for ps, o, run in ((params, opt, step), (twins, twin_opt, twin_step)):
                o.zero_grad()
                run()
        opt.zero_grad()
        graph, _ = tc.capture(step)
    for number in range(2, 7):
        feed(number)
        allocations = len(tc.allocations)
        graph.replay()
        assert len(tc.allocations) == allocations  # a replay allocates nothing
        twin_opt.zero_grad()
        twin_step()
        for p, q in zip(params, twins):
            assert bits(p) == bits(q)
            assert all(bits(opt.state[p][k]) == bits(twin_opt.state[q][k]) for k in opt.state[p])
        assert bits(scaler._scale) == bits(twin_scaler._scale)
        assert bits(opt.last_grad_norm) == bits(twin_opt.last_grad_norm)
    assert float(twin_opt.state[twins[0]]["step"]) == 6  # 7 steps, one skipped
    assert cp.freed_in_flight == []


def test_a_capture_needing_more_table_memory_than_was_set_aside_names_the_warm_up(cp, tc):
    small = net(4)
    opt = gft.AdamW(list(small.parameters()), lr=1e-2)
    with torch.cuda.stream(torch.cuda.Stream()):
        set_grads(small.parameters(), 0)
        opt.step()  # sets aside memory for tables of this step's sizes
        # SGD without momentum: no state to make (which a capture refuses first).
        bigger = gft.SGD([*small.parameters(), *[tcs.parameter(torch.ones(2)) for _ in range(200)]], lr=1e-2)
        for p in bigger.param_groups[0]["params"]:
            p.grad = tcs.cuda(torch.ones_like(p))
        with pytest.raises(gf.CaptureError, match=r"more than the pinned memory set aside for captures holds .*"
                                                  r"make the same call once before capturing"):
            tc.capture(bigger.step)


def test_a_momentum_buffer_no_step_applied_before_the_capture_replays_like_eager_steps(cp, tc):
    # The warm-up step is skipped by a GradScaler (an inf found), so the
    # momentum buffer it made is still new when the step is captured: its
    # count (0: new) is device data that each replay reads and counts, so the
    # first replay makes the buffer the gradient itself and the later ones
    # add to it, with dampening, as eager steps do.
    model, twin = net(5), net(5)
    opts = [gft.SGD(list(m.parameters()), lr=1e-2, momentum=0.9, dampening=0.5, max_norm=5.0)
            for m in (model, twin)]
    found = [tcs.cuda(torch.ones((), dtype=torch.float32)) for _ in opts]
    for opt, f in zip(opts, found):
        opt.grad_scale, opt.found_inf = tcs.cuda(torch.ones((), dtype=torch.float32)), f
    with torch.cuda.stream(torch.cuda.Stream()):
        for m, opt in zip((model, twin), opts):
            set_grads(m.parameters(), 0)
            opt.step()  # skipped: the buffers made, none applied
        for f in found:
            with torch._C.DisableTorchFunction():
                f.zero_()
        graph, _ = tc.capture(opts[0].step)
    for step in range(1, 7):
        set_grads(model.parameters(), step)
        set_grads(twin.parameters(), step)
        graph.replay()
        opts[1].step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert bits(p) == bits(q)
            assert all(bits(opts[0].state[p][k]) == bits(opts[1].state[q][k]) for k in opts[0].state[p])
    assert float(opts[1].state[next(twin.parameters())]["step"]) == 6
    assert cp.freed_in_flight == []


@pytest.mark.parametrize("name", ["adamw", "sgd", "lion"])
def test_a_captured_step_replays_like_eager_steps_after_the_caches_are_cleared(cp, tc, name):
    # A step without a GradScaler reads an (unscale, skip) flags tensor of
    # gpuflat's own; the graph keeps it, and everything else its launches
    # read, whatever gf.cache_clear() drops and whatever takes the memory after.
    make = {"adamw": lambda ps: gft.AdamW(ps, lr=1e-2, max_norm=0.5),
            "sgd": lambda ps: gft.SGD(ps, lr=1e-2, momentum=0.9, max_norm=0.5),
            "lion": lambda ps: gft.Lion(ps, lr=1e-3, weight_decay=0.1, max_norm=0.5)}[name]
    model, twin = net(6), net(6)
    opt, twin_opt = make(list(model.parameters())), make(list(twin.parameters()))
    with torch.cuda.stream(torch.cuda.Stream()):
        for warm in range(2):
            for m, o in ((model, opt), (twin, twin_opt)):
                set_grads(m.parameters(), warm)
                o.step()
        graph, _ = tc.capture(opt.step)
    gf.cache_clear()
    gc.collect()
    # Memory freed now is taken again, holding what a skip flag would.
    taken = [torch.ones(2, dtype=torch.float64) for _ in range(64)]
    for step in range(2, 5):
        set_grads(model.parameters(), step)
        set_grads(twin.parameters(), step)
        graph.replay()
        twin_opt.step()
        for p, q in zip(model.parameters(), twin.parameters()):
            assert bits(p) == bits(q)
    assert len(taken) == 64
    assert cp.freed_in_flight == []


def test_a_flat_optimizers_state_dict_reads_the_counts_once(cp, tc):
    # state_dict() leaves out the state no step applied: one host read of
    # every count on the device, not one per parameter.
    model = net(7)
    opt = gft.SGD(list(model.parameters()), lr=1e-2, momentum=0.9)
    with torch.cuda.stream(torch.cuda.Stream()):
        set_grads(model.parameters(), 0)
        opt.step()
        reads = tc.host_reads
        packed = opt.state_dict()
    assert tc.host_reads - reads == 1
    assert sorted(packed["state"]) == [0, 1, 2]


def test_state_that_a_capture_would_make_is_refused_naming_the_warm_up(cp, tc):
    # Every replay would make it again, at 0: momentum switched on just
    # before the capture needs a step outside it first.
    model = net(8)
    opt = gft.SGD(list(model.parameters()), lr=1e-2, momentum=0.0)
    with torch.cuda.stream(torch.cuda.Stream()):
        set_grads(model.parameters(), 0)
        opt.step()
        opt.param_groups[0]["momentum"] = 0.9
        with pytest.raises(gf.CaptureError, match=r"param_groups\[0\]\['params'\]\[0\]: its optimizer state would be "
                                                  r"made inside a CUDA-graph capture.*take a step before capturing"):
            tc.capture(opt.step)
        opt.step()  # the warm-up makes the buffers
        graph, _ = tc.capture(opt.step)
