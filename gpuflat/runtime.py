"""Where the CUDA backend's kernels run: a real GPU through CuPy, or the host
emulator.

Both runtimes take the same launches (a kernel name expression, a grid, a
block, and arguments that are device arrays or NumPy scalars), so
``gpuflat.backends.cuda`` builds every table, grid and argument list once
for both. Both count what a test wants to pin down: kernel launches, host
synchronisations (every device-to-host read) and table uploads.

>>> rt = EmulatedRuntime()
>>> table = rt.upload(np.arange(3, dtype=np.int64))
>>> rt.stats.uploads, rt.stats.syncs
(1, 0)
>>> rt.to_host(table).tolist(), rt.stats.syncs
([0, 1, 2], 1)
"""
from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import numpy as np

from gpuflat import kernel_loader

WARP = 32
MAX_BLOCK = 1024


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

    def snapshot(self) -> tuple:
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


class Runtime:
    """The launch path shared by the real and the emulated device.

    Subclasses set ``name`` (the backend name they serve), ``xp`` (the array
    module), ``block`` (threads per block of the grid-stride kernels) and
    ``max_grid``, and implement ``_empty``, ``_pointer``, ``_launch``,
    ``_upload`` and ``_to_host``.
    """

    name = "runtime"
    xp = np
    block = 256
    max_grid = 1

    def __init__(self):
        self.stats = Stats()
        self._lock = threading.Lock()

    # What the backend calls.
    @property
    def device_key(self):
        """A hashable naming this device, for per-device table caches."""
        return (self.name,)

    def on_device(self):
        """A context in which array-module calls run on this runtime's device."""
        return contextlib.nullcontext()

    def empty(self, shape, dtype):
        """An uninitialised device array (no upload: nothing crosses the bus)."""
        return self._empty(shape, dtype)

    def zeros(self, shape, dtype):
        """A zeroed device array (a memset on the device, no upload)."""
        return self._zeros(shape, dtype)

    def upload(self, host: np.ndarray):
        """Copy a host table to the device; counted in ``stats.uploads``."""
        with self._lock:
            self.stats.uploads += 1
        return self._upload(np.ascontiguousarray(host))

    def to_host(self, array) -> np.ndarray:
        """Read a device array back; counted in ``stats.syncs`` (it waits for the device)."""
        with self._lock:
            self.stats.syncs += 1
        return self._to_host(array)

    def pointer(self, array) -> int:
        """The device address of ``array``'s first element."""
        return self._pointer(array)

    def grid_for(self, n_warps: int) -> int:
        """Blocks for a grid-stride kernel that has ``n_warps`` warps' worth of work."""
        per_block = self.block // WARP
        return int(max(1, min(self.max_grid, -(-n_warps // per_block))))

    def launch(self, name: str, grid: int, block: int, args) -> None:
        """Launch kernel ``name`` (a name expression); ``args`` are device arrays
        (passed as pointers) and NumPy scalars (passed by value). Raises
        ``ValueError`` for a block that is not whole warps (see :func:`check_launch`)."""
        grid, block = int(grid), int(block)
        check_launch(name, grid, block)
        with self._lock:
            self.stats.launches += 1
        self._launch(name, grid, block, args)

    # Implementation hooks.
    def _empty(self, shape, dtype):
        raise NotImplementedError

    def _zeros(self, shape, dtype):
        raise NotImplementedError

    def _pointer(self, array) -> int:
        raise NotImplementedError

    def _upload(self, host):
        raise NotImplementedError

    def _to_host(self, array):
        raise NotImplementedError

    def _launch(self, name, grid, block, args):
        raise NotImplementedError


class EmulatedRuntime(Runtime):
    """The kernels compiled for the host (``gpuflat.emulator``): host memory is
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
        self._library = None

    @property
    def library(self):
        """The emulator library of the kernels, built on first use."""
        if self._library is None:
            self._library = kernel_loader.emulator_library()
        return self._library

    def _empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def _zeros(self, shape, dtype):
        return np.zeros(shape, dtype)

    def _pointer(self, array) -> int:
        return array.ctypes.data

    def _upload(self, host):
        return np.array(host, copy=True)

    def _to_host(self, array):
        return np.array(array, copy=True)

    def _launch(self, name, grid, block, args):
        converted = [np.uint64(self._pointer(a)) if isinstance(a, np.ndarray) else a for a in args]
        self.library.launch(name, grid, block, converted)


class CupyRuntime(Runtime):
    """One CUDA device through CuPy.

    Every allocation, upload, launch and read-back runs inside ``with
    device:``, so a runtime for device 1 never touches the current device.
    Launches and uploads go on CuPy's current stream: to launch on PyTorch's,
    wrap the calls in ``with cupy.cuda.ExternalStream(ptr):``. The kernels are
    the cubin of ``kernel_loader.device_cubin`` for the device's compute
    capability, the binary the compile checks build.
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
        self._kernels: dict = {}
        self._module = None

    @property
    def device_key(self):
        return (self.name, self.device.id)

    def on_device(self):
        return self.device

    def _empty(self, shape, dtype):
        with self.device:
            return self.xp.empty(shape, dtype)

    def _zeros(self, shape, dtype):
        with self.device:
            return self.xp.zeros(shape, dtype)

    def _pointer(self, array) -> int:
        if array.device.id != self.device.id:
            raise ValueError(f"array on CUDA device {array.device.id}; this runtime launches on "
                             f"device {self.device.id}")
        return array.data.ptr

    def _upload(self, host):
        # The tables are cached and reused by later launches, which may run on
        # another stream (another thread's, or an ExternalStream): one that is
        # not ordered after this copy could read the table before it lands.
        # Uploads are rare, so the copy is made synchronous instead.
        with self.device:
            table = self.xp.asarray(host)
            self.xp.cuda.get_current_stream().synchronize()
            return table

    def _to_host(self, array):
        with self.device:
            return self.xp.asnumpy(array)

    def _launch(self, name, grid, block, args):
        with self.device:
            self._kernel(name)((grid,), (block,), tuple(args))

    def _kernel(self, name: str):
        with self._lock:
            kernel = self._kernels.get(name)
            if kernel is None:
                if self._module is None:
                    self._module = kernel_loader.cupy_module(self.device)
                module, lowered = self._module
                kernel = self._kernels[name] = module.get_function(lowered[name])
            return kernel
