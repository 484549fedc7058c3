"""Where the CUDA backend's kernels run: a real GPU through CuPy, or the host
emulator (#3).

Both runtimes take the same launches (a kernel name expression, a grid, a
block, and arguments that are device arrays or NumPy scalars), so
``gpuflat.backends.cuda`` builds every table, grid and argument list once
for both, and CI, which has no GPU, exercises all of it but the few CuPy
calls here. Both count what a test wants to pin down: kernel launches, host
synchronisations (every device-to-host read) and table uploads.

>>> rt = EmulatedRuntime()
>>> table = rt.upload(np.arange(3, dtype=np.int64))
>>> rt.stats.uploads, rt.stats.syncs
(1, 0)
>>> rt.to_host(table).tolist(), rt.stats.syncs
([0, 1, 2], 1)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from gpuflat import kernel_loader


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


class Runtime:
    """The launch path shared by the real and the emulated device.

    Subclasses set ``name`` (the backend name they serve), ``xp`` (the array
    module), ``block`` (threads per block of the grid-stride kernels) and
    ``max_grid``, and implement ``_pointer``, ``_launch``, ``_upload`` and
    ``_to_host``.
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

    def empty(self, shape, dtype):
        """An uninitialised device array (no upload: nothing crosses the bus)."""
        return self.xp.empty(shape, dtype)

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

    def synchronize(self) -> None:
        """Wait for every launch so far; counted in ``stats.syncs``."""
        with self._lock:
            self.stats.syncs += 1
        self._synchronize()

    def pointer(self, array) -> int:
        """The device address of ``array``'s first element."""
        return self._pointer(array)

    def grid_for(self, n_warps: int) -> int:
        """Blocks for a grid-stride kernel that has ``n_warps`` warps' worth of work."""
        per_block = self.block // 32
        return int(max(1, min(self.max_grid, -(-n_warps // per_block))))

    def launch(self, name: str, grid: int, block: int, args) -> None:
        """Launch kernel ``name`` (a name expression); ``args`` are device arrays
        (passed as pointers) and NumPy scalars (passed by value)."""
        with self._lock:
            self.stats.launches += 1
        self._launch(name, int(grid), int(block), args)

    # Implementation hooks.
    def _pointer(self, array) -> int:
        raise NotImplementedError

    def _upload(self, host):
        raise NotImplementedError

    def _to_host(self, array):
        raise NotImplementedError

    def _synchronize(self):
        pass

    def _launch(self, name, grid, block, args):
        raise NotImplementedError


class EmulatedRuntime(Runtime):
    """The kernels compiled for the host (``gpuflat.emulator``): host memory is
    device memory and arrays are NumPy arrays.

    Every thread of a block is a host thread, so the grid is kept small (one
    warp per block, at most ``max_grid`` blocks); the kernels' results do not
    depend on the grid, and tests check that (#3).
    """

    name = "emulated"
    xp = np

    def __init__(self, block: int = 32, max_grid: int = 2):
        super().__init__()
        self.block = block
        self.max_grid = max_grid
        self._library = None

    @property
    def library(self):
        if self._library is None:
            self._library = kernel_loader.emulator_library()
        return self._library

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
    """A CUDA device through CuPy: kernels from ``kernel_loader.cupy_module``,
    launched on CuPy's current stream."""

    name = "cuda"

    def __init__(self, device_id: int | None = None, block: int = 256, blocks_per_sm: int = 8):
        super().__init__()
        import cupy

        self.xp = cupy
        self._device = cupy.cuda.Device(device_id) if device_id is not None else cupy.cuda.Device()
        self.block = block
        self.max_grid = self._device.attributes["MultiProcessorCount"] * blocks_per_sm
        self._kernels: dict = {}

    @property
    def device_key(self):
        return (self.name, self._device.id)

    def _pointer(self, array) -> int:
        return array.data.ptr

    def _upload(self, host):
        with self._device:
            return self.xp.asarray(host)

    def _to_host(self, array):
        return self.xp.asnumpy(array)

    def _synchronize(self):
        self.xp.cuda.get_current_stream().synchronize()

    def _launch(self, name, grid, block, args):
        kernel = self._kernels.get(name)
        if kernel is None:
            kernel = kernel_loader.cupy_module(self._device.id).get_function(name)
            self._kernels[name] = kernel
        with self._device:
            kernel((grid,), (block,), tuple(args))
