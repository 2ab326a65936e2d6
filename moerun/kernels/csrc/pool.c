/* The kernel thread pool: see pool.h. This file holds the module's only mutable global state. */
#define _GNU_SOURCE
#include "pool.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define MAX_THREADS 1024
/* Idle spin before sleeping. Measured on the 2-core Zen 4 VM: waking a sleeping worker costs ~50 us,
 * so back-to-back small calls take 59 us each with no spin and 4.7 us with 50 us of spin; a3b MoE
 * decode calls gain ~8 %; with a third busy thread on the machine 50 us costs ~8 %, 200 us ~25 %. */
#define DEFAULT_SPIN_US 50

static struct {
    pthread_mutex_t run_lock; /* one job at a time; also guards configuration changes */
    pthread_mutex_t lock;     /* guards sleepers, quit and the condition variables */
    pthread_cond_t wake;      /* workers: a new job (gen changed) or quit */
    pthread_cond_t done;      /* caller: pending reached 0 */
    int nthreads;             /* configured, caller included; 0 = not yet configured */
    atomic_int spin_us;       /* idle spin before sleeping, for workers and the caller */
    int started;              /* workers running (nthreads - 1 of them) */
    pthread_t *workers;
    unsigned start_gen;       /* gen when the workers were created */
    int sleepers;
    int quit;
    qk_task fn;
    void *ctx;
    atomic_uint gen;          /* bumped once per job */
    atomic_int pending;       /* workers still inside the current job */
    atomic_int active;        /* threads a job runs on, caller included (0: all nthreads) */
    int job_n;                /* threads of the current job: workers with tid >= job_n sit it out */
    atomic_int prefetch;      /* qk_prefetch's bytes, or -1 until decided */
    atomic_int prefetch_hint; /* qk_prefetch_hint's QK_PF_*, or -1 until decided */
    atomic_int wide;          /* qk_wide's QK_WIDE_* mask, or -1 until decided */
    atomic_int spread;        /* qk_prefetch_spread's 0 / 1, or -1 until decided */
    atomic_int idle;          /* qk_idle_prefetch's bytes, or -1 until decided */
    atomic_int near;          /* qk_prefetch_near's bytes, or -1 until decided */
    qk_span then[QK_THEN_MAX]; /* the current job's qk_pool_run_then spans, nthen of them */
    int nthen;
    qk_span expect[QK_THEN_MAX]; /* the spans the job before gave the current one (qk_pool_first_read) */
    int nexpect;
    atomic_llong span_matched, span_missed;
    atomic_int trace;         /* qk_pool_trace's switch; the rest of the trace under run_lock */
    int trace_n;
    int64_t trace_last;       /* when the last traced job returned, 0 before the first */
    qk_trace_row trace_rows[QK_TRACE_ROWS];
} P = {.prefetch = -1, .prefetch_hint = -1, .wide = -1, .spread = -1, .idle = -1, .near = -1, .run_lock = PTHREAD_MUTEX_INITIALIZER,
       .lock = PTHREAD_MUTEX_INITIALIZER,
       .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER, .spin_us = DEFAULT_SPIN_US};

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Spin until the job generation differs from `old` or spin_us passes; returns the last value seen. */
static unsigned spin_gen(unsigned old, int spin_us) {
    unsigned g = atomic_load_explicit(&P.gen, memory_order_acquire);
    if (g != old || spin_us <= 0) return g;
    const int64_t end = now_ns() + (int64_t)spin_us * 1000;
    for (unsigned i = 1;; i++) {
        CPU_RELAX();
        g = atomic_load_explicit(&P.gen, memory_order_acquire);
        if (g != old) return g;
        if ((i & 63) == 0 && now_ns() > end) return g;
    }
}

/* The first qk_idle_prefetch() bytes of span s into L2, 4 KB between looks at what ends the wait: for a worker a job
 * after generation `seen`, for the caller (worker = 0) the workers all done. */
#define IDLE_CHUNK 4096
static void idle_fetch(qk_span s, int worker, unsigned seen) {
    int64_t n = s.p ? s.bytes : 0;
    const int64_t cap = qk_idle_prefetch();
    if (n > cap) n = cap;
    for (int64_t o = 0; o < n; o += IDLE_CHUNK) {
        if (worker ? atomic_load_explicit(&P.gen, memory_order_acquire) != seen
                   : atomic_load_explicit(&P.pending, memory_order_acquire) == 0)
            return;
        const int64_t e = o + IDLE_CHUNK < n ? o + IDLE_CHUNK : n;
        for (int64_t i = o; i < e; i += 64) __builtin_prefetch(s.p + i, 0, 2); /* T1 */
    }
}

static void *worker_main(void *arg) {
    const int tid = (int)(intptr_t)arg;
    unsigned seen = P.start_gen; /* not P.gen: the first job may already have bumped it */
    for (;;) {
        unsigned g = spin_gen(seen, atomic_load_explicit(&P.spin_us, memory_order_relaxed));
        if (g == seen) {
            pthread_mutex_lock(&P.lock);
            while ((g = atomic_load_explicit(&P.gen, memory_order_acquire)) == seen && !P.quit) {
                P.sleepers++;
                pthread_cond_wait(&P.wake, &P.lock);
                P.sleepers--;
            }
            pthread_mutex_unlock(&P.lock);
        }
        if (P.quit) return NULL;
        seen = g;
        if (tid >= P.job_n) continue;
        P.fn(P.ctx, tid, P.job_n);
        const qk_span next = tid < P.nthen ? P.then[tid] : (qk_span){0}; /* read before the caller may move on */
        if (atomic_fetch_sub_explicit(&P.pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&P.lock);
            pthread_cond_signal(&P.done);
            pthread_mutex_unlock(&P.lock);
        }
        idle_fetch(next, 1, seen);
    }
}

/* After fork() only the forking thread exists: forget the workers (their memory is the parent's
 * to free) and start afresh on the next run. */
static void atfork_child(void) {
    pthread_mutex_init(&P.run_lock, NULL);
    pthread_mutex_init(&P.lock, NULL);
    pthread_cond_init(&P.wake, NULL);
    pthread_cond_init(&P.done, NULL);
    P.started = 0;
    P.workers = NULL;
    P.sleepers = 0;
    P.quit = 0;
    atomic_store(&P.pending, 0);
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, atfork_child); }

static int default_threads(void) {
#ifdef CPU_COUNT
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
#endif
    return 1;
}

/* Called with run_lock held. */
static void stop_workers(void) {
    if (!P.started) return;
    pthread_mutex_lock(&P.lock);
    P.quit = 1;
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.lock);
    for (int i = 0; i < P.nthreads - 1; i++) pthread_join(P.workers[i], NULL);
    free(P.workers);
    P.workers = NULL;
    P.started = 0;
    P.quit = 0;
}

/* Called with run_lock held. Returns 0, or -1 (and falls back to one thread) on failure. */
static int start_workers(void) {
    pthread_once(&atfork_once, register_atfork);
    if (P.nthreads == 0) P.nthreads = default_threads();
    if (P.started || P.nthreads == 1) return 0;
    P.workers = calloc((size_t)P.nthreads - 1, sizeof(pthread_t));
    P.start_gen = atomic_load(&P.gen);
    int made = 0;
    if (P.workers) {
        for (; made < P.nthreads - 1; made++)
            if (pthread_create(&P.workers[made], NULL, worker_main, (void *)(intptr_t)(made + 1))) break;
    }
    if (made == P.nthreads - 1) {
        P.started = 1;
        return 0;
    }
    /* Could not start them all: stop those that did start and run single-threaded. */
    P.nthreads = made + 1;
    P.started = 1;
    stop_workers();
    P.nthreads = 1;
    return -1;
}

int qk_pool_set_threads(int n, int spin_us) {
    if (n < 1 || n > MAX_THREADS || spin_us < 0 || spin_us > 1000000) return -1;
    pthread_mutex_lock(&P.run_lock);
    if (n != P.nthreads) {
        stop_workers();
        P.nthreads = n;
    }
    atomic_store(&P.spin_us, spin_us);
    pthread_mutex_unlock(&P.run_lock);
    return 0;
}

int qk_pool_threads(void) {
    pthread_mutex_lock(&P.run_lock);
    if (P.nthreads == 0) P.nthreads = default_threads();
    const int n = P.nthreads;
    pthread_mutex_unlock(&P.run_lock);
    return n;
}

int qk_pool_spin_us(void) { return atomic_load(&P.spin_us); }

int qk_pool_set_active(int n) {
    if (n < 0 || n > MAX_THREADS) return -1;
    atomic_store(&P.active, n);
    return 0;
}

int qk_pool_active(void) { return atomic_load(&P.active); }

void qk_pool_first_read(int t, const void *p) {
    if (!atomic_load_explicit(&P.trace, memory_order_relaxed) || t >= P.nexpect || !P.expect[t].p) return;
    atomic_fetch_add(P.expect[t].p == p ? &P.span_matched : &P.span_missed, 1);
}

void qk_pool_span_checks(long long *matched, long long *missed) {
    *matched = atomic_load(&P.span_matched);
    *missed = atomic_load(&P.span_missed);
}

void qk_pool_trace(int on) {
    pthread_mutex_lock(&P.run_lock);
    atomic_store(&P.span_matched, 0);
    atomic_store(&P.span_missed, 0);
    memset(P.trace_rows, 0, sizeof P.trace_rows);
    P.trace_n = 0;
    P.trace_last = 0;
    atomic_store(&P.trace, on != 0);
    pthread_mutex_unlock(&P.run_lock);
}

int qk_pool_trace_rows(qk_trace_row *out, int max) {
    pthread_mutex_lock(&P.run_lock);
    const int n = P.trace_n < max ? P.trace_n : max;
    memcpy(out, P.trace_rows, (size_t)(n > 0 ? n : 0) * sizeof *out);
    pthread_mutex_unlock(&P.run_lock);
    return n;
}

/* Called with run_lock held: a job of `name` entered at t_in, the caller's share done at t_own, returned at t_out. */
static void trace_add(const char *name, int64_t t_in, int64_t t_own, int64_t t_out) {
    int i = 0;
    while (i < P.trace_n && P.trace_rows[i].name != name && strcmp(P.trace_rows[i].name, name)) i++;
    if (i == QK_TRACE_ROWS) i--; /* more kinds than rows: the last row takes the rest */
    if (i == P.trace_n) P.trace_rows[P.trace_n++].name = name;
    qk_trace_row *r = &P.trace_rows[i];
    r->jobs++;
    r->own_ns += t_own - t_in;
    r->wait_ns += t_out - t_own;
    if (P.trace_last) {
        const int64_t gap = t_in - P.trace_last;
        if (gap > QK_TRACE_LONG_NS) r->long_gap_ns += gap;
        else r->gap_ns += gap;
    }
    P.trace_last = t_out;
}

int qk_pool_run_as(qk_task fn, void *ctx, const char *name) { return qk_pool_run_then(fn, ctx, name, NULL, 0); }

int qk_pool_run_then(qk_task fn, void *ctx, const char *name, const qk_span *then, int nthen) {
    const int traced = atomic_load_explicit(&P.trace, memory_order_relaxed);
    const int64_t t_in = traced ? now_ns() : 0;
    pthread_mutex_lock(&P.run_lock);
    const int rc = start_workers();
    const int active = atomic_load(&P.active);
    const int n = active > 0 && active < P.nthreads ? active : P.nthreads;
    memcpy(P.expect, P.then, (size_t)P.nthen * sizeof *P.then); /* what the job before said of this one */
    P.nexpect = P.nthen;
    P.nthen = then && nthen > 0 ? (nthen < QK_THEN_MAX ? nthen : QK_THEN_MAX) : 0;
    if (P.nthen) memcpy(P.then, then, (size_t)P.nthen * sizeof *then);
    if (n == 1) {
        fn(ctx, 0, 1);
        if (traced && atomic_load_explicit(&P.trace, memory_order_relaxed)) {
            const int64_t t = now_ns();
            trace_add(name, t_in, t, t);
        }
        pthread_mutex_unlock(&P.run_lock);
        return rc;
    }
    P.fn = fn;
    P.ctx = ctx;
    P.job_n = n;
    atomic_store_explicit(&P.pending, n - 1, memory_order_relaxed);
    pthread_mutex_lock(&P.lock);
    atomic_fetch_add_explicit(&P.gen, 1, memory_order_release);
    if (P.sleepers) pthread_cond_broadcast(&P.wake);
    pthread_mutex_unlock(&P.lock);

    fn(ctx, 0, n);
    const int64_t t_own = traced ? now_ns() : 0;
    if (P.nthen) idle_fetch(P.then[0], 0, 0);

    const int64_t end = now_ns() + (int64_t)atomic_load(&P.spin_us) * 1000;
    for (unsigned i = 1; atomic_load_explicit(&P.pending, memory_order_acquire) != 0; i++) {
        CPU_RELAX();
        if ((i & 63) == 0 && now_ns() > end) {
            pthread_mutex_lock(&P.lock);
            while (atomic_load_explicit(&P.pending, memory_order_acquire) != 0)
                pthread_cond_wait(&P.done, &P.lock);
            pthread_mutex_unlock(&P.lock);
            break;
        }
    }
    if (traced && atomic_load_explicit(&P.trace, memory_order_relaxed)) trace_add(name, t_in, t_own, now_ns());
    pthread_mutex_unlock(&P.run_lock);
    return rc;
}

/* The CPU's default prefetch distance and hint, by CPUID vendor, family and model (the first row whose vendor
 * matches, whose family the CPU's reaches and whose model is the CPU's or 0 for any; others: the last row);
 * bench/prefetch_sweep.py and bench/settings_ab.py measure the settings on a model. Intel: bench/RESULTS.md "issue 21
 * on an Intel machine" (T1 2 KB, a3b decode +6-36%, on a family 6 model 167 VM). Intel family 6 model 207: T1 8 KB,
 * bench/journal/issue-36.md "Intel's prefetch distance at full depth" (the five full-depth files' decode in one
 * process, every setting each round: 0.86-0.94x the step of T1 2 KB), and 512-bit one-token passes over Q6_K_R8 and
 * MXFP4_R8 rows only, "512-bit passes by type on Intel" (pool.h's qk_set_wide), and a second prefetch into L1 4 KB
 * ahead, "A second prefetch into L1" (pool.h's qk_set_prefetch_near). AMD Zen 5
 * (family 26): NTA 4 KB, bench/journal/issue-36.md "prefetch on Zen 5" (NTA 2 KB against none, full-depth qwen3moe
 * and qwen35moe decode in one process, every setting each round: 1.089x and 1.086x, above 1 in 14 of 14 and 12 of 12
 * rounds) and "the read probe beside each step" (4 KB against 2 KB: one 1 GB matrix 80-83 against 75-79 GB/s with the
 * memory in its fast state, level in its slow one; the five full-depth files' decode, with matmul.c's run heads,
 * +1.7-4.2 %). Zen 4 (family 25) and older: none, RESULTS.md "issue 36": no hint gained at any distance (64-8192 B;
 * 0.96-0.99x at 64-256 B, T1 2 KB 0.57-0.60x on an a3b-L12 decode), and at full depth neither the second prefetch into
 * L1, the idle prefetch nor Zen 5's NTA 4 KB ("Zen 4's defaults at full depth again": step times 0.94-1.07x the
 * default's on four files, 1.00-1.16x on one big matrix a type). */
static const struct {
    const char *vendor; /* CPUID leaf 0's 12 characters */
    int family;         /* the lowest family the row is for */
    int model;          /* the displayed model the row is for, 0: any */
    int bytes, hint;
    int wide;           /* qk_wide's mask: bench/journal/issue-36.md "One-token passes on 512-bit vectors" (Zen 5) */
    int spread;         /* qk_prefetch_spread's: bench/journal/issue-36.md "A block's prefetches beside its loads" */
    int idle;           /* qk_idle_prefetch's bytes: "A thread's next share prefetched while it waits" */
    int near;           /* qk_prefetch_near's bytes: "A second prefetch into L1" */
} PF_DEFAULTS[] = {
    {"GenuineIntel", 6, 207, 8192, QK_PF_T1, QK_WIDE_Q6K | QK_WIDE_MXFP4, 1, 1 << 20, 4096},
    {"GenuineIntel", 0, 0, 2048, QK_PF_T1, 0, 0, 0, 0},
    {"AuthenticAMD", 26, 0, 4096, QK_PF_NTA, QK_WIDE_ALL, 0, 0, 0},
    {"AuthenticAMD", 0, 0, 0, QK_PF_T1, 0, 0, 0, 0},
    {"", 0, 0, 0, QK_PF_T1, 0, 0, 0, 0},
};

static int default_row(const char *vendor, int family, int model) {
    int i = 0;
    while (PF_DEFAULTS[i].vendor[0] && (strcmp(PF_DEFAULTS[i].vendor, vendor) || family < PF_DEFAULTS[i].family ||
                                        (PF_DEFAULTS[i].model && model != PF_DEFAULTS[i].model)))
        i++;
    return i;
}

int qk_prefetch_default(const char *vendor, int family, int model, int *hint) {
    const int i = default_row(vendor, family, model);
    if (hint) *hint = PF_DEFAULTS[i].hint;
    return PF_DEFAULTS[i].bytes;
}

int qk_wide_default(const char *vendor, int family, int model) {
    return PF_DEFAULTS[default_row(vendor, family, model)].wide;
}

int qk_prefetch_spread_default(const char *vendor, int family, int model) {
    return PF_DEFAULTS[default_row(vendor, family, model)].spread;
}

int qk_idle_prefetch_default(const char *vendor, int family, int model) {
    return PF_DEFAULTS[default_row(vendor, family, model)].idle;
}

int qk_prefetch_near_default(const char *vendor, int family, int model) {
    return PF_DEFAULTS[default_row(vendor, family, model)].near;
}

/* This CPU's CPUID vendor string, displayed family (base, plus the extended one where base is 15) and displayed
 * model (base, plus the extended one shifted where the family is 6 or 15), as /proc/cpuinfo shows them. */
static void cpu_id(char vendor[13], int *family, int *model) {
    *family = *model = 0;
    memset(vendor, 0, 13);
#if defined(__x86_64__) || defined(__i386__)
    unsigned a, b, c, d;
    if (__get_cpuid(0, &a, &b, &c, &d)) {
        memcpy(vendor, &b, 4);
        memcpy(vendor + 4, &d, 4);
        memcpy(vendor + 8, &c, 4);
    }
    if (__get_cpuid(1, &a, &b, &c, &d)) {
        const int base = (int)(a >> 8 & 15);
        *family = base == 15 ? base + (int)(a >> 20 & 255) : base;
        *model = (int)(a >> 4 & 15) + (base == 6 || base == 15 ? (int)(a >> 16 & 15) << 4 : 0);
    }
#endif
}

/* A setting of 0..max: on, or -1 for this CPU's row of the table (dflt). */
static int set_flag(atomic_int *flag, int on, int max, int (*dflt)(const char *, int, int)) {
    if (on < -1 || on > max) return -1;
    if (on < 0) {
        char vendor[13];
        int family, model;
        cpu_id(vendor, &family, &model);
        on = dflt(vendor, family, model);
    }
    atomic_store(flag, on);
    return 0;
}

static int get_flag(atomic_int *flag, int (*dflt)(const char *, int, int)) {
    const int v = atomic_load_explicit(flag, memory_order_relaxed);
    if (v >= 0) return v;
    set_flag(flag, -1, 0, dflt);
    return atomic_load_explicit(flag, memory_order_relaxed);
}

int qk_set_wide(int mask) { return set_flag(&P.wide, mask, QK_WIDE_ALL, qk_wide_default); }
int qk_wide(void) { return get_flag(&P.wide, qk_wide_default); }
int qk_set_prefetch_spread(int on) { return set_flag(&P.spread, on, 1, qk_prefetch_spread_default); }
int qk_prefetch_spread(void) { return get_flag(&P.spread, qk_prefetch_spread_default); }
int qk_set_idle_prefetch(int bytes) {
    if (bytes > 0 && bytes % IDLE_CHUNK) return -1;
    return set_flag(&P.idle, bytes, 16 << 20, qk_idle_prefetch_default);
}
int qk_idle_prefetch(void) { return get_flag(&P.idle, qk_idle_prefetch_default); }
int qk_set_prefetch_near(int bytes) {
    if (bytes > 0 && bytes % 64) return -1;
    return set_flag(&P.near, bytes, 65536, qk_prefetch_near_default);
}
int qk_prefetch_near(void) { return get_flag(&P.near, qk_prefetch_near_default); }

static int default_prefetch(int *hint) {
    char vendor[13];
    int family, model;
    cpu_id(vendor, &family, &model);
    return qk_prefetch_default(vendor, family, model, hint);
}

int qk_set_prefetch(int bytes) {
    if (bytes < -1 || bytes > 65536 || (bytes > 0 && bytes % 64)) return -1;
    atomic_store(&P.prefetch, bytes < 0 ? default_prefetch(NULL) : bytes);
    return 0;
}

int qk_prefetch(void) {
    int n = atomic_load_explicit(&P.prefetch, memory_order_relaxed);
    if (n < 0) {
        n = default_prefetch(NULL);
        atomic_store(&P.prefetch, n);
    }
    return n;
}

int qk_set_prefetch_hint(int hint) {
    if (hint < -1 || hint >= QK_PF_HINTS) return -1;
    if (hint < 0) default_prefetch(&hint);
    atomic_store(&P.prefetch_hint, hint);
    return 0;
}

int qk_prefetch_hint(void) {
    int h = atomic_load_explicit(&P.prefetch_hint, memory_order_relaxed);
    if (h < 0) {
        default_prefetch(&h);
        atomic_store(&P.prefetch_hint, h);
    }
    return h;
}
