// Shared definitions of the flat-tree kernels: element types, dtype
// conversions, the device tables written by gpuflat/_src/backends/cuda.py, and the
// per-warp loop over one work item.
//
// The same text compiles with NVRTC for the GPU and with g++ against the host
// emulator header (kernels/emulator/), so it uses no CUDA or C++ standard
// headers: the 16-bit floats and complex types are plain structs. On the GPU
// they convert to and from float with the hardware's conversion instructions
// (inline PTX, as cuda_fp16.h and cuda_bf16.h do); every host build uses
// integer bit arithmetic with the same results, exact where the hardware's is.
#pragma once

#define GF_WARP 32
#define GF_FULL_MASK 0xffffffffu
// Dimensions a strided leaf may keep after the host merged what it could.
#define GF_MAX_DIMS 8
// Threads of the single block that finishes a norm. A compile-time constant
// because the reduction tree, and so the bits of the result, depend on it.
#define GF_FINISH_THREADS 256
// A slot with more work items than this is summed in the finishing block's
// fixed tree; smaller slots are summed by one thread, in item order.
#define GF_SMALL_SLOT_ITEMS 16
// A slot with more items than this (a 16M-element leaf) is summed by the
// whole finishing block when per-leaf norms are asked for; the others
// in the tree are played by one warp each, all warps at once. The tree, and
// so the bits, is the same either way.
#define GF_BLOCK_SLOT_ITEMS 4096
// Threads per block of the grid-stride kernels, and the blocks per SM their
// __launch_bounds__ ask for: 256 * 4 threads at 64 registers each fill an
// SM's 65,536 registers, so the compiler keeps every kernel within 64.
#define GF_BLOCK_THREADS 256
#define GF_MIN_BLOCKS_PER_SM 4
// 16-byte vectors each lane loads before it uses the first (loads in flight).
#define GF_UNROLL 4

// The emulator's header may leave launch bounds out: they only guide the GPU
// register allocator, so on the host they mean nothing.
#if defined(GPUFLAT_EMULATOR) && !defined(__launch_bounds__)
#define __launch_bounds__(...)
#endif

// The dtypes' tags and their list (GF_TAG_<type>, GF_DTYPES, GF_OPTIM_DTYPES),
// written from gpuflat._src.layout.DTYPES.
#include "gpuflat_rules.h"

// ---------------------------------------------------------------- element types
// Each C++ type of GF_DTYPES. A new one defines its type, gf_widen and
// gf_narrow (its conversions, through gf_wide), and, where it differs from
// their defaults, the traits below: gf_is_complex, gf_in_float (with
// gf_to_float and gf_from_float), gf_compute and gf_pair. Everything else
// (gf_dispatch, the vectors, the clip's scale, the optimizers' loops, the
// host libraries' loops) follows from those.
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };
struct c64 { float re, im; };
struct c128 { double re, im; };

// Every element widened to a complex double: exact for every input dtype.
struct gf_wide { double re, im; };

// One row of the leaf (source) table; the layout is mirrored by
// gpuflat/_src/backends/cuda.py (LEAF_ROW_WORDS int64 words).
struct LeafRef {
    long long ptr;    // address of element [0, ..., 0]
    long long tag;    // dtype tag (gpuflat._src.dtypes.TAGS)
    long long ndim;   // dims after merging; 0 means contiguous: ptr + i * itemsize
    long long size;   // elements
    long long shape[GF_MAX_DIMS];
    long long stride[GF_MAX_DIMS];  // in bytes; negative strides are fine
    // i / shape[d] == __umul64hi(i, magic[d]) >> shift d for every index
    // i < 2^63 (see gf_addr); shift d is byte d of `shifts`.
    unsigned long long magic[GF_MAX_DIMS];
    long long shifts;
};

// One work item: elements [start, start + len) of slot `slot`, whose first
// element sits at `flat` in the flat buffer. Items never span two slots, so a
// norm partial belongs to exactly one leaf.
struct Item {
    long long slot;
    long long start;
    long long len;
    long long flat;
};

// Complex types have members re and im; their norms' terms are of both.
template <class T> struct gf_is_complex { static constexpr bool value = false; };
template <> struct gf_is_complex<c64> { static constexpr bool value = true; };
template <> struct gf_is_complex<c128> { static constexpr bool value = true; };

// The real type a T's arithmetic runs in: a clip's product (gf_scale) and
// the optimizers' updates (gpuflat_optim.cuh). PyTorch's: float for 16- and
// 32-bit floats and complex64, double for the 64-bit ones. Float also tells
// that T's values lie within float's range (gf_bad_from_sum in norms.cu).
template <class T> struct gf_compute { using type = float; };
template <> struct gf_compute<double> { using type = double; };
template <> struct gf_compute<c128> { using type = double; };

__device__ __forceinline__ double gf_inf() { return __longlong_as_double(0x7ff0000000000000LL); }
__device__ __forceinline__ double gf_nan() { return __longlong_as_double(0x7ff8000000000000LL); }

// ---------------------------------------------------------------- 16-bit floats
// A binary float with EBITS exponent bits and MBITS mantissa bits (f16: 5/10,
// bf16: 8/7) widened to double: exact.
template <int EBITS, int MBITS>
__device__ __forceinline__ double gf_small_to_double(unsigned short h) {
    const int BIAS = (1 << (EBITS - 1)) - 1;
    const unsigned long long sign = (unsigned long long)(h >> (EBITS + MBITS)) << 63;
    const int e = (h >> MBITS) & ((1 << EBITS) - 1);
    const unsigned long long m = h & ((1u << MBITS) - 1);
    if (e == (1 << EBITS) - 1)  // inf or NaN (payload kept, so NaN stays NaN)
        return __longlong_as_double((long long)(sign | 0x7ff0000000000000ULL | (m << (52 - MBITS))));
    if (e == 0) {  // zero or subnormal: m * 2^(1 - BIAS - MBITS), exact in double
        const double unit = __longlong_as_double((long long)((unsigned long long)(1 - BIAS - MBITS + 1023) << 52));
        const double v = (double)m * unit;
        return sign ? -v : v;
    }
    return __longlong_as_double(
        (long long)(sign | ((unsigned long long)(e - BIAS + 1023) << 52) | (m << (52 - MBITS))));
}

// double -> 16-bit float in ONE correctly rounded step (nearest, ties to
// even). Going through float first would round twice.
template <int EBITS, int MBITS>
__device__ __forceinline__ unsigned short gf_double_to_small(double x) {
    const int BIAS = (1 << (EBITS - 1)) - 1;
    const unsigned long long b = (unsigned long long)__double_as_longlong(x);
    const unsigned short sign = (unsigned short)((b >> 63) << (EBITS + MBITS));
    const unsigned short expmask = (unsigned short)(((1u << EBITS) - 1) << MBITS);
    const unsigned long long a = b & 0x7fffffffffffffffULL;
    if (a > 0x7ff0000000000000ULL) return sign | expmask | (unsigned short)(1u << (MBITS - 1));  // quiet NaN
    const int e = (int)(a >> 52) - 1023;
    if (e > BIAS) return sign | expmask;  // too big, or inf: inf
    unsigned long long m = a & 0xfffffffffffffULL;
    unsigned long long r;
    int shift;
    if (e >= 1 - BIAS) {  // normal: a carry out of the mantissa bumps the exponent (up to inf)
        shift = 52 - MBITS;
        r = ((unsigned long long)(e + BIAS) << MBITS) + (m >> shift);
    } else {  // subnormal or zero, in units of the smallest subnormal
        shift = 52 - MBITS + (1 - BIAS - e);
        if (shift > 53) return sign;  // below half the smallest subnormal
        m |= 1ULL << 52;
        r = m >> shift;
    }
    const unsigned long long rem = m & ((1ULL << shift) - 1);
    const unsigned long long half = 1ULL << (shift - 1);
    if (rem > half || (rem == half && (r & 1))) ++r;
    return sign | (unsigned short)r;
}

// 16-bit floats <-> float. Every float16 and bfloat16 value is a float, so
// widening through float is exact; narrowing a float rounds once, to nearest
// even. On the GPU one instruction each (cvt.rn.bf16.f32 needs sm_80; older
// targets take the bit arithmetic); NaN payloads may differ, never NaN-ness.
__device__ __forceinline__ float gf_f16_to_float(unsigned short h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
#else
    // On the CPU, gf_small_to_double's value (a NaN made quiet, as the
    // conversion of a double NaN to float makes it) computed in float's own
    // bits: every case computed and one selected, no branch, so that the
    // update loops vectorise (the two agree on all 2**16 inputs). A
    // subnormal or zero, m * 2^-24, is 2^-14 + m * 2^-24 (m in the low
    // mantissa bits) less 2^-14, exactly. (With m * 2^-24 as a product of
    // the int's conversion, GCC kept a branch and did not vectorise.)
    const unsigned sign = (unsigned)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    const unsigned normal = ((e + 112u) << 23) | (m << 13);
    const unsigned special = 0x7f800000u | (m << 13) | (m != 0 ? 0x400000u : 0u);
    const float tiny = __uint_as_float(113u << 23);  // 2^-14
    const unsigned small = __float_as_uint(__uint_as_float((113u << 23) | (m << 13)) - tiny);
    return __uint_as_float(sign | (e == 31 ? special : e == 0 ? small : normal));
#endif
}
// bfloat16 is the top half of a float32: a shift, on every target.
__device__ __forceinline__ float gf_bf16_to_float(unsigned short h) { return __uint_as_float((unsigned)h << 16); }

__device__ __forceinline__ unsigned short gf_float_to_f16(float x) {
#ifdef __CUDA_ARCH__
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#else
    // On the CPU, gf_double_to_small's rounding of the float's own bits,
    // every case computed and one selected, so that the update loops
    // vectorise (the two agree on all 2**32 floats). A normal result drops
    // 13 bits to nearest even (a carry out of the mantissa reaches inf);
    // below float16's normal range, adding 0.5 rounds |x| to a multiple of
    // 2^-24, float16's smallest subnormal, in the sum's low bits (F. Giesen's
    // float_to_half_fast3_rtne).
    const unsigned u = __float_as_uint(x), a = u & 0x7fffffffu;
    const unsigned normal = (a - 0x38000000u + 0xfffu + ((a >> 13) & 1u)) >> 13;
    const unsigned small = __float_as_uint(__uint_as_float(a) + 0.5f) - 0x3f000000u;
    const unsigned big = a > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN (quiet) or inf
    return (unsigned short)(((u >> 16) & 0x8000u) | (a >= 0x47800000u ? big : a < 0x38800000u ? small : normal));
#endif
}
__device__ __forceinline__ unsigned short gf_float_to_bf16(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
#elif defined(__CUDA_ARCH__)
    return gf_double_to_small<8, 7>((double)x);
#else
    // On the CPU (the host library, the emulator), the same rounding on the
    // float's own bits, since bfloat16 is a float's top half: nearest even,
    // subnormals and the overflow to inf included, and a quiet NaN as
    // gf_double_to_small gives it (the two agree on all 2**32 floats). No
    // branch but NaN's, which a select takes: the update loops vectorise.
    const unsigned u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)(((u >> 16) & 0x8000u) | 0x7fc0u);
    return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#endif
}

// ---------------------------------------------------------------- conversions
// All conversions go through gf_wide: complex -> real takes the real part,
// real -> complex sets im = 0.
__device__ __forceinline__ gf_wide gf_widen(f16 x) { return {(double)gf_f16_to_float(x.bits), 0.0}; }
__device__ __forceinline__ gf_wide gf_widen(bf16 x) { return {(double)gf_bf16_to_float(x.bits), 0.0}; }
__device__ __forceinline__ gf_wide gf_widen(float x) { return {(double)x, 0.0}; }
__device__ __forceinline__ gf_wide gf_widen(double x) { return {x, 0.0}; }
__device__ __forceinline__ gf_wide gf_widen(c64 x) { return {(double)x.re, (double)x.im}; }
__device__ __forceinline__ gf_wide gf_widen(c128 x) { return {x.re, x.im}; }

template <class T> __device__ __forceinline__ T gf_narrow(gf_wide w);
template <> __device__ __forceinline__ f16 gf_narrow<f16>(gf_wide w) { return {gf_double_to_small<5, 10>(w.re)}; }
template <> __device__ __forceinline__ bf16 gf_narrow<bf16>(gf_wide w) { return {gf_double_to_small<8, 7>(w.re)}; }
template <> __device__ __forceinline__ float gf_narrow<float>(gf_wide w) { return (float)w.re; }
template <> __device__ __forceinline__ double gf_narrow<double>(gf_wide w) { return w.re; }
template <> __device__ __forceinline__ c64 gf_narrow<c64>(gf_wide w) { return {(float)w.re, (float)w.im}; }
template <> __device__ __forceinline__ c128 gf_narrow<c128>(gf_wide w) { return {w.re, w.im}; }

template <class A, class B> struct gf_same { static constexpr bool value = false; };
template <class A> struct gf_same<A, A> { static constexpr bool value = true; };

// The real types that float holds exactly, and their float value.
template <class T> struct gf_in_float { static constexpr bool value = false; };
template <> struct gf_in_float<f16> { static constexpr bool value = true; };
template <> struct gf_in_float<bf16> { static constexpr bool value = true; };
template <> struct gf_in_float<float> { static constexpr bool value = true; };
__device__ __forceinline__ float gf_to_float(f16 x) { return gf_f16_to_float(x.bits); }
__device__ __forceinline__ float gf_to_float(bf16 x) { return gf_bf16_to_float(x.bits); }
__device__ __forceinline__ float gf_to_float(float x) { return x; }
template <class T> __device__ __forceinline__ T gf_from_float(float x);
template <> __device__ __forceinline__ f16 gf_from_float<f16>(float x) { return {gf_float_to_f16(x)}; }
template <> __device__ __forceinline__ bf16 gf_from_float<bf16>(float x) { return {gf_float_to_bf16(x)}; }
template <> __device__ __forceinline__ float gf_from_float<float>(float x) { return x; }

// x converted to T, rounded once: a copy of the bits where the types match;
// through float, exactly, between float and the 16-bit floats (one rounding
// from float is the one rounding from the exact value); else through gf_wide.
template <class T, class S>
__device__ __forceinline__ T gf_convert(S x) {
    if constexpr (gf_same<T, S>::value) return x;
    else if constexpr (gf_in_float<S>::value && gf_in_float<T>::value) return gf_from_float<T>(gf_to_float(x));
    else return gf_narrow<T>(gf_widen(x));
}

// Two elements of a 32-bit word at a time, for the optimizers' vectors
// (optim.cu): lo and hi widen the word's low and high element to float, and
// join narrows two floats into a word, each rounded once as gf_from_float
// rounds it. By default a type has none: one element at a time.
template <class T> struct gf_pair { static constexpr bool value = false; };
template <> struct gf_pair<f16> {
    static constexpr bool value = true;
    static __device__ __forceinline__ float lo(unsigned w) { return gf_f16_to_float((unsigned short)(w & 0xffffu)); }
    static __device__ __forceinline__ float hi(unsigned w) { return gf_f16_to_float((unsigned short)(w >> 16)); }
    // One instruction for the pair on sm_80 and later.
    static __device__ __forceinline__ unsigned join(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        unsigned w;
        asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
        return w;
#else
        return (unsigned)gf_float_to_f16(lo) | (unsigned)gf_float_to_f16(hi) << 16;
#endif
    }
};
// A bfloat16 is the top half of a float, so a word's high element is the
// word with its low half cleared and its low one the word shifted up: one
// instruction each, where extracting the 16 bits first took two.
template <> struct gf_pair<bf16> {
    static constexpr bool value = true;
    static __device__ __forceinline__ float lo(unsigned w) { return __uint_as_float(w << 16); }
    static __device__ __forceinline__ float hi(unsigned w) { return __uint_as_float(w & 0xffff0000u); }
    static __device__ __forceinline__ unsigned join(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        unsigned w;
        asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(w) : "f"(hi), "f"(lo));
        return w;
#else
        return (unsigned)gf_float_to_bf16(lo) | (unsigned)gf_float_to_bf16(hi) << 16;
#endif
    }
};

// Calls f(S{}) with S the element type named by a dtype tag (GF_DTYPES). The
// tag is uniform over a work item (one leaf), so the switch never diverges a
// warp and a mixed-dtype tree is still one launch.
#define GF_DISPATCH_CASE(tag, T) case tag: f(T{}); break;
template <class F>
__device__ __forceinline__ void gf_dispatch(long long tag, F f) {
    switch (tag) {
        GF_DTYPES(GF_DISPATCH_CASE)
        default: break;
    }
}
#undef GF_DISPATCH_CASE

// ---------------------------------------------------------------- addressing
__device__ __forceinline__ long long gf_min(long long a, long long b) { return a < b ? a : b; }

// Address of element i (C order) of a strided leaf: 64-bit arithmetic
// throughout, so leaves and trees past 2^31 elements index correctly. The
// division by each dim's length is a multiply-high and a shift with the
// host's precomputed magic number (Granlund and Montgomery, "Division by
// invariant integers using multiplication", PLDI 1994, theorem 4.2:
// https://gmplib.org/~tege/divcnst-pldi94.pdf), a few instructions instead of
// a 64-bit division routine per element and dim. With `left`, also how many
// elements from i on share its innermost row (they lie stride[ndim - 1]
// apart), so a run of elements needs one address computation per row.
__device__ __forceinline__ char* gf_addr(const LeafRef& L, long long i, long long itemsize,
                                         long long* left = nullptr) {
    char* p = (char*)L.ptr;
    const int nd = (int)L.ndim;
    if (nd == 0) return p + i * itemsize;
    long long off = 0;
    // One dim at a time: unrolled, the loop had several dims' shapes, strides
    // and magic numbers loaded at once, and set the register peak of the
    // kernels (spills under CUDA 13 for sm_90).
#pragma unroll 1
    for (int d = nd - 1; d > 0; --d) {
        const int shift = (int)((unsigned long long)L.shifts >> (8 * d)) & 63;
        const long long q = (long long)(__umul64hi((unsigned long long)i, L.magic[d]) >> shift);
        const long long r = i - q * L.shape[d];
        if (left && d == nd - 1) *left = L.shape[d] - r;
        off += r * L.stride[d];
        i = q;
    }
    if (left && nd == 1) *left = L.shape[0] - i;
    return p + off + i * L.stride[0];  // the outermost index is what remains
}

// The per-lane loop over one work item of a leaf of element type S.
//
// The item's elements are grouped into vectors of V = 16 / sizeof(S)
// consecutive elements; vector j belongs to lane j % 32 and each lane visits
// its vectors in increasing j, elements in order. That mapping depends only
// on the dtype, never on alignment or strides, so a norm accumulates in the
// same order whichever path reads it, and its bits do not depend on where an
// array happens to live.
//
// gf_item_loop takes contiguous leaves: an item that starts 16-byte aligned
// is read (and written) with one 16-byte access per vector, U vectors per
// lane at a time, all loaded before the first is used, so several loads are
// in flight per lane instead of one load followed by its dependent
// arithmetic; a misaligned item, and an aligned one's last partial vector,
// one element at a time. gf_strided_loop takes strided leaves, one element
// at a time through gf_addr.
//
// op(i0, v, n) gets the item-relative index of the vector's first element and
// the vector, of which the first n elements are real; READ fills v from
// memory first, WRITE stores it after.
template <class S>
struct gf_vec {
    static constexpr int V = 16 / (int)sizeof(S);
    union {
        int4 raw;
        S v[V];
    };
};

// *p, loaded where this is written: the read-only load that __ldg compiles
// to, volatile so that the compiler keeps its place. A plain load's place is
// the compiler's choice: where each field was read inside the branch that
// the one before chose, it loaded them one after another, and written early
// it placed them differently per kernel and target (with more spills for the
// p-norm under CUDA 13 for sm_100).
__device__ __forceinline__ long long gf_load_here(const long long* p) {
#ifdef __CUDA_ARCH__
    long long v;
    asm volatile("ld.global.nc.s64 %0, [%1];" : "=l"(v) : "l"(p));
    return v;
#else
    return *p;
#endif
}

// A leaf's row with the fields every item needs loaded together as the item
// starts (gf_on_leaf with EARLY); the loops below take it or the row itself.
struct gf_leaf {
    const LeafRef& row;  // the rest: a strided leaf's shape, strides and magic numbers
    long long ptr, tag, ndim;
};
__device__ __forceinline__ const LeafRef& gf_row(const LeafRef& L) { return L; }
__device__ __forceinline__ const LeafRef& gf_row(const gf_leaf& L) { return L.row; }

// The first n elements of vector i0 / V of a contiguous item, one at a time
// (the item's last vector, or any vector of an item not 16-byte aligned),
// each as a vector of one (the same order as whole vectors). The loop runs
// V guarded trips, a bound the compiler knows: bounded by n alone, it was
// unrolled sixteen times, with sixteen elements' loads held in registers.
template <class S, bool READ, bool WRITE, class Leaf, class Op>
__device__ __forceinline__ void gf_elements(const Leaf& L, long long start, long long i0, int n, Op op) {
    S* const p = (S*)L.ptr + start + i0;
#pragma unroll
    for (int k = 0; k < gf_vec<S>::V; ++k) {
        if (k < n) {
            S v[gf_vec<S>::V];
            if constexpr (READ) v[0] = p[k];
            op(i0 + k, v, 1);
            if constexpr (WRITE) p[k] = v[0];
        }
    }
}

template <class S, bool READ, bool WRITE, int U = GF_UNROLL, class Leaf, class Op>
__device__ __forceinline__ void gf_item_loop(const Leaf& L, long long start, long long len, int lane, Op op) {
    constexpr int V = gf_vec<S>::V;
    S* const first = (S*)L.ptr + start;
    const long long nvec = (len + V - 1) / V;
    long long j = lane;
    if (((unsigned long long)first & 15ULL) == 0) {
        int4* const vecs = reinterpret_cast<int4*>(first);
        const long long nfull = len / V;
        for (; j + (U - 1) * GF_WARP < nfull; j += U * GF_WARP) {
            gf_vec<S> u[U];
            if constexpr (READ) {
#pragma unroll
                for (int r = 0; r < U; ++r) u[r].raw = vecs[j + r * GF_WARP];
            }
#pragma unroll
            for (int r = 0; r < U; ++r) op((j + r * GF_WARP) * V, u[r].v, V);
            if constexpr (WRITE) {
#pragma unroll
                for (int r = 0; r < U; ++r) vecs[j + r * GF_WARP] = u[r].raw;
            }
        }
        // Fewer than U trips, which the compiler cannot tell: left to it, this
        // loop was unrolled sixteen times, with sixteen vectors held in
        // registers, and so was the element loop below.
#pragma unroll 1
        for (; j < nfull; j += GF_WARP) {
            gf_vec<S> u;
            if constexpr (READ) u.raw = vecs[j];
            op(j * V, u.v, V);
            if constexpr (WRITE) vecs[j] = u.raw;
        }
    }
#pragma unroll 1
    for (; j < nvec; j += GF_WARP) gf_elements<S, READ, WRITE>(L, start, j * V, (int)gf_min((long long)V, len - j * V), op);
}

// A strided item, one element at a time in the same order: element i
// belongs to lane (i / V) % 32, and each lane takes its vectors' elements
// in increasing i. An element's address is computed where the lane enters a
// vector or a row of the leaf's innermost dim, and stepped along the row
// from there. One index walks the lane's elements (no vector index and
// bound beside it), so fewer values stay live beside gf_addr's arithmetic.
template <class S, bool READ, bool WRITE, class Leaf, class Op>
__device__ __forceinline__ void gf_strided_loop(const Leaf& L, long long start, long long len, int lane, Op op) {
    constexpr long long V = gf_vec<S>::V;
    constexpr long long SKIP = (GF_WARP - 1) * V;  // the other lanes' elements between two of this lane's vectors
    const LeafRef& row = gf_row(L);
    const long long step = row.stride[L.ndim - 1];
    char* at = nullptr;
    long long left = 0;  // elements from `at` on left in its row
#pragma unroll 1
    for (long long i = lane * V; i < len;) {
        if (left == 0) at = gf_addr(row, start + i, (long long)sizeof(S), &left);
        S* const p = (S*)at;
        S v[gf_vec<S>::V];
        if constexpr (READ) v[0] = *p;
        op(i, v, 1);
        if constexpr (WRITE) *p = v[0];
        ++i;
        at += step;
        --left;
        if ((i & (V - 1)) == 0) {
            i += SKIP;
            left = 0;
        }
    }
}

// f(x) for the first n elements of a vector, in order.
template <class S, class F>
__device__ __forceinline__ void gf_for_each(S (&v)[gf_vec<S>::V], int n, F f) {
#pragma unroll
    for (int k = 0; k < gf_vec<S>::V; ++k)
        if (k < n) f(v[k]);
}

// Element i of a leaf of any dtype, widened (the slow, general path).
__device__ __forceinline__ gf_wide gf_load_any(const LeafRef& L, long long i) {
    gf_wide w = {0.0, 0.0};
    gf_dispatch(L.tag, [&](auto z) {
        using S = decltype(z);
        w = gf_widen(*(const S*)gf_addr(L, i, (long long)sizeof(S)));
    });
    return w;
}

// The warp index of this thread over the whole grid, and the warp count: work
// items are handed out warp by warp, grid-stride, so any grid covers them.
__device__ __forceinline__ long long gf_global_warp() {
    return ((long long)blockIdx.x * (long long)blockDim.x + (long long)threadIdx.x) / GF_WARP;
}
__device__ __forceinline__ long long gf_warp_count() {
    return ((long long)gridDim.x * (long long)blockDim.x) / GF_WARP;
}

// ---------------------------------------------------------------- the item harness
// Every grid-stride kernel walks its work items the same way, as Apex's
// multi-tensor apply does for its functors
// (https://github.com/NVIDIA/apex/blob/master/csrc/multi_tensor_apply.cuh):
// the harness hands out the items and finds each one's leaf and element type,
// and a kernel is a small body per item. The order of the elements within an
// item is gf_item_loop's, so a body's sums keep their bits.

// This thread's lane, read from the thread index where it is used. Kept from
// the kernel's start instead, the lane (and the thread index the compiler
// derives lane offsets from) stayed live through every item's loops: two
// registers fewer for them, which CUDA 13's ptxas made up for with spills.
__device__ __forceinline__ int gf_lane() {
#ifdef __CUDA_ARCH__
    unsigned t;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
    return (int)(t % GF_WARP);
#else
    return (int)(threadIdx.x % GF_WARP);
#endif
}

// fn(it, item, lane) for every work item `it`, one warp each, grid-stride.
template <class Fn>
__device__ __forceinline__ void gf_for_items(const Item* __restrict__ items, long long n_items, Fn fn) {
    const long long nwarps = gf_warp_count();
    for (long long it = gf_global_warp(); it < n_items; it += nwarps) {
        const Item item = items[it];
        fn(it, item, gf_lane());
    }
}

// fn(L, S{}) with L the leaf of table row `row` and S its element type. With
// EARLY, L is a gf_leaf whose fields were loaded together first: read where
// first used, each inside the branch that the one before chose (the dtype,
// then strided or not, then the address), they are a chain of three
// dependent loads ahead of the item's data; loaded early, one. The price is
// registers held across the dispatch, which not every kernel can spare (the
// resource gates in tests/test_kernel_resources.py tell).
template <bool EARLY, class Fn>
__device__ __forceinline__ void gf_on_leaf(const LeafRef& row, Fn fn) {
    if constexpr (EARLY) {
        const gf_leaf L = {row, gf_load_here(&row.ptr), gf_load_here(&row.tag), gf_load_here(&row.ndim)};
        gf_dispatch(L.tag, [&](auto z) { fn(L, z); });
    } else {
        gf_dispatch(row.tag, [&](auto z) { fn(row, z); });
    }
}

// fn(item, L, lane, S{}) for every work item, with L and S its leaf's (see
// gf_on_leaf).
template <bool EARLY, class Fn>
__device__ __forceinline__ void gf_for_leaf_items(const Item* __restrict__ items, long long n_items,
                                                  const LeafRef* __restrict__ leaves, Fn fn) {
    gf_for_items(items, n_items, [&](long long, const Item& item, int lane) {
        gf_on_leaf<EARLY>(leaves[item.slot], [&](const auto& L, auto z) { fn(item, L, lane, z); });
    });
}

// The per-lane loop over an item's elements (see gf_item_loop): the strided
// path for a strided leaf, else the contiguous one with U vectors in flight.
template <class S, bool READ, bool WRITE, int U = GF_UNROLL, class Leaf, class Op>
__device__ __forceinline__ void gf_leaf_loop(const Leaf& L, const Item& item, int lane, Op op) {
    if (L.ndim != 0) gf_strided_loop<S, READ, WRITE>(L, item.start, item.len, lane, op);
    else gf_item_loop<S, READ, WRITE, U>(L, item.start, item.len, lane, op);
}
