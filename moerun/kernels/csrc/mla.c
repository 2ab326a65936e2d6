/* DeepSeek's multi-head latent attention for the rows of a small step (attn.h's kind 2), in the absorbed form:
 * the cache holds one latent a position, shared by every head; no head's keys or values are ever expanded.
 *
 * The projections go through qk_matmuls; then one pool job with an item per (row, head): the head's query into
 * the latent space (wk_b), scores over the latents, the softmax, the weighted latent, and out through wv_b. Each
 * value is computed by one thread in a fixed order, so results do not depend on the thread count. W_UK and W_UV may
 * stay in the file's quantized types: a row is then dequantized in registers (deqdot.c) or into a row of scratch,
 * and dotted in the float kernel's order, so the results are those of the float32 weights, bit for bit. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "attn_core.h"
#include "matmul.h"
#include "pool.h"
#include "qk.h"

/* W_UK or W_UV: rows of K weights, float32 (deq NULL, bytes 4 K) or of a quantized type (bytes a row). */
typedef struct {
    const uint8_t *w;
    int type;
    int64_t K, N, bytes;
    deq_dot_fn deq;
} mla_w;

typedef struct {
    const attn_kernels *k;
    dot_fn dot;
    mla_w wk, wv;
    int64_t nh, rank, R, nope, dv, maxkeys, items, row;
    int kind, group; /* group: items of eight heads through k->group */
    const uint8_t *cache;
    const float *q;
    float *qlat, *lat, *o, *scores, *rows, scale;
    const int64_t *const *slots;
    const int64_t *pos;
    atomic_long next;
} mla_ctx;

/* out = row `row` of m dotted with x (buf: K floats of scratch where a row is dequantized first). */
static void mla_dot(const mla_ctx *c, const mla_w *m, int64_t row, const float *x, float *buf, float *out) {
    const void *xs = x;
    if (m->type == GGML_F32) {
        c->dot(m->K, m->w + row * m->bytes, &xs, 1, out);
    } else if (m->deq) {
        m->deq(m->K, m->w + row * m->bytes, x, out);
    } else {
        qk_dequant_rows(m->type, m->w, m->N, m->K, &row, 1, buf);
        c->dot(m->K, (const uint8_t *)buf, &xs, 1, out);
    }
}

/* With the group kernel (c->group): an item is a row's eight heads (or the last few), their queries into the latent
 * space, then their attention over the latents together, then out through W_UV. */
static void mla_group_item(const mla_ctx *c, int64_t it, float *buf) {
    const int64_t chunks = (c->nh + 7) / 8, r = it / chunks, h0 = it % chunks * 8, n = c->pos[r] + 1;
    const int64_t hc = c->nh - h0 < 8 ? c->nh - h0 : 8, hd = c->nope + c->R, L = c->rank + c->R, i0 = r * c->nh + h0;
    for (int64_t h = h0; h < h0 + hc; h++) {
        const float *qh = c->q + (r * c->nh + h) * hd;
        float *ql = c->qlat + (r * c->nh + h) * L;
        for (int64_t i = 0; i < c->rank; i++) mla_dot(c, &c->wk, h * c->rank + i, qh, buf, ql + i);
        memcpy(ql + c->rank, qh + c->nope, (size_t)c->R * sizeof(float));
    }
    c->k->group(c->lat + i0 * c->rank, c->qlat + i0 * L, hc, n, c->cache, c->cache, c->slots[r], c->row, c->row, L,
                c->rank, c->kind, c->kind, c->scale, NULL, c->scores + it * 8 * c->maxkeys);
    for (int64_t h = h0; h < h0 + hc; h++)
        for (int64_t v = 0; v < c->dv; v++)
            mla_dot(c, &c->wv, h * c->dv + v, c->lat + (r * c->nh + h) * c->rank, buf, c->o + (r * c->nh + h) * c->dv + v);
}

static void mla_task(void *p, int tid, int nth) {
    mla_ctx *c = p;
    (void)nth;
    float *buf = c->rows + tid * (c->rank > c->nope ? c->rank : c->nope);
    const int64_t hd = c->nope + c->R, L = c->rank + c->R;
    for (int64_t it; (it = atomic_fetch_add(&c->next, 1)) < c->items;) {
        if (c->group) {
            mla_group_item(c, it, buf);
            continue;
        }
        const int64_t r = it / c->nh, h = it % c->nh, n = c->pos[r] + 1;
        const float *qh = c->q + it * hd;         /* [nope, rope], rotated */
        float *ql = c->qlat + it * L, *s = c->scores + it * c->maxkeys, *lt = c->lat + it * c->rank;
        for (int64_t i = 0; i < c->rank; i++) mla_dot(c, &c->wk, h * c->rank + i, qh, buf, ql + i);
        memcpy(ql + c->rank, qh + c->nope, (size_t)c->R * sizeof(float));
        c->k->scores[c->kind](s, ql, n, c->cache, c->slots[r], c->row, L, c->scale);
        float max = -INFINITY;
        for (int64_t j = 0; j < n; j++) max = s[j] > max ? s[j] : max;
        const float inv = 1.0f / c->k->exp_sum(s, n, max);
        for (int64_t j = 0; j < n; j++) s[j] *= inv;
        c->k->wsum[c->kind](lt, s, n, c->cache, c->slots[r], c->row, c->rank);
        for (int64_t v = 0; v < c->dv; v++) mla_dot(c, &c->wv, h * c->dv + v, lt, buf, c->o + it * c->dv + v);
    }
}

/* Items of eight heads through the group kernel where the kernel set has it and the latent's lengths allow. */
static void mla_use_group(mla_ctx *c, int64_t B) {
    c->group = c->k->group && (c->rank + c->R) % 16 == 0 && c->rank % 16 == 0;
    if (c->group) c->items = B * ((c->nh + 7) / 8);
}

static const float *fptr(int64_t a) { return (const float *)(uintptr_t)a; }

/* W_UK / W_UV [n rows of K]: its bytes a row by type, its kernel; 0 when the type or the row's length will not do. */
static int mla_wmat(int isa, int64_t w, int64_t type, int64_t N, int64_t K, mla_w *m) {
    *m = (mla_w){.w = (const uint8_t *)(uintptr_t)w, .type = (int)type, .K = K, .N = N, .bytes = 4 * K};
    if (type == GGML_F32) return 1;
    const int qt = qk_qtype_index((int)type);
    if (qt < 0 || QK_TYPES[qt].rows != 1 || K % QK_TYPES[qt].blk_elems) return 0;
    m->bytes = K / QK_TYPES[qt].blk_elems * QK_TYPES[qt].blk_bytes;
    m->deq = qk_deq_fdot(isa, (int)type);
    return 1;
}

static qk_wmat wmat(int64_t w, int64_t type, int64_t rows) {
    return (qk_wmat){(const uint8_t *)(uintptr_t)w, (int)type, rows};
}

int qk_mla_first(const qk_attn_desc *d, qk_wmat mats[QK_MM_MAX]) {
    const int64_t L = d->mla_rank + d->rope_dim;
    mats[0] = d->q_rank ? wmat(d->wq_a, d->wq_a_type, d->q_rank) : wmat(d->wq, d->wq_type, d->n_heads * d->head_dim);
    mats[1] = wmat(d->wkv_a, d->wkv_a_type, L);
    return 2;
}

int qk_mla_mix(int isa, const qk_attn_desc *d, float *x, int64_t B, const int64_t *const *slots, const int64_t *pos,
               void *kc, const float *rope_cos, const float *rope_sin, float eps, int ktype, const qk_then *then) {
    const int64_t H = d->hidden, nh = d->n_heads, rank = d->mla_rank, R = d->rope_dim, hd = d->head_dim;
    const int64_t nope = hd - R, dv = d->mla_v, qr = d->q_rank, L = rank + R, qd = nh * hd;
    const int kind = qk_kv_kind(ktype);
    const dot_fn dot = qk_fdot(isa, 0);
    if (B < 1 || H < 1 || nh < 1 || rank < 1 || dv < 1 || R < 2 || R % 2 || nope < 1 || qr < 0 || !d->wk_b ||
        !d->wv_b || !d->wkv_a || !d->kv_a_norm || (qr && (!d->wq_a || !d->q_a_norm)))
        return QK_ESHAPE;
    if (kind < 0 || !dot) return QK_ETYPE;
    mla_w wk, wv;
    if (!mla_wmat(isa, d->wk_b, d->wk_b_type, nh * rank, nope, &wk) ||
        !mla_wmat(isa, d->wv_b, d->wv_b_type, nh * dv, rank, &wv))
        return QK_ETYPE;
    if (kind == KV_Q8_0 && (rank % 32 || R % 32)) return QK_ESHAPE; /* the values are the latent's whole blocks */
    const int64_t row = qk_kind_bytes(kind, L);
    int64_t maxkeys = 1;
    for (int64_t r = 0; r < B; r++) {
        if (pos[r] < 0) return QK_ESHAPE;
        maxkeys = pos[r] + 1 > maxkeys ? pos[r] + 1 : maxkeys;
    }
    const int64_t nfloat = B * (H + qr + qd + L + nh * (L + rank + dv) + (nh + 7) * maxkeys + H) +
                           (int64_t)qk_pool_threads() * (rank > nope ? rank : nope);
    float *mem = malloc((size_t)nfloat * sizeof(float));
    if (!mem) return QK_ENOMEM;
    float *xn = mem, *qa = xn + B * H, *q = qa + B * qr, *kv = q + B * qd, *qlat = kv + B * L;
    float *lat = qlat + B * nh * L, *o = lat + B * nh * rank, *scores = o + B * nh * dv;
    float *out = scores + B * (nh + 7) * maxkeys; /* scores: a head's, or eight heads' an item (mla_group_item) */
    float *rows = out + B * H; /* a dequantized row per thread */

    for (int64_t r = 0; r < B; r++) qk_rms_norm(x + r * H, fptr(d->attn_norm), H, eps, xn + r * H);
    int rc;
    qk_wmat first[QK_MM_MAX];
    const qk_wmat wq = wmat(d->wq, d->wq_type, qd), wo = wmat(d->wo, d->wo_type, H);
    const qk_then to_wq = {1, &wq, qr}, to_wo = {1, &wo, nh * dv};
    qk_mla_first(d, first);
    if (qr) { /* q through its low-rank pair, the latent beside it from the same input */
        float *const outs[2] = {qa, kv};
        rc = qk_matmuls_then(isa, 2, first, H, xn, B, outs, &to_wq);
        for (int64_t r = 0; !rc && r < B; r++) qk_rms_norm(qa + r * qr, fptr(d->q_a_norm), qr, eps, qa + r * qr);
        if (!rc) rc = qk_matmuls_then(isa, 1, &wq, qr, qa, B, &q, &to_wo);
    } else {
        float *const outs[2] = {q, kv};
        rc = qk_matmuls_then(isa, 2, first, H, xn, B, outs, &to_wo);
    }
    for (int64_t r = 0; !rc && r < B; r++) {
        const float *cs = rope_cos + pos[r] * (R / 2), *sn = rope_sin + pos[r] * (R / 2);
        float *lr = kv + r * L;
        qk_rms_norm(lr, fptr(d->kv_a_norm), rank, eps, lr);
        qk_rope(lr + rank, cs, sn, R, (int)d->neox);
        qk_store_row(kind, (uint8_t *)kc + slots[r][pos[r]] * row, lr, L);
        for (int64_t h = 0; h < nh; h++) qk_rope(q + r * qd + h * hd + nope, cs, sn, R, (int)d->neox);
    }
    if (!rc) {
        const float scale = fptr(d->fparams) && fptr(d->fparams)[1] > 0.0f ? fptr(d->fparams)[1]
                                                                            : (float)(1.0 / sqrt((double)hd));
        mla_ctx c = {.k = qk_attn_kernels(isa), .dot = dot, .nh = nh, .rank = rank, .R = R, .nope = nope, .dv = dv,
                     .maxkeys = maxkeys, .items = B * nh, .row = row, .kind = kind, .cache = kc, .q = q, .wk = wk,
                     .wv = wv, .qlat = qlat, .lat = lat, .o = o, .scores = scores, .rows = rows, .scale = scale,
                     .slots = slots, .pos = pos};
        mla_use_group(&c, B);
        atomic_init(&c.next, 0);
        qk_span spans[QK_THEN_MAX];
        qk_pool_run_then(mla_task, &c, "mla_task", spans, qk_then_spans(isa, &to_wo, B, spans));
        rc = qk_matmuls_then(isa, 1, &wo, nh * dv, o, B, &out, then);
    }
    for (int64_t r = 0; !rc && r < B; r++)
        for (int64_t i = 0; i < H; i++) x[r * H + i] += out[r * H + i];
    free(mem);
    return rc;
}

int qk_mla_attend_rows(int isa, const float *q, int64_t B, int64_t nh, int64_t rank, int64_t R, int64_t nope,
                       int64_t dv, const float *wk_b, const float *wv_b, const float *cache,
                       const int64_t *const *slots, const int64_t *pos, float scale, float *o) {
    const int64_t L = rank + R, hd = nope + R;
    const dot_fn dot = qk_fdot(isa, 0);
    if (B < 1 || nh < 1 || rank < 1 || R < 0 || nope < 1 || dv < 1) return QK_ESHAPE;
    if (!dot) return QK_ETYPE;
    int64_t maxkeys = 1;
    for (int64_t r = 0; r < B; r++) {
        if (pos[r] < 0) return QK_ESHAPE;
        maxkeys = pos[r] + 1 > maxkeys ? pos[r] + 1 : maxkeys;
    }
    const int64_t nfloat = B * (nh * (L + rank) + (nh + 7) * maxkeys) +
                           (int64_t)qk_pool_threads() * (rank > nope ? rank : nope);
    float *mem = malloc((size_t)nfloat * sizeof(float));
    if (!mem) return QK_ENOMEM;
    float *qlat = mem, *lat = qlat + B * nh * L, *scores = lat + B * nh * rank;
    float *rows = scores + B * (nh + 7) * maxkeys;
    mla_ctx c = {.k = qk_attn_kernels(isa), .dot = dot, .nh = nh, .rank = rank, .R = R, .nope = nope, .dv = dv,
                 .maxkeys = maxkeys, .items = B * nh, .row = 4 * L, .kind = KV_F32, .cache = (const uint8_t *)cache,
                 .q = q, .wk = {(const uint8_t *)wk_b, GGML_F32, nope, nh * rank, 4 * nope, NULL},
                 .wv = {(const uint8_t *)wv_b, GGML_F32, rank, nh * dv, 4 * rank, NULL}, .qlat = qlat, .lat = lat,
                 .o = o, .scores = scores, .rows = rows,
                 .scale = scale > 0.0f ? scale : (float)(1.0 / sqrt((double)hd)), .slots = slots, .pos = pos};
    mla_use_group(&c, B);
    atomic_init(&c.next, 0);
    qk_pool_run(mla_task, &c);
    free(mem);
    return QK_OK;
}
