/* A quantized row dotted with a float vector exactly as fdot.c's AVX2 kernel dots that row dequantized: each
 * weight the value dequant.c gives (the same float operations), the products summed in 16 lanes, lane j over the
 * elements i = j (mod 16), then the lanes' halves added and summed as avx2_hsum sums them. So a matrix kept in its
 * file's type gives the float path's bits while reading its bytes, not four a weight: MLA's W_UK and W_UV (mla.c).
 * The blocks are dequantized in registers, 16 weights at a time (AVX-512); other CPUs and types have no kernel
 * here (qk_deq_fdot gives NULL) and the caller dots the dequantized row (qk_dequant_row) with qk_fdot. */
#include "qk.h"

#if QK_X86
#define QK_VNNI 1
#include "x86_common.h"

QK_AVX2_INLINE __m512 fma16(__m512 acc, __m512 w, const float *x) {
    return _mm512_fmadd_ps(w, _mm512_loadu_ps(x), acc);
}

QK_AVX2_INLINE __m512 i8_to_ps(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)); }
QK_AVX2_INLINE __m512 u8_to_ps(__m128i q) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q)); }

QK_AVX2_INLINE float finish(__m512 acc) {
    const __m256 lo = _mm512_castps512_ps256(acc);
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1));
    return avx2_hsum(_mm256_add_ps(lo, hi));
}

/* 32 weights as bytes: the low nibbles of qs[0..16) then their high nibbles (Q4_0 and Q5_0's order). */
QK_AVX2_INLINE __m256i nibbles32(const uint8_t *qs) {
    const __m128i q = _mm_loadu_si128((const __m128i *)(const void *)qs);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}

/* A block of 32 signed byte values times d, as d * (float)q. */
QK_AVX2_INLINE __m512 dot32(__m512 acc, __m256i q, float d, const float *x) {
    const __m512 vd = _mm512_set1_ps(d);
    acc = fma16(acc, _mm512_mul_ps(vd, i8_to_ps(_mm256_castsi256_si128(q))), x);
    return fma16(acc, _mm512_mul_ps(vd, i8_to_ps(_mm256_extracti128_si256(q, 1))), x + 16);
}

static QK_AVX2 void deq_dot_q4_0(int64_t n, const uint8_t *w, const float *x, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32, w += 18)
        acc = dot32(acc, _mm256_sub_epi8(nibbles32(w + 2), _mm256_set1_epi8(8)), qk_f16_at(w), x + i);
    *out = finish(acc);
}

static QK_AVX2 void deq_dot_q5_0(int64_t n, const uint8_t *w, const float *x, float *out) {
    __m512 acc = _mm512_setzero_ps();
    const __m256i sixteen = _mm256_set1_epi8(16);
    for (int64_t i = 0; i < n; i += 32, w += 22) {
        const __m256i q = nibbles32(w + 6);
        const __m256i q5 = _mm256_mask_add_epi8(q, (__mmask32)qk_rd32(w + 2), q, sixteen); /* the fifth bits */
        acc = dot32(acc, _mm256_sub_epi8(q5, sixteen), qk_f16_at(w), x + i);
    }
    *out = finish(acc);
}

static QK_AVX2 void deq_dot_q8_0(int64_t n, const uint8_t *w, const float *x, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 32, w += 34)
        acc = dot32(acc, _mm256_loadu_si256((const __m256i *)(const void *)(w + 2)), qk_f16_at(w), x + i);
    *out = finish(acc);
}

/* Q4_K and Q5_K (hb: the fifth bits): value = (d * sc) * q - dmin * m per 32-weight sub-block. */
QK_AVX2_INLINE __m512 dot_q45_k(__m512 acc, const uint8_t *b, const uint8_t *qs, const uint8_t *hb, const float *x) {
    const float d = qk_f16_at(b), dmin = qk_f16_at(b + 2);
    uint8_t sc[8], m[8];
    qk_unpack_q4k_scales(b + 4, sc, m);
    const __m256i low = _mm256_set1_epi8(15);
    const __m256i h = hb ? _mm256_loadu_si256((const __m256i *)(const void *)hb) : _mm256_setzero_si256();
    for (int s = 0; s < 8; s++, x += 32) {
        const __m256i q = _mm256_loadu_si256((const __m256i *)(const void *)(qs + 32 * (s / 2)));
        __m256i v = _mm256_and_si256(s % 2 ? _mm256_srli_epi16(q, 4) : q, low);
        if (hb) v = _mm256_mask_add_epi8(v, _mm256_test_epi8_mask(h, _mm256_set1_epi8((char)(1 << s))), v,
                                         _mm256_set1_epi8(16));
        const __m512 d1 = _mm512_set1_ps(d * (float)sc[s]), m1 = _mm512_set1_ps(dmin * (float)m[s]);
        acc = fma16(acc, _mm512_sub_ps(_mm512_mul_ps(d1, u8_to_ps(_mm256_castsi256_si128(v))), m1), x);
        acc = fma16(acc, _mm512_sub_ps(_mm512_mul_ps(d1, u8_to_ps(_mm256_extracti128_si256(v, 1))), m1), x + 16);
    }
    return acc;
}

static QK_AVX2 void deq_dot_q4_k(int64_t n, const uint8_t *w, const float *x, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 256, w += 144) acc = dot_q45_k(acc, w, w + 16, NULL, x + i);
    *out = finish(acc);
}

static QK_AVX2 void deq_dot_q5_k(int64_t n, const uint8_t *w, const float *x, float *out) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 256, w += 176) acc = dot_q45_k(acc, w, w + 48, w + 16, x + i);
    *out = finish(acc);
}

/* Q6_K: value = (d * scale) * (q - 32), q = low nibble | two high bits << 4; 16 weights a scale. */
static QK_AVX2 void deq_dot_q6_k(int64_t n, const uint8_t *w, const float *x, float *out) {
    __m512 acc = _mm512_setzero_ps();
    const __m128i low = _mm_set1_epi8(15), two = _mm_set1_epi8(3), bias = _mm_set1_epi8(32);
    for (int64_t i = 0; i < n; i += 256, w += 210) {
        const float d = qk_f16_at(w + 208);
        const int8_t *scales = (const int8_t *)(w + 192);
        for (int e = 0; e < 256; e += 16) {
            const int hh = e / 128, r = e % 128, k = r / 32;
            const __m128i lo = _mm_loadu_si128((const __m128i *)(const void *)(w + 64 * hh + r % 64));
            const __m128i hi = _mm_loadu_si128((const __m128i *)(const void *)(w + 128 + 32 * hh + r % 32));
            const __m128i l4 = _mm_and_si128(r / 64 ? _mm_srli_epi16(lo, 4) : lo, low);
            const __m128i h2 = _mm_and_si128(_mm_srl_epi16(hi, _mm_cvtsi32_si128(2 * k)), two);
            const __m128i q = _mm_sub_epi8(_mm_or_si128(l4, _mm_slli_epi16(h2, 4)), bias);
            acc = fma16(acc, _mm512_mul_ps(_mm512_set1_ps(d * (float)scales[e / 16]), i8_to_ps(q)), x + i + e);
        }
    }
    *out = finish(acc);
}
#endif

deq_dot_fn qk_deq_fdot(int isa, int ggml) {
#if QK_X86
    if (isa != ISA_VNNI || !qk_kernels(isa)) return NULL;
    switch (ggml) {
    case GGML_Q4_0: return deq_dot_q4_0;
    case GGML_Q5_0: return deq_dot_q5_0;
    case GGML_Q8_0: return deq_dot_q8_0;
    case GGML_Q4_K: return deq_dot_q4_k;
    case GGML_Q5_K: return deq_dot_q5_k;
    case GGML_Q6_K: return deq_dot_q6_k;
    default: return NULL;
    }
#else
    (void)isa, (void)ggml;
    return NULL;
#endif
}
