"""A stand-in for PyTorch's CUDA side, over the CuPy stand-in (tests/cupy_stand_in.py).

PyTorch on the CI machines has no CUDA, so the paths gpuflat takes for
CUDA tensors would never run there. ``install(monkeypatch, cupy)`` gives
PyTorch what those paths touch, and no more:

- CUDA tensors: CPU tensors (a subclass) that say ``is_cuda`` and
  ``device('cuda', 0)``, made by :func:`cuda`, by factories given a CUDA
  device, and by ``.to('cuda')``; parameters of that kind (:func:`parameter`);
  the CuPy stand-in imports them through ``cupy.from_dlpack`` on its current
  stream;
- streams: ``torch.cuda.Stream``, ``torch.cuda.current_stream`` and the
  ``torch.cuda.stream`` context, per thread; the default stream is 0;
- the caching allocator's ``caching_allocator_alloc`` and
  ``caching_allocator_delete``, which record the stream of each block;
- ``torch.cuda.synchronize`` (the CuPy stand-in's device synchronisation);
- host reads of a CUDA tensor (``item``, ``tolist``, ``bool``, ``float``,
  ``cpu``...) count in ``host_reads`` and raise while a graph is captured;
- :meth:`TorchCuda.capture`, the steps ``torch.cuda.graph`` takes: a device
  synchronisation, then the call on a capture stream of its own, whose CuPy
  work the CuPy stand-in records instead of running, as are PyTorch's own
  operations on CUDA tensors; the returned graph's ``replay()`` runs it all again.
"""
from __future__ import annotations

import contextlib
import itertools
import threading

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree

from gpuflat._src.arrays import external_stream

CUDA = torch.device("cuda", 0)
_HOST_READS = {"item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__"}


class CudaTensor(torch.Tensor):
    """A CPU tensor that says it lives on CUDA device 0."""

    is_cuda = property(lambda self: True)
    device = property(lambda self: CUDA)


class CudaParameter(torch.nn.Parameter):
    """A parameter that says it lives on CUDA device 0."""

    is_cuda = property(lambda self: True)
    device = property(lambda self: CUDA)


def cuda(t):
    """``t``'s memory as a stand-in CUDA tensor."""
    return t.as_subclass(CudaTensor)


def parameter(t):
    return CudaParameter(t.detach().clone())


def _says_cuda(x) -> bool:
    if isinstance(x, torch.Tensor):
        return isinstance(x, (CudaTensor, CudaParameter))
    if isinstance(x, torch.device):
        return x.type == "cuda"
    return isinstance(x, str) and x.startswith("cuda")


def _on_host(x):
    return "cpu" if not isinstance(x, torch.Tensor) and _says_cuda(x) else x


def _wrap(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, (CudaTensor, CudaParameter)):
        return x.as_subclass(CudaTensor)
    return x


def _in_place(name: str) -> bool:
    return name in ("__setitem__", "copy_") or (name.endswith("_") and not name.startswith("__"))


class Stream:
    """torch.cuda.Stream: a pointer on device 0."""

    _ids = itertools.count(1)

    def __init__(self, device=None, priority=0, ptr=None):
        self.cuda_stream = next(self._ids) * 0x10000 if ptr is None else ptr
        self.device = CUDA

    def __eq__(self, other):
        return isinstance(other, Stream) and other.cuda_stream == self.cuda_stream

    def __hash__(self):
        return hash(self.cuda_stream)


class Graph:
    """What :meth:`TorchCuda.capture` captured; ``replay()`` runs it again."""

    def __init__(self, cupy_graph):
        self._graph = cupy_graph

    def replay(self):
        self._graph.launch()


class TorchCuda(TorchFunctionMode):
    """PyTorch's CUDA side over the CuPy stand-in; see the module's docstring."""

    def __init__(self, cupy):
        super().__init__()
        self.cupy = cupy
        self.default = Stream(ptr=0)
        self.local = threading.local()
        self.allocations = []  # (bytes, device, stream pointer) of each caching-allocator block
        self.freed = []
        self.host_reads = 0
        self._ptrs = itertools.count(1)

    # ------------------------------------------------------------ torch.cuda
    def current_stream(self, device=None):
        return getattr(self.local, "stream", self.default)

    @contextlib.contextmanager
    def stream(self, stream):
        saved = self.current_stream()
        self.local.stream = stream
        try:
            yield stream
        finally:
            self.local.stream = saved

    def caching_allocator_alloc(self, size, device=None, stream=None):
        self.allocations.append((size, device, stream))
        return next(self._ptrs) * 0x1000

    def caching_allocator_delete(self, ptr):
        self.freed.append(ptr)

    def synchronize(self, device=None):
        self.cupy.cuda.Device(0).synchronize()

    def capturing(self) -> bool:
        return self._cupy_stream().is_capturing()

    def capture(self, call):
        """(graph, what ``call()`` returned) as ``torch.cuda.graph`` captures it."""
        self.synchronize()
        stream = Stream()
        with self.stream(stream):
            cupy_stream = self._cupy_stream()
            cupy_stream.begin_capture()
            try:
                out = call()
            finally:
                graph = cupy_stream.end_capture()
        return Graph(graph), out

    def _cupy_stream(self):
        return external_stream(self.cupy, self.current_stream().cuda_stream, 0)

    # ------------------------------------------------------------ operations on CUDA tensors
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = _pytree.tree_leaves((args, kwargs))
        if not any(map(_says_cuda, leaves)):
            return func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _HOST_READS:
            if self.capturing():
                raise self.cupy.ContractError(f"a host read ({name}) of a CUDA tensor while a graph is captured")
            self.host_reads += 1
            out = func(*args, **kwargs)
            return out.as_subclass(torch.Tensor) if isinstance(out, torch.Tensor) else out
        args, kwargs = _pytree.tree_map(_on_host, (args, kwargs))

        def run():
            return func(*args, **kwargs)

        if self.capturing() and _in_place(name):
            self.cupy.add_to_capture(self._cupy_stream(), run)  # runs when the graph does, not now
            return args[0]
        out = _pytree.tree_map(_wrap, run())
        if isinstance(out, torch.Tensor) and self.capturing():
            def again():
                with torch._C.DisableTorchFunction():
                    fresh = run()
                    if fresh.data_ptr() != out.data_ptr():
                        out.copy_(fresh)
            self.cupy.add_to_capture(self._cupy_stream(), again)
        return out


def install(monkeypatch, cupy) -> TorchCuda:
    """Give ``torch.cuda`` the stand-in's streams, allocator and synchronisation,
    and make operations on stand-in CUDA tensors work (until the test ends)."""
    tc = TorchCuda(cupy)
    for name in ("current_stream", "stream", "caching_allocator_alloc", "caching_allocator_delete",
                 "synchronize"):
        monkeypatch.setattr(torch.cuda, name, getattr(tc, name))
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    return tc
