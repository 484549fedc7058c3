// gather (flatten, and tied-gradient accumulation) and scatter (unflatten into
// the tree's own arrays): each ONE launch for any number of leaves (#3).
#include "gpuflat_common.cuh"

// out[item.flat + i] = sum of the slot's sources at element start + i.
//
// sources[src_csr[s] .. src_csr[s + 1]) are slot s's sources. One source is a
// flatten (converted straight to T); k sources are the per-occurrence
// gradients of a tied array, summed in complex double in list order and then
// rounded once; none writes zeros. The same kernel therefore serves flatten
// and tied-gradient accumulation (#3).
template <class T>
__global__ void gpuflat_gather(const Item* __restrict__ items, long long n_items,
                               const LeafRef* __restrict__ sources, const long long* __restrict__ src_csr,
                               T* __restrict__ out) {
    const int lane = (int)(threadIdx.x % GF_WARP);
    const long long nwarps = gf_warp_count();
    for (long long it = gf_global_warp(); it < n_items; it += nwarps) {
        const Item item = items[it];
        T* const dst = out + item.flat;
        const long long s0 = src_csr[item.slot];
        const long long s1 = src_csr[item.slot + 1];
        if (s1 - s0 == 1) {
            const LeafRef& L = sources[s0];
            gf_dispatch(L.tag, [&](auto z) {
                using S = decltype(z);
                gf_item_loop<S, true, false>(L, item.start, item.len, lane,
                                             [&](long long i, S& x) { dst[i] = gf_narrow<T>(gf_widen(x)); });
            });
        } else {
            for (long long i = lane; i < item.len; i += GF_WARP) {
                gf_wide acc = {0.0, 0.0};
                if (s1 > s0) {
                    // Start from the first source rather than +0.0, so a lone
                    // -0.0 keeps its sign.
                    acc = gf_load_any(sources[s0], item.start + i);
                    for (long long s = s0 + 1; s < s1; ++s) {
                        const gf_wide w = gf_load_any(sources[s], item.start + i);
                        acc.re += w.re;
                        acc.im += w.im;
                    }
                }
                dst[i] = gf_narrow<T>(acc);
            }
        }
    }
}

// leaves[s][start + i] = flat[item.flat + i], converted to the leaf's dtype,
// written in place through the leaf's own strides (no staging copy).
template <class T>
__global__ void gpuflat_scatter(const Item* __restrict__ items, long long n_items,
                                const LeafRef* __restrict__ leaves, const T* __restrict__ flat) {
    const int lane = (int)(threadIdx.x % GF_WARP);
    const long long nwarps = gf_warp_count();
    for (long long it = gf_global_warp(); it < n_items; it += nwarps) {
        const Item item = items[it];
        const T* const src = flat + item.flat;
        const LeafRef& L = leaves[item.slot];
        gf_dispatch(L.tag, [&](auto z) {
            using S = decltype(z);
            gf_item_loop<S, false, true>(L, item.start, item.len, lane,
                                         [&](long long i, S& x) { x = gf_narrow<S>(gf_widen(src[i])); });
        });
    }
}
