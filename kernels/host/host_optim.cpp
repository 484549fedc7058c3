// The flat optimizers' update on the host (gpuflat/_src/backends/host.py): the
// CUDA kernels' element arithmetic (gpuflat_optim.cuh, compiled for the host
// through host_prelude.h) over the same work items, each item's elements in
// contiguous loops that the compiler vectorises (one per item, or, for
// 16-bit parameters and mixed rows, a few per chunk: staged). Every element is
// computed by the same definition as on the GPU, independently of the
// others, so the bits do not depend on the order or the threads.
//
// A plain C ABI over raw addresses: the caller (ctypes) has checked the
// buffers already.
#include <algorithm>
#include <thread>
#include <vector>

#include "host_prelude.h"
#include "gpuflat_optim.cuh"
// The layout's rule numbers, dtypes and item size, and the rules' kernel
// structs (written from gpuflat._src.layout).
#include "gpuflat_rule_includes.h"
#include "gpuflat_rules.h"
#include "host_items.h"

#define GF_EXPORT extern "C" __attribute__((visibility("default")))
// For the statistics' lambdas and helpers: the update's loop around them is
// vectorised only when they are inlined into it (fused_stats).
#define GF_ALWAYS_INLINE __attribute__((always_inline))

namespace {

// Below this many elements per thread, starting a thread costs more than it saves.
constexpr long long MIN_WORK_PER_THREAD = 1 << 20;

struct Step {
    const long long* offsets;  // n_slots + 1 buffer offsets: the plan's slots
    long long n_slots;
    const long long* slot_group;
    const double* hyper;
    const double* steps;
    double factor;
};

// body(item) for every item, the items shared among threads in contiguous
// runs of about equal work: as many threads as `total` elements give each
// MIN_WORK_PER_THREAD, at most `threads`.
template <class Body>
void share(const std::vector<Item>& items, long long total, int threads, Body body) {
    const long long t = std::max(1LL, std::min<long long>(threads, total / MIN_WORK_PER_THREAD));
    auto run = [&](size_t a, size_t b) {
        for (size_t i = a; i < b; ++i) body(items[i]);
    };
    if (t == 1) return run(0, items.size());
    std::vector<std::thread> pool;
    const size_t n = items.size(), per = (n + t - 1) / t;
    for (size_t k = 1; k < (size_t)t; ++k) pool.emplace_back(run, std::min(n, k * per), std::min(n, (k + 1) * per));
    run(0, std::min(n, per));
    for (auto& th : pool) th.join();
}

// body(item) for every real slot's items, shared among threads (share).
template <class Body>
void for_items(const Step& s, int threads, Body body) {
    std::vector<Item> items;
    for (long long slot = 0; slot < s.n_slots; ++slot) {
        if (s.slot_group[slot] < 0) continue;
        gf_append_items(items, slot, s.offsets[slot + 1] - s.offsets[slot], s.offsets[slot]);
    }
    share(items, s.offsets[s.n_slots], threads, body);
}

template <class S>
void adamw(const Step& s, void* p, void* g, void* m, void* v, void* vmax, int threads) {
    using C = typename gf_compute<S>::type;
    for_items(s, threads, [&](const Item& it) {
        const double* h = s.hyper + s.slot_group[it.slot] * GF_HYPER;
        const auto k = gf_adamw_setup<C>(h, s.steps[it.slot], s.factor, h[0]);
        gf_adamw_range<1>((S*)p, (const S*)g, (S*)m, (S*)v, (S*)vmax, it.flat, it.len, k);
    });
}

template <class S>
void sgd(const Step& s, void* p, void* g, void* buf, int threads) {
    using C = typename gf_compute<S>::type;
    for_items(s, threads, [&](const Item& it) {
        const double* h = s.hyper + s.slot_group[it.slot] * GF_HYPER;
        const auto k = gf_sgd_setup<C>(h, s.steps[it.slot], s.factor, h[0]);
        gf_sgd_range<1>((S*)p, (const S*)g, (S*)buf, it.flat, it.len, k);
    });
}

// body(row, first element, count, item) over every row's items (item: its
// index in row order), shared among threads (share).
template <class Body>
void for_row_items(const ParamRow* rows, long long n_rows, int threads, Body body) {
    std::vector<Item> items;
    long long total = 0;
    for (long long r = 0; r < n_rows; ++r) {
        gf_append_items(items, r, rows[r].numel, 0);
        total += rows[r].numel;
    }
    const Item* const first = items.data();
    share(items, total, threads, [&](const Item& it) { body(rows[it.slot], it.start, it.len, &it - first); });
}

// The statistics' lanes (fused_stats).
constexpr int STATS_LANES = 32;

// A 64-byte vector of C (float or double).
template <class C>
struct Vec64;
template <>
struct Vec64<float> {
    typedef float type __attribute__((vector_size(64)));
};
template <>
struct Vec64<double> {
    typedef double type __attribute__((vector_size(64)));
};

// acc + x * x, rounded once (a fused multiply-add) where the machine has
// one; without, std::fma would be a library call per element, and the
// square is rounded before the sum.
template <class C>
GF_ALWAYS_INLINE inline C add_square(C acc, C x) {
#if defined(__FMA__) || defined(__ARM_FEATURE_FMA)
    return std::fma(x, x, acc);
#else
    return acc + x * x;
#endif
}

// The elements of an item whose statistics' sums in C go to the double
// sums at once (fused_stats).
constexpr int STATS_CHUNK = 32 * STATS_LANES;

// The update statistics' sums (fused_stats): STATS_LANES sums of d^2 and of
// w^2 (element j of an item to lane j % STATS_LANES, in increasing j), in
// double (total adds them in lane order at the end). A float row's squares
// go to float sums over each chunk of STATS_CHUNK elements first, which
// flush adds to the double sums; a double row's sums in C are the double
// sums. All are vectors, which the compiler keeps in registers (as arrays,
// its vectorised loops kept them in memory, each addition a store and a
// load).
template <class C>
struct StatsLanes {
    typedef double V __attribute__((vector_size(64)));
    using P = typename Vec64<C>::type;
    static constexpr bool DIRECT = gf_same<C, double>::value;
    static constexpr int E = 64 / sizeof(C), NP = STATS_LANES / E, N = STATS_LANES / 8;
    P pd[NP] = {}, pw[NP] = {};  // the sums in C (a float row's over a chunk)
    V d[N] = {}, w[N] = {};      // a float row's double sums

    // dd[l]^2 and ww[l]^2 to lane l.
    GF_ALWAYS_INLINE void add(const C* dd, const C* ww) {
        for (int q = 0; q < NP; ++q) {
            P x, y;
            for (int e = 0; e < E; ++e) {
                x[e] = add_square(pd[q][e], dd[E * q + e]);
                y[e] = add_square(pw[q][e], ww[E * q + e]);
            }
            pd[q] = x;
            pw[q] = y;
        }
    }

    // A float row's chunk sums added to the double sums, and zeroed.
    // Converted element by element: GCC 12 split __builtin_convertvector
    // from eight floats into halves, with shuffles, where this loop is one
    // conversion.
    GF_ALWAYS_INLINE void flush() {
        if constexpr (!DIRECT) {
            for (int q = 0; q < N; ++q) {
                V x, y;
                for (int e = 0; e < 8; ++e) {
                    x[e] = (double)pd[(8 * q + e) / E][(8 * q + e) % E];
                    y[e] = (double)pw[(8 * q + e) / E][(8 * q + e) % E];
                }
                d[q] += x;
                w[q] += y;
            }
            for (int q = 0; q < NP; ++q) pd[q] = pw[q] = P{};
        }
    }

    void total(double* out) const {
        double x = 0.0, y = 0.0;
        for (int l = 0; l < STATS_LANES; ++l) {
            if constexpr (DIRECT) {
                x += pd[l / 8][l % 8];
                y += pw[l / 8][l % 8];
            } else {
                x += d[l / 8][l % 8];
                y += w[l / 8][l % 8];
            }
        }
        out[0] = x;
        out[1] = y;
    }
};

// m <= STATS_LANES elements: one(l, held, w) updates element l and gives
// its held and new values; (w - held)^2 and w^2 to lanes 0 .. m - 1. The
// rest of the lanes get zeros' squares, which change no sum (every sum
// starts at +0 and adds squares).
template <class C, class One>
GF_ALWAYS_INLINE inline void stats_block(StatsLanes<C>& s, int m, One one) {
    alignas(64) C dd[STATS_LANES], ww[STATS_LANES];
    for (int l = 0; l < m; ++l) {
        C held, w;
        one(l, held, w);
        dd[l] = w - held;
        ww[l] = w;
    }
    for (int l = m; l < STATS_LANES; ++l) dd[l] = ww[l] = (C)0;
    s.add(dd, ww);
}

// The update statistics of an item of n elements of a row whose parameter
// is stored in its compute type C (float32 and float64 rows kept plain;
// the others are staged): the kernels' gf_lane_stats, sums of d^2 and w^2
// over its elements, d = w - held, as the rule's seen callback gives them,
// written to out[0] and out[1]. one(j, held, w) updates the item's element
// j. Each element's d and w go to one of STATS_LANES sums (StatsLanes),
// whose order of additions is fixed: the bits depend on the item alone,
// never on the threads. The lanes are many independent chains (four
// vectors each): with 8 lanes, the latency of their additions made the
// statistics cost five times as much.
//
// The update and the sums run in one pass, a block of STATS_LANES elements
// at a time (the update's loop vectorised over the block, the held values
// never leaving registers): beyond the caches the update is bound by its
// memory traffic, so the squares and sums beside it cost little. A pass
// over each chunk after the update, from a copy of its held values, cost
// two (4M elements) to five (in cache) times as much.
//
// Precision: a float lane's sum over a chunk is 32 terms, all positive,
// each square added with one rounding (two without a fused multiply-add):
// within 32 (64) roundings of float, 1.9e-6 (3.8e-6) relative at worst;
// the kernels' own float sums are within about 40 (2.4e-6). The double
// sums add little more.
template <class C, class One>
GF_ALWAYS_INLINE inline void fused_stats(double* out, long long n, One one) {
    StatsLanes<C> s;
    for (long long c = 0; c < n; c += STATS_CHUNK) {
        const long long end = std::min<long long>(n, c + STATS_CHUNK);
        long long j = c;
        for (; j + STATS_LANES <= end; j += STATS_LANES)
            stats_block<C>(s, STATS_LANES, [&](int l, C& held, C& w) GF_ALWAYS_INLINE { one(j + l, held, w); });
        if (j < end)
            stats_block<C>(s, (int)(end - j), [&](int l, C& held, C& w) GF_ALWAYS_INLINE { one(j + l, held, w); });
        s.flush();
    }
    s.total(out);
}

// seen (gf_unseen) keeping the held and new values.
template <class C>
struct Keep {
    C& held;
    C& w;
    GF_ALWAYS_INLINE void operator()(long long, C h, C x) const {
        held = h;
        w = x;
    }
};

// gf_adamw_range<1> over elements [first, first + n) with the update
// statistics to out (fused_stats); without out, gf_adamw_range<1> itself.
// Not inlined, so that the compiler keeps its pointers' __restrict (in
// the caller, it versioned the loop for aliasing among them and the
// statistics' arrays, and ran the scalar version). The loop is written
// once for each lerp_from_grad, which the compiler otherwise tests per
// block: the two ways then met in every block, and its statistics went
// through the stack.
template <class S>
__attribute__((noinline)) void adamw_stats(double* out, S* __restrict p, const S* __restrict g, S* __restrict m,
                                           S* __restrict v, S* __restrict vmax, long long first, long long n,
                                           const gf_adamw_coefs<S> k) {
    if (out == nullptr) return gf_adamw_range<1>(p, g, m, v, vmax, first, n, k);
    p += first, g += first, m += first, v += first, vmax += first;
    if (k.amsgrad) {
        const auto one = [&](long long i, S& held, S& w) GF_ALWAYS_INLINE {
            gf_amsgrad_one(p[i], g[i], m[i], v[i], vmax[i], k, i, Keep<S>{held, w});
        };
        if (k.lerp_from_grad) fused_stats<S>(out, n, one);
        else fused_stats<S>(out, n, one);
    } else {
        const auto one = [&](long long i, S& held, S& w) GF_ALWAYS_INLINE {
            gf_adamw_one(p[i], g[i], m[i], v[i], k, i, Keep<S>{held, w});
        };
        if (k.lerp_from_grad) fused_stats<S>(out, n, one);
        else fused_stats<S>(out, n, one);
    }
}

// gf_sgd_range<1> likewise, written once for whether the momentum buffer
// is read (as one loop, a float64 row's was not vectorised).
template <class S>
__attribute__((noinline)) void sgd_stats(double* out, S* __restrict p, const S* __restrict g, S* __restrict buf,
                                         long long first, long long n, const gf_sgd_coefs<S> k) {
    if (out == nullptr) return gf_sgd_range<1>(p, g, buf, first, n, k);
    p += first, g += first, buf += first;
    const auto one = [&](long long i, S& held, S& w) GF_ALWAYS_INLINE {
        gf_sgd_one(p[i], g[i], buf[i], k, i, Keep<S>{held, w});
    };
    if (k.has_momentum && !k.first) fused_stats<S>(out, n, one);
    else fused_stats<S>(out, n, one);
}

// ---------------------------------------------------------------- staged updates
// The update of a row whose parameter is not stored in its compute type (a
// 16-bit one), whose precision word is not 0, or of a generic rule (every
// row of the generic kernel gpuflat_rule_rows), one chunk of STAGE
// elements at a time: each tensor's chunk widened into an array of the
// compute type, R::math over those arrays, and the results narrowed back.
// Each loop does one thing to contiguous arrays of one dtype, which the
// compiler vectorises (the 16-bit conversions are branch-free on the CPU:
// gpuflat_common.cuh); the element by element update did not: GCC does not
// vectorise AdamW's loop-invariant select (lerp_from_grad) in a loop whose
// vectorization factor the 16-bit loads set, and the mixed update switched
// over each state's dtype per element. Every element still gets the
// kernels' own definitions (gf_load, R::math, gf_store, gf_store_stochastic)
// in the order gf_rule_mixed_one applies them, so the bits are the same.
// 512: a chunk's float arrays (parameter, held values, gradient, three
// states: 12 KiB) and its tensors' lines stay in a 32 KiB L1 cache; with
// 1024, bfloat16 AdamW took a fifth longer, with master weights a third.
constexpr int STAGE = 512;
static_assert(STAGE % STATS_LANES == 0, "a chunk starts at lane 0");

// f(T{}) with T the dtype of a precision word's state field, as
// gf_load_field reads it: field 0 (or one that names no optimizer dtype)
// is the parameter's type P.
template <class P, class F>
inline void field_type(int field, F f) {
    switch (field) {
#define GF_FIELD_CASE(tag, T) \
        case tag + 1: return f(T{});
        GF_OPTIM_DTYPES(GF_FIELD_CASE)
#undef GF_FIELD_CASE
        default: return f(P{});
    }
}

// x[j] = src[j] in the compute type, and back, rounded once (gf_load, gf_store).
template <class C, class T>
inline void widen(C* __restrict x, const T* __restrict src, int m) {
    for (int j = 0; j < m; ++j) x[j] = gf_load<C>(src[j]);
}
template <class T, class C>
inline void narrow(T* __restrict dst, const C* __restrict x, int m) {
    for (int j = 0; j < m; ++j) gf_store(dst[j], x[j]);
}

// A row's flag that R::math branches on per element: the loop is
// written once for each value, so that the compiler knows it in each. With
// AdamW's amsgrad inside the loop, GCC if-converted both ways and then
// did not vectorise the loop (its lerp's select on a condition combined
// with amsgrad).
template <class K>
inline bool unswitched(const K&) { return false; }
template <class C>
inline bool unswitched(const gf_adamw_coefs<C>& k) { return k.amsgrad; }

// Elements [first, first + n) of row r (parameters of type P) updated by
// rule R with coefficients k, as gf_rule_mixed_one updates each: its
// states read from their own dtypes (an absent or unused one, gf_rule_uses,
// reads as 0 and is never written), the parameter kept as the word's keep
// says, stochastic rounding drawn at `step`. With `out`, the item's update
// statistics there, summed as fused_stats sums them (a chunk's float sums
// to the double ones after each STAGE elements).
template <class R, class P>
void staged(const ParamRow& r, long long first, long long n,
            const typename R::template coefs<typename gf_compute<P>::type> k, unsigned step, double* out) {
    using C = typename gf_compute<P>::type;
    const int keep = gf_row_keep(r.precision);
    P* const param = (P*)r.param;
    const P* const grad = (const P*)r.grad;
    bool used[R::STATES];
    for (int t = 0; t < R::STATES; ++t) used[t] = gf_row_state(r, t) != 0 && gf_rule_uses(k, t);
    alignas(64) C p[STAGE], g[STAGE], s[R::STATES][STAGE];
    StatsLanes<C> sums;
    for (long long c = first; c < first + n; c += STAGE) {
        const int m = (int)std::min<long long>(STAGE, first + n - c);
        if (keep == GF_KEEP_MASTER) {
            widen(p, (const float*)r.extra + c, m);
        } else if (keep == GF_KEEP_KAHAN) {
            const P* const comp = (const P*)r.extra + c;
            for (int j = 0; j < m; ++j) p[j] = gf_load<C>(param[c + j]) + gf_load<C>(comp[j]);
        } else {
            widen(p, param + c, m);
        }
        widen(g, grad + c, m);
        for (int t = 0; t < R::STATES; ++t) {
            if (!used[t]) {
                std::fill(s[t], s[t] + m, (C)0);
                continue;
            }
            field_type<P>(gf_state_field(r.precision, t), [&](auto z) {
                widen(s[t], (const decltype(z)*)gf_row_state(r, t) + c, m);
            });
        }
        const auto math = [&] {
            for (int j = 0; j < m; ++j) {
                C sc[R::STATES];
                for (int t = 0; t < R::STATES; ++t) sc[t] = s[t][j];
                R::math(p[j], g[j], sc, k);
                for (int t = 0; t < R::STATES; ++t) s[t][j] = sc[t];
            }
        };
        // With statistics, the math and the sums in one loop, a block at a
        // time, as fused_stats runs them: a copy of the held values and a
        // pass over the chunk after the math cost 1.6 times as much (bfloat16
        // AdamW). Inlined: as a call, its loop was not vectorised.
        const auto math_stats = [&]() GF_ALWAYS_INLINE {
            const auto seen = [&](int j, C& h, C& w) GF_ALWAYS_INLINE {
                C sc[R::STATES];
                for (int t = 0; t < R::STATES; ++t) sc[t] = s[t][j];
                h = p[j];
                R::math(p[j], g[j], sc, k);
                w = p[j];
                for (int t = 0; t < R::STATES; ++t) s[t][j] = sc[t];
            };
            int j = 0;
            for (; j + STATS_LANES <= m; j += STATS_LANES)
                stats_block<C>(sums, STATS_LANES, [&](int l, C& h, C& w) GF_ALWAYS_INLINE { seen(j + l, h, w); });
            if (j < m) stats_block<C>(sums, m - j, [&](int l, C& h, C& w) GF_ALWAYS_INLINE { seen(j + l, h, w); });
            sums.flush();
        };
        if (out == nullptr) {
            if (unswitched(k)) math();
            else math();
        } else {
            if (unswitched(k)) math_stats();
            else math_stats();
        }
        for (int t = 0; t < R::STATES; ++t) {
            if (!used[t]) continue;
            field_type<P>(gf_state_field(r.precision, t), [&](auto z) {
                narrow((decltype(z)*)gf_row_state(r, t) + c, s[t], m);
            });
        }
        P* __restrict const dst = param + c;
        if (keep == GF_KEEP_MASTER) {
            float* __restrict const master = (float*)r.extra + c;
            for (int j = 0; j < m; ++j) {
                float w;
                gf_store(w, p[j]);
                master[j] = w;
                gf_store(dst[j], gf_load<C>(w));
            }
        } else if (keep == GF_KEEP_KAHAN) {
            P* __restrict const comp = (P*)r.extra + c;
            for (int j = 0; j < m; ++j) {
                P q;
                gf_store(q, p[j]);
                dst[j] = q;
                gf_store(comp[j], p[j] - gf_load<C>(q));
            }
        } else if (keep == GF_KEEP_STOCHASTIC) {
            const unsigned key = gf_row_key(r.precision);
            for (int j = 0; j < m; ++j)
                gf_store_stochastic(dst[j], p[j], gf_stochastic_bits(key, step, (unsigned long long)(c + j)));
        } else {
            narrow(dst, p, m);
        }
    }
    if (out != nullptr) sums.total(out);
}

// A rule R (gpuflat_optim.cuh) over a flat buffer, staged: the update of
// one plain row over the whole buffer, each item its elements. AdamW and
// SGD take this for 16-bit buffers (their structs), with their own
// kernels' bits.
template <class R, class S>
void rule_flat(const Step& s, void* p, void* g, void* const (&states)[GF_GENERIC_STATES], int threads) {
    using C = typename gf_compute<S>::type;
    const ParamRow whole{(long long)p, (long long)g, (long long)states[0], (long long)states[1],
                         (long long)states[2], 0, 0, 0, 0, 0};
    for_items(s, threads, [&](const Item& it) {
        const double* h = s.hyper + s.slot_group[it.slot] * GF_HYPER;
        staged<R, S>(whole, it.flat, it.len, R::template setup<C>(h, s.steps[it.slot], s.factor, h[0]), 0, nullptr);
    });
}

// Where item `item`'s statistics go in `partial` (2 doubles per item), or
// null for a step without them.
inline double* item_partial(double* partial, long long item) {
    return partial == nullptr ? nullptr : partial + 2 * item;
}

// A rule R (gpuflat_optim.cuh: every rule has a struct) over every row's
// items, each state of its own dtype and the parameter kept as its row's
// precision word says, as the kernels' gpuflat_rule_mixed_rows (staged);
// partial as rows_update's.
template <class R, class S>
void mixed_rows(const ParamRow* rows, long long n_rows, const double* hyper, const long long* lr_at, double factor,
                int threads, double* partial) {
    using C = typename gf_compute<S>::type;
    for_row_items(rows, n_rows, threads, [&](const ParamRow& r, long long first, long long n, long long item) {
        const double* h = hyper + r.group * GF_HYPER;
        const double step = gf_rule_row_step(r);
        const auto k = R::template setup<C>(h, step, factor, gf_group_lr(h, lr_at, r.group));
        staged<R, S>(r, first, n, k, (unsigned)step, item_partial(partial, item));
    });
}

// The update of plain rows (precision words 0) of parameters stored in
// their compute type, as the kernels' gpuflat_adamw_rows
// (gpuflat_adamw_amsgrad_rows), gpuflat_sgd_rows and gpuflat_rule_rows
// (optim.cu); partial as rows_update's. A generic rule's rows are staged
// (mixed_rows): its loop over the rows' own tensors, each state through an
// array of pointers, was not vectorised (Lion on float32 rows took 13
// times as long as AdamW). False for a rule number it does not know.
template <class S>
bool plain_rows(int rule, const ParamRow* rows, long long n_rows, const double* hyper, const long long* lr_at,
                double factor, int threads, double* partial) {
    using C = typename gf_compute<S>::type;
    switch (rule) {
        case GF_RULE_ADAMW:
        case GF_RULE_SGD:
            for_row_items(rows, n_rows, threads, [&](const ParamRow& r, long long first, long long n, long long item) {
                const double* h = hyper + r.group * GF_HYPER;
                const double lr = gf_group_lr(h, lr_at, r.group);
                if (rule == GF_RULE_ADAMW)
                    adamw_stats<S>(item_partial(partial, item), (S*)r.param, (const S*)r.grad, (S*)r.state0,
                                   (S*)r.state1, (S*)r.state2, first, n,
                                   gf_adamw_setup<C>(h, gf_adamw_row_step(r), factor, lr));
                else
                    sgd_stats<S>(item_partial(partial, item), (S*)r.param, (const S*)r.grad, (S*)r.state0, first, n,
                                 gf_sgd_setup<C>(h, gf_sgd_row_step(r, h), factor, lr));
            });
            break;
#define GF_RULE_CASE(number, R) \
        case number: mixed_rows<R, S>(rows, n_rows, hyper, lr_at, factor, threads, partial); break;
        GF_GENERIC_RULES(GF_RULE_CASE)
#undef GF_RULE_CASE
        default: return false;
    }
    return true;
}

// The update of the rows as the backends launch the kernels: plain_rows,
// or, where a row's precision word is not 0, gpuflat_rule_mixed_rows for
// them all (mixed_rows); 16-bit parameters' plain rows take mixed_rows too
// (staged, vectorised), with the plain kernels' bits, as a word naming each
// state's dtype explicitly gives them. With `partial`, each item's update
// statistics there (2 doubles per item in row order), as the kernels'
// *_stats instantiations write them. False for a rule number it does not
// know.
template <class S>
bool rows_update(int rule, const ParamRow* rows, long long n_rows, const double* hyper, const long long* lr_at,
                 double factor, int threads, double* partial) {
    if constexpr (gf_same<S, typename gf_compute<S>::type>::value) {
        bool mixed = false;
        for (long long i = 0; i < n_rows && !mixed; ++i) mixed = rows[i].precision != 0;
        if (!mixed) return plain_rows<S>(rule, rows, n_rows, hyper, lr_at, factor, threads, partial);
    }
    switch (rule) {
#define GF_RULE_CASE(number, R) \
        case number: mixed_rows<R, S>(rows, n_rows, hyper, lr_at, factor, threads, partial); return true;
        GF_RULES(GF_RULE_CASE)
#undef GF_RULE_CASE
        default: return false;
    }
}

// rows_update, then the kernels' gpuflat_count_steps: every update reads
// its count before any is moved. With `stats`, each row's update statistics
// there (the kernels' gpuflat_row_stats: its items' sums, added in item
// order; zeros for a row without elements). False for a rule number it does
// not know.
template <class S>
bool rows_step(int rule, const ParamRow* rows, long long n_rows, const double* hyper, const long long* lr_at,
               double factor, long long counted_field, int threads, double* stats) {
    // The items in for_row_items' order (each row's consecutive), and their sums.
    std::vector<Item> items;
    std::vector<double> partial;
    if (stats != nullptr) {
        for (long long r = 0; r < n_rows; ++r) gf_append_items(items, r, rows[r].numel, 0);
        partial.assign(2 * items.size(), 0.0);
    }
    if (!rows_update<S>(rule, rows, n_rows, hyper, lr_at, factor, threads, stats ? partial.data() : nullptr))
        return false;
    if (stats != nullptr) {
        std::fill(stats, stats + 2 * n_rows, 0.0);
        for (size_t k = 0; k < items.size(); ++k) {
            stats[2 * items[k].slot] += partial[2 * k];
            stats[2 * items[k].slot + 1] += partial[2 * k + 1];
        }
    }
    for (long long i = 0; i < n_rows; ++i)
        if (gf_counts(rows[i], hyper, counted_field)) *(float*)rows[i].step += 1.0f;
    return true;
}

// f(S{}) for the dtype tags the optimizers take (GF_OPTIM_DTYPES).
#define GF_OPTIM_CASE(tag, T) case tag: f(T{}); return true;
template <class F>
bool dispatch(int tag, F f) {
    switch (tag) {
        GF_OPTIM_DTYPES(GF_OPTIM_CASE)
        default: return false;
    }
}
#undef GF_OPTIM_CASE

}  // namespace

// A rule of gpuflat._src.layout.RULES by its number (GF_RULE_*): AdamW's
// states are exp_avg, exp_avg_sq, and max_exp_avg_sq, read only for the
// groups with amsgrad (null where none has it); SGD's momentum_buffer; a
// generic rule's its state_names, in order.
// total is null when the step does not clip; amp is (unscale factor, skip
// flag), as for the kernels. Returns 0, or -1 for a tag that is not a real
// floating dtype or a rule number it does not know.
GF_EXPORT int gf_host_optim_step(int rule, int tag, const long long* offsets, long long n_slots,
                                 const long long* slot_group, const double* hyper, const double* steps,
                                 void* p, void* g, void* s0, void* s1, void* s2, const double* total, double max_norm,
                                 double eps, const double* amp, int threads) {
    const Step s{offsets, n_slots, slot_group, hyper, steps,
                 gf_grad_factor(total, max_norm, eps, total != nullptr, amp)};
    bool known = true;
    const bool ok = dispatch(tag, [&](auto z) {
        using S = decltype(z);
        void* const states[GF_GENERIC_STATES] = {s0, s1, s2};
        if (amp[1] != 0.0) return;
        switch (rule) {
            case GF_RULE_ADAMW:
                if constexpr (gf_same<S, typename gf_compute<S>::type>::value) adamw<S>(s, p, g, s0, s1, s2, threads);
                else rule_flat<gf_adamw, S>(s, p, g, states, threads);
                break;
            case GF_RULE_SGD:
                if constexpr (gf_same<S, typename gf_compute<S>::type>::value) sgd<S>(s, p, g, s0, threads);
                else rule_flat<gf_sgd, S>(s, p, g, states, threads);
                break;
#define GF_RULE_CASE(number, R) \
            case number: rule_flat<R, S>(s, p, g, states, threads); break;
            GF_GENERIC_RULES(GF_RULE_CASE)
#undef GF_RULE_CASE
            default: known = false;
        }
    });
    return ok && known ? 0 : -1;
}

// The update of a table of PyTorch's parameters where they are (ParamRow,
// gpuflat_optim.cuh), as the kernels' row updates and gpuflat_count_steps:
// rule numbers, total, amp and the return value as for
// gf_host_optim_step; lr_at and counted_field as the kernels read them.
// Where any row's precision word is not 0 (a state of another dtype, or the
// parameter kept beside itself), every row goes through the mixed update,
// as the backends launch gpuflat_rule_mixed_rows then. stats: null, or
// n_rows * 2 doubles that take each row's update statistics (its sums of
// d^2 and w^2, rows_step), zeros where amp skips the step.
GF_EXPORT int gf_host_optim_rows(int rule, int tag, const long long* rows, long long n_rows, const double* hyper,
                                 const long long* lr_at, long long counted_field, const double* total,
                                 double max_norm, double eps, const double* amp, int threads, double* stats) {
    const double factor = gf_grad_factor(total, max_norm, eps, total != nullptr, amp);
    bool known = true;
    const bool ok = dispatch(tag, [&](auto z) {
        if (amp[1] == 0.0)
            known = rows_step<decltype(z)>(rule, reinterpret_cast<const ParamRow*>(rows), n_rows, hyper, lr_at,
                                           factor, counted_field, threads, stats);
        else if (stats != nullptr)
            std::fill(stats, stats + 2 * n_rows, 0.0);
    });
    return ok && known ? 0 : -1;
}
