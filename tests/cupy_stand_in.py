"""A contract check of CuPy, standing in for the few CuPy entry points that
``gpuflat._src.backends.cuda_runtime.CupyRuntime`` calls. It is not a GPU.

``make_cupy()`` returns a module to put in ``sys.modules["cupy"]``. Its
arrays are NumPy arrays tagged with a device, and its launches run the real
kernels through the host emulator, so results can be checked. What it adds
is CuPy's calling contract, enforced on every call (a breach raises
:class:`ContractError`):

- a module's bytes are the project's NVRTC cubin for the current device's
  compute capability and runtime major (``kernel_loader.device_cubin``),
  and its kernels are launched on the device it was loaded on;
- a launch has whole-warp blocks (a multiple of 32, at most 1024 threads)
  and at least one block;
- each argument matches the kernel's parameter (read from the emulator
  library's signature of the same source): pointers are device arrays on the
  current device, ``long long`` is ``np.int64``, ``int`` ``np.int32``,
  ``double`` ``np.float64``; a Python number, whose width CuPy would guess,
  is refused;
- a launch, element-wise operation or read-back on one stream never uses an
  upload still in flight on another stream: an upload lands for another
  stream when its own stream is synchronised, or when the other stream waited
  on an event recorded after it (``Stream.wait_event``);
- an array is never converted to NumPy implicitly (``np.asarray(x)`` raises
  TypeError, as CuPy's does: read it with ``.get()`` or ``cupy.asnumpy``);
- element-wise work (arithmetic, comparisons, ``astype``, ``fill``, item
  assignment, ``count_nonzero``) runs on the current device, which must be
  the array's (no peer access is assumed); ``copy()`` copies to the current
  device, as CuPy's does; memory is counted per device;
- while a stream captures a graph (``Stream.begin_capture``, CUDA's global
  capture mode, the one ``torch.cuda.graph`` uses): an allocation from the
  memory pool (one through ``cuda.using_allocator`` is allowed), a host
  synchronisation, an event query (``Event.done``: cudaEventQuery, which
  invalidates a capture in that mode from any thread, whatever its stream),
  an upload, a read-back and a DLPack import on a stream
  other than the capturing one raise; launches and element-wise
  work on the capturing stream are recorded, not run, and run when the graph
  is launched;
- memory CuPy did not allocate (``cuda.UnownedMemory``) is only page-locked
  host memory from ``cuda.alloc_pinned_memory``, which a kernel may read
  through its address (CUDA's unified virtual address space); a launch reads
  it as it is when the launch runs, a graph's replay included;
- streams are CuPy 14's: a foreign stream is wrapped by
  ``Stream.from_external`` (the CUDA stream protocol, ``__cuda_stream__``;
  its device unknown, -1, so the current one), and ``ExternalStream`` warns
  that it is deprecated, as CuPy 14's does;
- events keep CUDA's device time: ``cuda.get_elapsed_time`` between two
  events of one stream is the time the work queued on that stream between
  them took to run (the stand-in runs each piece as it is queued and times
  it; a captured graph's launch runs its recorded work as one piece on the
  stream it is launched on); work on other streams, or on none (host work),
  does not count;
- once ``destroy_context()`` (a test helper, not CuPy) has run, as at an
  exit that tore CUDA down, asking a stream whether it captures and querying
  an event raise CuPy's ``cuda.runtime.CUDARuntimeError``
  (cudaErrorContextIsDestroyed).

Every allocation, upload, module load, launch, fill and element-wise
operation is recorded in ``events`` with the current device and stream, for
tests to check. The stand-in also remembers which streams used each
allocation: one freed while a stream other than the one it was allocated on
may still read it (no synchronisation and no event wait orders the read
before the free), or while a graph that uses it is alive, is listed in
``freed_in_flight``: CuPy's pool would hand that memory to the next
allocation on its own stream while the other stream still reads it.
"""
from __future__ import annotations

import contextlib
import itertools
import operator
import sys
import threading
import time
import types
import warnings
import weakref
from dataclasses import dataclass

import numpy as np

from gpuflat._src import emulator, kernel_loader

_WARP = 32
_MAX_BLOCK = 1024
# Kernel parameter codes of the emulator library -> the NumPy type CuPy must get.
_SCALARS = {"i8": np.int64, "u8": np.uint64, "i4": np.int32, "u4": np.uint32, "f8": np.float64,
            "f4": np.float32}
# Memory each stand-in device reports in cuda.runtime.memGetInfo.
DEVICE_MEMORY = 1 << 30
# The CUDA runtime the stand-in reports (runtimeGetVersion): 13.0, as on the
# GPU image the device checks meet.
RUNTIME_VERSION = 13000
# The binary operators of an array, each with its reflected form.
_OPERATORS = {"add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
              "pow": operator.pow}
_COMPARISONS = {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le,
                "gt": operator.gt, "ge": operator.ge}


class ContractError(AssertionError):
    """A call CuPy would run wrongly or refuse on a real device."""


class CUDARuntimeError(RuntimeError):
    """CuPy's ``cupy.cuda.runtime.CUDARuntimeError``: a CUDA call's error status."""

    _NAMES = {709: "cudaErrorContextIsDestroyed: context is destroyed"}

    def __init__(self, status: int):
        super().__init__(self._NAMES.get(status, f"CUDA error {status}"))
        self.status = status


@dataclass
class Event:
    # "empty", "zeros", "upload", "load", "launch", "to_host", "fill", "elementwise", "sync"
    kind: str
    device: int
    stream: object
    detail: object = None


def make_cupy(compute_capabilities=("90", "80"), sms: int = 2) -> types.ModuleType:
    """A stand-in ``cupy`` module with one device per compute capability."""
    return _StandIn(tuple(compute_capabilities), sms).module


def install(monkeypatch, compute_capabilities=("90", "80")) -> types.ModuleType:
    """The stand-in as ``cupy`` for one test (device 0 sm_90, device 1 sm_80 by
    default), with gpuflat's backends made afresh on it."""
    from gpuflat._src.backends import selection

    module = make_cupy(compute_capabilities)
    monkeypatch.setitem(sys.modules, "cupy", module)
    monkeypatch.setattr(selection, "_backends", {})
    return module


class _StreamState:
    """What one stream (a device and a pointer) has had enqueued and what is known done.

    ``enqueued`` counts the work given to it; ``done`` how much of it the
    host knows finished (after a synchronisation); ``waited[key]`` how much
    of stream ``key``'s work it waited for through events; ``busy_s`` the
    seconds its work took to run, its device clock.
    """

    def __init__(self):
        self.enqueued = 0
        self.done = 0
        self.waited: dict = {}
        self.busy_s = 0.0


class _Memory:
    """One allocation: its device, size, the stream it was allocated on, the
    upload still in flight (stream key and its work count), and which streams
    used it (stream key -> work count of the last use)."""

    def __init__(self, device: int, nbytes: int, stream_key=None, pending=None, owner=None, graph_pool=False):
        self.device = device
        self.nbytes = nbytes
        self.stream_key = stream_key
        self.pending = pending
        self.owner = owner  # what an allocator handed out, kept until the memory goes
        # Allocated through an allocator while capturing: PyTorch's allocator
        # gives such blocks from the graph's private pool, which nothing else reuses.
        self.graph_pool = graph_pool
        self.uses: dict = {}
        self.graphs = weakref.WeakSet()


class _Graph:
    """Work recorded on a capturing stream; ``launch`` runs it."""

    def __init__(self, standin):
        self.standin = standin
        self.work = []
        self.pool = []  # the memory of its private pool, kept while the graph lives

    def launch(self, stream=None):
        """Runs the recorded work as one piece of work on ``stream`` (the
        current one by default, as CuPy's ``Graph.launch``): its run time
        counts on that stream's device clock, as a replay's kernels do."""
        standin = self.standin
        stream = stream if stream is not None else standin.current_stream(standin.current_device())
        standin.enqueue(stream)
        standin.execute(stream, self._run)

    def _run(self):
        for work in self.work:
            work()


class _StandIn:
    def __init__(self, capabilities, sms):
        self.capabilities = capabilities
        self.sms = sms
        self.events: list[Event] = []
        self.freed_in_flight: list[str] = []
        self.local = threading.local()
        self.null_streams = {}
        self.stream_ids = itertools.count(1)
        self.lock = threading.RLock()
        self.states: dict = {}  # stream key -> _StreamState
        self.captures: dict = {}  # stream key -> _Graph being captured
        self.exported: dict = {}  # arrays kept alive by a DLPack consumer
        self.context_destroyed = False
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

    def here(self):
        """(device, stream) of the calling thread."""
        device = self.current_device()
        return device, self.current_stream(device)

    def state(self, key) -> _StreamState:
        with self.lock:
            return self.states.setdefault(key, _StreamState())

    def enqueue(self, stream) -> int:
        """Count one piece of work on ``stream``; its number."""
        state = self.state(stream.key)
        with self.lock:
            state.enqueued += 1
            return state.enqueued

    def ordered(self, key, count, stream) -> bool:
        """Whether work ``count`` of stream ``key`` is done before what ``stream`` runs next."""
        if key is None or key == stream.key:
            return True
        return self.state(key).done >= count or self.state(stream.key).waited.get(key, 0) >= count

    def record(self, kind, device, stream, detail=None):
        with self.lock:
            self.events.append(Event(kind, device, stream, detail))

    def capturing(self, stream=None) -> bool:
        """Whether ``stream`` (None: any stream) is capturing a graph."""
        with self.lock:
            return bool(self.captures) if stream is None else stream.key in self.captures

    def check_context(self):
        """A CUDA call: refused once the context is destroyed (``destroy_context``)."""
        if self.context_destroyed:
            raise CUDARuntimeError(709)

    def refuse_in_capture(self, what):
        if self.capturing():
            raise ContractError(f"{what} while a CUDA graph is being captured (global capture mode)")

    def host_wait(self, what):
        """A host synchronisation: refused while capturing, recorded otherwise."""
        self.refuse_in_capture(what)
        device, stream = self.here()
        self.record("sync", device, stream, what)

    def check_landed(self, array, stream, what):
        pending = array._memory.pending
        if pending is not None and not self.ordered(*pending, stream):
            raise ContractError(f"{what} on stream {stream.ptr} uses an upload still in flight on stream "
                                f"{pending[0][1]}: nothing orders the copy before it")

    def use(self, memory, stream, count):
        memory.uses[stream.key] = count
        graph = self.captures.get(stream.key)
        if graph is not None:
            memory.graphs.add(graph)

    def run(self, kind, detail, arrays, work, writes=False):
        """Element-wise work on the current device and stream over ``arrays``
        (each checked to be there and landed): run now, or recorded into the
        graph the stream is capturing. ``writes``: it writes into an existing
        array, so it must not run at capture time."""
        device, stream = self.here()
        for a in arrays:
            if a._memory.device != device:
                raise ContractError(f"{detail}: array on device {a._memory.device}, current device {device}")
            self.check_landed(a, stream, detail)
        count = self.enqueue(stream)
        for a in arrays:
            self.use(a._memory, stream, count)
        self.record(kind, device, stream, detail)
        graph = self.captures.get(stream.key)
        if graph is not None:
            graph.work.append(work)
            if writes:
                return None
        return self.execute(stream, work)

    def execute(self, stream, work):
        """``work()``, its time added to ``stream``'s device clock."""
        began = time.perf_counter()
        try:
            return work()
        finally:
            state = self.state(stream.key)
            with self.lock:
                state.busy_s += time.perf_counter() - began

    def freed(self, memory_state, label):
        """An allocation was freed: list it if another stream or a live graph may still use it."""
        stream_key, uses, graphs, graph_pool = memory_state
        if not graph_pool and any(True for _ in graphs):
            self.freed_in_flight.append(f"{label}: freed while a captured graph that uses it is alive")
            return
        for key, count in uses.items():
            if key == stream_key or stream_key is None:
                continue
            done = self.state(key).done >= count or self.state(stream_key).waited.get(key, 0) >= count
            if not done:
                self.freed_in_flight.append(f"{label}: freed (allocated on stream {stream_key[1]}) while "
                                            f"stream {key[1]} may still use it")

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

            def synchronize(self):
                standin.host_wait("Device.synchronize")
                with standin.lock:
                    for (device, _), state in standin.states.items():
                        if device == self.id:
                            state.done = state.enqueued

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
            def from_external(cls, obj):
                """CuPy 14's wrapper of a foreign stream, from its CUDA stream
                protocol (``__cuda_stream__() -> (0, pointer)``); its device is
                unknown (-1): the current one wherever it is used."""
                try:
                    version, ptr = obj.__cuda_stream__()
                except AttributeError as e:
                    raise TypeError(f"Object of type {type(obj).__name__} does not implement the CUDA stream "
                                    f"protocol (__cuda_stream__ method)") from e
                if type(version) is not int or type(ptr) is not int or version != 0:
                    raise TypeError(f"__cuda_stream__() must return (0, int), got ({version!r}, {ptr!r})")
                stream = cls.__new__(cls)
                stream.device_id, stream.ptr = -1, ptr
                stream._foreign_stream_ref = obj
                return stream

            def __cuda_stream__(self):
                return (0, self.ptr)

            @classmethod
            def _null(cls, device):
                stream = cls.__new__(cls)
                stream.device_id, stream.ptr = device, 0
                return stream

            @property
            def device(self):
                """The stream's device: an unknown one (-1) is the current device."""
                return standin.current_device() if self.device_id == -1 else self.device_id

            @property
            def key(self):
                return (self.device, self.ptr)

            def __enter__(self):
                streams = standin.local.__dict__.setdefault("streams", {})
                saved = standin.local.__dict__.setdefault("saved", [])
                saved.append((self.device, streams.get(self.device)))
                streams[self.device] = self
                return self

            def __exit__(self, *exc):
                device, previous = standin.local.saved.pop()
                if previous is None:
                    standin.local.streams.pop(device, None)
                else:
                    standin.local.streams[device] = previous

            def synchronize(self):
                standin.host_wait(f"Stream.synchronize (stream {self.ptr})")
                state = standin.state(self.key)
                with standin.lock:
                    state.done = state.enqueued

            def wait_event(self, event):
                if event.mark is not None:
                    key, count = event.mark
                    waited = standin.state(self.key).waited
                    with standin.lock:
                        waited[key] = max(waited.get(key, 0), count)
                standin.enqueue(self)

            def record(self, event=None):
                event = event if event is not None else CudaEvent()
                event.record(self)
                return event

            def is_capturing(self):
                standin.check_context()
                return standin.capturing(self)

            def begin_capture(self, mode=None):
                with standin.lock:
                    if self.key in standin.captures:
                        raise ContractError(f"stream {self.ptr} is capturing already")
                    standin.captures[self.key] = _Graph(standin)

            def end_capture(self):
                with standin.lock:
                    if self.key not in standin.captures:
                        raise ContractError(f"stream {self.ptr} is not capturing")
                    return standin.captures.pop(self.key)

        class ExternalStream(Stream):
            def __init__(self, ptr, device_id=-1):
                warnings.warn("ExternalStream is deprecated. Use Stream.from_external() instead to interoperate "
                              "with external streams that implement the CUDA stream protocol.",
                              DeprecationWarning, stacklevel=2)
                super().__init__(ptr=int(ptr))
                if device_id >= 0:
                    self.device_id = device_id

        class CudaEvent:
            """cupy.cuda.Event: a point in a stream's work, and its device clock there."""

            def __init__(self, block=False, disable_timing=False, interprocess=False):
                self.mark = None
                self.timing = not disable_timing
                self.clock_s = None

            def record(self, stream=None):
                stream = stream if stream is not None else standin.current_stream(standin.current_device())
                if standin.capturing(stream):
                    raise ContractError("an event recorded while capturing cannot be queried afterwards")
                state = standin.state(stream.key)
                self.mark = (stream.key, state.enqueued)
                self.clock_s = state.busy_s

            @property
            def done(self):
                standin.check_context()
                standin.refuse_in_capture("an event query (cudaEventQuery)")
                if self.mark is None:
                    return True
                key, count = self.mark
                return standin.state(key).done >= count

            def synchronize(self):
                standin.host_wait("Event.synchronize")
                if self.mark is not None:
                    key, count = self.mark
                    state = standin.state(key)
                    with standin.lock:
                        state.done = max(state.done, count)

        class ndarray:
            # NumPy defers its operators to this class instead of converting it.
            __array_ufunc__ = None

            def __init__(self, host, memory=None, base=None, memptr=None):
                if memptr is not None:  # CuPy's ndarray(shape, dtype, memptr): over memory it did not allocate
                    host, memory = memptr.view(host, memory)
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
                arrays = [self] + ([value] if isinstance(value, ndarray) else [])
                operand(value)

                def work():
                    self._host[key] = value._host if isinstance(value, ndarray) else value
                standin.run("elementwise", "__setitem__", arrays, work, writes=True)

            def view(self, dtype):
                # CuPy 14's: the same memory as another dtype of its size
                # (bfloat16 included, as ml_dtypes' NumPy dtype).
                return self._view(self._host.view(dtype))

            def reshape(self, *shape):
                view = self._host.reshape(*shape)
                if not np.shares_memory(view, self._host) and view.size:
                    return computed("reshape (a copy)", [self], lambda: self._host.reshape(*shape))
                return self._view(view)

            def astype(self, dtype, copy=True):
                if not copy and np.dtype(dtype) == self.dtype:
                    standin.run("elementwise", "astype", [self], lambda: None)
                    return self
                return computed("astype", [self], lambda: self._host.astype(dtype))

            def copy(self):
                # CuPy copies to the current device, from any device.
                standin.check_landed(self, standin.current_stream(self._memory.device), "copy")
                return computed("copy", [], lambda: self._host.copy())

            def fill(self, value):
                standin.run("fill", value, [self], lambda: self._host.fill(value), writes=True)

            def get(self):
                return asnumpy(self)

            def set(self, arr, stream=None):
                upload_into(self, arr, stream)

            def __array__(self, *args, **kwargs):
                raise TypeError("Implicit conversion to a NumPy array is not allowed. "
                                "Please use `.get()` to construct a NumPy array explicitly.")

            def __dlpack__(self, stream=None):
                # The bytes live in host memory here: a consumer sees a CPU tensor,
                # which keeps this array alive, as CuPy's capsule does.
                view = self._host.view()
                standin.exported[id(view)] = self
                weakref.finalize(view, standin.exported.pop, id(view), None)
                return view.__dlpack__()

            def __dlpack_device__(self):
                return self._host.__dlpack_device__()

            def __int__(self):
                return int(self.get())

            def __float__(self):
                return float(self.get())

            def __neg__(self):
                return computed("negative", [self], lambda: -self._host)

            def __invert__(self):
                return computed("invert", [self], lambda: ~self._host)

            def sum(self):
                return computed("sum", [self], lambda: np.asarray(self._host.sum()))

            def max(self):
                return computed("max", [self], lambda: np.asarray(self._host.max()))

            def any(self):
                return computed("any", [self], lambda: np.asarray(self._host.any()))

            def argmax(self):
                return computed("argmax", [self], lambda: np.asarray(self._host.argmax()))

            def __len__(self):
                return len(self._host)

            def __repr__(self):
                return f"stand-in cupy.ndarray on device {self._memory.device}: {self._host!r}"

        def binary(op, reflected=False):
            def method(self, other):
                operand(other)
                arrays = [self] + ([other] if isinstance(other, ndarray) else [])

                def value():
                    a, b = self._host, other._host if isinstance(other, ndarray) else other
                    return np.asarray(op(b, a) if reflected else op(a, b))
                return computed(op.__name__, arrays, value)
            return method

        for name, op in _OPERATORS.items():
            setattr(ndarray, f"__{name}__", binary(op))
            setattr(ndarray, f"__r{name}__", binary(op, reflected=True))
        for name, op in _COMPARISONS.items():
            setattr(ndarray, f"__{name}__", binary(op))
        ndarray.__hash__ = None

        def operand(value):
            """CuPy takes its own arrays and scalars as operands, never a NumPy array."""
            if not isinstance(value, (ndarray, bool, int, float, complex, np.generic)):
                raise TypeError(f"Unsupported type {type(value)}")

        def computed(what, arrays, value):
            """A new array holding ``value()``: element-wise work over ``arrays``,
            recomputed into the same memory when a captured graph runs."""
            out = fresh(value())

            def work():
                np.copyto(out._host, value())
            standin.run("elementwise", what, arrays, work)
            return out

        def allocate(host: np.ndarray, kind=None, pending=None):
            """``host`` as a new allocation on the current device; ``kind``: the event to record."""
            device, stream = standin.here()
            allocator = getattr(standin.local, "allocator", None)
            if allocator is None and standin.capturing(stream):
                raise ContractError(f"a memory-pool allocation of {host.nbytes} bytes while stream "
                                    f"{stream.ptr} captures a graph: the graph would keep memory the "
                                    f"pool hands out again")
            owner = allocator(host.nbytes) if allocator is not None else None
            if kind is not None:
                standin.record(kind, device, stream, (host.shape, host.dtype, "pool" if owner is None else "allocator"))
            graph = standin.captures.get(stream.key)
            if graph is not None:
                graph.pool.append(host)
            memory = _Memory(device, host.nbytes, stream.key, pending, owner, graph is not None)
            standin.live_memories.add(memory)
            weakref.finalize(memory, standin.freed, (memory.stream_key, memory.uses, memory.graphs,
                                                     memory.graph_pool),
                             f"{host.nbytes}-byte allocation {host.shape} {host.dtype}")
            return ndarray(host, memory)

        def fresh(host):
            return allocate(np.array(host, order="C"), "empty")

        def empty(shape, dtype=np.float64):
            return allocate(np.empty(shape, dtype), "empty")

        def zeros(shape, dtype=np.float64):
            out = allocate(np.zeros(shape, dtype), "zeros")
            # A memset on the current stream: recorded into a graph being captured.
            standin.run("fill", 0, [out], lambda: out._host.fill(0), writes=True)
            return out

        def full(shape, fill_value, dtype=None):
            out = allocate(np.empty(shape, dtype if dtype is not None else np.asarray(fill_value).dtype), "empty")
            standin.run("fill", fill_value, [out], lambda: out._host.fill(fill_value))
            return out

        def upload_into(array, host, stream):
            """A host-to-device copy into ``array``: asynchronous on ``stream`` from
            pinned memory; otherwise the host waits for it (CuPy's synchronous copy)."""
            device, current = standin.here()
            standin.refuse_in_capture("a host-to-device copy")
            host_array = np.asarray(host)
            base = host_array
            while isinstance(base, np.ndarray) and base.base is not None:
                base = base.base
            pinned = isinstance(getattr(base, "obj", base), _Pinned)  # np.frombuffer keeps a memoryview
            on = stream if stream is not None else current
            standin.record("upload", device, on, {"nbytes": host_array.nbytes, "pinned": pinned,
                                                  "waits": stream is None or not pinned})
            array._host[...] = host_array.reshape(array.shape)
            count = standin.enqueue(on)
            standin.use(array._memory, on, count)
            if stream is None or not pinned:
                standin.host_wait("a synchronous host-to-device copy")
                with standin.lock:
                    standin.state(on.key).done = max(standin.state(on.key).done, count)
            else:
                array._memory.pending = (on.key, count)

        def asarray(a, dtype=None):
            if isinstance(a, ndarray):
                return a if dtype is None else a.astype(dtype, copy=False)
            device, stream = standin.here()
            standin.refuse_in_capture("an upload (cupy.asarray of host memory)")
            standin.record("upload", device, stream, np.asarray(a).nbytes)
            out = allocate(np.array(a, dtype=dtype, copy=True))
            out._memory.pending = (stream.key, standin.enqueue(stream))
            return out

        def array(a, dtype=None, copy=True, order="K"):
            if not isinstance(a, ndarray):
                return asarray(np.array(a, dtype=dtype, order="C"))
            return computed("array (a copy)", [a], lambda: np.array(a._host, dtype=dtype, order="C"))

        def asnumpy(a):
            stream = standin.current_stream(a._memory.device)
            standin.check_landed(a, stream, "asnumpy")
            standin.refuse_in_capture("a device-to-host read")
            standin.record("to_host", a._memory.device, stream)
            stream.synchronize()  # ndarray.get() on the current stream waits for it
            return np.array(a._host, copy=True)

        def host_of(x):
            return x._host if isinstance(x, ndarray) else x

        def where(condition, x, y):
            arrays = [a for a in (condition, x, y) if isinstance(a, ndarray)]
            return computed("where", arrays, lambda: np.asarray(np.where(*map(host_of, (condition, x, y)))))

        def isfinite(a):
            return computed("isfinite", [a], lambda: np.isfinite(a._host))

        def sqrt(a):
            return computed("sqrt", [a], lambda: np.asarray(np.sqrt(a._host)))

        def count_nonzero(a):
            return computed("count_nonzero", [a], lambda: np.asarray(np.count_nonzero(a._host), np.int64))

        def sum_(a):
            return computed("sum", [a], lambda: np.asarray(np.sum(a._host)))

        def from_dlpack(x):
            """A PyTorch tensor's memory (host memory here) as a device array, on the
            device it says it is on; imported on the current stream."""
            import torch

            with torch._C.DisableTorchFunction():
                host = x.detach().numpy()
            device, stream = standin.here()
            index = x.device.index or 0
            if standin.capturing() and not standin.capturing(stream):
                # PyTorch's __dlpack__ records an event on its current stream and
                # makes the importing stream wait on it: a stream pulled into the
                # capture that never rejoins (cudaErrorStreamCaptureUnjoined), or,
                # for the legacy default stream, cudaErrorStreamCaptureImplicit.
                raise ContractError(f"a DLPack import on stream {stream.ptr}, which is not capturing, while "
                                    f"a CUDA graph is being captured")
            standin.record("from_dlpack", index, stream, (host.shape, host.dtype))
            return on_device(host, index)

        def on_device(host: np.ndarray, device: int):
            """Test helper, not CuPy: a device array sharing ``host``'s memory."""
            memory = _Memory(device, host.nbytes)
            standin.live_memories.add(memory)
            return ndarray(host, memory)

        def add_to_capture(stream, work):
            """Test helper, not CuPy: ``work`` recorded into the graph ``stream``
            captures (True), or nothing when it captures none (False)."""
            graph = standin.captures.get(stream.key)
            if graph is not None:
                graph.work.append(work)
            return graph is not None

        class _Pinned(bytearray):
            """Page-locked host memory (cupy.cuda.alloc_pinned_memory). As
            CuPy's PinnedMemoryPointer: a buffer, ``ptr`` and ``size()``, and
            no ``len()`` (code relying on one would fail on a GPU only)."""

            def __len__(self):
                raise TypeError("object of type 'PinnedMemoryPointer' has no len(): use size()")

            def size(self):
                return bytearray.__len__(self)

            @property
            def ptr(self):
                return np.frombuffer(self, np.uint8).ctypes.data if self.size() else 0

        def alloc_pinned_memory(nbytes):
            standin.refuse_in_capture("a pinned host allocation")
            return _Pinned(nbytes)

        class UnownedMemory:
            """cupy.cuda.UnownedMemory. The only memory not CuPy's that a
            kernel may read here is page-locked host memory, under CUDA's
            unified virtual address space: ``owner`` must be a pinned block
            holding the ``size`` bytes at ``ptr``."""

            def __init__(self, ptr, size, owner, device_id=-1):
                if not isinstance(owner, _Pinned):
                    raise ContractError(f"UnownedMemory over {type(owner).__name__}: a kernel may read only "
                                        f"page-locked host memory (cupy.cuda.alloc_pinned_memory)")
                start = owner.ptr
                if not (device_id >= 0 and start <= ptr and ptr + size <= start + owner.size()):
                    raise ContractError(f"UnownedMemory at {ptr:#x}, {size} bytes, device {device_id}: expected "
                                        f"a device id and bytes inside the pinned block at {start:#x}")
                self.ptr, self.size, self.owner, self.device_id = ptr, size, owner, device_id
                self.offset = ptr - start

        class MemoryPointer:
            """cupy.cuda.MemoryPointer(memory, offset)."""

            def __init__(self, mem, offset):
                self.mem, self.offset = mem, offset
                self.ptr = mem.ptr + offset

            def view(self, shape, dtype):
                """(the host bytes, their _Memory) of an array over this pointer."""
                dtype = np.dtype(dtype)
                count = int(np.prod(shape, dtype=np.int64))
                if self.offset + count * dtype.itemsize > self.mem.size:
                    raise ContractError(f"an array of {count} {dtype} past the {self.mem.size} bytes of its memory")
                host = np.frombuffer(self.mem.owner, dtype, count, self.mem.offset + self.offset).reshape(shape)
                return host, _Memory(self.mem.device_id, host.nbytes, owner=self.mem.owner)

        class PythonFunctionAllocator:
            """cupy.cuda.memory.PythonFunctionAllocator: allocations through two Python functions."""

            def __init__(self, malloc_func, free_func):
                self.malloc_func, self.free_func = malloc_func, free_func

            def malloc(self, nbytes):
                device = standin.current_device()
                ptr = self.malloc_func(nbytes, device)
                return _Owned(ptr, device, self.free_func)

        class _Owned:
            """Memory an allocator handed out, given back when the last array using it goes."""

            def __init__(self, ptr, device, free_func):
                self.ptr = ptr
                weakref.finalize(self, free_func, ptr, device)

        @contextlib.contextmanager
        def using_allocator(allocator=None):
            saved = getattr(standin.local, "allocator", None)
            standin.local.allocator = allocator
            try:
                yield
            finally:
                standin.local.allocator = saved

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
                expected = kernel_loader.device_cubin(arch, RUNTIME_VERSION // 1000)
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
                count = standin.enqueue(stream)
                for arg in args:
                    if isinstance(arg, ndarray):
                        standin.use(arg._memory, stream, count)
                standin.record("launch", device, stream, (self.expression, grid_x, block_x))

                def work():
                    emulator.kernels_library().launch(self.expression, grid_x, block_x, values)
                graph = standin.captures.get(stream.key)
                if graph is not None:
                    graph.work.append(work)
                else:
                    standin.execute(stream, work)

        class runtime:
            CUDARuntimeError = CUDARuntimeError

            @staticmethod
            def getDeviceCount():
                return len(standin.capabilities)

            @staticmethod
            def runtimeGetVersion():
                return RUNTIME_VERSION

            @staticmethod
            def getDeviceProperties(device_id):
                """The few properties callers read; CuPy returns the name as bytes."""
                return {"name": b"CuPy stand-in", "multiProcessorCount": standin.sms, "l2CacheSize": 1 << 16,
                        "clockRate": 1_000_000, "major": int(standin.capabilities[device_id][:-1]),
                        "minor": int(standin.capabilities[device_id][-1])}

            @staticmethod
            def memGetInfo():
                """(free, total) bytes of the current device."""
                return DEVICE_MEMORY - standin.used_bytes(standin.current_device()), DEVICE_MEMORY

        def get_elapsed_time(start, end):
            """Milliseconds of device time between two events: the time the
            work queued between them on their stream took to run. Work on any
            other stream does not count: the events never see it."""
            for event in (start, end):
                if not event.timing or event.mark is None:
                    raise ContractError("get_elapsed_time takes two recorded events made without disable_timing")
            if start.mark[0] != end.mark[0]:
                raise ContractError(f"events on two streams ({start.mark[0]}, {end.mark[0]}): the stand-in's "
                                    f"device clock is per stream")
            if not end.done:
                raise ContractError("get_elapsed_time before its end event completed (cudaErrorNotReady): "
                                    "synchronize the end event first")
            return (end.clock_s - start.clock_s) * 1e3

        cuda.Device = Device
        cuda.Stream = Stream
        cuda.get_elapsed_time = get_elapsed_time
        cuda.ExternalStream = ExternalStream
        cuda.Event = CudaEvent
        cuda.get_current_stream = lambda device_id=None: standin.current_stream(
            standin.current_device() if device_id is None else device_id)
        cuda.function = types.SimpleNamespace(Module=Module)
        cuda.runtime = runtime
        cuda.alloc_pinned_memory = alloc_pinned_memory
        cuda.UnownedMemory = UnownedMemory
        cuda.MemoryPointer = MemoryPointer
        cuda.using_allocator = using_allocator
        cuda.memory = types.SimpleNamespace(PythonFunctionAllocator=PythonFunctionAllocator)
        mod.cuda = cuda
        mod.ndarray = ndarray
        mod.empty = empty
        mod.zeros = zeros
        mod.full = full
        mod.asarray = asarray
        mod.array = array
        mod.asnumpy = asnumpy
        mod.count_nonzero = count_nonzero
        mod.where, mod.isfinite, mod.sqrt = where, isfinite, sqrt
        for name in ("float16", "float32", "float64", "complex64", "complex128", "int64"):
            setattr(mod, name, getattr(np, name))
        mod.sum = sum_
        mod.from_dlpack = from_dlpack
        pool = MemoryPool()
        mod.get_default_memory_pool = lambda: pool
        mod.on_device = on_device
        mod.add_to_capture = add_to_capture
        mod.destroy_context = lambda: setattr(standin, "context_destroyed", True)
        mod.events = standin.events
        mod.freed_in_flight = standin.freed_in_flight
        mod.ContractError = ContractError
        self.ndarray = ndarray
        self.Stream = Stream
        return mod

    def check_args(self, expression, args, device, stream):
        """The emulator's arguments for a launch, once every argument passes CuPy's contract."""
        codes = emulator.kernels_library().signature(expression)
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
