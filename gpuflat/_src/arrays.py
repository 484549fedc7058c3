"""Array kinds: seeing a leaf zero-copy as a backend array, and handing results back.

gpuflat computes on NumPy arrays (host) and CuPy arrays (device). A leaf may
also be a PyTorch tensor or a JAX array; this module is the one place that
knows them. ``adopt`` views a leaf's memory as a NumPy or CuPy array without
copying; ``to_caller`` turns a result back into the caller's kind, on the
caller's device; ``launch_stream`` is where kernels on a PyTorch CUDA tensor
run, and ``device_scope`` the context every entry point does its device
work in. Neither torch nor JAX nor CuPy is imported here at module import: a
tensor can only exist if the caller imported its library already.

Array-likes gpuflat does not know (anything with ``__dlpack__``,
``__array__``, ``__array_interface__`` or ``__cuda_array_interface__``, and
``memoryview`` and ``array.array``, which expose typed buffers) are refused
with UnsupportedLeafError rather than kept as statics: a gradient that is
silently left out of a norm is worse than an error. NumPy scalars
(``np.float32(1.0)``), ``bytes`` and ``bytearray`` are values, not arrays:
they stay statics, as before.
"""
from __future__ import annotations

import array as _array
import contextlib
import functools
import sys
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from . import dtensor
from .dtypes import FROM_PACKAGE, bits_dtype, imported, is_imported
from ..errors import Float32OverflowError, UnsupportedLeafError

if TYPE_CHECKING:
    from typing import TypeGuard

    import jax
    import torch

_ARRAY_PROTOCOLS = ("__dlpack__", "__array__", "__array_interface__", "__cuda_array_interface__")
_BUFFERS = (memoryview, _array.array)


# ---------------------------------------------------------------- kinds

def kind(x: object) -> str | None:
    """"numpy", "cupy", "torch" or "jax" for an array of that library, else None.

    >>> import numpy as np
    >>> kind(np.ones(2)), kind("relu"), kind(np.float32(1.0))
    ('numpy', None, None)
    """
    if isinstance(x, np.ndarray):
        return "numpy"
    for name, array_type in (("torch", "Tensor"), ("jax", "Array"), ("cupy", "ndarray")):
        module = sys.modules.get(name)
        if module is not None and isinstance(x, getattr(module, array_type)):
            return name
    return None


# ---------------------------------------------------------------- adopt

def adopt(x: object) -> Any:
    """A NumPy or CuPy array viewing ``x``'s memory, or None if ``x`` is no array.

    NumPy and CuPy arrays come back as they are. A PyTorch tensor is read
    through ``detach()`` (same storage), so writing into the view changes the
    tensor; a DTensor (FSDP2, tensor parallel) through its local shard. A
    JAX array comes back as a read-only view (JAX arrays are immutable).
    Other array-likes, and tensor subclasses that hold no data of their own,
    raise UnsupportedLeafError naming their type.

    >>> import numpy as np
    >>> a = np.ones(3)
    >>> adopt(a) is a, adopt("relu"), adopt(np.float64(2.0))
    (True, None, None)
    >>> adopt(memoryview(b"ab"))
    Traceback (most recent call last):
    ...
    gpuflat.errors.UnsupportedLeafError: expected a NumPy, CuPy, PyTorch or JAX array, found memoryview (wrap it with np.asarray to use it as a leaf)
    """
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if type(x) is torch.Tensor:  # no DTensor, no wrapper: the common case, checked first
            return _adopt_torch(x, torch)
        if dtensor.is_dtensor(x):
            return _adopt_torch(dtensor.local(x), torch)
        return _adopt_torch(plain_tensor(x), torch)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(x, jax.Array):
        return _adopt_jax(x, jax)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.generic) or not _looks_like_array(x):
        return None
    raise UnsupportedLeafError(
        f"expected a NumPy, CuPy, PyTorch or JAX array, found {_type_name(x)} "
        f"(wrap it with np.asarray to use it as a leaf)"
    )


def _looks_like_array(x: object) -> bool:
    return isinstance(x, _BUFFERS) or any(hasattr(x, name) for name in _ARRAY_PROTOCOLS)


def _type_name(x: object) -> str:
    cls = type(x)
    return cls.__name__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


# ---------------------------------------------------------------- PyTorch

def plain_tensor(x: torch.Tensor) -> torch.Tensor:
    """``x`` itself when its memory is its own data; UnsupportedLeafError for a
    wrapper subclass (float8 or quantised wrappers, fake tensors): it overrides
    ``__torch_dispatch__`` to compute on what it wraps, so its storage, if
    any, is not its values.

    >>> import torch
    >>> t = torch.ones(2)
    >>> plain_tensor(t) is t
    True
    """
    torch = sys.modules["torch"]
    if type(x).__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
        return x
    raise UnsupportedLeafError(
        f"expected a plain tensor or a DTensor, found a {_type_name(x)}, a tensor subclass whose values "
        f"gpuflat cannot read (it overrides __torch_dispatch__); convert it to a plain tensor first"
    )


def _adopt_torch(x: torch.Tensor, torch: ModuleType) -> Any:
    # detach() gives the same storage; numpy() and DLPack refuse tensors that
    # require grad. Gradients do not, and skipping it halves the cost per leaf.
    t = x.detach() if x.requires_grad else x
    if t.is_cuda:
        return _adopt_torch_cuda(t, torch, _cupy())
    name = _torch_from_package(torch).get(t.dtype)
    if name is not None:  # numpy() knows no such dtype: its bits, viewed
        refusal = tensor_refusal(t)
        if refusal:
            raise UnsupportedLeafError(refusal)
        return _bits_tensor(t, torch).numpy().view(_imported_for(name, "PyTorch"))
    try:
        return t.numpy()
    except (TypeError, RuntimeError):
        raise UnsupportedLeafError(
            tensor_refusal(t) or f"expected a tensor of a dtype NumPy can hold, found {t.dtype}"
        ) from None


def _adopt_torch_cuda(t: torch.Tensor, torch: ModuleType, cupy: ModuleType) -> Any:
    refusal = tensor_refusal(t)
    if refusal:
        raise UnsupportedLeafError(refusal)
    # Imported on PyTorch's current stream: DLPack makes the importing stream
    # wait for the tensor's stream when they differ (an event, which a CUDA
    # graph being captured must not get from outside it), and when they are
    # the same there is nothing to wait for.
    with _torch_stream(t.device, torch, cupy):
        name = _torch_from_package(torch).get(t.dtype)
        if name is not None:
            # CuPy 13 crashes importing a bfloat16 DLPack tensor (cupy issue 8801,
            # https://github.com/cupy/cupy/issues/8801): pass the bits as an integer.
            return _as_imported(cupy, cupy.from_dlpack(_bits_tensor(t, torch)), name)
        return cupy.from_dlpack(t)


def tensor_refusal(t: torch.Tensor) -> str | None:
    """Why a tensor cannot be viewed zero-copy, or None if nothing is wrong.

    >>> import torch
    >>> tensor_refusal(torch.ones(2)) is None, tensor_refusal(torch.ones(2, dtype=torch.complex64).conj())
    (True, 'expected a tensor without the conjugate bit, found one with it set (call .resolve_conj() first)')
    """
    torch = sys.modules["torch"]
    if t.layout is not torch.strided:
        return f"expected a strided (dense) tensor, found layout {t.layout} (call .to_dense() first)"
    if t.is_conj():
        return "expected a tensor without the conjugate bit, found one with it set (call .resolve_conj() first)"
    if t.is_neg():
        return "expected a tensor without the negative bit, found one with it set (call .resolve_neg() first)"
    if t.device.type not in ("cpu", "cuda"):
        return f"expected a CPU or CUDA tensor, found one on device '{t.device}'"
    return None


# ---------------------------------------------------------------- JAX

def _adopt_jax(x: jax.Array, jax: ModuleType) -> Any:
    if isinstance(x, jax.core.Tracer):
        raise UnsupportedLeafError(
            f"expected a concrete jax.Array, found a tracer ({type(x).__name__}): "
            f"gpuflat calls inside jax.jit, jax.grad or jax.vmap are not supported"
        )
    device = x.device  # a Sharding, not a Device, when the array spans several devices
    if not isinstance(device, jax.Device):
        raise UnsupportedLeafError(
            f"expected a jax.Array on one device, found one sharded over "
            f"{len(x.sharding.device_set)} devices"
        )
    if device.platform == "cpu":
        return np.asarray(x)  # zero-copy for a CPU array, and read-only: JAX made it so
    if device.platform in ("gpu", "cuda"):
        return _adopt_jax_gpu(x, jax, _cupy())
    raise UnsupportedLeafError(f"expected a CPU or GPU jax.Array, found one on {device}")


def _adopt_jax_gpu(x: jax.Array, jax: ModuleType, cupy: ModuleType) -> Any:
    # Written through, a JAX buffer breaks JAX's immutability (jax issue 19123,
    # https://github.com/jax-ml/jax/issues/19123); CuPy arrays have no
    # read-only flag, so gpuflat's in-place operations must not be given them.
    if is_imported(x.dtype):
        # As for PyTorch, bfloat16 crosses DLPack as integer bits; JAX cannot
        # reinterpret without a copy, so such a dtype costs a device copy.
        bits = jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype.itemsize))
        return _as_imported(cupy, cupy.from_dlpack(bits), x.dtype.name)
    return cupy.from_dlpack(x)


# ---------------------------------------------------------------- shared device helpers

def _cupy() -> ModuleType:
    try:
        import cupy
    except ImportError:
        raise UnsupportedLeafError(
            "expected CuPy to be installed for device tensors, found none (pip install cupy-cuda12x)"
        ) from None
    return cupy


@functools.cache
def _torch_from_package(torch: ModuleType) -> dict:
    """{PyTorch's dtype: name} of the dtypes of FROM_PACKAGE (bfloat16)."""
    return {getattr(torch, name): name for name in FROM_PACKAGE}


def _bits_tensor(t: torch.Tensor, torch: ModuleType) -> torch.Tensor:
    return t.view(getattr(torch, bits_dtype(t.element_size()).name))


def _imported_for(name: str, library: str) -> np.dtype:
    dtype = imported(name)
    if dtype is None:
        module = FROM_PACKAGE[name].module
        raise UnsupportedLeafError(
            f"expected {module} to be installed for {name} {library} arrays, found none (pip install {module})"
        )
    return dtype


def _as_imported(cupy: ModuleType, bits: Any, name: str) -> Any:
    dtype = _imported_for(name, "device")
    try:
        return bits.view(dtype)
    except Exception:  # CuPy before 14 knows no bfloat16 and refuses the dtype
        raise UnsupportedLeafError(
            f"expected a CuPy with {name} support, found CuPy {cupy.__version__} "
            f"(install CuPy >= 14, e.g. pip install 'cupy-cuda12x>=14')"
        ) from None


# ---------------------------------------------------------------- results back to the caller

def to_caller(result: Any, like: Any) -> Any:
    """``result`` (NumPy or CuPy) in the kind of ``like``, on like's device.

    Zero-copy where the libraries allow it (torch.from_numpy, DLPack); NumPy
    and CuPy ``like`` give ``result`` unchanged.

    >>> import numpy as np
    >>> r = np.asarray(5.0)
    >>> to_caller(r, np.ones(2)) is r
    True
    """
    which = kind(like)
    if which == "torch":
        return _to_torch(result, like, sys.modules["torch"])
    if which == "jax":
        return _to_jax(result, like, sys.modules["jax"])
    return result


def _to_torch(result: Any, like: torch.Tensor, torch: ModuleType) -> torch.Tensor:
    if isinstance(result, (np.ndarray, np.generic)):
        result = np.asarray(result)
        if not result.flags.writeable:
            result = result.copy()  # torch tensors are writable; a read-only view is not
        if result.dtype.name in FROM_PACKAGE and is_imported(result.dtype):  # the name first: no call for the rest
            tensor = _from_bits(result, torch, torch.from_numpy)
        else:
            tensor = torch.from_numpy(result)
    elif is_imported(result.dtype):
        tensor = _from_bits(result, torch, torch.from_dlpack)
    else:
        tensor = torch.from_dlpack(result)
    return tensor if tensor.device == like.device else tensor.to(like.device)


def _from_bits(result: Any, torch: ModuleType, wrap: Callable[[Any], torch.Tensor]) -> torch.Tensor:
    # A dtype of FROM_PACKAGE crosses as its bits, viewed as PyTorch's dtype of its name.
    return wrap(result.view(bits_dtype(result.dtype.itemsize))).view(getattr(torch, result.dtype.name))


def _to_jax(result: Any, like: jax.Array, jax: ModuleType) -> jax.Array:
    result = _in_jax_precision(result, jax)
    if isinstance(result, (np.ndarray, np.generic)):
        return jax.device_put(result, like.device)
    if is_imported(result.dtype):
        bits = jax.dlpack.from_dlpack(result.view(bits_dtype(result.dtype.itemsize)))
        return jax.device_put(jax.lax.bitcast_convert_type(bits, result.dtype), like.device)
    return jax.device_put(jax.dlpack.from_dlpack(result), like.device)


def _in_jax_precision(result: Any, jax: ModuleType) -> Any:
    """``result`` in the dtype JAX holds it in: float64 stays float64 with
    ``jax_enable_x64`` on, and becomes float32 with it off, unless a finite
    value would become inf (Float32OverflowError)."""
    held = jax.dtypes.canonicalize_dtype(result.dtype)
    if held == result.dtype:
        return result
    xp = np if isinstance(result, (np.ndarray, np.generic)) else sys.modules["cupy"]
    result = xp.asarray(result)
    with np.errstate(over="ignore"):
        narrowed = result.astype(held)
    overflowed = xp.isinf(narrowed) & xp.isfinite(result)
    if bool(overflowed.any()):
        found = result[overflowed].ravel()[0].item()
        raise Float32OverflowError(
            f"expected a result that fits {held} (JAX's dtype for {result.dtype} with "
            f"jax_enable_x64 off), found {found!r}; enable it with "
            f"jax.config.update('jax_enable_x64', True) to get the {result.dtype} result"
        )
    return narrowed


# ---------------------------------------------------------------- streams

def launch_stream(like: object) -> Any:
    """The context to launch kernels in for leaves like ``like``.

    For a PyTorch CUDA tensor, PyTorch's current stream on its device: no
    synchronisation, no cross-stream hazard with PyTorch's caching allocator,
    and what CUDA-graph capture needs. Otherwise a context that does nothing.

    >>> import numpy as np
    >>> with launch_stream(np.ones(2)):
    ...     pass
    """
    if _is_torch_cuda(like):
        return _torch_stream(like.device, sys.modules["torch"], _cupy())
    return contextlib.nullcontext()


def _torch_stream(device: torch.device, torch: ModuleType, cupy: ModuleType) -> Any:
    return external_stream(cupy, torch.cuda.current_stream(device).cuda_stream, device.index)


class _StreamHandle:
    """A raw ``cudaStream_t`` in the CUDA stream protocol, which CuPy 14's
    ``Stream.from_external`` takes
    (https://nvidia.github.io/cuda-python/cuda-core/latest/interoperability.html#cuda-stream-protocol)."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = int(ptr)

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


def external_stream(cupy: Any, ptr: int, device_id: int = -1) -> Any:
    """CuPy's stream object over a stream CuPy did not create (PyTorch's,
    say): ``Stream.from_external`` where CuPy has it (CuPy 14, which
    deprecates ``ExternalStream``), else ``ExternalStream`` (CuPy 13).

    The stream protocol carries no device: CuPy 14 marks the stream's device
    unknown (-1, the current device when used); a known ``device_id`` is
    set as ``ExternalStream`` sets it, so CuPy refuses the stream on another
    device.

    >>> import types
    >>> class Stream:
    ...     @classmethod
    ...     def from_external(cls, obj):
    ...         s = cls(); s.ptr, s.device_id = obj.__cuda_stream__()[1], -1; return s
    >>> s = external_stream(types.SimpleNamespace(cuda=types.SimpleNamespace(Stream=Stream)), 0xBEEF00, 1)
    >>> hex(s.ptr), s.device_id
    ('0xbeef00', 1)
    """
    from_external = getattr(getattr(cupy.cuda, "Stream", None), "from_external", None)
    if from_external is None:
        return cupy.cuda.ExternalStream(int(ptr), device_id)
    stream = from_external(_StreamHandle(ptr))
    if device_id >= 0:
        stream.device_id = device_id
    return stream


def device_scope(backend: Any, like: object) -> contextlib.AbstractContextManager[Any]:
    """The context a call's device work runs in: ``backend``'s device and, when
    ``like`` is a PyTorch CUDA tensor, its device, PyTorch's current stream
    there (:func:`launch_stream`) and PyTorch's caching allocator for every
    CuPy allocation, so that each launch, allocation, fill and element-wise
    operation is ordered with PyTorch's own work, and a CUDA graph that
    PyTorch captures keeps the scratch in its private pool. ``backend`` may
    be None: then only ``like`` says where the work runs. (Typed Any: the
    backends' protocol is a layer above this module.)

    >>> import numpy as np
    >>> from gpuflat._src.backends import get_backend
    >>> with device_scope(get_backend("numpy"), np.ones(2)):
    ...     pass
    """
    # A plain function, not a generator: host work enters the backend's own
    # context directly, and leaving it runs no code of this module.
    if not _is_torch_cuda(like):
        return backend.on_device() if backend is not None else contextlib.nullcontext()
    return _torch_cuda_scope(like)


@contextlib.contextmanager
def _torch_cuda_scope(like: torch.Tensor) -> Iterator[None]:
    """:func:`device_scope` for a PyTorch CUDA tensor ``like``."""
    cupy = sys.modules["cupy"]
    stream = launch_stream(like)
    allocator = _torch_allocator(cupy, stream.ptr)
    with cupy.cuda.Device(like.device.index), stream, cupy.cuda.using_allocator(allocator.malloc):
        yield


def _is_torch_cuda(x: object) -> TypeGuard[torch.Tensor]:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor) and x.is_cuda


def _torch_allocator(cupy: ModuleType, stream_ptr: int) -> Any:
    """A CuPy allocator taking blocks from PyTorch's caching allocator for the
    stream ``stream_ptr``; while PyTorch captures a graph on it, from the
    graph's private pool."""
    cuda = sys.modules["torch"].cuda
    alloc, delete = cuda.caching_allocator_alloc, cuda.caching_allocator_delete
    return cupy.cuda.memory.PythonFunctionAllocator(
        lambda nbytes, device_id: alloc(nbytes, device_id, stream_ptr), lambda ptr, device_id: delete(ptr))


# ---------------------------------------------------------------- PyTorch modules

def is_module(x: object) -> TypeGuard[torch.nn.Module]:
    """True for a ``torch.nn.Module`` (never imports torch).

    >>> is_module({"w": 1})
    False
    """
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.nn.Module)


def module_parameters(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(qualified name, parameter) for each trainable parameter, in named_parameters() order.

    Frozen parameters (requires_grad False) and buffers are left out; a
    parameter shared by several submodules appears once, under its first name.

    >>> import torch
    >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    >>> _ = net[0].bias.requires_grad_(False)
    >>> [name for name, _ in module_parameters(net)]
    ['0.weight', '1.weight', '1.bias']
    """
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]
