// The native host backend (gpuflat/backends/host.py): gather, scatter, norms
// and clipping over NumPy arrays, on every core, with the CUDA kernels'
// arithmetic and summation order.
//
// The element arithmetic is not copied: it is gpuflat_math.cuh, compiled for
// the host through host_prelude.h. The order is the kernels' (kernels/norms.cu):
// a norm partial per work item of at most ITEM elements of one leaf, in which
// vector j of V = 16 / sizeof(S) consecutive elements belongs to lane j % 32,
// each lane adds its vectors in increasing j, then lane 0 ends with the fixed
// shuffle-down tree; then the finishing block's fixed order. Here the 32 lanes
// are 32 accumulators that the compiler turns into SIMD registers, so the norms
// are the same bits as the CUDA kernels' (built with --fmad=false; this file is
// built with -ffp-contract=off, so a*b+c is two roundings here too).
//
// Work items are split across threads by contiguous ranges; every item's
// partial lands in its own slot and the finish runs on one thread, so the
// thread count never changes a bit.
//
// Arrays arrive as Python objects (the library is loaded with ctypes.PyDLL):
// reading 10,000 data pointers and strides here costs microseconds, where
// reading them in Python costs milliseconds. The GIL is released while the
// loops run.
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "host_prelude.h"
#include "gpuflat_math.cuh"

#define GF_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr long long ITEM = 4096;  // elements per work item: gpuflat.backends.cuda.ITEM
// Below this many elements per thread, starting a thread costs more than it saves.
constexpr long long MIN_WORK_PER_THREAD = 1 << 17;
// What one work item costs beyond its elements (table lookups, the lane tree).
constexpr long long ITEM_OVERHEAD = 64;

// A leaf as the loops see it. ndim 0: contiguous and aligned, element i at
// ptr + i * itemsize; otherwise ndim merged dims of shape and byte strides
// (any sign), read and written with memcpy, so unaligned arrays work too.
struct Leaf {
    char* ptr;
    int tag;
    int ndim;
    long long size;
    const long long* shape;
    const long long* stride;
};
// Work items are gpuflat_common.cuh's Item: elements [start, start + len) of
// slot `slot`, at `flat` in the flat buffer.

// ------------------------------------------------------------ reading arrays

PyTypeObject* g_ndarray = nullptr;
int g_bfloat16_num = -1;

int tag_of(PyArrayObject* a) {
    if (!PyArray_ISNOTSWAPPED(a)) return -1;
    const int num = PyArray_DESCR(a)->type_num;
    switch (num) {
        case NPY_HALF: return 0;
        case NPY_FLOAT: return 2;
        case NPY_DOUBLE: return 3;
        case NPY_CFLOAT: return 4;
        case NPY_CDOUBLE: return 5;
        default: return num == g_bfloat16_num ? 1 : -1;
    }
}

long long itemsize_of(int tag) {
    static const long long sizes[] = {2, 2, 4, 8, 8, 16};
    return sizes[tag];
}

// Leaves of one call; merged dims live in `dims`, pointed to once all are read
// (the vector may move while it grows).
struct LeafSet {
    std::vector<Leaf> leaves;
    std::vector<long long> dims;
    std::vector<long long> dims_at;

    // Adds array `obj`; false if it is not a native-order ndarray of a gpuflat dtype.
    bool add(PyObject* obj) {
        if (!PyObject_TypeCheck(obj, g_ndarray)) return false;
        PyArrayObject* a = (PyArrayObject*)obj;
        const int tag = tag_of(a);
        if (tag < 0) return false;
        const long long itemsize = itemsize_of(tag);
        const int nd = PyArray_NDIM(a);
        const npy_intp* shape = PyArray_DIMS(a);
        const npy_intp* strides = PyArray_STRIDES(a);
        long long size = 1;
        for (int d = 0; d < nd; ++d) size *= shape[d];
        const size_t first = dims.size() / 2;
        // Size-1 dims dropped, neighbours merged where the strides allow (as
        // the CUDA backend's table rows): a transposed matrix keeps 2 dims.
        std::vector<long long> n_s;
        for (int d = 0; d < nd && size > 0; ++d) {
            if (shape[d] == 1) continue;
            if (!n_s.empty() && n_s[n_s.size() - 1] == strides[d] * shape[d]) {
                n_s[n_s.size() - 2] *= shape[d];
                n_s[n_s.size() - 1] = strides[d];
            } else {
                n_s.push_back(shape[d]);
                n_s.push_back(strides[d]);
            }
        }
        const bool contiguous = n_s.empty() || (n_s.size() == 2 && n_s[1] == itemsize);
        int ndim = 0;
        if (size > 0 && !(contiguous && PyArray_ISALIGNED(a))) {
            if (contiguous) n_s = {size, itemsize};
            ndim = (int)(n_s.size() / 2);
            for (int d = 0; d < ndim; ++d) dims.push_back(n_s[2 * d]);
            for (int d = 0; d < ndim; ++d) dims.push_back(n_s[2 * d + 1]);
        }
        dims_at.push_back((long long)first * 2);
        leaves.push_back(Leaf{(char*)PyArray_DATA(a), tag, ndim, size, nullptr, nullptr});
        return true;
    }

    void finish() {
        for (size_t i = 0; i < leaves.size(); ++i) {
            leaves[i].shape = dims.data() + dims_at[i];
            leaves[i].stride = dims.data() + dims_at[i] + leaves[i].ndim;
        }
    }
};

// Reads a sequence of arrays; returns the index of the first unreadable one, or -1.
long long read_leaves(PyObject* seq, LeafSet& set) {
    PyObject* fast = PySequence_Fast(seq, "expected a sequence of arrays");
    if (!fast) return 0;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject** items = PySequence_Fast_ITEMS(fast);
    set.leaves.reserve(n);
    long long bad = -1;
    for (Py_ssize_t i = 0; i < n && bad < 0; ++i)
        if (!set.add(items[i])) bad = i;
    Py_DECREF(fast);
    set.finish();
    return bad;
}

template <class T>
T* data_of(PyObject* array) {
    return (T*)PyArray_DATA((PyArrayObject*)array);
}

// ------------------------------------------------------------ work items

// The items of a plan from its offsets (n_slots + 1 of them), as
// gpuflat.backends.cuda.plan_items builds them.
std::vector<Item> plan_items(const long long* offsets, long long n_slots) {
    std::vector<Item> items;
    for (long long s = 0; s < n_slots; ++s)
        for (long long start = 0; start < offsets[s + 1] - offsets[s]; start += ITEM)
            items.push_back(Item{s, start, std::min(ITEM, offsets[s + 1] - offsets[s] - start), offsets[s] + start});
    return items;
}

// Runs body(first, end) over contiguous ranges of items of about equal cost,
// one range per thread. Which thread runs an item never changes its result.
template <class Body>
void parallel_items(const std::vector<Item>& items, int threads, Body body) {
    const long long n = (long long)items.size();
    std::vector<long long> cost(n + 1, 0);
    for (long long i = 0; i < n; ++i) cost[i + 1] = cost[i] + items[i].len + ITEM_OVERHEAD;
    const long long t = std::max(1LL, std::min<long long>(threads, cost[n] / MIN_WORK_PER_THREAD));
    if (t == 1) {
        body(0LL, n);
        return;
    }
    std::vector<long long> bounds(t + 1, n);
    bounds[0] = 0;
    for (long long k = 1; k < t; ++k)
        bounds[k] = std::lower_bound(cost.begin(), cost.end(), cost[n] * k / t) - cost.begin();
    std::vector<std::thread> pool;
    for (long long k = 1; k < t; ++k) pool.emplace_back(body, bounds[k], bounds[k + 1]);
    body(bounds[0], bounds[1]);
    for (auto& th : pool) th.join();
}

// ------------------------------------------------------------ strided leaves

// Walks a strided leaf's elements in C order from element `start`.
class Cursor {
  public:
    Cursor(const Leaf& L, long long start) : L_(L), p_(L.ptr) {
        for (int d = L.ndim - 1; d >= 0; --d) {
            const long long q = start / L.shape[d];
            idx_[d] = start - q * L.shape[d];
            p_ += idx_[d] * L.stride[d];
            start = q;
        }
    }
    char* next() {
        char* here = p_;
        for (int d = L_.ndim - 1; d >= 0; --d) {
            p_ += L_.stride[d];
            if (++idx_[d] < L_.shape[d]) break;
            p_ -= L_.stride[d] * L_.shape[d];
            idx_[d] = 0;
        }
        return here;
    }

  private:
    const Leaf& L_;
    char* p_;
    long long idx_[NPY_MAXDIMS];
};

template <class S>
void pack(const Leaf& L, long long start, long long len, S* buf) {
    Cursor c(L, start);
    for (long long i = 0; i < len; ++i) std::memcpy(&buf[i], c.next(), sizeof(S));
}

template <class S>
void unpack(const Leaf& L, long long start, long long len, const S* buf) {
    Cursor c(L, start);
    for (long long i = 0; i < len; ++i) std::memcpy(c.next(), &buf[i], sizeof(S));
}

// One item's scratch: ITEM elements of the widest type (gf_wide, 16 bytes).
struct alignas(64) Scratch {
    unsigned char bytes[ITEM * sizeof(gf_wide)];
    template <class S> S* as() { return reinterpret_cast<S*>(bytes); }
};

// The item's elements as a contiguous array: in place, or packed into scratch.
template <class S>
S* item_view(const Leaf& L, const Item& item, Scratch& scratch) {
    if (L.ndim == 0) return (S*)L.ptr + item.start;
    S* buf = scratch.as<S>();
    pack(L, item.start, item.len, buf);
    return buf;
}

// ------------------------------------------------------------ norms

// The item's partial in the kernel's order (gpuflat_norm_partial).
// `done`: elements 0 .. done - 1 (whole steps) are already in acc.
template <int K, class S>
double item_partial(const S* x, long long len, double p, double* acc, long long done) {
    constexpr int V = 16 / (int)sizeof(S);
    constexpr bool CPLX = gf_is_complex<S>::value;
    constexpr long long STEP = (long long)GF_WARP * V;
    const long long full = len / STEP;
    for (long long r = done / STEP; r < full; ++r) {
        const S* step = x + r * STEP;
        for (int k = 0; k < V; ++k)
            for (int l = 0; l < GF_WARP; ++l)
                acc[l] = gf_combine<K>(acc[l], gf_term<K, CPLX>(gf_widen(step[l * V + k]), p));
    }
    // The last, partial step: fewer than 32 vectors, so vector j is lane j.
    const S* tail = x + full * STEP;
    const long long rest = len - full * STEP;
    for (long long j = 0; j * V < rest; ++j)
        for (long long i = j * V; i < std::min(rest, (j + 1) * V); ++i)
            acc[j] = gf_combine<K>(acc[j], gf_term<K, CPLX>(gf_widen(tail[i]), p));
    // __shfl_down_sync's tree: lane l takes lane l + off, for off = 16 .. 1.
    for (int off = GF_WARP / 2; off > 0; off >>= 1)
        for (int l = 0; l < off; ++l) acc[l] = gf_combine<K>(acc[l], acc[l + off]);
    return acc[0];
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__F16C__)
// The 2-norm's partial with AVX-512: the 32 lane accumulators are four
// registers of 8 doubles, lanes 8g .. 8g + 7 in register g. For each element
// position k of a vector, one permute picks lane i's element k out of the two
// 64-byte rows that hold lanes 8g .. 8g + 7, a conversion widens it exactly,
// and then each lane does gf_term<GF_NORM_L2> and gf_combine<GF_NORM_L2>:
// x * x (re * re + im * im for complex), then acc + term, each one rounding
// (the intrinsics are never contracted under -ffp-contract=off). NaN inputs
// may come out of the hardware conversions with other payload bits than
// gf_widen gives, so an item whose partial is NaN is summed again by the
// generic loop (item_partial).
template <class S> struct Wide2;  // terms of lanes 8g .. 8g + 7 at position k, from rows a, b

template <> struct Wide2<float> {
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512d w = _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_permutex2var_ps(a, idx, b)));
        return _mm512_mul_pd(w, w);
    }
};
template <> struct Wide2<double> {
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512d w = _mm512_permutex2var_pd(_mm512_castps_pd(a), idx, _mm512_castps_pd(b));
        return _mm512_mul_pd(w, w);
    }
};
template <> struct Wide2<f16> {
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512i h = _mm512_permutex2var_epi16(_mm512_castps_si512(a), idx, _mm512_castps_si512(b));
        const __m512d w = _mm512_cvtps_pd(_mm256_cvtph_ps(_mm512_castsi512_si128(h)));
        return _mm512_mul_pd(w, w);
    }
};
template <> struct Wide2<bf16> {
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        // idx puts element i in the high half of 32-bit slot i; the mask zeroes the low halves.
        const __m512i f = _mm512_maskz_permutex2var_epi16(0xaaaaaaaau, _mm512_castps_si512(a), idx,
                                                           _mm512_castps_si512(b));
        const __m512d w = _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_castsi512_ps(f)));
        return _mm512_mul_pd(w, w);
    }
};
template <> struct Wide2<c64> {  // idx picks the real parts; idx + 1 the imaginary ones
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512i one = _mm512_set1_epi32(1);
        const __m512d re = _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_permutex2var_ps(a, idx, b)));
        const __m512d im = _mm512_cvtps_pd(
            _mm512_castps512_ps256(_mm512_permutex2var_ps(a, _mm512_add_epi32(idx, one), b)));
        return _mm512_add_pd(_mm512_mul_pd(re, re), _mm512_mul_pd(im, im));
    }
};
template <> struct Wide2<c128> {
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512i one = _mm512_set1_epi64(1);
        const __m512d re = _mm512_permutex2var_pd(_mm512_castps_pd(a), idx, _mm512_castps_pd(b));
        const __m512d im = _mm512_permutex2var_pd(_mm512_castps_pd(a), _mm512_add_epi64(idx, one), _mm512_castps_pd(b));
        return _mm512_add_pd(_mm512_mul_pd(re, re), _mm512_mul_pd(im, im));
    }
};

// Index vectors: lane i of a group takes element i * V + k of its 128 bytes,
// counted in the permute's units (16-, 32- or 64-bit).
template <class S>
__m512i lane_index(int k) {
    constexpr int V = 16 / (int)sizeof(S);
    if constexpr (sizeof(S) == 2) {  // float16: slot i; bfloat16: the high half of 32-bit slot i
        constexpr int at = std::is_same_v<S, bf16> ? 2 : 1;
        alignas(64) short idx[32] = {};
        for (int i = 0; i < 8; ++i) idx[at * i + at - 1] = (short)(i * V + k);
        return _mm512_load_si512(idx);
    } else if constexpr (std::is_same_v<S, float> || std::is_same_v<S, c64>) {
        constexpr int per = (int)sizeof(S) / 4;  // 32-bit units per element
        alignas(64) int idx[16] = {};
        for (int i = 0; i < 8; ++i) idx[i] = (i * V + k) * per;
        return _mm512_load_si512(idx);
    } else {
        constexpr int per = (int)sizeof(S) / 8;
        alignas(64) long long idx[8] = {};
        for (int i = 0; i < 8; ++i) idx[i] = (i * V + k) * per;
        return _mm512_load_si512(idx);
    }
}

// Adds the full steps (32 vectors each) of x into acc, in the lanes' order.
template <class S>
long long l2_steps(const S* x, long long len, double* acc) {
    constexpr int V = 16 / (int)sizeof(S);
    constexpr long long STEP = (long long)GF_WARP * V;
    __m512i idx[V];
    for (int k = 0; k < V; ++k) idx[k] = lane_index<S>(k);
    __m512d a0 = _mm512_loadu_pd(acc), a1 = _mm512_loadu_pd(acc + 8);
    __m512d a2 = _mm512_loadu_pd(acc + 16), a3 = _mm512_loadu_pd(acc + 24);
    const long long full = len / STEP;
    for (long long r = 0; r < full; ++r) {
        const float* row = reinterpret_cast<const float*>(x + r * STEP);  // 8 rows of 64 bytes
        const __m512 r0 = _mm512_loadu_ps(row), r1 = _mm512_loadu_ps(row + 16);
        const __m512 r2 = _mm512_loadu_ps(row + 32), r3 = _mm512_loadu_ps(row + 48);
        const __m512 r4 = _mm512_loadu_ps(row + 64), r5 = _mm512_loadu_ps(row + 80);
        const __m512 r6 = _mm512_loadu_ps(row + 96), r7 = _mm512_loadu_ps(row + 112);
        for (int k = 0; k < V; ++k) {
            a0 = _mm512_add_pd(a0, Wide2<S>::terms(r0, r1, idx[k]));
            a1 = _mm512_add_pd(a1, Wide2<S>::terms(r2, r3, idx[k]));
            a2 = _mm512_add_pd(a2, Wide2<S>::terms(r4, r5, idx[k]));
            a3 = _mm512_add_pd(a3, Wide2<S>::terms(r6, r7, idx[k]));
        }
    }
    _mm512_storeu_pd(acc, a0);
    _mm512_storeu_pd(acc + 8, a1);
    _mm512_storeu_pd(acc + 16, a2);
    _mm512_storeu_pd(acc + 24, a3);
    return full * STEP;
}
#define GF_HOST_L2_STEPS 1

// gf_scale on 16 float16 or bfloat16 values at once: widened exactly, one
// float multiply, rounded once to nearest-even (vcvtps2ph for float16; for
// bfloat16 the integer form of the same rounding). Only a NaN product leaves
// the two roundings apart (payload bits), so a group holding one is left to
// gf_scale itself; returns false for it.
template <class S>
bool scale16(S* x, float c) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    __m512 w;
    if constexpr (std::is_same_v<S, f16>) w = _mm512_cvtph_ps(h);
    else w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    const __m512 y = _mm512_mul_ps(w, _mm512_set1_ps(c));
    if (_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q)) return false;
    __m256i out;
    if constexpr (std::is_same_v<S, f16>) {
        out = _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    } else {
        const __m512i u = _mm512_castps_si512(y);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
        out = _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), out);
    return true;
}
#define GF_HOST_SCALE16 1
#endif

// x[0 .. n) scaled by gf_scale, 16-bit floats 16 at a time where the machine can.
template <class S>
void scale_run(S* x, long long n, double coef) {
    long long i = 0;
#ifdef GF_HOST_SCALE16
    if constexpr (sizeof(S) == 2) {
        for (; i + 16 <= n; i += 16)
            if (!scale16(x + i, (float)coef))
                for (long long k = i; k < i + 16; ++k) gf_scale(x[k], coef);
    }
#endif
    for (; i < n; ++i) gf_scale(x[i], coef);
}

template <class S>
bool holds_nonfinite(const S* x, long long len) {
    for (long long i = 0; i < len; ++i) {
        const gf_wide w = gf_widen(x[i]);
        if (!(isfinite(w.re) && isfinite(w.im))) return true;
    }
    return false;
}

// One item's partial: whole steps of a 2-norm in SIMD where the machine has
// it, the rest (and any item whose SIMD partial is NaN) by the generic loop.
template <int K, class S>
double partial_of(const S* x, long long len, double p) {
    double acc[GF_WARP] = {};
#ifdef GF_HOST_L2_STEPS
    if constexpr (K == GF_NORM_L2) {
        const double fast = item_partial<K, S>(x, len, p, acc, l2_steps(x, len, acc));
        if (fast == fast) return fast;
        for (double& a : acc) a = 0.0;
    }
#endif
    return item_partial<K, S>(x, len, p, acc, 0);
}

template <int K>
void item_partials(const LeafSet& set, const std::vector<Item>& items, long long first, long long end,
                   double p, double* partial) {
    Scratch scratch;
    for (long long it = first; it < end; ++it) {
        const Item& item = items[it];
        const Leaf& L = set.leaves[item.slot];
        gf_dispatch(L.tag, [&](auto z) {
            using S = decltype(z);
            partial[it] = partial_of<K, S>(item_view<S>(L, item, scratch), item.len, p);
        });
    }
}

// A non-finite element makes its item's partial non-finite (terms are never
// negative, so nothing cancels); only such items are read again for the flag.
long long first_nonfinite_slot(const LeafSet& set, const std::vector<Item>& items, const double* partial) {
    Scratch scratch;
    for (size_t it = 0; it < items.size(); ++it) {
        if (isfinite(partial[it])) continue;
        const Item& item = items[it];
        const Leaf& L = set.leaves[item.slot];
        bool bad = false;
        gf_dispatch(L.tag, [&](auto z) {
            using S = decltype(z);
            bad = holds_nonfinite(item_view<S>(L, item, scratch), item.len);
        });
        if (bad) return item.slot;
    }
    return -1;
}

// gf_block_reduce's tree over GF_FINISH_THREADS values.
template <int K>
double block_tree(double* red) {
    for (int w = GF_FINISH_THREADS / 2; w > 0; w >>= 1)
        for (int t = 0; t < w; ++t) red[t] = gf_combine<K>(red[t], red[t + w]);
    return red[0];
}

// gpuflat_norm_finish on one thread: each slot from its items, the total from
// the slots' raw sums, in the finishing block's order.
template <int K>
double finish(const std::vector<Item>& items, const double* partial, long long n_slots, double p, double* per_leaf) {
    const long long T = GF_FINISH_THREADS;
    double red[GF_FINISH_THREADS];
    size_t a = 0;
    for (long long s = 0; s < n_slots; ++s) {
        size_t b = a;
        while (b < items.size() && items[b].slot == s) ++b;
        if ((long long)(b - a) <= GF_SMALL_SLOT_ITEMS) {
            double v = 0.0;
            for (size_t k = a; k < b; ++k) v = gf_combine<K>(v, partial[k]);
            per_leaf[s] = v;
        } else {
            for (long long t = 0; t < T; ++t) {
                double v = 0.0;
                for (size_t k = a + t; k < b; k += T) v = gf_combine<K>(v, partial[k]);
                red[t] = v;
            }
            per_leaf[s] = block_tree<K>(red);
        }
        a = b;
    }
    for (long long t = 0; t < T; ++t) {
        double v = 0.0;
        for (long long s = t; s < n_slots; s += T) v = gf_combine<K>(v, per_leaf[s]);
        red[t] = v;
    }
    for (long long s = 0; s < n_slots; ++s) per_leaf[s] = gf_root<K>(per_leaf[s], p);
    return gf_root<K>(block_tree<K>(red), p);
}

template <int K>
void norms(const LeafSet& set, const std::vector<Item>& items, long long n_slots, double p, int threads,
           double* per_leaf, double* total, long long* first_bad) {
    std::vector<double> partial(items.size());
    parallel_items(items, threads, [&](long long first, long long end) {
        item_partials<K>(set, items, first, end, p, partial.data());
    });
    *total = finish<K>(items, partial.data(), n_slots, p, per_leaf);
    *first_bad = first_nonfinite_slot(set, items, partial.data());
}

// ------------------------------------------------------------ gather, scatter, clip

// dst[i] = src[i] converted (gf_narrow of gf_widen: one rounding).
template <class S, class T>
void convert(const S* src, T* dst, long long n) {
    if constexpr (std::is_same_v<S, T>) {
        std::memcpy(dst, src, n * sizeof(T));
    } else {
        for (long long i = 0; i < n; ++i) dst[i] = gf_narrow<T>(gf_widen(src[i]));
    }
}

// The slot's sources summed in complex double in list order, then rounded
// once, as gpuflat_gather does for tied gradients; no source gives zeros.
template <class T>
void gather_tied(const LeafSet& set, const long long* csr, const Item& item, T* dst, Scratch& scratch) {
    const long long s0 = csr[item.slot], s1 = csr[item.slot + 1];
    gf_wide acc[ITEM];
    for (long long i = 0; i < item.len; ++i) acc[i] = gf_wide{0.0, 0.0};
    for (long long s = s0; s < s1; ++s) {
        const Leaf& L = set.leaves[s];
        gf_dispatch(L.tag, [&](auto z) {
            using S = decltype(z);
            const S* x = item_view<S>(L, item, scratch);
            for (long long i = 0; i < item.len; ++i) {
                const gf_wide w = gf_widen(x[i]);
                // The first source is taken as is, so a lone -0.0 keeps its sign.
                acc[i] = s == s0 ? w : gf_wide{acc[i].re + w.re, acc[i].im + w.im};
            }
        });
    }
    for (long long i = 0; i < item.len; ++i) dst[i] = gf_narrow<T>(acc[i]);
}

template <class T>
void gather(const LeafSet& set, const long long* csr, const std::vector<Item>& items, T* out, int threads) {
    parallel_items(items, threads, [&](long long first, long long end) {
        Scratch scratch;
        for (long long it = first; it < end; ++it) {
            const Item& item = items[it];
            T* dst = out + item.flat;
            if (csr[item.slot + 1] - csr[item.slot] != 1) {
                gather_tied<T>(set, csr, item, dst, scratch);
                continue;
            }
            const Leaf& L = set.leaves[csr[item.slot]];
            gf_dispatch(L.tag, [&](auto z) {
                using S = decltype(z);
                convert(item_view<S>(L, item, scratch), dst, item.len);
            });
        }
    });
}

template <class T>
void scatter(const T* flat, const LeafSet& set, const std::vector<Item>& items, int threads) {
    parallel_items(items, threads, [&](long long first, long long end) {
        Scratch scratch;
        for (long long it = first; it < end; ++it) {
            const Item& item = items[it];
            const Leaf& L = set.leaves[item.slot];
            gf_dispatch(L.tag, [&](auto z) {
                using S = decltype(z);
                if (L.ndim == 0) {
                    convert(flat + item.flat, (S*)L.ptr + item.start, item.len);
                } else {
                    convert(flat + item.flat, scratch.as<S>(), item.len);
                    unpack(L, item.start, item.len, scratch.as<S>());
                }
            });
        }
    });
}

void scale(const LeafSet& set, const std::vector<Item>& items, double coef, int threads) {
    parallel_items(items, threads, [&](long long first, long long end) {
        Scratch scratch;
        for (long long it = first; it < end; ++it) {
            const Item& item = items[it];
            const Leaf& L = set.leaves[item.slot];
            gf_dispatch(L.tag, [&](auto z) {
                using S = decltype(z);
                S* x = item_view<S>(L, item, scratch);
                scale_run(x, item.len, coef);
                if (L.ndim != 0) unpack(L, item.start, item.len, x);
            });
        }
    });
}

// The leaf sizes must be the plan's; returns the first slot that differs, or -1.
long long check_sizes(const LeafSet& set, const long long* offsets) {
    for (size_t s = 0; s < set.leaves.size(); ++s)
        if (set.leaves[s].size != offsets[s + 1] - offsets[s]) return (long long)s;
    return -1;
}

}  // namespace

// ------------------------------------------------------------ entry points
// Each returns -1 on success, else the index of the first array it cannot
// use (not an ndarray of a gpuflat dtype in native byte order, or of the
// wrong size); the caller names the leaf. Nothing is written before that
// check. Outputs are NumPy arrays of the right dtype and size.

GF_EXPORT void gf_host_init(PyObject* ndarray_type, int bfloat16_num) {
    g_ndarray = (PyTypeObject*)ndarray_type;
    g_bfloat16_num = bfloat16_num;
}

GF_EXPORT long long gf_host_norms(PyObject* leaves, PyObject* offsets, int kind, double p, int threads,
                                  PyObject* per_leaf, PyObject* total, PyObject* first_bad) {
    LeafSet set;
    long long bad = read_leaves(leaves, set);
    if (bad < 0) bad = check_sizes(set, data_of<long long>(offsets));
    if (bad >= 0) return bad;
    const long long n_slots = (long long)set.leaves.size();
    Py_BEGIN_ALLOW_THREADS
    const std::vector<Item> items = plan_items(data_of<long long>(offsets), n_slots);
    double* per = data_of<double>(per_leaf);
    double* tot = data_of<double>(total);
    long long* first = data_of<long long>(first_bad);
    switch (kind) {
        case GF_NORM_L1: norms<GF_NORM_L1>(set, items, n_slots, p, threads, per, tot, first); break;
        case GF_NORM_L2: norms<GF_NORM_L2>(set, items, n_slots, p, threads, per, tot, first); break;
        case GF_NORM_INF: norms<GF_NORM_INF>(set, items, n_slots, p, threads, per, tot, first); break;
        default: norms<GF_NORM_P>(set, items, n_slots, p, threads, per, tot, first); break;
    }
    Py_END_ALLOW_THREADS
    return -1;
}

// sources: one sequence of arrays per slot; csr: n_slots + 1 int64 bounds of
// each slot's sources in the flattened list.
GF_EXPORT long long gf_host_gather(PyObject* sources, PyObject* csr, PyObject* offsets, PyObject* out,
                                   int threads) {
    LeafSet set;
    const long long bad = read_leaves(sources, set);
    if (bad >= 0) return bad;
    const long long* bounds = data_of<long long>(csr);
    const long long* offs = data_of<long long>(offsets);
    const long long n_slots = PyArray_DIMS((PyArrayObject*)offsets)[0] - 1;
    for (long long s = 0; s < n_slots; ++s)
        for (long long k = bounds[s]; k < bounds[s + 1]; ++k)
            if (set.leaves[k].size != offs[s + 1] - offs[s]) return k;
    const int tag = tag_of((PyArrayObject*)out);
    Py_BEGIN_ALLOW_THREADS
    const std::vector<Item> items = plan_items(offs, n_slots);
    gf_dispatch(tag, [&](auto z) {
        using T = decltype(z);
        gather<T>(set, bounds, items, data_of<T>(out), threads);
    });
    Py_END_ALLOW_THREADS
    return -1;
}

GF_EXPORT long long gf_host_scatter(PyObject* flat, PyObject* leaves, PyObject* offsets, int threads) {
    LeafSet set;
    long long bad = read_leaves(leaves, set);
    if (bad < 0) bad = check_sizes(set, data_of<long long>(offsets));
    if (bad >= 0) return bad;
    const int tag = tag_of((PyArrayObject*)flat);
    Py_BEGIN_ALLOW_THREADS
    const std::vector<Item> items = plan_items(data_of<long long>(offsets), (long long)set.leaves.size());
    gf_dispatch(tag, [&](auto z) {
        using T = decltype(z);
        scatter<T>(data_of<T>(flat), set, items, threads);
    });
    Py_END_ALLOW_THREADS
    return -1;
}

// Every leaf *= min(1, max_norm / (total + eps)), as gpuflat_scale: a NaN
// total gives a NaN factor, and a factor of exactly 1 writes nothing.
GF_EXPORT long long gf_host_clip(PyObject* leaves, PyObject* offsets, double total, double max_norm, double eps,
                                 int threads) {
    LeafSet set;
    long long bad = read_leaves(leaves, set);
    if (bad < 0) bad = check_sizes(set, data_of<long long>(offsets));
    if (bad >= 0) return bad;
    const double c = max_norm / (total + eps);
    const double coef = c > 1.0 ? 1.0 : c;
    if (coef == 1.0) return -1;
    Py_BEGIN_ALLOW_THREADS
    const std::vector<Item> items = plan_items(data_of<long long>(offsets), (long long)set.leaves.size());
    scale(set, items, coef, threads);
    Py_END_ALLOW_THREADS
    return -1;
}
