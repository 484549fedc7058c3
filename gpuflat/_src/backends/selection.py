"""Which backend serves a call: by name, and by the arrays' kind and device."""
from __future__ import annotations

import functools
import sys
import threading
from operator import attrgetter
from typing import TYPE_CHECKING, Any, Callable, Sequence

from gpuflat._src import caches, native
from gpuflat._src.identity import SameArrays

if TYPE_CHECKING:
    from .protocol import Backend

BACKEND_NAMES = ("numpy", "host", "cuda", "emulated")

_backends: dict[tuple[str, int | None], Backend] = {}
_lock = threading.Lock()


def get_backend(name: str, device: int | None = None) -> Backend:
    """The backend instance called ``name`` ("numpy", "host", "cuda" or "emulated").

    "cuda" has one backend per device (``device``: the CUDA device id;
    default: CuPy's current device), each launching on its own device.
    "host" raises a RuntimeError, with the build's message, where its native
    library cannot be built or loaded ("numpy" runs everywhere).

    >>> get_backend("numpy").name
    'numpy'
    """
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend: expected one of {BACKEND_NAMES}, got {name!r}")
    if name == "cuda" and device is None:
        device = sys.modules["cupy"].cuda.Device().id if "cupy" in sys.modules else 0
    key = (name, device if name == "cuda" else None)
    with _lock:
        if key not in _backends:
            _backends[key] = _make(name, device)
        return _backends[key]


def _make(name: str, device: int | None) -> Backend:
    if name == "numpy":
        from .numpy_backend import NumpyBackend

        return NumpyBackend()
    if name == "host":
        from .host import HostBackend

        return HostBackend()
    from .cuda import CudaBackend
    from .cuda_runtime import CupyRuntime, EmulatedRuntime

    return CudaBackend(EmulatedRuntime() if name == "emulated" else CupyRuntime(device))


def _is_cupy(x: Any) -> bool:
    cupy = sys.modules.get("cupy")
    return cupy is not None and isinstance(x, cupy.ndarray)


def select(backend: str | None, arrays: Sequence[Any], path_of: Callable[[int], str]) -> Backend:
    """The backend for a call on ``arrays``; ``path_of(i)`` names the i-th (only on error).

    The default follows the arrays: NumPy arrays take "host" (the native
    path) where it builds, else "numpy"; CuPy arrays "cuda" on their device.
    A mix of kinds or of devices raises, naming one leaf of each; so does a
    backend that cannot reach the arrays' memory, and an explicit "host"
    where its native library cannot be built (the build's message says why).

    >>> import numpy as np
    >>> select(None, [np.ones(2)], lambda i: "['w']").name in ("host", "numpy")
    True
    >>> select("cuda", [np.ones(2)], lambda i: "['w']")
    Traceback (most recent call last):
    ...
    TypeError: backend 'cuda' works on CuPy arrays; leaf "['w']" is a numpy.ndarray
    """
    first_numpy, first_cupy = _first_of_each_kind(arrays)
    if first_numpy is not None and first_cupy is not None:
        raise TypeError(
            f"tree mixes NumPy and CuPy arrays: leaf {path_of(first_numpy)!r} is a NumPy array, "
            f"leaf {path_of(first_cupy)!r} is a CuPy array"
        )
    name = backend or ("cuda" if first_cupy is not None else host_default())
    wants_cupy = name == "cuda"
    wrong = first_numpy if wants_cupy else first_cupy
    if wrong is not None:
        kind = "CuPy" if wants_cupy else "NumPy"
        raise TypeError(
            f"backend {name!r} works on {kind} arrays; leaf {path_of(wrong)!r} is a "
            f"{type(arrays[wrong]).__module__}.{type(arrays[wrong]).__name__}"
        )
    if not wants_cupy:
        return get_backend(name)
    return get_backend(name, _one_device(arrays, path_of))


def _first_of_each_kind(arrays: Sequence[Any]) -> tuple[int | None, int | None]:
    """(the position of the first NumPy array, of the first CuPy array), None for a kind absent.

    Read from the set of the arrays' types: one C-level pass, and none at all
    where CuPy is not imported (no CuPy array can exist then), or where they
    are a recorded tree's, found unchanged (``identity.Recorded``: one kind
    of array), whose first array tells.

    >>> import numpy as np
    >>> _first_of_each_kind([np.ones(2), np.ones(3)]), _first_of_each_kind([])
    ((0, None), (None, None))
    """
    cupy = sys.modules.get("cupy")
    if not arrays or cupy is None:
        return (0 if arrays else None), None
    kinds = {issubclass(k, cupy.ndarray) for k in ((type(arrays[0]),) if getattr(arrays, "token", 0)
                                                   else set(map(type, arrays)))}
    if kinds == {False}:
        return 0, None
    if kinds == {True}:
        return None, 0
    on_gpu = list(map(_is_cupy, arrays))  # mixed kinds: an error will name one leaf of each
    return on_gpu.index(False), on_gpu.index(True)


@functools.cache  # the host library is built or refused once per process (native.host_library)
def host_default() -> str:
    """The backend NumPy arrays get by default: "host" where its native library builds, else "numpy".

    >>> host_default() in ("host", "numpy")
    True
    """
    return "host" if native.available() else "numpy"


# The arrays whose device was found lately, each list with its device.
# A CuPy array's memory, so its device, is fixed for its life (``data`` is
# read-only), and a weak reference never matches a dead array, so a list
# met again (a training loop's gradients, step after step) is answered by
# identity alone: one C loop, no device read per leaf.
_devices_found = caches.Recent("devices of CuPy arrays", 4)
_device_id = attrgetter("device.id")


def _one_device(arrays: Sequence[Any], path_of: Callable[[int], str]) -> int | None:
    """The CUDA device all ``arrays`` live on; TypeError naming a leaf on each of two.

    >>> from types import SimpleNamespace as Array
    >>> on = lambda d: Array(device=Array(id=d))
    >>> _one_device([on(1), on(1)], str)
    1
    >>> _one_device([on(1), on(0)], str)
    Traceback (most recent call last):
    ...
    TypeError: tree spans two GPUs: leaf '0' is on device 1, leaf '1' on device 0; expected one device
    """
    if not arrays:
        return None
    known, start = None, 0
    token = getattr(arrays, "token", 0)  # a recorded tree's arrays, unchanged (identity.Recorded)
    for held, device, held_token in _devices_found.entries()[::-1]:
        if token and token == held_token:
            return device
        start = held.shared_start(arrays)
        if start:
            known = device
            break
    if start == len(arrays):
        if token:  # found by their identities: their token finds them from now on
            _devices_found.add((SameArrays(arrays), known, token))
        return known
    rest = arrays[start:]
    devices = set(map(_device_id, rest))
    if known is not None:
        devices.add(known)
    if len(devices) > 1:
        _raise_two_devices(arrays, path_of)
    device = devices.pop()
    _devices_found.add((SameArrays(arrays), device, token))
    return device


def _raise_two_devices(arrays: Sequence[Any], path_of: Callable[[int], str]) -> None:
    device = arrays[0].device.id
    for i, a in enumerate(arrays):
        if a.device.id != device:
            raise TypeError(
                f"tree spans two GPUs: leaf {path_of(0)!r} is on device {device}, "
                f"leaf {path_of(i)!r} on device {a.device.id}; expected one device"
            )
