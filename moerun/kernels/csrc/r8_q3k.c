/* Q3_K_R8 (qk.h): one block repacked from 8 Q3_K blocks and back, and its portable dot. The repack copies 4-byte
 * pieces (a row's 4 consecutive hmask or qs bytes) and moves the 6-bit scales into Q4_K_R8's vectors, so it is exact
 * on any bytes, as r8.c's layouts are. */
#include <string.h>

#include "qk.h"

#define Q3K_BYTES 110

/* Where Q3_K_R8 keeps the 8 rows' hmask bytes 4v..4v + 3 (v < 8) and qs bytes 32h + 4v..+3 (h < 2). */
static int hm_at(int v) { return 112 + 32 * v; }
static int qs_at(int h, int v) { return 368 + 32 * (8 * h + v); }

/* A row's sixteen 6-bit scales, as bytes (qk_q3k_scales' order). */
static void row_scales(const uint8_t *blk, uint8_t sc[16]) {
    uint32_t w[4];
    qk_q3k_scales(blk + 96, w);
    memcpy(sc, w, 16);
}

void qk_q3r8_pack_block(const uint8_t *const src[8], uint8_t *b) {
    uint8_t v[4][32];
    for (int r = 0; r < 8; r++) {
        memcpy(b + 2 * r, src[r] + 108, 2);
        uint8_t sc[16];
        row_scales(src[r], sc);
        for (int s = 0; s < 16; s++) v[s / 4][8 * (s % 4) + r] = sc[s];
        for (int j = 0; j < 8; j++) memcpy(b + hm_at(j) + 4 * r, src[r] + 4 * j, 4);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 8; j++) memcpy(b + qs_at(h, j) + 4 * r, src[r] + 32 + 32 * h + 4 * j, 4);
    }
    qk_r8_pack_vectors(v, b + 16);
}

/* The 8 rows' scales of an R8 block: sc[r][s]. */
static void r8_row_scales(const uint8_t *b, uint8_t sc[8][16]) {
    uint8_t v[4][32];
    qk_r8_vectors(b + 16, v);
    for (int j = 0; j < 128; j++) sc[j % 8][j / 8] = v[j / 32][j % 32]; /* vector m's byte i: row i % 8, sub-block 4m + i / 8 */
}

void qk_q3r8_unpack_block(const uint8_t *b, uint8_t *const dst[8]) {
    uint8_t sc[8][16];
    r8_row_scales(b, sc);
    for (int r = 0; r < 8; r++) {
        uint8_t *o = dst[r];
        memcpy(o + 108, b + 2 * r, 2);
        for (int j = 0; j < 8; j++) o[96 + j] = (uint8_t)((sc[r][j] & 15) | (sc[r][j + 8] & 15) << 4);
        for (int j = 0; j < 4; j++)
            o[104 + j] = (uint8_t)(sc[r][j] >> 4 | (sc[r][j + 4] >> 4) << 2 | (sc[r][j + 8] >> 4) << 4 |
                                   (sc[r][j + 12] >> 4) << 6);
        for (int j = 0; j < 8; j++) memcpy(o + 4 * j, b + hm_at(j) + 4 * r, 4);
        for (int h = 0; h < 2; h++)
            for (int j = 0; j < 8; j++) memcpy(o + 32 + 32 * h + 4 * j, b + qs_at(h, j) + 4 * r, 4);
    }
}

/* out[8t + r] = dot of row r with token t: sum over sub-blocks of (scale - 32) * sum (q - 4 + 4 * third bit) * y. */
void qk_dot_scalar_q3_k_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        float sum[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 8 * Q3K_BYTES;
            uint8_t sc[8][16];
            r8_row_scales(b, sc);
            for (int r = 0; r < 8; r++) {
                int32_t isum = 0;
                for (int h = 0; h < 2; h++)
                    for (int k = 0; k < 4; k++)
                        for (int v = 0; v < 8; v++) {
                            const int8_t *y = x[i].qs + 128 * h + 32 * k + 4 * v;
                            int32_t s4 = 0;
                            for (int j = 0; j < 4; j++) {
                                const int q = (b[qs_at(h, v) + 4 * r + j] >> (2 * k)) & 3;
                                const int hb = (b[hm_at(v) + 4 * r + j] >> (4 * h + k)) & 1;
                                s4 += (q - (hb ? 0 : 4)) * y[j];
                            }
                            isum += (sc[r][8 * h + 2 * k + v / 4] - 32) * s4;
                        }
                sum[r] += x[i].d * qk_f16_at(b + 2 * r) * (float)isum;
            }
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = sum[r];
    }
}
