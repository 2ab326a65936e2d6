/* The fused MoE expert FFN on the thread pool (qk_moe_ffn, matmul.h), two pool jobs: (A) gate and up rows of every
 * routed expert, h = act(g, u), and, by whichever thread finishes an expert's last item, h quantized for the down
 * projection; (B) per block of output rows, the down rows of every routed expert, then the weighted combine of those
 * rows; for a few tokens (decode), long runs of one expert's down rows instead, and the combine after them. Work items
 * and dot calls as matmul.c's; experts that 16 or more tokens chose go through AMX tiles where the CPU has them
 * (amx.h). */
#include "matmul.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "matmul_int.h"
#include "vexp.h"

/* gate and up rows per MoE work item for a few tokens (decode), where each row is read once: longer runs of each */
#define MAX_ROWS_PER_ITEM_A 256
#define SCRATCH_BYTES (1 << 20) /* per-thread budget for the MoE down projection's outputs */
/* MoE down projection by expert up to this many tokens (each weight row serves few of them), in items of at least
 * 1 / BY_EXPERT_ITEMS of a thread's share */
#define BY_EXPERT_TOKENS 8
#define BY_EXPERT_ITEMS 2
/* and of at most this many weight bytes, so that a thread done with its share waits for a small piece of another's
 * (GLM-4.5-Air's 4 MB expert downs as 8 whole items: the caller waited 132 us a layer, issue 36) */
#define BY_EXPERT_ITEM_BYTES (512 << 10)

typedef struct {
    /* routing, grouped by expert: active expert a is expert act_e[a]; its (token, slot) pairs are
     * order[first[a] .. first[a + 1]) (pair index t * k + j, ascending); pos[p] = place of pair p */
    int64_t nact, k;
    const int32_t *act_e;
    const int64_t *first, *order, *pos;
    /* gate / up: rows of H elements; x quantized once per activation format */
    dot_fn dot_g, dot_u;
    dot16_fn dot16_g, dot16_u, dot16_d; /* or NULL */
    const uint8_t **gate, **up, *xg, *xu; /* per active expert */
    int64_t nb_g, nb_u, rowb_g, rowb_u, xrow_g, xrow_u, I;
    int rows_g, rows_u, step_a; /* rows per dot call; gate and up rows are taken step_a at a time */
    int nt_a, nt_d;             /* tokens per dot call at most: gate and up, down */
    /* h = silu(gate x) * up x per pair (sorted order), quantized per expert when complete */
    float *h;
    quant_fn quant_h;
    uint8_t *hq;
    int64_t hrow;
    atomic_long *done;        /* per active expert: items finished */
    int64_t rows_a, items_per_expert;
    /* down: rows of I elements, outputs summed into out[T, H] */
    dot_fn dot_d;
    const uint8_t **down;
    int64_t nb_d, rowb_d, H, rows_b, items_b;
    int rows_d;
    const float *wts;
    float *out, *scratch;     /* scratch: rows_b floats per pair, for each of nscratch threads; by expert: H per pair */
    int64_t nscratch, T;
    int64_t parts;            /* by expert (small batches): items are (expert, 1/parts of its rows), else 0 */
    int pairs;                /* out holds one weighted row per pair instead of their sum per token */
    qk_expert_fn fn;
    workq qa, qb;
    /* experts that QK_AMX_MIN_TOKENS pairs or more chose, through the tiles (amx.h) where set: quantized x per pair
     * (sorted order; gate's format, which up shares), up's outputs (gate's go to h); down through them (amx_d); each
     * thread's scratch */
    const uint8_t *xgg;
    float *u2;
    int amx_d;
    uint8_t *tsc;
    int64_t tsc_bytes;
    int qg, qu, qd;
} moe_ctx;

/* Gate and up rows [r0, r1) of active expert a for all its pairs through the tiles, then h = act(g, u) in place. */
static void amx_gate_up(const moe_ctx *c, int64_t a, int64_t r0, int64_t r1, uint8_t *sc);

/* h[j * hstride + q] = act(g[j * n + q], u[j * n + q]) for nt rows of n (vexp.h: vectorised, libm's expf was 8 % of a
 * gpt-oss prompt). */
QK_VECTOR_CLONES static void glu_rows(const qk_expert_fn *fn, const float *g, const float *u, int nt, int n, float *h,
                                      int64_t hstride) {
    const float alpha = fn->alpha, limit = fn->limit;
    for (int j = 0; j < nt; j++) {
        const float *gj = g + j * n, *uj = u + j * n;
        float *hj = h + j * hstride;
        if (fn->act == QK_ACT_SWIGLU_OAI)
            for (int q = 0; q < n; q++) hj[q] = qk_vswiglu_oai(gj[q], uj[q], alpha, limit);
        else
            for (int q = 0; q < n; q++) hj[q] = qk_vsilu(gj[q]) * uj[q];
    }
}

/* Rows [r, r + n) of a matrix of `rows` rows per dot call (n a multiple of it; each call reads rowb bytes)
 * against nt activation rows: o[t * n + j] = row r + j . x[t]. */
static void dot_span(dot_fn dot, dot16_fn dot16, int rows, int64_t nb, const uint8_t *w, int64_t rowb, int64_t r,
                     int n, const void *const *xs, int nt, float *o) {
    float tmp[DOT_MAX_NT * 2 * DOT_MAX_ROWS];
    for (int j = 0; j < n;) {
        const int m = dot_groups(dot, dot16, rows, nb, w, rowb, r + j, r + n, xs, nt, tmp);
        for (int t = 0; t < nt; t++)
            for (int q = 0; q < m; q++) o[t * n + j + q] = tmp[t * m + q];
        j += m;
    }
}

/* Gate and up rows [r0, r1) of active expert a for its pairs through the dot kernels, then h = act(g, u). */
static void dot_gate_up(const moe_ctx *c, int64_t a, int64_t r0, int64_t r1) {
    const uint8_t *gw = c->gate[a], *uw = c->up[a];
    const qk_expert_fn *fn = &c->fn;
    const float *gb = fn->gate_b ? fn->gate_b + c->act_e[a] * c->I : NULL;
    const float *ub = fn->up_b ? fn->up_b + c->act_e[a] * c->I : NULL;
    for (int64_t s = c->first[a]; s < c->first[a + 1]; s += c->nt_a) {
        const int nt = (int)min64(c->nt_a, c->first[a + 1] - s);
        const void *xg[DOT_MAX_NT], *xu[DOT_MAX_NT];
        for (int j = 0; j < nt; j++) {
            const int64_t tok = c->order[s + j] / c->k;
            xg[j] = c->xg + tok * c->xrow_g;
            xu[j] = c->xu + tok * c->xrow_u;
        }
        /* the item's gate rows, then its up rows: one long run of each matrix (alternating them every few KB
         * cost the two streams a quarter of their rate from memory) */
        const int n = (int)(r1 - r0), r = (int)r0;
        float g[DOT_MAX_NT * MAX_ROWS_PER_ITEM_A], u[DOT_MAX_NT * MAX_ROWS_PER_ITEM_A];
        dot_span(c->dot_g, c->dot16_g, c->rows_g, c->nb_g, gw, c->rowb_g, r, n, xg, nt, g);
        dot_span(c->dot_u, c->dot16_u, c->rows_u, c->nb_u, uw, c->rowb_u, r, n, xu, nt, u);
        if (gb || ub)
            for (int j = 0; j < nt; j++)
                for (int q = 0; q < n; q++) {
                    g[j * n + q] += gb ? gb[r + q] : 0.0f;
                    u[j * n + q] += ub ? ub[r + q] : 0.0f;
                }
        glu_rows(fn, g, u, nt, n, c->h + s * c->I + r, c->I);
    }
}

static void moe_gate_up_task(void *p, int tid, int nth) {
    moe_ctx *c = p;
    (void)nth;
    int cur = tid % c->qa.n;
    for (int64_t it; (it = wq_next(&c->qa, &cur)) >= 0;) {
        const int64_t a = it / c->items_per_expert;
        const int64_t r0 = it % c->items_per_expert * c->rows_a, r1 = min64(r0 + c->rows_a, c->I);
        const uint8_t *gw = c->gate[a], *uw = c->up[a];
        if (c->T == 1) { /* the item reads a run of gate rows, then one of up rows */
            prefetch_head(gw + r0 / c->rows_g * c->rowb_g, (r1 - r0) / c->rows_g * c->rowb_g);
            prefetch_head(uw + r0 / c->rows_u * c->rowb_u, (r1 - r0) / c->rows_u * c->rowb_u);
        }
        if (c->xgg && c->first[a + 1] - c->first[a] >= QK_AMX_MIN_TOKENS && tid < c->nscratch)
            amx_gate_up(c, a, r0, r1, c->tsc + tid * c->tsc_bytes);
        else
            dot_gate_up(c, a, r0, r1);
        /* The last item of an expert quantizes its h rows (acq_rel: sees the others' writes). */
        if (atomic_fetch_add_explicit(&c->done[a], 1, memory_order_acq_rel) == c->items_per_expert - 1)
            for (int64_t s = c->first[a]; s < c->first[a + 1]; s++)
                c->quant_h(c->h + s * c->I, c->hq + s * c->hrow, c->I);
    }
}

/* Down rows [r0, r1) of active expert a for its pairs: y[s * ystride + (r - r0)] = row r . h of pair s (+ bias). */
static void down_rows(const moe_ctx *c, int64_t a, int64_t r0, int64_t r1, float *y, int64_t ystride) {
    const uint8_t *dw = c->down[a];
    const float *db = c->fn.down_b ? c->fn.down_b + c->act_e[a] * c->H : NULL;
    for (int64_t s = c->first[a]; s < c->first[a + 1]; s += c->nt_d) {
        const int nt = (int)min64(c->nt_d, c->first[a + 1] - s);
        const void *xs[DOT_MAX_NT];
        for (int j = 0; j < nt; j++) xs[j] = c->hq + (s + j) * c->hrow;
        for (int64_t r = r0; r < r1;) {
            float o[DOT_MAX_NT * 2 * DOT_MAX_ROWS];
            const int n = dot_groups(c->dot_d, c->dot16_d, c->rows_d, c->nb_d, dw, c->rowb_d, r, r1, xs, nt, o);
            for (int j = 0; j < nt; j++)
                for (int q = 0; q < n; q++) y[(s + j) * ystride + (r - r0) + q] = o[j * n + q] + (db ? db[r + q] : 0.0f);
            r += n;
        }
    }
}

static void amx_gate_up(const moe_ctx *c, int64_t a, int64_t r0, int64_t r1, uint8_t *sc) {
    const int64_t s0 = c->first[a], na = c->first[a + 1] - s0, n = r1 - r0, I = c->I;
    float *g = c->h + s0 * I + r0, *u = c->u2 + s0 * I + r0;
    const uint8_t *x = c->xgg + s0 * c->xrow_g;
    qk_amx_rows(c->qg, c->gate[a], c->rowb_g, c->nb_g, r0, r1, x, c->xrow_g, na, g, I, sc);
    qk_amx_rows(c->qu, c->up[a], c->rowb_u, c->nb_u, r0, r1, x, c->xrow_g, na, u, I, sc);
    const float *gb = c->fn.gate_b ? c->fn.gate_b + c->act_e[a] * I + r0 : NULL;
    const float *ub = c->fn.up_b ? c->fn.up_b + c->act_e[a] * I + r0 : NULL;
    for (int64_t j = 0; j < na; j++) {
        float *gj = g + j * I, *uj = u + j * I;
        for (int64_t q = 0; gb && q < n; q++) gj[q] += gb[q];
        for (int64_t q = 0; ub && q < n; q++) uj[q] += ub[q];
        glu_rows(&c->fn, gj, uj, 1, (int)n, gj, I);
    }
}

/* Down rows [r0, r1) of active expert a for its pairs through the tiles, as down_rows. */
static void amx_down(const moe_ctx *c, int64_t a, int64_t r0, int64_t r1, float *y, int64_t ystride, uint8_t *sc) {
    const int64_t s0 = c->first[a], na = c->first[a + 1] - s0;
    qk_amx_rows(c->qd, c->down[a], c->rowb_d, c->nb_d, r0, r1, c->hq + s0 * c->hrow, c->hrow, na, y + s0 * ystride,
                ystride, sc);
    const float *db = c->fn.down_b ? c->fn.down_b + c->act_e[a] * c->H : NULL;
    for (int64_t j = 0; db && j < na; j++)
        for (int64_t r = r0; r < r1; r++) y[(s0 + j) * ystride + (r - r0)] += db[r];
}

/* Output rows [r0, r1) from the pairs' down rows (y[pos * ystride + (r - r0)]), in the order of each token's k
 * choices (pos < 0: a skipped pair): the weighted rows themselves with c->pairs, else their sum per token. */
static void combine_rows(const moe_ctx *c, int64_t r0, int64_t r1, const float *y, int64_t ystride) {
    if (c->pairs) {
        for (int64_t p = 0; p < c->T * c->k; p++)
            for (int64_t r = r0; r < r1; r++)
                c->out[p * c->H + r] = c->pos[p] < 0 ? 0.0f : c->wts[p] * y[c->pos[p] * ystride + (r - r0)];
        return;
    }
    for (int64_t t = 0; t < c->T; t++) { /* choice by choice over the rows (vectorizes): each sum in choice order */
        float *o = c->out + t * c->H + r0;
        for (int64_t r = 0; r < r1 - r0; r++) o[r] = 0.0f;
        for (int64_t j = 0; j < c->k; j++) {
            const int64_t s = c->pos[t * c->k + j];
            if (s < 0) continue;
            const float w = c->wts[t * c->k + j], *yj = y + s * ystride;
            for (int64_t r = 0; r < r1 - r0; r++) o[r] += w * yj[r];
        }
    }
}

/* A batch: per block of output rows, the down rows of every routed expert, then their combine (in cache). */
static void moe_down_task(void *p, int tid, int nth) {
    moe_ctx *c = p;
    (void)nth;
    if (tid >= c->nscratch) return; /* the pool grew since the scratch was sized: sit this one out */
    const int64_t npairs = c->first[c->nact];
    float *y = c->scratch + (int64_t)tid * npairs * c->rows_b; /* y[s * rows_b + (r - r0)] */
    int cur = tid % c->qb.n;
    for (int64_t it; (it = wq_next(&c->qb, &cur)) >= 0;) {
        const int64_t r0 = it * c->rows_b, r1 = min64(r0 + c->rows_b, c->H);
        for (int64_t a = 0; a < c->nact; a++)
            if (c->amx_d && c->first[a + 1] - c->first[a] >= QK_AMX_MIN_TOKENS)
                amx_down(c, a, r0, r1, y, c->rows_b, c->tsc + tid * c->tsc_bytes);
            else
                down_rows(c, a, r0, r1, y, c->rows_b);
        combine_rows(c, r0, r1, y, c->rows_b);
    }
}

/* A few tokens (decode): each item one long run of one expert's down rows, so a thread streams whole matrices
 * instead of switching experts every few KB; the combine follows on the caller (moe_down_combine). */
static void moe_down_expert_task(void *p, int tid, int nth) {
    moe_ctx *c = p;
    (void)nth;
    int cur = tid % c->qb.n;
    const int64_t span = ((c->H + c->parts - 1) / c->parts + c->rows_d - 1) / c->rows_d * c->rows_d; /* parts cover H */
    for (int64_t it; (it = wq_next(&c->qb, &cur)) >= 0;) {
        const int64_t a = it / c->parts, r0 = it % c->parts * span, r1 = min64(r0 + span, c->H);
        if (wq_first(&c->qb, cur, it)) qk_pool_first_read(cur, c->down[a] + r0 / c->rows_d * c->rowb_d);
        if (r0 >= r1) continue;
        if (c->T == 1) prefetch_head(c->down[a] + r0 / c->rows_d * c->rowb_d, (r1 - r0) / c->rows_d * c->rowb_d);
        down_rows(c, a, r0, r1, c->scratch + r0, c->H);
    }
}

/* Where each thread's share of moe_down_expert_task starts (qk_then_spans): its range's first item, to the end of that
 * expert's rows in the range. */
static int down_spans(const moe_ctx *c, qk_span *spans) {
    if (!qk_idle_prefetch()) return 0;
    const int n = c->qb.n < QK_THEN_MAX ? c->qb.n : QK_THEN_MAX;
    const int64_t span = ((c->H + c->parts - 1) / c->parts + c->rows_d - 1) / c->rows_d * c->rows_d;
    for (int t = 0; t < n; t++) {
        const int64_t it = c->qb.r[t].start, a = it / c->parts, end = min64(c->qb.r[t].end, (a + 1) * c->parts);
        const int64_t r0 = it % c->parts * span, r1 = min64((end - a * c->parts) * span, c->H);
        const int64_t rb = c->rowb_d;
        spans[t] = it < end && r0 < r1 ? (qk_span){c->down[a] + r0 / c->rows_d * rb, (r1 - r0) / c->rows_d * rb}
                                       : (qk_span){0};
    }
    return n;
}

static const uint8_t *expert_ptr(qk_expert_mats m, int64_t e) {
    if (m.stride > 0) return m.base + e * m.stride;
    uint64_t a;
    memcpy(&a, m.base + 8 * e, 8);
    return (const uint8_t *)(uintptr_t)a;
}

static int moe_free(void *mem, void *h, void *scratch, int rc) {
    free(mem);
    free(h);
    free(scratch);
    return rc;
}

/* The tiles' buffers where some expert takes them (*tiles, freed by the caller): x quantized per pair, with 16 rows to
 * spare (a tile reads 16), up's outputs, the threads' scratch. */
static int amx_moe_setup(moe_ctx *c, int isa, int qg, int qu, int qd, int step, int group_d, uint8_t **tiles) {
    if (c->T < QK_AMX_MIN_TOKENS) return QK_OK; /* no expert can have enough pairs */
    const int64_t run = c->first[c->nact], I = c->I;
    int many = 0;
    for (int64_t a = 0; a < c->nact; a++) many |= c->first[a + 1] - c->first[a] >= QK_AMX_MIN_TOKENS;
    const int on = many && isa == ISA_VNNI && c->parts == 0 && qk_amx();
    const int gu = on && step == 16 && qk_amx_type(qg) && qk_amx_type(qu) && c->xu == c->xg;
    c->amx_d = on && group_d == 16 && qk_amx_type(qd);
    if (!gu && !c->amx_d) return QK_OK;
    const int64_t xb = gu ? (run + 16) * c->xrow_g : 0, ub = gu ? run * I * 4 : 0;
    const int64_t sg = qk_amx_scratch(qg, c->nb_g), su = qk_amx_scratch(qu, c->nb_u), sd = qk_amx_scratch(qd, c->nb_d);
    c->tsc_bytes = gu ? (sg > su ? sg : su) : 0;
    if (c->amx_d && sd > c->tsc_bytes) c->tsc_bytes = sd;
    const int64_t bytes = (xb + 63) / 64 * 64 + ub + c->nscratch * c->tsc_bytes;
    uint8_t *m = *tiles = aligned_alloc(64, (size_t)((bytes + 63) / 64 * 64));
    if (!m) return QK_ENOMEM;
    if (gu) {
        uint8_t *xgg = m;
        for (int64_t s = 0; s < run; s++) memcpy(xgg + s * c->xrow_g, c->xg + c->order[s] / c->k * c->xrow_g, c->xrow_g);
        memset(xgg + run * c->xrow_g, 0, (size_t)(16 * c->xrow_g));
        c->xgg = xgg;
        c->u2 = (float *)(m + (xb + 63) / 64 * 64);
    }
    c->tsc = m + (xb + 63) / 64 * 64 + ub;
    c->qg = qg, c->qu = qu, c->qd = qd;
    return QK_OK;
}

int qk_moe_ffn(int isa, const float *x, int64_t T, int64_t H, const int32_t *ids, const float *wts, int k,
               qk_expert_mats gate, qk_expert_mats up, qk_expert_mats down, int64_t E, int64_t I, float *out,
               int pairs, const qk_expert_fn *fn, const qk_then *then) {
    const kernel_set *ks = qk_kernels(isa);
    const int qg = qk_qtype_index(gate.type), qu = qk_qtype_index(up.type), qd = qk_qtype_index(down.type);
    if (!ks) return QK_EISA;
    if (qg < 0 || qu < 0 || qd < 0) return QK_ETYPE;
    const qtype_info *tg = &QK_TYPES[qg], *tu = &QK_TYPES[qu], *td = &QK_TYPES[qd];
    const int step_a = tg->rows > tu->rows ? tg->rows : tu->rows; /* 1 or 8 */
    if (T < 1 || k < 1 || E < 1 || I < 1 || H < 1 || H % tg->blk_elems || H % tu->blk_elems ||
        I % td->blk_elems || I % step_a || H % td->rows)
        return QK_ESHAPE;
    for (int64_t p = 0; p < T * k; p++)
        if (ids[p] >= E) return QK_EIDS;

    const int nth = qk_pool_threads();
    const int64_t P = T * k;
    const int ag = tg->act, au = tu->act, ad = td->act;
    const int64_t xrow_g = H / qk_act_elems(ag) * qk_act_bytes(ag);
    const int64_t xrow_u = H / qk_act_elems(au) * qk_act_bytes(au);
    const int64_t hrow = I / qk_act_elems(ad) * qk_act_bytes(ad);
    int64_t rows_b = rows_per_item(H, nth);
    while (rows_b > 4 && P * rows_b * (int64_t)sizeof(float) > SCRATCH_BYTES) rows_b /= 2;
    const int by_expert = T <= BY_EXPERT_TOKENS; /* down pass by expert (see moe_down_expert_task) */
    /* A batch takes two groups of interleaved rows per call where the kernel set has such kernels. */
    dot16_fn d16_g = T > 1 ? ks->dot16[qg] : NULL, d16_u = T > 1 ? ks->dot16[qu] : NULL;
    dot16_fn d16_d = T > 1 ? ks->dot16[qd] : NULL;
    const int step = (d16_g || d16_u) && I % (2 * step_a) == 0 ? 2 * step_a : step_a;
    const int group_d = d16_d && H % (2 * td->rows) == 0 ? 2 * td->rows : td->rows;
    rows_b = (rows_b + group_d - 1) / group_d * group_d; /* whole groups of interleaved rows */

    /* Scratch in three allocations, each under glibc's largest mmap threshold (32 MiB) for a prompt chunk of 512
     * tokens, so that the heap keeps them between calls (hostmem.keep_freed_memory; one block of 32.4 MiB was
     * mapped and faulted in anew in every gpt-oss layer): first (E + 1), cursor (E), order and pos (P each) as
     * int64; done (E counters); gate, up and down addresses (3 E); act_e (E int32); quantized x (one copy per
     * activation format) and quantized h | h (P * I floats) | down outputs (nth * P * rows_b floats, or P * H). */
    const int64_t n_i64 = 5 * E + 1 + 2 * P;
    const int64_t n_out = by_expert ? P * H : (int64_t)nth * P * rows_b;
    const int64_t hpad = T >= QK_AMX_MIN_TOKENS ? 16 : 0; /* h: rows to spare for the tiles, which read 16 a pass */
    const int64_t n_u8 = T * xrow_g + (au != ag ? T * xrow_u : 0) + (P + hpad) * hrow;
    uint8_t *mem = malloc((size_t)(n_i64 * 8 + E * (int64_t)sizeof(atomic_long) + (E + 1) / 2 * 8 + n_u8));
    float *h = malloc((size_t)(P * I) * sizeof(float)), *scratch = malloc((size_t)n_out * sizeof(float));
    if (!mem || !h || !scratch) return moe_free(mem, h, scratch, QK_ENOMEM);
    int64_t *first = (int64_t *)mem, *cursor = first + E + 1, *order = cursor + E, *pos = order + P;
    const uint8_t **pg = (const uint8_t **)(pos + P), **pu = pg + E, **pd = pu + E;
    atomic_long *done = (atomic_long *)(pd + E);
    int32_t *act_e = (int32_t *)(done + E);
    uint8_t *xg = (uint8_t *)(act_e + (E + 1) / 2 * 2); /* 8-byte aligned */
    uint8_t *xu = au != ag ? xg + T * xrow_g : xg;
    uint8_t *hq = xu + (au != ag ? T * xrow_u : T * xrow_g);
    memset(hq + P * hrow, 0, (size_t)(hpad * hrow));

    /* Group the pairs by expert: a stable counting sort keeps token order within an expert; skipped pairs
     * (negative ids) get no place. */
    for (int64_t e = 0; e < E; e++) cursor[e] = 0;
    for (int64_t p = 0; p < P; p++)
        if (ids[p] >= 0) cursor[ids[p]]++;
    int64_t nact = 0, run = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t n = cursor[e];
        if (n) {
            act_e[nact] = (int32_t)e;
            first[nact++] = run;
        }
        cursor[e] = run;
        run += n;
    }
    first[nact] = run;
    for (int64_t p = 0; p < P; p++) {
        pos[p] = -1;
        if (ids[p] >= 0) order[cursor[ids[p]]++] = p;
    }
    for (int64_t s = 0; s < run; s++) pos[order[s]] = s;
    if (nact == 0) { /* every pair skipped */
        memset(out, 0, (size_t)((pairs ? T * k : T) * H) * sizeof(float));
        return moe_free(mem, h, scratch, QK_OK);
    }
    for (int64_t a = 0; a < nact; a++) {
        atomic_init(&done[a], 0);
        pg[a] = expert_ptr(gate, act_e[a]);
        pu[a] = expert_ptr(up, act_e[a]);
        pd[a] = expert_ptr(down, act_e[a]);
        if (!pg[a] || !pu[a] || !pd[a]) return moe_free(mem, h, scratch, QK_EMISSING);
    }

    qk_quantize_rows(ks->quant[ag], x, T, H, xg, xrow_g);
    if (au != ag) qk_quantize_rows(ks->quant[au], x, T, H, xu, xrow_u);

    moe_ctx c = {
        .nact = nact, .k = k, .act_e = act_e, .first = first, .order = order, .pos = pos,
        .dot_g = ks->dot[qg], .dot_u = ks->dot[qu], .gate = pg, .up = pu, .xg = xg, .xu = xu,
        .nb_g = H / tg->blk_elems, .nb_u = H / tu->blk_elems, .rowb_g = H / tg->blk_elems * tg->blk_bytes,
        .rowb_u = H / tu->blk_elems * tu->blk_bytes, .xrow_g = xrow_g, .xrow_u = xrow_u, .I = I,
        .rows_g = tg->rows, .rows_u = tu->rows, .step_a = step, .rows_d = td->rows,
        .dot16_g = d16_g, .dot16_u = d16_u, .dot16_d = d16_d,
        .nt_a = tg->max_nt < tu->max_nt ? tg->max_nt : tu->max_nt, .nt_d = td->max_nt,
        .h = h, .quant_h = ks->quant[ad], .hq = hq, .hrow = hrow, .done = done,
        .dot_d = ks->dot[qd], .down = pd, .nb_d = I / td->blk_elems,
        .rowb_d = I / td->blk_elems * td->blk_bytes, .H = H, .rows_b = rows_b,
        .wts = wts, .out = out, .scratch = scratch, .nscratch = nth, .T = T, .pairs = pairs,
        .fn = fn ? *fn : (qk_expert_fn){QK_ACT_SWIGLU, 0.0f, 0.0f, NULL, NULL, NULL},
    };
    c.rows_a = by_expert ? (nact * I + (int64_t)ITEMS_PER_THREAD * nth - 1) / ((int64_t)ITEMS_PER_THREAD * nth)
                         : rows_per_item(nact * I, nth);
    c.rows_a = c.rows_a < step ? step : c.rows_a > MAX_ROWS_PER_ITEM_A ? MAX_ROWS_PER_ITEM_A : c.rows_a;
    c.rows_a = (c.rows_a + step - 1) / step * step;
    if (c.rows_a > I) c.rows_a = I;
    c.items_per_expert = (I + c.rows_a - 1) / c.rows_a;
    if (by_expert) { /* parts: at least BY_EXPERT_ITEMS items per thread in all, for balance */
        c.parts = (BY_EXPERT_ITEMS * nth + nact - 1) / nact;
        const int64_t by_bytes = (H / td->rows * c.rowb_d + BY_EXPERT_ITEM_BYTES - 1) / BY_EXPERT_ITEM_BYTES;
        if (nth > 1 && c.parts < by_bytes) c.parts = by_bytes;
        if (c.parts > H / td->rows) c.parts = H / td->rows;
        c.items_b = nact * c.parts;
    } else {
        c.items_b = (H + rows_b - 1) / rows_b;
    }
    uint8_t *tiles = NULL;
    const int rc = amx_moe_setup(&c, isa, qg, qu, qd, step, group_d, &tiles);
    if (rc != QK_OK) return moe_free(mem, h, scratch, rc);
    wq_init(&c.qa, nact * c.items_per_expert, nth);
    wq_init(&c.qb, c.items_b, nth);
    qk_span spans[QK_THEN_MAX];
    const int nspans = by_expert ? down_spans(&c, spans) : 0;
    qk_pool_run_then(moe_gate_up_task, &c, "moe_gate_up_task", spans, nspans);
    if (by_expert) {
        qk_pool_run_then(moe_down_expert_task, &c, "moe_down_expert_task", spans, qk_then_spans(isa, then, T, spans));
        combine_rows(&c, 0, H, scratch, H);
    } else {
        qk_pool_run(moe_down_task, &c);
    }
    free(tiles);
    return moe_free(mem, h, scratch, QK_OK);
}
