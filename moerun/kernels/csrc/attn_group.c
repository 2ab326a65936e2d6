/* Decode attention of one GQA group on AVX-512: the g query heads that share a key/value head read each key and value
 * row once for all of them, eight heads at a time (attn.c's per-head loops read every row g times and sum each score
 * across its lanes alone; issue 36: 6.7 ns a head and key on Zen 5 at 2,048 keys).
 *
 * Scores: per key, eight zmm accumulators (one per head) over the row's 16-value chunks, then one 8-way reduction,
 * stored key-major (s[j * 8 + head]); the softmax runs on those rows with one lane per head; the weighted sum takes
 * 32 output values of all eight heads per pass over the values (16 accumulators). Heads past g in the last eight
 * repeat head 0 and are not written. The sums run in a different order from the per-head loops (a few ulp apart).
 * Caches of float32, float16 or Q8_0 (each 16 values scaled as they load). */
#define QK_VNNI 1
#include "x86_common.h"

#include <math.h>

#include "attn_core.h"

#if QK_X86

/* Values c..c+15 of a cache row of kind `kind` (a Q8_0 row: blocks of an f16 scale and 32 int8, c a multiple of 16). */
QK_AVX2_INLINE __m512 ag_load(const uint8_t *row, int64_t c, int kind) {
    if (kind == KV_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + 2 * c)));
    if (kind == KV_F32) return _mm512_loadu_ps((const float *)row + c);
    const uint8_t *b = row + c / 32 * 34;
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + c % 32))));
    return _mm512_mul_ps(v, _mm512_set1_ps(qk_f16_at(b)));
}

/* The sums of eight zmm, lane i the sum of a[i]. */
QK_AVX2_INLINE __m256 ag_sum8(const __m512 *a) {
    __m256 h[8];
    for (int i = 0; i < 8; i++)
        h[i] = _mm256_add_ps(_mm512_castps512_ps256(a[i]),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a[i]), 1)));
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(h[0], h[1]), _mm256_hadd_ps(h[2], h[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(h[4], h[5]), _mm256_hadd_ps(h[6], h[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* A row AG_AHEAD keys ahead, into L1. */
QK_AVX2_INLINE void ag_ahead(const uint8_t *row, int64_t bytes) {
    for (int64_t o = 0; o < bytes; o += 64) _mm_prefetch((const char *)row + o, _MM_HINT_T0);
}

/* Heads q[i * D ..] for i < hc (<= 8) over n keys: s[j * 8 + i] = exp(scale * q_i . k_j - max_i); returns each
 * head's 1 / sum (the sink's share in the sum where sinks is given). */
QK_AVX2_INLINE __m256 ag_softmax(float *s, const float *q, int hc, int64_t n, const uint8_t *kbase, const int64_t *slot,
                                 int64_t stride, int64_t D, int kind, float scale, const float *sinks) {
    const float *qh[8];
    for (int i = 0; i < 8; i++) qh[i] = q + (i < hc ? i : 0) * D;
    const int64_t rb = qk_kind_bytes(kind, D);
    __m256 m = _mm256_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *k = kbase + slot[j] * stride;
        if (j + AG_AHEAD < n) ag_ahead(kbase + slot[j + AG_AHEAD] * stride, rb);
        __m512 a[8];
        for (int i = 0; i < 8; i++) a[i] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
            const __m512 kv = ag_load(k, c, kind);
            for (int i = 0; i < 8; i++) a[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qh[i] + c), kv, a[i]);
        }
        const __m256 sj = _mm256_mul_ps(ag_sum8(a), _mm256_set1_ps(scale));
        _mm256_storeu_ps(s + 8 * j, sj);
        m = _mm256_max_ps(m, sj);
    }
    float mx[8], sk[8];
    _mm256_storeu_ps(mx, m);
    for (int i = 0; i < 8; i++) {
        sk[i] = sinks && i < hc ? sinks[i] : -INFINITY;
        if (sk[i] > mx[i]) mx[i] = sk[i];
    }
    m = _mm256_loadu_ps(mx);
    __m256 sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + 8 * j), m));
        _mm256_storeu_ps(s + 8 * j, e);
        sum = _mm256_add_ps(sum, e);
    }
    float sm[8];
    _mm256_storeu_ps(sm, sum);
    for (int i = 0; i < 8; i++) sm[i] = 1.0f / (sm[i] + (sk[i] > -INFINITY ? expf(sk[i] - mx[i]) : 0.0f));
    return _mm256_loadu_ps(sm);
}

/* out[i * D ..] = inv_i * sum_j p[j * 8 + i] v_j (the first D values of each row, a row rb bytes) for i < hc, 32
 * values at a time (D % 16 == 0: the last pass may take 16). */
QK_AVX2_INLINE void ag_wsum(float *out, const float *p, __m256 inv, int hc, int64_t n, const uint8_t *vbase,
                            const int64_t *slot, int64_t stride, int64_t D, int64_t rb, int kind) {
    float iv[8];
    _mm256_storeu_ps(iv, inv);
    for (int64_t d = 0; d < D; d += 32) {
        const int two = d + 32 <= D;
        __m512 a[8][2];
        for (int i = 0; i < 8; i++) a[i][0] = a[i][1] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *v = vbase + slot[j] * stride;
            if (d == 0 && j + AG_AHEAD < n) ag_ahead(vbase + slot[j + AG_AHEAD] * stride, rb);
            const __m512 v0 = ag_load(v, d, kind), v1 = two ? ag_load(v, d + 16, kind) : _mm512_setzero_ps();
            for (int i = 0; i < 8; i++) {
                const __m512 b = _mm512_set1_ps(p[8 * j + i]);
                a[i][0] = _mm512_fmadd_ps(b, v0, a[i][0]);
                a[i][1] = _mm512_fmadd_ps(b, v1, a[i][1]);
            }
        }
        for (int i = 0; i < hc; i++) {
            const __m512 w = _mm512_set1_ps(iv[i]);
            _mm512_storeu_ps(out + i * D + d, _mm512_mul_ps(a[i][0], w));
            if (two) _mm512_storeu_ps(out + i * D + d + 16, _mm512_mul_ps(a[i][1], w));
        }
    }
}

__attribute__((target(QK_TARGET))) void qk_attn_group_vnni(float *out, const float *q, int64_t g, int64_t n,
                                                             const uint8_t *kbase, const uint8_t *vbase,
                                                             const int64_t *slot, int64_t kstride, int64_t vstride,
                                                             int64_t D, int64_t Dv, int kkind, int vkind,
                                                             float scale, const float *sinks, float *s) {
    for (int64_t h0 = 0; h0 < g; h0 += 8) {
        const int hc = g - h0 < 8 ? (int)(g - h0) : 8;
        const __m256 inv = ag_softmax(s, q + h0 * D, hc, n, kbase, slot, kstride, D, kkind, scale,
                                      sinks ? sinks + h0 : NULL);
        ag_wsum(out + h0 * Dv, s, inv, hc, n, vbase, slot, vstride, Dv, qk_kind_bytes(vkind, Dv), vkind);
    }
}

#endif
