// The flat optimizers' update on the host (gpuflat/_src/backends/host.py): the
// CUDA kernels' element arithmetic (gpuflat_optim.cuh, compiled for the host
// through host_prelude.h) over the same work items, each item's elements in
// one contiguous loop that the compiler vectorises. Every element is
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

// A generic rule R (gpuflat_optim.cuh) over a flat buffer.
template <class R, class S>
void rule_flat(const Step& s, void* p, void* g, void* const (&states)[GF_GENERIC_STATES], int threads) {
    using C = typename gf_compute<S>::type;
    S* const* st = reinterpret_cast<S* const*>(states);
    for_items(s, threads, [&](const Item& it) {
        const double* h = s.hyper + s.slot_group[it.slot] * GF_HYPER;
        gf_rule_range<R, 1>((S*)p, (const S*)g, st, it.flat, it.len,
                            R::template setup<C>(h, s.steps[it.slot], s.factor, h[0]));
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

// Adds term(j, d2, w2)'s two values for j = 0 .. m - 1 to sd[j % LANES] and
// sw[j % LANES], in increasing j: whole runs of LANES as one unrolled inner
// loop (which the compiler vectorises across the lanes), then the tail.
template <int LANES, class Term>
inline void add_lanes(double* sd, double* sw, int m, Term term) {
    int j = 0;
    for (; j + LANES <= m; j += LANES) {
        for (int l = 0; l < LANES; ++l) {
            double d2, w2;
            term(j + l, d2, w2);
            sd[l] += d2;
            sw[l] += w2;
        }
    }
    for (int l = 0; j + l < m; ++l) {
        double d2, w2;
        term(j + l, d2, w2);
        sd[l] += d2;
        sw[l] += w2;
    }
}

// The update statistics of an item (the kernels' gf_lane_stats: sums of
// d^2 and w^2 over its elements, d = w - held, as gf_unseen tells them),
// written to out[0] and out[1]; without `out`, run(first, n, gf_unseen{})
// alone. run(first, n, seen) updates elements [first, first + n) and calls
// seen(i, held, w) for each. The update runs over chunks of CHUNK elements;
// each element's d * d and w * w, rounded once in the compute type C, go to
// one of LANES double sums (element i of the item to lane i % LANES), added
// in a fixed order at the end: the bits depend on the item alone, never on
// the threads. LANES is wide so that the sums are many independent chains
// (four vectors of eight doubles each): with 8 lanes, the latency of their
// additions made the statistics cost five times as much.
//
// Where the parameter p is stored in its compute type (float32 and float64
// rows kept plain: pass p, else null), w is what the update stores, so the
// chunk's held values are kept first and the update runs as it does
// without statistics (gf_unseen: the loop the compiler vectorises; one with
// a callback storing two more arrays was not, and took three times as long),
// then d and w come from the chunk and what was kept, in cache, straight
// into the sums. The held values are kept negated, d = w + (-held) being
// the same bits as w - held: a plain copy the compiler turns into a call of
// memmove, whose string copy of each 4 KiB chunk took more than half the
// update's own time on an AMD EPYC.
template <class C, class S, class Run>
void item_stats(double* out, S* p, long long first, long long n, Run run) {
    if (out == nullptr) return run(first, n, gf_unseen{});
    constexpr int CHUNK = 1024, LANES = 32;
    static_assert(CHUNK % LANES == 0, "a chunk starts at lane 0");
    alignas(64) C a[CHUNK], b[CHUNK];  // the held values negated, or each element's d^2 and w^2
    double sd[LANES] = {}, sw[LANES] = {};
    for (long long c = first; c < first + n; c += CHUNK) {
        const int m = (int)std::min<long long>(CHUNK, first + n - c);
        if constexpr (gf_same<S, C>::value) {
            if (p != nullptr) {
                for (int j = 0; j < m; ++j) a[j] = -p[c + j];
                run(c, m, gf_unseen{});
                add_lanes<LANES>(sd, sw, m, [&](int j, double& d2, double& w2) {
                    const C w = p[c + j], d = w + a[j];
                    d2 = (double)(d * d);
                    w2 = (double)(w * w);
                });
                continue;
            }
        }
        run(c, m, [&](long long i, C held, C w) {
            const C d = w - held;
            a[i - c] = d * d;
            b[i - c] = w * w;
        });
        add_lanes<LANES>(sd, sw, m, [&](int j, double& d2, double& w2) {
            d2 = (double)a[j];
            w2 = (double)b[j];
        });
    }
    double x = 0.0, y = 0.0;
    for (int l = 0; l < LANES; ++l) {
        x += sd[l];
        y += sw[l];
    }
    out[0] = x;
    out[1] = y;
}

// Where item `item`'s statistics go in `partial` (2 doubles per item), or
// null for a step without them.
inline double* item_partial(double* partial, long long item) {
    return partial == nullptr ? nullptr : partial + 2 * item;
}

// A generic rule R (gpuflat_optim.cuh) over every row's items, as the
// kernels' gpuflat_rule_rows; partial as rows_update's.
template <class R, class S>
void rule_rows(const ParamRow* rows, long long n_rows, const double* hyper, const long long* lr_at, double factor,
               int threads, double* partial) {
    using C = typename gf_compute<S>::type;
    for_row_items(rows, n_rows, threads, [&](const ParamRow& r, long long first, long long n, long long item) {
        const double* h = hyper + r.group * GF_HYPER;
        S* st[R::STATES];
        for (int t = 0; t < R::STATES; ++t) st[t] = (S*)gf_row_state(r, t);
        const auto k = R::template setup<C>(h, gf_rule_row_step(r), factor, gf_group_lr(h, lr_at, r.group));
        item_stats<C>(item_partial(partial, item), (S*)r.param, first, n, [&](long long f, long long m, auto seen) {
            gf_rule_range<R, 1>((S*)r.param, (const S*)r.grad, st, f, m, k, seen);
        });
    });
}

// A rule R (gpuflat_optim.cuh: every rule has a struct) over every row's
// items, each state of its own dtype and the parameter kept as its row's
// precision word says, as the kernels' gpuflat_rule_mixed_rows; partial as
// rows_update's.
template <class R, class S>
void mixed_rows(const ParamRow* rows, long long n_rows, const double* hyper, const long long* lr_at, double factor,
                int threads, double* partial) {
    using C = typename gf_compute<S>::type;
    for_row_items(rows, n_rows, threads, [&](const ParamRow& r, long long first, long long n, long long item) {
        const double* h = hyper + r.group * GF_HYPER;
        const double step = gf_rule_row_step(r);
        const auto k = R::template setup<C>(h, step, factor, gf_group_lr(h, lr_at, r.group));
        item_stats<C>(item_partial(partial, item), (S*)nullptr, first, n, [&](long long f, long long m, auto seen) {
            for (long long i = f; i < f + m; ++i) gf_rule_mixed_one<R, S>(r, i, k, (unsigned)step, seen);
        });
    });
}

// The update of the rows of the kernels' gpuflat_adamw_rows
// (gpuflat_adamw_amsgrad_rows), gpuflat_sgd_rows and gpuflat_rule_rows
// (optim.cu), or, where a row's precision word is not 0,
// gpuflat_rule_mixed_rows for them all, as the backends launch them; with
// `partial`, each item's update statistics there (item_stats, 2 doubles per
// item in row order), as their *_stats instantiations write them. False
// for a rule number it does not know.
template <class S>
bool rows_update(int rule, const ParamRow* rows, long long n_rows, const double* hyper, const long long* lr_at,
                 double factor, int threads, double* partial) {
    using C = typename gf_compute<S>::type;
    bool mixed = false;
    for (long long i = 0; i < n_rows && !mixed; ++i) mixed = rows[i].precision != 0;
    if (mixed) {
        switch (rule) {
#define GF_RULE_CASE(number, R) \
            case number: mixed_rows<R, S>(rows, n_rows, hyper, lr_at, factor, threads, partial); return true;
            GF_RULES(GF_RULE_CASE)
#undef GF_RULE_CASE
            default: return false;
        }
    }
    switch (rule) {
        case GF_RULE_ADAMW:
        case GF_RULE_SGD:
            for_row_items(rows, n_rows, threads, [&](const ParamRow& r, long long first, long long n, long long item) {
                const double* h = hyper + r.group * GF_HYPER;
                const double lr = gf_group_lr(h, lr_at, r.group);
                if (rule == GF_RULE_ADAMW) {
                    const auto k = gf_adamw_setup<C>(h, gf_adamw_row_step(r), factor, lr);
                    item_stats<C>(item_partial(partial, item), (S*)r.param, first, n,
                                  [&](long long f, long long m, auto seen) {
                        gf_adamw_range<1>((S*)r.param, (const S*)r.grad, (S*)r.state0, (S*)r.state1, (S*)r.state2,
                                          f, m, k, seen);
                    });
                } else {
                    const auto k = gf_sgd_setup<C>(h, gf_sgd_row_step(r, h), factor, lr);
                    item_stats<C>(item_partial(partial, item), (S*)r.param, first, n,
                                  [&](long long f, long long m, auto seen) {
                        gf_sgd_range<1>((S*)r.param, (const S*)r.grad, (S*)r.state0, f, m, k, seen);
                    });
                }
            });
            break;
#define GF_RULE_CASE(number, R) \
        case number: rule_rows<R, S>(rows, n_rows, hyper, lr_at, factor, threads, partial); break;
        GF_GENERIC_RULES(GF_RULE_CASE)
#undef GF_RULE_CASE
        default: return false;
    }
    return true;
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
            case GF_RULE_ADAMW: adamw<S>(s, p, g, s0, s1, s2, threads); break;
            case GF_RULE_SGD: sgd<S>(s, p, g, s0, threads); break;
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
