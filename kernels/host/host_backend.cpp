// The native host backend (gpuflat/_src/backends/host.py): gather, scatter, norms
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
// Large calls share their work items among threads in chunks; every item's
// partial lands in its own slot and the finish runs on one thread, so the
// thread count never changes a bit. Small calls run on the calling thread.
//
// Arrays arrive as Python objects (the library is loaded with ctypes.PyDLL):
// reading 10,000 data pointers and strides here costs microseconds, where
// reading them in Python costs milliseconds. A resident model's norms skip
// even that: its leaves come as a table of rows built once (its clips read
// the one flat buffer). The GIL is released while the loops run.
//
// Of NumPy's C API only the array struct's accessors are used, the names in
// gpuflat/_src/native.py's NUMPY_API: inline reads of fields whose place is
// the same in every NumPy from the floor to the newest, which need no
// import_array(). What they cannot tell without more of the API is decided in
// Python: which type number is which dtype (given to gf_host_init), and byte
// order (the tree walk refuses byte-swapped leaves before any backend sees them).
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/ndarraytypes.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "host_prelude.h"
#include "gpuflat_math.cuh"
// The layout's item size, dtype tags and rule numbers (written from gpuflat._src.layout).
#include "gpuflat_rules.h"
#include "host_items.h"

#define GF_EXPORT extern "C" __attribute__((visibility("default")))

namespace {

constexpr long long ITEM = GF_ITEM;  // elements per work item
// Below this many elements per thread, starting a thread costs more than it
// saves: a start costs tens of microseconds on an idle machine, and
// milliseconds when other processes hold the cores, while 2M elements are a
// few hundred microseconds of work.
constexpr long long MIN_WORK_PER_THREAD = 1 << 21;
// Elements a thread claims at a time when several run: small enough to share
// the work evenly, large enough that claiming costs nothing.
constexpr long long CHUNK_WORK = 1 << 18;
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

// The most dims an array may have: NumPy 2's limit (NumPy 1's is 32). An
// array with more (a NumPy yet to come) is refused, never overrun.
constexpr int MAX_DIMS = 64;
constexpr int N_TAGS = GF_N_TAGS;

PyTypeObject* g_ndarray = nullptr;
// The NumPy type number of each dtype tag (gpuflat/_src/layout.py's rows),
// -1 for one not known yet (bfloat16 before ml_dtypes is imported).
std::array<int, N_TAGS> g_type_num = [] {
    std::array<int, N_TAGS> nums;
    nums.fill(-1);
    return nums;
}();

int tag_of(PyArrayObject* a) {
    const int num = PyArray_TYPE(a);
    for (int tag = 0; tag < N_TAGS; ++tag)
        if (g_type_num[tag] == num) return tag;
    return -1;
}

// NumPy's own judgement of whether every element sits at a multiple of its dtype's alignment.
bool aligned(PyArrayObject* a) { return (PyArray_FLAGS(a) & NPY_ARRAY_ALIGNED) != 0; }

long long itemsize_of(int tag) {
    static const long long sizes[] = {GF_ITEMSIZES};
    return sizes[tag];
}

// Whether merged dims (`kept` pairs of extent and byte stride in `n_s`, no
// extent 1) fill one dense block of memory: sorted by |stride|, a C-contiguous
// layout's (gpuflat/_src/memory_order.py's dense_start). If so, `start` is the byte
// offset of the block's lowest address. Norms and clips read such a leaf as
// that block, contiguously, in memory order.
bool dense_block(const long long* n_s, int kept, long long itemsize, long long& start) {
    int order[MAX_DIMS];
    for (int d = 0; d < kept; ++d) order[d] = d;
    // Equal |strides| never pass (each extent is at least 2), whatever their order here.
    std::sort(order, order + kept,
              [&](int a, int b) { return std::llabs(n_s[2 * a + 1]) < std::llabs(n_s[2 * b + 1]); });
    long long expected = itemsize;
    start = 0;
    for (int k = 0; k < kept; ++k) {
        const long long n = n_s[2 * order[k]], stride = n_s[2 * order[k] + 1];
        if (std::llabs(stride) != expected) return false;
        expected *= n;
        if (stride < 0) start += (n - 1) * stride;
    }
    return true;
}

// Which order a strided leaf is read in: its logical (C) order (gather,
// scatter), or its memory's where it fills one dense block (norms, clips).
enum class Order { logical, memory };

// Leaves of one call; merged dims live in `dims`, pointed to once all are read
// (the vector may move while it grows).
struct LeafSet {
    std::vector<Leaf> leaves;
    std::vector<long long> dims;
    std::vector<long long> dims_at;

    // Adds array `obj`, read in `order`; false if it is not a native-order
    // ndarray of a gpuflat dtype.
    bool add(PyObject* obj, Order order) {
        if (!PyObject_TypeCheck(obj, g_ndarray)) return false;
        PyArrayObject* a = (PyArrayObject*)obj;
        const int tag = tag_of(a);
        if (tag < 0) return false;
        const long long itemsize = itemsize_of(tag);
        const int nd = PyArray_NDIM(a);
        if (nd > MAX_DIMS) return false;
        const auto* shape = PyArray_DIMS(a);
        const auto* strides = PyArray_STRIDES(a);
        long long size = 1;
        for (int d = 0; d < nd; ++d) size *= shape[d];
        const long long at = (long long)dims.size();
        // Size-1 dims dropped, neighbours merged where the strides allow (as
        // the CUDA backend's table rows): a transposed matrix keeps 2 dims.
        // Pairs (extent, stride) on the stack: no allocation per leaf.
        long long n_s[2 * MAX_DIMS];
        int kept = 0;
        for (int d = 0; d < nd && size > 0; ++d) {
            if (shape[d] == 1) continue;
            if (kept > 0 && n_s[2 * kept - 1] == strides[d] * shape[d]) {
                n_s[2 * kept - 2] *= shape[d];
                n_s[2 * kept - 1] = strides[d];
            } else {
                n_s[2 * kept] = shape[d];
                n_s[2 * kept + 1] = strides[d];
                ++kept;
            }
        }
        bool contiguous = kept == 0 || (kept == 1 && n_s[1] == itemsize);
        char* ptr = (char*)PyArray_DATA(a);
        long long start = 0;
        if (!contiguous && order == Order::memory && dense_block(n_s, kept, itemsize, start)) {
            ptr += start;  // the lowest address; an aligned array's is aligned too
            contiguous = true;
        }
        int ndim = 0;
        if (size > 0 && !(contiguous && aligned(a))) {
            if (contiguous) {
                kept = 1;
                n_s[0] = size;
                n_s[1] = itemsize;
            }
            ndim = kept;
            for (int d = 0; d < ndim; ++d) dims.push_back(n_s[2 * d]);
            for (int d = 0; d < ndim; ++d) dims.push_back(n_s[2 * d + 1]);
        }
        dims_at.push_back(at);
        leaves.push_back(Leaf{ptr, tag, ndim, size, nullptr, nullptr});
        return true;
    }

    // One contiguous leaf per slot of the 1-D buffer `flat`; false if it is not
    // an aligned, contiguous, native-order ndarray of a gpuflat dtype holding
    // exactly offsets[n_slots] elements.
    bool add_slots(PyObject* flat, const long long* offsets, long long n_slots) {
        if (!PyObject_TypeCheck(flat, g_ndarray)) return false;
        PyArrayObject* a = (PyArrayObject*)flat;
        const int tag = tag_of(a);
        if (tag < 0 || PyArray_NDIM(a) != 1 || !aligned(a)) return false;
        const long long itemsize = itemsize_of(tag);
        const long long size = PyArray_DIMS(a)[0];
        if (size != offsets[n_slots] || (size > 1 && PyArray_STRIDES(a)[0] != itemsize)) return false;
        char* base = (char*)PyArray_DATA(a);
        leaves.reserve(n_slots);
        for (long long s = 0; s < n_slots; ++s)
            leaves.push_back(Leaf{base + offsets[s] * itemsize, tag, 0, offsets[s + 1] - offsets[s], nullptr, nullptr});
        return true;
    }

    // The leaves of a leaf table (LeafRef rows, gpuflat/_src/backends/cuda.py's
    // layout), as gpuflat.torch builds it from tensors' metadata, for norms
    // and clips: a row filling one dense block reads as that block. A
    // contiguous row whose address is not a multiple of its itemsize reads
    // through the strided (memcpy) path, as an unaligned array does.
    void add_rows(const LeafRef* rows, long long n) {
        leaves.reserve(n);
        dims_at.reserve(n);
        for (long long i = 0; i < n; ++i) {
            const LeafRef& r = rows[i];
            const int tag = (int)r.tag;
            int ndim = (int)r.ndim;
            char* ptr = (char*)r.ptr;
            long long n_s[2 * GF_MAX_DIMS];
            int kept = 0;
            for (int d = 0; d < ndim; ++d) {
                if (r.shape[d] == 1) continue;
                n_s[2 * kept] = r.shape[d];
                n_s[2 * kept + 1] = r.stride[d];
                ++kept;
            }
            long long start = 0;
            if (ndim > 0 && r.size > 0 && dense_block(n_s, kept, itemsize_of(tag), start)) {
                ptr += start;
                ndim = 0;
            }
            dims_at.push_back((long long)dims.size());
            if (ndim == 0 && r.size > 0 && (long long)ptr % itemsize_of(tag) != 0) {
                ndim = 1;
                dims.push_back(r.size);
                dims.push_back(itemsize_of(tag));
            } else {
                for (int d = 0; d < ndim; ++d) dims.push_back(r.shape[d]);
                for (int d = 0; d < ndim; ++d) dims.push_back(r.stride[d]);
            }
            leaves.push_back(Leaf{ptr, tag, ndim, r.size, nullptr, nullptr});
        }
        finish();
    }

    void clear() {
        leaves.clear();
        dims.clear();
        dims_at.clear();
    }

    void finish() {
        for (size_t i = 0; i < leaves.size(); ++i) {
            leaves[i].shape = dims.data() + dims_at[i];
            leaves[i].stride = dims.data() + dims_at[i] + leaves[i].ndim;
        }
    }
};

// `seq` as a list or tuple (a new reference): itself where it is one, a
// subclass included (PySequence_Fast would copy a list subclass), else a
// new list; nullptr with a Python error set if it is no sequence.
PyObject* fast_sequence(PyObject* seq, const char* message) {
    if (PyList_Check(seq) || PyTuple_Check(seq)) {
        Py_INCREF(seq);
        return seq;
    }
    return PySequence_Fast(seq, message);
}

// Reads a sequence of arrays in `order`; returns the index of the first unreadable one, or -1.
long long read_leaves(PyObject* seq, LeafSet& set, Order order) {
    PyObject* fast = fast_sequence(seq, "expected a sequence of arrays");
    if (!fast) return 0;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject** items = PySequence_Fast_ITEMS(fast);
    set.leaves.reserve(n);
    set.dims_at.reserve(n);
    long long bad = -1;
    for (Py_ssize_t i = 0; i < n && bad < 0; ++i)
        if (!set.add(items[i], order)) bad = i;
    Py_DECREF(fast);
    set.finish();
    return bad;
}

// Reads a sequence of sequences of arrays (a slot's sources) into one list,
// slot s's sources at csr[s] .. csr[s + 1] (an array in place of a sequence
// is its slot's one source); returns the position of the first unreadable
// array in that list, or -1.
long long read_sources(PyObject* seq, LeafSet& set, std::vector<long long>& csr) {
    PyObject* fast = fast_sequence(seq, "expected a sequence of sequences of arrays");
    if (!fast) return 0;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject** slots = PySequence_Fast_ITEMS(fast);
    set.leaves.reserve(n);
    set.dims_at.reserve(n);
    csr.assign(n + 1, 0);
    long long bad = -1;
    for (Py_ssize_t s = 0; s < n && bad < 0; ++s) {
        if (PyObject_TypeCheck(slots[s], g_ndarray)) {  // an array: the slot's one source
            if (!set.add(slots[s], Order::logical)) bad = (long long)set.leaves.size();
            csr[s + 1] = (long long)set.leaves.size();
            continue;
        }
        PyObject* sources = fast_sequence(slots[s], "expected a sequence of arrays");
        if (!sources) {
            bad = (long long)set.leaves.size();
            break;
        }
        const Py_ssize_t m = PySequence_Fast_GET_SIZE(sources);
        PyObject** arrays = PySequence_Fast_ITEMS(sources);
        for (Py_ssize_t k = 0; k < m && bad < 0; ++k)
            if (!set.add(arrays[k], Order::logical)) bad = (long long)set.leaves.size();
        Py_DECREF(sources);
        csr[s + 1] = (long long)set.leaves.size();
    }
    Py_DECREF(fast);
    set.finish();
    return bad;
}

template <class T>
T* data_of(PyObject* array) {
    return (T*)PyArray_DATA((PyArrayObject*)array);
}

// ------------------------------------------------------------ work items

// The tables of one call. Each calling thread keeps one set and reuses its
// memory, so a call on 10,000 leaves allocates (and page-faults) nothing
// once the first has sized them.
struct Workspace {
    LeafSet set;
    std::vector<long long> csr;
    std::vector<Item> items;
    std::vector<double> partial;
};

Workspace& thread_workspace() {
    thread_local Workspace w;
    return w;
}

// The calling thread's workspace, its leaf set emptied.
Workspace& workspace() {
    Workspace& w = thread_workspace();
    w.set.clear();
    return w;
}

// The items of a plan from its offsets (n_slots + 1 of them), as
// gpuflat._src.backends.cuda.plan_items builds them, into `items`.
void plan_items(const long long* offsets, long long n_slots, std::vector<Item>& items) {
    items.clear();
    for (long long s = 0; s < n_slots; ++s) gf_append_items(items, s, offsets[s + 1] - offsets[s], offsets[s]);
}

long long cost_of(const Item& item) { return item.len + ITEM_OVERHEAD; }

// Runs body(first, end) over contiguous ranges of items, on up to `threads`
// threads. The ranges are chunks of about CHUNK_WORK, claimed in order by
// whichever thread is free, so a thread that starts late (other processes
// hold the cores) takes fewer and nobody waits for its share. Which thread
// runs an item never changes its result.
template <class Body>
void parallel_items(const std::vector<Item>& items, int threads, Body body) {
    const long long n = (long long)items.size();
    long long total = 0;
    for (const Item& item : items) total += cost_of(item);
    const long long t = std::max(1LL, std::min<long long>(threads, total / MIN_WORK_PER_THREAD));
    if (t == 1) {
        body(0LL, n);
        return;
    }
    std::vector<long long> bounds{0};
    long long work = 0;
    for (long long i = 0; i < n; ++i) {
        work += cost_of(items[i]);
        if (work >= CHUNK_WORK || i == n - 1) {
            bounds.push_back(i + 1);
            work = 0;
        }
    }
    const size_t chunks = bounds.size() - 1;
    std::atomic<size_t> next{0};
    auto run = [&] {
        for (size_t c = next++; c < chunks; c = next++) body(bounds[c], bounds[c + 1]);
    };
    std::vector<std::thread> pool;
    for (long long k = 1; k < t; ++k) pool.emplace_back(run);
    run();
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
    long long idx_[MAX_DIMS];
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

// __shfl_down_sync's tree: lane l takes lane l + off, for off = 16 .. 1.
template <int K>
double lane_tree(double* acc) {
    for (int off = GF_WARP / 2; off > 0; off >>= 1)
        for (int l = 0; l < off; ++l) acc[l] = gf_combine<K>(acc[l], acc[l + off]);
    return acc[0];
}

// The item's partial in the kernel's order (gpuflat_norm_partial).
template <int K, class S>
double item_partial(const S* x, long long len, double p) {
    constexpr int V = 16 / (int)sizeof(S);
    constexpr bool CPLX = gf_is_complex<S>::value;
    constexpr long long STEP = (long long)GF_WARP * V;
    double acc[GF_WARP] = {};
    const long long full = len / STEP;
    for (long long r = 0; r < full; ++r) {
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
    return lane_tree<K>(acc);
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
//
// A dtype's lane is Wide2<S>: terms(a, b, idx) gives the terms of lanes
// 8g .. 8g + 7 at position k from rows a and b, with idx from lane_index,
// which picks elements in the permute's units (Unit: 16-, 32- or 64-bit
// integers) at unit AT * i + AT - 1 for lane i. A dtype without one (the
// primary template) takes the generic loop.
template <class S> struct Wide2 {};
struct Wide2Defaults {
    static constexpr int AT = 1;
};

template <> struct Wide2<float> : Wide2Defaults {
    using Unit = int;
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512d w = _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_permutex2var_ps(a, idx, b)));
        return _mm512_mul_pd(w, w);
    }
};
template <> struct Wide2<double> : Wide2Defaults {
    using Unit = long long;
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512d w = _mm512_permutex2var_pd(_mm512_castps_pd(a), idx, _mm512_castps_pd(b));
        return _mm512_mul_pd(w, w);
    }
};
template <> struct Wide2<f16> : Wide2Defaults {
    using Unit = short;
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512i h = _mm512_permutex2var_epi16(_mm512_castps_si512(a), idx, _mm512_castps_si512(b));
        const __m512d w = _mm512_cvtps_pd(_mm256_cvtph_ps(_mm512_castsi512_si128(h)));
        return _mm512_mul_pd(w, w);
    }
};
template <> struct Wide2<bf16> : Wide2Defaults {
    using Unit = short;
    static constexpr int AT = 2;  // element i in the high half of 32-bit slot i: a float's top half
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        // The mask zeroes the low halves.
        const __m512i f = _mm512_maskz_permutex2var_epi16(0xaaaaaaaau, _mm512_castps_si512(a), idx,
                                                           _mm512_castps_si512(b));
        const __m512d w = _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_castsi512_ps(f)));
        return _mm512_mul_pd(w, w);
    }
};
template <> struct Wide2<c64> : Wide2Defaults {  // idx picks the real parts; idx + 1 the imaginary ones
    using Unit = int;
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512i one = _mm512_set1_epi32(1);
        const __m512d re = _mm512_cvtps_pd(_mm512_castps512_ps256(_mm512_permutex2var_ps(a, idx, b)));
        const __m512d im = _mm512_cvtps_pd(
            _mm512_castps512_ps256(_mm512_permutex2var_ps(a, _mm512_add_epi32(idx, one), b)));
        return _mm512_add_pd(_mm512_mul_pd(re, re), _mm512_mul_pd(im, im));
    }
};
template <> struct Wide2<c128> : Wide2Defaults {
    using Unit = long long;
    static __m512d terms(__m512 a, __m512 b, __m512i idx) {
        const __m512i one = _mm512_set1_epi64(1);
        const __m512d re = _mm512_permutex2var_pd(_mm512_castps_pd(a), idx, _mm512_castps_pd(b));
        const __m512d im = _mm512_permutex2var_pd(_mm512_castps_pd(a), _mm512_add_epi64(idx, one), _mm512_castps_pd(b));
        return _mm512_add_pd(_mm512_mul_pd(re, re), _mm512_mul_pd(im, im));
    }
};

// Index vector k: lane i of a group takes element i * V + k of its 128 bytes,
// counted in the permute's units (Wide2<S>::Unit), at unit AT * i + AT - 1.
template <class S>
__m512i lane_index(int k) {
    using Unit = typename Wide2<S>::Unit;
    constexpr int V = 16 / (int)sizeof(S), PER = (int)(sizeof(S) / sizeof(Unit)), AT = Wide2<S>::AT;
    alignas(64) Unit idx[64 / sizeof(Unit)] = {};
    for (int i = 0; i < 8; ++i) idx[AT * i + AT - 1] = (Unit)((i * V + k) * PER);
    return _mm512_load_si512(idx);
}

// The V index vectors of a dtype, built once.
template <class S>
struct LaneIndices {
    __m512i idx[16 / sizeof(S)];
    LaneIndices() {
        for (int k = 0; k < (int)(16 / sizeof(S)); ++k) idx[k] = lane_index<S>(k);
    }
};

// Row `at` .. at + 63 of an item's bytes, of which `left` exist from `at` on:
// bytes past the end read as zero bits (+0.0 in every dtype), and a masked
// load never touches them.
inline __m512 load_row(const char* x, long long at, long long left) {
    if (left >= 64) return _mm512_loadu_ps(reinterpret_cast<const float*>(x + at));
    const __mmask64 mask = left <= 0 ? 0 : ~0ULL >> (64 - left);
    return _mm512_castsi512_ps(_mm512_maskz_loadu_epi8(mask, x + at));
}

// The 2-norm partial of one item in the lanes' order: steps of 32 vectors
// (512 bytes, 8 rows), the last one zero-padded to a whole step. The kernel's
// lane j adds the last step's vector j; the padding adds +0.0 terms, which
// change no sum of non-negative terms (nor a NaN), so these are the generic
// loop's bits.
template <class S>
double l2_partial(const S* x, long long len) {
    constexpr int V = 16 / (int)sizeof(S);
    static const LaneIndices<S> lanes;
    const __m512i* idx = lanes.idx;
    __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    const char* bytes = reinterpret_cast<const char*>(x);
    const long long n = len * (long long)sizeof(S);
    for (long long at = 0; at < n; at += 512) {
        const long long left = n - at;
        const __m512 r0 = load_row(bytes, at, left), r1 = load_row(bytes, at + 64, left - 64);
        const __m512 r2 = load_row(bytes, at + 128, left - 128), r3 = load_row(bytes, at + 192, left - 192);
        const __m512 r4 = load_row(bytes, at + 256, left - 256), r5 = load_row(bytes, at + 320, left - 320);
        const __m512 r6 = load_row(bytes, at + 384, left - 384), r7 = load_row(bytes, at + 448, left - 448);
        for (int k = 0; k < V; ++k) {
            a0 = _mm512_add_pd(a0, Wide2<S>::terms(r0, r1, idx[k]));
            a1 = _mm512_add_pd(a1, Wide2<S>::terms(r2, r3, idx[k]));
            a2 = _mm512_add_pd(a2, Wide2<S>::terms(r4, r5, idx[k]));
            a3 = _mm512_add_pd(a3, Wide2<S>::terms(r6, r7, idx[k]));
        }
    }
    // lane_tree in registers: lanes 0 .. 7 live in a0, 8 .. 15 in a1, and so on,
    // and each step adds lane l + off into lane l, as the scalar tree does.
    const __m512d lo16 = _mm512_add_pd(a0, a2), hi16 = _mm512_add_pd(a1, a3);  // off 16
    const __m512d lanes8 = _mm512_add_pd(lo16, hi16);                           // off 8
    const __m256d lanes4 = _mm256_add_pd(_mm512_castpd512_pd256(lanes8), _mm512_extractf64x4_pd(lanes8, 1));
    const __m128d lanes2 = _mm_add_pd(_mm256_castpd256_pd128(lanes4), _mm256_extractf128_pd(lanes4, 1));
    return _mm_cvtsd_f64(lanes2) + _mm_cvtsd_f64(_mm_unpackhi_pd(lanes2, lanes2));
}
#define GF_HOST_L2_SIMD 1

// A 16-bit float's 16 values at once, to float and back (Scale16<S>):
// widened exactly, and rounded once to nearest-even (vcvtps2ph for float16;
// for bfloat16 the integer form of the same rounding). A dtype without one
// (the primary template) is scaled one element at a time.
template <class S> struct Scale16 {};
template <> struct Scale16<f16> {
    static __m512 widen(__m256i h) { return _mm512_cvtph_ps(h); }
    static __m256i narrow(__m512 y) { return _mm512_cvtps_ph(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
};
template <> struct Scale16<bf16> {
    static __m512 widen(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
    static __m256i narrow(__m512 y) {
        const __m512i u = _mm512_castps_si512(y);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
        return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
    }
};

// gf_scale on 16 values at once: widened, one float multiply, narrowed. Only
// a NaN product leaves the two roundings apart (payload bits), so a group
// holding one is left to gf_scale itself; returns false for it.
template <class S>
bool scale16(S* x, float c) {
    const __m512 y = _mm512_mul_ps(Scale16<S>::widen(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                                   _mm512_set1_ps(c));
    if (_mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q)) return false;
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(x), Scale16<S>::narrow(y));
    return true;
}
#define GF_HOST_SCALE16 1
#endif

// x[0 .. n) scaled by gf_scale, 16 at a time where the machine and the dtype can (Scale16).
template <class S>
void scale_run(S* x, long long n, double coef) {
    long long i = 0;
#ifdef GF_HOST_SCALE16
    if constexpr (requires { Scale16<S>::widen; }) {
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

// One item's partial: a sum of squares (the 2-norm's, gf_norm's
// sum_of_squares) in SIMD where the machine and the dtype have a lane
// (Wide2), the rest (and any item whose SIMD partial is NaN) by the generic
// loop.
template <int K, class S>
double partial_of(const S* x, long long len, double p) {
#ifdef GF_HOST_L2_SIMD
    if constexpr (gf_norm<K>::sum_of_squares() && requires { Wide2<S>::terms; }) {
        const double fast = l2_partial(x, len);
        if (fast == fast) return fast;
    }
#endif
    return item_partial<K, S>(x, len, p);
}

template <int K>
void item_partials(const LeafSet& set, const std::vector<Item>& items, long long first, long long end,
                   double p, double* partial) {
    Scratch scratch;
    for (long long it = first; it < end;) {
        const int tag = set.leaves[items[it].slot].tag;
        // One dispatch for the run of items whose leaves share the dtype.
        gf_dispatch(tag, [&](auto z) {
            using S = decltype(z);
            for (; it < end && set.leaves[items[it].slot].tag == tag; ++it) {
                const Item& item = items[it];
                partial[it] = partial_of<K, S>(item_view<S>(set.leaves[item.slot], item, scratch), item.len, p);
            }
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

// The finishing block's strided order (thread t of GF_FINISH_THREADS takes
// values t, t + T, ... from 0.0, then gf_block_reduce's tree) over v[a .. b).
template <int K>
double strided_sum(const double* v, size_t a, size_t b) {
    const size_t T = GF_FINISH_THREADS;
    double red[GF_FINISH_THREADS];
    for (size_t t = 0; t < T; ++t) {
        double r = 0.0;
        for (size_t k = a + t; k < b; k += T) r = gf_combine<K>(r, v[k]);
        red[t] = r;
    }
    return block_tree<K>(red);
}

// gpuflat_norm_finish on one thread: each slot's norm from its items (as
// gf_slot_norms), the total from every item's partial at once, in the
// finishing block's order. Returns the unrooted total (sum |x|**p, or the max
// for inf); the caller takes its root.
template <int K>
double finish(const std::vector<Item>& items, const double* partial, long long n_slots, double p, double* per_leaf) {
    size_t a = 0;
    for (long long s = 0; s < n_slots; ++s) {
        size_t b = a;
        while (b < items.size() && items[b].slot == s) ++b;
        double v = 0.0;
        if ((long long)(b - a) <= GF_SMALL_SLOT_ITEMS) {
            for (size_t k = a; k < b; ++k) v = gf_combine<K>(v, partial[k]);
        } else {
            v = strided_sum<K>(partial, a, b);
        }
        per_leaf[s] = gf_root<K>(v, p);
        a = b;
    }
    return strided_sum<K>(partial, 0, items.size());
}

template <int K>
void norms(const LeafSet& set, const std::vector<Item>& items, std::vector<double>& partial, long long n_slots,
           double p, int threads, double* per_leaf, double* total, long long* first_bad) {
    partial.resize(items.size());
    parallel_items(items, threads, [&](long long first, long long end) {
        item_partials<K>(set, items, first, end, p, partial.data());
    });
    // total[0] the norm, total[1] the unrooted total, as gpuflat_norm_finish.
    const double raw = finish<K>(items, partial.data(), n_slots, p, per_leaf);
    total[0] = gf_root<K>(raw, p);
    total[1] = raw;
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

// ------------------------------------------------------------ arrays read once

// Leaves and their work items for one plan's offsets, one array per slot
// (`csr` the identity).
struct Prepared {
    LeafSet set;
    std::vector<long long> csr;
    std::vector<Item> items;
};

// Arrays read once and kept under the token Python gives arrays it has found
// unchanged since they were read (gpuflat/_src/seen.py: the same objects, at the
// same addresses, of the same dtypes, shapes, strides and flags): a tree met
// again costs no read of its arrays here, only the work. A few per thread,
// the most recently used first.
struct Kept {
    long long token;
    Order order;
    std::vector<long long> offsets;
    std::vector<PyObject*> arrays;  // compared, never dereferenced: the token vouches for them
    Prepared prep;
};
constexpr size_t KEPT_PER_THREAD = 4;

std::vector<std::unique_ptr<Kept>>& kept() {
    thread_local std::vector<std::unique_ptr<Kept>> k;
    return k;
}

// The kept leaves of `token` read in `order` for these offsets, from these
// very array objects (a token is for one list of arrays; checking costs a
// pointer per array).
Prepared* find_kept(long long token, Order order, const long long* offsets, long long n, PyObject** arrays,
                    Py_ssize_t n_arrays) {
    auto& ks = kept();
    for (size_t i = 0; i < ks.size(); ++i) {
        const Kept& k = *ks[i];
        if (k.token == token && k.order == order && (long long)k.offsets.size() == n &&
            std::equal(k.offsets.begin(), k.offsets.end(), offsets) && (Py_ssize_t)k.arrays.size() == n_arrays &&
            std::equal(k.arrays.begin(), k.arrays.end(), arrays)) {
            std::rotate(ks.begin(), ks.begin() + i, ks.begin() + i + 1);
            return &ks[0]->prep;
        }
    }
    return nullptr;
}

// `arrays` (one per slot) read in `order`, their sizes checked against the
// plan's `offsets`, and their items: those kept under `token` (0: none),
// else read now (kept when a token is given). nullptr with `bad` set to the
// first unreadable or missized slot.
const Prepared* prepare(PyObject* arrays, PyObject* offsets, long long token, Order order, long long& bad) {
    const long long* offs = data_of<long long>(offsets);
    const long long n = PyArray_DIMS((PyArrayObject*)offsets)[0];
    bad = -1;
    const bool listed = PyList_Check(arrays);
    if (!listed) token = 0;  // a token comes with a list
    PyObject** items = listed ? PySequence_Fast_ITEMS(arrays) : nullptr;
    const Py_ssize_t n_arrays = listed ? PyList_GET_SIZE(arrays) : 0;
    if (token != 0) {
        if (Prepared* found = find_kept(token, order, offs, n, items, n_arrays)) return found;
    }
    thread_local Prepared scratch;
    std::unique_ptr<Kept> fresh = token != 0 ? std::make_unique<Kept>() : nullptr;
    Prepared& p = fresh ? fresh->prep : scratch;
    p.set.clear();
    bad = read_leaves(arrays, p.set, order);
    if (bad < 0) bad = check_sizes(p.set, offs);
    if (bad >= 0) return nullptr;
    p.csr.resize(n);
    for (long long s = 0; s < n; ++s) p.csr[s] = s;
    plan_items(offs, n - 1, p.items);
    if (!fresh) return &p;
    fresh->token = token;
    fresh->order = order;
    fresh->offsets.assign(offs, offs + n);
    fresh->arrays.assign(items, items + n_arrays);
    auto& ks = kept();
    ks.insert(ks.begin(), std::move(fresh));
    if (ks.size() > KEPT_PER_THREAD) ks.pop_back();
    return &ks[0]->prep;
}

}  // namespace

// ------------------------------------------------------------ entry points
// Each returns -1 on success, else the index of the first array it cannot
// use (not an ndarray of a gpuflat dtype, or of the wrong size); the caller
// names the leaf. Nothing is written before that
// check. Outputs are NumPy arrays of the right dtype and size.

// type_nums: the NumPy type number of each dtype tag, -1 for one not known yet.
GF_EXPORT void gf_host_init(PyObject* ndarray_type, const int* type_nums) {
    g_ndarray = (PyTypeObject*)ndarray_type;
    std::copy(type_nums, type_nums + N_TAGS, g_type_num.begin());
}

namespace {

// The norms of `set`'s leaves over their `items` (partials in the calling
// thread's workspace).
long long run_norms(const LeafSet& set, const std::vector<Item>& items, int kind, double p, int threads,
                    PyObject* per_leaf, PyObject* total, PyObject* first_bad) {
    const long long n_slots = (long long)set.leaves.size();
    std::vector<double>& partial = thread_workspace().partial;  // not workspace(): `set` may be its own
    double* per = data_of<double>(per_leaf);
    double* tot = data_of<double>(total);
    long long* first = data_of<long long>(first_bad);
    Py_BEGIN_ALLOW_THREADS
    switch (kind) {  // every kind of the layout (its NORM_KINDS, the only numbers Python passes)
#define GF_NORM_CASE(K) \
        case K: norms<K>(set, items, partial, n_slots, p, threads, per, tot, first); break;
        GF_NORM_KINDS(GF_NORM_CASE)
#undef GF_NORM_CASE
    }
    Py_END_ALLOW_THREADS
    return -1;
}

// Every leaf of the workspace *= min(1, max_norm / (total + eps)), as
// gpuflat_scale: a NaN total gives a NaN factor, and a factor of exactly 1
// writes nothing.
long long run_clip(const LeafSet& set, const std::vector<Item>& items, double total, double max_norm, double eps,
                   int threads) {
    const double c = max_norm / (total + eps);
    const double coef = c > 1.0 ? 1.0 : c;
    if (coef == 1.0) return -1;
    Py_BEGIN_ALLOW_THREADS
    scale(set, items, coef, threads);
    Py_END_ALLOW_THREADS
    return -1;
}

}  // namespace

// token: see prepare (0: none).
GF_EXPORT long long gf_host_norms(PyObject* leaves, PyObject* offsets, int kind, double p, int threads,
                                  PyObject* per_leaf, PyObject* total, PyObject* first_bad, long long token) {
    long long bad;
    const Prepared* prep = prepare(leaves, offsets, token, Order::memory, bad);
    if (!prep) return bad;
    return run_norms(prep->set, prep->items, kind, p, threads, per_leaf, total, first_bad);
}

// The same norms over a leaf table (`rows`: an int64 array of LeafRef rows,
// one per slot, whose tags and sizes the caller has checked against the plan).
GF_EXPORT long long gf_host_norms_rows(PyObject* rows, PyObject* offsets, int kind, double p, int threads,
                                       PyObject* per_leaf, PyObject* total, PyObject* first_bad) {
    Workspace& w = workspace();
    w.set.add_rows(data_of<LeafRef>(rows), PyArray_DIMS((PyArrayObject*)rows)[0]);
    const long long bad = check_sizes(w.set, data_of<long long>(offsets));
    if (bad >= 0) return bad;
    plan_items(data_of<long long>(offsets), (long long)w.set.leaves.size(), w.items);
    return run_norms(w.set, w.items, kind, p, threads, per_leaf, total, first_bad);
}

// What a tree record (gpuflat/_src/seen.py) compares from call to call about
// its NumPy arrays, read in one loop: per array its identity, data address,
// dtype (number and byte order), flags (writable and contiguous among them),
// ndim, dims and strides, as int64 words into `out`. Returns the number of
// words written, or -1 if an item is not an ndarray or `out` is too small
// (the record then takes the tree as changed). The byte order is recorded,
// not judged: a dtype set to a byte-swapped one in place reads as a change,
// and the walk that follows refuses the leaf.
GF_EXPORT long long gf_host_facts(PyObject* arrays, PyObject* out) {
    PyObject* fast = fast_sequence(arrays, "expected a sequence of arrays");
    if (!fast) {
        PyErr_Clear();
        return -1;
    }
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject** items = PySequence_Fast_ITEMS(fast);
    long long* w = data_of<long long>(out);
    const long long capacity = PyArray_DIMS((PyArrayObject*)out)[0];
    long long k = 0;
    for (Py_ssize_t i = 0; i < n; ++i) {
        if (!PyObject_TypeCheck(items[i], g_ndarray)) {
            k = -1;
            break;
        }
        PyArrayObject* a = (PyArrayObject*)items[i];
        const int nd = PyArray_NDIM(a);
        if (k + 4 + 2 * nd > capacity) {
            k = -1;
            break;
        }
        w[k++] = (long long)(intptr_t)items[i];
        w[k++] = (long long)(intptr_t)PyArray_DATA(a);
        w[k++] = (long long)PyArray_TYPE(a) | ((long long)(unsigned char)PyArray_DESCR(a)->byteorder << 32);
        w[k++] = (long long)PyArray_FLAGS(a) | ((long long)nd << 32);
        for (int j = 0; j < nd; ++j) w[k++] = PyArray_DIMS(a)[j];
        for (int j = 0; j < nd; ++j) w[k++] = PyArray_STRIDES(a)[j];
    }
    Py_DECREF(fast);
    return k;
}

// What a tree record (gpuflat/_src/seen.py) compares from call to call about
// its CuPy arrays, in one loop each: that `arrays` are the very objects
// recorded (`ids`: a list of their identities); then, if `alive` (the
// record's list of one flag, cleared by the weak reference callback of any
// recorded array that dies) holds True, so that those identities are still
// the recorded arrays' own, that each has the shape in `shapes` (a list of
// tuples), read through its `shape` attribute (CuPy's is a Cython property:
// its fields are not ours to read). Returns 1 if all hold, 0 if one does
// not, or -1 with the Python error a read raised. A read may run Python,
// which cannot reach `arrays`: a list the record made for this call.
GF_EXPORT long long gf_host_same_shapes(PyObject* arrays, PyObject* ids, PyObject* alive, PyObject* shapes) {
    static PyObject* const shape = PyUnicode_InternFromString("shape");
    if (!shape) return -1;
    PyObject* fast = fast_sequence(arrays, "expected a sequence of arrays");
    if (!fast) return -1;
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    PyObject** items = PySequence_Fast_ITEMS(fast);
    long long same = n == PyList_GET_SIZE(ids) && n == PyList_GET_SIZE(shapes);
    for (Py_ssize_t i = 0; i < n && same == 1; ++i) {
        void* recorded = PyLong_AsVoidPtr(PyList_GET_ITEM(ids, i));
        if (!recorded && PyErr_Occurred()) same = -1;
        else same = recorded == (void*)items[i];
    }
    if (same == 1) same = PyList_GET_ITEM(alive, 0) == Py_True;
    for (Py_ssize_t i = 0; i < n && same == 1; ++i) {
        PyObject* now = PyObject_GetAttr(items[i], shape);
        same = now ? PyObject_RichCompareBool(now, PyList_GET_ITEM(shapes, i), Py_EQ) : -1;
        Py_XDECREF(now);
    }
    Py_DECREF(fast);
    return same;
}

// sources: one sequence of arrays per slot, added in order; with a token
// (see prepare; 0: none), one array per slot.
GF_EXPORT long long gf_host_gather(PyObject* sources, PyObject* offsets, PyObject* out, int threads,
                                   long long token) {
    const int out_tag = tag_of((PyArrayObject*)out);
    if (token != 0) {
        long long bad;
        const Prepared* prep = prepare(sources, offsets, token, Order::logical, bad);
        if (!prep) return bad;
        Py_BEGIN_ALLOW_THREADS
        gf_dispatch(out_tag, [&](auto z) {
            using T = decltype(z);
            gather<T>(prep->set, prep->csr.data(), prep->items, data_of<T>(out), threads);
        });
        Py_END_ALLOW_THREADS
        return -1;
    }
    Workspace& w = workspace();
    const long long bad = read_sources(sources, w.set, w.csr);
    if (bad >= 0) return bad;
    const long long* offs = data_of<long long>(offsets);
    const long long n_slots = (long long)w.csr.size() - 1;
    for (long long s = 0; s < n_slots; ++s)
        for (long long k = w.csr[s]; k < w.csr[s + 1]; ++k)
            if (w.set.leaves[k].size != offs[s + 1] - offs[s]) return k;
    Py_BEGIN_ALLOW_THREADS
    plan_items(offs, n_slots, w.items);
    gf_dispatch(out_tag, [&](auto z) {
        using T = decltype(z);
        gather<T>(w.set, w.csr.data(), w.items, data_of<T>(out), threads);
    });
    Py_END_ALLOW_THREADS
    return -1;
}

// token: see prepare (0: none).
GF_EXPORT long long gf_host_scatter(PyObject* flat, PyObject* leaves, PyObject* offsets, int threads,
                                    long long token) {
    long long bad;
    const Prepared* prep = prepare(leaves, offsets, token, Order::logical, bad);
    if (!prep) return bad;
    const int tag = tag_of((PyArrayObject*)flat);
    Py_BEGIN_ALLOW_THREADS
    gf_dispatch(tag, [&](auto z) {
        using T = decltype(z);
        scatter<T>(data_of<T>(flat), prep->set, prep->items, threads);
    });
    Py_END_ALLOW_THREADS
    return -1;
}

// Every leaf *= min(1, max_norm / (total + eps)) (run_clip).
// token: see prepare (0: none).
GF_EXPORT long long gf_host_clip(PyObject* leaves, PyObject* offsets, double total, double max_norm, double eps,
                                 int threads, long long token) {
    long long bad;
    const Prepared* prep = prepare(leaves, offsets, token, Order::memory, bad);
    if (!prep) return bad;
    return run_clip(prep->set, prep->items, total, max_norm, eps, threads);
}

// The same clip over a leaf table (as gf_host_norms_rows).
GF_EXPORT long long gf_host_clip_rows(PyObject* rows, PyObject* offsets, double total, double max_norm, double eps,
                                      int threads) {
    Workspace& w = workspace();
    w.set.add_rows(data_of<LeafRef>(rows), PyArray_DIMS((PyArrayObject*)rows)[0]);
    const long long bad = check_sizes(w.set, data_of<long long>(offsets));
    if (bad >= 0) return bad;
    plan_items(data_of<long long>(offsets), (long long)w.set.leaves.size(), w.items);
    return run_clip(w.set, w.items, total, max_norm, eps, threads);
}

// flat *= min(1, max_norm / (total + eps)) over the whole buffer at once, for
// a buffer that is zero outside its leaves (a resident model's): a finite
// factor keeps the zeros zero, so the cost is the buffer's bytes whatever the
// leaf count. Returns 0, writing nothing, when the factor is NaN (0 x NaN
// would turn the zeros into NaN) or `flat` is not an aligned, contiguous 1-D
// buffer; the caller then scales the leaves alone.
GF_EXPORT long long gf_host_clip_flat(PyObject* flat, double total, double max_norm, double eps, int threads) {
    const double c = max_norm / (total + eps);
    const double coef = c > 1.0 ? 1.0 : c;
    if (coef != coef || !PyObject_TypeCheck(flat, g_ndarray) || PyArray_NDIM((PyArrayObject*)flat) != 1) return 0;
    if (coef == 1.0) return -1;
    Workspace& w = workspace();
    const long long offsets[2] = {0, (long long)PyArray_DIMS((PyArrayObject*)flat)[0]};
    if (!w.set.add_slots(flat, offsets, 1)) return 0;
    Py_BEGIN_ALLOW_THREADS
    plan_items(offsets, 1, w.items);
    scale(w.set, w.items, coef, threads);
    Py_END_ALLOW_THREADS
    return -1;
}
