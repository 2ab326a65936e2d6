/* Rows of a weight matrix back to floats, as gguf.quants dequantizes them (same float operations, so
 * the same values): the token embedding lookup of a quantized model, one row per token. Layouts: qk.h. */
#include <stdatomic.h>

#include "matmul.h"
#include "pool.h"
#include "qk.h"

static void deq_q4_0(const uint8_t *b, float *y) {
    const float d = qk_f16_at(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[2 + j] & 15) - 8);
        y[j + 16] = d * (float)((b[2 + j] >> 4) - 8);
    }
}

static void deq_q5_0(const uint8_t *b, float *y) {
    const float d = qk_f16_at(b);
    const uint32_t qh = qk_rd32(b + 2);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)(((b[6 + j] & 15) | (int)((qh >> j) & 1) << 4) - 16);
        y[j + 16] = d * (float)(((b[6 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4) - 16);
    }
}

static void deq_q5_1(const uint8_t *b, float *y) {
    const float d = qk_f16_at(b), m = qk_f16_at(b + 2);
    const uint32_t qh = qk_rd32(b + 4);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)((b[8 + j] & 15) | (int)((qh >> j) & 1) << 4) + m;
        y[j + 16] = d * (float)((b[8 + j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4) + m;
    }
}

static void deq_iq4_nl(const uint8_t *b, float *y) {
    const float d = qk_f16_at(b);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)QK_KV_IQ4NL[b[2 + j] & 15];
        y[j + 16] = d * (float)QK_KV_IQ4NL[b[2 + j] >> 4];
    }
}

static void deq_q8_0(const uint8_t *b, float *y) {
    const float d = qk_f16_at(b);
    for (int j = 0; j < 32; j++) y[j] = d * (float)(int8_t)b[2 + j];
}

static void deq_mxfp4(const uint8_t *b, float *y) {
    const float d = qk_e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)QK_KV_MXFP4[b[1 + j] & 15];
        y[j + 16] = d * (float)QK_KV_MXFP4[b[1 + j] >> 4];
    }
}

static void deq_iq4_xs(const uint8_t *b, float *y) {
    const float d = qk_f16_at(b);
    const uint16_t sh = qk_rd16(b + 2);
    for (int s = 0; s < 8; s++, y += 32) {
        const float dl = d * (float)((((b[4 + s / 2] >> (4 * (s % 2))) & 15) | (((sh >> (2 * s)) & 3) << 4)) - 32);
        const uint8_t *qs = b + 8 + 16 * s;
        for (int j = 0; j < 16; j++) {
            y[j] = dl * (float)QK_KV_IQ4NL[qs[j] & 15];
            y[j + 16] = dl * (float)QK_KV_IQ4NL[qs[j] >> 4];
        }
    }
}

/* Q4_K and Q5_K: value = (d * sc) * q - (dmin * m), per 32-element sub-block; hb: Q5_K's fifth bits. */
static void deq_q45_k(const uint8_t *b, float *y, const uint8_t *qs, const uint8_t *hb) {
    const float d = qk_f16_at(b), dmin = qk_f16_at(b + 2);
    uint8_t sc[8], m[8];
    qk_unpack_q4k_scales(b + 4, sc, m);
    for (int s = 0; s < 8; s++, y += 32) {
        const float d1 = d * (float)sc[s], m1 = dmin * (float)m[s];
        const uint8_t *q = qs + 32 * (s / 2);
        for (int j = 0; j < 32; j++) {
            int v = s % 2 ? q[j] >> 4 : q[j] & 15;
            if (hb) v |= ((hb[j] >> s) & 1) << 4;
            y[j] = d1 * (float)v - m1;
        }
    }
}

static void deq_q4_k(const uint8_t *b, float *y) { deq_q45_k(b, y, b + 16, NULL); }
static void deq_q5_k(const uint8_t *b, float *y) { deq_q45_k(b, y, b + 48, b + 16); }

static void deq_q6_k(const uint8_t *b, float *y) {
    const float d = qk_f16_at(b + 208);
    const int8_t *scales = (const int8_t *)(b + 192);
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, r = e % 128, j = r % 64, k = r / 32;
        const int lo = (b[64 * h + j] >> (4 * (r / 64))) & 15;
        const int hi = (b[128 + 32 * h + r % 32] >> (2 * k)) & 3;
        y[e] = d * (float)scales[e / 16] * (float)((lo | hi << 4) - 32);
    }
}

static void deq_q3_k(const uint8_t *b, float *y) {
    const float d = qk_f16_at(b + 108);
    uint32_t sw[4];
    qk_q3k_scales(b + 96, sw);
    const uint8_t *sc = (const uint8_t *)sw;
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, k = e % 128 / 32, j = e % 32;
        const int q = ((b[32 + 32 * h + j] >> (2 * k)) & 3) - (((b[j] >> (4 * h + k)) & 1) ? 0 : 4);
        y[e] = d * (float)(sc[e / 16] - 32) * (float)q;
    }
}

typedef void (*deq_fn)(const uint8_t *block, float *out);
static const deq_fn DEQ[QT_COUNT] = {
    [QT_Q4_0] = deq_q4_0, [QT_Q5_0] = deq_q5_0, [QT_Q8_0] = deq_q8_0, [QT_MXFP4] = deq_mxfp4, [QT_Q4_K] = deq_q4_k,
    [QT_Q5_K] = deq_q5_k, [QT_Q6_K] = deq_q6_k, [QT_IQ4_XS] = deq_iq4_xs, [QT_Q5_1] = deq_q5_1,
    [QT_IQ4_NL] = deq_iq4_nl, [QT_Q3_K] = deq_q3_k,
};

int qk_dequant_rows(int ggml, const uint8_t *w, int64_t N, int64_t K, const int64_t *rows, int64_t n, float *out) {
    const int qt = qk_qtype_index(ggml);
    if (qt < 0 || !DEQ[qt]) return QK_ETYPE; /* GGUF layouts only: interleaved rows are not looked up */
    const qtype_info *ti = &QK_TYPES[qt];
    if (K < 1 || K % ti->blk_elems) return QK_ESHAPE;
    const int64_t nb = K / ti->blk_elems, row_bytes = nb * ti->blk_bytes;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= N) return QK_EIDS;
    for (int64_t i = 0; i < n; i++)
        for (int64_t blk = 0; blk < nb; blk++)
            DEQ[qt](w + rows[i] * row_bytes + blk * ti->blk_bytes, out + i * K + blk * ti->blk_elems);
    return QK_OK;
}

/* qk_dequant_rows on the thread pool, DEQ_ROWS rows an item (each row written by one thread: the same values): for
 * whole matrices (the float copies of MLA's W_UK / W_UV at load). Never from inside a pool job. */
#define DEQ_ROWS 64

typedef struct {
    int ggml;
    const uint8_t *w;
    int64_t N, K, n;
    const int64_t *rows;
    float *out;
    atomic_long next;
} deq_ctx;

static void deq_task(void *p, int tid, int nth) {
    deq_ctx *c = p;
    (void)tid, (void)nth;
    for (int64_t it; (it = atomic_fetch_add(&c->next, 1)) * DEQ_ROWS < c->n;) {
        const int64_t r0 = it * DEQ_ROWS, m = c->n - r0 < DEQ_ROWS ? c->n - r0 : DEQ_ROWS;
        qk_dequant_rows(c->ggml, c->w, c->N, c->K, c->rows + r0, m, c->out + r0 * c->K);
    }
}

int qk_dequant_rows_mt(int ggml, const uint8_t *w, int64_t N, int64_t K, const int64_t *rows, int64_t n, float *out) {
    if (n <= DEQ_ROWS) return qk_dequant_rows(ggml, w, N, K, rows, n, out);
    const int rc = qk_dequant_rows(ggml, w, N, K, rows, 0, out); /* the type and the shape */
    if (rc) return rc;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= N) return QK_EIDS;
    deq_ctx c = {.ggml = ggml, .w = w, .N = N, .K = K, .n = n, .rows = rows, .out = out};
    atomic_init(&c.next, 0);
    qk_pool_run(deq_task, &c);
    return QK_OK;
}
