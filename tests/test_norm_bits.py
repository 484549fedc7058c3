"""Every front end gives the same norm bits, and names the same leaf.

The same random gradients (many leaves, every floating dtype mixed, empty,
0-d, transposed and sliced leaves, values near float64's underflow and
overflow, NaN and inf) go to every front end that takes a norm: a tree
(``gf.global_norm``, ``gf.clip_grad_norm_``), a tensor list
(``gpuflat.torch.get_total_norm``, ``clip_grad_norm_``), the compiled
drop-in's operator, ``gpuflat.distributed`` on one rank and a resident
model, on every backend that runs without a GPU, and on the CUDA path over
the CuPy and PyTorch stand-ins. Each must return the very bits the tree
returns for orders 1, 2, inf and 3, and, with ``error_if_nonfinite``, name
the same first leaf holding NaN or inf. The host library and the emulated
kernels follow one order (kernels/norms.cu), so they also give each other's
bits; NumPy has its own.

A resident model holds every leaf in C order, so it is compared with the
tree of the same values held in C order: a transposed leaf is summed in
memory order, the order its memory holds.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import gpuflat as gf
import gpuflat.torch as gft
from gpuflat import distributed as gfd
from gpuflat._src import tensor_table
from gpuflat._src.backends import get_backend
from gpuflat._src.layout import ITEM

from conftest import BACKENDS, BF16, DTYPES, cast

ORDS = [1.0, 2.0, math.inf, 3.0]
CASES = 24
# A leaf's length: around one and two chunks of ITEM elements, and small ones.
LENGTHS = [0, 1, 5, 31, 257, ITEM - 1, ITEM + 3, 2 * ITEM + 17]
# Magnitudes: ordinary, near float64's underflow and overflow (the squares of
# 1e-160 are subnormal, those of 1e150 near float64's largest).
SCALES = [1.0, 1e-3, 1e4]
EXTREME_SCALES = [1e-160, 1e150]
HUGE = 1e308  # a max_norm no norm here reaches: clipping scales nothing


def _leaf(rng, dtype):
    """One random leaf of ``dtype``: 0-d, empty, 1-D, transposed or sliced."""
    kind = rng.choice(["0-d", "1-d", "1-d", "transposed", "sliced"])
    n = int(rng.choice(LENGTHS))
    wide = dtype.itemsize >= 8 and dtype != np.complex64
    scale = float(rng.choice(SCALES + (EXTREME_SCALES if wide else [])))
    if kind == "0-d":
        shape, make = (), lambda s: s
    elif kind == "1-d":
        shape, make = (n,), lambda s: s
    elif kind == "transposed":
        rows = int(rng.integers(1, 70))
        shape, make = (rows, max(1, n // rows)), lambda s: s
    else:
        shape, make = (2 * max(1, n // 3) + 1,), lambda s: s[1::2]
    real = rng.standard_normal(shape) * scale
    if dtype.kind == "c":
        real = real + 1j * rng.standard_normal(shape) * scale
        values = np.asarray(real).astype(dtype)
    else:
        values = cast(real, dtype)
    if kind == "transposed":
        values = np.ascontiguousarray(values).T
    return make(values)


def gradient_case(seed, kinds=DTYPES):
    """(leaves of ``kinds``, index of the first leaf holding NaN or inf or
    None): a float64 leaf always among them, so PyTorch's drop-ins return
    float64 too."""
    rng = np.random.default_rng(seed)
    dtypes = [np.dtype(np.float64)] + [kinds[i] for i in rng.integers(0, len(kinds), int(rng.integers(1, 10)))]
    rng.shuffle(dtypes)
    leaves = [_leaf(rng, d) for d in dtypes]
    bad = None
    if seed % 3 == 0:
        holders = [i for i, a in enumerate(leaves) if a.size]
        for i in sorted(rng.choice(holders, size=min(2, len(holders)), replace=False)):
            flat = leaves[i].reshape(-1) if leaves[i].flags.c_contiguous else None
            if flat is None:
                leaves[i] = leaves[i].copy()  # a strided leaf's copy keeps its shape; write it in C order
                flat = leaves[i].reshape(-1)
            flat[int(rng.integers(0, flat.size))] = rng.choice([np.nan, np.inf, -np.inf])
            bad = i if bad is None else bad
    return leaves, bad


def bits(x):
    return np.asarray(x, np.float64).tobytes()


def _torch_tensor(a):
    """``a``'s memory as a CPU tensor of its dtype, strides kept."""
    if BF16 is not None and a.dtype == BF16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def named_index(message):
    """The leaf index a non-finite error names, whatever the front end's path format."""
    found = re.search(r"\bg(\d+)\b|\[(\d+)\]", message)  # 'g3' of a dict or module, [3] of a list
    assert found, message
    return int(found.group(1) or found.group(2))


def _nonfinite_leaf(call):
    with pytest.raises((gf.NonFiniteError, RuntimeError)) as caught:
        call()
    return named_index(str(caught.value))


# ---------------------------------------------------------------- the front ends, each on a backend

def tree_norm(leaves, p, backend):
    return gf.global_norm(list(leaves), p, backend=backend)


def tree_clip(leaves, p, backend, error=False):
    copies = [a.copy(order="K") for a in leaves]
    return gf.clip_grad_norm_(copies, HUGE, p, backend=backend, error_if_nonfinite=error)


def distributed_norm(leaves, p, backend, error=False):
    return gfd.global_norm(list(leaves), p, backend=backend, error_if_nonfinite=error)


def distributed_clip(leaves, p, backend, error=False):
    copies = [a.copy(order="K") for a in leaves]
    return gfd.clip_grad_norm_(copies, HUGE, p, backend=backend, error_if_nonfinite=error)


def tensors_of(leaves):
    return [_torch_tensor(a) for a in leaves]


def tensor_list_norm(leaves, p, backend):
    with tensor_table.serve_with(get_backend(backend)):
        return gft.get_total_norm(tensors_of(leaves), p).numpy()


def tensor_list_clip(leaves, p, backend, error=False):
    params = [torch.nn.Parameter(torch.zeros(a.shape, dtype=_torch_tensor(a).dtype)) for a in leaves]
    for q, a in zip(params, leaves):
        q.grad = _torch_tensor(a.copy(order="K"))
    with tensor_table.serve_with(get_backend(backend)):
        return gft.clip_grad_norm_(params, HUGE, p, error_if_nonfinite=error).numpy()


def compiled_operator_norm(leaves, p, backend):
    # The operator the compiled drop-in calls: a float64 norm, whatever the dtypes.
    with tensor_table.serve_with(get_backend(backend)):
        return torch.ops.gpuflat.total_norm(tensors_of(leaves), p).numpy()


def dense(a):
    """Whether ``a`` fills one dense block of memory: what a parameter of the flat optimizers may be."""
    return a.flags.c_contiguous or a.flags.f_contiguous


def optimizer_norm(leaves, p, backend):
    # A flat optimizer's norm of its parameters' gradients (last_grad_norm),
    # each gradient laid out like its parameter, transposed ones too.
    grads = [_torch_tensor(a.copy(order="K")) for a in leaves]
    params = [torch.nn.Parameter(g.clone()) for g in grads]
    for q, g in zip(params, grads):
        q.grad = g
    opt = gft.AdamW(params, max_norm=HUGE, norm_type=p)
    with tensor_table.serve_with(get_backend(backend)):
        opt.step()
    return opt.last_grad_norm.numpy()


def resident_model(leaves, backend):
    r = gf.resident({f"g{i}": np.zeros(a.shape, a.dtype) for i, a in enumerate(leaves)}, backend=backend)
    for i, a in enumerate(leaves):
        r.grads[f"g{i}"][...] = a
    return r


def c_order(leaves):
    return [np.ascontiguousarray(a) for a in leaves]


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", range(CASES))
def test_every_front_end_returns_the_trees_bits(seed, backend):
    leaves, _ = gradient_case(seed)
    for p in ORDS:
        want = bits(tree_norm(leaves, p, backend))
        got = {
            "tree clip": tree_clip(leaves, p, backend),
            "gfd global_norm": distributed_norm(leaves, p, backend),
            "gfd clip": distributed_clip(leaves, p, backend),
            "tensor list get_total_norm": tensor_list_norm(leaves, p, backend),
            "tensor list clip": tensor_list_clip(leaves, p, backend),
            "compiled operator": compiled_operator_norm(leaves, p, backend),
        }
        for name, value in got.items():
            assert bits(value) == want, (name, p, float(np.asarray(value)), float(np.frombuffer(want)[0]))
        real = [a for a in leaves if (a.dtype.kind == "f" or a.dtype.name == "bfloat16") and dense(a)]  # its params
        assert bits(optimizer_norm(real, p, backend)) == bits(tree_norm(real, p, backend)), ("AdamW", p)
        contiguous = c_order(leaves)
        want_c = bits(tree_norm(contiguous, p, backend))
        r = resident_model(leaves, backend)
        got = {"tree of the resident's grads": tree_norm(list(r.grads.values()), p, backend),
               "resident grad_norm": r.grad_norm(p), "resident per_leaf total": r.grad_norm(p, per_leaf=True)[0],
               "resident clip": r.clip_grad_norm_(HUGE, p)}  # last: a non-finite norm makes the gradients NaN
        for name, value in got.items():
            assert bits(value) == want_c, (name, p)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seed", [s for s in range(CASES) if s % 3 == 0])
def test_every_front_end_names_the_same_first_nonfinite_leaf(seed, backend):
    leaves, bad = gradient_case(seed)
    assert bad is not None
    for p in (2.0, math.inf):
        named = {
            "tree": _nonfinite_leaf(lambda: tree_clip(leaves, p, backend, error=True)),
            "gfd norm": _nonfinite_leaf(lambda: distributed_norm(leaves, p, backend, error=True)),
            "gfd clip": _nonfinite_leaf(lambda: distributed_clip(leaves, p, backend, error=True)),
            "tensor list": _nonfinite_leaf(lambda: tensor_list_clip(leaves, p, backend, error=True)),
            "resident": _nonfinite_leaf(lambda: resident_model(leaves, backend).clip_grad_norm_(
                HUGE, p, error_if_nonfinite=True)),
        }
        assert set(named.values()) == {bad}, (p, named)


@pytest.mark.parametrize("seed", range(CASES))
def test_the_host_library_and_the_emulated_kernels_give_each_others_bits(seed):
    leaves, _ = gradient_case(seed)
    for p in ORDS:
        assert bits(tree_norm(leaves, p, "host")) == bits(tree_norm(leaves, p, "emulated")), p
        r_host, r_emulated = resident_model(leaves, "host"), resident_model(leaves, "emulated")
        assert bits(r_host.grad_norm(p)) == bits(r_emulated.grad_norm(p)), p


def test_the_total_does_not_depend_on_how_the_chunks_fall_into_leaves():
    # kernels/norms.cu's order sums the chunks' partials whatever leaf each
    # belongs to: leaves of exactly ITEM elements give the bits of one leaf
    # of all of them (the same chunks), on the host and the emulated device.
    rng = np.random.default_rng(5)
    whole = rng.standard_normal(7 * ITEM).astype(np.float32)
    pieces = [whole[k * ITEM : (k + 1) * ITEM] for k in range(7)]
    for backend in ("host", "emulated"):
        for p in ORDS:
            assert bits(tree_norm([whole], p, backend)) == bits(tree_norm(pieces, p, backend)), (backend, p)


def test_the_finisher_sums_many_items_partials_in_the_order():
    # The finisher takes each thread's partials several at a time. Thread 0
    # of its 256 sums items 0, 256, 512, ... from 0.0 in that order: 1.0,
    # then 2**-53 nine times, each of which rounds away (to even) against
    # 1.0, so the 1-norm is exactly 1.0; any order adding two of the small
    # ones first gives more. Every other item is 0.
    tiny = [np.array([1.0 if k == 0 else 2.0**-53 if k % 256 == 0 else 0.0]) for k in range(2_500)]
    for backend in ("host", "emulated"):
        assert float(tree_norm(tiny, 1.0, backend)) == 1.0, backend
    # A tree of thousands of mixed leaves: the host library's bits (one
    # partial at a time), per-leaf norms and the first non-finite leaf too.
    rng = np.random.default_rng(21)
    dtypes = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(np.float64), np.dtype(np.complex64)]
    leaves = [cast(rng.standard_normal(int(rng.choice([0, 1, 7, 100, 300, ITEM + 5]))), dtypes[i % len(dtypes)])
              for i in range(6_000)]
    leaves.append(cast(rng.standard_normal(()), np.float32))  # 0-d
    leaves.append(cast(rng.standard_normal((40, 30)), np.float32).T)  # transposed
    for p in ORDS:
        assert bits(tree_norm(leaves, p, "host")) == bits(tree_norm(leaves, p, "emulated")), p
    tree = {f"g{i:05d}": a for i, a in enumerate(leaves)}
    plan, trainables = gf.plan(tree), gf.trainables(tree)
    results = {name: get_backend(name).norms(plan, trainables, 2.0, True) for name in ("host", "emulated")}
    assert bits(results["host"].per_leaf) == bits(results["emulated"].per_leaf)
    bad = [i for i, a in enumerate(leaves) if a.size][-3]
    leaves[bad].reshape(-1)[0] = np.nan
    tree = {f"g{i:05d}": a for i, a in enumerate(leaves)}
    for name in ("host", "emulated"):
        assert int(get_backend(name).norms(gf.plan(tree), gf.trainables(tree), 2.0, False).first_nonfinite) == bad


@pytest.mark.parametrize("seed", range(0, CASES, 2))
def test_the_one_launch_norm_gives_the_two_launches_bits(seed):
    # Without per-leaf norms the emulated kernels take one launch
    # (gpuflat_norm_one: the block drawing the last ticket adds every
    # partial); with them, two (the partials, then the finisher). The total,
    # the unrooted total and the first non-finite leaf are the same bits
    # either way, and the host library's, whichever block finishes (grids
    # of 1 to 3 blocks), for the random mixed trees (empty, 0-d, strided,
    # non-finite leaves, every dtype) and for thousands of small leaves
    # (several partials per finishing thread, which it loads in batches).
    from gpuflat._src.backends.cuda import CudaBackend
    from gpuflat._src.backends.cuda_runtime import EmulatedRuntime

    leaves, bad = gradient_case(seed)
    if seed % 4 == 0:
        rng = np.random.default_rng(seed)
        leaves = leaves + [cast(rng.standard_normal(int(n)), DTYPES[i % len(DTYPES)])
                           for i, n in enumerate(rng.choice([0, 1, 3, 100], 2_200))]
    tree = {f"g{i:05d}": a for i, a in enumerate(leaves)}
    plan, trainables = gf.plan(tree), gf.trainables(tree)
    host = get_backend("host")
    for p in ORDS:
        want = host.norms(plan, trainables, p, True)
        for grid in (1, 2, 3):
            be = CudaBackend(EmulatedRuntime(), grid=grid)
            one = be.norms(plan, trainables, p, False)
            assert be.stats.launches == 1
            two = be.norms(plan, trainables, p, True)
            assert be.stats.launches == 3
            for r in (one, two):
                assert bits(r.total) == bits(want.total), (p, grid)
                assert bits(r.power_sum) == bits(want.power_sum), (p, grid)
                assert int(r.first_nonfinite) == int(want.first_nonfinite) == (-1 if bad is None else bad)
            assert bits(two.per_leaf) == bits(want.per_leaf), (p, grid)


def test_a_compiled_clip_returns_the_trees_bits():
    leaves, _ = gradient_case(1)
    params = [torch.nn.Parameter(torch.zeros(a.shape, dtype=_torch_tensor(a).dtype)) for a in leaves]
    for q, a in zip(params, leaves):
        q.grad = _torch_tensor(a.copy(order="K"))
    torch._dynamo.reset()

    def clipped(params):
        return gft.clip_grad_norm_(params, HUGE, 2.0)

    got = torch.compile(clipped, backend="eager")(params)
    assert bits(got.numpy()) == bits(tree_norm(leaves, 2.0, None))


# ---------------------------------------------------------------- the CUDA path, on the stand-ins

@pytest.fixture
def stand_in_cuda(monkeypatch):
    """The CuPy and PyTorch CUDA stand-ins (tests/cupy_stand_in.py,
    tests/torch_cuda_stand_in.py): the CUDA backend's tables and launches,
    its kernels run by the host emulator."""
    import cupy_stand_in
    import torch_cuda_stand_in as tcs

    cp = cupy_stand_in.install(monkeypatch)
    stand_in = tcs.install(monkeypatch, cp)
    with stand_in:
        yield cp, tcs


@pytest.mark.parametrize("seed", [0, 1, 2, 5])
def test_cuda_front_ends_return_the_emulated_trees_bits(seed, stand_in_cuda):
    cp, tcs = stand_in_cuda
    # The CuPy stand-in has no bfloat16, as CuPy before 14 has none.
    leaves, bad = gradient_case(seed, [d for d in DTYPES if d != BF16])
    leaves = c_order(leaves)
    model = torch.nn.Module()
    for i, a in enumerate(leaves):
        model.register_parameter(f"g{i}", tcs.parameter(torch.zeros(a.shape, dtype=_torch_tensor(a).dtype)))
        getattr(model, f"g{i}").grad = tcs.cuda(_torch_tensor(a.copy()))
    r = gf.resident(model)  # the gradients copied into its buffers
    for p in ORDS:
        want = bits(tree_norm(leaves, p, "emulated"))
        got = {"tree of CuPy arrays": gf.global_norm([cp.asarray(a) for a in leaves], p).get(),
               "tensor list": gft.get_total_norm([tcs.cuda(_torch_tensor(a)) for a in leaves], p),
               "resident": r.grad_norm(p)}
        for name, value in got.items():
            if isinstance(value, torch.Tensor):
                with torch._C.DisableTorchFunction():
                    value = value.detach().numpy()
            assert bits(value) == want, (name, p)
    if bad is not None:
        named = {"tree": _nonfinite_leaf(lambda: gf.clip_grad_norm_([cp.asarray(a) for a in leaves], HUGE,
                                                                     error_if_nonfinite=True)),
                 "resident": _nonfinite_leaf(lambda: r.clip_grad_norm_(HUGE, error_if_nonfinite=True))}
        assert set(named.values()) == {bad}, named


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_rank_owning_some_leaves_returns_the_bits_of_the_tree_of_those(backend):
    leaves, _ = gradient_case(4)
    grads = {f"g{i}": a for i, a in enumerate(leaves)}
    owned = {f"['g{i}']" for i in range(0, len(leaves), 2)}
    mine = [a for i, a in enumerate(leaves) if i % 2 == 0]
    for p in ORDS:
        assert bits(gfd.global_norm(grads, p, owned=owned, backend=backend)) == bits(tree_norm(mine, p, backend)), p
    # A NaN in a leaf the rank does not count is not its concern; one it counts is named.
    grads["g1"] = np.full(3, np.nan)
    assert math.isfinite(float(gfd.global_norm(grads, owned=owned, backend=backend, error_if_nonfinite=True)))
    grads["g2"] = np.full(3, np.inf)
    assert _nonfinite_leaf(lambda: gfd.global_norm(grads, owned=owned, backend=backend, error_if_nonfinite=True)) == 2
