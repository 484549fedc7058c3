"""The host emulator of the CUDA kernels: built-ins, synchronisation, warp
primitives, argument passing, floating-point rounding and failure reporting.

Every test runs small kernels written here against NumPy references; all of
them are built into one library (one g++ run for the module).
"""
from __future__ import annotations

import ctypes
import platform
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from gpuflat._src import emulator, host_compiler
from gpuflat.errors import EmulatorBuildError, KernelError, UnknownKernelError

FULL = "0xffffffffu"

SOURCE = r"""
// Every thread records its coordinates.
__global__ void k_ids(unsigned* out) {
    const unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    out[4 * g + 0] = threadIdx.x;
    out[4 * g + 1] = blockIdx.x;
    out[4 * g + 2] = blockDim.x;
    out[4 * g + 3] = gridDim.x;
}

// Shared-memory tree sum for any block size: fold down to a power of two,
// then halve. Wrong without every __syncthreads.
__global__ void k_block_sum(const long long* in, long long* out) {
    __shared__ long long s[1024];
    const unsigned t = threadIdx.x, n = blockDim.x;
    s[t] = in[blockIdx.x * n + t];
    __syncthreads();
    unsigned p = 1;
    while (2 * p <= n) p *= 2;
    if (t < n - p) s[t] += s[t + p];
    __syncthreads();
    for (unsigned w = p / 2; w > 0; w >>= 1) {
        if (t < w) s[t] += s[t + w];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// Each thread reads what its neighbour wrote before the barrier.
__global__ void k_neighbour(long long* out) {
    __shared__ long long s[1024];
    const unsigned t = threadIdx.x, n = blockDim.x;
    s[t] = 3 * (long long)t + 1 + 10000 * (long long)blockIdx.x;
    __syncthreads();
    out[blockIdx.x * n + t] = s[(t + 1) % n];
}

// Shared memory read before it is written: the emulator fills it with 0xff
// bytes before every block (undefined values on a GPU).
__global__ void k_shared_unwritten(long long* out) {
    __shared__ long long s[64];
    out[blockIdx.x * blockDim.x + threadIdx.x] = s[threadIdx.x];
    __syncthreads();
    s[threadIdx.x] = 7;  // must not leak into the next block
}

template <class T>
__global__ void k_shfl(const T* in, T* out, int delta, int width) {
    const unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    out[g] = __shfl_down_sync(0xffffffffu, in[g], (unsigned)delta, width);
}

// A warp-shuffle tree sum of a 16-byte type.
__global__ void k_shfl_double2(const double* in, double* out) {
    const unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    double2 v = make_double2(in[g], -in[g]);
    for (int off = 16; off > 0; off >>= 1) {
        const double2 o = __shfl_down_sync(0xffffffffu, v, off);
        v.x += o.x;
        v.y += o.y;
    }
    if (threadIdx.x % 32 == 0) {
        out[2 * (g / 32)] = v.x;
        out[2 * (g / 32) + 1] = v.y;
    }
}

__global__ void k_any(const int* pred, int* any) {
    const unsigned g = blockIdx.x * blockDim.x + threadIdx.x;
    any[g] = __any_sync(0xffffffffu, pred[g]);
}

__global__ void k_args(long long a, unsigned long long b, int c, double d, float e,
                       const long long* p, unsigned long long* out) {
    unsigned e_bits;
    memcpy(&e_bits, &e, sizeof e_bits);
    out[0] = (unsigned long long)a;
    out[1] = b;
    out[2] = (unsigned long long)(long long)c;
    out[3] = (unsigned long long)__double_as_longlong(d);
    out[4] = e_bits;
    out[5] = (unsigned long long)p;
    out[6] = (unsigned long long)p[1];
}

// The math the kernels use, with CUDA's NaN rules for min and max.
__global__ void k_math(const double* in, double* out) {
    const double x = in[threadIdx.x], y = in[blockDim.x + threadIdx.x];
    double* o = out + 8 * threadIdx.x;
    o[0] = max(x, y);
    o[1] = min(x, y);
    o[2] = fabs(x);
    o[3] = hypot(x, y);
    o[4] = pow(fabs(x), 1.5);
    o[5] = sqrt(fabs(y));
    o[6] = isfinite(x) ? 1.0 : 0.0;
    o[7] = __longlong_as_double(__double_as_longlong(x) ^ (1ll << 63)) + (double)(max(-3, (int)threadIdx.x) + alignof(int4));
}

// One product and one sum, each rounded: never fused into an fma.
__global__ void k_mul_add(const float* a, const float* b, const float* c, float* out, long long n) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a[i] * b[i] + c[i];
}

__global__ void k_trap(int* out, int bad_block) {
    if ((int)blockIdx.x == bad_block && threadIdx.x == 5) __trap();
    __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

__global__ void k_assert(const int* x) { assert(x[threadIdx.x] >= 0); }

// Lane 0 waits at a warp shuffle while the rest of the warp waits for the block.
__global__ void k_deadlock(int* out) {
    if (threadIdx.x == 0) out[0] = __shfl_down_sync(0xffffffffu, 1, 1);
    else __syncthreads();
}

// Threads that returned no longer hold back __syncthreads, as on the GPU.
__global__ void k_early_exit(int* out) {
    if (threadIdx.x >= 10) return;
    __syncthreads();
    out[threadIdx.x] = 1;
}
"""

SHFL_TYPES = {"int": np.int32, "float": np.float32, "double": np.float64}
NAMES = [
    "k_ids", "k_block_sum", "k_neighbour", "k_shared_unwritten", "k_shfl_double2", "k_any", "k_args",
    "k_math", "k_mul_add", "k_trap", "k_assert", "k_deadlock", "k_early_exit",
] + [f"k_shfl<{t}>" for t in SHFL_TYPES]


@pytest.fixture(scope="module")
def lib():
    return emulator.load_library({"emulator_tests.cu": SOURCE}, NAMES, "test-emulator")


def ptr(a: np.ndarray) -> np.uint64:
    return np.uint64(a.ctypes.data)


def assert_bits(a, b):
    assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), (a, b)


@pytest.mark.parametrize("grid,block", [(1, 1), (3, 32), (2, 100), (4, 256), (1, 1024), (5, 33)])
def test_every_thread_runs_with_its_indices(lib, grid, block):
    out = np.full((grid * block, 4), 0xDEAD, dtype=np.uint32)
    lib.launch("k_ids", grid, block, [ptr(out)])
    g = np.arange(grid * block)
    np.testing.assert_array_equal(out[:, 0], g % block)
    np.testing.assert_array_equal(out[:, 1], g // block)
    assert (out[:, 2] == block).all() and (out[:, 3] == grid).all()


@pytest.mark.parametrize("block", [32, 64, 96, 256, 1000, 1024])
def test_syncthreads_orders_shared_memory(lib, block):
    rng = np.random.default_rng(block)
    grid = 2
    x = rng.integers(-(2**40), 2**40, size=grid * block, dtype=np.int64)
    out = np.zeros(grid, dtype=np.int64)
    lib.launch("k_block_sum", grid, block, [ptr(x), ptr(out)])
    np.testing.assert_array_equal(out, x.reshape(grid, block).sum(axis=1))

    nb = np.zeros(grid * block, dtype=np.int64)
    lib.launch("k_neighbour", grid, block, [ptr(nb)])
    t = np.arange(block)
    expect = np.concatenate([3 * ((t + 1) % block) + 1 + 10000 * b for b in range(grid)])
    np.testing.assert_array_equal(nb, expect)


def test_shared_memory_is_poisoned_before_every_block(lib):
    out = np.zeros(3 * 64, dtype=np.int64)
    lib.launch("k_shared_unwritten", 3, 64, [ptr(out)])
    assert (out == -1).all()


def shfl_down_reference(v, block, delta, width):
    """What __shfl_down_sync returns, per PTX shfl.sync.down; a lane that does
    not exist in a partial warp reads as all-ones bytes."""
    poison = np.frombuffer(b"\xff" * v.itemsize, dtype=v.dtype)[0]
    out = np.empty_like(v)
    for g in range(v.size):
        t = g % block
        lane = t % 32
        lanes = min(32, block - (t - lane))
        src = lane if (lane % width) + delta >= width else lane + delta
        out[g] = v[g - lane + src] if src < lanes else poison
    return out


@pytest.mark.parametrize("ctype", list(SHFL_TYPES))
@pytest.mark.parametrize("delta,width", [(1, 32), (5, 32), (16, 32), (31, 32), (3, 8), (2, 4), (7, 16)])
def test_shuffles_match_reference(lib, ctype, delta, width):
    dtype = SHFL_TYPES[ctype]
    grid, block = 2, 64
    rng = np.random.default_rng(delta * 100 + width)
    v = (rng.standard_normal(grid * block) * 1000).astype(dtype)
    out = np.zeros(grid * block, dtype=dtype)
    lib.launch(f"k_shfl<{ctype}>", grid, block, [ptr(v), ptr(out), np.int32(delta), np.int32(width)])
    ref = shfl_down_reference(v, block, delta, width)
    np.testing.assert_array_equal(out.view(np.uint8), ref.view(np.uint8))


def test_shuffle_from_a_missing_lane_of_a_partial_warp(lib):
    block = 48  # the second warp has lanes 0..15 only
    v = np.arange(block, dtype=np.int32) + 100
    out = np.zeros(block, dtype=np.int32)
    lib.launch("k_shfl<int>", 1, block, [ptr(v), ptr(out), np.int32(8), np.int32(32)])
    np.testing.assert_array_equal(out, shfl_down_reference(v, block, 8, 32))
    assert out[32 + 8] == -1  # lane 8 of the partial warp reads lane 16


def test_shuffle_of_a_16_byte_type(lib):
    x = np.arange(128, dtype=np.float64) * 0.5
    out = np.zeros(8, dtype=np.float64)
    lib.launch("k_shfl_double2", 2, 64, [ptr(x), ptr(out)])
    sums = x.reshape(4, 32).sum(axis=1)
    np.testing.assert_array_equal(out.reshape(4, 2), np.stack([sums, -sums], axis=1))


@pytest.mark.parametrize("block", [128, 40])
def test_any(lib, block):
    rng = np.random.default_rng(block)
    grid = 2
    pred = rng.integers(0, 2, size=grid * block).astype(np.int32)
    pred[:32] = 0  # a warp of all-false
    any_ = np.full(grid * block, 7, dtype=np.int32)
    lib.launch("k_any", grid, block, [ptr(pred), ptr(any_)])
    for b in range(grid):
        for w0 in range(0, block, 32):
            sl = slice(b * block + w0, b * block + min(block, w0 + 32))
            assert (any_[sl] == int(pred[sl].any())).all()
    assert (any_[:32] == 0).all()


def test_64_bit_arguments_arrive_intact(lib):
    p = np.array([11, -(2**63) + 5], dtype=np.int64)
    out = np.zeros(7, dtype=np.uint64)
    a, b, c, d, e = -(2**62) - 12345, 2**64 - 3, -7, np.pi, np.float32(1.5)
    args = [np.int64(a), np.uint64(b), np.int32(c), np.float64(d), e, ptr(p), ptr(out)]
    lib.launch("k_args", 1, 1, args)
    assert out[0] == a % 2**64 and out[1] == b and out[2] == c % 2**64
    assert out[3] == np.float64(d).view(np.uint64) and out[4] == e.view(np.uint32)
    assert out[5] == p.ctypes.data and out[6] == (-(2**63) + 5) % 2**64


def test_argument_types_are_checked(lib):
    out = np.zeros(7, dtype=np.uint64)
    good = [np.int64(1), np.uint64(2), np.int32(3), np.float64(4), np.float32(5), ptr(out), ptr(out)]
    assert lib.signature("k_args") == ("i8", "u8", "i4", "f8", "f4", "p8", "p8")
    with pytest.raises(TypeError, match=r"argument 0: expected a 64-bit integer .*got int32"):
        lib.launch("k_args", 1, 1, [np.int32(1)] + good[1:])
    with pytest.raises(TypeError, match=r"argument 5: expected a pointer"):
        lib.launch("k_args", 1, 1, good[:5] + [out.ctypes.data, ptr(out)])
    with pytest.raises(TypeError, match="takes 7 arguments"):
        lib.launch("k_args", 1, 1, good[:6])
    assert (out == 0).all()


def test_math(lib):
    x = np.array([1.5, -2.0, np.nan, 3.0, -0.0, np.inf, 5e-324, 1e300])
    y = np.array([np.nan, 4.0, 1.0, -7.5, 0.0, 2.0, -1e-310, 1e300])
    out = np.zeros((x.size, 8))
    lib.launch("k_math", 1, x.size, [ptr(np.concatenate([x, y])), ptr(out)])
    t = np.arange(x.size)
    with np.errstate(invalid="ignore", over="ignore"):
        expect = np.stack([np.fmax(x, y), np.fmin(x, y), np.abs(x), np.hypot(x, y), np.abs(x) ** 1.5,
                           np.sqrt(np.abs(y)), np.isfinite(x).astype(float),
                           -x + (np.maximum(-3, t) + 16)], axis=1)
    np.testing.assert_array_equal(out, expect)


def test_products_and_sums_are_rounded_apart(lib):
    # a*b+c where one fma rounding differs from two: (1+2**-12)**2 - (1+2**-11).
    n = 100
    a = np.full(n, 1 + 2.0**-12, np.float32)
    c = np.full(n, -(1 + 2.0**-11), np.float32)
    a[::2] = np.float32(1e-20)  # subnormal products survive too
    c[::2] = np.float32(0)
    out = np.zeros(n, np.float32)
    lib.launch("k_mul_add", 2, 64, [ptr(a), ptr(a), ptr(c), ptr(out), np.int64(n)])
    expect = a * a + c  # NumPy: two float32 roundings
    assert_bits(out, expect)
    assert out[1] == 0 and out[0] > 0 and out[0] < np.finfo(np.float32).tiny


def _fma_flags():
    """Flags that let g++ emit fused multiply-adds on this host."""
    if platform.machine() in ("x86_64", "AMD64"):
        return ("-mfma",)
    return ()


def test_the_emulator_flags_keep_a_fusing_host_from_fusing():
    src = 'extern "C" __attribute__((visibility("default"))) float mul_add(float a, float b, float c) ' \
          '{ return a * b + c; }'
    a, c = 1 + 2.0**-12, -(1 + 2.0**-11)

    def run(flags):
        fn = host_compiler.load(host_compiler.build_library("test-mul-add", src, flags=flags)).mul_add
        fn.argtypes, fn.restype = [ctypes.c_float] * 3, ctypes.c_float
        return fn(a, a, c)

    # The probe can tell: allowed to contract, an fma-capable host fuses.
    assert run(("-O2", "-ffp-contract=fast", *_fma_flags())) == 2.0**-24
    assert run(emulator.CXX_FLAGS + _fma_flags()) == 0.0


def test_unknown_kernel_raises(lib):
    with pytest.raises(UnknownKernelError, match=r"'k_nope<float>'.*k_ids"):
        lib.launch("k_nope<float>", 1, 1, [])
    # The C entry point itself refuses it too, with a message.
    assert lib._lib.gpuflat_emu_launch(b"k_nope", 1, 1, None) == 1
    assert b"k_nope" in lib._lib.gpuflat_emu_last_error()


@pytest.mark.parametrize("grid,block", [(1, 0), (1, 1025), (0, 32)])
def test_invalid_configuration(lib, grid, block):
    out = np.zeros(4, dtype=np.uint32)
    with pytest.raises(ValueError, match="invalid launch configuration"):
        lib.launch("k_ids", grid, block, [ptr(out)])


def test_trap_fails_the_launch_and_the_pool_survives(lib):
    out = np.zeros(3 * 64, dtype=np.int32)
    with pytest.raises(KernelError, match=r"k_trap', block 1, thread 5: __trap\(\)"):
        lib.launch("k_trap", 3, 64, [ptr(out), np.int32(1)])
    assert (out[64:] == 0).all()  # blocks after the trap never ran
    lib.launch("k_trap", 3, 64, [ptr(out), np.int32(-1)])
    assert (out == 1).all()


def test_assert_fails_the_launch(lib):
    x = np.array([0, 1, -4, 2], dtype=np.int32)
    with pytest.raises(KernelError, match=r"thread 2: assertion 'x\[threadIdx.x\] >= 0' failed"):
        lib.launch("k_assert", 1, 4, [ptr(x)])


def test_deadlock_is_reported(lib):
    lib.set_deadlock_timeout(0.2)
    try:
        with pytest.raises(KernelError, match=r"deadlock.*\(31 at __syncthreads, 1 at warp"):
            lib.launch("k_deadlock", 1, 32, [ptr(np.zeros(1, np.int32))])
    finally:
        lib.set_deadlock_timeout(2.0)
    out = np.zeros(4, dtype=np.uint32)
    lib.launch("k_ids", 1, 1, [ptr(out)])
    assert out.tolist() == [0, 0, 1, 1]


def test_exited_threads_release_syncthreads(lib):
    out = np.zeros(64, dtype=np.int32)
    lib.launch("k_early_exit", 1, 64, [ptr(out)])
    assert out.tolist() == [1] * 10 + [0] * 54


def test_concurrent_launches_from_python_threads(lib):
    barrier = threading.Barrier(8)

    def work(seed):
        rng = np.random.default_rng(seed)
        block = [32, 64, 128, 96][seed % 4]
        barrier.wait()
        for _ in range(6):
            x = rng.integers(-1000, 1000, size=3 * block, dtype=np.int64)
            out = np.zeros(3, dtype=np.int64)
            lib.launch("k_block_sum", 3, block, [ptr(x), ptr(out)])
            if not (out == x.reshape(3, block).sum(axis=1)).all():
                return False
        return True

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(work, range(8)))


def test_library_is_cached_and_memoised(lib):
    again = emulator.load_library({"emulator_tests.cu": SOURCE}, NAMES, "test-emulator")
    assert again is lib
    assert lib.path.parent == host_compiler.cache_dir()
    assert lib.path.name.startswith("test-emulator-") and lib.path.is_file()


def test_build_failure_carries_the_compiler_message(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUFLAT_CACHE_DIR", str(tmp_path))
    with pytest.raises(EmulatorBuildError, match="error") as info:
        emulator.load_library({"bad.cu": "__global__ void k() { this is not C++; }"}, ["k"], "bad")
    assert "bad.cu" in info.value.stderr
    assert not list(tmp_path.rglob("*.so"))
