// The flat optimizers' update: one launch per dtype buffer, whatever the
// number of leaves or parameter groups.
//
// The work items are the buffer's plan's (leaves and the padding between
// them); slot_group[slot] is the slot's parameter group, or -1 for padding,
// which is never written. hyper holds GF_HYPER doubles per group and
// steps[slot] the slot's step count, already incremented on the device: the
// host changes neither between steps, so a warmed-up step can be captured in
// a CUDA graph. The clip factor comes from the norm on the device (total[0]);
// amp holds a loss scaler's unscale factor and skip flag (a nonzero amp[1]
// leaves everything as it was, decided on the device).
#include "gpuflat_optim.cuh"

// fn(h, step, first, n) for every item of a parameter (padding is skipped):
// h is its group's hyperparameter row and step its step count, and the lane
// updates the n elements first, first + GF_WARP, ... of the buffers. Nothing
// runs when amp says to skip the step.
template <class Fn>
__device__ __forceinline__ void gf_for_param_items(const Item* __restrict__ items, long long n_items,
                                                   const long long* __restrict__ slot_group,
                                                   const double* __restrict__ hyper,
                                                   const double* __restrict__ steps, const double* __restrict__ amp,
                                                   Fn fn) {
    if (amp[1] != 0.0) return;
    gf_for_items(items, n_items, [&](long long, const Item& item, int lane) {
        const long long grp = slot_group[item.slot];
        if (grp < 0 || lane >= item.len) return;
        fn(hyper + grp * GF_HYPER, steps[item.slot], item.flat + lane, (item.len - lane + GF_WARP - 1) / GF_WARP);
    });
}

template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_adamw(const Item* __restrict__ items, long long n_items, const long long* __restrict__ slot_group,
              const double* __restrict__ hyper, const double* __restrict__ steps, S* p, const S* g, S* m, S* v,
              const double* __restrict__ total, double max_norm, double eps, long long clip,
              const double* __restrict__ amp) {
    using C = typename gf_compute<S>::type;
    const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
    gf_for_param_items(items, n_items, slot_group, hyper, steps, amp, [&](const double* h, double step, long long first,
                                                                          long long n) {
        gf_adamw_range<GF_WARP>(p, g, m, v, first, n, gf_adamw_setup<C>(h, step, factor, h[0]));
    });
}

template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_sgd(const Item* __restrict__ items, long long n_items, const long long* __restrict__ slot_group,
            const double* __restrict__ hyper, const double* __restrict__ steps, S* p, const S* g, S* buf,
            const double* __restrict__ total, double max_norm, double eps, long long clip,
            const double* __restrict__ amp) {
    using C = typename gf_compute<S>::type;
    const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
    gf_for_param_items(items, n_items, slot_group, hyper, steps, amp, [&](const double* h, double step, long long first,
                                                                          long long n) {
        gf_sgd_range<GF_WARP>(p, g, buf, first, n, gf_sgd_setup<C>(h, step, factor, h[0]));
    });
}

// ---------------------------------------------------------------- tensor lists
// The update of PyTorch's parameters where they are (gpuflat.torch.AdamW and
// SGD): one launch per device and dtype over a table of ParamRow, whatever
// the number of parameters or groups. The work items split each row's
// elements (slot = row); the table, the items and the hyperparameters are
// all the host writes, so a warmed-up step can be captured in a CUDA graph.
// Step counts are read here (the count after this step is the stored one
// plus 1, as PyTorch adds before it updates) and written by
// gpuflat_count_steps afterwards, so no item reads a count another has
// already moved.
// fn(row, item) for every item of a row, one warp each, grid-stride;
// nothing runs when amp says to skip the step.
template <class Fn>
__device__ __forceinline__ void gf_for_row_items(const Item* __restrict__ items, long long n_items,
                                                 const ParamRow* __restrict__ rows, const double* __restrict__ amp,
                                                 Fn fn) {
    if (amp[1] != 0.0) return;
    gf_for_items(items, n_items, [&](long long, const Item& item, int lane) { fn(rows[item.slot], item, lane); });
}

// one(i) or, where every tensor's item starts 16-byte aligned, one(i) for
// whole 16-byte vectors of each: lane l takes vectors l, l + 32, ... of the
// item (loaded whole, updated element by element, stored whole), then the
// elements past the last whole vector one at a time. An element's update
// never depends on another's, so the grouping changes no bit.
template <class S, class Vec, class One>
__device__ __forceinline__ void gf_row_item(const Item& item, int lane, bool aligned, Vec vec, One one) {
    constexpr int V = gf_vec<S>::V;
    long long i = lane;
    if (aligned) {
        const long long whole = item.len / V;
        for (long long j = lane; j < whole; j += GF_WARP) vec(item.start / V + j);
        i = whole * V + lane;
    }
    for (; i < item.len; i += GF_WARP) one(item.start + i);
}

__device__ __forceinline__ bool gf_all_aligned(long long a, long long b, long long c, long long d) {
    return ((a | b | c | d) & 15) == 0;
}

template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_adamw_rows(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                   const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                   const double* __restrict__ total, double max_norm, double eps, long long clip,
                   const double* __restrict__ amp) {
    using C = typename gf_compute<S>::type;
    const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
    gf_for_row_items(items, n_items, rows, amp, [&](const ParamRow& r, const Item& item, int lane) {
        const double* h = hyper + r.group * GF_HYPER;
        const double step = (double)*(const float*)r.step + 1.0;
        const auto k = gf_adamw_setup<C>(h, step, factor, gf_group_lr(h, lr_at, r.group));
        S *p = (S*)r.param, *m = (S*)r.state0, *v = (S*)r.state1;
        const S* g = (const S*)r.grad;
        const long long at = item.start * (long long)sizeof(S);
        gf_row_item<S>(item, lane, gf_all_aligned(r.param + at, r.grad + at, r.state0 + at, r.state1 + at),
            [&](long long j) {
                gf_vec<S> P, G, M, W;
                P.raw = ((const int4*)p)[j];
                G.raw = ((const int4*)g)[j];
                M.raw = ((const int4*)m)[j];
                W.raw = ((const int4*)v)[j];
#pragma unroll
                for (int e = 0; e < gf_vec<S>::V; ++e) gf_adamw_one(P.v[e], G.v[e], M.v[e], W.v[e], k);
                ((int4*)p)[j] = P.raw;
                ((int4*)m)[j] = M.raw;
                ((int4*)v)[j] = W.raw;
            },
            [&](long long i) { gf_adamw_one(p[i], g[i], m[i], v[i], k); });
    });
}

template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_sgd_rows(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                 const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                 const double* __restrict__ total, double max_norm, double eps, long long clip,
                 const double* __restrict__ amp) {
    using C = typename gf_compute<S>::type;
    const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
    gf_for_row_items(items, n_items, rows, amp, [&](const ParamRow& r, const Item& item, int lane) {
        const double* h = hyper + r.group * GF_HYPER;
        // gf_sgd_setup tells the momentum buffer's first step by a count of 1.
        const double step = (r.flags & GF_ROW_FIRST) ? 1.0 : 2.0;
        const auto k = gf_sgd_setup<C>(h, step, factor, gf_group_lr(h, lr_at, r.group));
        S *p = (S*)r.param, *buf = (S*)r.state0;
        const S* g = (const S*)r.grad;
        // Without momentum there is no buffer: address 0, aligned, never read.
        const long long at = item.start * (long long)sizeof(S);
        gf_row_item<S>(item, lane, gf_all_aligned(r.param + at, r.grad + at, k.has_momentum ? r.state0 + at : 0, 0),
            [&](long long j) {
                gf_vec<S> P, G, B;
                B.raw = int4{0, 0, 0, 0};
                P.raw = ((const int4*)p)[j];
                G.raw = ((const int4*)g)[j];
                if (k.has_momentum && !k.first) B.raw = ((const int4*)buf)[j];
#pragma unroll
                for (int e = 0; e < gf_vec<S>::V; ++e) gf_sgd_one(P.v[e], G.v[e], B.v[e], k);
                ((int4*)p)[j] = P.raw;
                if (k.has_momentum) ((int4*)buf)[j] = B.raw;
            },
            [&](long long i) {
                S none{};
                gf_sgd_one(p[i], g[i], k.has_momentum ? buf[i] : none, k);
            });
    });
}

// Each row's step count plus one, unless the step is skipped.
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_count_steps(const ParamRow* __restrict__ rows, long long n_rows, const double* __restrict__ amp) {
    if (amp[1] != 0.0) return;
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_rows; i += stride)
        if (rows[i].step != 0) *(float*)rows[i].step += 1.0f;
}
