/* Q6_K_R8 (qk.h): one block repacked from 8 Q6_K blocks and back, and its portable dot. The repack moves each
 * weight's low four and top two bits into the R8 block's words; it is exact on any bytes, as r8.c's layouts are. */
#include <string.h>

#include "qk.h"

#define Q6K_BYTES 210

/* A Q6_K block (qk.h) from its 256 6-bit values: element 128h + 64t + j (j < 64) keeps its low four bits in ql
 * byte 64h + j (the high nibble where t = 1) and its top two in qh byte 32h + j % 32, bits 2 (j / 32) + 4t. */
static void q6k_store(const uint8_t q[256], uint8_t *blk) {
    memset(blk + 128, 0, 64);
    for (int h = 0; h < 2; h++)
        for (int j = 0; j < 64; j++) {
            const int k = j / 32;
            blk[64 * h + j] = (uint8_t)((q[128 * h + j] & 15) | (q[128 * h + 64 + j] & 15) << 4);
            blk[128 + 32 * h + j % 32] |= (uint8_t)((q[128 * h + j] >> 4) << (2 * k) | (q[128 * h + 64 + j] >> 4) << (2 * k + 4));
        }
}

/* Q6_K_R8 (qk.h): element e of row r sits in ql vector c % 32 (c = e / 4; high nibble for c >= 32) and in qh vector
 * m = c % 32 / 2, bit pair c % 2 + 2 (c >= 32), each at 4r + e % 4; -> the two vectors' byte offsets in the block. */
static void q6r8_place(int e, int *ql_at, int *nib, int *qh_at, int *pair) {
    const int c = e / 4, m = c % 32 / 2; /* W_c */
    *ql_at = 144 + 96 * m + 32 * (c % 2);
    *nib = c >= 32;
    *qh_at = 144 + 96 * m + 64;
    *pair = c % 2 + 2 * (c >= 32);
}

/* W_m's three words of row r straight from the Q6_K block's ql and qh words: its groups c = 2m, 2m + 1 (elements 8m..
 * 8m + 7) and 2m + 32, 2m + 33 (128 on) are, for m = 8t + m', ql bytes 8m'.. of each half shifted by 4t, and qh bytes
 * 8m' % 32.. of each half shifted by 2 (8m' / 32) + 4t (q6k_store's layout read a word at a time: going through
 * the 256 values held the repack to 1 GB/s). */
void qk_q6r8_pack_block(const uint8_t *const src[8], uint8_t *b) {
    for (int r = 0; r < 8; r++) {
        const uint8_t *ql = src[r], *qh = src[r] + 128;
        memcpy(b + 2 * r, src[r] + 208, 2);
        for (int s = 0; s < 16; s++) b[16 + 16 * (s / 2) + 2 * r + s % 2] = src[r][192 + s];
#pragma GCC unroll 16
        for (int m = 0; m < 16; m++) { /* unrolled: every shift a constant */
            const int t = m / 8, j = 8 * (m % 8), sh = 2 * (j / 32) + 4 * t;
            uint32_t n[4], h[4];
            for (int w = 0; w < 4; w++) { /* w: group 2m + w % 2 of half w / 2 */
                n[w] = qk_rd32(ql + 64 * (w / 2) + j + 4 * (w % 2)) >> 4 * t & 0x0f0f0f0fu;
                h[w] = qk_rd32(qh + 32 * (w / 2) + j % 32 + 4 * (w % 2)) >> sh & 0x03030303u;
            }
            const uint32_t lo0 = n[0] | n[2] << 4, lo1 = n[1] | n[3] << 4, hi = h[0] | h[1] << 2 | h[2] << 4 | h[3] << 6;
            memcpy(b + 144 + 96 * m + 4 * r, &lo0, 4);
            memcpy(b + 144 + 96 * m + 32 + 4 * r, &lo1, 4);
            memcpy(b + 144 + 96 * m + 64 + 4 * r, &hi, 4);
        }
    }
}

/* Row r's 6-bit value of element e in a Q6_K_R8 block. */
static int q6r8_value(const uint8_t *b, int r, int e) {
    int lo, nib, hi, pair;
    q6r8_place(e, &lo, &nib, &hi, &pair);
    return (b[lo + 4 * r + e % 4] >> (4 * nib) & 15) | (b[hi + 4 * r + e % 4] >> (2 * pair) & 3) << 4;
}

void qk_q6r8_unpack_block(const uint8_t *b, uint8_t *const dst[8]) {
    for (int r = 0; r < 8; r++) {
        uint8_t q[256];
        for (int e = 0; e < 256; e++) q[e] = (uint8_t)q6r8_value(b, r, e);
        q6k_store(q, dst[r]);
        for (int s = 0; s < 16; s++) dst[r][192 + s] = b[16 + 16 * (s / 2) + 2 * r + s % 2];
        memcpy(dst[r] + 208, b + 2 * r, 2);
    }
}

/* Portable Q6_K_R8 dot: out[8t + r] = sum_i y.d * d_r * (sum_s sc * (q . y)_s - 32 sum_s sc * bsum_s), the integer
 * sums as the x86 kernels. */
void qk_dot_scalar_q6_k_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        float acc[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 8 * Q6K_BYTES;
            for (int r = 0; r < 8; r++) {
                int32_t isum = 0, bias = 0;
                for (int s = 0; s < 16; s++) {
                    const int sc = (int8_t)b[16 + 16 * (s / 2) + 2 * r + s % 2];
                    int32_t sub = 0;
                    for (int e = 16 * s; e < 16 * s + 16; e++) sub += q6r8_value(b, r, e) * x[i].qs[e];
                    isum += sc * sub;
                    bias += sc * x[i].bsums[s];
                }
                acc[r] += x[i].d * qk_f16_at(b + 2 * r) * (float)(isum - 32 * bias);
            }
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = acc[r];
    }
}
