/* The attention half of a decoder layer for a few rows at once (see attn.h): the decode step's whole
 * pre-MoE work in one call, with the GIL released, instead of ~40 torch operations per layer.
 *
 * Matrix products go through qk_matmuls (q, k, v in one pool job; then o; then the router); attention
 * runs on the pool too, one work item per (row, KV head) covering that head's group of query heads.
 * Norms, biases, RoPE and routing are a few thousand floats per row and stay on the calling thread.
 * Every value is computed by one thread in a fixed order, so results do not depend on the thread count. */
#include "attn.h"
#include "attn_core.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "matmul.h"
#include "pool.h"
#include "qk.h"
#include "vexp.h"

/* ------------------------------------------------------------------ attention inner loops */


/* One row of n values into the cache's kind: floats, halves (round to nearest even), or Q8_0 blocks as
 * moerun.quant.quantize writes them (d = absmax / 127 as an f16; round(x / d) half away from zero, in
 * gguf.quants' float steps), so the C and the torch paths store the same bytes. */
static uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0)); /* inf, nan */
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* rounds past the largest half */
    if (ax < 0x38800000u) { /* a subnormal half (or 0): scale into its integer range, round to even */
        float a;
        memcpy(&a, &ax, 4);
        const float t = a * 0x1p24f;
        uint32_t m = (uint32_t)t;
        const float rem = t - (float)m;
        if (rem > 0.5f || (rem == 0.5f && (m & 1u))) m++;
        return (uint16_t)(sign | m);
    }
    uint32_t m = ax + 0xc8000000u; /* rebias the exponent by -112 */
    m += 0x0fffu + ((m >> 13) & 1u); /* round to nearest even */
    return (uint16_t)(sign | (m >> 13));
}

static float gguf_roundf(float v) {
    const float a = fabsf(v), fl = floorf(a);
    const float r = fl + floorf(2.0f * (a - fl));
    return v < 0 ? -r : r;
}

void qk_store_row(int kind, uint8_t *dst, const float *src, int64_t n) {
    if (kind == KV_F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else if (kind == KV_F16) {
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = f32_to_f16(src[i]);
            memcpy(dst + 2 * i, &h, 2);
        }
    } else {
        for (int64_t b = 0; b < n / 32; b++, dst += 34, src += 32) {
            float amax = 0.0f;
            for (int i = 0; i < 32; i++) amax = fabsf(src[i]) > amax ? fabsf(src[i]) : amax;
            const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
            const uint16_t h = f32_to_f16(d);
            memcpy(dst, &h, 2);
            for (int i = 0; i < 32; i++) dst[2 + i] = (uint8_t)(int8_t)gguf_roundf(src[i] * id);
        }
    }
}

static void scores_scalar(float *s, const float *q, int64_t n, const uint8_t *kbase, const int64_t *slot,
                          int64_t stride, int64_t D, float scale) {
    for (int64_t j = 0; j < n; j++) {
        const float *k = (const float *)(kbase + slot[j] * stride);
        float acc = 0.0f;
        for (int64_t i = 0; i < D; i++) acc += q[i] * k[i];
        s[j] = acc * scale;
    }
}

static float exp_sum_scalar(float *s, int64_t n, float max) {
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) sum += s[j] = expf(s[j] - max);
    return sum;
}

static void wsum_scalar(float *out, const float *p, int64_t n, const uint8_t *vbase, const int64_t *slot,
                        int64_t stride, int64_t D) {
    for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const float *v = (const float *)(vbase + slot[j] * stride);
        for (int64_t i = 0; i < D; i++) out[i] += p[j] * v[i];
    }
}

static void scores_f16_scalar(float *s, const float *q, int64_t n, const uint8_t *kbase, const int64_t *slot,
                              int64_t stride, int64_t D, float scale) {
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *k = kbase + slot[j] * stride;
        float acc = 0.0f;
        for (int64_t i = 0; i < D; i++) acc += q[i] * qk_f16_at(k + 2 * i);
        s[j] = acc * scale;
    }
}

static void wsum_f16_scalar(float *out, const float *p, int64_t n, const uint8_t *vbase, const int64_t *slot,
                            int64_t stride, int64_t D) {
    for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *v = vbase + slot[j] * stride;
        for (int64_t i = 0; i < D; i++) out[i] += p[j] * qk_f16_at(v + 2 * i);
    }
}

static void scores_q8_scalar(float *s, const float *q, int64_t n, const uint8_t *kbase, const int64_t *slot,
                             int64_t stride, int64_t D, float scale) {
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *k = kbase + slot[j] * stride;
        float acc = 0.0f;
        for (int64_t b = 0; b < D / 32; b++, k += 34) {
            float dot = 0.0f;
            for (int i = 0; i < 32; i++) dot += q[32 * b + i] * (float)(int8_t)k[2 + i];
            acc += qk_f16_at(k) * dot;
        }
        s[j] = acc * scale;
    }
}

static void wsum_q8_scalar(float *out, const float *p, int64_t n, const uint8_t *vbase, const int64_t *slot,
                           int64_t stride, int64_t D) {
    for (int64_t i = 0; i < D; i++) out[i] = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *v = vbase + slot[j] * stride;
        for (int64_t b = 0; b < D / 32; b++, v += 34) {
            const float w = p[j] * qk_f16_at(v);
            for (int i = 0; i < 32; i++) out[32 * b + i] += w * (float)(int8_t)v[2 + i];
        }
    }
}

static const attn_kernels ATTN_SCALAR = {{scores_scalar, scores_f16_scalar, scores_q8_scalar}, exp_sum_scalar,
                                         {wsum_scalar, wsum_f16_scalar, wsum_q8_scalar}, NULL};

#if QK_X86
#include "x86_common.h"

static QK_AVX2 void scores_avx2(float *s, const float *q, int64_t n, const uint8_t *kbase, const int64_t *slot,
                                int64_t stride, int64_t D, float scale) {
    for (int64_t j = 0; j < n; j++) {
        const float *k = (const float *)(kbase + slot[j] * stride);
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        int64_t i = 0;
        for (; i + 32 <= D; i += 32) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8), _mm256_loadu_ps(k + i + 8), a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 16), _mm256_loadu_ps(k + i + 16), a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 24), _mm256_loadu_ps(k + i + 24), a3);
        }
        for (; i + 8 <= D; i += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), a0);
        float acc = avx2_hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
        for (; i < D; i++) acc += q[i] * k[i];
        s[j] = acc * scale;
    }
}

static QK_AVX2 float exp_sum_avx2(float *s, int64_t n, float max) {
    const __m256 m = _mm256_set1_ps(max);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = avx2_hsum(acc);
    for (; j < n; j++) sum += s[j] = expf(s[j] - max);
    return sum;
}

/* 64 output floats at a time in eight accumulators; every v row is read once per chunk. */
static QK_AVX2 void wsum_avx2(float *out, const float *p, int64_t n, const uint8_t *vbytes, const int64_t *slot,
                              int64_t stride, int64_t D) {
    const float *vbase = (const float *)vbytes;
    stride /= (int64_t)sizeof(float);
    int64_t i = 0;
    for (; i + 64 <= D; i += 64) {
        __m256 a[8];
        for (int c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const float *v = vbase + slot[j] * stride + i;
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int c = 0; c < 8; c++) a[c] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * c), a[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + i + 8 * c, a[c]);
    }
    for (; i + 8 <= D; i += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(vbase + slot[j] * stride + i), a);
        _mm256_storeu_ps(out + i, a);
    }
    for (; i < D; i++) {
        float a = 0.0f;
        for (int64_t j = 0; j < n; j++) a += p[j] * vbase[slot[j] * stride + i];
        out[i] = a;
    }
}

/* Halves: 8 at a time through F16C. */
static QK_AVX2 void scores_f16_avx2(float *s, const float *q, int64_t n, const uint8_t *kbase, const int64_t *slot,
                                    int64_t stride, int64_t D, float scale) {
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *k = kbase + slot[j] * stride;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        int64_t i = 0;
        for (; i + 16 <= D; i += 16) {
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_cvtph_ps(_mm_loadu_si128((const void *)(k + 2 * i))),
                                 a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i + 8),
                                 _mm256_cvtph_ps(_mm_loadu_si128((const void *)(k + 2 * i + 16))), a1);
        }
        for (; i + 8 <= D; i += 8)
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_cvtph_ps(_mm_loadu_si128((const void *)(k + 2 * i))),
                                 a0);
        float acc = avx2_hsum(_mm256_add_ps(a0, a1));
        for (; i < D; i++) acc += q[i] * qk_f16_at(k + 2 * i);
        s[j] = acc * scale;
    }
}

static QK_AVX2 void wsum_f16_avx2(float *out, const float *p, int64_t n, const uint8_t *vbase, const int64_t *slot,
                                  int64_t stride, int64_t D) {
    int64_t i = 0;
    for (; i + 64 <= D; i += 64) { /* as wsum_avx2: eight accumulators, each v row read once per chunk */
        __m256 a[8];
        for (int c = 0; c < 8; c++) a[c] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *v = vbase + slot[j] * stride + 2 * i;
            const __m256 pj = _mm256_set1_ps(p[j]);
            for (int c = 0; c < 8; c++)
                a[c] = _mm256_fmadd_ps(pj, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(v + 16 * c))), a[c]);
        }
        for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + i + 8 * c, a[c]);
    }
    for (; i + 8 <= D; i += 8) {
        __m256 a = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++)
            a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]),
                                _mm256_cvtph_ps(_mm_loadu_si128((const void *)(vbase + slot[j] * stride + 2 * i))), a);
        _mm256_storeu_ps(out + i, a);
    }
    for (; i < D; i++) {
        float a = 0.0f;
        for (int64_t j = 0; j < n; j++) a += p[j] * qk_f16_at(vbase + slot[j] * stride + 2 * i);
        out[i] = a;
    }
}

/* 8 int8 of a Q8_0 block -> 8 floats. */
QK_AVX2_INLINE __m256 q8_8(const uint8_t *b) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)b)));
}

static QK_AVX2 void scores_q8_avx2(float *s, const float *q, int64_t n, const uint8_t *kbase, const int64_t *slot,
                                   int64_t stride, int64_t D, float scale) {
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *k = kbase + slot[j] * stride;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t b = 0; b < D / 32; b++, k += 34) {
            const float *qb = q + 32 * b;
            __m256 d0 = _mm256_mul_ps(_mm256_loadu_ps(qb), q8_8(k + 2));
            __m256 d1 = _mm256_mul_ps(_mm256_loadu_ps(qb + 8), q8_8(k + 10));
            d0 = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 16), q8_8(k + 18), d0);
            d1 = _mm256_fmadd_ps(_mm256_loadu_ps(qb + 24), q8_8(k + 26), d1);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(qk_f16_at(k)), _mm256_add_ps(d0, d1), acc);
        }
        s[j] = avx2_hsum(acc) * scale;
    }
}

static QK_AVX2 void wsum_q8_avx2(float *out, const float *p, int64_t n, const uint8_t *vbase, const int64_t *slot,
                                 int64_t stride, int64_t D) {
    for (int64_t b = 0; b < D / 32; b++) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t j = 0; j < n; j++) {
            const uint8_t *v = vbase + slot[j] * stride + 34 * b;
            const __m256 w = _mm256_set1_ps(p[j] * qk_f16_at(v));
            a0 = _mm256_fmadd_ps(w, q8_8(v + 2), a0);
            a1 = _mm256_fmadd_ps(w, q8_8(v + 10), a1);
            a2 = _mm256_fmadd_ps(w, q8_8(v + 18), a2);
            a3 = _mm256_fmadd_ps(w, q8_8(v + 26), a3);
        }
        _mm256_storeu_ps(out + 32 * b, a0);
        _mm256_storeu_ps(out + 32 * b + 8, a1);
        _mm256_storeu_ps(out + 32 * b + 16, a2);
        _mm256_storeu_ps(out + 32 * b + 24, a3);
    }
}

static const attn_kernels ATTN_AVX2 = {{scores_avx2, scores_f16_avx2, scores_q8_avx2}, exp_sum_avx2,
                                       {wsum_avx2, wsum_f16_avx2, wsum_q8_avx2}, NULL};
static const attn_kernels ATTN_VNNI = {{scores_avx2, scores_f16_avx2, scores_q8_avx2}, exp_sum_avx2,
                                       {wsum_avx2, wsum_f16_avx2, wsum_q8_avx2}, qk_attn_group_vnni};
#endif

const attn_kernels *qk_attn_kernels(int isa) {
#if QK_X86
    if (isa == ISA_VNNI && qk_kernels(ISA_VNNI)) return &ATTN_VNNI;
    if (isa != ISA_SCALAR) return &ATTN_AVX2;
#endif
    (void)isa;
    return &ATTN_SCALAR;
}

/* ------------------------------------------------------------------------------ attention job */

typedef struct {
    const attn_kernels *k;
    int64_t nh, nkv, D, maxkeys, items, window;
    int kkind, vkind;
    int64_t krow, vrow, khead, vhead; /* bytes: a slot's row, one head's part of it */
    const uint8_t *kc, *vc;
    const float *q, *sinks;
    float *att, *scores, scale;
    const int64_t *const *slots;
    const int64_t *pos;
    atomic_long next;
} attn_ctx;

int64_t qk_kind_bytes(int kind, int64_t n) {
    return kind == KV_F32 ? 4 * n : kind == KV_F16 ? 2 * n : n / 32 * 34;
}

int qk_kv_kind(int ggml_type) {
    return ggml_type == 0 ? KV_F32 : ggml_type == 1 ? KV_F16 : ggml_type == 8 ? KV_Q8_0 : -1;
}

static void attn_task(void *p, int tid, int nth) {
    attn_ctx *c = p;
    (void)tid, (void)nth;
    const int64_t g = c->nh / c->nkv, qd = c->nh * c->D;
    for (int64_t it; (it = atomic_fetch_add(&c->next, 1)) < c->items;) {
        const int64_t r = it / c->nkv, h = it % c->nkv;
        const int64_t first = c->window && c->pos[r] >= c->window ? c->pos[r] - c->window + 1 : 0;
        const int64_t n = c->pos[r] + 1 - first;
        const int64_t *slot = c->slots[r] + first;
        /* every key and value row of this head at once: the misses overlap instead of coming one row at a time
         * (the cache is cold after a decode step's weights streamed through; 10% off the attention); the group
         * kernel prefetches AG_AHEAD rows ahead itself, so only its first rows here */
        const int group = c->k->group && c->D % 16 == 0;
        for (int64_t j = 0; j < (group && n > AG_AHEAD ? AG_AHEAD : n); j++) {
            const char *kp = (const char *)c->kc + h * c->khead + slot[j] * c->krow;
            const char *vp = (const char *)c->vc + h * c->vhead + slot[j] * c->vrow;
            for (int64_t o = 0; o < c->khead; o += 64) __builtin_prefetch(kp + o, 0, 2);
            for (int64_t o = 0; o < c->vhead; o += 64) __builtin_prefetch(vp + o, 0, 2);
        }
        if (group) {
            c->k->group(c->att + r * qd + h * g * c->D, c->q + r * qd + h * g * c->D, g, n, c->kc + h * c->khead,
                        c->vc + h * c->vhead, slot, c->krow, c->vrow, c->D, c->D, c->kkind, c->vkind, c->scale,
                        c->sinks ? c->sinks + h * g : NULL, c->scores + (r * c->nkv + h) * qk_group_slots(g) * c->maxkeys);
            continue;
        }
        for (int64_t gi = 0; gi < g; gi++) {
            const int64_t head = h * g + gi;
            float *s = c->scores + (r * c->nh + head) * c->maxkeys;
            c->k->scores[c->kkind](s, c->q + r * qd + head * c->D, n, c->kc + h * c->khead, slot, c->krow, c->D,
                                   c->scale);
            float max = c->sinks ? c->sinks[head] : -INFINITY;
            for (int64_t j = 0; j < n; j++) max = s[j] > max ? s[j] : max;
            float sum = c->k->exp_sum(s, n, max);
            if (c->sinks) sum += expf(c->sinks[head] - max);  /* the sink's share of the softmax, no value */
            const float inv = 1.0f / sum;
            for (int64_t j = 0; j < n; j++) s[j] *= inv;
            c->k->wsum[c->vkind](c->att + r * qd + head * c->D, s, n, c->vc + h * c->vhead, slot, c->vrow, c->D);
        }
    }
}

int qk_attend_rows(int isa, const float *q, int64_t B, int64_t nh, int64_t nkv, int64_t D, const float *k,
                   const float *v, const int64_t *const *slots, const int64_t *pos, int64_t window, const float *sinks,
                   float scale, float *att) {
    if (B < 1 || nh < 1 || nkv < 1 || nh % nkv || D < 1) return QK_ESHAPE;
    int64_t maxkeys = 1;
    for (int64_t r = 0; r < B; r++) {
        if (pos[r] < 0) return QK_ESHAPE;
        maxkeys = pos[r] + 1 > maxkeys ? pos[r] + 1 : maxkeys;
    }
    float *scores = malloc((size_t)(B * qk_score_floats(nh, nkv, maxkeys)) * sizeof(float));
    if (!scores) return QK_ENOMEM;
    attn_ctx c = {.k = qk_attn_kernels(isa), .nh = nh, .nkv = nkv, .D = D, .maxkeys = maxkeys, .items = B * nkv,
                  .window = window, .kkind = KV_F32, .vkind = KV_F32, .krow = 4 * nkv * D, .vrow = 4 * nkv * D,
                  .khead = 4 * D, .vhead = 4 * D, .q = q, .kc = (const uint8_t *)k, .vc = (const uint8_t *)v, .sinks = sinks, .att = att,
                  .scores = scores, .scale = scale > 0.0f ? scale : (float)(1.0 / sqrt((double)D)), .slots = slots,
                  .pos = pos};
    atomic_init(&c.next, 0);
    qk_pool_run(attn_task, &c);
    free(scores);
    return QK_OK;
}

/* ------------------------------------------------------------------------- per-row pieces */

static const float *fptr(int64_t a) { return (const float *)(uintptr_t)a; }

/* out = w * (x / rms(x)), the mean of squares accumulated in double. */
QK_VECTOR_CLONES void qk_rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    double s[8] = {0}; /* value i goes to sum i % 8: eight chains of adds, not one (a norm of 2048 values: 0.8 us less) */
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) s[l] += (double)x[i + l] * x[i + l];
    for (; i < n; i++) s[i % 8] += (double)x[i] * x[i];
    const double ss = ((s[0] + s[4]) + (s[1] + s[5])) + ((s[2] + s[6]) + (s[3] + s[7]));
    const float scale = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (i = 0; i < n; i++) out[i] = w[i] * (x[i] * scale);
}

QK_VECTOR_CLONES void qk_rope(float *x, const float *cos, const float *sin, int64_t R, int neox) {
    const int64_t half = R / 2;
    for (int64_t i = 0; i < half; i++) {
        float *a = neox ? x + i : x + 2 * i, *b = neox ? x + i + half : x + 2 * i + 1;
        const float x1 = *a, x2 = *b;
        *a = x1 * cos[i] - x2 * sin[i];
        *b = x2 * cos[i] + x1 * sin[i];
    }
}

QK_VECTOR_CLONES void qk_gate_mul(float *x, const float *gate, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] *= 1.0f / (1.0f + qk_vexp(-gate[i]));
}

/* A prompt's norms and RoPE on the pool: rows in runs of about ROWS_RUN values taken through a counter, each row
 * computed as alone (the same bits on any number of threads). */
#define ROWS_RUN 16384
#define ROWS_PARALLEL (1 << 16) /* values; fewer: on the caller */

typedef struct {
    const float *x, *w, *cos, *sin;
    float *out; /* RoPE: x rotated in place (out == x) */
    int64_t rows, n, heads, R, run;
    float eps;
    int neox;
    atomic_long next;
} rows_ctx;

static void rows_span(const rows_ctx *c, int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; r++) {
        if (c->w)
            qk_rms_norm(c->x + r * c->n, c->w, c->n, c->eps, c->out + r * c->n);
        else
            qk_rope(c->out + r * c->n, c->cos + r / c->heads * (c->R / 2), c->sin + r / c->heads * (c->R / 2), c->R,
                    c->neox);
    }
}

static void rows_task(void *p, int tid, int nth) {
    rows_ctx *c = p;
    (void)tid, (void)nth;
    for (int64_t r0; (r0 = atomic_fetch_add(&c->next, c->run)) < c->rows;)
        rows_span(c, r0, r0 + c->run < c->rows ? r0 + c->run : c->rows);
}

static void rows_run(rows_ctx *c) {
    c->run = ROWS_RUN / c->n > 1 ? ROWS_RUN / c->n : 1;
    atomic_init(&c->next, 0);
    if (c->rows * c->n < ROWS_PARALLEL || c->rows == 1)
        rows_span(c, 0, c->rows);
    else
        qk_pool_run(rows_task, c); /* without workers it runs on the caller */
}

void qk_rms_norm_rows(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out) {
    rows_ctx c = {.x = x, .w = w, .out = out, .rows = rows, .n = n, .heads = 1, .eps = eps};
    rows_run(&c);
}

void qk_rope_rows(float *x, int64_t T, int64_t heads, int64_t D, const float *cos, const float *sin, int64_t R,
                  int neox) {
    rows_ctx c = {.x = x, .cos = cos, .sin = sin, .out = x, .rows = T * heads, .n = D, .heads = heads, .R = R,
                  .neox = neox};
    rows_run(&c);
}

/* Biases, clamp, q/k norms and RoPE (over R dims a head) for one row's q [nh * D] and k [nkv * D] (v: bias and
 * clamp). */
static void finish_qkv(const qk_attn_desc *d, float *q, float *k, float *v, const float *cos, const float *sin,
                       int64_t R, float eps, float clip) {
    const int64_t D = d->head_dim, qd = d->n_heads * D, kd = d->n_kv_heads * D;
    float *vecs[3] = {q, k, v};
    const int64_t len[3] = {qd, kd, kd}, bias[3] = {d->bq, d->bk, d->bv};
    for (int m = 0; m < 3; m++)
        for (int64_t i = 0; i < len[m]; i++) {
            float t = vecs[m][i] + (bias[m] ? fptr(bias[m])[i] : 0.0f);
            if (clip > 0.0f) t = t < -clip ? -clip : t > clip ? clip : t;
            vecs[m][i] = t;
        }
    if (d->qk_norm == 1) {
        qk_rms_norm(q, fptr(d->q_norm), qd, eps, q);
        qk_rms_norm(k, fptr(d->k_norm), kd, eps, k);
    } else if (d->qk_norm == 2) {
        for (int64_t h = 0; h < d->n_heads; h++) qk_rms_norm(q + h * D, fptr(d->q_norm), D, eps, q + h * D);
        for (int64_t h = 0; h < d->n_kv_heads; h++) qk_rms_norm(k + h * D, fptr(d->k_norm), D, eps, k + h * D);
    }
    for (int64_t h = 0; h < d->n_heads; h++) qk_rope(q + h * D, cos, sin, R, (int)d->neox);
    for (int64_t h = 0; h < d->n_kv_heads; h++) qk_rope(k + h * D, cos, sin, R, (int)d->neox);
}

/* ------------------------------------------------------------------------------------ the call */

int qk_attn_first(const qk_attn_desc *d, qk_wmat mats[QK_MM_MAX]) {
    const int64_t qd = d->n_heads * d->head_dim, kd = d->n_kv_heads * d->head_dim;
    mats[0] = (qk_wmat){(const uint8_t *)(uintptr_t)d->wq, (int)d->wq_type, (1 + (d->attn_gate != 0)) * qd};
    mats[1] = (qk_wmat){(const uint8_t *)(uintptr_t)d->wk, (int)d->wk_type, kd};
    mats[2] = (qk_wmat){(const uint8_t *)(uintptr_t)d->wv, (int)d->wv_type, kd};
    return 3;
}

int qk_attn_mix(int isa, const qk_attn_desc *d, float *x, int64_t B, const int64_t *const *slots,
                const int64_t *pos, void *kc, void *vc, const float *rope_cos, const float *rope_sin, float eps,
                float clip, int ktype, int vtype, const qk_then *then) {
    const int64_t H = d->hidden, nh = d->n_heads, nkv = d->n_kv_heads, D = d->head_dim;
    const int64_t qd = nh * D, kd = nkv * D, R = d->rope_dim ? d->rope_dim : D, gated = d->attn_gate != 0;
    const int kkind = qk_kv_kind(ktype), vkind = qk_kv_kind(vtype);
    if (B < 1 || H < 1 || nh < 1 || nkv < 1 || nh % nkv || D < 2 || D % 2 || R < 2 || R % 2 || R > D)
        return QK_ESHAPE;
    if (kkind < 0 || vkind < 0) return QK_ETYPE;
    if ((kkind == KV_Q8_0 || vkind == KV_Q8_0) && D % 32) return QK_ESHAPE; /* a head is whole blocks */
    const int64_t krow = qk_kind_bytes(kkind, kd), vrow = qk_kind_bytes(vkind, kd);
    int64_t maxkeys = 1;
    for (int64_t r = 0; r < B; r++) {
        if (pos[r] < 0) return QK_ESHAPE;
        maxkeys = pos[r] + 1 > maxkeys ? pos[r] + 1 : maxkeys;
    }
    const int64_t nfloat = B * (H + (2 + 2 * gated) * qd + 2 * kd + H + qk_score_floats(nh, nkv, maxkeys));
    float *mem = malloc((size_t)nfloat * sizeof(float));
    if (!mem) return QK_ENOMEM;
    /* q: [B, nh * D], or with the gate [B, nh * 2D] as wq gives it, then split into q and gate */
    float *xn = mem, *q = xn + B * H, *gate = q + (1 + gated) * B * qd, *k = gate + gated * B * qd, *v = k + B * kd;
    float *att = v + B * kd, *o = att + B * qd, *scores = o + B * H;

    for (int64_t r = 0; r < B; r++) qk_rms_norm(x + r * H, fptr(d->attn_norm), H, eps, xn + r * H);
    qk_wmat wqkv[QK_MM_MAX];
    const qk_wmat wo = {(const uint8_t *)(uintptr_t)d->wo, (int)d->wo_type, H};
    const qk_then to_wo = {1, &wo, qd};
    float *const qkv[3] = {q, k, v};
    int rc = qk_matmuls_then(isa, qk_attn_first(d, wqkv), wqkv, H, xn, B, qkv, &to_wo);
    if (!rc && gated) /* each head's [q, gate] rows -> q [B, nh * D], gate [B, nh * D]; in place, front to back */
        for (int64_t r = 0; r < B; r++)
            for (int64_t h = 0; h < nh; h++) {
                const float *src = q + (r * nh + h) * 2 * D;
                memcpy(gate + (r * nh + h) * D, src + D, (size_t)D * sizeof(float));
                memmove(q + (r * nh + h) * D, src, (size_t)D * sizeof(float));
            }
    for (int64_t r = 0; !rc && r < B; r++) {
        const float *cs = rope_cos + pos[r] * (R / 2), *sn = rope_sin + pos[r] * (R / 2);
        finish_qkv(d, q + r * qd, k + r * kd, v + r * kd, cs, sn, R, eps, clip);
        const int64_t slot = slots[r][pos[r]];
        qk_store_row(kkind, (uint8_t *)kc + slot * krow, k + r * kd, kd);
        qk_store_row(vkind, (uint8_t *)vc + slot * vrow, v + r * kd, kd);
    }
    if (!rc) {
        const float scale = fptr(d->fparams) && fptr(d->fparams)[1] > 0.0f ? fptr(d->fparams)[1]
                                                                            : (float)(1.0 / sqrt((double)D));
        attn_ctx c = {.k = qk_attn_kernels(isa), .nh = nh, .nkv = nkv, .D = D, .maxkeys = maxkeys,
                      .items = B * nkv, .window = d->window, .kkind = kkind, .vkind = vkind, .krow = krow,
                      .vrow = vrow, .khead = qk_kind_bytes(kkind, D), .vhead = qk_kind_bytes(vkind, D), .q = q,
                      .kc = kc, .vc = vc, .sinks = fptr(d->sinks),
                      .att = att, .scores = scores, .scale = scale, .slots = slots, .pos = pos};
        atomic_init(&c.next, 0);
        qk_span spans[QK_THEN_MAX];
        qk_pool_run_then(attn_task, &c, "attn_task", spans, qk_then_spans(isa, &to_wo, B, spans));
        if (gated)
            qk_gate_mul(att, gate, B * qd);
        rc = qk_matmuls_then(isa, 1, &wo, qd, att, B, &o, then);
    }
    const float *bo = fptr(d->bo);
    for (int64_t r = 0; !rc && r < B; r++)
        for (int64_t i = 0; i < H; i++) x[r * H + i] += bo ? o[r * H + i] + bo[i] : o[r * H + i];
    free(mem);
    return rc;
}
