"""The CuPy rules tests/test_gpu.py relies on when it runs on the stand-in
(tests/cupy_stand_in.py): each refusal fires, so a test body that breaks
one fails in CI rather than on the first lent GPU.
"""
from __future__ import annotations


import numpy as np
import pytest


import cupy_stand_in


@pytest.fixture
def cp(monkeypatch):
    """The stand-in as ``cupy``: device 0 is sm_90, device 1 sm_80."""
    return cupy_stand_in.install(monkeypatch)


def test_no_implicit_conversion_to_numpy(cp):
    x = cp.asarray(np.arange(3.0))
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(x)
    with pytest.raises(TypeError, match="Unsupported type"):
        x + np.ones(3)
    assert x.get().tolist() == [0.0, 1.0, 2.0]


def test_operations_return_device_arrays_with_numpys_values(cp):
    host = np.array([[1.5, -2.0, 0.0], [4.0, 5.0, -6.5]], np.float32)
    x = cp.asarray(host)[::-1, 1:].T
    np.testing.assert_array_equal(x.get(), host[::-1, 1:].T)
    for got, want in [(x * 2 + 1, host[::-1, 1:].T * 2 + 1), (x != np.float32(5), host[::-1, 1:].T != 5),
                      (np.float32(3) - x, 3 - host[::-1, 1:].T), (x.astype(np.float64), host[::-1, 1:].T.astype(np.float64))]:
        assert isinstance(got, cp.ndarray)
        np.testing.assert_array_equal(got.get(), want)
        assert got.dtype == want.dtype
    assert int(cp.count_nonzero(x)) == np.count_nonzero(host[::-1, 1:])
    y = cp.full((2, 3), 7, np.float16)
    y[1, ::2] = 1.0
    assert y.get().tolist() == [[7, 7, 7], [1, 7, 1]]


def test_element_wise_work_runs_on_the_arrays_device(cp):
    with cp.cuda.Device(1):
        x = cp.asarray(np.ones(4))
    for work in (lambda: x + 1, lambda: x.fill(2), lambda: x.__setitem__(0, 3.0), lambda: cp.count_nonzero(x)):
        with pytest.raises(cp.ContractError, match="array on device 1, current device 0"):
            work()
    copy = x.copy()  # CuPy copies across devices, to the current one
    assert copy.device.id == 0 and copy.get().tolist() == [1.0] * 4
    with cp.cuda.Device(1):
        assert (x + 1).device.id == 1


def test_memory_is_counted_per_device(cp):
    pool = cp.get_default_memory_pool()
    free0, total = cp.cuda.runtime.memGetInfo()
    with cp.cuda.Device(1):
        kept = cp.empty(1000, np.float64)
        assert pool.used_bytes() == 8000
        assert cp.cuda.runtime.memGetInfo() == (total - 8000, total)
    assert pool.used_bytes() == 0 and cp.cuda.runtime.memGetInfo()[0] == free0
    del kept
    with cp.cuda.Device(1):
        assert pool.used_bytes() == 0



def test_results_land_on_the_trees_device_not_the_current_one(cp):
    import gpuflat as gf

    with cp.cuda.Device(1):
        tree = {"w": cp.asarray(np.arange(5.0)), "b": cp.asarray(np.ones(3))}
    flat, re = gf.destructure(tree)  # the current device is 0
    assert flat.device.id == 1 and flat.get().tolist() == [0, 1, 2, 3, 4, 1, 1, 1]
    rebuilt = re(flat)
    assert rebuilt["w"].device.id == 1 and rebuilt["w"].get().tolist() == [0, 1, 2, 3, 4]
    out = gf.flatten(gf.plan(tree), tree)
    assert out.device.id == 1
    assert gf.unflatten(gf.plan(tree), flat)["b"].device.id == 1
    assert float(gf.total("l2", tree).get()) == float(np.linalg.norm(np.arange(5.0)) + np.sqrt(3))


def test_a_capture_refuses_pool_allocations_synchronisations_uploads_and_reads(cp):
    x = cp.zeros(3)
    stream = cp.cuda.Stream()
    stream.begin_capture()
    with stream:
        for work, what in [(lambda: cp.empty(3), "memory-pool allocation"),
                           (lambda: stream.synchronize(), "Stream.synchronize"),
                           (lambda: cp.cuda.Device(0).synchronize(), "Device.synchronize"),
                           (lambda: cp.asarray(np.ones(2)), "upload"),
                           (lambda: x.get(), "device-to-host read")]:
            with pytest.raises(cp.ContractError, match=what):
                work()
    stream.end_capture()
    cp.empty(3)  # allowed again once the capture ended
    stream.synchronize()


def test_captured_work_runs_when_the_graph_is_launched_not_before(cp):
    x = cp.asarray(np.arange(3.0))
    cp.cuda.get_current_stream().synchronize()  # the upload lands for every stream
    stream = cp.cuda.Stream()
    blocks = []
    allocator = cp.cuda.memory.PythonFunctionAllocator(lambda n, device: blocks.append(n) or 0x100,
                                                       lambda ptr, device: None)
    stream.begin_capture()
    with stream, cp.cuda.using_allocator(allocator.malloc):
        y = x * 2  # allocated through the allocator, computed when the graph runs
        x.fill(1.0)
    graph = stream.end_capture()
    assert blocks == [24] and x.get().tolist() == [0.0, 1.0, 2.0]
    graph.launch()
    assert x.get().tolist() == [1.0, 1.0, 1.0] and y.get().tolist() == [0.0, 2.0, 4.0]
    graph.launch()
    assert y.get().tolist() == [2.0, 2.0, 2.0]
