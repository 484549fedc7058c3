// The few CUDA names that kernels/gpuflat_common.cuh and gpuflat_math.cuh use,
// defined for a plain host build, so the native host backend compiles the
// kernels' own element arithmetic (gf_widen, gf_narrow, gf_term, gf_root,
// gf_combine, gf_scale) instead of keeping a copy of it.
//
// Unlike kernels/emulator/cuda_host.h there are no threads, barriers or warp
// primitives here: the host backend runs plain loops and only borrows the
// per-element definitions. Every standard header is included before the
// macros below, which would otherwise rewrite attributes inside them.
#pragma once

#include <bit>
#include <cmath>

#define __global__
#define __device__
#define __host__
// Inlined as on the GPU: left to GCC's budget, a 16-bit conversion in a
// large staged update (host_optim.cpp) became a call per element, and the
// loop around it scalar.
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict

struct alignas(16) int4 {
    int x, y, z, w;
};

// The thread-index built-ins appear only in helpers the host backend never
// calls (the grid-stride warp counters); one block of one thread keeps them
// well defined.
struct gf_host_dim3 {
    unsigned x, y, z;
};
inline constexpr gf_host_dim3 threadIdx{0, 0, 0};
inline constexpr gf_host_dim3 blockIdx{0, 0, 0};
inline constexpr gf_host_dim3 blockDim{1, 1, 1};
inline constexpr gf_host_dim3 gridDim{1, 1, 1};

inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

// CUDA puts the double overloads of the math functions in the global
// namespace; these are the ones the shared headers call.
using std::fabs;
using std::hypot;
using std::isfinite;
using std::pow;
using std::sqrt;
