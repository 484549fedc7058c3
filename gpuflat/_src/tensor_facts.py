"""What decides a list of PyTorch tensors' leaf table, read in one native pass.

``gpuflat.torch`` finds a call's table again by each tensor's address,
element count, dtype and contiguity (``gpuflat._src.tensor_table``). Those facts
come back as one int64 array of three words per tensor: the address, the
element count, and a code: the dtype's position in :data:`DTYPES`,
:data:`CONTIGUOUS` set for a contiguous tensor, :data:`LAZY_VIEW` for a
conjugate or negative view, and the device (:func:`device_keys`). A small C++ library built
against the installed PyTorch's headers (``kernels/host/tensor_facts.cpp``,
built with g++ on first use and cached on disk) reads them, and the
gradients of a list of parameters, at about 40 ns per tensor; Python reads
them where the library cannot be built (a warning says why) or
``GPUFLAT_NATIVE=0`` turns it off, at about 300 ns, with the same result.

>>> import torch
>>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
>>> grads, facts = gradients([w, torch.nn.Parameter(torch.zeros(2))])
>>> grads[0] is w.grad, facts[:, :2].tolist() == [[w.grad.data_ptr(), 3]]
(True, True)
>>> [DTYPES[c] for c in dtype_codes(facts)], bool(facts[0, 2] & CONTIGUOUS)
([torch.float32], True)
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import operator
import sys
import sysconfig
from operator import attrgetter
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from . import caches, host_compiler
from ..errors import BuildError
from .kernel_loader import kernel_dir

__all__ = ["CONTIGUOUS", "DTYPES", "LAZY_VIEW", "NAME", "PLAIN", "available", "device_keys", "dtype_codes",
           "gradients", "in_python", "is_plain_type", "of_step", "of_tensors", "same_items", "state_words",
           "unavailable_reason"]

# Every torch dtype, in a fixed order: a dtype's code is its position here.
DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
# The rest of the code word, written here once: the C++ reads it from the
# header :func:`_header` writes from these.
CONTIGUOUS = 1 << 16
LAZY_VIEW = 1 << 17  # a conjugate or negative view: its memory holds other values than it shows
# Bits 24 and up: the device's kind (1 the CPU, 2 CUDA, 3 anything else), then its index + 1.
_DEVICE_SHIFT = 24
_DEVICE_KINDS = {"cpu": 1, "cuda": 2}
_OTHER_DEVICE = 3
_INDEX_SHIFT = 8  # the index + 1 above the kind
_CODE = {dtype: i for i, dtype in enumerate(DTYPES)}
# The tensor types read natively; a subclass may define what Python sees its own way.
PLAIN = frozenset((torch.Tensor, torch.nn.Parameter))
_grad_of, _dtype = attrgetter("grad"), attrgetter("dtype")
# The library's name in the cache (and in host_compiler.obtained).
NAME = "gpuflat-tensor-facts"


def gradients(parameters: list) -> tuple[list, np.ndarray | None]:
    """(the gradients of ``parameters`` that have one, in order; their facts
    (:func:`of_tensors`)). Parameters of a subclass may define ``.grad``
    their own way: theirs are read in Python.

    >>> p = torch.nn.Parameter(torch.zeros(2))
    >>> gradients([p])[0], gradients([p])[1].shape
    ([], (0, 3))
    """
    lib = _library()
    if lib is not None:
        present: list = []
        rows = np.empty((len(parameters), 3), np.int64)
        n = lib.gf_tensor_facts(parameters, 1, present, rows.ctypes.data)
        if n >= 0:
            return present, rows[:n]
    grads = [g for g in map(_grad_of, parameters) if g is not None]
    return grads, of_tensors(grads)


def of_step(lists: list, parameters: list) -> tuple[list, np.ndarray | None, np.ndarray | None] | None:
    """What an optimizer's step reads of its parameters in one call: None
    where ``lists`` (the groups' params lists) no longer hold exactly
    ``parameters`` (:func:`same_items`), else (their gradients, the
    gradients' facts, as :func:`gradients` gives them; the parameters'
    facts, :func:`of_tensors`).

    >>> w = torch.nn.Parameter(torch.zeros(3)); w.grad = torch.ones(3)
    >>> grads, grad_facts, facts = of_step([[w]], [w])
    >>> grads[0] is w.grad, facts[0, 1], of_step([[w], [w]], [w])
    (True, np.int64(3), None)
    """
    if not same_items(lists, parameters):
        return None
    return (*gradients(parameters), of_tensors(parameters))


def same_items(lists: list, flat: list) -> bool:
    """Whether the lists ``lists`` hold, one after the other, exactly the
    objects of ``flat``, compared by identity (never by value: two tensors of
    equal values are different parameters).

    >>> a, b = torch.zeros(1), torch.zeros(1)
    >>> same_items([[a], [b]], [a, b]), same_items([[a], [a]], [a, b]), same_items([[a]], [a, b])
    (True, False, False)
    """
    lib = _library()
    if lib is not None:
        return bool(lib.gf_same_items(lists, flat))
    return sum(map(len, lists)) == len(flat) and all(map(operator.is_, itertools.chain.from_iterable(lists), flat))


def state_words(state: dict, names: tuple) -> tuple[list, np.ndarray]:
    """(the keys of ``state``, an optimizer's state dict, in its order; per
    key, int64 words: the identity of its dict, then per name of ``names``
    the identity of the value kept under it (0 where absent) and its data
    pointer where it is a plain strided tensor with storage, else 0).

    >>> w, m = torch.zeros(2), torch.ones(2)
    >>> keys, words = state_words({w: {"m": m}}, ("m", "v"))
    >>> keys[0] is w, words[0, 1:].tolist() == [id(m), m.data_ptr(), 0, 0]
    (True, True)
    """
    width = 1 + 2 * len(names)
    lib = _library()
    if lib is not None:
        rows = np.empty((len(state), 1 + width), np.int64)
        n = lib.gf_state_words(state, names, rows.ctypes.data, len(state))
        if n == len(state):  # the same order as the dict's own iteration
            return list(state), rows[:, 1:]
    keys = list(state)
    rows = np.zeros((len(keys), width), np.int64)
    for j, key in enumerate(keys):
        values = state[key]
        rows[j, 0] = id(values)
        for k, name in enumerate(names):
            value = values.get(name) if isinstance(values, dict) else None
            if value is not None:
                rows[j, 1 + 2 * k] = id(value)
                if type(value) in PLAIN and value.layout == torch.strided:
                    with contextlib.suppress(RuntimeError):  # no storage of its own
                        rows[j, 2 + 2 * k] = value.data_ptr()
    return keys, rows


def of_tensors(tensors: list) -> np.ndarray | None:
    """The facts of ``tensors``; None where one is not a strided tensor with
    storage of a plain type (:func:`is_plain_type`).

    >>> t = torch.zeros(2, 3).t()
    >>> bool(of_tensors([t])[0, 2] & CONTIGUOUS), of_tensors([torch.zeros(2).to_sparse()])
    (False, None)
    """
    lib = _library()
    if lib is not None:
        rows = np.empty((len(tensors), 3), np.int64)
        if lib.gf_tensor_facts(tensors, 0, None, rows.ctypes.data) >= 0:
            return rows
    return _python_facts(tensors)


def in_python(tensors: list) -> np.ndarray | None:
    """The facts of tensors of any type, read through their Python API (what
    a subclass says of itself); None where one is not strided or has no
    storage of its own.

    >>> class Tagged(torch.Tensor): pass
    >>> in_python([torch.ones(3).as_subclass(Tagged)])[0, 1]
    np.int64(3)
    """
    return _python_facts(tensors, any_type=True)


def _python_facts(tensors: Sequence[torch.Tensor], any_type: bool = False) -> np.ndarray | None:
    """The facts read in Python: where the library is not built, or for subclasses it leaves out."""
    if ((not any_type and not all(map(is_plain_type, set(map(type, tensors)))))
            or set(map(attrgetter("layout"), tensors)) - {torch.strided}):
        return None
    rows = np.empty((len(tensors), 3), np.int64)
    try:
        rows[:, 0] = np.fromiter(map(torch.Tensor.data_ptr, tensors), np.int64, len(tensors))
    except RuntimeError:  # no storage of its own
        return None
    rows[:, 1] = np.fromiter(map(torch.Tensor.numel, tensors), np.int64, len(tensors))
    rows[:, 2] = np.fromiter(map(_CODE.__getitem__, map(_dtype, tensors)), np.int64, len(tensors))
    rows[:, 2] |= np.fromiter(map(torch.Tensor.is_contiguous, tensors), bool, len(tensors)) * CONTIGUOUS
    lazy = np.fromiter(map(torch.Tensor.is_conj, tensors), bool, len(tensors))
    lazy |= np.fromiter(map(torch.Tensor.is_neg, tensors), bool, len(tensors))
    rows[:, 2] |= lazy * LAZY_VIEW
    rows[:, 2] |= np.fromiter(map(_device_code, map(attrgetter("device"), tensors)), np.int64, len(tensors))
    return rows


@caches.function(maxsize=64)
def _device_code(device: torch.device) -> int:
    kind = _DEVICE_KINDS.get(device.type, _OTHER_DEVICE)
    index = -1 if device.index is None else device.index
    return (kind | (index + 1) << _INDEX_SHIFT) << _DEVICE_SHIFT


def dtype_codes(facts: np.ndarray) -> np.ndarray:
    """Each tensor's dtype as its position in :data:`DTYPES`.

    >>> [DTYPES[c] for c in dtype_codes(of_tensors([torch.ones(1, dtype=torch.float16)]))]
    [torch.float16]
    """
    return facts[:, 2] & (CONTIGUOUS - 1)


def device_keys(facts: np.ndarray) -> np.ndarray:
    """A number per tensor, equal for tensors on the same device: its kind
    (``key & 255``: 1 the CPU, 2 CUDA, 3 any other) and index.

    >>> keys = device_keys(of_tensors([torch.ones(1), torch.ones(2)]))
    >>> bool(keys[0] == keys[1]), int(keys[0] & 255)
    (True, 1)
    """
    return facts[:, 2] >> _DEVICE_SHIFT


@caches.function(maxsize=64)
def is_plain_type(cls: object) -> bool:
    """A tensor type whose memory holds its values (not a DTensor or another wrapper).

    >>> is_plain_type(torch.nn.Parameter), is_plain_type(int)
    (True, False)
    """
    # A DTensor, like every wrapper subclass, overrides __torch_dispatch__.
    return cls in PLAIN or (isinstance(cls, type) and issubclass(cls, torch.Tensor)
                             and cls.__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


def available() -> bool:
    """Whether the native reader builds and loads here (else Python reads the facts).

    >>> isinstance(available(), bool)
    True
    """
    return _library() is not None


def unavailable_reason() -> str | None:
    """Why the native reader is not used here, or None where it is.

    >>> (unavailable_reason() is None) == available()
    True
    """
    return _load()[1]


# The header the library reads the code word from, written by _header.
HEADER = "gpuflat_tensor_facts.h"


def _header() -> str:
    """The C++ header of the code word's parts (never on disk: handed to the build).

    >>> "#define GF_FACTS_CONTIGUOUS 65536LL" in _header().splitlines()
    True
    """
    words = {"CONTIGUOUS": CONTIGUOUS, "LAZY_VIEW": LAZY_VIEW, "DEVICE_SHIFT": _DEVICE_SHIFT,
             "INDEX_SHIFT": _INDEX_SHIFT, "CPU": _DEVICE_KINDS["cpu"], "CUDA": _DEVICE_KINDS["cuda"],
             "OTHER_DEVICE": _OTHER_DEVICE}
    lines = ["// Written by gpuflat._src.tensor_facts._header(): the parts of a tensor's code word.", "#pragma once"]
    return "\n".join(lines + [f"#define GF_FACTS_{name} {value}LL" for name, value in words.items()]) + "\n"


def _library() -> ctypes.PyDLL | None:
    return _load()[0]


@functools.lru_cache(maxsize=None)
def _load() -> tuple[ctypes.PyDLL, None] | tuple[None, str]:
    """(the loaded library, None), or (None, why it is not used: off, or why
    it cannot be built or loaded); built on first use."""
    off = host_compiler.native_disabled()
    if off:
        return None, off
    python_include = sysconfig.get_paths()["include"]
    # The wheel's own headers and libraries (torch.utils.cpp_extension knows
    # them too, but imports setuptools, which a plain venv may lack).
    torch_root = Path(torch.__file__).parent
    torch_lib, torch_include = torch_root / "lib", torch_root / "include"
    abi = int(torch.compiled_with_cxx11_abi())
    flags = ("-O2", "-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             # Linked whatever the compiler's --as-needed default, found by rpath.
             "-Wl,--no-as-needed", f"-L{torch_lib}", "-ltorch_python", "-ltorch_cpu", "-lc10",
             f"-Wl,-rpath,{torch_lib}")
    try:
        path = host_compiler.build_library(
            NAME, (kernel_dir() / "host" / "tensor_facts.cpp").read_text(),
            include_dirs=(python_include, torch_include, torch_include / "torch" / "csrc" / "api" / "include"),
            flags=flags, files={HEADER: _header()},
            key_parts=(sys.version, torch.__version__, str(torch_lib)))
        lib = host_compiler.load(path, ctypes.PyDLL)
    except (BuildError, OSError) as exc:
        return None, host_compiler.warn_unbuilt("tensor facts reader", str(exc),
                                                "PyTorch tensors' facts are read in Python (slower per tensor)")
    obj = ctypes.py_object
    lib.gf_tensor_facts_init.argtypes = [obj, obj, obj]
    lib.gf_tensor_facts_init.restype = None
    lib.gf_tensor_facts.argtypes = [obj, ctypes.c_int, obj, ctypes.c_void_p]
    lib.gf_tensor_facts.restype = ctypes.c_longlong
    lib.gf_same_items.argtypes = [obj, obj]
    lib.gf_same_items.restype = ctypes.c_longlong
    lib.gf_state_words.argtypes = [obj, obj, ctypes.c_void_p, ctypes.c_longlong]
    lib.gf_state_words.restype = ctypes.c_longlong
    lib.gf_tensor_facts_init(torch.Tensor, torch.nn.Parameter, DTYPES)
    return lib, None
