"""gpuflat._src.tensor_facts: the native reader against the Python one, fact by
fact, on every kind of tensor and parameter a training loop hands over; and
what it leaves to Python."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from gpuflat._src import tensor_facts
from gpuflat._src.tensor_facts import CONTIGUOUS, DTYPES, LAZY_VIEW


@pytest.fixture(params=["native", "python"])
def reader(request, monkeypatch):
    """Each test runs on the native library, then on the Python fallback."""
    if request.param == "native":
        if not tensor_facts.available():
            pytest.skip(f"the native reader does not build here: {tensor_facts.unavailable_reason()}")
    else:
        monkeypatch.setattr(tensor_facts, "_library", lambda: None)
    return request.param


def expected(tensors):
    """The facts, one tensor at a time, from PyTorch's own accessors."""
    return [[t.data_ptr(), t.numel(), code(t)] for t in tensors]


def code(t):
    # The code word's parts are the module's (the C++ reads them from the
    # header it writes); each fact is PyTorch's.
    return (DTYPES.index(t.dtype) | (CONTIGUOUS if t.is_contiguous() else 0)
            | (LAZY_VIEW if t.is_conj() or t.is_neg() else 0) | tensor_facts._device_code(t.device))


def every_kind():
    base = torch.arange(24.0).reshape(2, 3, 4)
    return [base, base.transpose(0, 2), base[:, 1], base[..., ::2], torch.tensor(2.5), torch.zeros(0),
            torch.zeros(3, 0), base.expand(2, 2, 3, 4), torch.zeros(2, 3, 4, 5).to(memory_format=torch.channels_last),
            torch.nn.Parameter(torch.ones(3)), torch.ones(2, dtype=torch.complex64).conj(),
            torch.ones(2, dtype=torch.complex64).conj().imag, torch.empty(3, device="meta")] + [torch.ones(2, dtype=d) for d in (
                torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                torch.int64, torch.int8, torch.bool, torch.uint8)]


def test_of_tensors_reads_each_fact(reader):
    tensors = every_kind()
    assert tensor_facts.of_tensors(tensors).tolist() == expected(tensors)


def test_the_contiguity_bit_is_set_for_contiguous_tensors_only(reader):
    a = torch.zeros(3, 4)
    codes = tensor_facts.of_tensors([a, a.t(), a[:, :2], a[1]])[:, 2]
    assert [bool(c & CONTIGUOUS) for c in codes] == [True, False, False, True]


def test_gradients_skips_parameters_without_one_and_returns_the_gradient_objects(reader):
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((3,), (1,), (2, 2), (2,))]
    params[0].grad, params[2].grad = torch.ones(3), torch.ones(2, 2).t()
    grads, facts = tensor_facts.gradients(params)
    assert len(grads) == 2 and grads[0] is params[0].grad and grads[1] is params[2].grad
    assert facts.tolist() == expected(grads)
    assert tensor_facts.gradients([params[1]])[1].shape == (0, 3)


def test_anything_without_plain_facts_gives_none(reader):
    sparse = torch.zeros(3).to_sparse()
    assert tensor_facts.of_tensors([torch.zeros(2), sparse]) is None
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = sparse
    grads, facts = tensor_facts.gradients([p])
    assert grads == [sparse] and facts is None


def test_a_parameter_subclass_is_read_through_its_own_grad(reader):
    class Doubled(torch.nn.Parameter):
        @property
        def grad(self):  # what Python sees is what counts
            g = super().grad
            return None if g is None else g * 2

        @grad.setter
        def grad(self, value):
            torch.nn.Parameter.grad.__set__(self, value)

    p = Doubled(torch.zeros(2))
    p.grad = torch.ones(2)
    grads, facts = tensor_facts.gradients([p])
    assert grads[0].tolist() == [2.0, 2.0] and facts.tolist() == expected(grads)


def test_a_plain_subclass_tensor_is_read_and_a_wrapper_is_not(reader):
    class Tagged(torch.Tensor):
        pass

    tagged = torch.ones(3).as_subclass(Tagged)
    assert tensor_facts.of_tensors([tagged]).tolist() == expected([tagged])

    class Wrapper(torch.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            raise NotImplementedError

    wrapper = torch.Tensor._make_subclass(Wrapper, torch.ones(2))
    assert tensor_facts.of_tensors([wrapper]) is None


def test_a_tuple_or_a_non_leaf_is_read_as_python_would(reader):
    a = torch.ones(2)
    assert tensor_facts.of_tensors((a, a.t())).tolist() == expected([a, a])
    leaf = torch.ones(2, requires_grad=True)
    non_leaf = leaf * 2
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        grads, facts = tensor_facts.gradients([non_leaf])
    assert grads == [] and facts.shape == (0, 3)
    assert any("non-leaf" in str(w.message) for w in seen)  # PyTorch's own warning, as p.grad gives


def test_ten_thousand_gradients_in_one_read(reader):
    params = [torch.nn.Parameter(torch.empty(5, dtype=torch.float16)) for _ in range(10_000)]
    for p in params[::3]:
        p.grad = torch.empty(5, dtype=torch.float16)
    grads, facts = tensor_facts.gradients(params)
    assert len(grads) == 3334 and all(g is p.grad for g, p in zip(grads, params[::3]))
    assert np.array_equal(facts, np.array(expected(grads), np.int64))


def test_the_device_and_lazy_views_are_coded(reader):
    plain, conj, meta = torch.ones(2, dtype=torch.complex64), torch.ones(2, dtype=torch.complex64).conj(), torch.ones(2, device="meta")
    facts = tensor_facts.of_tensors([plain, conj, meta])
    assert [bool(c & LAZY_VIEW) for c in facts[:, 2]] == [False, True, False]
    keys = tensor_facts.device_keys(facts)
    assert keys[0] == keys[1] != keys[2] and keys[0] == tensor_facts.device_keys(tensor_facts.in_python([plain]))[0]
    assert [DTYPES[c] for c in tensor_facts.dtype_codes(facts)] == [torch.complex64, torch.complex64, torch.float32]


def test_the_code_word_is_written_once_in_python():
    # The C++ takes every part of the code word from the header written from
    # the module's constants, and spells out none of them.
    import re

    from gpuflat._src.kernel_loader import kernel_dir

    source = (kernel_dir() / "host" / "tensor_facts.cpp").read_text()
    written = set(re.findall(r"^#define (GF_FACTS_\w+) ", tensor_facts._header(), re.M))
    assert f'#include "{tensor_facts.HEADER}"' in source
    assert set(re.findall(r"GF_FACTS_\w+", source)) == written
    code = source[source.index("constexpr int64_t CONTIGUOUS"):source.index("bool plain(")]
    assert not re.search(r"<<\s*\d|\?\s*\d", code)
    # The device code is one number per device, its kind below the index.
    codes = {tensor_facts._device_code(torch.device(d)) for d in ("cpu", "cuda:0", "cuda:1", "meta")}
    assert len(codes) == 4 and all(c >> tensor_facts._DEVICE_SHIFT << tensor_facts._DEVICE_SHIFT == c for c in codes)
    assert max(DTYPES.index(d) for d in DTYPES) < CONTIGUOUS < LAZY_VIEW < 1 << tensor_facts._DEVICE_SHIFT
