// gather (flatten, and tied-gradient accumulation) and scatter (unflatten into
// the tree's own arrays): each ONE launch for any number of leaves.
#include "gpuflat_common.cuh"

// dst[0 .. n) = v converted to T (a plain copy where the dtypes match). A
// whole vector becomes whole 16-byte stores when dst is 16-byte aligned and
// the converted vector fills whole 16-byte words (T at least as wide as S);
// anything else is stored element by element.
template <class T, class S>
__device__ __forceinline__ void gf_put(T* dst, S (&v)[gf_vec<S>::V], int n, bool aligned) {
    constexpr int V = gf_vec<S>::V;
    constexpr int BYTES = V * (int)sizeof(T);
    if constexpr (gf_same<T, S>::value) {
        // v is the element view of a gf_vec: its 16 bytes move as one word,
        // never as V separate (for 16-bit types, half-register) elements.
        if (aligned && n == V) {
            *reinterpret_cast<int4*>(dst) = *reinterpret_cast<const int4*>(v);
            return;
        }
    } else if constexpr (BYTES % 16 == 0) {
        if (aligned && n == V) {
            union {
                int4 raw[BYTES / 16];
                T t[V];
            } u;
#pragma unroll
            for (int k = 0; k < V; ++k) u.t[k] = gf_convert<T>(v[k]);
#pragma unroll
            for (int q = 0; q < BYTES / 16; ++q) reinterpret_cast<int4*>(dst)[q] = u.raw[q];
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < V; ++k)
        if (k < n) dst[k] = gf_convert<T>(v[k]);
}

// v[0 .. n) = src[0 .. n) converted to S: the mirror of gf_put, with 16-byte
// loads under the same conditions.
template <class T, class S>
__device__ __forceinline__ void gf_get(S (&v)[gf_vec<S>::V], const T* src, int n, bool aligned) {
    constexpr int V = gf_vec<S>::V;
    constexpr int BYTES = V * (int)sizeof(T);
    if constexpr (gf_same<T, S>::value) {
        if (aligned && n == V) {
            *reinterpret_cast<int4*>(v) = *reinterpret_cast<const int4*>(src);
            return;
        }
    } else if constexpr (BYTES % 16 == 0) {
        if (aligned && n == V) {
            union {
                int4 raw[BYTES / 16];
                T t[V];
            } u;
#pragma unroll
            for (int q = 0; q < BYTES / 16; ++q) u.raw[q] = reinterpret_cast<const int4*>(src)[q];
#pragma unroll
            for (int k = 0; k < V; ++k) v[k] = gf_convert<S>(u.t[k]);
            return;
        }
    }
#pragma unroll
    for (int k = 0; k < V; ++k)
        if (k < n) v[k] = gf_convert<S>(src[k]);
}

// Vectors of S per lane in flight when the other side is T: GF_UNROLL
// 16-byte words of the wider of the two, so a narrow leaf in a wide flat
// buffer does not hold GF_UNROLL times its widened vector in registers.
template <class S, class T>
constexpr int gf_unroll() {
    return sizeof(T) > sizeof(S) ? (GF_UNROLL * (int)sizeof(S) / (int)sizeof(T) > 1 ? GF_UNROLL * (int)sizeof(S) / (int)sizeof(T) : 1) : GF_UNROLL;
}

__device__ __forceinline__ bool gf_aligned16(const void* p) { return ((unsigned long long)p & 15ULL) == 0; }

// The strided path of a scatter item, out of line: it keeps the per-element
// address arithmetic out of the registers of the contiguous loop.
template <class T, class S>
__device__ __noinline__ void gf_scatter_strided(const LeafRef& L, long long start, long long len, int lane,
                                                const T* src) {
    gf_strided_loop<S, false, true>(L, start, len, lane, [&](long long i0, S (&v)[gf_vec<S>::V], int n) {
        gf_get(v, src + i0, n, false);
    });
}

// dst[i] = the sum of sources[s0 .. s1) at element start + i, one element
// at a time through gf_load_any's general addressing: ties are rare. It is
// inlined: out of line (__noinline__), the call cost the flatten spills
// under CUDA 13.5 for sm_90.
template <class T>
__device__ __forceinline__ void gf_gather_tied(const LeafRef* sources, long long s0, long long s1, long long start,
                                            long long len, int lane, T* dst) {
    for (long long i = lane; i < len; i += GF_WARP) {
        gf_wide acc = {0.0, 0.0};
        if (s1 > s0) {
            // Start from the first source rather than +0.0, so a lone -0.0
            // keeps its sign.
            acc = gf_load_any(sources[s0], start + i);
            for (long long s = s0 + 1; s < s1; ++s) {
                const gf_wide w = gf_load_any(sources[s], start + i);
                acc.re += w.re;
                acc.im += w.im;
            }
        }
        dst[i] = gf_narrow<T>(acc);
    }
}

// out[item.flat + i] = sum of the slot's sources at element start + i.
//
// sources[src_csr[s] .. src_csr[s + 1]) are slot s's sources. One source is a
// flatten (converted straight to T); k sources are the per-occurrence
// gradients of a tied array, summed in complex double in list order and then
// rounded once; none writes zeros. The same kernel therefore serves flatten
// and tied-gradient accumulation.
template <class T>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_gather(const Item* __restrict__ items, long long n_items, const LeafRef* __restrict__ sources,
               const long long* __restrict__ src_csr, T* __restrict__ out) {
    gf_for_items(items, n_items, [&](long long, const Item& item, int lane) {
        T* const dst = out + item.flat;
        const long long s0 = src_csr[item.slot];
        const long long s1 = src_csr[item.slot + 1];
        if (s1 - s0 != 1) return gf_gather_tied(sources, s0, s1, item.start, item.len, lane, dst);
        const LeafRef& L = sources[s0];
        const bool aligned = gf_aligned16(dst);
        gf_dispatch(L.tag, [&](auto z) {
            using S = decltype(z);
            gf_leaf_loop<S, true, false, gf_unroll<S, T>()>(L, item, lane, [&](long long i0, S (&v)[gf_vec<S>::V], int n) {
                gf_put(dst + i0, v, n, aligned);
            });
        });
    });
}

// leaves[s][start + i] = flat[item.flat + i], converted to the leaf's dtype,
// written in place through the leaf's own strides (no staging copy).
template <class T>
__global__ void __launch_bounds__(GF_BLOCK_THREADS, GF_MIN_BLOCKS_PER_SM)
gpuflat_scatter(const Item* __restrict__ items, long long n_items, const LeafRef* __restrict__ leaves,
                const T* __restrict__ flat) {
    // The leaf's fields are loaded with the item (see gf_on_leaf).
    gf_for_leaf_items<true>(items, n_items, leaves, [&](const Item& item, const auto& L, int lane, auto z) {
        using S = decltype(z);
        const T* const src = flat + item.flat;
        if (L.ndim != 0) return gf_scatter_strided<T, S>(gf_row(L), item.start, item.len, lane, src);
        const bool aligned = gf_aligned16(src);
        gf_item_loop<S, false, true, gf_unroll<S, T>()>(L, item.start, item.len, lane,
                                                     [&](long long i0, S (&v)[gf_vec<S>::V], int n) {
                                                         gf_get(v, src + i0, n, aligned);
                                                     });
    });
}
