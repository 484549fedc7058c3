"""gpuflat._src.arrays: NumPy and PyTorch leaves seen zero-copy, array-likes refused,
results handed back in the caller's kind, and the CUDA paths through stand-ins.

JAX arrays are tested in test_jax.py.
"""
from __future__ import annotations

import array
import sys
import types

import numpy as np
import pytest
import torch

from conftest import BF16, DTYPES, DTYPE_IDS
from gpuflat._src import arrays
from gpuflat._src.arrays import UnsupportedLeafError, adopt, kind, to_caller

TORCH_DTYPES = {
    np.dtype(np.float16): torch.float16,
    BF16: torch.bfloat16,
    np.dtype(np.float32): torch.float32,
    np.dtype(np.float64): torch.float64,
    np.dtype(np.complex64): torch.complex64,
    np.dtype(np.complex128): torch.complex128,
}
SHAPES = [(), (0,), (3,), (2, 0), (3, 4)]


def torch_tensor(dtype, shape, layout, seed=0):
    """A CPU tensor of ``shape`` laid out as ``layout``: c, transposed or sliced."""
    g = torch.Generator().manual_seed(seed)
    tdt = TORCH_DTYPES[np.dtype(dtype)]
    if layout == "transposed" and len(shape) == 2:
        return torch.randn(shape[::-1], generator=g, dtype=tdt).T
    if layout == "sliced" and len(shape) >= 1:
        big = torch.randn(tuple(2 * n + 1 for n in shape), generator=g, dtype=tdt)
        return big[tuple(slice(1, None, 2) for _ in shape)]
    return torch.randn(shape, generator=g, dtype=tdt)


def reference_values(t):
    """The tensor's values as float64 or complex128, through torch's own conversion."""
    wide = torch.complex128 if t.dtype.is_complex else torch.float64
    return t.detach().to(wide).numpy()


def address(a):
    return a.__array_interface__["data"][0]


# ---------------------------------------------------------------- NumPy and statics

def test_numpy_arrays_come_back_as_they_are():
    a = np.ones((2, 3), np.float32).T
    assert adopt(a) is a and kind(a) == "numpy"
    assert to_caller(a, np.zeros(1)) is a


@pytest.mark.parametrize("value", ["relu", 3, 2.5, None, np.sin, b"bytes", bytearray(b"ab"),
                                   np.float32(1.5), np.complex128(1j), (1, 2)])
def test_statics_are_not_arrays(value):
    assert adopt(value) is None
    assert kind(value) is None


# ---------------------------------------------------------------- PyTorch CPU tensors

@pytest.mark.parametrize("layout", ["c", "transposed", "sliced"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_cpu_tensor_is_viewed_zero_copy(dtype, shape, layout):
    t = torch_tensor(dtype, shape, layout)
    view = adopt(t)
    assert type(view) is np.ndarray and kind(t) == "torch"
    assert view.dtype == dtype and view.shape == tuple(t.shape)
    np.testing.assert_array_equal(view.astype(reference_values(t).dtype), reference_values(t))
    if t.numel():  # NumPy reports strides and addresses of empty arrays its own way
        assert view.strides == tuple(s * t.element_size() for s in t.stride())
        assert address(view) == t.data_ptr()
        view[(0,) * view.ndim] = 7
        assert t[(0,) * t.ndim].item() == 7  # written through the view, seen by the tensor


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_torch_nonfinite_values_survive(dtype):
    t = torch.tensor([float("nan"), float("inf"), -float("inf"), 1.0]).to(TORCH_DTYPES[dtype])
    np.testing.assert_array_equal(adopt(t).astype(reference_values(t).dtype), reference_values(t))


def test_tensor_requiring_grad_is_viewed_through_detach():
    p = torch.nn.Parameter(torch.arange(4.0))
    view = adopt(p)
    assert address(view) == p.data_ptr()
    view[1] = 10.0
    assert p[1].item() == 10.0 and p.requires_grad


def test_tensors_sharing_storage_give_views_of_the_same_memory():
    base = torch.arange(6.0)
    whole, tail = adopt(base), adopt(base[2:])
    assert np.shares_memory(whole, tail)
    tail[0] = -1.0
    assert base[2].item() == -1.0 and whole[2] == -1.0


def test_integer_and_bool_tensors_are_viewed_too():
    # Viewable, but never trainable: the walk keeps them as non-trainable arrays.
    ints, flags = torch.arange(3), torch.tensor([True, False])
    assert adopt(ints).dtype == np.int64 and address(adopt(ints)) == ints.data_ptr()
    assert adopt(flags).dtype == np.bool_


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("tensor, expected", [
    (lambda: torch.ones(3, dtype=torch.complex64).conj(), "conjugate bit"),
    (lambda: torch.ones(3, dtype=torch.complex64).conj().imag, "negative bit"),
    (lambda: torch.ones(3).to_sparse(), "strided (dense) tensor, found layout torch.sparse_coo"),
    (lambda: torch.ones(2, 2).to_sparse_csr(), "found layout torch.sparse_csr"),
    (lambda: torch.ones(3, device="meta"), "CPU or CUDA tensor, found one on device 'meta'"),
    (lambda: torch.ones(3, dtype=torch.float8_e4m3fn), "dtype NumPy can hold, found torch.float8_e4m3fn"),
])
def test_unviewable_tensors_raise_saying_what_was_expected(tensor, expected):
    with pytest.raises(UnsupportedLeafError, match=expected.replace("(", r"\(").replace(")", r"\)")) as err:
        adopt(tensor())
    assert isinstance(err.value, TypeError)
    assert "leaf" not in str(err.value)  # the walk prefixes the path


def test_bfloat16_without_ml_dtypes_raises(monkeypatch):
    monkeypatch.setattr(arrays, "imported", lambda name: None)
    with pytest.raises(UnsupportedLeafError, match="ml_dtypes"):
        adopt(torch.ones(2, dtype=torch.bfloat16))


# ---------------------------------------------------------------- results back to PyTorch

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_to_caller_gives_a_cpu_tensor_sharing_memory(dtype):
    result = (np.arange(6.0).reshape(2, 3) - 2.5).astype(dtype)
    back = to_caller(result, torch.zeros(1))
    assert isinstance(back, torch.Tensor) and back.dtype == TORCH_DTYPES[dtype]
    assert back.data_ptr() == address(result)
    np.testing.assert_array_equal(reference_values(back), result.astype(reference_values(back).dtype))


def test_to_caller_keeps_a_0d_norm_0d():
    back = to_caller(np.asarray(5.0), torch.zeros(3, dtype=torch.float16))
    assert back.shape == () and back.dtype == torch.float64 and back.item() == 5.0
    assert to_caller(np.float64(2.0), torch.zeros(1)).item() == 2.0


def test_to_caller_copies_a_read_only_result():
    result = np.arange(3.0)
    result.flags.writeable = False
    back = to_caller(result, torch.zeros(1))
    back[0] = 9.0  # a tensor is writable; the read-only source is untouched
    assert result[0] == 0.0 and back.tolist() == [9.0, 1.0, 2.0]


def test_launch_stream_does_nothing_for_host_arrays():
    for like in (np.ones(1), torch.ones(1), "static"):
        with arrays.launch_stream(like) as entered:
            assert entered is None


# ---------------------------------------------------------------- array-likes gpuflat does not know

class WithInterface:
    def __init__(self):
        self._a = np.ones(3)
        self.__array_interface__ = self._a.__array_interface__


class WithArray:
    def __array__(self, dtype=None, copy=None):
        return np.ones(3)


class WithDlpack:
    def __dlpack__(self, stream=None):
        raise AssertionError("never called")


class WithCudaInterface:
    __cuda_array_interface__ = {"shape": (3,), "typestr": "<f4", "data": (0, False), "version": 3}


@pytest.mark.parametrize("value, name", [
    (WithInterface(), "test_arrays.WithInterface"),
    (WithArray(), "test_arrays.WithArray"),
    (WithDlpack(), "test_arrays.WithDlpack"),
    (WithCudaInterface(), "test_arrays.WithCudaInterface"),
    (memoryview(np.ones(3)), "memoryview"),
    (array.array("f", [1.0, 2.0]), "array.array"),
])
def test_unknown_array_likes_raise_naming_their_type(value, name):
    with pytest.raises(UnsupportedLeafError, match=f"found {name} ") as err:
        adopt(value)
    assert "NumPy, CuPy, PyTorch or JAX" in str(err.value)
    assert kind(value) is None


# ---------------------------------------------------------------- PyTorch modules

class TiedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.frozen = torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.out = torch.nn.Linear(4, 5, bias=False)
        self.out.weight = self.embed.weight  # tied


def test_module_parameters_are_the_trainable_ones_once_by_qualified_name():
    model = TiedLM()
    names = [name for name, _ in arrays.module_parameters(model)]
    assert names == ["embed.weight", "norm.weight", "norm.bias"]
    assert arrays.module_parameters(model)[0][1] is model.embed.weight
    assert arrays.is_module(model) and not arrays.is_module({"w": torch.ones(1)})


def test_module_parameters_of_a_transformer_use_pytorch_names():
    model = torch.nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=1,
                                 dim_feedforward=16, batch_first=True)
    got = arrays.module_parameters(model)
    assert [n for n, _ in got] == [n for n, p in model.named_parameters()]
    assert "encoder.layers.0.linear1.weight" in dict(got)


# ---------------------------------------------------------------- CUDA paths, through stand-ins

class StandInCuda(torch.Tensor):
    """A CPU tensor that says it is on CUDA, so the CUDA branches run here."""

    @property
    def is_cuda(self):
        return True


def stand_in_cuda(t):
    return torch.Tensor._make_subclass(StandInCuda, t)


@pytest.fixture
def stand_in_cupy(monkeypatch):
    """A module named cupy whose from_dlpack is NumPy's and whose streams are
    recorded, made and entered; PyTorch's current stream is 4242."""
    streams, entered, imported = [], [], []

    class ExternalStream:
        def __init__(self, ptr, device_id):
            streams.append((ptr, device_id))

        def __enter__(self):
            entered.append(self)
            return self

        def __exit__(self, *exc):
            entered.remove(self)

    fake = types.ModuleType("cupy")
    fake.__version__ = "13.6.0"
    fake.ndarray = type("ndarray", (), {})
    fake.from_dlpack = lambda x: imported.append(bool(entered)) or np.from_dlpack(x)
    fake.cuda = types.SimpleNamespace(ExternalStream=ExternalStream)
    fake.streams, fake.imported = streams, imported
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: types.SimpleNamespace(cuda_stream=4242))
    return fake


def test_cuda_tensor_goes_through_cupy_from_dlpack(stand_in_cupy):
    t = torch.arange(6.0).reshape(2, 3).T
    view = adopt(stand_in_cuda(t))
    assert address(view) == t.data_ptr() and view.strides == (4, 12)
    np.testing.assert_array_equal(view, t.numpy())
    # Imported on PyTorch's current stream: DLPack then orders nothing across streams.
    assert stand_in_cupy.imported == [True] and stand_in_cupy.streams == [(4242, t.device.index)]


def test_cuda_bfloat16_crosses_as_int16_bits(stand_in_cupy, monkeypatch):
    t = torch.tensor([1.5, -2.0, float("inf")], dtype=torch.bfloat16)
    seen = []
    monkeypatch.setattr(stand_in_cupy, "from_dlpack", lambda x: seen.append(x.dtype) or np.from_dlpack(x))
    view = adopt(stand_in_cuda(t))
    assert seen == [torch.int16]  # never a bfloat16 DLPack tensor
    assert view.dtype == BF16 and address(view) == t.data_ptr()
    np.testing.assert_array_equal(view.astype(np.float64), [1.5, -2.0, np.inf])


def test_cuda_bfloat16_on_a_cupy_without_it_raises_naming_what_to_install(stand_in_cupy, monkeypatch):
    class OldCupyArray:
        def view(self, dtype):
            raise TypeError(f"Unsupported dtype {dtype}")

    monkeypatch.setattr(stand_in_cupy, "from_dlpack", lambda x: OldCupyArray())
    with pytest.raises(UnsupportedLeafError, match=r"found CuPy 13\.6\.0 \(install CuPy >= 14"):
        adopt(stand_in_cuda(torch.ones(2, dtype=torch.bfloat16)))


def test_cuda_tensor_with_the_conjugate_bit_is_refused_before_dlpack(stand_in_cupy, monkeypatch):
    monkeypatch.setattr(stand_in_cupy, "from_dlpack", lambda x: pytest.fail("reached DLPack"))
    with pytest.raises(UnsupportedLeafError, match="conjugate bit"):
        adopt(stand_in_cuda(torch.ones(2, dtype=torch.complex64).conj()))


def test_cuda_tensor_without_cupy_raises_naming_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # makes `import cupy` fail
    with pytest.raises(UnsupportedLeafError, match="pip install cupy"):
        adopt(stand_in_cuda(torch.ones(2)))


def test_launch_stream_uses_pytorchs_current_stream(stand_in_cupy, monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device: asked.append(device) or types.SimpleNamespace(cuda_stream=4242))
    t = stand_in_cuda(torch.ones(2))
    assert isinstance(arrays.launch_stream(t), stand_in_cupy.cuda.ExternalStream)
    assert asked == [t.device] and stand_in_cupy.streams == [(4242, t.device.index)]
