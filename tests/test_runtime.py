"""The runtimes. ``CupyRuntime`` and ``CudaBackend(CupyRuntime(...))`` run here
for real against a contract check of CuPy (tests/cupy_stand_in.py): not a
GPU, but every call the runtime makes is held to CuPy's calling contract
(module bytes, device, stream ordering, argument types, whole-warp blocks),
and the kernels run on the host emulator, so results are checked against
NumPy. Then subnormals through the public API on the host backends.
"""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest

import gpuflat as gf
from gpuflat._src import kernel_loader as kl
from gpuflat._src.backends.cuda import CudaBackend
from gpuflat._src.arrays import external_stream
from gpuflat._src.backends.cuda_runtime import CupyRuntime, EmulatedRuntime

import cupy_stand_in
from conftest import BF16, DTYPES, assert_bits_equal, cast, exact_norm, random_array, ref_flatten, torch_scaled


@pytest.fixture
def cupy(monkeypatch):
    """The contract check as ``cupy``: device 0 is sm_90, device 1 sm_80."""
    module = cupy_stand_in.make_cupy(("90", "80"))
    monkeypatch.setitem(sys.modules, "cupy", module)
    return module


def tree_of(rng, dtypes, device, cupy):
    """(host leaves, device leaves sharing their memory, plan)."""
    host = [random_array(rng, shape, dtype) for shape, dtype in zip([(3, 5), (0,), (), (70,)], dtypes)]
    plan = gf.plan({f"l{i}": a for i, a in enumerate(host)})
    return host, [cupy.on_device(a, device) for a in host], plan


# ---------------------------------------------------------------- the GPU path, executed


def test_the_gpu_loads_the_checked_cubin_for_its_architecture(cupy):
    for device, arch in ((0, "sm_90"), (1, "sm_80")):
        rt = CupyRuntime(device)
        rt.launch(kl.SCALE_NAME, 1, 256, scale_nothing_args(rt))
        loads = [e for e in cupy.events if e.kind == "load" and e.device == device]
        assert [e.detail for e in loads] == [arch]
    assert not hasattr(cupy, "RawModule")  # CuPy's RawModule would add -ftz=true


def scale_nothing_args(rt):
    """Arguments of the scale kernel over zero items."""
    zeros = rt.upload(np.zeros(32, np.int64))
    total = rt.upload(np.zeros((), np.float64))
    return [zeros, np.int64(0), zeros, total, np.float64(1), np.float64(1e-6)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_backend_on_device_1_matches_numpy(cupy, dtype):
    rng = np.random.default_rng(1)
    host, leaves, plan = tree_of(rng, [dtype] * 4, 1, cupy)
    with cupy.cuda.Device(0):  # the caller's current device is not the tree's
        be = CudaBackend(CupyRuntime(1))
        flat = be.runtime.empty(plan.size, plan.dtype)
        be.gather(plan, [[a] for a in leaves], flat)
        got = be.to_host(flat)
        for leaf, a in zip(plan.leaves, host):
            assert_bits_equal(got[leaf.offset:leaf.offset + leaf.size], cast(a.ravel(), plan.dtype))
        for ord in (1, 2, math.inf):
            r = be.norms(plan, leaves, ord, per_leaf=True)
            ref = exact_norm(host, ord)
            assert float(be.to_host(r.total)) == pytest.approx(ref, rel=1e-12, abs=1e-300)
    kinds = {(e.kind, e.device) for e in cupy.events}
    assert {("empty", 1), ("upload", 1), ("load", 1), ("launch", 1)} <= kinds
    assert {e.device for e in cupy.events} == {1}


def test_scatter_and_clip_on_device_1(cupy):
    rng = np.random.default_rng(2)
    host, leaves, plan = tree_of(rng, [np.float32, np.float64, np.float32, np.complex64], 1, cupy)
    before = [a.copy() for a in host]
    be = CudaBackend(CupyRuntime(1))
    r = be.norms(plan, leaves, 2, per_leaf=False)
    be.clip_(plan, leaves, r.total, 0.5, 1e-6)
    coef = min(1.0, 0.5 / (exact_norm(before) + 1e-6))
    for a, b in zip(host, before):
        np.testing.assert_allclose(a, cast(b * coef, b.dtype), rtol=1e-6)
    values = np.arange(plan.size, dtype=plan.dtype)
    be.scatter(plan, cupy.on_device(values, 1), leaves)
    for leaf, a in zip(plan.leaves, host):
        np.testing.assert_array_equal(a.ravel(), cast(values[leaf.offset:leaf.offset + leaf.size], a.dtype))


def test_leaves_on_two_devices_are_refused_before_any_launch(cupy):
    rng = np.random.default_rng(3)
    host, leaves, plan = tree_of(rng, [np.float32] * 4, 0, cupy)
    leaves[3] = cupy.on_device(host[3], 1)
    be = CudaBackend(CupyRuntime(0))
    out = be.runtime.empty(plan.size, plan.dtype)
    with pytest.raises(ValueError, match="device 1; this runtime launches on device 0"):
        be.gather(plan, [[a] for a in leaves], out)
    assert not [e for e in cupy.events if e.kind == "launch"]


def test_tables_uploaded_on_one_stream_serve_another(cupy):
    rng = np.random.default_rng(4)
    host, leaves, plan = tree_of(rng, [np.float64] * 4, 0, cupy)
    be = CudaBackend(CupyRuntime(0))
    with cupy.cuda.Stream():
        first = be.norms(plan, leaves, 2, per_leaf=True)  # uploads the plan's tables
    with external_stream(cupy, 0xBEEF00):  # e.g. PyTorch's current stream
        again = be.norms(plan, leaves, 2, per_leaf=True)  # reuses them, no upload
        launches = [e for e in cupy.events if e.kind == "launch" and e.stream.ptr == 0xBEEF00]
        assert len(launches) == 2
        assert_bits_equal(be.to_host(again.per_leaf), be.to_host(first.per_leaf))
    assert float(be.to_host(again.total)) == pytest.approx(exact_norm(host), rel=1e-15)


def test_uploads_and_launches_share_the_callers_stream(cupy):
    rng = np.random.default_rng(5)
    _, leaves, plan = tree_of(rng, [np.float32] * 4, 0, cupy)
    be = CudaBackend(CupyRuntime(0))
    with external_stream(cupy, 0xABC00):
        be.norms(plan, leaves, 2, per_leaf=False)
    used = {e.stream.ptr for e in cupy.events if e.kind in ("upload", "launch")}
    assert used == {0xABC00}


@pytest.mark.parametrize("block", [0, 48, 1056, 2048])
def test_blocks_must_be_whole_warps(cupy, block):
    rt = CupyRuntime(0)
    with pytest.raises(ValueError, match=f"block of {block} threads"):
        rt.launch(kl.SCALE_NAME, 1, block, [])
    with pytest.raises(ValueError, match="whole warps"):
        CupyRuntime(0, block=block)
    with pytest.raises(ValueError, match="whole warps"):
        EmulatedRuntime(block=block)


@pytest.mark.filterwarnings("error::DeprecationWarning")
def test_foreign_streams_are_wrapped_as_cupy_14_wants(cupy):
    # CuPy 14 deprecates ExternalStream (the stand-in warns as it does, and
    # the warning is an error here): a foreign stream, and each stream the
    # runtime later asks whether it captures, goes through Stream.from_external.
    rng = np.random.default_rng(6)
    _, leaves, plan = tree_of(rng, [np.float32] * 4, 0, cupy)
    be = CudaBackend(CupyRuntime(0))
    with cupy.cuda.Stream():
        be.norms(plan, leaves, 2, per_leaf=False)
    with external_stream(cupy, 0xABC00, 0) as stream:
        assert isinstance(stream, cupy.cuda.Stream) and stream.device_id == 0
        be.norms(plan, leaves, 2, per_leaf=False)
    rt = be.runtime
    rt.release(rt.upload_table(np.arange(3)))  # asks each stream that used a table whether it captures
    assert set(rt._streams) == {0, 0x100, 0xABC00}
    with pytest.warns(DeprecationWarning, match="Stream.from_external"):
        cupy.cuda.ExternalStream(0xABC00)


def test_on_cupy_13_a_foreign_stream_is_an_external_stream(cupy, monkeypatch):
    monkeypatch.delattr(cupy.cuda.Stream, "from_external")
    with pytest.warns(DeprecationWarning):
        stream = external_stream(cupy, 0xABC00, 1)
    assert isinstance(stream, cupy.cuda.ExternalStream) and (stream.ptr, stream.device_id) == (0xABC00, 1)


def test_runtime_without_synchronize():
    # Nothing calls a bare device synchronisation: reads synchronise.
    assert not hasattr(CupyRuntime, "synchronize") and not hasattr(EmulatedRuntime, "synchronize")


# ---------------------------------------------------------------- the contract check can fail


def test_contract_refuses_foreign_module_bytes(cupy):
    module = cupy.cuda.function.Module()
    with pytest.raises(cupy.ContractError, match="not the project's NVRTC cubin for sm_90"):
        module.load(kl.device_cubin("sm_80", cupy_stand_in.RUNTIME_VERSION // 1000).cubin)


def loaded_kernel(cupy, name):
    module = cupy.cuda.function.Module()
    module.load(kl.device_cubin("sm_90", cupy_stand_in.RUNTIME_VERSION // 1000).cubin)
    return module.get_function(kl.device_cubin("sm_90", cupy_stand_in.RUNTIME_VERSION // 1000).lowered[name])


def test_contract_refuses_wrong_scalar_types_and_host_pointers(cupy):
    kernel = loaded_kernel(cupy, kl.SCALE_NAME)
    items, table = cupy.on_device(np.zeros(4, np.int64), 0), cupy.on_device(np.zeros(20, np.int64), 0)
    total = cupy.on_device(np.zeros((), np.float64), 0)
    good = (items, np.int64(0), table, total, np.float64(1), np.float64(1e-6))
    kernel((1,), (32,), good)
    for i, bad in [(1, np.int32(0)), (1, 0), (4, 1.0), (2, np.zeros(20, np.int64))]:
        with pytest.raises(cupy.ContractError, match=f"argument {i}"):
            kernel((1,), (32,), good[:i] + (bad,) + good[i + 1:])
    with pytest.raises(cupy.ContractError, match="whole warps"):
        kernel((1,), (48,), good)


def test_contract_refuses_a_launch_on_another_device(cupy):
    kernel = loaded_kernel(cupy, kl.SCALE_NAME)
    with cupy.cuda.Device(1), pytest.raises(cupy.ContractError, match="loaded on device 0"):
        kernel((1,), (32,), ())


def test_contract_refuses_a_table_read_before_its_copy_lands(cupy):
    with cupy.cuda.Stream():
        table = cupy.asarray(np.arange(4, dtype=np.int64))
    with cupy.cuda.Stream(), pytest.raises(cupy.ContractError, match="still in flight"):
        cupy.asnumpy(table)


# ---------------------------------------------------------------- subnormals, public API


def subnormal(dtype):
    """The smallest positive subnormal of ``dtype`` (of its parts if complex)."""
    real = np.dtype(dtype) if np.dtype(dtype).kind != "c" else np.dtype(np.dtype(dtype).char.lower())
    return np.array(1, np.uint16 if real.itemsize == 2 else np.uint32 if real.itemsize == 4 else np.uint64
                    ).view(real)[()]


def subnormal_leaf(dtype, n=9):
    dtype = np.dtype(dtype)
    tiny = subnormal(dtype)
    x = np.arange(1, n + 1).astype(np.float64) * (-1.0) ** np.arange(n)
    leaf = cast(x, dtype) if dtype.kind != "c" else np.zeros(n, dtype)
    if dtype.kind == "c":
        leaf.real = x
        leaf.imag = -x
    real_view = leaf.view(tiny.dtype)
    real_view[:] = real_view * tiny  # k times the smallest subnormal: exact, all subnormal
    return leaf


SUBNORMAL_DTYPES = [np.float16, np.float32, np.complex64] + ([BF16] if BF16 is not None else [])


@pytest.mark.parametrize("dtype", SUBNORMAL_DTYPES, ids=str)
def test_subnormals_survive_gather_and_scatter(backend, dtype):
    leaf = subnormal_leaf(dtype)
    assert (leaf.view(subnormal(dtype).dtype) != 0).all()
    tree = {"a": leaf, "b": leaf[::-2].copy()}
    flat, re = gf.destructure(tree, backend=backend)
    assert_bits_equal(flat, ref_flatten(tree))
    rebuilt = re(flat)
    for k in tree:
        assert_bits_equal(rebuilt[k], tree[k])


@pytest.mark.parametrize("dtype", SUBNORMAL_DTYPES, ids=str)
def test_subnormals_survive_widening_and_narrowing(backend, dtype):
    # A float64 leaf beside makes the flat buffer wider; the way back narrows.
    leaf = subnormal_leaf(dtype)
    tree = {"s": leaf, "w": np.array([1e-310, 2.5], np.float64)}
    flat, re = gf.destructure(tree, backend=backend)
    assert_bits_equal(flat, ref_flatten(tree))
    assert_bits_equal(re(flat)["s"], leaf)


@pytest.mark.parametrize("dtype", SUBNORMAL_DTYPES, ids=str)
def test_norms_of_subnormals(backend, dtype):
    leaf = subnormal_leaf(dtype)
    tree = {"s": leaf}
    for ord in (1, 2, math.inf):
        got = float(gf.global_norm(tree, ord, backend=backend))
        ref = exact_norm([leaf], ord)
        assert ref > 0 and got == pytest.approx(ref, rel=1e-12, abs=0), ord


@pytest.mark.parametrize("dtype", SUBNORMAL_DTYPES, ids=str)
def test_clipping_keeps_subnormals(backend, dtype):
    leaf = subnormal_leaf(dtype)
    big = np.full(4, 3.0, leaf.dtype)
    grads = {"s": leaf.copy(), "big": big.copy()}
    norm = float(gf.clip_grad_norm_(grads, max_norm=1.0, backend=backend))
    assert norm == pytest.approx(exact_norm([leaf, big]), rel=1e-12)
    assert_bits_equal(grads["s"], torch_scaled(leaf, min(1.0, 1.0 / (norm + 1e-6))))
    assert (grads["s"].view(subnormal(dtype).dtype) != 0).any()


def test_flatten_chooses_the_backend_from_every_gradient_of_a_tied_slot(cupy):
    # The first gradient of the tied slot is a NumPy array, the second a CuPy
    # one: taking the first alone would launch on host memory or copy silently.
    w = np.ones(3, np.float32)
    plan = gf.plan({"enc": w, "dec": w})
    grads = {"enc": np.ones(3, np.float32), "dec": cupy.on_device(np.ones(3, np.float32), 0)}
    with pytest.raises(TypeError, match=r"mixes NumPy and CuPy.*\['enc'\].*\['enc'\]"):
        gf.flatten(plan, grads)


@pytest.mark.parametrize("kinds, backend, error", [
    ("nnn", None, None),
    ("ccc", None, None),
    ("nnn", "cuda", r"backend 'cuda' works on CuPy arrays; leaf 'p0' is a numpy.ndarray"),
    ("ccc", "host", r"backend 'host' works on NumPy arrays; leaf 'p0' is a \w+\.ndarray"),
    ("ccn", None, r"mixes NumPy and CuPy arrays: leaf 'p2' is a NumPy array, leaf 'p0' is a CuPy array"),
])
def test_select_names_the_first_leaf_of_each_kind(cupy, kinds, backend, error):
    from gpuflat._src.backends.selection import host_default, select

    arrays = [np.ones(2) if k == "n" else cupy.on_device(np.ones(2), 0) for k in kinds]
    if error is None:
        assert select(backend, arrays, "p{}".format).name == ("cuda" if kinds[0] == "c" else host_default())
    else:
        with pytest.raises(TypeError, match=error):
            select(backend, arrays, "p{}".format)
