// The per-element arithmetic of norms and clipping, shared by the CUDA
// kernels (norms.cu) and every host build of the same text, so each element
// is computed by one definition wherever it runs.
#pragma once
#include "gpuflat_common.cuh"

// Norm kinds, the template argument K of the norm kernels.
#define GF_NORM_L1 0
#define GF_NORM_L2 1
#define GF_NORM_INF 2
#define GF_NORM_P 3

// max that lets a NaN win, so a NaN anywhere makes an inf-norm NaN.
__device__ __forceinline__ double gf_nanmax(double a, double b) {
    if (a != a) return a;
    if (b != b) return b;
    return a > b ? a : b;
}

template <int K>
__device__ __forceinline__ double gf_combine(double a, double b) {
    if constexpr (K == GF_NORM_INF) return gf_nanmax(a, b);
    else return a + b;
}

// One element's share of the norm, in double: float32 values near 1e30 or
// float16 values past 256 square without overflow.
template <int K, bool CPLX>
__device__ __forceinline__ double gf_term(gf_wide w, double p) {
    if constexpr (K == GF_NORM_L2) {
        if constexpr (CPLX) return w.re * w.re + w.im * w.im;
        else return w.re * w.re;
    } else {
        const double a = CPLX ? hypot(w.re, w.im) : fabs(w.re);
        if constexpr (K == GF_NORM_P) return pow(a, p);
        else return a;
    }
}

// The norm of an accumulated value: sqrt for 2, 1/p-th power for p.
template <int K>
__device__ __forceinline__ double gf_root(double v, double p) {
    if constexpr (K == GF_NORM_L2) return sqrt(v);
    else if constexpr (K == GF_NORM_P) return pow(v, 1.0 / p);
    else return v;
}

// The clip product in PyTorch's precision: the factor is cast to the leaf's
// compute type (float for 16- and 32-bit leaves, double for 64-bit ones) and
// multiplied there, so the result is rounded once, as torch's mul_ does.
__device__ __forceinline__ void gf_scale(float& x, double c) { x = x * (float)c; }
__device__ __forceinline__ void gf_scale(double& x, double c) { x = x * c; }
__device__ __forceinline__ void gf_scale(c64& x, double c) {
    const float f = (float)c;
    x.re = x.re * f;
    x.im = x.im * f;
}
__device__ __forceinline__ void gf_scale(c128& x, double c) {
    x.re = x.re * c;
    x.im = x.im * c;
}
template <class S>  // f16 and bf16: float arithmetic, one rounding back to 16 bits
__device__ __forceinline__ void gf_scale(S& x, double c) {
    x = gf_convert<S>((float)gf_widen(x).re * (float)c);
}
