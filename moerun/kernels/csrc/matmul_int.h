/* What matmul.c and moe_ffn.c share (internal): work items handed out through atomic counters, the head of a run of
 * rows prefetched, dot calls over one or two groups of interleaved rows, activations quantized on the pool. */
#ifndef MOERUN_MATMUL_INT_H
#define MOERUN_MATMUL_INT_H

#include <stdatomic.h>
#include <stdint.h>

#include "matmul.h"
#include "pool.h"
#include "qk.h"

#define ITEMS_PER_THREAD 16 /* work items per thread, for balance under uneven load */
#define MAX_ROWS_PER_ITEM 64

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }


static inline int64_t rows_per_item(int64_t rows, int nth) {
    int64_t r = (rows + (int64_t)ITEMS_PER_THREAD * nth - 1) / ((int64_t)ITEMS_PER_THREAD * nth);
    return r < 1 ? 1 : r > MAX_ROWS_PER_ITEM ? MAX_ROWS_PER_ITEM : r;
}

/* Work items 0..n-1 split into one contiguous range per thread; a thread takes the items of its own
 * range in order (so its weight reads form long sequential streams the prefetchers follow), then
 * helps with the others' ranges. Any thread may take any item: the split only sets the start. */
#define WQ_RANGES 16
typedef struct {
    struct {
        _Alignas(64) atomic_long next; /* one cache line per range */
        int64_t start, end;
    } r[WQ_RANGES];
    int n;
} workq;

static inline void wq_init(workq *q, int64_t items, int nth) {
    q->n = nth < WQ_RANGES ? nth : WQ_RANGES;
    for (int i = 0; i < q->n; i++) {
        atomic_init(&q->r[i].next, items * i / q->n);
        q->r[i].start = items * i / q->n;
        q->r[i].end = items * (i + 1) / q->n;
    }
}

/* The next item for a thread whose current range is *cur (start with *cur = tid), or -1. */
static inline int64_t wq_next(workq *q, int *cur) {
    for (int k = 0; k < q->n; k++, *cur = (*cur + 1) % q->n) {
        if (atomic_load_explicit(&q->r[*cur].next, memory_order_relaxed) >= q->r[*cur].end) continue;
        const int64_t it = atomic_fetch_add_explicit(&q->r[*cur].next, 1, memory_order_relaxed);
        if (it < q->r[*cur].end) return it;
    }
    return -1;
}

/* Whether item `it`, taken from range `cur` (wq_next's), is that range's first (pool.h's qk_pool_first_read). */
static inline int wq_first(const workq *q, int cur, int64_t it) { return it == q->r[cur].start; }

/* The first qk_prefetch() bytes of a run of weight rows about to be read from its start, with the kernels' hint. The
 * one-token kernels prefetch that far ahead of each block they read, so a run's head is the one part nothing asks
 * for early; a job's items and the MoE's expert runs start a new run each (issue 36: +1 % on a full-depth decode). */
static inline void prefetch_head(const uint8_t *p, int64_t bytes) {
    const int64_t pf = qk_prefetch(), n = bytes < pf ? bytes : pf;
    switch (qk_prefetch_hint()) { /* __builtin_prefetch's locality: 3 = T0, 2 = T1, 1 = T2, 0 = NTA */
    case QK_PF_T0: for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 3); break;
    case QK_PF_T2: for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 1); break;
    case QK_PF_NTA: for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 0); break;
    default: for (int64_t o = 0; o < n; o += 64) __builtin_prefetch(p + o, 0, 2); break;
    }
}

/* Rows r.. of a matrix of `rows` rows per dot call (each call's group: rowb bytes) against nt activation rows, in
 * one call: two groups through dot16 where it is given and both lie below `end`, else one group. o[t * n + q] =
 * row r + q . x[t]; returns n, the rows done. */
static inline int dot_groups(dot_fn dot, dot16_fn dot16, int rows, int64_t nb, const uint8_t *w, int64_t rowb,
                             int64_t r, int64_t end, const void *const *xs, int nt, float *o) {
    if (dot16 && r + 2 * rows <= end) {
        dot16(nb, w + r / rows * rowb, rowb, xs, nt, o);
        return 2 * rows;
    }
    dot(nb, w + r / rows * rowb, xs, nt, o);
    return rows;
}

/* rows x K floats -> rows activation rows of out_row bytes each (on the pool when there are many; matmul.c). */
int qk_quantize_rows(quant_fn quant, const float *x, int64_t rows, int64_t K, uint8_t *out, int64_t out_row);

#endif
