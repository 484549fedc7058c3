// Fused norms (total, per leaf, first non-finite leaf) in two launches (one
// where no leaf's own norm is asked for: gpuflat_norm_one), and the clipping
// scale in one, with no host synchronisation.
//
// The summation order: every norm of every front end and backend but NumPy's
// (gpuflat._src.clipping describes NumPy's) is these bits.
//  1. Each element's term |x|**p in double (gf_term; |x| for the inf-norm).
//  2. The leaves in the plan's order, each cut into chunks (work items) of
//     ITEM elements (gpuflat._src.layout) from its own first element: where a leaf lies in memory,
//     and what lies between leaves, changes no chunk. A leaf filling one dense
//     block of memory in another order than C's (transposed, channels_last,
//     reversed) comes as the contiguous row of that block
//     (gpuflat._src.memory_order), so it is read in memory order; any other leaf in
//     its logical (C) order.
//  3. A chunk's partial: vector j of the chunk (16 bytes) is lane j % 32's,
//     each lane combines its terms in order from 0.0, then lane 0 ends with
//     the fixed shuffle-down tree ((l0+l16)+(l8+l24))+... (kernel 1).
//  4. The unrooted total: the chunks' partials in order k = 0, 1, ... over
//     all leaves, thread t of GF_FINISH_THREADS combining k = t (mod
//     GF_FINISH_THREADS) in increasing k from 0.0, then the fixed tree over
//     the threads (gf_block_reduce); the root is taken once, of that total.
//     Leaf boundaries enter only through the chunks, so the total's work is
//     one pass over the partials whatever the leaf count, the per-leaf norms
//     are computed only when asked for, and any split of the same chunks
//     (several front ends' tables, many leaves packed into one work item)
//     gives the same bits.
//  5. A leaf's own norm (when asked for): its chunks' partials, from 0.0 in
//     chunk order for at most GF_SMALL_SLOT_ITEMS of them, else in step 4's
//     order over its chunks alone; then its root.
//  6. The first non-finite leaf: the least slot one of whose chunks holds a
//     NaN or inf element.
// Neither the grid of kernel 1 nor the run changes a bit. The one atomic
// (gpuflat_norm_one's ticket) decides only which block finishes, never an order.
#include "gpuflat_math.cuh"

// Vectors in flight per lane (gf_item_loop's U): the kind's choice
// (gf_norm in gpuflat_math.cuh) for real or complex leaves.
template <int K, class S>
constexpr int gf_norm_unroll() {
    return gf_is_complex<S>::value ? gf_norm<K>::unroll_complex() : gf_norm<K>::unroll();
}

// A lane's share of one item: its sum (or max) of terms, and whether it met
// a NaN or inf.
struct gf_lane_sum {
    double acc;
    int bad;
};

// Whether a lane's accumulated value alone tells that it met a NaN or inf:
// where the kind allows it (gf_norm's bad_from_sum: every finite element's
// term is finite, any sum of them far inside double's range, while a NaN or
// inf term makes the sum non-finite) for elements no wider than float (those
// that compute in float, gf_compute). A double's square can overflow: its
// elements are checked one by one.
template <int K, class S>
constexpr bool gf_bad_from_sum() {
    return gf_norm<K>::bad_from_sum() && gf_same<typename gf_compute<S>::type, float>::value;
}

template <int K, class S>
__device__ __forceinline__ void gf_add_terms(gf_lane_sum& s, S (&v)[gf_vec<S>::V], int n, double p) {
    gf_for_each(v, n, [&](S x) {
        const gf_wide w = gf_widen(x);
        if constexpr (!gf_bad_from_sum<K, S>()) s.bad |= !(isfinite(w.re) && isfinite(w.im));
        s.acc = gf_combine<K>(s.acc, gf_term<K, gf_is_complex<S>::value>(w, p));
    });
}

// A lane's share of one item of leaf L, of element type S.
template <int K, class S, class Leaf>
__device__ __forceinline__ gf_lane_sum gf_item_terms(const Leaf& L, const Item& item, int lane, double p) {
    gf_lane_sum s = {0.0, 0};
    gf_leaf_loop<S, true, false, gf_norm_unroll<K, S>()>(L, item, lane, [&](long long, S (&v)[gf_vec<S>::V], int n) {
        gf_add_terms<K>(s, v, n, p);
    });
    if constexpr (gf_bad_from_sum<K, S>()) s.bad = !isfinite(s.acc);
    return s;
}

// An item's non-finite flag when it holds no NaN or inf: above every item
// index (far below 2^53), so the least flag is the first bad item, whose slot
// is the first bad slot (items are sorted by slot).
#define GF_NO_ITEM 9007199254740992.0

// Kernel 1's work: one warp per work item (grid-stride). partial[it] is the
// item's sum (or max) of terms and partial[n_items + it] its index `it` if
// the item holds a NaN or inf, else GF_NO_ITEM (the index, not the slot,
// which would hold one more register through the item's loop): every item
// writes both, so the scratch needs no clearing (no memset launch).
template <int K>
__device__ __forceinline__ void gf_norm_partials(const Item* __restrict__ items, long long n_items,
                                                 const LeafRef* __restrict__ leaves, double p, double* partial) {
    gf_for_items(items, n_items, [&](long long it, const Item& item, int lane) {
        gf_lane_sum sum = {0.0, 0};
        // The leaf's fields are loaded early where the kind allows it
        // (gf_norm's early_leaf).
        gf_on_leaf<gf_norm<K>::early_leaf()>(leaves[item.slot], [&](const auto& L, auto z) {
            sum = gf_item_terms<K, decltype(z)>(L, item, lane, p);
        });
        double acc = sum.acc;
        // Fixed tree: lane 0 ends with ((l0+l16)+(l8+l24))+... whatever the grid.
#pragma unroll
        for (int off = GF_WARP / 2; off > 0; off >>= 1)
            acc = gf_combine<K>(acc, __shfl_down_sync(GF_FULL_MASK, acc, off));
        const int bad = __any_sync(GF_FULL_MASK, sum.bad);
        if (gf_lane() == 0) {  // read again (see gf_lane)
            partial[it] = acc;
            partial[n_items + it] = bad ? (double)it : GF_NO_ITEM;
        }
    });
}

// Kernel 1 (see gf_norm_partials).
template <int K>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_norm_partial(const Item* __restrict__ items, long long n_items, const LeafRef* __restrict__ leaves,
                     double p, double* __restrict__ partial) {
    gf_norm_partials<K>(items, n_items, leaves, p, partial);
}

__device__ __forceinline__ double gf_min_double(double a, double b) { return a < b ? a : b; }

// The fixed tree over the finishing block (thread t < w takes op(its value,
// thread t + w's), w = GF_FINISH_THREADS / 2 down to 1) of `v` with `op`
// and, beside it, of `first` with min: the levels wider than a warp through
// shared memory `red` (2 * GF_FINISH_THREADS doubles), the last ones in
// warp 0 as shuffles (lane t plays thread t), so three barriers serve both
// trees. Thread 0 gets both results.
template <class Op>
__device__ __forceinline__ void gf_block_reduce(double* red, double& v, double& first, Op op) {
    const int t = (int)threadIdx.x;
    double* red_first = red + GF_FINISH_THREADS;
    red[t] = v;
    red_first[t] = first;
    __syncthreads();
#pragma unroll
    for (int w = GF_FINISH_THREADS / 2; w > GF_WARP; w >>= 1) {
        if (t < w) {
            red[t] = op(red[t], red[t + w]);
            red_first[t] = gf_min_double(red_first[t], red_first[t + w]);
        }
        __syncthreads();
    }
    if (t < GF_WARP) {
        v = op(red[t], red[t + GF_WARP]);
        first = gf_min_double(red_first[t], red_first[t + GF_WARP]);
#pragma unroll
        for (int off = GF_WARP / 2; off > 0; off >>= 1) {
            v = op(v, __shfl_down_sync(GF_FULL_MASK, v, off));
            first = gf_min_double(first, __shfl_down_sync(GF_FULL_MASK, first, off));
        }
    }
}

// The sum of partial[a .. b) in the order of gf_block_reduce over
// GF_FINISH_THREADS threads, each summing the items k = a + t (mod
// GF_FINISH_THREADS) in order, computed by ONE warp: lane l plays threads
// l + 32 r, so the tree's first levels stay inside a lane, the last five are
// shuffles, and no block barrier is needed. Lane 0 gets the sum.
template <int K>
__device__ __forceinline__ double gf_warp_slot_sum(const double* __restrict__ partial, long long a, long long b,
                                                   int lane) {
    constexpr int R = GF_FINISH_THREADS / GF_WARP;
    double r[R];
#pragma unroll
    for (int i = 0; i < R; ++i) r[i] = 0.0;
    // The R strided sums advance together, each in its own order, so a lane
    // has R independent loads in flight per step (more once unrolled), not
    // one chain of dependent additions after another.
#pragma unroll 2
    for (long long base = a + lane; base < b; base += GF_FINISH_THREADS) {
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const long long k = base + i * GF_WARP;
            if (k < b) r[i] = gf_combine<K>(r[i], partial[k]);
        }
    }
#pragma unroll
    for (int w = R / 2; w > 0; w >>= 1) {
#pragma unroll
        for (int i = 0; i < w; ++i) r[i] = gf_combine<K>(r[i], r[i + w]);
    }
    double v = r[0];
#pragma unroll
    for (int off = GF_WARP / 2; off > 0; off >>= 1) v = gf_combine<K>(v, __shfl_down_sync(GF_FULL_MASK, v, off));
    return v;
}

// Slots a finishing thread takes at once: their bounds and first items are
// loaded together, so one load latency (two where a slot's first item is not
// item s) serves all of them instead of two per slot.
constexpr int GF_FINISH_SLOTS = 8;

// A finishing thread's slots s0, s0 + T, ... (GF_FINISH_SLOTS of them; T =
// GF_FINISH_THREADS), of which the first n exist: their bounds a .. b and,
// as a guess, item s's partial, right where slot s holds exactly item s (a
// tree of leaves of one item each). Entries past the ends are left unset and
// never read.
struct gf_slot_batch {
    long long s0;
    int n;
    long long a[GF_FINISH_SLOTS], b[GF_FINISH_SLOTS];
    double x[GF_FINISH_SLOTS];
};

// How many of s0, s0 + T, ... (at most GF_FINISH_SLOTS) are below `end`; 0 or
// less if none.
__device__ __forceinline__ int gf_batch_count(long long s0, long long end) {
    const long long T = GF_FINISH_THREADS;
    return (int)gf_min(GF_FINISH_SLOTS, (end - s0 + T - 1) / T);
}

// Issues every load of the batch at s0; nothing waits for them here.
__device__ __forceinline__ void gf_load_slots(gf_slot_batch& q, long long n_items, const double* __restrict__ partial,
                                              const long long* __restrict__ slot_items, long long n_slots,
                                              long long s0) {
    q.s0 = s0;
    q.n = gf_batch_count(s0, n_slots);
    const int guessed = gf_batch_count(s0, n_items);
#pragma unroll
    for (int u = 0; u < GF_FINISH_SLOTS; ++u) {
        const long long s = s0 + u * (long long)GF_FINISH_THREADS;
        if (u < q.n) {
            q.a[u] = slot_items[s];
            q.b[u] = slot_items[s + 1];
        }
        if (u < guessed) q.x[u] = partial[s];
    }
}

// The slots of batch q, each's root into per_leaf. A big slot's raw sum is
// already in per_leaf; a small one's is 0.0 combined with its items'
// partials in item order. Where a slot's first item is not item s it is
// loaded again, from the bounds.
template <int K>
__device__ __forceinline__ void gf_finish_slots(gf_slot_batch& q, const double* __restrict__ partial, double p,
                                                double* __restrict__ per_leaf) {
    constexpr int U = GF_FINISH_SLOTS;
    const long long T = GF_FINISH_THREADS;
    // Zero where every slot here holds exactly item s (bitwise, not
    // branches: one test for the whole batch).
    long long missed = 0;
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const long long s = q.s0 + u * T;
        if (u < q.n) missed |= (q.a[u] - s) | (q.b[u] - s - 1);
    }
    if (missed == 0) {
#pragma unroll
        for (int u = 0; u < U && u < q.n; ++u) per_leaf[q.s0 + u * T] = gf_root<K>(gf_combine<K>(0.0, q.x[u]), p);
        return;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        if (u < q.n && q.a[u] < q.b[u] && q.a[u] != q.s0 + u * T) q.x[u] = partial[q.a[u]];
    }
#pragma unroll
    for (int u = 0; u < U && u < q.n; ++u) {
        const long long s = q.s0 + u * T;
        const long long a = q.a[u], b = q.b[u];
        double raw = 0.0;
        if (b - a > GF_SMALL_SLOT_ITEMS) {
            raw = per_leaf[s];
        } else if (a < b) {
            raw = gf_combine<K>(0.0, q.x[u]);
#pragma unroll 4
            for (long long k = a + 1; k < b; ++k) raw = gf_combine<K>(raw, partial[k]);
        }
        per_leaf[s] = gf_root<K>(raw, p);
    }
}

// Each slot's own norm (step 5 of the order) into per_leaf. Big slots are
// summed first: the largest one after another by the whole block (its
// threads sum the items a + t, a + t + T, ... in order, then the block's
// tree: the order gf_warp_slot_sum plays with one warp), then the others one
// warp each, all warps at once; then one pass in which thread t computes
// each of its small slots' sums (or reads a big one's) and its root.
template <int K>
__device__ __forceinline__ void gf_slot_norms(double* red, long long n_items, const double* __restrict__ partial,
                                              const long long* __restrict__ slot_items, long long n_slots,
                                              const long long* __restrict__ big_slots, long long n_big, double p,
                                              double* __restrict__ per_leaf) {
    const int t = (int)threadIdx.x;
    const int lane = t % GF_WARP;
    const long long T = GF_FINISH_THREADS;
    for (long long q = 0; q < n_big; ++q) {
        const long long s = big_slots[q], a = slot_items[s], b = slot_items[s + 1];
        if (b - a <= GF_BLOCK_SLOT_ITEMS) continue;
        double r = 0.0, unused = 0.0;
        for (long long k = a + t; k < b; k += T) r = gf_combine<K>(r, partial[k]);
        gf_block_reduce(red, r, unused, [](double x, double y) { return gf_combine<K>(x, y); });
        if (t == 0) per_leaf[s] = r;
        __syncthreads();  // red is free for the next slot
    }
    for (long long q = t / GF_WARP; q < n_big; q += T / GF_WARP) {
        const long long s = big_slots[q];
        if (slot_items[s + 1] - slot_items[s] > GF_BLOCK_SLOT_ITEMS) continue;
        const double v = gf_warp_slot_sum<K>(partial, slot_items[s], slot_items[s + 1], lane);
        if (lane == 0) per_leaf[s] = v;
    }
    __syncthreads();  // every big slot's sum is in per_leaf
    // The next batch's loads are in flight while this one is finished; two
    // batches take turns, so none is copied.
    const long long step = GF_FINISH_SLOTS * T;
    gf_slot_batch q0, q1;
    gf_load_slots(q0, n_items, partial, slot_items, n_slots, t);
    while (q0.n > 0) {
        gf_load_slots(q1, n_items, partial, slot_items, n_slots, q0.s0 + step);
        gf_finish_slots<K>(q0, partial, p, per_leaf);
        if (q1.n <= 0) break;
        gf_load_slots(q0, n_items, partial, slot_items, n_slots, q1.s0 + step);
        gf_finish_slots<K>(q1, partial, p, per_leaf);
    }
}

// Step 4 of the order and the first non-finite leaf, by one block of
// exactly GF_FINISH_THREADS threads (thread t plays finishing thread t):
// writes total[0] (the norm), total[1] (the unrooted total it is the root
// of: sum |x|**p, or the max for inf, so a sum of squares needs no squaring
// of a rounded root) and first_bad[0] (the first slot holding a NaN or inf,
// or -1). `partial` is read with plain loads: in the one-launch kernel other
// blocks wrote it during this launch, where the read-only cache may not be used.
template <int K>
__device__ __forceinline__ void gf_norm_total(double* red, const Item* __restrict__ items, long long n_items,
                                              const double* partial, double p, double* __restrict__ total,
                                              long long* __restrict__ first_bad) {
    const int t = (int)threadIdx.x;
    const long long T = GF_FINISH_THREADS;
    // The first bad item, as a double (see GF_NO_ITEM).
    double v = 0.0, first = GF_NO_ITEM;
    // A thread's partials are loaded GF_FINISH_SLOTS at a time and combined
    // in order after: one load latency per batch, not one per partial, which
    // made the total of many small leaves' items (forty partials a thread
    // for 10,000) a chain of forty latencies. The order, and so the bits,
    // are the one-at-a-time loop's.
    long long k = t;
    for (; k + (GF_FINISH_SLOTS - 1) * T < n_items; k += GF_FINISH_SLOTS * T) {
        double x[GF_FINISH_SLOTS], f[GF_FINISH_SLOTS];
#pragma unroll
        for (int u = 0; u < GF_FINISH_SLOTS; ++u) {
            x[u] = partial[k + u * T];
            f[u] = partial[n_items + k + u * T];
        }
#pragma unroll
        for (int u = 0; u < GF_FINISH_SLOTS; ++u) {
            v = gf_combine<K>(v, x[u]);
            first = gf_min_double(first, f[u]);
        }
    }
#pragma unroll 1
    for (; k < n_items; k += T) {
        v = gf_combine<K>(v, partial[k]);
        first = gf_min_double(first, partial[n_items + k]);
    }
    gf_block_reduce(red, v, first, [](double x, double y) { return gf_combine<K>(x, y); });
    if (t == 0) {
        total[0] = gf_root<K>(v, p);
        total[1] = v;
        first_bad[0] = first < (double)n_items ? items[(long long)first].slot : -1;
    }
}

// Kernel 2: one block of exactly GF_FINISH_THREADS threads, where the
// leaves' own norms are asked for (else gpuflat_norm_one does it all).
//
// items are kernel 1's (sorted by slot); slot_items[s] .. slot_items[s + 1]
// are slot s's; big_slots lists, ascending, the slots with more than
// GF_SMALL_SLOT_ITEMS items. Writes per_leaf[s] (each leaf's norm), then the
// total and the first bad slot (see gf_norm_total). The total (step 4 of
// the order) is one strided pass over every item's partial, whatever the
// slots, the pass a single slot of all the items would take.
//
// Its launch bounds ask for one block per SM, so the block may have the whole
// register file (CUDA 13's ptxas otherwise holds the inf-norm's threads to
// 128 registers for sm_100, and spills two batches of slots in flight).
template <int K>
__global__ void __launch_bounds__(GF_FINISH_THREADS, 1)
gpuflat_norm_finish(const Item* __restrict__ items, long long n_items, const double* __restrict__ partial,
                    const long long* __restrict__ slot_items, long long n_slots,
                    const long long* __restrict__ big_slots, long long n_big, double p,
                    double* __restrict__ per_leaf, double* __restrict__ total, long long* __restrict__ first_bad) {
    __shared__ double red[2 * GF_FINISH_THREADS];
    gf_slot_norms<K>(red, n_items, partial, slot_items, n_slots, big_slots, n_big, p, per_leaf);
    gf_norm_total<K>(red, items, n_items, partial, p, total, first_bad);
}

// The norm in one launch, where no leaf's own norm is asked for: kernel 1's
// work, then the block that finishes last runs kernel 2's total pass
// (gf_norm_total) over every partial, so the bits are the two launches'
// whichever block it is. Blocks of exactly GF_FINISH_THREADS threads.
//
// "Last" is a ticket: each block, once its partials are written and fenced,
// draws one with an atomic add on *ticket, which the caller zeroed before
// the launch; the block drawing gridDim.x - 1 knows every other block's
// partials are visible (the writers' fences before the draws, its own
// after). The word is the launch's own, zeroed with it (the backend's
// norms), so two launches in flight never share one and nothing is reset.
//
// A kernel of its own, not kernel 1's, so the big trees' kernel keeps its
// register budget; its launch bounds are kernel 1's, so the partials of a
// tree of small leaves run at kernel 1's occupancy.
template <int K>
__global__ void __launch_bounds__(GF_FINISH_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_norm_one(const Item* __restrict__ items, long long n_items, const LeafRef* __restrict__ leaves,
                 double p, double* partial, unsigned long long* ticket, double* __restrict__ total,
                 long long* __restrict__ first_bad) {
    __shared__ double red[2 * GF_FINISH_THREADS];
    __shared__ int last;
    gf_norm_partials<K>(items, n_items, leaves, p, partial);
    __threadfence();  // this thread's partials before the block's ticket
    __syncthreads();
    if (threadIdx.x == 0) {
        last = atomicAdd(ticket, 1ull) == gridDim.x - 1ull;
        __threadfence();  // the other blocks' partials after their tickets
    }
    __syncthreads();
    if (!last) return;
    gf_norm_total<K>(red, items, n_items, partial, p, total, first_bad);
}

// Clipping: every leaf *= min(1, max_norm / (total + eps)), with total read
// from device memory, so clipping never waits on the host. A NaN total
// gives a NaN coefficient (PyTorch's semantics: the gradients become NaN); the
// clamp is written so that NaN survives it.
__device__ __forceinline__ double gf_clip_coef(double total, double max_norm, double eps) {
    const double c = max_norm / (total + eps);
    return c > 1.0 ? 1.0 : c;
}

__device__ __forceinline__ void gf_scale_items(const Item* __restrict__ items, long long n_items,
                                               const LeafRef* __restrict__ leaves, double coef) {
    // x * 1 is x exactly for every dtype (NaN stays NaN), so when nothing is
    // clipped the kernel leaves memory untouched instead of rewriting it.
    if (coef == 1.0) return;
    gf_for_leaf_items<true>(items, n_items, leaves, [&](const Item& item, const auto& L, int lane, auto z) {
        using S = decltype(z);
        gf_leaf_loop<S, true, true>(L, item, lane, [&](long long, S (&v)[gf_vec<S>::V], int n) {
            gf_for_each(v, n, [&](S& x) { gf_scale(x, coef); });
        });
    });
}

__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_scale(const Item* __restrict__ items, long long n_items, const LeafRef* __restrict__ leaves,
              const double* __restrict__ total, double max_norm, double eps) {
    gf_scale_items(items, n_items, leaves, gf_clip_coef(total[0], max_norm, eps));
}

// The same with max_norm read from device memory (a 0-d tensor of the
// caller's), so that a captured CUDA graph reads its value at every replay.
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_scale_at(const Item* __restrict__ items, long long n_items, const LeafRef* __restrict__ leaves,
                 const double* __restrict__ total, const double* __restrict__ max_norm, double eps) {
    gf_scale_items(items, n_items, leaves, gf_clip_coef(total[0], max_norm[0], eps));
}
