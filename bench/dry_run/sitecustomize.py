"""``bash bench/gpu_check.sh --dry-run``: every Python the script starts
imports this first (the folder is on ``PYTHONPATH``), and ``import cupy``
gives the CuPy contract stand-in (tests/cupy_stand_in.py: one sm_90 device
reporting CUDA 13, its kernels run by the host emulator), so the script's
plumbing runs end to end before it ever meets a GPU.

The stand-in covers what gpuflat calls; the few calls the benchmark's
timer, floors and machine report add are given here, on the host. Their
times are host times of emulated kernels: a dry run's figures mean nothing.
"""
import sys
import time

import cupy_stand_in  # tests/, on PYTHONPATH in a dry run
import numpy as np

cupy = cupy_stand_in.make_cupy(("90",))


def _properties(device_id):
    return {"name": b"CuPy stand-in (dry run)", "l2CacheSize": 1 << 16}


def _elapsed_ms(start, end):
    # The stand-in's events mark work, not time: a dry run's timer reads the host clock.
    return (end.host_time - start.host_time) * 1e3


_record = cupy.cuda.Event.record


def _record_with_time(self, stream=None):
    _record(self, stream)
    self.host_time = time.perf_counter()


_data = cupy.ndarray.data


class _Memory:
    """``ndarray.data``: the stand-in's pointer, and the floors' device-to-device copy."""

    def __init__(self, array):
        self.array, self.ptr = array, _data.fget(array).ptr

    def copy_from_device_async(self, src, nbytes):
        dest = cupy.asnumpy(self.array).reshape(-1).view(np.uint8)
        dest[:nbytes] = cupy.asnumpy(src.array).reshape(-1).view(np.uint8)[:nbytes]
        self.array[...] = cupy.asarray(dest.view(self.array.dtype).reshape(self.array.shape))


class _SpinKernel:
    """``cupy.RawKernel`` of the timer's spin: the host runs nothing (a dry
    run's timer reads the host clock, which no queue orders)."""

    def __init__(self, code, name):
        if name != "gpuflat_bench_spin":
            raise NotImplementedError(f"dry run: only the timer's spin kernel, not {name!r}")

    def __call__(self, grid, block, args):
        pass


class _CopyKernel:
    """``cupy.ElementwiseKernel("T x", "T y", "y = x", ...)``, the one the floors define."""

    def __init__(self, in_params, out_params, operation, name):
        if operation != "y = x":
            raise NotImplementedError(f"dry run: only the copy kernel, not {operation!r}")

    def __call__(self, x, y):
        y[...] = x
        return y


for _name in ("uint8", "int16", "int32", "int64", "float16", "float32", "float64", "complex64", "complex128"):
    setattr(cupy, _name, getattr(cupy, _name, getattr(np, _name)))  # CuPy's dtype names are NumPy's
cupy.cuda.runtime.getDeviceProperties = staticmethod(_properties)
cupy.cuda.get_elapsed_time = _elapsed_ms
cupy.cuda.Event.record = _record_with_time
cupy.ndarray.data = property(_Memory)
cupy.ElementwiseKernel = _CopyKernel
cupy.RawKernel = _SpinKernel
sys.modules["cupy"] = cupy
