"""Every exception class gpuflat raises; each message names what was
expected and what was found (and the leaf path, where there is one).

This module imports nothing of gpuflat's but ``gpuflat._src.public``
(which imports nothing of gpuflat's), so every module, down to the lowest
(``gpuflat._src.host_compiler``), can raise from it without a cycle.
"""
from ._src import public as _public

__all__ = [
    "BuildError", "CaptureError", "CollectiveError", "EmulatorBuildError", "EmulatorError",
    "Float32OverflowError", "KernelError", "NonFiniteError", "NonFiniteNormError", "NonFloatingTensorError",
    "OverlapError", "StaleResidentError", "TreeMismatchError", "UnknownKernelError", "UnsupportedLeafError",
    "UnwalkableError",
]
__dir__ = _public.listing(__all__)


class TreeMismatchError(ValueError):
    """A tree, leaf or flat buffer does not match the plan it is used with.

    >>> raise TreeMismatchError("leaf ['w']: expected shape (3,), got (4,)")
    Traceback (most recent call last):
    ...
    gpuflat.errors.TreeMismatchError: leaf ['w']: expected shape (3,), got (4,)
    """


class UnwalkableError(TypeError):
    """A value inside a tree that gpuflat cannot take (a generator, a float8
    array, a container that contains itself); raised naming its path.

    >>> import gpuflat as gf
    >>> gf.trainables({"w": iter([1.0])})
    Traceback (most recent call last):
    ...
    gpuflat.errors.UnwalkableError: leaf "['w']": expected an array or a container, got a list_iterator, which cannot be walked twice or rebuilt; pass a list
    """


class NonFiniteError(FloatingPointError):
    """A norm is NaN or infinite where the caller asked for finite values.

    >>> raise NonFiniteError("leaf ['w'] holds NaN or inf")
    Traceback (most recent call last):
    ...
    gpuflat.errors.NonFiniteError: leaf ['w'] holds NaN or inf
    """


class OverlapError(ValueError):
    """Two distinct leaves share memory, so an in-place write would race.

    >>> raise OverlapError("leaves ['a'] and ['b'] share memory")
    Traceback (most recent call last):
    ...
    gpuflat.errors.OverlapError: leaves ['a'] and ['b'] share memory
    """


class StaleResidentError(RuntimeError):
    """A resident model no longer matches the model it was made from.

    Raised by a resident model's per-step calls when a parameter was changed
    in a way the flat buffers cannot follow (its dtype or shape, whether it
    requires grad, a parameter added or removed); the message names the
    parameter and says what changed. Rebuild with ``gf.resident(model)``.

    >>> raise StaleResidentError("parameter 'fc.weight': dtype changed from float32 to float64")
    Traceback (most recent call last):
    ...
    gpuflat.errors.StaleResidentError: parameter 'fc.weight': dtype changed from float32 to float64
    """


class CaptureError(RuntimeError):
    """A call needs work that a CUDA graph cannot capture (a table upload, a
    synchronisation) while its stream is capturing one.

    The message names the call and the warm-up it is missing: the same call
    once before capturing, so its tables are uploaded and kept.

    >>> raise CaptureError("norms of leaf ['w']: make the same call once before capturing")
    Traceback (most recent call last):
    ...
    gpuflat.errors.CaptureError: norms of leaf ['w']: make the same call once before capturing
    """


class UnsupportedLeafError(TypeError):
    """A leaf is an array gpuflat cannot view zero-copy; the walk prefixes its path.

    >>> raise UnsupportedLeafError("expected a NumPy, CuPy, PyTorch or JAX array, found Series")
    Traceback (most recent call last):
    ...
    gpuflat.errors.UnsupportedLeafError: expected a NumPy, CuPy, PyTorch or JAX array, found Series
    """


class Float32OverflowError(OverflowError):
    """A finite 64-bit result does not fit the 32-bit dtype JAX would hold it in.

    With ``jax_enable_x64`` off (JAX's default) JAX arrays are at most 32-bit,
    and JAX itself would turn such a value into inf with only a warning.

    >>> raise Float32OverflowError("expected a result that fits float32, found 6e+38")
    Traceback (most recent call last):
    ...
    gpuflat.errors.Float32OverflowError: expected a result that fits float32, found 6e+38
    """


class NonFiniteNormError(NonFiniteError, RuntimeError):
    """The total norm is NaN or inf and ``error_if_nonfinite`` was set; nothing was scaled.

    A RuntimeError, as PyTorch raises, and a gpuflat NonFiniteError.

    >>> issubclass(NonFiniteNormError, RuntimeError), issubclass(NonFiniteNormError, NonFiniteError)
    (True, True)
    """


class NonFloatingTensorError(TreeMismatchError, RuntimeError):
    """A tensor is neither floating point nor complex (an integer or bool tensor); nothing was changed.

    A RuntimeError, as PyTorch's norms raise for such tensors, and a gpuflat TreeMismatchError.

    >>> import torch
    >>> from gpuflat.torch import get_total_norm
    >>> get_total_norm([torch.ones(2), torch.arange(3)])
    Traceback (most recent call last):
    ...
    gpuflat.errors.NonFloatingTensorError: leaf 'tensors[1]': expected a floating point or complex tensor, found dtype torch.int64
    """


class CollectiveError(RuntimeError):
    """A collective failed: typically another rank raised before reaching it, or left.

    >>> raise CollectiveError("rank 0 of 2: the all-reduce failed")
    Traceback (most recent call last):
    ...
    gpuflat.errors.CollectiveError: rank 0 of 2: the all-reduce failed
    """


class BuildError(RuntimeError):
    """The C++ compiler rejected the sources (or could not run); ``stderr`` holds its message.

    >>> err = BuildError("g++ failed to build demo (exit 1)", "demo.cpp:1: error: expected ';'")
    >>> str(err), err.stderr
    ('g++ failed to build demo (exit 1)', "demo.cpp:1: error: expected ';'")
    """

    def __init__(self, message: str, stderr: str = ""):
        super().__init__(message)
        self.stderr = stderr


class EmulatorError(RuntimeError):
    """Base class of the errors of the kernels run on the host (``gpuflat._src.emulator``).

    >>> issubclass(KernelError, EmulatorError), issubclass(EmulatorBuildError, EmulatorError)
    (True, True)
    """


class EmulatorBuildError(EmulatorError, BuildError):
    """g++ rejected the kernel sources; ``stderr`` holds its message.

    >>> issubclass(EmulatorBuildError, BuildError)
    True
    """


class UnknownKernelError(EmulatorError, LookupError):
    """The name expression is not one the library was built with.

    >>> raise UnknownKernelError("kernel 'k<float>' is not in the emulator library demo.so (it has: k<double>)")
    Traceback (most recent call last):
    ...
    gpuflat.errors.UnknownKernelError: kernel 'k<float>' is not in the emulator library demo.so (it has: k<double>)
    """


class KernelError(EmulatorError):
    """A launch failed: a trap or assert in a kernel, or a deadlock.

    >>> raise KernelError("kernel 'k', block 1, thread 5: __trap()")
    Traceback (most recent call last):
    ...
    gpuflat.errors.KernelError: kernel 'k', block 1, thread 5: __trap()
    """
