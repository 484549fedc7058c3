// Host emulation of the CUDA built-ins the kernels use, so that the same
// kernels/*.cu text that NVRTC compiles for the GPU also compiles with
// g++ -std=c++20 (force-included with -include) and runs on the CPU.
// It defines only what the kernels use; a kernel needing more built-ins
// adds them here (the build fails, naming the missing one, until then).
//
// Execution model. Every CUDA thread of a block is a real host thread, taken
// from a pool that persists across launches (creating hundreds of OS threads
// per launch would dominate the test suite). A launch of B threads runs the
// blocks of its grid one after another on pool threads 0..B-1; launches are
// serialised by one mutex, so calls from several Python threads are safe.
// Because only one block is alive at a time, `__shared__` variables are plain
// function-local statics. The loader finds them in the built library's symbol
// table and hands their addresses to gpuflat_emu_set_shared_ranges; they are
// then refilled with 0xff bytes before every block, so a kernel that reads
// shared memory it never wrote sees NaN / -1 rather than a friendly zero or
// the previous block's values. (A linker section would be simpler, but GCC
// ignores section attributes on statics of template functions.)
//
// Synchronisation. `__syncthreads` is a block-wide barrier and the warp
// primitives (`__shfl_down_sync`, `__any_sync`) a per-warp barrier around
// a double-buffered exchange area. The barrier is a small futex barrier rather
// than std::barrier because it must also (a) let a thread that returned from
// the kernel drop out, as exited threads do on the GPU, (b) be cancelled when
// a thread traps, so that a failing kernel reports an error instead of
// hanging, and (c) notice a deadlock (threads waiting at different barriers)
// after a timeout. std::barrier can do none of these.
//
// Not emulated: dynamic shared memory (`extern __shared__`), inline PTX,
// cooperative groups, warp primitives with a mask that leaves out existing
// lanes of the warp (reported as an error), 2-D/3-D launches.
#pragma once
#ifndef GPUFLAT_EMULATOR_CUDA_HOST_H
#define GPUFLAT_EMULATOR_CUDA_HOST_H

#include <atomic>
#include <bit>
#include <cassert>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <type_traits>
#include <utility>

#include <dlfcn.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

// Lets a kernel source tell the emulator from NVRTC where it must.
#define GPUFLAT_EMULATOR 1

// ------------------------------------------------------------ vector types
// Layouts and alignments as in CUDA's vector_types.h, so that tables shared
// with the host have the same offsets in both builds.
#define GPUFLAT_EMU_V1(N, T)                                          \
    struct N {                                                        \
        T x;                                                          \
    };                                                                \
    inline constexpr N make_##N(T x) { return N{x}; }
#define GPUFLAT_EMU_V2(N, T, A)                                       \
    struct alignas(A) N {                                             \
        T x, y;                                                       \
    };                                                                \
    inline constexpr N make_##N(T x, T y) { return N{x, y}; }
#define GPUFLAT_EMU_V3(N, T)                                          \
    struct N {                                                        \
        T x, y, z;                                                    \
    };                                                                \
    inline constexpr N make_##N(T x, T y, T z) { return N{x, y, z}; }
#define GPUFLAT_EMU_V4(N, T, A)                                       \
    struct alignas(A) N {                                             \
        T x, y, z, w;                                                 \
    };                                                                \
    inline constexpr N make_##N(T x, T y, T z, T w) { return N{x, y, z, w}; }
#define GPUFLAT_EMU_VECS(P, T, A2, A4) \
    GPUFLAT_EMU_V1(P##1, T)            \
    GPUFLAT_EMU_V2(P##2, T, A2)        \
    GPUFLAT_EMU_V3(P##3, T)            \
    GPUFLAT_EMU_V4(P##4, T, A4)

GPUFLAT_EMU_VECS(int, int, 8, 16)
GPUFLAT_EMU_VECS(uint, unsigned int, 8, 16)
GPUFLAT_EMU_VECS(longlong, long long, 16, 16)
GPUFLAT_EMU_VECS(ulonglong, unsigned long long, 16, 16)
GPUFLAT_EMU_VECS(float, float, 8, 16)
GPUFLAT_EMU_VECS(double, double, 16, 16)

struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// ------------------------------------------------------------ built-in variables
// One copy per host thread; the runtime sets them before calling the kernel.
inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;
constexpr int warpSize = 32;

// ------------------------------------------------------------ runtime
namespace gpuflat_emu {

constexpr unsigned kMaxBlock = 1024;
constexpr unsigned kWarp = 32;
constexpr unsigned kMaxWarps = kMaxBlock / kWarp;
// Set in a barrier's generation word when the launch is cancelled.
constexpr uint32_t kAbortBit = 0x80000000u;

// Thrown to unwind a thread out of a cancelled launch (caught by the pool).
struct KernelAbort {};

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    asm volatile("yield");
#endif
}

inline long futex_wait(std::atomic<uint32_t>* word, uint32_t expected, const timespec* timeout) {
    return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, timeout,
                   nullptr, 0);
}
inline void futex_wake_all(std::atomic<uint32_t>* word) {
    syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

[[noreturn]] inline void fail(const char* fmt, ...);
inline void note_progress();
inline unsigned spin_iterations();
inline unsigned yield_iterations();

// A reusable counting barrier on a futex. `expected` is the number of threads
// that take part in the next phase; a thread that leaves the kernel drops out
// (arrive_and_drop), so the remaining threads' __syncthreads still complete,
// as on the GPU where exited threads no longer hold a barrier back.
struct Barrier {
    alignas(64) std::atomic<uint32_t> remaining{0};
    std::atomic<uint32_t> expected{0};
    std::atomic<uint32_t> sleepers{0};
    alignas(64) std::atomic<uint32_t> gen{0};

    // Only while no thread is inside the barrier.
    void reset(uint32_t n) {
        expected.store(n, std::memory_order_relaxed);
        remaining.store(n, std::memory_order_relaxed);
        sleepers.store(0, std::memory_order_relaxed);
        gen.store(0, std::memory_order_release);
    }

    // The current phase; a thread reads it before it arrives, so the value is
    // stable until its own arrival (and names the exchange buffer to use).
    uint32_t phase() const {
        const uint32_t g = gen.load(std::memory_order_acquire);
        if (g & kAbortBit) throw KernelAbort{};
        return g;
    }

    void complete(uint32_t g) {
        note_progress();
        remaining.store(expected.load(std::memory_order_relaxed), std::memory_order_relaxed);
        gen.fetch_add(1, std::memory_order_seq_cst);
        if (sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&gen);
    }

    // on_last runs in the last arriving thread before anyone is released.
    template <class OnLast>
    void arrive_and_wait(uint32_t g, OnLast&& on_last) {
        if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            on_last();
            complete(g);
            return;
        }
        wait(g);
    }
    void arrive_and_wait(uint32_t g) {
        arrive_and_wait(g, [] {});
    }

    void arrive_and_drop() {
        const uint32_t g = gen.load(std::memory_order_acquire) & ~kAbortBit;
        expected.fetch_sub(1, std::memory_order_relaxed);
        if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) complete(g);
    }

    void cancel() {
        gen.fetch_or(kAbortBit, std::memory_order_seq_cst);
        futex_wake_all(&gen);
    }

    void wait(uint32_t g) {
        // Spinning only pays when every thread of the block has a core. When
        // the threads outnumber the cores, a couple of yields let the threads
        // still to arrive run, and are cheaper than sleeping and being woken
        // when the phase completes within them.
        for (unsigned i = spin_iterations(); i > 0; --i) {
            if (gen.load(std::memory_order_acquire) != g) return finish_wait(g);
            cpu_relax();
        }
        for (unsigned i = yield_iterations(); i > 0; --i) {
            if (gen.load(std::memory_order_acquire) != g) return finish_wait(g);
            sched_yield();
        }
        sleepers.fetch_add(1, std::memory_order_seq_cst);
        while (gen.load(std::memory_order_seq_cst) == g) futex_wait(&gen, g, nullptr);
        sleepers.fetch_sub(1, std::memory_order_relaxed);
        finish_wait(g);
    }

    // Released either by the phase completing or by a cancellation.
    void finish_wait(uint32_t g) {
        const uint32_t now = gen.load(std::memory_order_acquire);
        if ((now & ~kAbortBit) == g) throw KernelAbort{};
    }
};

// The exchange area of one warp: lane l writes slot [phase & 1][l], then all
// lanes meet at the warp barrier and read. Two buffers, so a lane may write
// the next exchange while slower lanes still read this one.
struct Warp {
    Barrier bar;
    alignas(16) unsigned char buf[2][kWarp][16] = {};
    unsigned present = 0;  // lanes that exist in this launch's block
    unsigned nlanes = 0;
};

using Thunk = void (*)(void* const* args);

struct Runtime {
    pthread_mutex_t launch_mutex = PTHREAD_MUTEX_INITIALIZER;
    // The launch in flight (written by the launcher before it wakes the pool).
    Thunk thunk = nullptr;
    void* const* args = nullptr;
    const char* name = "";
    unsigned grid = 0, block = 0;
    unsigned spin = 0;    // pause loops before sleeping at a barrier
    unsigned yields = 0;  // sched_yield()s before sleeping at a barrier
    std::atomic<unsigned> deadlock_ms{2000};
    // Barrier phases completed in this launch: the deadlock watchdog's clock.
    alignas(64) std::atomic<uint64_t> progress{0};

    Barrier block_bar;  // __syncthreads
    Barrier grid_bar;   // between two blocks of the grid
    Warp warps[kMaxWarps];
    // Worker i sleeps on start[i / 32]; the word holds a launch counter and
    // the launch's block size, so a woken worker knows whether it takes part
    // without reading the (possibly already reused) launch descriptor.
    alignas(64) std::atomic<uint32_t> start[kMaxWarps] = {};
    alignas(64) std::atomic<uint32_t> done_remaining{0};
    std::atomic<uint32_t> done_word{0};
    std::atomic<bool> aborted{false};
    char message[768] = {};
    unsigned nthreads = 0;
    unsigned ncpu = 1;
    unsigned oversubscribed_yields = 16;
};

// Constant-initialised and never destroyed, so pool threads still blocked in
// the futex at interpreter exit find it intact.
inline constinit Runtime g_rt;

struct ThreadCtx {
    Warp* warp = nullptr;
    unsigned lane = 0;
    unsigned tid = 0;
};
inline thread_local ThreadCtx t_ctx;
inline thread_local char t_last_error[1024];

inline unsigned spin_iterations() { return g_rt.spin; }
inline unsigned yield_iterations() { return g_rt.yields; }
inline void note_progress() { g_rt.progress.fetch_add(1, std::memory_order_relaxed); }

// The __shared__ variables, poisoned before each block: see the file comment.
struct SharedRange {
    char* ptr;
    size_t size;
};
inline SharedRange* g_shared = nullptr;
inline unsigned g_n_shared = 0;

// offsets_sizes: n pairs (symbol value, size) from the library's symbol table;
// values are relative to the load address, which dladdr gives.
inline int set_shared_ranges(const unsigned long long* offsets_sizes, unsigned n, const void* anchor) {
    Dl_info info;
    if (n && (dladdr(anchor, &info) == 0 || info.dli_fbase == nullptr)) return 1;
    auto* ranges = new SharedRange[n ? n : 1];
    for (unsigned i = 0; i < n; ++i)
        ranges[i] = {static_cast<char*>(info.dli_fbase) + offsets_sizes[2 * i], static_cast<size_t>(offsets_sizes[2 * i + 1])};
    pthread_mutex_lock(&g_rt.launch_mutex);
    g_shared = ranges;  // the previous table is leaked: set once per library
    g_n_shared = n;
    pthread_mutex_unlock(&g_rt.launch_mutex);
    return 0;
}

inline void cancel_launch() {
    Runtime& r = g_rt;
    r.block_bar.cancel();
    r.grid_bar.cancel();
    for (unsigned w = 0; w < (r.block + kWarp - 1) / kWarp; ++w) r.warps[w].bar.cancel();
}

// Records the first failure of the launch (with the failing thread's
// coordinates) and releases every waiting thread.
inline void vrecord_failure(const char* fmt, va_list ap) {
    Runtime& r = g_rt;
    if (!r.aborted.exchange(true)) {
        int n = snprintf(r.message, sizeof r.message, "kernel '%s', block %u, thread %u: ", r.name,
                         blockIdx.x, threadIdx.x);
        if (n < 0) n = 0;
        if (static_cast<size_t>(n) < sizeof r.message) vsnprintf(r.message + n, sizeof r.message - n, fmt, ap);
    }
    cancel_launch();
}
inline void record_failure(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vrecord_failure(fmt, ap);
    va_end(ap);
}

[[noreturn]] inline void fail(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vrecord_failure(fmt, ap);
    va_end(ap);
    throw KernelAbort{};
}


// Before every block: fresh barriers and poisoned shared memory.
inline void prepare_block() {
    Runtime& r = g_rt;
    r.block_bar.reset(r.block);
    for (unsigned w = 0; w < (r.block + kWarp - 1) / kWarp; ++w) r.warps[w].bar.reset(r.warps[w].nlanes);
    for (unsigned i = 0; i < g_n_shared; ++i) std::memset(g_shared[i].ptr, 0xff, g_shared[i].size);
}

inline void run_blocks(unsigned idx) {
    Runtime& r = g_rt;
    blockDim = dim3(r.block);
    gridDim = dim3(r.grid);
    for (unsigned b = 0; b < r.grid; ++b) {
        if (b > 0) {
            try {
                r.grid_bar.arrive_and_wait(r.grid_bar.phase(), prepare_block);
            } catch (KernelAbort&) {
                break;
            }
        }
        if (r.aborted.load(std::memory_order_relaxed)) break;
        blockIdx = uint3{b, 0, 0};
        try {
            r.thunk(r.args);
        } catch (KernelAbort&) {
            break;
        } catch (std::exception& e) {
            record_failure("C++ exception: %s", e.what());
            break;
        } catch (...) {
            record_failure("unknown C++ exception");
            break;
        }
        // Returned from the kernel: no longer holds back the barriers.
        t_ctx.warp->bar.arrive_and_drop();
        r.block_bar.arrive_and_drop();
    }
}

struct WorkerStart {
    unsigned idx;
    uint32_t seen;
};

inline void* worker_main(void* p) {
    const WorkerStart ws = *static_cast<WorkerStart*>(p);
    delete static_cast<WorkerStart*>(p);
    Runtime& r = g_rt;
    const unsigned idx = ws.idx;
    t_ctx.warp = &r.warps[idx / kWarp];
    t_ctx.lane = idx % kWarp;
    t_ctx.tid = idx;
    threadIdx = uint3{idx, 0, 0};
    std::atomic<uint32_t>& word = r.start[idx / kWarp];
    uint32_t seen = ws.seen;
    for (;;) {
        uint32_t s;
        while ((s = word.load(std::memory_order_acquire)) == seen) futex_wait(&word, seen, nullptr);
        seen = s;
        if (idx >= (s & 0x7ffu)) continue;  // this launch's block is smaller
        run_blocks(idx);
        if (r.done_remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
            r.done_word.fetch_add(1, std::memory_order_release);
            futex_wake_all(&r.done_word);
        }
    }
    return nullptr;
}

// Grows the pool to n threads (a multiple of the warp size). Signals are
// blocked in pool threads so that Ctrl-C still reaches the interpreter.
inline bool ensure_threads(unsigned n) {
    Runtime& r = g_rt;
    if (r.nthreads >= n) return true;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1 << 20);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    bool ok = true;
    while (r.nthreads < n) {
        const unsigned idx = r.nthreads;
        auto* ws = new WorkerStart{idx, r.start[idx / kWarp].load(std::memory_order_relaxed)};
        pthread_t th;
        if (pthread_create(&th, &attr, worker_main, ws) != 0) {
            delete ws;
            ok = false;
            break;
        }
        ++r.nthreads;
    }
    pthread_sigmask(SIG_SETMASK, &old, nullptr);
    pthread_attr_destroy(&attr);
    return ok;
}

// A fork()ed child has none of the parent's pool threads: start afresh.
inline void atfork_prepare() { pthread_mutex_lock(&g_rt.launch_mutex); }
inline void atfork_parent() { pthread_mutex_unlock(&g_rt.launch_mutex); }
inline void atfork_child() {
    pthread_mutex_init(&g_rt.launch_mutex, nullptr);
    g_rt.nthreads = 0;
}
inline const bool g_atfork_registered = [] {
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    g_rt.ncpu = static_cast<unsigned>(sysconf(_SC_NPROCESSORS_ONLN) > 0 ? sysconf(_SC_NPROCESSORS_ONLN) : 1);
    if (const char* y = getenv("GPUFLAT_EMU_YIELDS")) g_rt.oversubscribed_yields = static_cast<unsigned>(atoi(y));
    return true;
}();

// Threads of the launch now asleep at some barrier.
inline unsigned sleeping_threads(unsigned* at_block, unsigned* at_warp) {
    Runtime& r = g_rt;
    *at_block = r.block_bar.sleepers.load(std::memory_order_seq_cst);
    *at_warp = 0;
    for (unsigned w = 0; w < (r.block + kWarp - 1) / kWarp; ++w)
        *at_warp += r.warps[w].bar.sleepers.load(std::memory_order_seq_cst);
    return *at_block + *at_warp + r.grid_bar.sleepers.load(std::memory_order_seq_cst);
}

// Waits for the launch to finish. A deadlock (every thread still running is
// asleep at a barrier that can never complete, e.g. part of a warp at
// a warp shuffle and the rest at __syncthreads) shows as no barrier completing
// for the timeout while all live threads sleep; the launch is then
// cancelled. A long computation keeps a thread awake, so it is never taken
// for a deadlock.
inline void watch(uint32_t done) {
    Runtime& r = g_rt;
    const timespec tick{0, 50 * 1000000L};
    uint64_t last = r.progress.load(std::memory_order_relaxed);
    unsigned stalled_ms = 0;
    while (r.done_word.load(std::memory_order_acquire) == done) {
        if (futex_wait(&r.done_word, done, &tick) == -1 && errno == ETIMEDOUT) {
            const uint64_t now = r.progress.load(std::memory_order_relaxed);
            unsigned at_block, at_warp;
            const unsigned asleep = sleeping_threads(&at_block, &at_warp);
            const unsigned alive = r.done_remaining.load(std::memory_order_seq_cst);
            if (now != last || asleep < alive || r.aborted.load(std::memory_order_relaxed)) {
                last = now;
                stalled_ms = 0;
                continue;
            }
            stalled_ms += 50;
            if (stalled_ms >= r.deadlock_ms.load(std::memory_order_relaxed) &&
                !r.aborted.exchange(true)) {
                snprintf(r.message, sizeof r.message,
                         "kernel '%s': deadlock: for %u ms all %u running threads waited at barriers "
                         "(%u at __syncthreads, %u at warp operations) that cannot complete",
                         r.name, stalled_ms, alive, at_block, at_warp);
                cancel_launch();
            }
        }
    }
}

enum LaunchStatus : int { kOk = 0, kUnknownKernel = 1, kBadConfig = 2, kKernelFailed = 3, kNoThreads = 4 };

inline int set_error(int code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t_last_error, sizeof t_last_error, fmt, ap);
    va_end(ap);
    return code;
}

inline int launch(const char* name, Thunk thunk, unsigned grid, unsigned block, void* const* args) {
    if (block == 0 || block > kMaxBlock || grid == 0 || grid > 0x7fffffffu)
        return set_error(kBadConfig, "kernel '%s': invalid launch configuration grid=%u block=%u "
                         "(block must be 1..1024, grid 1..2^31-1)", name, grid, block);
    Runtime& r = g_rt;
    pthread_mutex_lock(&r.launch_mutex);
    const unsigned nwarps = (block + kWarp - 1) / kWarp;
    if (!ensure_threads(nwarps * kWarp)) {
        pthread_mutex_unlock(&r.launch_mutex);
        return set_error(kNoThreads, "kernel '%s': could not start %u host threads", name, nwarps * kWarp);
    }
    r.thunk = thunk;
    r.args = args;
    r.name = name;
    r.grid = grid;
    r.block = block;
    r.spin = block <= r.ncpu ? 4000 : 0;
    r.yields = block <= r.ncpu ? 0 : r.oversubscribed_yields;
    r.progress.store(0, std::memory_order_relaxed);
    r.aborted.store(false, std::memory_order_relaxed);
    r.message[0] = '\0';
    for (unsigned w = 0; w < nwarps; ++w) {
        Warp& wp = r.warps[w];
        wp.nlanes = block - w * kWarp < kWarp ? block - w * kWarp : kWarp;
        wp.present = wp.nlanes == kWarp ? 0xffffffffu : (1u << wp.nlanes) - 1u;
        // Lanes missing from a partial warp are never written: a shuffle
        // from one of them reads all-ones bytes (undefined on a GPU).
        std::memset(wp.buf, 0xff, sizeof wp.buf);
    }
    prepare_block();
    r.grid_bar.reset(block);
    r.done_remaining.store(block, std::memory_order_relaxed);
    const uint32_t done = r.done_word.load(std::memory_order_relaxed);
    for (unsigned w = 0; w < nwarps; ++w) {
        const uint32_t old = r.start[w].load(std::memory_order_relaxed);
        r.start[w].store((((old >> 11) + 1) << 11) | block, std::memory_order_release);
        futex_wake_all(&r.start[w]);
    }
    watch(done);
    int status = kOk;
    if (r.aborted.load(std::memory_order_relaxed)) status = set_error(kKernelFailed, "%s", r.message);
    pthread_mutex_unlock(&r.launch_mutex);
    return status;
}

// ------------------------------------------------------------ kernel registry
// The generated translation unit lists {name expression, thunk, signature};
// thunk<&kernel<T>> unpacks `void** args` into the kernel's parameter types.
struct KernelEntry {
    const char* name;
    Thunk thunk;
    const char* (*signature)();
};

template <class T>
inline T load_arg(const void* p) {
    struct Raw {
        unsigned char b[sizeof(T)];
    } raw;
    std::memcpy(raw.b, p, sizeof(T));  // args need not be aligned
    return std::bit_cast<T>(raw);
}

template <class... A>
inline void invoke(void (*f)(A...), void* const* args) {
    [&]<std::size_t... I>(std::index_sequence<I...>) { f(load_arg<A>(args[I])...); }(std::index_sequence_for<A...>{});
}

template <auto F>
void thunk(void* const* args) {
    invoke(F, args);
}

// p: pointer, i/u: signed/unsigned integer, f: floating point, b: bool,
// s: any other trivially copyable struct; followed by the size in bytes.
template <class T>
constexpr char kind_of() {
    if constexpr (std::is_pointer_v<T>) return 'p';
    else if constexpr (std::is_same_v<T, bool>) return 'b';
    else if constexpr (std::is_integral_v<T>) return std::is_signed_v<T> ? 'i' : 'u';
    else if constexpr (std::is_floating_point_v<T>) return 'f';
    else return 's';
}

template <class... A>
const char* signature_of(void (*)(A...)) {
    static_assert((std::is_trivially_copyable_v<A> && ...), "kernel parameters must be trivially copyable");
    static char text[sizeof...(A) * 24 + 1];
    static const bool done = [] {
        char* p = text;
        bool first = true;
        ((p += snprintf(p, 24, "%s%c%zu", first ? "" : ",", kind_of<A>(), sizeof(A)), first = false), ...);
        (void)first;
        return true;
    }();
    (void)done;
    return text;
}

template <auto F>
const char* signature() {
    return signature_of(F);
}

inline int launch_by_name(const KernelEntry* table, const char* name, unsigned grid, unsigned block, void** args) {
    if (name == nullptr) return set_error(kUnknownKernel, "no kernel name given");
    for (const KernelEntry* e = table; e->name; ++e)
        if (std::strcmp(e->name, name) == 0) return launch(e->name, e->thunk, grid, block, args);
    return set_error(kUnknownKernel, "kernel '%s' is not in this library", name);
}

inline int table_size(const KernelEntry* table) {
    int n = 0;
    while (table[n].name) ++n;
    return n;
}

// ------------------------------------------------------------ warp helpers
inline Warp& warp_for(unsigned mask, const char* what) {
    Warp& w = *t_ctx.warp;
    if ((mask & w.present) != w.present)
        fail("%s with mask 0x%08x: the emulator needs every lane of the warp (present 0x%08x)", what, mask,
             w.present);
    return w;
}

template <class T>
inline T exchange(unsigned mask, const T& v, unsigned src, const char* what) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 16,
                  "warp shuffles take trivially copyable values of at most 16 bytes");
    Warp& w = warp_for(mask, what);
    const uint32_t g = w.bar.phase();
    std::memcpy(w.buf[g & 1][t_ctx.lane], &v, sizeof(T));
    w.bar.arrive_and_wait(g);
    if (src == t_ctx.lane) return v;
    T out;
    std::memcpy(&out, w.buf[g & 1][src & (kWarp - 1)], sizeof(T));
    return out;
}

// Predicates of all lanes of the warp, one bit each.
inline unsigned vote(unsigned mask, int pred, const char* what) {
    Warp& w = warp_for(mask, what);
    const uint32_t g = w.bar.phase();
    w.buf[g & 1][t_ctx.lane][0] = pred != 0;
    w.bar.arrive_and_wait(g);
    unsigned bits = 0;
    for (unsigned l = 0; l < w.nlanes; ++l) bits |= static_cast<unsigned>(w.buf[g & 1][l][0] & 1u) << l;
    return bits;
}

[[noreturn]] inline void assert_fail(const char* expr, const char* file, int line) {
    fail("assertion '%s' failed at %s:%d", expr, file, line);
}

}  // namespace gpuflat_emu

#define GPUFLAT_EMU_EXPORT extern "C" __attribute__((visibility("default")))

// Defines the library's C entry points over a table ending in {nullptr}.
#define GPUFLAT_EMU_EXPORTS(TABLE)                                                                         \
    GPUFLAT_EMU_EXPORT int gpuflat_emu_launch(const char* name, unsigned grid, unsigned block, void** args) { \
        return ::gpuflat_emu::launch_by_name(TABLE, name, grid, block, args);                              \
    }                                                                                                       \
    GPUFLAT_EMU_EXPORT const char* gpuflat_emu_last_error(void) { return ::gpuflat_emu::t_last_error; }     \
    GPUFLAT_EMU_EXPORT int gpuflat_emu_kernel_count(void) { return ::gpuflat_emu::table_size(TABLE); }      \
    GPUFLAT_EMU_EXPORT const char* gpuflat_emu_kernel_name(int i) { return TABLE[i].name; }                 \
    GPUFLAT_EMU_EXPORT const char* gpuflat_emu_kernel_signature(int i) { return TABLE[i].signature(); }     \
    GPUFLAT_EMU_EXPORT void gpuflat_emu_set_deadlock_timeout_ms(unsigned ms) {                              \
        ::gpuflat_emu::g_rt.deadlock_ms.store(ms ? ms : 1, std::memory_order_relaxed);                       \
    }                                                                                                       \
    GPUFLAT_EMU_EXPORT int gpuflat_emu_set_shared_ranges(const unsigned long long* offsets_sizes, unsigned n) { \
        return ::gpuflat_emu::set_shared_ranges(offsets_sizes, n, reinterpret_cast<const void*>(&gpuflat_emu_launch)); \
    }

// ------------------------------------------------------------ qualifiers
// Defined after the standard headers: libstdc++ itself spells attributes
// such as __noinline__, which these macros would break.
#define __global__
#define __device__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
// Static storage, poisoned before every block (see top).
#define __shared__ static

// ------------------------------------------------------------ synchronisation
inline void __syncthreads() {
    auto& b = ::gpuflat_emu::g_rt.block_bar;
    b.arrive_and_wait(b.phase());
}
[[noreturn]] inline void __trap() { ::gpuflat_emu::fail("__trap()"); }

// Device-wide atomics and fences. Blocks run one after another, but a
// block's threads run at once on host threads, so the add is a real atomic
// read-modify-write (returning the old value, as CUDA's) and the fence a
// sequentially consistent one: exact for any number of callers.
inline unsigned long long atomicAdd(unsigned long long* address, unsigned long long val) {
    return std::atomic_ref<unsigned long long>(*address).fetch_add(val);
}
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

// Device-side assert: fails the launch (as on the GPU) instead of aborting
// the host process.
#undef assert
#ifdef NDEBUG
#define assert(e) ((void)0)
#else
#define assert(e) ((e) ? (void)0 : ::gpuflat_emu::assert_fail(#e, __FILE__, __LINE__))
#endif

// ------------------------------------------------------------ warp shuffles
// Source lane rules of PTX shfl.sync: a source outside the caller's segment of
// `width` lanes gives the caller's own value.
template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = warpSize) {
    const unsigned lane = ::gpuflat_emu::t_ctx.lane;
    const unsigned src = (lane & (width - 1)) + delta >= static_cast<unsigned>(width) ? lane : lane + delta;
    return ::gpuflat_emu::exchange(mask, var, src, "__shfl_down_sync");
}
inline int __any_sync(unsigned mask, int pred) { return ::gpuflat_emu::vote(mask, pred, "__any_sync") != 0; }

// ------------------------------------------------------------ bits
inline long long __double_as_longlong(double x) { return std::bit_cast<long long>(x); }
inline double __longlong_as_double(long long x) { return std::bit_cast<double>(x); }
inline float __uint_as_float(unsigned x) { return std::bit_cast<float>(x); }
inline unsigned __float_as_uint(float x) { return std::bit_cast<unsigned>(x); }
inline unsigned long long __umul64hi(unsigned long long a, unsigned long long b) {
    return (unsigned long long)(((unsigned __int128)a * b) >> 64);
}

// ------------------------------------------------------------ math
// CUDA puts the float and double overloads in the global namespace.
using std::fabs;
using std::hypot;
using std::isfinite;
using std::pow;
using std::sqrt;

// CUDA's global min/max: fmin/fmax rules for floating point (a NaN loses),
// plain comparison for integers, usual arithmetic conversions when mixed.
template <class A, class B>
    requires(std::is_arithmetic_v<A> && std::is_arithmetic_v<B>)
inline std::common_type_t<A, B> min(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) return std::fmin(static_cast<C>(a), static_cast<C>(b));
    else return static_cast<C>(b) < static_cast<C>(a) ? static_cast<C>(b) : static_cast<C>(a);
}
template <class A, class B>
    requires(std::is_arithmetic_v<A> && std::is_arithmetic_v<B>)
inline std::common_type_t<A, B> max(A a, B b) {
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<C>) return std::fmax(static_cast<C>(a), static_cast<C>(b));
    else return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}

#endif  // GPUFLAT_EMULATOR_CUDA_HOST_H
