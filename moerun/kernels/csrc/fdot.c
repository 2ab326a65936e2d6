/* Row dot products for float weights (F32 and F16 rows) against float activations, in the dot_fn
 * shape of qk.h (nb = elements per row, x[t] = a float row). They serve the small float matrices of a
 * quantized model on the fused decode path (the router, kept F32 by llama.cpp's mixes) and float
 * models there; prefill of float weights stays with torch's GEMM. */
#include "qk.h"

static void fdot_f32_scalar(int64_t n, const uint8_t *w8, const void *const *x, int nt, float *out) {
    const float *w = (const float *)(const void *)w8;
    for (int t = 0; t < nt; t++) {
        const float *y = x[t];
        float acc[8] = {0};
        int64_t i = 0;
        for (; i + 8 <= n; i += 8)
            for (int j = 0; j < 8; j++) acc[j] += w[i + j] * y[i + j];
        float s = 0.0f;
        for (; i < n; i++) s += w[i] * y[i];
        for (int j = 0; j < 8; j++) s += acc[j];
        out[t] = s;
    }
}

static void fdot_f16_scalar(int64_t n, const uint8_t *w, const void *const *x, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const float *y = x[t];
        float s = 0.0f;
        for (int64_t i = 0; i < n; i++) s += qk_f16_at(w + 2 * i) * y[i];
        out[t] = s;
    }
}

static const dot_fn FDOT_SCALAR[FT_COUNT] = {[FT_F32] = fdot_f32_scalar, [FT_F16] = fdot_f16_scalar};

#if QK_X86
#include "x86_common.h"

/* 16 weights per step (two 8-lane accumulators per token); the tail is summed in scalar order. */
#define FDOT_BODY(LOADW, ELEM, ES, n, w, x, NT, out)                                            \
    do {                                                                                        \
        __m256 a0[NT], a1[NT];                                                                  \
        const float *y[NT];                                                                     \
        for (int t = 0; t < NT; t++) {                                                          \
            a0[t] = a1[t] = _mm256_setzero_ps();                                                \
            y[t] = x[t];                                                                        \
        }                                                                                       \
        int64_t i = 0;                                                                          \
        for (; i + 16 <= n; i += 16) {                                                          \
            _mm_prefetch((const char *)(w) + (ES) * i + QK_PREFETCH_AHEAD, _MM_HINT_T0);        \
            const __m256 w0 = LOADW(w, i), w1 = LOADW(w, i + 8);                                \
            for (int t = 0; t < NT; t++) {                                                      \
                a0[t] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(y[t] + i), a0[t]);                  \
                a1[t] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(y[t] + i + 8), a1[t]);              \
            }                                                                                   \
        }                                                                                       \
        for (int t = 0; t < NT; t++) {                                                          \
            float s = avx2_hsum(_mm256_add_ps(a0[t], a1[t]));                                   \
            for (int64_t j = i; j < n; j++) s += ELEM(w, j) * y[t][j];                          \
            out[t] = s;                                                                         \
        }                                                                                       \
    } while (0)

QK_AVX2_INLINE __m256 load_f32(const uint8_t *w, int64_t i) { return _mm256_loadu_ps((const float *)(const void *)w + i); }
QK_AVX2_INLINE __m256 load_f16(const uint8_t *w, int64_t i) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(w + 2 * i)));
}

QK_AVX2_INLINE float elem_f32(const uint8_t *w, int64_t i) { float f; memcpy(&f, w + 4 * i, 4); return f; }
QK_AVX2_INLINE float elem_f16(const uint8_t *w, int64_t i) { return qk_f16_at(w + 2 * i); }

#define FDOT_F32(n, w, x, NT, out) FDOT_BODY(load_f32, elem_f32, 4, n, w, x, NT, out)
#define FDOT_F16(n, w, x, NT, out) FDOT_BODY(load_f16, elem_f16, 2, n, w, x, NT, out)

static QK_AVX2 void fdot_f32_avx2(int64_t n, const uint8_t *w, const void *const *x, int nt, float *out) {
    QK_NT_DISPATCH(FDOT_F32, n, w, x, nt, out)
}

static QK_AVX2 void fdot_f16_avx2(int64_t n, const uint8_t *w, const void *const *x, int nt, float *out) {
    QK_NT_DISPATCH(FDOT_F16, n, w, x, nt, out)
}

static const dot_fn FDOT_AVX2[FT_COUNT] = {[FT_F32] = fdot_f32_avx2, [FT_F16] = fdot_f16_avx2};
#endif

dot_fn qk_fdot(int isa, int ggml) {
    const int ft = ggml == GGML_F32 ? FT_F32 : ggml == GGML_F16 ? FT_F16 : -1;
    if (ft < 0 || !qk_kernels(isa)) return NULL;
#if QK_X86
    if (isa != ISA_SCALAR) return FDOT_AVX2[ft];
#endif
    return FDOT_SCALAR[ft];
}
