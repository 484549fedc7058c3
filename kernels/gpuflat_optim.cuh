// The per-element arithmetic of the flat optimizers (AdamW, SGD), shared by
// the CUDA kernels (optim.cu) and the host build (host/host_optim.cpp), so
// each element is updated by one definition wherever it runs.
//
// The operations and their order are PyTorch's foreach paths
// (torch/optim/adam.py with decoupled weight decay, torch/optim/sgd.py), in
// the parameter's compute type: float for 16- and 32-bit buffers, double for
// 64-bit ones; the scalars are computed in double and cast once, as PyTorch
// casts a Python scalar. The clip factor multiplies the gradient first, as
// torch.nn.utils.clip_grad_norm_ would have done in a pass of its own.
#pragma once
#include "gpuflat_common.cuh"

// Per-group hyperparameter rows (GF_HYPER doubles each), written by
// gpuflat/optim.py: AdamW (lr, weight_decay, beta1, beta2, eps),
// SGD (lr, weight_decay, momentum, dampening, nesterov).
#define GF_HYPER 5

// One row of a tensor-list step's table (gpuflat.layout.PARAM_ROW_WORDS
// int64 words): a parameter and what it is updated with, each tensor dense
// and laid out alike, addressed at its lowest element, so the update runs
// over numel consecutive elements of each.
struct ParamRow {
    long long param, grad, state0, state1;  // state1 is 0 for SGD
    long long step;   // the address of its float32 step count (AdamW), or 0
    long long numel;
    long long group;  // its parameter group: the row of the hyperparameter table
    long long flags;  // GF_ROW_FIRST: its momentum buffer is new this step (SGD)
};
#define GF_ROW_FIRST 1

// A group's learning rate: read on the device through lr_at[2 * group]
// (the address of a 0-d float32 or float64 tensor, its dtype tag at
// lr_at[2 * group + 1]) where it is a tensor, so a scheduler's write between
// steps or graph replays needs no host read; else its hyperparameter row's.
__device__ __forceinline__ double gf_group_lr(const double* h, const long long* lr_at, long long group) {
    const long long at = lr_at[2 * group];
    if (at == 0) return h[0];
    return lr_at[2 * group + 1] == 3 ? *(const double*)at : (double)*(const float*)at;
}

template <class S> struct gf_compute { using type = float; };
template <> struct gf_compute<double> { using type = double; };

// An element in the compute type and back. A 16-bit float and float convert
// directly (one instruction each way on the GPU: the widening is exact and
// the narrowing rounds once to nearest even, the bits of rounding the same
// value through double); the other types go through gf_wide.
template <class C, class S>
__device__ __forceinline__ C gf_load(const S& x) {
    if constexpr (gf_in_float<S>::value && gf_same<C, float>::value) return gf_to_float(x);
    else return (C)gf_widen(x).re;
}
template <class S, class C>
__device__ __forceinline__ void gf_store(S& x, C c) {
    if constexpr (gf_in_float<S>::value && gf_same<C, float>::value) x = gf_from_float<S>(c);
    else x = gf_narrow<S>(gf_wide{(double)c, 0.0});
}

// base**n for a whole n >= 0 by repeated squaring: IEEE products only, so
// every device and the host give the same bits (a library pow may differ in
// the last place between them).
__device__ __forceinline__ double gf_powi(double base, double n) {
    double r = 1.0;
    for (long long k = (long long)n; k > 0; k >>= 1) {
        if (k & 1) r *= base;
        base *= base;
    }
    return r;
}

// What each gradient is multiplied by: the clip factor min(1, max_norm /
// (total + eps)), NaN kept (PyTorch's clip_grad_norm_), or 1 when the step
// does not clip; times a loss scaler's unscale factor amp[0] (1 without one).
__device__ __forceinline__ double gf_grad_factor(const double* total, double max_norm, double eps, long long clip,
                                                 const double* amp) {
    double c = 1.0;
    if (clip) {
        c = max_norm / (total[0] + eps);
        c = c > 1.0 ? 1.0 : c;
    }
    return c * amp[0];
}

// torch.lerp's formula, which switches form at weight 0.5.
template <class C>
__device__ __forceinline__ C gf_lerp(C a, C b, C w) {
    return (w < (C)0.5 && w > (C)-0.5) ? a + w * (b - a) : b - (b - a) * ((C)1 - w);
}

template <class C>
struct gf_adamw_coefs {
    C clip, decay, w1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps;
};

// One group's scalars at step `step` (already counted), as PyTorch's
// non-capturable foreach AdamW computes them on the host.
template <class C>
__device__ __forceinline__ gf_adamw_coefs<C> gf_adamw_setup(const double* h, double step, double clip,
                                                            double lr) {
    const double wd = h[1], b1 = h[2], b2 = h[3];
    const double bc1 = 1.0 - gf_powi(b1, step), bc2 = 1.0 - gf_powi(b2, step);
    return {(C)clip, (C)(1.0 - lr * wd), (C)(1.0 - b1), (C)b2, (C)(1.0 - b2),
            (C)(-(lr / bc1)), (C)sqrt(bc2), (C)h[4]};
}

// One element of the four buffers, in place.
template <class S>
__device__ __forceinline__ void gf_adamw_one(S& p, const S& g, S& m, S& v,
                                             const gf_adamw_coefs<typename gf_compute<S>::type>& k) {
    using C = typename gf_compute<S>::type;
    const C gc = gf_load<C>(g) * k.clip;
    const C pc = gf_load<C>(p) * k.decay;
    const C mc = gf_lerp(gf_load<C>(m), gc, k.w1);
    const C vc = gf_load<C>(v) * k.beta2 + k.one_minus_beta2 * gc * gc;
    const C denom = sqrt(vc) / k.bc2_sqrt + k.eps;
    gf_store(p, pc + k.step_size * (mc / denom));
    gf_store(m, mc);
    gf_store(v, vc);
}

// Elements first, first + STRIDE, ... (n of them) of the four buffers.
template <int STRIDE, class S>
__device__ __forceinline__ void gf_adamw_range(S* __restrict__ p, const S* __restrict__ g, S* __restrict__ m,
                                               S* __restrict__ v, long long first, long long n,
                                               gf_adamw_coefs<typename gf_compute<S>::type> k) {
    for (long long j = 0; j < n; ++j) {
        const long long i = first + j * STRIDE;
        gf_adamw_one(p[i], g[i], m[i], v[i], k);
    }
}

template <class C>
struct gf_sgd_coefs {
    C clip, neg_lr, wd, momentum, one_minus_dampening;
    int has_wd, has_momentum, first, nesterov;
};

template <class C>
__device__ __forceinline__ gf_sgd_coefs<C> gf_sgd_setup(const double* h, double step, double clip, double lr) {
    return {(C)clip, (C)(-lr), (C)h[1], (C)h[2], (C)(1.0 - h[3]),
            h[1] != 0.0, h[2] != 0.0, step <= 1.0, h[4] != 0.0};
}

// PyTorch's SGD: d = g + wd * p; buf = d on the first step, else
// buf * momentum + (1 - dampening) * d; d = d + momentum * buf (nesterov) or
// buf; p = p - lr * d. The branches are uniform over a range.
template <class S>
__device__ __forceinline__ void gf_sgd_one(S& p, const S& g, S& buf,
                                           const gf_sgd_coefs<typename gf_compute<S>::type>& k) {
    using C = typename gf_compute<S>::type;
    const C pc = gf_load<C>(p);
    C d = gf_load<C>(g) * k.clip;
    if (k.has_wd) d = d + k.wd * pc;
    if (k.has_momentum) {
        const C b = k.first ? d : gf_load<C>(buf) * k.momentum + k.one_minus_dampening * d;
        gf_store(buf, b);
        d = k.nesterov ? d + k.momentum * b : b;
    }
    gf_store(p, pc + k.neg_lr * d);
}

template <int STRIDE, class S>
__device__ __forceinline__ void gf_sgd_range(S* __restrict__ p, const S* __restrict__ g, S* __restrict__ buf,
                                             long long first, long long n,
                                             gf_sgd_coefs<typename gf_compute<S>::type> k) {
    for (long long j = 0; j < n; ++j) {
        const long long i = first + j * STRIDE;
        gf_sgd_one(p[i], g[i], buf[i], k);
    }
}
