// The per-element arithmetic of the flat optimizers (AdamW, SGD), shared by
// the CUDA kernels (optim.cu) and the host build (host/host_optim.cpp), so
// each element is updated by one definition wherever it runs.
//
// The operations and their order are PyTorch's (torch/optim/adam.py with
// decoupled weight decay, torch/optim/sgd.py). Each element is read once,
// computed in the parameter's compute type (float for 16- and 32-bit
// buffers, double for 64-bit ones) and stored once, every operation rounded
// (--fmad=false: no multiply-add fused into one rounding). For float and
// double buffers that is the rounding of PyTorch's foreach path. For 16-bit
// buffers it is the rounding of its fused kernels (fused=True), which keep
// the intermediate values in float; the default foreach path rounds every
// intermediate to 16 bits. The scalars are
// computed in double and cast once, as PyTorch casts a Python scalar. The
// clip factor multiplies the gradient first, as
// torch.nn.utils.clip_grad_norm_ would have done in a pass of its own, and
// maximize negates the result, as the optimizers negate the gradient they
// find.
#pragma once
#include "gpuflat_common.cuh"

// Per-group hyperparameter rows (GF_HYPER doubles each, zeros after a
// rule's fields), written by gpuflat/optim.py and the tensor-list front
// ends: AdamW (lr, weight_decay, beta1, beta2, eps, maximize, amsgrad),
// SGD (lr, weight_decay, momentum, dampening, nesterov, maximize); flags
// are 1 or 0.
#define GF_HYPER 7
#define GF_HYPER_MAXIMIZE 5
#define GF_HYPER_AMSGRAD 6
// Blocks per SM the AMSGrad row update asks for (optim.cu).
#define GF_AMSGRAD_MIN_BLOCKS_PER_SM 3

// One row of a tensor-list step's table (gpuflat._src.layout.PARAM_ROW_WORDS
// int64 words): a parameter and what it is updated with, each tensor dense
// and laid out alike, addressed at its lowest element, so the update runs
// over numel consecutive elements of each.
struct ParamRow {
    // AdamW: exp_avg, exp_avg_sq, max_exp_avg_sq (0 unless its group has
    // amsgrad); SGD: momentum_buffer (0 without momentum), 0, 0.
    long long param, grad, state0, state1, state2;
    // What the row keeps beside its parameter (GF_KEEP_* of its precision
    // word: a float32 master copy or a compensation buffer; 0 for none).
    long long extra;
    // The address of its float32 step count: AdamW's steps; SGD's updates
    // of its momentum buffer (0 where it keeps none), 0 when it is new.
    long long step;
    long long numel;
    long long group;  // its parameter group: the row of the hyperparameter table
    // Each state's dtype tag + 1 in GF_PRECISION_TAG_BITS (0: the
    // parameter's), then the keep at GF_KEEP_SHIFT; 0 for a plain row.
    long long precision;
};

// The keep of a row's precision word (GF_KEEP_*).
__device__ __forceinline__ int gf_row_keep(long long precision) {
    return (int)((precision >> GF_KEEP_SHIFT) & ((1LL << GF_KEEP_BITS) - 1));
}

// The factor a group's gradients are multiplied by: `factor` (the clip and
// unscale, in the compute type), negated where the group maximizes.
// -(g * c) is g * (-c) bit for bit (negation is exact and rounding is
// symmetric), so maximize costs no operation per element; the cast to the
// compute type commutes with negation too.
template <class C>
__device__ __forceinline__ C gf_group_factor(const double* h, C factor) {
    return h[GF_HYPER_MAXIMIZE] != 0.0 ? -factor : factor;
}

// A group's learning rate: read on the device through lr_at[2 * group]
// (the address of a 0-d float32 or float64 tensor, its dtype tag at
// lr_at[2 * group + 1]) where it is a tensor, so a scheduler's write between
// steps or graph replays needs no host read; else its hyperparameter row's.
__device__ __forceinline__ double gf_group_lr(const double* h, const long long* lr_at, long long group) {
    const long long at = lr_at[2 * group];
    if (at == 0) return h[0];
    return lr_at[2 * group + 1] == GF_TAG_double ? *(const double*)at : (double)*(const float*)at;
}

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

// What an element's update shows of it: seen(i, held, w) with i the
// element's index, held the value the rule's arithmetic started from and w
// the value it produced, both in the compute type (w before it is rounded
// into storage). The row kernels' update statistics (optim.cu) and the host
// library's take them; gf_unseen, every other caller's, takes nothing, so
// those compile to what they were without it.
struct gf_unseen {
    template <class C>
    __device__ __forceinline__ void operator()(long long, C, C) const {}
};

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

template <class C>
struct gf_adamw_coefs {
    // clip: the group's factor (gf_group_factor).
    C clip, decay, beta2, one_minus_beta2, step_size, bc2_sqrt, eps;
    // torch.lerp(m, g, 1 - beta1) is base + lerp_weight * (g - m), its base
    // g where lerp_from_grad, else m (gf_adamw_setup).
    C lerp_weight;
    bool lerp_from_grad;
    // 1 / bc2_sqrt in double, and whether gf_unbias may multiply by it.
    double inv_bc2_sqrt;
    bool unbias_by_product;
    // The group's amsgrad: the denominator from max_exp_avg_sq (gf_amsgrad_math).
    bool amsgrad;
};

// One group's scalars at step `step` (already counted), as PyTorch's
// non-capturable foreach AdamW computes them on the host, each row's once.
//
// torch.lerp(m, g, w) is m + w * (g - m) where |w| < 0.5, else
// g - (g - m) * (1 - w), which is g + (-(1 - w)) * (g - m) bit for bit
// (negating a product or a term changes no rounding, and x - y and
// x + (-y) give the same zero), so a row picks its base and weight and an
// element computes base + weight * (g - m): no branch per element.
template <class C>
__device__ __forceinline__ gf_adamw_coefs<C> gf_adamw_setup(const double* h, double step, double clip,
                                                            double lr) {
    const double wd = h[1], b1 = h[2], b2 = h[3];
    const double bc1 = 1.0 - gf_powi(b1, step), bc2 = 1.0 - gf_powi(b2, step);
    const C w = (C)(1.0 - b1), bc2_sqrt = (C)sqrt(bc2);
    const bool from_grad = !(w < (C)0.5 && w > (C)-0.5);
    // gf_unbias: c at most 2^32, or not finite (betas in [0, 1) give c in [2^-27, 1]).
    const double c = (double)bc2_sqrt;
    const bool by_product = gf_same<C, float>::value && !(c > 4294967296.0 && c < gf_inf());
    return {gf_group_factor(h, (C)clip), (C)(1.0 - lr * wd), (C)b2, (C)(1.0 - b2), (C)(-(lr / bc1)), bc2_sqrt,
            (C)h[4], from_grad ? -((C)1 - w) : w, from_grad, 1.0 / c, by_product, h[GF_HYPER_AMSGRAD] != 0.0};
}

// sqrt(v) / bc2_sqrt, rounded once. BY_PRODUCT, for float rows whose
// unbias_by_product is set, rounds the double product root * (1 / c)
// (c = bc2_sqrt) to float instead: the quotient's bits, with a multiply in
// place of a division per element. The product is within 2^-52 (relative)
// of the real root / c, which is further than that from every midpoint M
// between two floats, the only points where rounding to float changes its
// answer, so both round alike: root / c - M = (root - M c) / c, and
// root - M c is a nonzero multiple of the finer of root's and M c's last
// places (root, 24 significant bits, is never M c, wider: M has 25), at
// least 2^-49 of M c. Below float's normal range midpoints are evenly spaced
// and root / c can be one, but root is 0 or at least 2^-75 (the square root
// of a float) and c at most 2^32 keeps root / c above 2^-107. A c of 0, inf
// or NaN gives what the division gives: root * inf, root * 0, NaN.
template <bool BY_PRODUCT, class C>
__device__ __forceinline__ C gf_unbias(C root, const gf_adamw_coefs<C>& k) {
    if constexpr (BY_PRODUCT) return (C)((double)root * k.inv_bc2_sqrt);
    else return root / k.bc2_sqrt;
}

// The moments of one element in the compute type, in place.
template <class C>
__device__ __forceinline__ void gf_adamw_moments(C g, C& m, C& v, const gf_adamw_coefs<C>& k) {
    const C gc = g * k.clip;
    m = (k.lerp_from_grad ? gc : m) + k.lerp_weight * (gc - m);
    v = v * k.beta2 + k.one_minus_beta2 * gc * gc;
}

// The parameter's update from the first moment m and the second moment the
// denominator takes, w. The independent operations are ordered so that few
// values stay live across the square root and the division, whose slow
// paths are calls.
template <bool BY_PRODUCT, class C>
__device__ __forceinline__ void gf_adamw_apply(C& p, C m, C w, const gf_adamw_coefs<C>& k) {
    const C denom = gf_unbias<BY_PRODUCT>(sqrt(w), k) + k.eps;
    p = p * k.decay + k.step_size * (m / denom);
}

// One element of the four tensors in the compute type, in place.
template <bool BY_PRODUCT, class C>
__device__ __forceinline__ void gf_adamw_math(C& p, C g, C& m, C& v, const gf_adamw_coefs<C>& k) {
    gf_adamw_moments(g, m, v, k);
    gf_adamw_apply<BY_PRODUCT>(p, m, v, k);
}

// The larger of a and b, NaN where either is: torch.maximum, as the foreach
// AdamW keeps max_exp_avg_sq (the fused kernels' std::max keeps the old
// maximum where the new second moment is NaN; the parameter is NaN either
// way).
template <class C>
__device__ __forceinline__ C gf_max_nan(C a, C b) {
    return (a > b || a != a) ? a : b;
}

// AMSGrad on one element of the five tensors (vmax: max_exp_avg_sq), in
// place: the running maximum of the second moment takes the new one, and
// the denominator takes the maximum. For 16-bit buffers the maximum is
// taken in float, of the stored maximum and the unrounded moment, as
// PyTorch's fused kernels take it.
template <bool BY_PRODUCT, class C>
__device__ __forceinline__ void gf_amsgrad_math(C& p, C g, C& m, C& v, C& vmax, const gf_adamw_coefs<C>& k) {
    gf_adamw_moments(g, m, v, k);
    vmax = gf_max_nan(vmax, v);
    gf_adamw_apply<BY_PRODUCT>(p, m, vmax, k);
}

// One element of the four buffers, in place; seen(i, held, new value) (gf_unseen).
template <class S, class Seen = gf_unseen>
__device__ __forceinline__ void gf_adamw_one(S& p, const S& g, S& m, S& v,
                                             const gf_adamw_coefs<typename gf_compute<S>::type>& k,
                                             long long i = 0, Seen seen = {}) {
    using C = typename gf_compute<S>::type;
    C pc = gf_load<C>(p), mc = gf_load<C>(m), vc = gf_load<C>(v);
    const C held = pc;
    gf_adamw_math<false>(pc, gf_load<C>(g), mc, vc, k);
    seen(i, held, pc);
    gf_store(p, pc);
    gf_store(m, mc);
    gf_store(v, vc);
}

// One element of the five buffers (AMSGrad), in place; seen as gf_adamw_one's.
template <class S, class Seen = gf_unseen>
__device__ __forceinline__ void gf_amsgrad_one(S& p, const S& g, S& m, S& v, S& vmax,
                                               const gf_adamw_coefs<typename gf_compute<S>::type>& k,
                                               long long i = 0, Seen seen = {}) {
    using C = typename gf_compute<S>::type;
    C pc = gf_load<C>(p), mc = gf_load<C>(m), vc = gf_load<C>(v), wc = gf_load<C>(vmax);
    const C held = pc;
    gf_amsgrad_math<false>(pc, gf_load<C>(g), mc, vc, wc, k);
    seen(i, held, pc);
    gf_store(p, pc);
    gf_store(m, mc);
    gf_store(v, vc);
    gf_store(vmax, wc);
}

// Elements first, first + STRIDE, ... (n of them) of the buffers; vmax
// (max_exp_avg_sq) is read and written only where the group has amsgrad.
// seen(i, held, new value) for each (gf_unseen).
template <int STRIDE, class S, class Seen = gf_unseen>
__device__ __forceinline__ void gf_adamw_range(S* __restrict__ p, const S* __restrict__ g, S* __restrict__ m,
                                               S* __restrict__ v, S* __restrict__ vmax, long long first, long long n,
                                               gf_adamw_coefs<typename gf_compute<S>::type> k, Seen seen = {}) {
    if (k.amsgrad) {
        for (long long j = 0; j < n; ++j) {
            const long long i = first + j * STRIDE;
            gf_amsgrad_one(p[i], g[i], m[i], v[i], vmax[i], k, i, seen);
        }
    } else {
        for (long long j = 0; j < n; ++j) {
            const long long i = first + j * STRIDE;
            gf_adamw_one(p[i], g[i], m[i], v[i], k, i, seen);
        }
    }
}

template <class C>
struct gf_sgd_coefs {
    // clip: the group's factor (gf_group_factor).
    C clip, neg_lr, wd, momentum, one_minus_dampening;
    int has_wd, has_momentum, first, nesterov;
};

// One group's scalars; `step` is the count of the momentum buffer's updates
// with this one (1: the buffer is new).
template <class C>
__device__ __forceinline__ gf_sgd_coefs<C> gf_sgd_setup(const double* h, double step, double clip, double lr) {
    return {gf_group_factor(h, (C)clip), (C)(-lr), (C)h[1], (C)h[2], (C)(1.0 - h[3]),
            h[1] != 0.0, h[2] != 0.0, step <= 1.0, h[4] != 0.0};
}

// PyTorch's SGD on one element in the compute type, in place: d = g + wd * p;
// buf = d on the first step, else buf * momentum + (1 - dampening) * d;
// d = d + momentum * buf (nesterov) or buf; p = p - lr * d. The choices are
// uniform over a row and made by selects (the values not chosen have no
// effect), so a vector of elements runs without branches.
template <class C>
__device__ __forceinline__ void gf_sgd_math(C& p, C g, C& buf, const gf_sgd_coefs<C>& k) {
    C d = g * k.clip;
    d = k.has_wd ? d + k.wd * p : d;
    const C b = k.first ? d : buf * k.momentum + k.one_minus_dampening * d;
    const C n = k.nesterov ? d + k.momentum * b : b;
    if (k.has_momentum) {
        buf = b;
        d = n;
    }
    p = p + k.neg_lr * d;
}

// One element of the buffers, in place; buf is read only with momentum
// after the first step, and written only with momentum. seen as gf_adamw_one's.
template <class S, class Seen = gf_unseen>
__device__ __forceinline__ void gf_sgd_one(S& p, const S& g, S& buf,
                                           const gf_sgd_coefs<typename gf_compute<S>::type>& k,
                                           long long i = 0, Seen seen = {}) {
    using C = typename gf_compute<S>::type;
    C pc = gf_load<C>(p), b = k.has_momentum && !k.first ? gf_load<C>(buf) : (C)0;
    const C held = pc;
    gf_sgd_math(pc, gf_load<C>(g), b, k);
    seen(i, held, pc);
    if (k.has_momentum) gf_store(buf, b);
    gf_store(p, pc);
}

template <int STRIDE, class S, class Seen = gf_unseen>
__device__ __forceinline__ void gf_sgd_range(S* __restrict__ p, const S* __restrict__ g, S* __restrict__ buf,
                                             long long first, long long n,
                                             gf_sgd_coefs<typename gf_compute<S>::type> k, Seen seen = {}) {
    for (long long j = 0; j < n; ++j) {
        const long long i = first + j * STRIDE;
        gf_sgd_one(p[i], g[i], buf[i], k, i, seen);
    }
}

// A row's step count after this step, as the update reads it: its stored
// count plus one (PyTorch counts before it updates). An SGD row's count is
// read only with momentum: without, it may keep no count (step word 0).
__device__ __forceinline__ double gf_adamw_row_step(const ParamRow& r) {
    return (double)*(const float*)r.step + 1.0;
}
__device__ __forceinline__ double gf_sgd_row_step(const ParamRow& r, const double* h) {
    return h[2] != 0.0 ? (double)*(const float*)r.step + 1.0 : 1.0;
}

// Whether a step moves a row's count: it keeps one, and its group's
// hyperparameter `counted_field` is nonzero (gpuflat._src.layout.Rule.counted_field;
// -1: every step counts).
__device__ __forceinline__ bool gf_counts(const ParamRow& r, const double* hyper, long long counted_field) {
    // A stochastically rounded row counts every step: its draws are keyed by the count.
    return r.step != 0 && (counted_field < 0 || hyper[r.group * GF_HYPER + counted_field] != 0.0 ||
                           gf_row_keep(r.precision) == GF_KEEP_STOCHASTIC);
}

// ---------------------------------------------------------------- rules as data
// A rule of gpuflat._src.layout.RULES with a `kernel` struct R is updated by
// the generic kernels (gpuflat_rule, gpuflat_rule_rows in optim.cu) and the
// host library's generic loops, whatever it computes. Its header (the
// rule's `header`, included through the written gpuflat_rule_includes.h) defines R:
//   static constexpr int STATES;  // its state tensors (1 to GF_GENERIC_STATES),
//                                 // a row's state0... in Rule.state_names order
//   template <class C> struct coefs;  // a group's scalars in the compute type
//   template <class C> static coefs<C> setup(const double* h, double step, double factor, double lr);
//   template <class C> static void math(C& p, C g, C (&s)[STATES], const coefs<C>& k);
// setup takes the group's hyperparameter row h, the step count after this
// step, the clip and unscale factor (gf_group_factor applies maximize) and
// the group's learning rate; math updates one element in the compute type,
// every operation rounded. The loads, stores, vectors and rows are the
// kernels' own, so a rule is only its arithmetic. A rule whose rows may hold
// a state their group's update leaves alone overloads gf_rule_uses for its
// coefs (below; by default a row's update reads and writes every state),
// so that the rows whose states are of other dtypes than the parameter
// (gpuflat_rule_mixed_rows) neither read nor round-trip it.
//
// Every rule, AdamW and SGD too (gf_adamw, gf_sgd below), has a struct: the
// rows with a nonzero precision word (a state of another dtype, or the
// parameter kept through a master copy or a compensation) go through the
// generic mixed update (gf_rule_mixed_one) whatever the rule. AdamW and SGD
// keep their own kernels for flat buffers and plain rows.

// A row's state tensor t (0: state0).
__device__ __forceinline__ long long gf_row_state(const ParamRow& r, int t) {
    return t == 0 ? r.state0 : t == 1 ? r.state1 : r.state2;
}

// A generic rule's step count after this step: its stored count plus one,
// or 1 where the row keeps none.
__device__ __forceinline__ double gf_rule_row_step(const ParamRow& r) {
    return r.step != 0 ? (double)*(const float*)r.step + 1.0 : 1.0;
}

// Element i of a parameter, its gradient and a generic rule's states, in
// place; seen as gf_adamw_one's.
template <class R, class S, class K, class Seen = gf_unseen>
__device__ __forceinline__ void gf_rule_one(S* __restrict__ p, const S* __restrict__ g, S* const* s,
                                            long long i, const K& k, Seen seen = {}) {
    using C = typename gf_compute<S>::type;
    C pc = gf_load<C>(p[i]), sc[R::STATES];
#pragma unroll
    for (int t = 0; t < R::STATES; ++t) sc[t] = gf_load<C>(s[t][i]);
    const C held = pc;
    R::math(pc, gf_load<C>(g[i]), sc, k);
    seen(i, held, pc);
    gf_store(p[i], pc);
#pragma unroll
    for (int t = 0; t < R::STATES; ++t) gf_store(s[t][i], sc[t]);
}

// Elements first, first + STRIDE, ... (n of them) of a generic rule's tensors.
template <class R, int STRIDE, class S, class K, class Seen = gf_unseen>
__device__ __forceinline__ void gf_rule_range(S* __restrict__ p, const S* __restrict__ g, S* const* s,
                                              long long first, long long n, const K& k, Seen seen = {}) {
    for (long long j = 0; j < n; ++j) gf_rule_one<R>(p, g, s, first + j * STRIDE, k, seen);
}


// ---------------------------------------------------------------- AdamW and SGD as rules
// Whether a row's update reads and writes its state t (every state unless
// a rule's overload for its coefs says otherwise): AdamW's max_exp_avg_sq
// only where the group has amsgrad, SGD's buffer only with momentum, as
// their own kernels and the NumPy reference read and write them.
template <class K>
__device__ __forceinline__ bool gf_rule_uses(const K&, int) { return true; }
template <class C>
__device__ __forceinline__ bool gf_rule_uses(const gf_adamw_coefs<C>& k, int t) { return t < 2 || k.amsgrad; }
template <class C>
__device__ __forceinline__ bool gf_rule_uses(const gf_sgd_coefs<C>& k, int) { return k.has_momentum != 0; }

// AdamW as a rule (the protocol above): exp_avg, exp_avg_sq and
// max_exp_avg_sq, the last used where the group has amsgrad. The element
// is gf_adamw_one's (the division, not the reciprocal's product, which only
// the vector loops of float rows take; both give the same bits).
struct gf_adamw {
    static constexpr int STATES = 3;

    template <class C>
    using coefs = gf_adamw_coefs<C>;

    template <class C>
    static __device__ __forceinline__ coefs<C> setup(const double* h, double step, double factor, double lr) {
        return gf_adamw_setup<C>(h, step, factor, lr);
    }

    template <class C>
    static __device__ __forceinline__ void math(C& p, C g, C (&s)[STATES], const coefs<C>& k) {
        if (k.amsgrad) gf_amsgrad_math<false>(p, g, s[0], s[1], s[2], k);
        else gf_adamw_math<false>(p, g, s[0], s[1], k);
    }
};

// SGD as a rule: momentum_buffer, used with momentum. Its `step` is the
// count of the buffer's updates with this one: gf_rule_row_step's stored
// count + 1 where the row keeps a count (it does with momentum: the
// layout's check), else 1, which only a row without momentum has, whose
// update reads no count.
struct gf_sgd {
    static constexpr int STATES = 1;

    template <class C>
    using coefs = gf_sgd_coefs<C>;

    template <class C>
    static __device__ __forceinline__ coefs<C> setup(const double* h, double step, double factor, double lr) {
        return gf_sgd_setup<C>(h, step, factor, lr);
    }

    template <class C>
    static __device__ __forceinline__ void math(C& p, C g, C (&s)[STATES], const coefs<C>& k) {
        gf_sgd_math(p, g, s[0], k);
    }
};

// ---------------------------------------------------------------- rows of mixed precision
// A row's precision word (gpuflat._src.layout.precision_word): state t's
// field (its dtype tag + 1; 0: the parameter's dtype) and the keep
// (GF_KEEP_*).
__device__ __forceinline__ int gf_state_field(long long precision, int t) {
    return (int)((precision >> (GF_PRECISION_TAG_BITS * t)) & ((1LL << GF_PRECISION_TAG_BITS) - 1));
}
// The row's key for stochastic rounding.
__device__ __forceinline__ unsigned gf_row_key(long long precision) { return (unsigned)(precision >> GF_KEY_SHIFT); }

// The 16 random bits stochastic rounding adds below element i of a row
// with key `key` at step count `step` (gpuflat._src.layout.stochastic_bits):
// splitmix64's output function (Steele, Lea and Flood 2014,
// https://doi.org/10.1145/2714064.2660195) of the three, a counter-based
// draw: the same on every backend, new at every step, as a captured step's
// count moves at each replay.
__device__ __forceinline__ unsigned gf_stochastic_bits(unsigned key, unsigned step, unsigned long long i) {
    unsigned long long z = (((unsigned long long)key << 32) | step) ^ (i * 0x9E3779B97F4A7C15ULL);
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return (unsigned)(z & 0xFFFF);
}

// c rounded into x up or down at random: `bits` added below the 16 bits a
// bfloat16 keeps of a float, then truncated, so that c rounds up with the
// probability of its distance from the value below (NaN and inf round to
// nearest). Other types round to nearest: the layout keeps bfloat16
// parameters only this way.
template <class P, class C>
__device__ __forceinline__ void gf_store_stochastic(P& x, C c, unsigned) {
    gf_store(x, c);
}
__device__ __forceinline__ void gf_store_stochastic(bf16& x, float c, unsigned bits) {
    if (c - c == 0.0f) x.bits = (unsigned short)((__float_as_uint(c) + bits) >> 16);  // finite
    else gf_store(x, c);
}

// Element i of the tensor at `at` whose dtype is given by a precision
// word's `field`, in the compute type C, and back (rounded once, as
// gf_load and gf_store): field 0 (or one that names no optimizer dtype,
// which the layout's words never hold) is the parameter's type P.
template <class P, class C>
__device__ __forceinline__ C gf_load_field(long long at, int field, long long i) {
    switch (field) {
#define GF_FIELD_LOAD(tag, T) \
        case tag + 1: return gf_load<C>(((const T*)at)[i]);
        GF_OPTIM_DTYPES(GF_FIELD_LOAD)
#undef GF_FIELD_LOAD
        default: return gf_load<C>(((const P*)at)[i]);
    }
}
template <class P, class C>
__device__ __forceinline__ void gf_store_field(long long at, int field, long long i, C c) {
    switch (field) {
#define GF_FIELD_STORE(tag, T) \
        case tag + 1: gf_store(((T*)at)[i], c); return;
        GF_OPTIM_DTYPES(GF_FIELD_STORE)
#undef GF_FIELD_STORE
        default: gf_store(((P*)at)[i], c);
    }
}

// Element i of a row of parameters of type P whose precision word may be
// nonzero, for a rule R, in place: each state read from its own dtype in
// the compute type C (an absent one, address 0, or one the row's update
// does not use, gf_rule_uses, reads as 0 and is never written), and the
// parameter kept as the word says:
// - GF_KEEP_PLAIN: R::math on the parameter;
// - GF_KEEP_MASTER: on the float32 master copy at `extra`, which takes the
//   new value rounded to float32; the parameter takes that, rounded once
//   into P (from C = double, the master's float32 value, as the NumPy
//   reference copies the master);
// - GF_KEEP_KAHAN: on value = (C)param + (C)comp (comp at `extra`, of type
//   P); the parameter takes value rounded into P, comp what that rounding
//   lost, value - (C)param, rounded into P;
// - GF_KEEP_STOCHASTIC: on the parameter, rounded into it at random
//   (gf_store_stochastic), with the draw of element i at `step`, the row's
//   count after this step.
// The operations and their order are gpuflat._src.backends.numpy_backend's
// _kept_update. The word's fields are the same for every element of a row,
// so each switch takes one way in a warp. seen(i, held, new value) with
// held the value R::math started from (the parameter, its master copy, or
// parameter + compensation) and the new value before it is kept.
template <class R, class P, class K, class Seen = gf_unseen>
__device__ __forceinline__ void gf_rule_mixed_one(const ParamRow& r, long long i, const K& k, unsigned step,
                                                  Seen seen = {}) {
    using C = typename gf_compute<P>::type;
    const int keep = gf_row_keep(r.precision);
    P* const p = (P*)r.param;
    C pc;
    if (keep == GF_KEEP_MASTER) pc = gf_load<C>(((const float*)r.extra)[i]);
    else if (keep == GF_KEEP_KAHAN) pc = gf_load<C>(p[i]) + gf_load<C>(((const P*)r.extra)[i]);
    else pc = gf_load<C>(p[i]);
    C sc[R::STATES];
#pragma unroll
    for (int t = 0; t < R::STATES; ++t) {
        const long long at = gf_row_state(r, t);
        sc[t] = at != 0 && gf_rule_uses(k, t) ? gf_load_field<P, C>(at, gf_state_field(r.precision, t), i) : (C)0;
    }
    const C held = pc;
    R::math(pc, gf_load<C>(((const P*)r.grad)[i]), sc, k);
    seen(i, held, pc);
#pragma unroll
    for (int t = 0; t < R::STATES; ++t) {
        const long long at = gf_row_state(r, t);
        if (at != 0 && gf_rule_uses(k, t)) gf_store_field<P>(at, gf_state_field(r.precision, t), i, sc[t]);
    }
    if (keep == GF_KEEP_MASTER) {
        float& master = ((float*)r.extra)[i];
        gf_store(master, pc);
        gf_store(p[i], gf_load<C>(master));
    } else if (keep == GF_KEEP_KAHAN) {
        P q;
        gf_store(q, pc);
        p[i] = q;
        gf_store(((P*)r.extra)[i], pc - gf_load<C>(q));
    } else if (keep == GF_KEEP_STOCHASTIC) {
        gf_store_stochastic(p[i], pc, gf_stochastic_bits(gf_row_key(r.precision), step, (unsigned long long)i));
    } else {
        gf_store(p[i], pc);
    }
}
