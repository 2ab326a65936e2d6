/* matmul and the fused MoE expert FFN (moe_ffn.c), on the thread pool.
 *
 * Both quantize the activations once, then hand out work items (up to 64 weight rows each) through
 * atomic counters (workq, matmul_int.h): each thread starts on its own contiguous share, so its reads are long
 * sequential streams, and a thread slowed down by other load simply ends up taking fewer items. Every
 * output value is computed by exactly one dot call whose inputs do not depend on which thread runs it,
 * and the MoE combine adds the k expert outputs of a token in the order of its k choices: results are
 * bitwise independent of the thread count.
 *
 * Within an item, tokens are taken four at a time (one weight-row load serves four activation rows)
 * and the item's weight rows, which stay in L1/L2, are walked once per group of four tokens. Batches of 16 tokens
 * or more of Q8_0 / MXFP4 rows go through AMX tiles where the CPU has them (amx.h). */
#include "matmul.h"

#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "matmul_int.h"

#define PARALLEL_QUANT_ELEMS (1 << 16) /* quantize activations on the pool above this many values */

/* ---------------------------------------------------------------------- activation quantization */

typedef struct {
    quant_fn quant;
    const float *x;
    int64_t rows, K, out_row;
    uint8_t *out;
    atomic_long next;
} quant_ctx;

#define QUANT_ROWS 8

static void quant_task(void *p, int tid, int nth) {
    quant_ctx *c = p;
    (void)tid, (void)nth;
    for (;;) {
        const int64_t r0 = atomic_fetch_add(&c->next, QUANT_ROWS);
        if (r0 >= c->rows) break;
        for (int64_t r = r0; r < min64(r0 + QUANT_ROWS, c->rows); r++)
            c->quant(c->x + r * c->K, c->out + r * c->out_row, c->K);
    }
}

int qk_quantize_rows(quant_fn quant, const float *x, int64_t rows, int64_t K, uint8_t *out, int64_t out_row) {
    if (rows * K <= PARALLEL_QUANT_ELEMS || rows == 1) {
        for (int64_t r = 0; r < rows; r++) quant(x + r * K, out + r * out_row, K);
        return 0;
    }
    quant_ctx c = {quant, x, rows, K, out_row, out, 0};
    return qk_pool_run(quant_task, &c);
}

/* ------------------------------------------------------------------------------------ matmul */

typedef struct {
    dot_fn dot;
    dot16_fn dot16;        /* two groups of interleaved rows per call, or NULL */
    const uint8_t *w;
    int64_t N, nb, row_bytes; /* row_bytes: per dot call (a group of `rows` rows) */
    int rows;
    int nt;                /* tokens per dot call at most */
    int act;               /* activation format, or -1: float weights read the float rows of x */
    const uint8_t *xq;     /* activation rows in that format */
    int64_t xq_row;
    float *out;
    int64_t item0;         /* the matrix's first work item */
    int amx;               /* through the tiles (amx.h), as the QT_* type qt */
    int qt;
} mm_mat;

typedef struct {
    mm_mat m[QK_MM_MAX];
    int n;
    int64_t T, rows_per;
    workq q;
    uint8_t *sc; /* the tiles' scratch, sc_bytes for each of nsc threads */
    int64_t sc_bytes;
    int nsc;
} mm_ctx;

/* Rows [r0, r1) of one matrix against all T tokens, m->nt tokens per pass over the rows (r0 and r1 are
 * multiples of the matrix's rows per dot call). */
static void mm_rows(const mm_mat *m, int64_t T, int64_t r0, int64_t r1) {
    const dot_fn dot = m->dot;
    const int64_t nb = m->nb, rb = m->row_bytes, N = m->N;
    const int rows = m->rows;
    for (int64_t t = 0; t < T; t += m->nt) {
        const int nt = (int)min64(m->nt, T - t);
        const void *xs[DOT_MAX_NT];
        for (int j = 0; j < nt; j++) xs[j] = m->xq + (t + j) * m->xq_row;
        for (int64_t r = r0; r < r1;) {
            float o[DOT_MAX_NT * 2 * DOT_MAX_ROWS];
            const int n = dot_groups(dot, m->dot16, rows, nb, m->w, rb, r, r1, xs, nt, o);
            for (int j = 0; j < nt; j++)
                for (int q = 0; q < n; q++) m->out[(t + j) * N + r + q] = o[j * n + q];
            r += n;
        }
    }
}

static void mm_task(void *p, int tid, int nth) {
    mm_ctx *c = p;
    (void)nth;
    int cur = tid % c->q.n;
    const uint8_t *next = NULL; /* where the thread's last item ended */
    for (int64_t it; (it = wq_next(&c->q, &cur)) >= 0;) {
        int j = 0;
        while (j + 1 < c->n && it >= c->m[j + 1].item0) j++;
        const mm_mat *m = &c->m[j];
        const int64_t r0 = (it - m->item0) * c->rows_per, r1 = min64(r0 + c->rows_per, m->N);
        const uint8_t *start = m->w + r0 / m->rows * m->row_bytes;
        if (wq_first(&c->q, cur, it)) qk_pool_first_read(cur, start);
        if (c->T == 1 && start != next) prefetch_head(start, (r1 - r0) / m->rows * m->row_bytes);
        next = m->w + r1 / m->rows * m->row_bytes;
        if (m->amx && tid < c->nsc)
            qk_amx_rows(m->qt, m->w, m->row_bytes, m->nb, r0, r1, m->xq, m->xq_row, c->T, m->out + r0, m->N,
                        c->sc + tid * c->sc_bytes);
        else
            mm_rows(m, c->T, r0, r1);
    }
}

/* The job's matrices, their work items (rows_per rows each, whole groups of interleaved rows) and the activation
 * formats they read (need): everything but the activations themselves. Returns QK_OK or a QK_E* code. */
static int mm_layout(const kernel_set *ks, int isa, int n, const qk_wmat *w, int64_t K, int64_t T, int nth, mm_ctx *c,
                     int need[ACT_COUNT], int64_t *items) {
    if (n < 1 || n > QK_MM_MAX || T < 1 || K < 1) return QK_ESHAPE;
    *c = (mm_ctx){.n = n, .T = T};
    int group = 1; /* work items hold whole groups of interleaved rows */
    int64_t rows = 0;
    for (int j = 0; j < n; j++) {
        mm_mat *m = &c->m[j];
        *m = (mm_mat){.w = w[j].w, .N = w[j].N, .act = -1};
        if (m->N < 1) return QK_ESHAPE;
        rows += m->N;
        const dot_fn fd = qk_fdot(isa, w[j].ggml);
        if (fd) {
            *m = (mm_mat){fd, NULL, w[j].w, w[j].N, K, K * (w[j].ggml == GGML_F32 ? 4 : 2), 1, 4, -1, NULL, 0, NULL,
                          0, 0, 0};
            continue;
        }
        const int qt = qk_qtype_index(w[j].ggml);
        if (qt < 0) return QK_ETYPE;
        const qtype_info *ti = &QK_TYPES[qt];
        if (K % ti->blk_elems || m->N % ti->rows) return QK_ESHAPE;
        m->dot = ks->dot[qt];
        m->dot16 = T > 1 ? ks->dot16[qt] : NULL; /* a batch: 16 rows per call where the set has it */
        if (m->dot16 && 2 * ti->rows > group) group = 2 * ti->rows;
        m->nb = K / ti->blk_elems;
        m->row_bytes = m->nb * ti->blk_bytes;
        m->rows = ti->rows;
        m->nt = ti->max_nt;
        if (ti->rows > group) group = ti->rows;
        m->act = ti->act;
        need[ti->act] = 1;
        m->qt = qt;
        m->amx = isa == ISA_VNNI && T >= QK_AMX_MIN_TOKENS && m->N % 16 == 0 && qk_amx_type(qt) && qk_amx();
        if (m->amx && qk_amx_scratch(qt, m->nb) > c->sc_bytes) c->sc_bytes = qk_amx_scratch(qt, m->nb);
        c->nsc |= m->amx;
    }
    c->rows_per = (rows_per_item(rows, nth) + group - 1) / group * group;
    *items = 0;
    for (int j = 0; j < n; j++) {
        c->m[j].item0 = *items;
        *items += (c->m[j].N + c->rows_per - 1) / c->rows_per;
    }
    return QK_OK;
}

int qk_then_spans(int isa, const qk_then *then, int64_t T, qk_span *spans) {
    const kernel_set *ks = qk_kernels(isa);
    if (!ks || !then || then->n < 1 || !qk_idle_prefetch()) return 0;
    const int nth = qk_pool_threads();
    mm_ctx c;
    int need[ACT_COUNT] = {0};
    int64_t items;
    if (mm_layout(ks, isa, then->n, then->w, then->K, T, nth, &c, need, &items)) return 0;
    workq q; /* the job's split: thread t starts on the first item of its range */
    wq_init(&q, items, nth);
    const int n = q.n < QK_THEN_MAX ? q.n : QK_THEN_MAX;
    for (int t = 0; t < n; t++) {
        const int64_t it = q.r[t].start, end = q.r[t].end;
        int j = 0;
        while (j + 1 < c.n && it >= c.m[j + 1].item0) j++;
        const mm_mat *m = &c.m[j];
        const int64_t last = j + 1 < c.n && end > c.m[j + 1].item0 ? c.m[j + 1].item0 : end; /* within matrix j */
        const int64_t r0 = (it - m->item0) * c.rows_per, r1 = min64((last - m->item0) * c.rows_per, m->N);
        const int64_t rb = m->row_bytes;
        spans[t] = it < end && r0 < r1 ? (qk_span){m->w + r0 / m->rows * rb, (r1 - r0) / m->rows * rb} : (qk_span){0};
    }
    return n;
}

int qk_matmuls_then(int isa, int n, const qk_wmat *w, int64_t K, const float *x, int64_t T, float *const *out,
                    const qk_then *then) {
    const kernel_set *ks = qk_kernels(isa);
    if (!ks) return QK_EISA;
    const int nth = qk_pool_threads();
    mm_ctx c;
    int need[ACT_COUNT] = {0};
    int64_t items;
    const int rc = mm_layout(ks, isa, n, w, K, T, nth, &c, need, &items);
    if (rc) return rc;
    /* x quantized once per activation format the matrices use (and 16 rows to spare for the tiles, which read 16) */
    int64_t xrow[ACT_COUNT] = {0}, bytes = 0, rows_x = c.nsc ? T + 16 : T;
    for (int a = 0; a < ACT_COUNT; a++)
        if (need[a]) bytes += rows_x * (xrow[a] = K / qk_act_elems(a) * qk_act_bytes(a));
    uint8_t *mem = bytes ? malloc((size_t)bytes) : NULL, *xq[ACT_COUNT] = {0};
    if (bytes && !mem) return QK_ENOMEM;
    int64_t off = 0;
    for (int a = 0; a < ACT_COUNT; a++) {
        if (!need[a]) continue;
        xq[a] = mem + off;
        memset(xq[a] + T * xrow[a], 0, (size_t)((rows_x - T) * xrow[a]));
        off += rows_x * xrow[a];
        qk_quantize_rows(ks->quant[a], x, T, K, xq[a], xrow[a]);
    }
    uint8_t *tiles = NULL; /* the tiles' scratch, per thread */
    if (c.nsc) {
        if (!(tiles = aligned_alloc(64, (size_t)(nth * c.sc_bytes)))) {
            free(mem);
            return QK_ENOMEM;
        }
        c.sc = tiles;
        c.nsc = nth;
    }
    for (int j = 0; j < n; j++) {
        mm_mat *m = &c.m[j];
        m->out = out[j];
        if (m->act >= 0) {
            m->xq = xq[m->act];
            m->xq_row = xrow[m->act];
        } else {
            m->xq = (const uint8_t *)x; /* float rows */
            m->xq_row = K * (int64_t)sizeof(float);
        }
    }
    wq_init(&c.q, items, nth);
    qk_span spans[QK_THEN_MAX];
    const int nspans = qk_then_spans(isa, then, T, spans);
    qk_pool_run_then(mm_task, &c, "mm_task", spans, nspans);
    free(mem);
    free(tiles);
    return QK_OK;
}

int qk_matmuls(int isa, int n, const qk_wmat *w, int64_t K, const float *x, int64_t T, float *const *out) {
    return qk_matmuls_then(isa, n, w, K, x, T, out, NULL);
}

int qk_matmul(int isa, int ggml, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t T, float *out) {
    if (qk_fdot(isa, ggml)) return QK_ETYPE; /* the public matmul takes quantized weights only */
    const qk_wmat m = {w, ggml, N};
    return qk_matmuls(isa, 1, &m, K, x, T, &out);
}
