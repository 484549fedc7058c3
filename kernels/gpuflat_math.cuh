// The per-element arithmetic of norms and clipping, shared by the CUDA
// kernels (norms.cu) and every host build of the same text, so each element
// is computed by one definition wherever it runs.
#pragma once
#include "gpuflat_common.cuh"

// The norm kinds' numbers (GF_NORM_<NAME>) and their list (GF_NORM_KINDS),
// written from gpuflat._src.layout's NORMS.
#include "gpuflat_rules.h"

// max that lets a NaN win, so a NaN anywhere makes an inf-norm NaN.
__device__ __forceinline__ double gf_nanmax(double a, double b) {
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
}

// Norm kind K's arithmetic and the kernels' choices for it: gf_norm<K>, one
// specialization per kind of GF_NORM_KINDS (the host library's switch
// expands that list; the CUDA and emulated builds instantiate the kernels the
// layout names). What a kind does not define it takes from gf_norm_defaults.
template <int K>
struct gf_norm;

struct gf_norm_defaults {
    // One element's share of the norm, in double (float32 values near 1e30
    // or float16 values past 256 square without overflow): |x|, a hypot for
    // complex elements.
    template <bool CPLX>
    static __device__ __forceinline__ double term(gf_wide w, double) {
        return CPLX ? hypot(w.re, w.im) : fabs(w.re);
    }
    static __device__ __forceinline__ double combine(double a, double b) { return a + b; }
    // The norm of an accumulated value.
    static __device__ __forceinline__ double root(double v, double) { return v; }
    // Vectors in flight per lane of the partial kernel (gf_item_loop's U;
    // the order of the sum is the same for any), for real and complex
    // leaves. A hypot per element needs registers: with four vectors in
    // flight CUDA 13's ptxas spilled for sm_90, with two it does not.
    static constexpr int unroll() { return GF_UNROLL; }
    static constexpr int unroll_complex() { return 2; }
    // Whether a lane's accumulated value alone tells that it met a NaN or
    // inf, for elements no wider than float (gf_bad_from_sum in norms.cu):
    // every finite element's term finite, and any combination of them far
    // inside double's range. Else every element is checked.
    static constexpr bool bad_from_sum() { return false; }
    // Whether the partial kernel loads the leaf's fields before its loop
    // (gf_on_leaf's EARLY).
    static constexpr bool early_leaf() { return true; }
    // Whether the terms are x * x (re * re + im * im), summed: the host
    // library's AVX-512 2-norm lane computes exactly that.
    static constexpr bool sum_of_squares() { return false; }
};

// The 1-norm: the sum of |x|. A term is at most 3.5e38 for a float.
template <>
struct gf_norm<GF_NORM_L1> : gf_norm_defaults {
    static constexpr bool bad_from_sum() { return true; }
};

// The 2-norm: the root of the sum of squares (no hypot). A float's square
// is at most (3.5e38)^2 = 1.2e77, and at most 2^63 of them are summed.
template <>
struct gf_norm<GF_NORM_L2> : gf_norm_defaults {
    template <bool CPLX>
    static __device__ __forceinline__ double term(gf_wide w, double) {
        if constexpr (CPLX) return w.re * w.re + w.im * w.im;
        else return w.re * w.re;
    }
    static __device__ __forceinline__ double root(double v, double) { return sqrt(v); }
    static constexpr int unroll_complex() { return GF_UNROLL; }
    static constexpr bool bad_from_sum() { return true; }
    static constexpr bool sum_of_squares() { return true; }
};

// The inf-norm: the max of |x|, a NaN winning. Its per-element check of NaN
// and inf keeps the kernel within its registers (the NaN-preferring max
// would allow bad_from_sum), and CUDA 13's ptxas spills its partial kernel
// (for sm_90 too) when the leaf's fields are loaded early.
template <>
struct gf_norm<GF_NORM_INF> : gf_norm_defaults {
    static __device__ __forceinline__ double combine(double a, double b) { return gf_nanmax(a, b); }
    static constexpr bool early_leaf() { return false; }
};

// Any other order p: the 1/p-th power of the sum of |x|^p. pow makes it
// compute-bound: one vector in flight is enough, and the registers go to
// pow. Any p-th power can overflow, so every element is checked.
template <>
struct gf_norm<GF_NORM_P> : gf_norm_defaults {
    template <bool CPLX>
    static __device__ __forceinline__ double term(gf_wide w, double p) {
        return pow(gf_norm_defaults::term<CPLX>(w, p), p);
    }
    static __device__ __forceinline__ double root(double v, double p) { return pow(v, 1.0 / p); }
    static constexpr int unroll() { return 1; }
    static constexpr int unroll_complex() { return 1; }
};

// The kernels' and host library's names for a kind's arithmetic.
template <int K>
__device__ __forceinline__ double gf_combine(double a, double b) {
    return gf_norm<K>::combine(a, b);
}

template <int K, bool CPLX>
__device__ __forceinline__ double gf_term(gf_wide w, double p) {
    return gf_norm<K>::template term<CPLX>(w, p);
}

template <int K>
__device__ __forceinline__ double gf_root(double v, double p) {
    return gf_norm<K>::root(v, p);
}

// The clip product in PyTorch's precision: the factor is cast to the leaf's
// compute type (gf_compute: float for 16- and 32-bit leaves, double for
// 64-bit ones) and multiplied there, so the result is rounded once, as
// torch's mul_ does; a complex leaf's parts each so.
template <class S>
__device__ __forceinline__ void gf_scale(S& x, double c) {
    using C = typename gf_compute<S>::type;
    if constexpr (gf_is_complex<S>::value) {
        const C f = (C)c;
        x.re = x.re * f;
        x.im = x.im * f;
    } else {
        x = gf_convert<S>(gf_convert<C>(x) * (C)c);
    }
}
