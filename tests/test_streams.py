"""Every entry point on PyTorch's current stream, and the tables' lifetime
across streams, on the CuPy stand-in (tests/cupy_stand_in.py) and the
PyTorch CUDA stand-in (tests/torch_cuda_stand_in.py).

The stand-ins record the device and stream of every allocation, upload,
launch, fill and element-wise operation; a call on tensors PyTorch owns
must put all of them on ``torch.cuda.current_stream()``, and take every
allocation from PyTorch's caching allocator on that stream.
"""
from __future__ import annotations

import gc
import sys

import numpy as np
import pytest
import torch

import gpuflat as gf
import gpuflat.distributed as gfd
import gpuflat.torch as gft
from gpuflat._src.backends.cuda import TABLES_KEPT, CudaBackend
from gpuflat._src.backends.cuda_runtime import CupyRuntime

import cupy_stand_in
import torch_cuda_stand_in as tcs

DEVICE_WORK = ("empty", "zeros", "upload", "launch", "fill", "elementwise", "to_host")


@pytest.fixture
def cp(monkeypatch):
    return cupy_stand_in.install(monkeypatch)


@pytest.fixture
def tc(cp, monkeypatch):
    stand_in = tcs.install(monkeypatch, cp)
    with stand_in:
        yield stand_in


def cuda_tensor(rng, shape, dtype=torch.float32):
    return tcs.cuda(torch.from_numpy(rng.standard_normal(shape)).to(dtype))


class Net(torch.nn.Module):
    """Two dtypes, so a resident model combines two buffers' norms."""

    def __init__(self, rng):
        super().__init__()
        self.w = tcs.parameter(torch.from_numpy(rng.standard_normal((4, 3))).float())
        self.b = tcs.parameter(torch.from_numpy(rng.standard_normal(3)))
        self.h = tcs.parameter(torch.from_numpy(rng.standard_normal(5)).half())


def set_grads(net, rng, scale=1.0):
    for p in net.parameters():
        g = torch.from_numpy(rng.standard_normal(tuple(p.shape)) * scale).to(p.dtype)
        if p.grad is None:  # a resident model keeps a gradient that is None as None
            p.grad = tcs.cuda(g)
        else:
            p.grad.copy_(g)


def device_work(cp, start):
    return [e for e in cp.events[start:] if e.kind in DEVICE_WORK]


# ---------------------------------------------------------------- PyTorch's stream everywhere

def test_every_entry_point_runs_on_pytorchs_current_stream(cp, tc):
    rng = np.random.default_rng(0)
    side = torch.cuda.Stream()
    start = len(cp.events)
    with torch.cuda.stream(side):
        tree = {"w": cuda_tensor(rng, (3, 4)), "b": cuda_tensor(rng, 5, torch.float64),
                "h": cuda_tensor(rng, 6, torch.float16)}
        plan = gf.plan(tree)
        flat, re = gf.destructure(tree)
        re(flat)
        gf.flatten(plan, tree)
        gf.flatten(plan, tree, out=tcs.cuda(torch.empty(plan.size, dtype=torch.float64)))
        gf.unflatten(plan, flat)
        gf.scatter(plan, flat, tree)
        gf.global_norm(tree, per_leaf=True)
        gf.total("l2", tree)
        gf.total("sumsq", tree)
        gf.clip_grad_norm_(tree, 1.0)
        gf.clip_by_global_norm(tree, 1.0)
        w = tree["w"]
        gf.global_norm({"x": w, "y": None, "z": w}, model={"x": w, "y": tree["b"], "z": w})

        params = [tcs.parameter(torch.ones(3)), tcs.parameter(torch.ones(2, dtype=torch.float64))]
        for p in params:
            p.grad = cuda_tensor(rng, tuple(p.shape), p.dtype)
        gft.clip_grad_norm_(params, 0.5)
        gft.get_total_norm([p.grad for p in params])
        gft.clip_grads_with_norm_(params, 0.5, gft.get_total_norm([p.grad for p in params]))

        net = Net(rng)
        r = gf.resident(net)
        set_grads(net, rng)
        r.grad_norm(per_leaf=True)
        r.param_norm()
        r.clip_grad_norm_(0.5)
        r.zero_grad()

        gfd.global_norm(tree)
        gfd.clip_grad_norm_(tree, 1.0)
        gfd.all_reduce_(tree, "mean")
    work = device_work(cp, start)
    kinds = {e.kind for e in work}
    assert {"empty", "zeros", "upload", "launch", "fill", "elementwise"} <= kinds
    off = [(e.kind, e.stream.ptr, e.detail) for e in work if e.stream.ptr != side.cuda_stream]
    assert not off, off[:5]
    # Every allocation came from PyTorch's caching allocator, on that stream.
    allocations = [e for e in work if e.kind in ("empty", "zeros")]
    assert all(e.detail[2] == "allocator" for e in allocations)
    assert tc.allocations and {stream for _, _, stream in tc.allocations} == {side.cuda_stream}
    # Every entry point imports the tensors through DLPack on PyTorch's stream too.
    imports = [e for e in cp.events[start:] if e.kind == "from_dlpack"]
    assert imports and all(e.stream.ptr == side.cuda_stream for e in imports)


def test_the_default_stream_is_pytorchs_default(cp, tc):
    rng = np.random.default_rng(1)
    start = len(cp.events)
    tree = {"w": cuda_tensor(rng, 7)}
    gf.clip_grad_norm_(tree, 1.0)
    assert {e.stream.ptr for e in device_work(cp, start)} == {0}


def test_results_match_the_host_backends(cp, tc):
    rng = np.random.default_rng(2)
    host = {"w": rng.standard_normal((3, 4)).astype(np.float32), "b": rng.standard_normal(5)}
    dev = {k: tcs.cuda(torch.from_numpy(v.copy())) for k, v in host.items()}
    with torch.cuda.stream(torch.cuda.Stream()):
        norm = gf.clip_grad_norm_(dev, 0.5)
    want = gf.clip_grad_norm_(host, 0.5, backend="emulated")
    assert norm.is_cuda and float(norm) == float(want)
    for k in host:
        assert dev[k].numpy().tobytes() == host[k].tobytes()


# ---------------------------------------------------------------- tables across streams

def leaves_on(cp, rng, sizes=(5, 70, 1)):
    hosts = [rng.standard_normal(n) for n in sizes]
    return hosts, [cp.on_device(h, 0) for h in hosts]


def test_uploads_never_wait_and_other_streams_wait_on_the_device(cp):
    rng = np.random.default_rng(3)
    hosts, leaves = leaves_on(cp, rng)
    plan = gf.plan(hosts)
    be = CudaBackend(CupyRuntime(0))
    with cp.cuda.Stream():
        first = be.norms(plan, leaves, 2, per_leaf=False)  # uploads the tables
    uploads = [e for e in cp.events if e.kind == "upload"]
    assert uploads and all(e.detail["pinned"] and not e.detail["waits"] for e in uploads)
    assert be.stats.syncs == 0 and not [e for e in cp.events if e.kind == "sync"]
    with cp.cuda.Stream():  # would raise ContractError if it read a table still in flight
        again = be.norms(plan, leaves, 2, per_leaf=False)
    assert be.stats.uploads == 2 and be.stats.syncs == 0
    assert be.to_host(again.total).tobytes() == be.to_host(first.total).tobytes()


def test_an_unordered_read_of_an_upload_is_refused(cp):
    # The check the test above relies on: a stream that did not wait raises.
    table = cp.empty(4, np.int64)
    with cp.cuda.Stream() as a:
        table.set(np.frombuffer(cp.cuda.alloc_pinned_memory(32), np.int64, 4), stream=a)
    with cp.cuda.Stream(), pytest.raises(cp.ContractError, match="still in flight"):
        table + 1


def fill_tables(be, cp, rng, plan, n):
    """n norms over new leaves of ``plan``'s shape, each a new per-call table."""
    kept = []
    for _ in range(n):
        _, leaves = leaves_on(cp, rng)
        be.norms(plan, leaves, 2, per_leaf=False)
        kept.append(leaves)
    return kept


def test_an_evicted_table_outlives_the_reads_of_other_streams(cp):
    rng = np.random.default_rng(4)
    hosts, _ = leaves_on(cp, rng)
    plan = gf.plan(hosts)
    be = CudaBackend(CupyRuntime(0))
    uploader, reader = cp.cuda.Stream(), cp.cuda.Stream()
    with uploader:
        kept = fill_tables(be, cp, rng, plan, 1)
    with reader:  # reads the table, and nothing says it finished
        be.norms(plan, kept[0], 2, per_leaf=False)
    with uploader:
        kept += fill_tables(be, cp, rng, plan, TABLES_KEPT)  # evicts the first table
    gc.collect()
    assert cp.freed_in_flight == []
    [first] = be.runtime._retired  # kept while the reader may still read it
    uploader.synchronize()  # its copy landed (its pinned staging may go), the reader still runs
    with uploader:
        fill_tables(be, cp, rng, plan, 1)
    assert first in be.runtime._retired
    reader.synchronize()
    with uploader:
        fill_tables(be, cp, rng, plan, 1)  # the next upload frees what is done
    assert first not in be.runtime._retired
    gc.collect()
    assert cp.freed_in_flight == []


def test_freeing_an_evicted_table_at_once_is_caught(cp, monkeypatch):
    # The stand-in's check can fail: with release freeing at once, it reports the table.
    monkeypatch.setattr(CupyRuntime, "release", lambda self, table: None)
    rng = np.random.default_rng(5)
    hosts, _ = leaves_on(cp, rng)
    plan = gf.plan(hosts)
    be = CudaBackend(CupyRuntime(0))
    uploader, reader = cp.cuda.Stream(), cp.cuda.Stream()
    with uploader:
        kept = fill_tables(be, cp, rng, plan, 1)
    with reader:
        be.norms(plan, kept[0], 2, per_leaf=False)
    with uploader:
        fill_tables(be, cp, rng, plan, TABLES_KEPT)
    gc.collect()
    assert cp.freed_in_flight and "may still use it" in cp.freed_in_flight[0]


def test_a_collected_plan_keeps_its_tables_until_other_streams_are_done(cp):
    rng = np.random.default_rng(6)
    hosts, leaves = leaves_on(cp, rng)
    be = CudaBackend(CupyRuntime(0))
    uploader, reader = cp.cuda.Stream(), cp.cuda.Stream()
    plan = gf.plan(hosts)
    with uploader:
        be.norms(plan, leaves, 2, per_leaf=False)
    with reader:
        be.norms(plan, leaves, 2, per_leaf=False)
    gf.plan_cache_clear()
    del plan
    gc.collect()
    assert cp.freed_in_flight == []
    assert len(be.runtime._retired) == 2  # the static and the per-call table
    reader.synchronize()
    uploader.synchronize()
    with uploader:
        be.norms(gf.plan([np.ones(3)]), [cp.on_device(np.ones(3), 0)], 2, per_leaf=False)
    gc.collect()
    assert be.runtime._retired == [] and cp.freed_in_flight == []


# ---------------------------------------------------------------- at exit


def tables_on_two_streams(cp, rng):
    """A runtime whose tables two streams read, a plan owning some of them, and one more table."""
    hosts, leaves = leaves_on(cp, rng)
    be = CudaBackend(CupyRuntime(0))
    plan = gf.plan(hosts)
    for stream in (cp.cuda.Stream(), cp.cuda.Stream()):
        with stream:
            be.norms(plan, leaves, 2, per_leaf=False)
    return be.runtime, plan, be.runtime.upload_table(np.arange(3))


def test_nothing_raises_once_the_context_is_gone(cp, monkeypatch):
    # At exit CUDA may be torn down before the last finalisers release their
    # tables: asking a stream or an event then raises cudaErrorContextIsDestroyed.
    rt, plan, table = tables_on_two_streams(cp, np.random.default_rng(7))
    cp.destroy_context()
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    rt.release(table)
    gf.plan_cache_clear()
    del plan
    gc.collect()  # the plan's finaliser releases its tables
    assert unraisable == []
    assert len(rt._retired) == 3  # kept: nothing can be asked or freed on a context that is gone
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError, match="context is destroyed"):
        cp.cuda.get_current_stream().is_capturing()  # the stand-in's check can fail


def test_nothing_is_freed_while_the_interpreter_shuts_down(cp, monkeypatch):
    rt, plan, table = tables_on_two_streams(cp, np.random.default_rng(8))
    asked = len(cp.events)
    monkeypatch.setattr(sys, "is_finalizing", lambda: True)
    rt.release(table)
    assert rt._retired == [] and cp.events[asked:] == []
