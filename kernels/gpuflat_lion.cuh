// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms",
// https://arxiv.org/abs/2302.06675) as a rule of the generic kernels (the
// rule protocol in gpuflat_optim.cuh; gpuflat._src.layout.RULES["lion"]):
//   u = sign(beta1 * m + (1 - beta1) * g)
//   p = p * (1 - lr * weight_decay) - lr * u
//   m = beta2 * m + (1 - beta2) * g
// in lion-pytorch's order (https://github.com/lucidrains/lion-pytorch: the
// decay first, then the signed step, then the moment), every operation
// rounded in the compute type. sign(0) is 0 and sign(NaN) NaN, as torch.sign.
#pragma once
#include "gpuflat_optim.cuh"

struct gf_lion {
    static constexpr int STATES = 1;  // exp_avg

    template <class C>
    struct coefs {
        // clip: the group's factor (gf_group_factor).
        C clip, decay, neg_lr, beta1, one_minus_beta1, beta2, one_minus_beta2;
    };

    template <class C>
    static __device__ __forceinline__ coefs<C> setup(const double* h, double, double factor, double lr) {
        return {gf_group_factor(h, (C)factor), (C)(1.0 - lr * h[1]), (C)(-lr), (C)h[2], (C)(1.0 - h[2]), (C)h[3],
                (C)(1.0 - h[3])};
    }

    template <class C>
    static __device__ __forceinline__ void math(C& p, C g, C (&s)[STATES], const coefs<C>& k) {
        const C gc = g * k.clip, m = s[0];
        const C c = m * k.beta1 + k.one_minus_beta1 * gc;
        const C u = c > (C)0 ? (C)1 : c < (C)0 ? (C)-1 : c == (C)0 ? (C)0 : c;
        p = p * k.decay + k.neg_lr * u;
        s[0] = m * k.beta2 + k.one_minus_beta2 * gc;
    }
};
