"""A contract check of CuPy, standing in for the few CuPy entry points that
``gpuflat.runtime.CupyRuntime`` calls. It is not a GPU.

``make_cupy()`` returns a module to put in ``sys.modules["cupy"]``. Its
arrays are NumPy arrays tagged with a device, and its launches run the real
kernels through the host emulator, so results can be checked. What it adds
is CuPy's calling contract, enforced on every call (a breach raises
:class:`ContractError`):

- a module's bytes are the project's NVRTC cubin for the current device's
  compute capability (``kernel_loader.device_cubin``), and its kernels are
  launched on the device it was loaded on;
- a launch has whole-warp blocks (a multiple of 32, at most 1024 threads)
  and at least one block;
- each argument matches the kernel's parameter (read from the emulator
  library's signature of the same source): pointers are device arrays on the
  current device, ``long long`` is ``np.int64``, ``int`` ``np.int32``,
  ``double`` ``np.float64``; a Python number, whose width CuPy would guess,
  is refused;
- a launch or read-back on one stream never uses an upload still in flight
  on another stream (an upload lands when its stream is synchronised);
- an array is never converted to NumPy implicitly (``np.asarray(x)`` raises
  TypeError, as CuPy's does: read it with ``.get()`` or ``cupy.asnumpy``);
- element-wise work (arithmetic, comparisons, ``astype``, ``fill``, item
  assignment, ``count_nonzero``) runs on the current device, which must be
  the array's (no peer access is assumed); ``copy()`` copies to the current
  device, as CuPy's does; memory is counted per device.

Every allocation, upload, module load and launch is recorded in ``events``
with the current device and stream, for tests to check.
"""
from __future__ import annotations

import itertools
import operator
import threading
import types
import weakref
from dataclasses import dataclass

import numpy as np

from gpuflat import kernel_loader

_WARP = 32
_MAX_BLOCK = 1024
# Kernel parameter codes of the emulator library -> the NumPy type CuPy must get.
_SCALARS = {"i8": np.int64, "u8": np.uint64, "i4": np.int32, "u4": np.uint32, "f8": np.float64,
            "f4": np.float32}
# Memory each stand-in device reports in cuda.runtime.memGetInfo.
DEVICE_MEMORY = 1 << 30
# The binary operators of an array, each with its reflected form.
_OPERATORS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
              "pow": operator.pow}
_COMPARISONS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
                "gt": operator.gt, "ge": operator.ge}


class ContractError(AssertionError):
    """A call CuPy would run wrongly or refuse on a real device."""


@dataclass
class Event:
    kind: str  # "empty", "zeros", "upload", "load", "launch", "to_host"
    device: int
    stream: object
    detail: object = None


def make_cupy(compute_capabilities=("90", "80"), sms: int = 2) -> types.ModuleType:
    """A stand-in ``cupy`` module with one device per compute capability."""
    return _StandIn(tuple(compute_capabilities), sms).module


class _Memory:
    """One allocation: its device, its size and the stream of an upload still in flight."""

    def __init__(self, device: int, nbytes: int, pending=None):
        self.device = device
        self.nbytes = nbytes
        self.pending = pending


class _StandIn:
    def __init__(self, capabilities, sms):
        self.capabilities = capabilities
        self.sms = sms
        self.events: list[Event] = []
        self.local = threading.local()
        self.null_streams = {}
        self.stream_ids = itertools.count(1)
        self.lock = threading.Lock()
        # Weakly: an allocation is freed when its last array goes, as in CuPy's pool.
        self.live_memories = weakref.WeakSet()
        self.module = self._module()

    # -------------------------------------------------------- device and stream state
    def current_device(self) -> int:
        stack = getattr(self.local, "devices", None)
        return stack[-1] if stack else 0

    def current_stream(self, device: int):
        streams = getattr(self.local, "streams", {})
        if device in streams:
            return streams[device]
        with self.lock:
            if device not in self.null_streams:
                self.null_streams[device] = self.Stream._null(device)
            return self.null_streams[device]

    def record(self, kind, device, stream, detail=None):
        with self.lock:
            self.events.append(Event(kind, device, stream, detail))

    def check_landed(self, array, stream, what):
        pending = array._memory.pending
        if pending is not None and pending is not stream:
            raise ContractError(f"{what} on stream {stream.ptr} uses an upload still in flight on stream "
                                f"{pending.ptr}: nothing orders the copy before it")

    def check_here(self, array, what):
        """An element-wise operation on ``array``: on its device, after its upload landed."""
        device = self.current_device()
        if array._memory.device != device:
            raise ContractError(f"{what}: array on device {array._memory.device}, current device {device}")
        self.check_landed(array, self.current_stream(device), what)

    def used_bytes(self, device):
        return sum(m.nbytes for m in list(self.live_memories) if m.device == device)

    # -------------------------------------------------------- the module
    def _module(self):
        standin = self
        cuda = types.SimpleNamespace()
        mod = types.ModuleType("cupy")
        mod.__doc__ = "A contract check of CuPy (tests/cupy_stand_in.py), not a GPU."

        class Device:
            def __init__(self, device=None):
                self.id = standin.current_device() if device is None else int(device)
                if not 0 <= self.id < len(standin.capabilities):
                    raise ContractError(f"no CUDA device {self.id}")

            @property
            def attributes(self):
                return {"MultiProcessorCount": standin.sms}

            @property
            def compute_capability(self):
                return standin.capabilities[self.id]

            def __enter__(self):
                standin.local.__dict__.setdefault("devices", []).append(self.id)
                return self

            def __exit__(self, *exc):
                standin.local.devices.pop()

            def __eq__(self, other):
                return isinstance(other, Device) and other.id == self.id

            def __hash__(self):
                return hash(self.id)

        class Stream:
            def __init__(self, non_blocking=False, ptr=None):
                self.device_id = standin.current_device()
                self.ptr = ptr if ptr is not None else next(standin.stream_ids) * 0x100

            @classmethod
            def _null(cls, device):
                stream = cls.__new__(cls)
                stream.device_id, stream.ptr = device, 0
                return stream

            def __enter__(self):
                streams = standin.local.__dict__.setdefault("streams", {})
                saved = standin.local.__dict__.setdefault("saved", [])
                saved.append((self.device_id, streams.get(self.device_id)))
                streams[self.device_id] = self
                return self

            def __exit__(self, *exc):
                device, previous = standin.local.saved.pop()
                if previous is None:
                    standin.local.streams.pop(device, None)
                else:
                    standin.local.streams[device] = previous

            def synchronize(self):
                for memory in list(standin.live_memories):
                    if memory.pending is self:
                        memory.pending = None

        class ExternalStream(Stream):
            def __init__(self, ptr, device_id=-1):
                super().__init__(ptr=int(ptr))
                if device_id >= 0:
                    self.device_id = device_id

        class ndarray:
            # NumPy defers its operators to this class instead of converting it.
            __array_ufunc__ = None

            def __init__(self, host: np.ndarray, memory: _Memory, base=None):
                self._host = host
                self._memory = memory
                self.base = base  # as CuPy's: the array owning the memory of a view, else None

            shape = property(lambda self: self._host.shape)
            strides = property(lambda self: self._host.strides)
            dtype = property(lambda self: self._host.dtype)
            size = property(lambda self: self._host.size)
            ndim = property(lambda self: self._host.ndim)
            itemsize = property(lambda self: self._host.itemsize)
            nbytes = property(lambda self: self._host.nbytes)
            data = property(lambda self: types.SimpleNamespace(ptr=self._host.ctypes.data))
            device = property(lambda self: Device(self._memory.device))
            T = property(lambda self: self._view(self._host.T))
            flags = property(lambda self: types.SimpleNamespace(
                c_contiguous=self._host.flags.c_contiguous, f_contiguous=self._host.flags.f_contiguous,
                owndata=self.base is None))

            def _view(self, host):
                return ndarray(host, self._memory, self if self.base is None else self.base)

            def __getitem__(self, key):
                return self._view(self._host[key])

            def __setitem__(self, key, value):
                standin.check_here(self, "__setitem__")
                self._host[key] = operand(value, "__setitem__")

            def reshape(self, *shape):
                view = self._host.reshape(*shape)
                if not np.shares_memory(view, self._host) and view.size:
                    standin.check_here(self, "reshape (a copy)")
                    return fresh(view)
                return self._view(view)

            def astype(self, dtype, copy=True):
                standin.check_here(self, "astype")
                if not copy and np.dtype(dtype) == self.dtype:
                    return self
                return fresh(self._host.astype(dtype))

            def copy(self):
                # CuPy copies to the current device, from any device.
                standin.check_landed(self, standin.current_stream(self._memory.device), "copy")
                return fresh(self._host.copy())

            def fill(self, value):
                standin.check_here(self, "fill")
                self._host.fill(value)

            def get(self):
                return asnumpy(self)

            def __array__(self, *args, **kwargs):
                raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                                "Please use `.get()` to construct a NumPy array explicitly.")

            def __int__(self):
                return int(self.get())

            def __float__(self):
                return float(self.get())

            def __neg__(self):
                standin.check_here(self, "negative")
                return fresh(-self._host)

            def __len__(self):
                return len(self._host)

            def __repr__(self):
                return f"stand-in cupy.ndarray on device {self._memory.device}: {self._host!r}"

        def binary(op, reflected=False):
            def method(self, other):
                standin.check_here(self, op.__name__)
                a, b = self._host, operand(other, op.__name__)
                return fresh(np.asarray(op(b, a) if reflected else op(a, b)))
            return method

        for name, op in _OPERATORS.items():
            setattr(ndarray, f"__{name}__", binary(op))
            setattr(ndarray, f"__r{name}__", binary(op, reflected=True))
        for name, op in _COMPARISONS.items():
            setattr(ndarray, f"__{name}__", binary(op))
        ndarray.__hash__ = None

        def operand(value, what):
            """The host value of an operand: CuPy takes its own arrays and scalars, never a NumPy array."""
            if isinstance(value, ndarray):
                standin.check_here(value, what)
                return value._host
            if isinstance(value, (bool, int, float, complex, np.generic)):
                return value
            raise TypeError(f"Unsupported type {type(value)}")

        def allocate(host: np.ndarray, kind=None, pending=None):
            """``host`` as a new allocation on the current device; ``kind``: the event to record."""
            device = standin.current_device()
            if kind is not None:
                standin.record(kind, device, standin.current_stream(device), (host.shape, host.dtype))
            memory = _Memory(device, host.nbytes, pending)
            standin.live_memories.add(memory)
            return ndarray(host, memory)

        def fresh(host):
            return allocate(np.array(host, order="C"), "empty")

        def empty(shape, dtype=np.float64):
            return allocate(np.empty(shape, dtype), "empty")

        def zeros(shape, dtype=np.float64):
            return allocate(np.zeros(shape, dtype), "zeros")

        def full(shape, fill_value, dtype=None):
            return allocate(np.full(shape, fill_value, dtype), "empty")

        def asarray(a, dtype=None):
            if isinstance(a, ndarray):
                return a if dtype is None else a.astype(dtype, copy=False)
            device = standin.current_device()
            stream = standin.current_stream(device)
            standin.record("upload", device, stream, np.asarray(a).nbytes)
            return allocate(np.array(a, dtype=dtype, copy=True), pending=stream)

        def asnumpy(a):
            stream = standin.current_stream(a._memory.device)
            standin.check_landed(a, stream, "asnumpy")
            standin.record("to_host", a._memory.device, stream)
            stream.synchronize()  # ndarray.get() on the current stream waits for it
            return np.array(a._host, copy=True)

        def count_nonzero(a):
            standin.check_here(a, "count_nonzero")
            return fresh(np.asarray(np.count_nonzero(a._host), np.int64))

        def sum_(a):
            standin.check_here(a, "sum")
            return fresh(np.asarray(np.sum(a._host)))

        def on_device(host: np.ndarray, device: int):
            """Test helper, not CuPy: a device array sharing ``host``'s memory."""
            memory = _Memory(device, host.nbytes)
            standin.live_memories.add(memory)
            return ndarray(host, memory)

        class MemoryPool:
            """The current device's live allocations; nothing is cached, so nothing is freed."""

            def used_bytes(self):
                return standin.used_bytes(standin.current_device())

            total_bytes = used_bytes

            def free_all_blocks(self):
                pass

        class Module:
            def load(self, cubin: bytes):
                self.device = standin.current_device()
                arch = f"sm_{standin.capabilities[self.device]}"
                expected = kernel_loader.device_cubin(arch)
                if not isinstance(cubin, bytes) or cubin != expected.cubin:
                    raise ContractError(f"module bytes for device {self.device} are not the project's NVRTC "
                                        f"cubin for {arch}")
                self.names = {lowered: name for name, lowered in expected.lowered.items()}
                standin.record("load", self.device, standin.current_stream(self.device), arch)

            def get_function(self, name):
                if name not in self.names:
                    raise ContractError(f"no kernel {name!r} in the module (get_function takes lowered names)")
                return Function(self, self.names[name])

        class Function:
            def __init__(self, module, expression):
                self.module = module
                self.expression = expression

            def __call__(self, grid, block, args, shared_mem=0, stream=None):
                device = standin.current_device()
                if device != self.module.device:
                    raise ContractError(f"{self.expression}: launched on device {device}, its module was loaded "
                                        f"on device {self.module.device}")
                stream = stream if stream is not None else standin.current_stream(device)
                (grid_x,), (block_x,) = grid, block
                if block_x % _WARP or not 0 < block_x <= _MAX_BLOCK or grid_x < 1:
                    raise ContractError(f"{self.expression}: grid {grid_x}, block {block_x}: blocks must be "
                                        f"whole warps, 32..1024 threads")
                values = standin.check_args(self.expression, args, device, stream)
                standin.record("launch", device, stream, (self.expression, grid_x, block_x))
                kernel_loader.emulator_library().launch(self.expression, grid_x, block_x, values)

        class runtime:
            @staticmethod
            def getDeviceCount():
                return len(standin.capabilities)

            @staticmethod
            def memGetInfo():
                """(free, total) bytes of the current device."""
                return DEVICE_MEMORY - standin.used_bytes(standin.current_device()), DEVICE_MEMORY

        cuda.Device = Device
        cuda.Stream = Stream
        cuda.ExternalStream = ExternalStream
        cuda.get_current_stream = lambda device_id=None: standin.current_stream(
            standin.current_device() if device_id is None else device_id)
        cuda.function = types.SimpleNamespace(Module=Module)
        cuda.runtime = runtime
        mod.cuda = cuda
        mod.ndarray = ndarray
        mod.empty = empty
        mod.zeros = zeros
        mod.full = full
        mod.asarray = asarray
        mod.asnumpy = asnumpy
        mod.count_nonzero = count_nonzero
        mod.sum = sum_
        pool = MemoryPool()
        mod.get_default_memory_pool = lambda: pool
        mod.on_device = on_device
        mod.events = standin.events
        mod.ContractError = ContractError
        self.ndarray = ndarray
        self.Stream = Stream
        return mod

    def check_args(self, expression, args, device, stream):
        """The emulator's arguments for a launch, once every argument passes CuPy's contract."""
        codes = kernel_loader.emulator_library().signature(expression)
        if not isinstance(args, tuple) or len(args) != len(codes):
            raise ContractError(f"{expression}: takes a tuple of {len(codes)} arguments, got {args!r:.80}")
        values = []
        for i, (code, arg) in enumerate(zip(codes, args)):
            if code == "p8":
                if not isinstance(arg, self.ndarray):
                    raise ContractError(f"{expression} argument {i}: a pointer takes a device array, "
                                        f"got {type(arg).__name__}")
                if arg._memory.device != device:
                    raise ContractError(f"{expression} argument {i}: array on device {arg._memory.device}, "
                                        f"launch on device {device}")
                self.check_landed(arg, stream, f"{expression} argument {i}")
                values.append(np.uint64(arg.data.ptr))
            elif type(arg) is not _SCALARS.get(code):
                raise ContractError(f"{expression} argument {i}: parameter {code} takes "
                                    f"{_SCALARS.get(code)}, got {type(arg).__name__}")
            else:
                values.append(arg)
        return values
