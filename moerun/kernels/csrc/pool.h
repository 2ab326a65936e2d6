/* The process's one kernel thread pool (DESIGN.md decision 9).
 *
 * qk_pool_run(fn, ctx) runs fn(ctx, tid, n) on n threads at once, the caller being tid 0, and
 * returns when all have finished. Idle workers spin for a bounded time (qk_pool_set_threads'
 * spin_us), then sleep on a condition variable, so they never burn a core for long while other
 * threads (torch's, the caller's) need it. Jobs are serialised: a second caller waits its turn.
 * Workers start on the first run and are re-created after fork(). */
#ifndef MOERUN_POOL_H
#define MOERUN_POOL_H

#include <stdint.h>

typedef void (*qk_task)(void *ctx, int tid, int nthreads);

/* n >= 1 threads in all (caller included); spin_us >= 0 is the idle spin before sleeping.
 * Returns 0, or -1 when n or spin_us is out of range. */
int qk_pool_set_threads(int n, int spin_us);
int qk_pool_threads(void);
/* Jobs run on min(n, threads) threads from now on (0: all of them); the others sleep through them. Work
 * items are handed out as threads come for them, so any count computes the same result. Returns 0, or -1
 * when n is out of range. */
int qk_pool_set_active(int n);
int qk_pool_active(void); /* the last set_active's n */
int qk_pool_spin_us(void);
/* How far ahead (bytes) the interleaved-layout kernels prefetch weights on passes of one token (8-row kernels) or up to
 * 8 (16-row kernels), 0 for not at all, and with which hint (qk_set_prefetch_hint). -1 sets the CPU's default (pool.c's
 * table per vendor and family): 2048 on Intel, where a core's demand stream alone leaves memory idle (an a3b decode
 * token +6-36%), 4096 on AMD Zen 5 (NTA: +9% on full-depth decode at 2 KB, 2-4% more at 4 KB), 0 elsewhere (on Zen 4 the hardware prefetchers keep
 * up and a T0 prefetch cost 8%). While it is > 0 the GGUF-layout
 * kernels' one-token prefetch (2 KB ahead) goes to L2 rather than L1. Results do not depend on it. Returns 0, or -1
 * when bytes is not -1 or a multiple of 64 in 0..65536. */
int qk_set_prefetch(int bytes);
int qk_prefetch(void);
/* The interleaved kernels' prefetch hint: where the lines go (_mm_prefetch's T0: every cache level, T1: L2 and out,
 * T2: L3 and out, NTA: non-temporal, close to the core and first out, as Intel describes them; each CPU decides).
 * -1 sets the CPU's default (the table's: T1, NTA on Zen 5). Returns 0, or -1 when hint is not -1 or a QK_PF_* value. */
enum { QK_PF_T0 = 0, QK_PF_T1 = 1, QK_PF_T2 = 2, QK_PF_NTA = 3, QK_PF_HINTS = 4 };
int qk_set_prefetch_hint(int hint);
int qk_prefetch_hint(void);
/* The table's default distance (and *hint) for a CPU of this CPUID vendor string, family and model. */
int qk_prefetch_default(const char *vendor, int family, int model, int *hint);
/* Which row types the AVX-512 VNNI kernel set multiplies one token through on 512-bit vectors (two 32-byte chunks a
 * load, the activations spread by vpermd) rather than 256-bit ones: a mask of QK_WIDE_* bits, the same results bit for
 * bit either way. A Zen 5 core from L2 ran them 1.42x (Q4_K_R8), 1.19x (Q6_K_R8) and 1.14x (MXFP4_R8) the 256-bit
 * loops' rate. An Intel family 6 model 207 core from L1 ran them at 0.70x, 0.90x and 0.80x, and one 1 GB matrix on two
 * threads streamed at 0.95-0.97x (Q4_K), 1.02-1.03x (Q6_K) and 0.99-1.09x (MXFP4) the 256-bit rate. -1: the CPU's
 * default (the table's: all three on AMD Zen 5, Q6_K_R8 and MXFP4_R8 on Intel family 6 model 207, none elsewhere until
 * measured there). Returns 0, or -1 when mask is not -1 or within QK_WIDE_ALL. */
enum { QK_WIDE_Q4K = 1, QK_WIDE_Q6K = 2, QK_WIDE_MXFP4 = 4, QK_WIDE_ALL = 7 };
int qk_set_wide(int mask);
int qk_wide(void); /* the mask */
int qk_wide_default(const char *vendor, int family, int model);
/* Where the one-token passes over Q4_K_R8 and Q5_K_R8 rows (and the 512-bit ones over Q6_K_R8) put a block's
 * prefetches: 1: each beside the loads of its part of the block (the header's at the block's start), 0: all of the
 * block's at its start; the same lines either way, and the same results. -1: the CPU's default (the table's: on for
 * Intel family 6 model 207, where one 1 GB matrix streamed 1.04-1.06x as fast and full-depth decode steps took
 * 0.93-0.97x the time; off elsewhere until measured there). Returns 0, or -1 when on is not -1, 0 or 1. */
int qk_set_prefetch_spread(int on);
int qk_prefetch_spread(void);
int qk_prefetch_spread_default(const char *vendor, int family, int model);
/* A second prefetch of the same lines into L1 (T0), `bytes` ahead of the block being read, on the interleaved kernels'
 * one-token passes while qk_prefetch() > 0: the first prefetch brings a line to L2 early, this one to L1 just before its
 * loads. 0: none. -1: the CPU's default (the table's: 4096 on Intel family 6 model 207, where one 1 GiB Q4_K matrix
 * streamed 1.06-1.07x as fast and qwen3moe decode steps took 0.94-0.98x the time, bench/journal/issue-36.md "A second
 * prefetch into L1"; 0 elsewhere until measured there). Results do not depend on it. Returns 0, or -1 when bytes is
 * not -1 or a multiple of 64 in 0..65536. */
int qk_set_prefetch_near(int bytes);
int qk_prefetch_near(void);
int qk_prefetch_near_default(const char *vendor, int family, int model);
/* Returns 0, or -1 when worker threads could not be created (the job then ran on the caller). name: the task's, which
 * keys qk_pool_trace's rows (qk_pool_run passes the function's own). */
int qk_pool_run_as(qk_task fn, void *ctx, const char *name);
#define qk_pool_run(fn, ctx) qk_pool_run_as((fn), (ctx), #fn)

/* Where thread tid's reads start in the job after this one: then[tid], for the first nthen threads (at most
 * QK_THEN_MAX). A thread done with its share of this job prefetches the first qk_idle_prefetch() bytes of its span into
 * L2 while it waits: a worker until the next job comes, the caller until the workers are done. A job's tail and the
 * caller's work between jobs then keep memory busy. Results do not depend on it. */
#define QK_THEN_MAX 16
typedef struct {
    const uint8_t *p;
    int64_t bytes;
} qk_span;
int qk_pool_run_then(qk_task fn, void *ctx, const char *name, const qk_span *then, int nthen);
/* The first item of thread t's share of this job (its range's first, whichever thread takes it) reads from p: while
 * qk_pool_trace is on, checked against the span the job before gave thread t (qk_pool_span_checks: matched, or
 * missed where a span was given and p is not its start). */
void qk_pool_first_read(int t, const void *p);
void qk_pool_span_checks(long long *matched, long long *missed);
/* How many bytes of its next span an idle thread prefetches (a multiple of 4096 in 0..16 MiB; 0: none); -1 sets the
 * CPU's default (the table's: 1 MiB on Intel family 6 model 207, where qwen3moe decode steps took 0.956-0.979x the
 * time in three of four windows, bench/journal/issue-36.md "A thread's next share prefetched while it waits"; 0
 * elsewhere until measured there). Returns 0, or -1 when bytes is out of range. */
int qk_set_idle_prefetch(int bytes);
int qk_idle_prefetch(void);
int qk_idle_prefetch_default(const char *vendor, int family, int model);

/* Where the caller's time goes, per job kind (the task's name), while qk_pool_trace(1) is on: jobs, its time from
 * entering a job to the end of its own share, its wait for the workers after that, and its time since the previous
 * job returned (its own work between jobs; a gap over QK_TRACE_LONG_NS, the caller outside the kernels, such as
 * Python between two decode steps, counted apart), in ns. bench/step_profile.py prints them for a decode step. */
#define QK_TRACE_ROWS 32
#define QK_TRACE_LONG_NS 30000
typedef struct {
    const char *name;
    long long jobs, own_ns, wait_ns, gap_ns, long_gap_ns;
} qk_trace_row;
void qk_pool_trace(int on); /* the counters reset; 1: kept from now on, 0: no longer kept */
int qk_pool_trace_rows(qk_trace_row *out, int max); /* copies up to max rows -> how many */

#endif
