"""Where the CUDA backend's kernels run: a real GPU through CuPy, or the host
emulator.

Both runtimes take the same launches (a kernel name expression, a grid, a
block, and arguments that are device arrays or NumPy scalars), so
``gpuflat._src.backends.cuda`` builds every table, grid and argument list once
for both. Both count what a test wants to pin down: kernel launches, host
synchronisations (every device-to-host read) and table uploads (none of
which makes the host wait).

Tables (:class:`DeviceTable`) are uploaded once and read by launches on any
stream. On a GPU the upload goes through pinned staging on the current
stream with no host wait; a launch on another stream first waits for it on
the device (an event); a table is freed only once every other stream that
read it is done with it (an event per stream), and never if a CUDA graph
captured a launch reading it. While a stream captures a graph nothing can
be uploaded or allocated: a table needed then is written into pinned host
memory set aside before the capture (:class:`CaptureReserve`), which the
kernels read through its address.

>>> rt = EmulatedRuntime()
>>> table = rt.upload(np.arange(3, dtype=np.int64))
>>> rt.stats.uploads, rt.stats.syncs
(1, 0)
>>> rt.to_host(table).tolist(), rt.stats.syncs
([0, 1, 2], 1)
"""
from __future__ import annotations

import contextlib
import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from gpuflat._src import caches, kernel_loader
from gpuflat._src.arrays import external_stream
from gpuflat.errors import CaptureError

if TYPE_CHECKING:
    from collections.abc import Callable, Hashable, Sequence
    from contextlib import AbstractContextManager
    from types import ModuleType

    from numpy.typing import DTypeLike

WARP = 32
MAX_BLOCK = 1024
# CUDA's errors for a context that is gone: the process is tearing CUDA down
# (cudaErrorCudartUnloading) or the context was destroyed
# (cudaErrorContextIsDestroyed); nothing on it can be freed or asked any more.
# https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html
CONTEXT_GONE = (4, 709)


@dataclass
class Stats:
    """Counters of one runtime; ``reset()`` zeroes them.

    >>> s = Stats(); s.launches += 2; s.snapshot()
    (2, 0, 0)
    """

    launches: int = 0
    syncs: int = 0
    uploads: int = 0

    def reset(self) -> None:
        self.launches = self.syncs = self.uploads = 0

    def snapshot(self) -> tuple[int, int, int]:
        """(launches, syncs, uploads)."""
        return (self.launches, self.syncs, self.uploads)


def check_launch(name: str, grid: int, block: int) -> None:
    """Refuse a launch configuration the kernels cannot run.

    The kernels reduce with full-mask warp shuffles, so a block must be whole
    warps: a multiple of 32, at most 1024 threads.

    >>> check_launch("k", 1, 256)
    >>> check_launch("k", 1, 48)
    Traceback (most recent call last):
    ...
    ValueError: kernel 'k': block of 48 threads; expected a multiple of 32 in 32..1024 (whole warps)
    """
    if block % WARP or not 0 < block <= MAX_BLOCK:
        raise ValueError(f"kernel {name!r}: block of {block} threads; expected a multiple of {WARP} "
                         f"in {WARP}..{MAX_BLOCK} (whole warps)")
    if not 0 < grid < 2**31:
        raise ValueError(f"kernel {name!r}: grid of {grid} blocks; expected 1..2**31-1")


class DeviceTable:
    """A host table copied to the device once, and what its lifetime needs:
    the stream it was uploaded on, an event marking the copy (``ready``; None
    for a table the kernels read from pinned host memory, which nothing needs
    to wait for), the streams that waited for it, the last use by each other
    stream, the pinned staging the copy reads until it lands, and whether a
    CUDA graph captured a launch reading it. Only ``array`` matters to a launch.

    >>> DeviceTable(np.arange(2)).array.tolist()
    [0, 1]
    """

    __slots__ = ("array", "stream", "ready", "staging", "waited", "last_use", "captured")

    def __init__(self, array: Any, stream: int | None = None, ready: Any = None, staging: Any = None) -> None:
        self.array = array
        self.stream = stream  # the stream's pointer
        self.ready = ready
        self.staging = staging
        self.waited: set[int] = set()  # stream pointers
        self.last_use: dict[int, Any] = {}  # stream pointer -> event
        self.captured = False


class CaptureReserve:
    """Pinned host memory set aside outside any capture for the tables a
    CUDA-graph capture needs.

    A capture can neither allocate nor upload, yet a step whose gradients
    are allocated inside it (PyTorch's whole-step capture) needs tables of
    addresses that did not exist before. Under CUDA's unified virtual
    address space a kernel may read page-locked host memory through its own
    address
    (https://docs.nvidia.com/cuda/cuda-c-programming-guide/#unified-virtual-address-space),
    so such a table is written into this reserve on the host and read from
    there by every replay; the graph owns what it took, for good.

    The reserve is sized by the tables the last ``window`` distinct tables
    launches read, twice over: a capture of the same calls as before it
    needs tables of those sizes.

    >>> reserve = CaptureReserve(bytearray, window=2)
    >>> for table in (1, 2, 3):
    ...     reserve.note(table, 300)  # 512 bytes each, aligned
    >>> reserve.refill()
    >>> reserve.need, reserve.capacity
    (1024, 2048)
    >>> reserve.take(1000)[1], reserve.take(1000)[1], reserve.take(1000)
    (0, 1024, None)
    """

    ALIGN = 256  # each table starts on a boundary wide enough for any vector load
    block: Any  # what ``allocate`` returned: pinned memory, or None before the first refill

    def __init__(self, allocate: Callable[[int], Any], window: int = 64) -> None:
        self.allocate = allocate
        self.need = 0  # the bytes of the tables in ``recent``
        self.recent = caches.LRU("capture reserve's recent tables", window, on_evict=self._forget)  # id -> bytes
        self.block, self.capacity, self.used = None, 0, 0  # CuPy's pinned memory has size(), no len()

    def note(self, key: Hashable, nbytes: int) -> None:
        """A launch read a table of ``nbytes`` (outside any capture)."""
        if self.recent.find(key) is None:
            self.need += _aligned(nbytes)
            self.recent.put(key, _aligned(nbytes))

    def _forget(self, nbytes: int) -> None:
        self.need -= nbytes

    def refill(self) -> None:
        """Set aside a new block when what is left is less than the recent
        tables need (outside any capture: it is a pinned allocation)."""
        if self.need and self.capacity - self.used < self.need:
            self.block, self.capacity, self.used = self.allocate(2 * self.need), 2 * self.need, 0

    def take(self, nbytes: int) -> tuple[Any, int] | None:
        """(the block, an offset) holding ``nbytes`` for a capture's table, or
        None when the reserve cannot hold them."""
        if self.used + nbytes > self.capacity:
            return None
        offset, self.used = self.used, self.used + _aligned(nbytes)
        return self.block, offset


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // CaptureReserve.ALIGN) * CaptureReserve.ALIGN


class Runtime:
    """The launch path shared by the real and the emulated device.

    Subclasses set ``name`` (the backend name they serve), ``xp`` (the array
    module), ``block`` (threads per block of the grid-stride kernels) and
    ``max_grid``, and implement ``_empty``, ``_pointer``, ``_launch``,
    ``_upload`` and ``_to_host``; a device with streams also overrides the
    stream hooks ``_before_launch``, ``_after_launch`` and ``release``.
    """

    name = "runtime"
    xp: ModuleType = np
    block = 256
    max_grid = 1

    def __init__(self) -> None:
        self.stats = Stats()
        self._lock = threading.RLock()  # re-entrant: a finaliser may release a table while it is held

    # What the backend calls.
    @property
    def device_key(self) -> tuple[Hashable, ...]:
        """A hashable naming this device, for per-device table caches."""
        return (self.name,)

    def on_device(self) -> AbstractContextManager[Any]:
        """A context in which array-module calls run on this runtime's device."""
        return contextlib.nullcontext()

    def empty(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> Any:
        """An uninitialised device array (no upload: nothing crosses the bus)."""
        return self._empty(shape, dtype)

    def zeros(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> Any:
        """A zeroed device array (a memset on the device, no upload)."""
        return self._zeros(shape, dtype)

    def upload(self, host: np.ndarray, purpose: str = "an upload") -> Any:
        """Copy a host table to the device, with no host wait; counted in
        ``stats.uploads``. The copy is ordered on the current stream only: a
        table read on any stream comes from :meth:`upload_table`."""
        return self.upload_table(host, purpose).array

    def upload_table(self, host: np.ndarray, purpose: str = "an upload") -> DeviceTable:
        """``host`` copied to the device as a :class:`DeviceTable`, which
        launches on any stream may read (pass it in ``tables``). ``purpose``
        names the call needing it, for the CaptureError raised when the
        current stream is capturing a CUDA graph (an upload cannot be captured)."""
        with self._lock:
            self.stats.uploads += 1
        return self._upload(np.ascontiguousarray(host), purpose)

    def release(self, table: DeviceTable) -> None:
        """Let ``table`` go once no stream can still read it (see the device's override)."""

    def to_host(self, array: Any) -> np.ndarray:
        """Read a device array back; counted in ``stats.syncs`` (it waits for the device)."""
        with self._lock:
            self.stats.syncs += 1
        return self._to_host(array)

    def pointer(self, array: Any) -> int:
        """The device address of ``array``'s first element."""
        return self._pointer(array)

    def grid_for(self, n_warps: int) -> int:
        """Blocks for a grid-stride kernel that has ``n_warps`` warps' worth of work."""
        per_block = self.block // WARP
        return int(max(1, min(self.max_grid, -(-n_warps // per_block))))

    def launch(self, name: str, grid: int, block: int, args: Sequence[Any],
               tables: Sequence[DeviceTable] = ()) -> None:
        """Launch kernel ``name`` (a name expression); ``args`` are device arrays
        (passed as pointers) and NumPy scalars (passed by value); ``tables``
        the DeviceTables whose arrays ``args`` read, ordered after their
        uploads and noted as used by the current stream. Raises
        ``ValueError`` for a block that is not whole warps (see :func:`check_launch`)."""
        grid, block = int(grid), int(block)
        check_launch(name, grid, block)
        with self._lock:
            self.stats.launches += 1
        for table in tables:
            self._before_launch(table)
        self._launch(name, grid, block, args)
        for table in tables:
            self._after_launch(table)

    # Implementation hooks.
    def _empty(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> Any:
        raise NotImplementedError

    def _zeros(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> Any:
        raise NotImplementedError

    def _pointer(self, array: Any) -> int:
        raise NotImplementedError

    def _upload(self, host: np.ndarray, purpose: str) -> DeviceTable:
        raise NotImplementedError

    def _to_host(self, array: Any) -> np.ndarray:
        raise NotImplementedError

    def _launch(self, name: str, grid: int, block: int, args: Sequence[Any]) -> None:
        raise NotImplementedError

    def _before_launch(self, table: DeviceTable) -> None:
        """Order the current stream after ``table``'s upload (nothing: one stream)."""

    def _after_launch(self, table: DeviceTable) -> None:
        """Note that the current stream read ``table`` (nothing: one stream)."""


class EmulatedRuntime(Runtime):
    """The kernels compiled for the host (``gpuflat._src.emulator``): host memory is
    device memory and arrays are NumPy arrays.

    Every thread of a block is a host thread, so the grid is kept small (one
    warp per block, at most ``max_grid`` blocks); the kernels' results do not
    depend on the grid, and tests check that.
    """

    name = "emulated"
    xp = np

    def __init__(self, block: int = WARP, max_grid: int = 2):
        super().__init__()
        check_launch("grid-stride kernels", max_grid, block)
        self.block = block
        self.max_grid = max_grid
        self._library: Any = None

    @property
    def library(self) -> Any:
        """The emulator library of the kernels, built on first use."""
        if self._library is None:
            from gpuflat._src import emulator  # only the emulated backend builds and loads it

            self._library = emulator.kernels_library()
        return self._library

    def _empty(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
        return np.empty(shape, dtype)

    def _zeros(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> np.ndarray:
        return np.zeros(shape, dtype)

    def _pointer(self, array: np.ndarray) -> int:
        return array.ctypes.data

    def _upload(self, host: np.ndarray, purpose: str) -> DeviceTable:
        return DeviceTable(np.array(host, copy=True))

    def _to_host(self, array: Any) -> np.ndarray:
        return np.array(array, copy=True)

    def _launch(self, name: str, grid: int, block: int, args: Sequence[Any]) -> None:
        converted = [np.uint64(self._pointer(a)) if isinstance(a, np.ndarray) else a for a in args]
        self.library.launch(name, grid, block, converted)


class CupyRuntime(Runtime):
    """One CUDA device through CuPy.

    Every allocation, upload, launch and read-back runs inside ``with
    device:``, so a runtime for device 1 never touches the current device.
    Launches and uploads go on CuPy's current stream: to launch on PyTorch's,
    wrap the calls in ``gpuflat._src.arrays.device_scope``. The kernels are
    the cubin of ``kernel_loader.device_cubin`` for the device's compute
    capability, the binary the compile checks build.

    Tables are shared by every stream (another thread's, PyTorch's,
    a graph's capture stream): each upload is asynchronous from pinned
    staging and marked with an event, which a launch on another stream
    waits for on the device; a released table is kept until the events
    recorded after its last use on every other stream are done, since CuPy's
    pool and PyTorch's allocator hand freed memory to the next allocation on
    the stream that allocated it, which nothing orders after the other
    streams' reads. A table a captured graph reads is kept for good: the
    graph may be replayed at any time. A table needed during a capture is
    taken from the :class:`CaptureReserve`, which every launch outside a
    capture keeps as large as twice the tables recently read.
    """

    name = "cuda"

    def __init__(self, device_id: int | None = None, block: int = 256, blocks_per_sm: int = 4):
        super().__init__()
        import cupy

        self.xp = cupy
        self.device = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
        check_launch("grid-stride kernels", 1, block)
        self.block = block
        self.max_grid = self.device.attributes["MultiProcessorCount"] * blocks_per_sm
        self._kernels: dict[str, Any] = {}
        self._module: tuple[Any, dict[str, str]] | None = None  # (the module, the lowered names)
        self._retired: list[DeviceTable] = []  # released tables other streams may still read
        self._kept: list[DeviceTable] = []  # tables read by captured graphs
        self._streams: dict[int, Any] = {}  # ptr -> CuPy's stream over it, for each that uploaded or launched
        self._reserve = CaptureReserve(cupy.cuda.alloc_pinned_memory)

    @property
    def device_key(self) -> tuple[Hashable, ...]:
        return (self.name, self.device.id)

    def on_device(self) -> AbstractContextManager[Any]:
        return self.device

    def _empty(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> Any:
        with self.device:
            return self.xp.empty(shape, dtype)

    def _zeros(self, shape: int | tuple[int, ...], dtype: DTypeLike) -> Any:
        with self.device:
            return self.xp.zeros(shape, dtype)

    def _pointer(self, array: Any) -> int:
        if array.device.id != self.device.id:
            raise ValueError(f"array on CUDA device {array.device.id}; this runtime launches on "
                             f"device {self.device.id}")
        return array.data.ptr

    def _upload(self, host: np.ndarray, purpose: str) -> DeviceTable:
        cuda = self.xp.cuda
        with self.device:
            stream = cuda.get_current_stream()
            if stream.is_capturing():
                return self._table_in_capture(host, purpose, stream)
            self._note_stream(stream.ptr)
            self._free_finished()
            table = self.xp.empty(host.shape, host.dtype)
            staging = cuda.alloc_pinned_memory(max(host.nbytes, 1))
            np.frombuffer(staging, host.dtype, host.size)[...] = host.ravel()
            # From pinned memory the copy is asynchronous: the host does not wait.
            table.set(np.frombuffer(staging, host.dtype, host.size).reshape(host.shape), stream=stream)
            ready = cuda.Event(disable_timing=True)
            ready.record(stream)
            return DeviceTable(table, stream.ptr, ready, staging)

    def _table_in_capture(self, host: np.ndarray, purpose: str, stream: Any) -> DeviceTable:
        """``host`` written into the capture reserve, read there by the
        kernels (no upload, no allocation: neither can be captured)."""
        with self._lock:
            taken = self._reserve.take(host.nbytes)
        if taken is None:
            raise CaptureError(
                f"{purpose} needs a {host.nbytes}-byte table while stream {stream.ptr:#x} captures a CUDA "
                f"graph, more than the pinned memory set aside for captures holds (as much as the tables "
                f"of the launches before the capture): make the same call once before capturing (a "
                f"warm-up call on arrays of the same sizes), so that memory is set aside")
        block, offset = taken
        np.frombuffer(block, host.dtype, host.size, offset)[...] = host.ravel()
        cuda = self.xp.cuda
        address = np.frombuffer(block, np.uint8).ctypes.data + offset
        memory = cuda.UnownedMemory(address, host.nbytes, block, self.device.id)
        array = self.xp.ndarray(host.shape, host.dtype, memptr=cuda.MemoryPointer(memory, 0))
        return DeviceTable(array, stream.ptr, None, block)

    def _before_launch(self, table: DeviceTable) -> None:
        stream = self.xp.cuda.get_current_stream()
        if stream.ptr == table.stream or stream.ptr in table.waited or table.ready is None:
            return
        self._note_stream(stream.ptr)
        # No event is queried here: in the global capture mode torch.cuda.graph
        # uses, an event query from any thread while any stream captures
        # invalidates the capture (PyTorch's allocator defers its own event
        # queries while a capture is under way for this reason). A capturing
        # stream needs no wait: torch.cuda.graph synchronises the device
        # before it begins, so a table uploaded before has landed, and an
        # upload during a capture raises. Any other stream waits on the device.
        if not stream.is_capturing():
            stream.wait_event(table.ready)  # on the device: the host does not wait
        table.waited.add(stream.ptr)

    def _after_launch(self, table: DeviceTable) -> None:
        stream = self.xp.cuda.get_current_stream()
        if stream.is_capturing():
            table.captured = True
            return
        with self._lock:
            self._reserve.note(id(table), table.array.nbytes)
            self._reserve.refill()
        if stream.ptr != table.stream:
            event = table.last_use.get(stream.ptr)
            if event is None:
                event = table.last_use[stream.ptr] = self.xp.cuda.Event(disable_timing=True)
            event.record(stream)

    def _note_stream(self, ptr: int) -> None:
        """Remember stream ``ptr``, which :meth:`_free_finished` asks whether it captures."""
        if ptr not in self._streams:
            self._streams[ptr] = external_stream(self.xp, ptr)

    def release(self, table: DeviceTable) -> None:
        """Free ``table`` once every other stream that read it is done with it;
        never if a captured graph reads it. ``release`` may run from a garbage
        collector's finaliser at any moment, a capture's included: the
        freeing (event queries) then waits for a later release or upload
        outside any capture. While the interpreter shuts down nothing is
        freed: CuPy's modules may be half gone, and the process's end frees
        the device memory anyway."""
        if sys.is_finalizing():
            return
        with self._lock:
            if table.captured:
                self._kept.append(table)
            else:
                self._retired.append(table)
        self._free_finished()

    def _free_finished(self) -> None:
        """Drop the released tables no stream can still read (event queries,
        no wait), unless the current stream or one this runtime used is
        capturing a graph (``cudaStreamIsCapturing`` may be asked during a
        capture; an event query may not), or the device's context is gone
        (:data:`CONTEXT_GONE`: at exit, CUDA may be torn down before the
        last finalisers run), when nothing can be asked or freed."""
        with self.device, self._lock:
            try:
                if self.xp.cuda.get_current_stream().is_capturing() or \
                        any(stream.is_capturing() for stream in self._streams.values()):
                    return
                self._retired = [t for t in self._retired if not (
                    (t.ready is None or t.ready.done) and all(e.done for e in t.last_use.values()))]
            except self.xp.cuda.runtime.CUDARuntimeError as exc:
                if getattr(exc, "status", None) not in CONTEXT_GONE:
                    raise

    def _to_host(self, array: Any) -> np.ndarray:
        with self.device:
            return self.xp.asnumpy(array)

    def _launch(self, name: str, grid: int, block: int, args: Sequence[Any]) -> None:
        with self.device:
            self._kernel(name)((grid,), (block,), tuple(args))

    def _kernel(self, name: str) -> Any:
        with self._lock:
            kernel = self._kernels.get(name)
            if kernel is None:
                if self._module is None:
                    self._module = kernel_loader.cupy_module(self.device)
                module, lowered = self._module
                kernel = self._kernels[name] = module.get_function(lowered[name])
            return kernel
