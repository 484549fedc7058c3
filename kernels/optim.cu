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
// leaves everything as it was, decided on the device). AdamW's vmax
// (max_exp_avg_sq) is read only for the groups with amsgrad: null where
// none has it.
#include "gpuflat_optim.cuh"
// The rules' kernel structs, their headers included, and their lists
// GF_RULES and GF_GENERIC_RULES (written from gpuflat._src.layout.RULES).
#include "gpuflat_rule_includes.h"
#include "gpuflat_rules.h"

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
              S* vmax, const double* __restrict__ total, double max_norm, double eps, long long clip,
              const double* __restrict__ amp) {
    using C = typename gf_compute<S>::type;
    const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
    gf_for_param_items(items, n_items, slot_group, hyper, steps, amp, [&](const double* h, double step, long long first,
                                                                          long long n) {
        gf_adamw_range<GF_WARP>(p, g, m, v, vmax, first, n, gf_adamw_setup<C>(h, step, factor, h[0]));
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

// A generic rule R (gpuflat_optim.cuh) over a flat buffer: its states in
// s0... (GF_GENERIC_STATES arguments, those past R::STATES unread).
template <class R, class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_rule(const Item* __restrict__ items, long long n_items, const long long* __restrict__ slot_group,
             const double* __restrict__ hyper, const double* __restrict__ steps, S* p, const S* g, S* s0, S* s1,
             S* s2, const double* __restrict__ total, double max_norm, double eps, long long clip,
             const double* __restrict__ amp) {
    static_assert(R::STATES >= 1 && R::STATES <= GF_GENERIC_STATES, "a generic rule keeps 1 to 3 state tensors");
    using C = typename gf_compute<S>::type;
    S* const all[GF_GENERIC_STATES] = {s0, s1, s2};
    S* s[R::STATES];
#pragma unroll
    for (int t = 0; t < R::STATES; ++t) s[t] = all[t];
    const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
    gf_for_param_items(items, n_items, slot_group, hyper, steps, amp, [&](const double* h, double step, long long first,
                                                                          long long n) {
        gf_rule_range<R, GF_WARP>(p, g, s, first, n, R::template setup<C>(h, step, factor, h[0]));
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
// fn(row, item, lane, it) for every item `it` of a row, one warp each,
// grid-stride; nothing runs when amp says to skip the step.
template <class Fn>
__device__ __forceinline__ void gf_for_row_items(const Item* __restrict__ items, long long n_items,
                                                 const ParamRow* __restrict__ rows, const double* __restrict__ amp,
                                                 Fn fn) {
    if (amp[1] != 0.0) return;
    gf_for_items(items, n_items, [&](long long it, const Item& item, int lane) {
        fn(rows[item.slot], item, lane, it);
    });
}

// ---------------------------------------------------------------- update statistics
// The row kernels' instantiations with STATS (the *_stats kernels below)
// also sum, over each work item, d^2 and w^2 of its elements (w: the value
// the rule produced, in the compute type before it is rounded into storage;
// d = w - held, held: the value it started from, gf_unseen's), and write
// the two sums to partial[2 * it] and partial[2 * it + 1]; gpuflat_row_stats
// then adds each row's items. Nothing else is read or written: the sums
// come from values the update holds anyway.
//
// A lane adds a 16-byte vector's terms (at most 8) in the compute type C,
// each d * d and w * w rounded once, then that sum to its own sums, also in
// C; an element outside the vectors alone. A lane's sums over an item are
// thus two levels of at most 8 and 32 terms, all positive: within about 40
// roundings of C (2.4e-6 relative for float at worst, a few 1e-7 in
// practice) of the exact sums; 128 roundings at worst where an item takes
// no vectors (a tensor off its 16-byte alignment). The lanes' sums meet in double, in a fixed
// tree of shuffles, so an item's sums are the same bits on every run and
// grid. Double sums per lane would be closer, but their two more registers
// make the 16-bit AdamW rows spill under every gated NVRTC
// (tests/test_kernel_resources.py); float ones spill under none of
// CUDA 12.6, 12.9 and 13.0 for sm_90. Without STATS every member does
// nothing, and the kernels compile to what they were.
template <bool STATS, class L>
struct gf_lane_stats {
    // A vector's sums, in the compute type C (L, the lane's sums' type, too).
    template <class C>
    struct part {
        __device__ __forceinline__ void element(C, C) {}
    };
    template <class C>
    __device__ __forceinline__ void add(const part<C>&) {}
    template <class C>
    __device__ __forceinline__ void element(C, C) {}
    __device__ __forceinline__ void write(double* __restrict__, long long) {}
};

template <class L>
struct gf_lane_stats<true, L> {
    L d2 = (L)0, w2 = (L)0;

    template <class C>
    struct part {
        C d2 = (C)0, w2 = (C)0;
        __device__ __forceinline__ void element(C held, C w) {
            const C d = w - held;
            d2 = d2 + d * d;
            w2 = w2 + w * w;
        }
    };
    template <class C>
    __device__ __forceinline__ void add(const part<C>& s) {
        d2 = d2 + (L)s.d2;
        w2 = w2 + (L)s.w2;
    }
    template <class C>
    __device__ __forceinline__ void element(C held, C w) {
        part<C> s;
        s.element(held, w);
        add(s);
    }
    // The warp's sums (every lane calls it), written by lane 0: lane 0 ends
    // with ((l0 + l16) + (l8 + l24)) + ..., whatever the grid.
    __device__ __forceinline__ void write(double* __restrict__ partial, long long it) {
        double a = (double)d2, b = (double)w2;
#pragma unroll
        for (int off = GF_WARP / 2; off > 0; off >>= 1) {
            a += __shfl_down_sync(GF_FULL_MASK, a, off);
            b += __shfl_down_sync(GF_FULL_MASK, b, off);
        }
        if (gf_lane() == 0) {
            partial[2 * it] = a;
            partial[2 * it + 1] = b;
        }
    }
};


// Each row's statistics: stats[2 * row] and stats[2 * row + 1] the sums of
// d^2 and w^2 over its items' partials (the row kernels'), its items
// row_items[row] to row_items[row + 1] (a row's items are consecutive),
// one warp per row: lane l adds items l, l + 32, ... in order, and the
// lanes meet in a fixed tree, so the bits depend on neither the grid nor the
// run. A row without elements gets zeros, and so does every row of a step
// that amp skips (its row kernel wrote no partial).
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_row_stats(const long long* __restrict__ row_items, long long n_rows, const double* __restrict__ partial,
                  const double* __restrict__ amp, double* __restrict__ stats) {
    const bool skip = amp[1] != 0.0;
    const long long nwarps = gf_warp_count();
    for (long long row = gf_global_warp(); row < n_rows; row += nwarps) {
        double a = 0.0, b = 0.0;
        if (!skip) {
            const long long end = row_items[row + 1];
#pragma unroll 1
            for (long long k = row_items[row] + gf_lane(); k < end; k += GF_WARP) {
                a += partial[2 * k];
                b += partial[2 * k + 1];
            }
        }
#pragma unroll
        for (int off = GF_WARP / 2; off > 0; off >>= 1) {
            a += __shfl_down_sync(GF_FULL_MASK, a, off);
            b += __shfl_down_sync(GF_FULL_MASK, b, off);
        }
        if (gf_lane() == 0) {
            stats[2 * row] = a;
            stats[2 * row + 1] = b;
        }
    }
}

// A 16-byte vector's elements in the compute type, a group of GROUP at a
// time (a 32-bit word of two elements where the type has gf_pair, else one
// element), and back, each rounded once as gf_store rounds it.
template <class S> struct gf_group { static constexpr int GROUP = gf_pair<S>::value ? 2 : 1; };

__device__ __forceinline__ unsigned& gf_word(int4& r, int i) {
    return reinterpret_cast<unsigned&>(i == 0 ? r.x : i == 1 ? r.y : i == 2 ? r.z : r.w);
}

template <class S, class C>
__device__ __forceinline__ void gf_unpack(gf_vec<S>& x, int group, C (&c)[gf_group<S>::GROUP]) {
    if constexpr (gf_group<S>::GROUP == 1) {
        c[0] = gf_load<C>(x.v[group]);
    } else {
        const unsigned w = gf_word(x.raw, group);
        c[0] = gf_pair<S>::lo(w);
        c[1] = gf_pair<S>::hi(w);
    }
}

template <class S, class C>
__device__ __forceinline__ void gf_pack(gf_vec<S>& x, int group, const C (&c)[gf_group<S>::GROUP]) {
    if constexpr (gf_group<S>::GROUP == 1) gf_store(x.v[group], c[0]);
    else gf_word(x.raw, group) = gf_pair<S>::join(c[0], c[1]);
}

// x, as a value the compiler cannot see through: what is computed from it
// is computed again there rather than kept from an earlier computation.
__device__ __forceinline__ int gf_opaque(int x) {
#ifdef __CUDA_ARCH__
    asm("" : "+r"(x));
#endif
    return x;
}

// An item of a row whose N tensors start at base[0..N): one(i) for each of
// the lane's elements i outside whole 16-byte vectors, then, where
// `vectors` says every tensor's item starts 16-byte aligned, vec(load,
// store) for each of the lane's whole vectors (lane, lane + 32, ...), where
// load(t) and store(t) are that vector's address in tensor t; without
// `vectors`, one(i) for all. An element's update never depends on another's,
// so neither the grouping nor the order changes a bit.
//
// The loop costs little per vector: the tail goes first, so the base
// pointers are dead by the vector loop; the vector index is 32-bit (an item
// holds at most gpuflat._src.layout.ITEM elements), so an address is one
// IMAD.WIDE from the item's start; and a store address is computed again
// after the update instead of held through it, which left the 16-bit AdamW
// kernels a register short (a spill).
template <class S, int N, class Vec, class One>
__device__ __forceinline__ void gf_row_item(S* const (&base)[N], const Item& item, int lane, bool vectors,
                                            Vec vec, One one) {
    constexpr int V = gf_vec<S>::V;
    const int whole = vectors ? (int)(item.len / V) : 0;
#pragma unroll 1
    for (long long i = (long long)whole * V + lane; i < item.len; i += GF_WARP) one(item.start + i);
    int4* start[N];
#pragma unroll
    for (int t = 0; t < N; ++t) start[t] = (int4*)(base[t] + item.start);
#pragma unroll 1
    for (int j = lane; j < whole; j += GF_WARP)
        vec([&](int t) { return start[t] + j; }, [&](int t) { return start[t] + gf_opaque(j); });
}

template <class... A>
__device__ __forceinline__ bool gf_all_aligned(A... addresses) {
    return ((addresses | ...) & 15) == 0;
}

// The vector body of a row item over N tensors (0: the parameter, 1: its
// gradient, only read; the others written back), for one lane's 16-byte
// vector of each (load(u), store(u): its address in tensor u): each vector
// loaded once, unpacked into the compute type a group of E elements at a
// time, element(c, e) updating element e of the group in place (c[u][e]:
// tensor u's), then packed and stored once.
template <class S, int N, class Load, class Store, class Element>
__device__ __forceinline__ void gf_vectors(Load load, Store store, Element element) {
    using C = typename gf_compute<S>::type;
    constexpr int E = gf_group<S>::GROUP;
    gf_vec<S> x[N];
#pragma unroll
    for (int u = 0; u < N; ++u) x[u].raw = *load(u);
#pragma unroll
    for (int i = 0; i < gf_vec<S>::V / E; ++i) {
        C c[N][E];
#pragma unroll
        for (int u = 0; u < N; ++u) gf_unpack(x[u], i, c[u]);
#pragma unroll
        for (int e = 0; e < E; ++e) element(c, e);
#pragma unroll
        for (int u = 0; u < N; ++u)
            if (u != 1) gf_pack(x[u], i, c[u]);
    }
#pragma unroll
    for (int u = 0; u < N; ++u)
        if (u != 1) *store(u) = x[u].raw;  // the gradient is only read
}

// An AdamW row's item over its N tensors (4: param, grad, exp_avg,
// exp_avg_sq; 5: and max_exp_avg_sq, for amsgrad), whole vectors where all
// start 16-byte aligned and a float row may divide through the reciprocal.
template <int N, bool BY_PRODUCT, class S, class Stats>
__device__ __forceinline__ void gf_adamw_row_item(const ParamRow& r, const Item& item, int lane,
                                                  const gf_adamw_coefs<typename gf_compute<S>::type>& k,
                                                  Stats& stats) {
    using C = typename gf_compute<S>::type;
    constexpr int E = gf_group<S>::GROUP;
    S* t[N];
    t[0] = (S*)r.param;
    t[1] = (S*)r.grad;
    t[2] = (S*)r.state0;
    t[3] = (S*)r.state1;
    if constexpr (N == 5) t[4] = (S*)r.state2;
    const long long at = item.start * (long long)sizeof(S);
    bool aligned = gf_all_aligned(r.param + at, r.grad + at, r.state0 + at, r.state1 + at);
    if constexpr (N == 5) aligned = aligned && gf_all_aligned(r.state2 + at);
    gf_row_item(t, item, lane, (!BY_PRODUCT || k.unbias_by_product) && aligned,
        [&](auto load, auto store) {
            typename Stats::template part<C> sums;
            // c: param, grad, exp_avg, exp_avg_sq(, max_exp_avg_sq)
            gf_vectors<S, N>(load, store, [&](C (&c)[N][E], int e) {
                const C held = c[0][e];
                if constexpr (N == 5) gf_amsgrad_math<BY_PRODUCT>(c[0][e], c[1][e], c[2][e], c[3][e], c[4][e], k);
                else gf_adamw_math<BY_PRODUCT>(c[0][e], c[1][e], c[2][e], c[3][e], k);
                sums.element(held, c[0][e]);
            });
            stats.add(sums);
        },
        [&](long long i) {
            const auto seen = [&](long long, C held, C w) { stats.element(held, w); };
            if constexpr (N == 5) gf_amsgrad_one(t[0][i], t[1][i], t[2][i], t[3][i], t[4][i], k, i, seen);
            else gf_adamw_one(t[0][i], t[1][i], t[2][i], t[3][i], k, i, seen);
        });
}

// AdamW over a table of rows. AMSGRAD: the instantiation for a step where
// some group has amsgrad, which takes max_exp_avg_sq in those groups' rows;
// the other keeps the rows of every step without amsgrad within the
// resource gates of a hot kernel. STATS: with the update statistics
// (gf_lane_stats) written to `partial`.
template <class S, bool AMSGRAD, bool STATS>
__device__ __forceinline__ void gf_adamw_rows(const Item* __restrict__ items, long long n_items,
                                              const ParamRow* __restrict__ rows, const double* __restrict__ hyper,
                                              const long long* __restrict__ lr_at, const double* __restrict__ total,
                                              double max_norm, double eps, long long clip,
                                              const double* __restrict__ amp, double* __restrict__ partial) {
    using C = typename gf_compute<S>::type;
    // Float vectors divide by bc2_sqrt through its reciprocal (gf_unbias); a
    // float row that may not goes one element at a time, dividing.
    constexpr bool BY_PRODUCT = gf_same<C, float>::value;
    gf_for_row_items(items, n_items, rows, amp, [&](const ParamRow& r, const Item& item, int lane, long long it) {
        const double* h = hyper + r.group * GF_HYPER;
        // The factor is computed again for each item, from the kernel's
        // arguments, rather than held across items: a group's maximize makes
        // the row's factor differ from the kernel's, and holding both cost the
        // 16-bit rows a register (a spill under CUDA 13.5).
        const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
        const auto k = gf_adamw_setup<C>(h, gf_adamw_row_step(r), factor, gf_group_lr(h, lr_at, r.group));
        gf_lane_stats<STATS, C> stats;
        if constexpr (AMSGRAD) {
            if (k.amsgrad) {
                gf_adamw_row_item<5, BY_PRODUCT, S>(r, item, lane, k, stats);
                return stats.write(partial, it);
            }
        }
        gf_adamw_row_item<4, BY_PRODUCT, S>(r, item, lane, k, stats);
        stats.write(partial, it);
    });
}

template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_adamw_rows(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                   const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                   const double* __restrict__ total, double max_norm, double eps, long long clip,
                   const double* __restrict__ amp) {
    gf_adamw_rows<S, false, false>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, nullptr);
}

// The same with the update statistics (gf_lane_stats): each item's sums in
// partial (2 doubles per item), every other word as gpuflat_adamw_rows.
template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_adamw_rows_stats(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                         const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                         const double* __restrict__ total, double max_norm, double eps, long long clip,
                         const double* __restrict__ amp, double* __restrict__ partial) {
    gf_adamw_rows<S, false, true>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, partial);
}

// Five 16-byte vectors per lane and five row addresses do not fit the 64
// registers of four blocks per SM for 16-bit rows (ptxas spilled 40 to 48
// bytes): three blocks per SM give each thread 85, and
// still keep 3 * 256 lanes' five vector loads in flight.
template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_AMSGRAD_MIN_BLOCKS_PER_SM)
gpuflat_adamw_amsgrad_rows(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                           const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                           const double* __restrict__ total, double max_norm, double eps, long long clip,
                           const double* __restrict__ amp) {
    gf_adamw_rows<S, true, false>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, nullptr);
}

template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_AMSGRAD_MIN_BLOCKS_PER_SM)
gpuflat_adamw_amsgrad_rows_stats(const Item* __restrict__ items, long long n_items,
                                 const ParamRow* __restrict__ rows, const double* __restrict__ hyper,
                                 const long long* __restrict__ lr_at, const double* __restrict__ total,
                                 double max_norm, double eps, long long clip, const double* __restrict__ amp,
                                 double* __restrict__ partial) {
    gf_adamw_rows<S, true, true>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, partial);
}

// SGD over a table of rows; STATS as gf_adamw_rows'.
template <class S, bool STATS>
__device__ __forceinline__ void gf_sgd_rows(const Item* __restrict__ items, long long n_items,
                                            const ParamRow* __restrict__ rows, const double* __restrict__ hyper,
                                            const long long* __restrict__ lr_at, const double* __restrict__ total,
                                            double max_norm, double eps, long long clip,
                                            const double* __restrict__ amp, double* __restrict__ partial) {
    using C = typename gf_compute<S>::type;
    constexpr int E = gf_group<S>::GROUP;
    const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
    gf_for_row_items(items, n_items, rows, amp, [&](const ParamRow& r, const Item& item, int lane, long long it) {
        const double* h = hyper + r.group * GF_HYPER;
        const auto k = gf_sgd_setup<C>(h, gf_sgd_row_step(r, h), factor, gf_group_lr(h, lr_at, r.group));
        // Without momentum there is no buffer: address 0, aligned, never read
        // or written.
        S* const t[3] = {(S*)r.param, (S*)r.grad, (S*)r.state0};
        const long long at = item.start * (long long)sizeof(S);
        gf_lane_stats<STATS, C> stats;
        gf_row_item(t, item, lane, gf_all_aligned(r.param + at, r.grad + at, k.has_momentum ? r.state0 + at : 0, 0),
            [&](auto load, auto store) {
                typename gf_lane_stats<STATS, C>::template part<C> sums;
                gf_vec<S> P, G, B;
                P.raw = *load(0);
                G.raw = *load(1);
                B.raw = k.has_momentum && !k.first ? *load(2) : int4{0, 0, 0, 0};
#pragma unroll
                for (int i = 0; i < gf_vec<S>::V / E; ++i) {
                    C p[E], g[E], b[E];
                    gf_unpack(P, i, p);
                    gf_unpack(G, i, g);
                    gf_unpack(B, i, b);
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        const C held = p[e];
                        gf_sgd_math(p[e], g[e], b[e], k);
                        sums.element(held, p[e]);
                    }
                    gf_pack(P, i, p);
                    gf_pack(B, i, b);
                }
                *store(0) = P.raw;
                if (k.has_momentum) *store(2) = B.raw;
                stats.add(sums);
            },
            [&](long long i) {
                gf_sgd_one(t[0][i], t[1][i], t[2][i], k, i, [&](long long, C held, C w) { stats.element(held, w); });
            });
        stats.write(partial, it);
    });
}

template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_sgd_rows(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                 const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                 const double* __restrict__ total, double max_norm, double eps, long long clip,
                 const double* __restrict__ amp) {
    gf_sgd_rows<S, false>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, nullptr);
}

template <class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_sgd_rows_stats(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                       const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                       const double* __restrict__ total, double max_norm, double eps, long long clip,
                       const double* __restrict__ amp, double* __restrict__ partial) {
    gf_sgd_rows<S, true>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, partial);
}

// A generic rule R (gpuflat_optim.cuh) over a table of rows: whole 16-byte
// vectors where every tensor's item starts aligned, as the AdamW rows;
// STATS as gf_adamw_rows'.
template <class R, class S, bool STATS>
__device__ __forceinline__ void gf_rule_rows(const Item* __restrict__ items, long long n_items,
                                             const ParamRow* __restrict__ rows, const double* __restrict__ hyper,
                                             const long long* __restrict__ lr_at, const double* __restrict__ total,
                                             double max_norm, double eps, long long clip,
                                             const double* __restrict__ amp, double* __restrict__ partial) {
    static_assert(R::STATES >= 1 && R::STATES <= GF_GENERIC_STATES, "a generic rule keeps 1 to 3 state tensors");
    using C = typename gf_compute<S>::type;
    constexpr int N = 2 + R::STATES, E = gf_group<S>::GROUP;
    gf_for_row_items(items, n_items, rows, amp, [&](const ParamRow& r, const Item& item, int lane, long long it) {
        const double* h = hyper + r.group * GF_HYPER;
        const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
        const auto k = R::template setup<C>(h, gf_rule_row_step(r), factor, gf_group_lr(h, lr_at, r.group));
        S* t[N];
        t[0] = (S*)r.param;
        t[1] = (S*)r.grad;
        const long long at = item.start * (long long)sizeof(S);
        long long addresses = (r.param + at) | (r.grad + at);
#pragma unroll
        for (int u = 0; u < R::STATES; ++u) {
            t[2 + u] = (S*)gf_row_state(r, u);
            addresses |= gf_row_state(r, u) + at;
        }
        S* s[R::STATES];
#pragma unroll
        for (int u = 0; u < R::STATES; ++u) s[u] = t[2 + u];
        gf_lane_stats<STATS, C> stats;
        gf_row_item(t, item, lane, (addresses & 15) == 0,
            [&](auto load, auto store) {
                typename gf_lane_stats<STATS, C>::template part<C> sums;
                // c: param, grad, the states
                gf_vectors<S, N>(load, store, [&](C (&c)[N][E], int e) {
                    C st[R::STATES];
#pragma unroll
                    for (int u = 0; u < R::STATES; ++u) st[u] = c[2 + u][e];
                    const C held = c[0][e];
                    R::math(c[0][e], c[1][e], st, k);
                    sums.element(held, c[0][e]);
#pragma unroll
                    for (int u = 0; u < R::STATES; ++u) c[2 + u][e] = st[u];
                });
                stats.add(sums);
            },
            [&](long long i) {
                gf_rule_one<R>(t[0], t[1], s, i, k, [&](long long, C held, C w) { stats.element(held, w); });
            });
        stats.write(partial, it);
    });
}

template <class R, class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_rule_rows(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                  const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                  const double* __restrict__ total, double max_norm, double eps, long long clip,
                  const double* __restrict__ amp) {
    gf_rule_rows<R, S, false>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, nullptr);
}

template <class R, class S>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_rule_rows_stats(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                        const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                        const double* __restrict__ total, double max_norm, double eps, long long clip,
                        const double* __restrict__ amp, double* __restrict__ partial) {
    gf_rule_rows<R, S, true>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, partial);
}

// A rule R (gpuflat_optim.cuh; AdamW and SGD as gf_adamw and gf_sgd) over a
// table of rows of parameters of type P whose precision words are not all
// 0: each state of its own dtype, the parameter kept plain, through a
// float32 master copy or with a compensation (gf_rule_mixed_one). Element by
// element per lane, with no 16-byte vector path: a row's tensors have
// different widths (a bfloat16 parameter's float32 master and states), so
// an item's elements span vectors of different counts, and a vector body
// would need one instantiation per combination of dtypes and keep. A plain
// row (word 0) in the same table gives the tuned kernels' bits. STATS as
// gf_adamw_rows'.
template <class R, class P, bool STATS>
__device__ __forceinline__ void gf_rule_mixed_rows(const Item* __restrict__ items, long long n_items,
                                                   const ParamRow* __restrict__ rows,
                                                   const double* __restrict__ hyper,
                                                   const long long* __restrict__ lr_at,
                                                   const double* __restrict__ total, double max_norm, double eps,
                                                   long long clip, const double* __restrict__ amp,
                                                   double* __restrict__ partial) {
    static_assert(R::STATES >= 1 && R::STATES <= GF_GENERIC_STATES, "a rule keeps 1 to 3 state tensors");
    using C = typename gf_compute<P>::type;
    gf_for_row_items(items, n_items, rows, amp, [&](const ParamRow& r, const Item& item, int lane, long long it) {
        const double* h = hyper + r.group * GF_HYPER;
        const double factor = gf_grad_factor(total, max_norm, eps, clip, amp);
        const double step = gf_rule_row_step(r);
        const auto k = R::template setup<C>(h, step, factor, gf_group_lr(h, lr_at, r.group));
        gf_lane_stats<STATS, C> stats;
#pragma unroll 1
        for (long long i = lane; i < item.len; i += GF_WARP)
            gf_rule_mixed_one<R, P>(r, item.start + i, k, (unsigned)step,
                                    [&](long long, C held, C w) { stats.element(held, w); });
        stats.write(partial, it);
    });
}

template <class R, class P>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_rule_mixed_rows(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                        const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                        const double* __restrict__ total, double max_norm, double eps, long long clip,
                        const double* __restrict__ amp) {
    gf_rule_mixed_rows<R, P, false>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, nullptr);
}

template <class R, class P>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_rule_mixed_rows_stats(const Item* __restrict__ items, long long n_items, const ParamRow* __restrict__ rows,
                              const double* __restrict__ hyper, const long long* __restrict__ lr_at,
                              const double* __restrict__ total, double max_norm, double eps, long long clip,
                              const double* __restrict__ amp, double* __restrict__ partial) {
    gf_rule_mixed_rows<R, P, true>(items, n_items, rows, hyper, lr_at, total, max_norm, eps, clip, amp, partial);
}

// Each counted row's step count plus one (gf_counts), unless the step is
// skipped.
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_count_steps(const ParamRow* __restrict__ rows, long long n_rows, const double* __restrict__ hyper,
                    long long counted_field, const double* __restrict__ amp) {
    if (amp[1] != 0.0) return;
    const long long stride = (long long)gridDim.x * (long long)blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n_rows; i += stride)
        if (gf_counts(rows[i], hyper, counted_field)) *(float*)rows[i].step += 1.0f;
}
