/* Portable kernels: activation quantizers, row dot products, and the type / kernel-set tables.
 *
 * Integer sums are exact, so the AVX2 kernels compute the same integers; only the float
 * accumulation order differs between the two sets. Block layouts are described in qk.h.
 */
#include <math.h>

#include "qk.h"

#if QK_NEON && defined(__linux__)
#include <sys/auxv.h>
#elif QK_NEON && defined(__APPLE__)
#include <sys/sysctl.h>
#endif

const qtype_info QK_TYPES[QT_COUNT] = {
    [QT_Q4_0] = {GGML_Q4_0, "Q4_0", 32, 18, ACT_Q8_0, 1, 4},
    [QT_Q8_0] = {GGML_Q8_0, "Q8_0", 32, 34, ACT_Q8_0, 1, 4},
    [QT_MXFP4] = {GGML_MXFP4, "MXFP4", 32, 17, ACT_Q8_0, 1, 4},
    [QT_Q4_K] = {GGML_Q4_K, "Q4_K", 256, 144, ACT_Q8K, 1, 4},
    [QT_Q5_K] = {GGML_Q5_K, "Q5_K", 256, 176, ACT_Q8K, 1, 4},
    [QT_Q6_K] = {GGML_Q6_K, "Q6_K", 256, 210, ACT_Q8K, 1, 4},
    [QT_IQ4_XS] = {GGML_IQ4_XS, "IQ4_XS", 256, 136, ACT_Q8_0, 1, 4},
    [QT_Q4_K_R8] = {GGML_Q4_K_R8, "Q4_K_R8", 256, 8 * 144, ACT_Q8K, 8, 4},
    [QT_Q8_0_R8] = {GGML_Q8_0_R8, "Q8_0_R8", 32, 8 * 34, ACT_Q8_0, 8, 8},
    [QT_MXFP4_R8] = {GGML_MXFP4_R8, "MXFP4_R8", 32, 8 * 17, ACT_Q8_0, 8, 8},
    [QT_Q6_K_R8] = {GGML_Q6_K_R8, "Q6_K_R8", 256, 8 * 210, ACT_Q8K, 8, 4},
    [QT_IQ4_XS_R8] = {GGML_IQ4_XS_R8, "IQ4_XS_R8", 256, 8 * 136, ACT_Q8_0, 8, 8},
    [QT_Q5_K_R8] = {GGML_Q5_K_R8, "Q5_K_R8", 256, 8 * 176, ACT_Q8K, 8, 4},
    [QT_Q5_0] = {GGML_Q5_0, "Q5_0", 32, 22, ACT_Q8_0, 1, 4},
    [QT_Q5_0_R8] = {GGML_Q5_0_R8, "Q5_0_R8", 32, 8 * 22, ACT_Q8_0, 8, 8},
    [QT_Q5_1] = {GGML_Q5_1, "Q5_1", 32, 24, ACT_Q8_0, 1, 4},
    [QT_Q5_1_R8] = {GGML_Q5_1_R8, "Q5_1_R8", 32, 8 * 24, ACT_Q8_0, 8, 8},
    [QT_IQ4_NL] = {GGML_IQ4_NL, "IQ4_NL", 32, 18, ACT_Q8_0, 1, 4},
    [QT_IQ4_NL_R8] = {GGML_IQ4_NL_R8, "IQ4_NL_R8", 32, 8 * 18, ACT_Q8_0, 8, 8},
    [QT_Q3_K] = {GGML_Q3_K, "Q3_K", 256, 110, ACT_Q8K, 1, 4},
    [QT_Q3_K_R8] = {GGML_Q3_K_R8, "Q3_K_R8", 256, 8 * 110, ACT_Q8K, 8, 4},
};

int qk_qtype_index(int ggml) {
    for (int i = 0; i < QT_COUNT; i++)
        if (QK_TYPES[i].ggml == ggml) return i;
    return -1;
}

int qk_act_elems(int act) { return act == ACT_Q8K ? 256 : 32; }
int qk_act_bytes(int act) { return act == ACT_Q8K ? (int)sizeof(act_q8k) : (int)sizeof(act_q8_0); }

/* ---------------------------------------------------------------------- activation quantizers */

/* Symmetric: d = absmax / 127, q = round-half-even(x * 127 / absmax). The AVX2 versions perform the
 * same float operations (one multiply, then a conversion in the default rounding mode), so both
 * produce identical bytes. */
void qk_quant_q8k_scalar(const float *x, void *out, int64_t k) {
    act_q8k *y = out;
    for (int64_t i = 0; i < k / 256; i++, x += 256) {
        float amax = 0.0f;
        for (int j = 0; j < 256; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        y[i].d = amax / 127.0f;
        for (int j = 0; j < 256; j++) y[i].qs[j] = (int8_t)lrintf(x[j] * id);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += y[i].qs[16 * g + j];
            y[i].bsums[g] = (int16_t)s;
        }
    }
}

void qk_quant_q8_0_scalar(const float *x, void *out, int64_t k) {
    act_q8_0 *y = out;
    for (int64_t i = 0; i < k / 32; i++, x += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        y[i].d = amax / 127.0f;
        y[i].s = 0;
        for (int j = 0; j < 32; j++) y[i].s += y[i].qs[j] = (int8_t)lrintf(x[j] * id);
    }
}

/* ----------------------------------------------------------------------- 32-element weight types */

/* The three types whose 32 weights are a 16-byte nibble array (low nibbles first) share this loop;
 * `lut` maps a nibble to its integer weight, `scale` reads the block's float scale. */
#define DOT32_NIBBLES(NAME, BYTES, QOFF, LUT_EXPR, SCALE_EXPR)                                    \
    void NAME(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {        \
        for (int t = 0; t < nt; t++) {                                                           \
            const act_q8_0 *x = xv[t];                                                           \
            const uint8_t *b = w;                                                                \
            float sum = 0.0f;                                                                    \
            for (int64_t i = 0; i < nb; i++, b += (BYTES)) {                                     \
                const uint8_t *qs = b + (QOFF);                                                  \
                int32_t isum = 0;                                                                \
                for (int j = 0; j < 16; j++) {                                                   \
                    const int lo = qs[j] & 15, hi = qs[j] >> 4;                                  \
                    isum += (LUT_EXPR(lo)) * x[i].qs[j] + (LUT_EXPR(hi)) * x[i].qs[j + 16];      \
                }                                                                                \
                sum += (SCALE_EXPR) * x[i].d * (float)isum;                                      \
            }                                                                                    \
            out[t] = sum;                                                                        \
        }                                                                                        \
    }

#define MINUS8(q) ((q) - 8)
#define MXFP4(q) QK_KV_MXFP4[q]
DOT32_NIBBLES(qk_dot_scalar_q4_0, 18, 2, MINUS8, qk_f16_at(b))
DOT32_NIBBLES(qk_dot_scalar_mxfp4, 17, 1, MXFP4, qk_e8m0_half(b[0]))
#define IQ4NL(q) QK_KV_IQ4NL[q]
DOT32_NIBBLES(qk_dot_scalar_iq4_nl, 18, 2, IQ4NL, qk_f16_at(b))

/* q . x.qs over one Q5_0 / Q5_1 block's 5-bit values q (0..31): the nibbles of qs[16] and the bits of qh. */
static int32_t q5_isum(const uint8_t *qs, uint32_t qh, const int8_t *y) {
    int32_t isum = 0;
    for (int j = 0; j < 16; j++) {
        const int lo = (qs[j] & 15) | (int)((qh >> j) & 1) << 4;
        const int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1) << 4;
        isum += lo * y[j] + hi * y[j + 16];
    }
    return isum;
}

/* Q5_0: out = sum_i d * x.d * (q . x.qs - 16 x.s). Q5_1: out = sum_i x.d * (d * q . x.qs + m * x.s). */
void qk_dot_scalar_q5_0(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        const uint8_t *b = w;
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++, b += 22)
            sum += qk_f16_at(b) * x[i].d * (float)(q5_isum(b + 6, qk_rd32(b + 2), x[i].qs) - 16 * x[i].s);
        out[t] = sum;
    }
}

void qk_dot_scalar_q5_1(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        const uint8_t *b = w;
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++, b += 24)
            sum += x[i].d * (qk_f16_at(b) * (float)q5_isum(b + 8, qk_rd32(b + 4), x[i].qs) +
                             qk_f16_at(b + 2) * (float)x[i].s);
        out[t] = sum;
    }
}

void qk_dot_scalar_q8_0(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        const uint8_t *b = w;
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++, b += 34) {
            const int8_t *q = (const int8_t *)(b + 2);
            int32_t isum = 0;
            for (int j = 0; j < 32; j++) isum += q[j] * x[i].qs[j];
            sum += qk_f16_at(b) * x[i].d * (float)isum;
        }
        out[t] = sum;
    }
}

/* IQ4_XS: 256-element blocks of eight 32-element sub-blocks, dotted against eight act_q8_0 blocks. */
void qk_dot_scalar_iq4_xs(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        const uint8_t *b = w;
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++, b += 136) {
            const float d = qk_f16_at(b);
            const uint16_t sh = qk_rd16(b + 2);
            for (int s = 0; s < 8; s++) {
                const int ls = (((b[4 + s / 2] >> (4 * (s % 2))) & 15) | (((sh >> (2 * s)) & 3) << 4)) - 32;
                const uint8_t *qs = b + 8 + 16 * s;
                const act_q8_0 *y = &x[8 * i + s];
                int32_t isum = 0;
                for (int j = 0; j < 16; j++)
                    isum += QK_KV_IQ4NL[qs[j] & 15] * y->qs[j] + QK_KV_IQ4NL[qs[j] >> 4] * y->qs[j + 16];
                sum += d * (float)ls * y->d * (float)isum;
            }
        }
        out[t] = sum;
    }
}

/* ----------------------------------------------------------------------------------- K-quants */

void qk_dot_scalar_q4_k(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        const uint8_t *b = w;
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++, b += 144) {
            uint8_t sc[8], m[8];
            qk_unpack_q4k_scales(b + 4, sc, m);
            const uint8_t *qs = b + 16;
            const int8_t *y = x[i].qs;
            int32_t isum = 0, msum = 0;
            for (int g = 0; g < 4; g++) {
                int32_t lo = 0, hi = 0;
                for (int j = 0; j < 32; j++) {
                    lo += (qs[32 * g + j] & 15) * y[64 * g + j];
                    hi += (qs[32 * g + j] >> 4) * y[64 * g + 32 + j];
                }
                isum += sc[2 * g] * lo + sc[2 * g + 1] * hi;
            }
            for (int s = 0; s < 8; s++) msum += m[s] * (x[i].bsums[2 * s] + x[i].bsums[2 * s + 1]);
            sum += x[i].d * (qk_f16_at(b) * (float)isum - qk_f16_at(b + 2) * (float)msum);
        }
        out[t] = sum;
    }
}

void qk_dot_scalar_q5_k(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        const uint8_t *b = w;
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++, b += 176) {
            uint8_t sc[8], m[8];
            qk_unpack_q4k_scales(b + 4, sc, m);
            const uint8_t *qh = b + 16, *qs = b + 48;
            const int8_t *y = x[i].qs;
            int32_t isum = 0, msum = 0;
            for (int g = 0; g < 4; g++) {
                int32_t lo = 0, hi = 0;
                for (int j = 0; j < 32; j++) {
                    const int ql = (qs[32 * g + j] & 15) | (((qh[j] >> (2 * g)) & 1) << 4);
                    const int qu = (qs[32 * g + j] >> 4) | (((qh[j] >> (2 * g + 1)) & 1) << 4);
                    lo += ql * y[64 * g + j];
                    hi += qu * y[64 * g + 32 + j];
                }
                isum += sc[2 * g] * lo + sc[2 * g + 1] * hi;
            }
            for (int s = 0; s < 8; s++) msum += m[s] * (x[i].bsums[2 * s] + x[i].bsums[2 * s + 1]);
            sum += x[i].d * (qk_f16_at(b) * (float)isum - qk_f16_at(b + 2) * (float)msum);
        }
        out[t] = sum;
    }
}

void qk_dot_scalar_q6_k(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        const uint8_t *b = w;
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++, b += 210) {
            const uint8_t *ql = b, *qh = b + 128;
            const int8_t *sc = (const int8_t *)(b + 192);
            const int8_t *y = x[i].qs;
            int32_t isum = 0;
            for (int h = 0; h < 2; h++) {
                for (int k = 0; k < 4; k++) { /* 32 elements 128h + 32k + j: two groups of 16 */
                    const uint8_t *l = ql + 64 * h + 32 * (k & 1), *hb = qh + 32 * h;
                    const int lshift = k < 2 ? 0 : 4, hshift = 2 * k;
                    const int8_t *yk = y + 128 * h + 32 * k;
                    for (int g = 0; g < 2; g++) {
                        int32_t sg = 0;
                        for (int j = 16 * g; j < 16 * g + 16; j++)
                            sg += ((((l[j] >> lshift) & 15) | (((hb[j] >> hshift) & 3) << 4)) - 32) * yk[j];
                        isum += sc[8 * h + 2 * k + g] * sg;
                    }
                }
            }
            sum += x[i].d * qk_f16_at(b + 208) * (float)isum;
        }
        out[t] = sum;
    }
}

/* Q3_K: value = d * sc[el / 16] * (q - 4 + 4 * third bit), q the two bits in qs (layout: qk.h). */
void qk_dot_scalar_q3_k(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        const uint8_t *b = w;
        float sum = 0.0f;
        for (int64_t i = 0; i < nb; i++, b += 110) {
            uint32_t sw[4];
            qk_q3k_scales(b + 96, sw);
            const uint8_t *sc = (const uint8_t *)sw;
            int32_t isum = 0;
            for (int h = 0; h < 2; h++) {
                const uint8_t *q = b + 32 + 32 * h;
                for (int k = 0; k < 4; k++) {
                    const int8_t *y = x[i].qs + 128 * h + 32 * k;
                    for (int g = 0; g < 2; g++) {
                        int32_t sg = 0;
                        for (int j = 16 * g; j < 16 * g + 16; j++)
                            sg += (((q[j] >> (2 * k)) & 3) - (((b[j] >> (4 * h + k)) & 1) ? 0 : 4)) * y[j];
                        isum += (sc[8 * h + 2 * k + g] - 32) * sg;
                    }
                }
            }
            sum += x[i].d * qk_f16_at(b + 108) * (float)isum;
        }
        out[t] = sum;
    }
}

/* ------------------------------------------------------------------------------- kernel sets */

static const kernel_set SCALAR = {
    "scalar",
    {[ACT_Q8K] = qk_quant_q8k_scalar, [ACT_Q8_0] = qk_quant_q8_0_scalar},
    {[QT_Q4_0] = qk_dot_scalar_q4_0, [QT_Q8_0] = qk_dot_scalar_q8_0, [QT_MXFP4] = qk_dot_scalar_mxfp4,
     [QT_Q4_K] = qk_dot_scalar_q4_k, [QT_Q5_K] = qk_dot_scalar_q5_k, [QT_Q6_K] = qk_dot_scalar_q6_k,
     [QT_IQ4_XS] = qk_dot_scalar_iq4_xs, [QT_Q4_K_R8] = qk_dot_scalar_q4_k_r8,
     [QT_Q8_0_R8] = qk_dot_scalar_q8_0_r8, [QT_MXFP4_R8] = qk_dot_scalar_mxfp4_r8,
     [QT_Q6_K_R8] = qk_dot_scalar_q6_k_r8, [QT_IQ4_XS_R8] = qk_dot_scalar_iq4_xs_r8,
     [QT_Q5_K_R8] = qk_dot_scalar_q5_k_r8, [QT_Q5_0] = qk_dot_scalar_q5_0,
     [QT_Q5_0_R8] = qk_dot_scalar_q5_0_r8, [QT_Q5_1] = qk_dot_scalar_q5_1,
     [QT_Q5_1_R8] = qk_dot_scalar_q5_1_r8, [QT_IQ4_NL] = qk_dot_scalar_iq4_nl,
     [QT_IQ4_NL_R8] = qk_dot_scalar_iq4_nl_r8, [QT_Q3_K] = qk_dot_scalar_q3_k,
     [QT_Q3_K_R8] = qk_dot_scalar_q3_k_r8},
    {NULL},
};

#if QK_X86
#define X86_SET(NAME, SUFFIX, ...)                                                                 \
    {NAME,                                                                                         \
     {[ACT_Q8K] = qk_quant_q8k_avx2, [ACT_Q8_0] = qk_quant_q8_0_avx2},                            \
     {[QT_Q4_0] = qk_dot_q4_0##SUFFIX, [QT_Q8_0] = qk_dot_q8_0##SUFFIX, [QT_MXFP4] = qk_dot_mxfp4##SUFFIX, \
      [QT_Q4_K] = qk_dot_q4_k##SUFFIX, [QT_Q5_K] = qk_dot_q5_k##SUFFIX, [QT_Q6_K] = qk_dot_q6_k##SUFFIX,  \
      [QT_IQ4_XS] = qk_dot_iq4_xs##SUFFIX, [QT_Q4_K_R8] = qk_dot_q4_k_r8##SUFFIX,                \
      [QT_Q8_0_R8] = qk_dot_q8_0_r8##SUFFIX, [QT_MXFP4_R8] = qk_dot_mxfp4_r8##SUFFIX,               \
      [QT_Q6_K_R8] = qk_dot_q6_k_r8##SUFFIX, [QT_IQ4_XS_R8] = qk_dot_iq4_xs_r8##SUFFIX,              \
      [QT_Q5_K_R8] = qk_dot_q5_k_r8##SUFFIX, [QT_Q5_0] = qk_dot_q5_0##SUFFIX,                        \
      [QT_Q5_0_R8] = qk_dot_q5_0_r8##SUFFIX, [QT_Q5_1] = qk_dot_q5_1##SUFFIX,                        \
      [QT_Q5_1_R8] = qk_dot_q5_1_r8##SUFFIX, [QT_IQ4_NL] = qk_dot_iq4_nl##SUFFIX,                   \
      [QT_IQ4_NL_R8] = qk_dot_iq4_nl_r8##SUFFIX, [QT_Q3_K] = qk_dot_q3_k##SUFFIX,                     \
      [QT_Q3_K_R8] = qk_dot_q3_k_r8##SUFFIX},                                                       \
     {__VA_ARGS__}}
static const kernel_set AVX2 = X86_SET("avx2", _avx2, NULL);
static const kernel_set VNNI = X86_SET("avx512vnni", _vnni, [QT_Q8_0_R8] = qk_dot16_q8_0_r8_vnni,
                                           [QT_Q4_K_R8] = qk_dot16_q4_k_r8_vnni, [QT_Q6_K_R8] = qk_dot16_q6_k_r8_vnni,
                                           [QT_MXFP4_R8] = qk_dot16_mxfp4_r8_vnni, [QT_IQ4_XS_R8] = qk_dot16_iq4_xs_r8_vnni,
                                           [QT_Q5_K_R8] = qk_dot16_q5_k_r8_vnni, [QT_Q3_K_R8] = qk_dot16_q3_k_r8_vnni);

static int cpu_has(int isa) {
    __builtin_cpu_init();
    const int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                     __builtin_cpu_supports("f16c");
    if (isa == ISA_AVX2) return avx2;
    return avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni");
}
#endif

#if QK_NEON
/* NEON dots where dot_neon.c has them, the portable ones for the rest. */
static const kernel_set NEON = {
    "neon",
    {[ACT_Q8K] = qk_quant_q8k_scalar, [ACT_Q8_0] = qk_quant_q8_0_scalar},
    {[QT_Q4_0] = qk_dot_q4_0_neon, [QT_Q8_0] = qk_dot_q8_0_neon, [QT_MXFP4] = qk_dot_scalar_mxfp4,
     [QT_Q4_K] = qk_dot_q4_k_neon, [QT_Q5_K] = qk_dot_scalar_q5_k, [QT_Q6_K] = qk_dot_q6_k_neon,
     [QT_IQ4_XS] = qk_dot_scalar_iq4_xs, [QT_Q4_K_R8] = qk_dot_q4_k_r8_neon, [QT_Q8_0_R8] = qk_dot_q8_0_r8_neon,
     [QT_MXFP4_R8] = qk_dot_scalar_mxfp4_r8, [QT_Q6_K_R8] = qk_dot_scalar_q6_k_r8,
     [QT_IQ4_XS_R8] = qk_dot_scalar_iq4_xs_r8, [QT_Q5_K_R8] = qk_dot_scalar_q5_k_r8,
     [QT_Q5_0] = qk_dot_scalar_q5_0, [QT_Q5_0_R8] = qk_dot_scalar_q5_0_r8, [QT_Q5_1] = qk_dot_scalar_q5_1,
     [QT_Q5_1_R8] = qk_dot_scalar_q5_1_r8, [QT_IQ4_NL] = qk_dot_scalar_iq4_nl,
     [QT_IQ4_NL_R8] = qk_dot_scalar_iq4_nl_r8, [QT_Q3_K] = qk_dot_scalar_q3_k,
     [QT_Q3_K_R8] = qk_dot_scalar_q3_k_r8},
    {NULL},
};

static int neon_dotprod(void) {
#if defined(__linux__)
    return (getauxval(AT_HWCAP) & (1UL << 20)) != 0; /* HWCAP_ASIMDDP */
#elif defined(__APPLE__)
    int v = 0;
    size_t n = sizeof v;
    return sysctlbyname("hw.optional.arm.FEAT_DotProd", &v, &n, NULL, 0) == 0 && v;
#else
    return 0;
#endif
}
#endif

const kernel_set *qk_kernels(int isa) {
    if (isa == ISA_SCALAR) return &SCALAR;
#if QK_X86
    if (isa == ISA_AVX2 && cpu_has(ISA_AVX2)) return &AVX2;
    if (isa == ISA_VNNI && cpu_has(ISA_VNNI)) return &VNNI;
#endif
#if QK_NEON
    if (isa == ISA_NEON && neon_dotprod()) return &NEON;
#endif
    return NULL;
}

int qk_best_isa(void) {
    for (int isa = ISA_COUNT - 1; isa > ISA_SCALAR; isa--)
        if (qk_kernels(isa)) return isa;
    return ISA_SCALAR;
}

const char *qk_isa_name(int isa) {
    static const char *const names[ISA_COUNT] = {"scalar", "avx2", "avx512vnni", "neon"};
    return isa >= 0 && isa < ISA_COUNT ? names[isa] : "?";
}
