/* The interleaved Q4_K_R8 layout (qk.h): repacking from and back to GGUF's Q4_K, and the portable dot.
 *
 * qk_repack and qk_unpack are exact inverses on any bytes (the 12-byte packed scales map one to one onto
 * the 6-bit values), so a repacked tensor holds the file's weights, only in another order. */
#include <stdatomic.h>
#include <string.h>

#include "matmul.h"
#include "pool.h"
#include "qk.h"

#define Q4K_BYTES 144
#define R8_BYTES (8 * Q4K_BYTES)

/* The four 32-value scale vectors of an R8 block (layout: qk.h). */
void qk_r8_vectors(const uint8_t *b, uint8_t v[4][32]) {
    for (int j = 0; j < 32; j++) {
        const uint8_t hi = b[96 + j];
        v[0][j] = (uint8_t)((b[32 + j] & 15) | (hi & 3) << 4);
        v[1][j] = (uint8_t)((b[32 + j] >> 4) | (hi >> 2 & 3) << 4);
        v[2][j] = (uint8_t)((b[64 + j] & 15) | (hi >> 4 & 3) << 4);
        v[3][j] = (uint8_t)((b[64 + j] >> 4) | (hi >> 6) << 4);
    }
}

/* Row r's scale and min of sub-block s, from the vectors. */
static int r8_sc(uint8_t v[4][32], int r, int s) { return v[s / 4][8 * (s % 4) + r]; }
static int r8_m(uint8_t v[4][32], int r, int s) { return v[2 + s / 4][16 * (s / 2 % 2) + 2 * r + s % 2]; }

/* One R8 block from 8 Q4_K blocks (src[r]: row r's block). */
static void r8_pack_block(const uint8_t *const src[8], uint8_t *b) {
    uint8_t v[4][32];
    for (int r = 0; r < 8; r++) {
        uint8_t sc[8], m[8];
        memcpy(b + 2 * r, src[r], 2);
        memcpy(b + 16 + 2 * r, src[r] + 2, 2);
        qk_unpack_q4k_scales(src[r] + 4, sc, m);
        for (int s = 0; s < 8; s++) {
            v[s / 4][8 * (s % 4) + r] = sc[s];
            v[2 + s / 4][16 * (s / 2 % 2) + 2 * r + s % 2] = m[s];
        }
        for (int g = 0; g < 4; g++)
            for (int c = 0; c < 8; c++) memcpy(b + 128 + 256 * g + 32 * c + 4 * r, src[r] + 16 + 32 * g + 4 * c, 4);
    }
    for (int j = 0; j < 32; j++) {
        b[32 + j] = (uint8_t)((v[0][j] & 15) | (v[1][j] & 15) << 4);
        b[64 + j] = (uint8_t)((v[2][j] & 15) | (v[3][j] & 15) << 4);
        b[96 + j] = (uint8_t)(v[0][j] >> 4 | (v[1][j] >> 4) << 2 | (v[2][j] >> 4) << 4 | (v[3][j] >> 4) << 6);
    }
}

/* The 8 Q4_K blocks (dst[r]) of an R8 block. */
static void r8_unpack_block(const uint8_t *b, uint8_t *const dst[8]) {
    uint8_t v[4][32];
    qk_r8_vectors(b, v);
    for (int r = 0; r < 8; r++) {
        uint8_t *o = dst[r];
        memcpy(o, b + 2 * r, 2);
        memcpy(o + 2, b + 16 + 2 * r, 2);
        for (int j = 0; j < 4; j++) { /* the 12-byte packing of qk_unpack_q4k_scales, inverted */
            const int sl = r8_sc(v, r, j), sh = r8_sc(v, r, j + 4), ml = r8_m(v, r, j), mh = r8_m(v, r, j + 4);
            o[4 + j] = (uint8_t)(sl | (sh >> 4) << 6);
            o[8 + j] = (uint8_t)(ml | (mh >> 4) << 6);
            o[12 + j] = (uint8_t)((sh & 15) | (mh & 15) << 4);
        }
        for (int g = 0; g < 4; g++)
            for (int c = 0; c < 8; c++) memcpy(o + 16 + 32 * g + 4 * c, b + 128 + 256 * g + 32 * c + 4 * r, 4);
    }
}

static int r8_shape(int to, int64_t N, int64_t K) {
    if (to != GGML_Q4_K_R8) return QK_ETYPE;
    if (N < 8 || N % 8 || K < 256 || K % 256) return QK_ESHAPE;
    return QK_OK;
}

/* Groups of 8 rows are independent: the pool's threads take runs of them (a model's worth of Q4_K is
 * gigabytes, rewritten once at load). */
#define GROUPS_PER_ITEM 64

typedef struct {
    const uint8_t *src;
    uint8_t *dst;
    int64_t groups, nb;
    int pack;
    atomic_long next;
} relayout_ctx;

static void relayout_task(void *p, int tid, int nth) {
    relayout_ctx *c = p;
    (void)tid, (void)nth;
    const int64_t rowb = c->nb * Q4K_BYTES;
    for (;;) {
        const int64_t g0 = atomic_fetch_add(&c->next, GROUPS_PER_ITEM);
        if (g0 >= c->groups) break;
        for (int64_t g = g0; g < g0 + GROUPS_PER_ITEM && g < c->groups; g++)
            for (int64_t i = 0; i < c->nb; i++) {
                uint8_t *rows[8];
                for (int r = 0; r < 8; r++)
                    rows[r] = (uint8_t *)(c->pack ? c->src : c->dst) + (8 * g + r) * rowb + i * Q4K_BYTES;
                if (c->pack)
                    r8_pack_block((const uint8_t *const *)rows, c->dst + (g * c->nb + i) * R8_BYTES);
                else
                    r8_unpack_block(c->src + (g * c->nb + i) * R8_BYTES, rows);
            }
    }
}

static int relayout(int type, const uint8_t *src, uint8_t *dst, int64_t N, int64_t K, int pack) {
    const int rc = r8_shape(type, N, K);
    if (rc) return rc;
    relayout_ctx c = {src, dst, N / 8, K / 256, pack, 0};
    qk_pool_run(relayout_task, &c); /* without workers it ran on this thread: done either way */
    return QK_OK;
}

int qk_repack(int to, const uint8_t *src, uint8_t *dst, int64_t N, int64_t K) {
    return relayout(to, src, dst, N, K, 1);
}

int qk_unpack(int from, const uint8_t *src, uint8_t *dst, int64_t N, int64_t K) {
    return relayout(from, src, dst, N, K, 0);
}

/* Portable dot of 8 interleaved rows: out[8t + r] = sum_i y.d * (d_r * sum_s sc * (q . y)_s - dmin_r *
 * sum_s m * bsum_s), the integer sums exact as in the x86 kernels. */
void qk_dot_scalar_q4_k_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        float acc[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * R8_BYTES;
            uint8_t v[4][32];
            qk_r8_vectors(b, v);
            for (int r = 0; r < 8; r++) {
                int32_t isum = 0, msum = 0;
                for (int s = 0; s < 8; s++) {
                    const int g = s / 2, shift = 4 * (s % 2);
                    int32_t sub = 0;
                    for (int e = 0; e < 32; e++) {
                        const int c = e / 4, k = e % 4;
                        sub += ((b[128 + 256 * g + 32 * c + 4 * r + k] >> shift) & 15) * x[i].qs[32 * s + e];
                    }
                    isum += r8_sc(v, r, s) * sub;
                    msum += r8_m(v, r, s) * (x[i].bsums[2 * s] + x[i].bsums[2 * s + 1]);
                }
                acc[r] += x[i].d * (qk_f16_at(b + 2 * r) * (float)isum - qk_f16_at(b + 16 + 2 * r) * (float)msum);
            }
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = acc[r];
    }
}
