/* AVX2 activation quantizers: f32 -> act_q8k / act_q8_0 (formats in qk.h). They produce the same
 * bytes as the portable ones in dot_scalar.c (same float operations, default rounding mode). Both x86
 * kernel sets use them. */
#include "x86_common.h"

#if QK_X86

/* 32 floats -> 32 int8 = round-half-even(x * id) (the default MXCSR rounding), order kept. */
QK_AVX2_INLINE __m256i quant32(const float *x, __m256 id) {
    const __m256i i0 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), id));
    const __m256i i1 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8), id));
    const __m256i i2 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 16), id));
    const __m256i i3 = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 24), id));
    /* The packs work per 128-bit lane; the permute puts the 4-byte groups back in order. */
    const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(i0, i1), _mm256_packs_epi32(i2, i3));
    return _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}

QK_AVX2_INLINE __m256 absmax8(const float *x, int n, __m256 m) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int j = 0; j < n; j += 8) m = _mm256_max_ps(m, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + j)));
    return m;
}

QK_AVX2_INLINE float hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

QK_AVX2 void qk_quant_q8_0_avx2(const float *x, void *out, int64_t k) {
    act_q8_0 *y = out;
    for (int64_t i = 0; i < k / 32; i++, x += 32) {
        const float amax = hmax(absmax8(x, 32, _mm256_setzero_ps()));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        y[i].d = amax / 127.0f;
        const __m256i q = quant32(x, _mm256_set1_ps(id));
        _mm256_storeu_si256((__m256i *)y[i].qs, q);
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q), _mm256_set1_epi16(1));
        const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4e));
        y[i].s = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xb1)));
    }
}

QK_AVX2 void qk_quant_q8k_avx2(const float *x, void *out, int64_t k) {
    act_q8k *y = out;
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < k / 256; i++, x += 256) {
        const float amax = hmax(absmax8(x, 256, _mm256_setzero_ps()));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        y[i].d = amax / 127.0f;
        const __m256 vid = _mm256_set1_ps(id);
        __m256i s4[8]; /* per 32 values: 8 int32 lanes, each the sum of 4 consecutive values */
        for (int j = 0; j < 8; j++) {
            const __m256i q = quant32(x + 32 * j, vid);
            _mm256_storeu_si256((__m256i *)(y[i].qs + 32 * j), q);
            const __m256i p = _mm256_maddubs_epi16(ones8, q); /* pair sums (1 unsigned, q signed) */
            s4[j] = _mm256_madd_epi16(p, ones16);
        }
        /* Lanes 0-3 of s4[j] cover values 32j..32j+15, lanes 4-7 cover 32j+16..32j+31. */
        for (int j = 0; j < 8; j++) {
            int32_t l[8];
            _mm256_storeu_si256((__m256i *)l, s4[j]);
            y[i].bsums[2 * j] = (int16_t)(l[0] + l[1] + l[2] + l[3]);
            y[i].bsums[2 * j + 1] = (int16_t)(l[4] + l[5] + l[6] + l[7]);
        }
    }
}

#endif
