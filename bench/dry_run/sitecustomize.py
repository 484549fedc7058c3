"""``bash bench/gpu_check.sh --dry-run``: every Python the script starts
imports this first (the folder is on ``PYTHONPATH``), and ``import cupy``
gives the CuPy contract stand-in (tests/cupy_stand_in.py: one sm_90 device
reporting CUDA 13, its kernels run by the host emulator), so the script's
plumbing runs end to end before it ever meets a GPU.

The stand-in covers what gpuflat calls, and CUDA events' device time (the
time the work queued on the events' stream took to run on the host); the
few calls the benchmark's timer and floors add are given here
(:func:`stand_in`, which the tests load too). Its times are host times of
emulated kernels: a dry run's figures mean nothing.
"""
import sys

import cupy_stand_in  # tests/, on PYTHONPATH in a dry run
import numpy as np


class _SpinKernel:
    """``cupy.RawKernel`` of the timer's spin: it runs nothing, as a spin
    adds nothing to the device time between the events after it."""

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


class _GraphPool:
    """``cupy.cuda.MemoryPool`` as ``bench.graphs`` uses one: a pool of a
    graph's own, handed to ``cuda.using_allocator`` while it captures. The
    stand-in's arrays hold their own bytes; a block here only marks them as
    the pool's."""

    def malloc(self, nbytes):
        return bytearray(0)


def stand_in():
    """The CuPy stand-in with the benchmark's own calls: the timer's spin
    kernel, the floors' copy kernel and device-to-device copy, and the
    graph pool and capture mode of ``--device-time``."""
    cupy = cupy_stand_in.make_cupy(("90",))
    data = cupy.ndarray.data

    class Memory:
        """``ndarray.data``: the stand-in's pointer, and the floors' device-to-device copy."""

        def __init__(self, array):
            self.array, self.ptr = array, data.fget(array).ptr

        def copy_from_device_async(self, src, nbytes):
            dest = cupy.asnumpy(self.array).reshape(-1).view(np.uint8)
            dest[:nbytes] = cupy.asnumpy(src.array).reshape(-1).view(np.uint8)[:nbytes]
            self.array[...] = cupy.asarray(dest.view(self.array.dtype).reshape(self.array.shape))

    for name in ("uint8", "int16", "int32", "int64", "float16", "float32", "float64", "complex64", "complex128"):
        setattr(cupy, name, getattr(cupy, name, getattr(np, name)))  # CuPy's dtype names are NumPy's
    cupy.ndarray.data = property(Memory)
    cupy.ElementwiseKernel = _CopyKernel
    cupy.RawKernel = _SpinKernel
    cupy.cuda.MemoryPool = _GraphPool
    cupy.cuda.runtime.streamCaptureModeRelaxed = 2  # CUDA's cudaStreamCaptureModeRelaxed
    return cupy


if __name__ == "sitecustomize":
    sys.modules["cupy"] = stand_in()
