/* The Arm NEON kernel set (AArch64 with the dot-product extension, ARMv8.2 "asimddp": Apple M1 and later,
 * Graviton 2 and later, Cortex-A76 and later): qk_dot_*_neon for Q8_0, Q4_0, Q4_K, Q6_K, Q4_K_R8 and Q8_0_R8, the
 * layouts and integer sums of the scalar kernels (qk.h, dot_scalar.c, r8.c) with SDOT doing four int8
 * products per int32 lane. The set's other types (MXFP4, Q5_K, IQ4_XS) and the activation quantizers are the
 * portable ones. The functions are compiled for +dotprod through a pragma and only run after qk_kernels()
 * has found the feature in the kernel's HWCAP bits, so the module still loads on older cores (which get
 * the scalar set). Tested on x86 machines under qemu-aarch64 (tests/test_neon_kernels.py). */
#include "qk.h"

#if QK_NEON
#if !defined(__clang__)
#pragma GCC target("arch=armv8.2-a+dotprod")
#endif
#include <arm_neon.h>

/* SDOT: acc + four int8 products per int32 lane. GCC gets the intrinsic from the pragma above; clang's
 * arm_neon.h (14 and earlier) only declares it when the whole file is built for +dotprod, and its assembler
 * then refuses the mnemonic, so clang emits the instruction's encoding, "sdot v0.4s, v1.16b, v2.16b", with
 * the operands pinned to those registers. */
static inline int32x4_t sdot(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(__clang__)
    register int32x4_t d __asm__("v0") = acc;
    register int8x16_t n __asm__("v1") = a;
    register int8x16_t m __asm__("v2") = b;
    __asm__(".inst 0x4e829420" : "+w"(d) : "w"(n), "w"(m));
    return d;
#else
    return vdotq_s32(acc, a, b);
#endif
}

static inline int32_t dot32(int8x16_t a0, int8x16_t a1, const int8_t *y) {
    int32x4_t s = sdot(vdupq_n_s32(0), a0, vld1q_s8(y));
    s = sdot(s, a1, vld1q_s8(y + 16));
    return vaddvq_s32(s);
}

/* Q8_0: value = d * q. */
void qk_dot_q8_0_neon(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 34;
            const int32_t s = dot32(vld1q_s8((const int8_t *)b + 2), vld1q_s8((const int8_t *)b + 18), x[i].qs);
            acc += qk_f16_at(b) * x[i].d * (float)s;
        }
        out[t] = acc;    }
}

/* Q4_0: value = d * (q - 8); low nibbles are elements 0..15, high nibbles 16..31. */
void qk_dot_q4_0_neon(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 18;
            const uint8x16_t q = vld1q_u8(b + 2);
            const int8x16_t lo = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(15))), vdupq_n_s8(8));
            const int8x16_t hi = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8(q, 4)), vdupq_n_s8(8));
            acc += qk_f16_at(b) * x[i].d * (float)dot32(lo, hi, x[i].qs);
        }
        out[t] = acc;    }
}

/* Q4_K: d * sc * q - dmin * m per 32 weights; the mins through the activations' bsums. */
void qk_dot_q4_k_neon(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 144;
            uint8_t sc[8], m[8];
            qk_unpack_q4k_scales(b + 4, sc, m);
            int32_t isum = 0, msum = 0;
            for (int g = 0; g < 4; g++) { /* qs[32g + j]: low nibble -> el 64g + j, high -> 64g + 32 + j */
                const uint8x16_t q0 = vld1q_u8(b + 16 + 32 * g), q1 = vld1q_u8(b + 32 + 32 * g);
                const uint8x16_t m4 = vdupq_n_u8(15);
                const int8_t *y = x[i].qs + 64 * g;
                isum += sc[2 * g] * dot32(vreinterpretq_s8_u8(vandq_u8(q0, m4)), vreinterpretq_s8_u8(vandq_u8(q1, m4)), y);
                isum += sc[2 * g + 1] * dot32(vreinterpretq_s8_u8(vshrq_n_u8(q0, 4)), vreinterpretq_s8_u8(vshrq_n_u8(q1, 4)),
                                              y + 32);
            }
            for (int s = 0; s < 8; s++) msum += m[s] * (x[i].bsums[2 * s] + x[i].bsums[2 * s + 1]);
            acc += x[i].d * (qk_f16_at(b) * (float)isum - qk_f16_at(b + 2) * (float)msum);
        }
        out[t] = acc;    }
}

/* Q6_K: value = d * scales[el / 16] * (q - 32). */
void qk_dot_q6_k_neon(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        float acc = 0.0f;
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 210;
            const int8_t *sc = (const int8_t *)(b + 192);
            int32_t isum = 0;
            for (int h = 0; h < 2; h++) {
                for (int half = 0; half < 2; half++) { /* 16 of the 32 j of each k at a time */
                    const int o = 16 * half;
                    const uint8x16_t l0 = vld1q_u8(b + 64 * h + o), l1 = vld1q_u8(b + 64 * h + 32 + o);
                    const uint8x16_t hb = vld1q_u8(b + 128 + 32 * h + o), m4 = vdupq_n_u8(15), m3 = vdupq_n_u8(3);
                    const uint8x16_t q[4] = {
                        vorrq_u8(vandq_u8(l0, m4), vshlq_n_u8(vandq_u8(hb, m3), 4)),
                        vorrq_u8(vandq_u8(l1, m4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 2), m3), 4)),
                        vorrq_u8(vshrq_n_u8(l0, 4), vshlq_n_u8(vandq_u8(vshrq_n_u8(hb, 4), m3), 4)),
                        vorrq_u8(vshrq_n_u8(l1, 4), vshlq_n_u8(vshrq_n_u8(hb, 6), 4))};
                    for (int k = 0; k < 4; k++) { /* elements 128h + 32k + o .. + 15: scale index 8h + 2k + half */
                        const int8x16_t v = vsubq_s8(vreinterpretq_s8_u8(q[k]), vdupq_n_s8(32));
                        const int32x4_t s = sdot(vdupq_n_s32(0), v, vld1q_s8(x[i].qs + 128 * h + 32 * k + o));
                        isum += sc[8 * h + 2 * k + half] * vaddvq_s32(s);
                    }
                }
            }
            acc += x[i].d * qk_f16_at(b + 208) * (float)isum;
        }
        out[t] = acc;    }
}

/* Q4_K_R8: 8 interleaved rows; one 16-byte load holds 4 weights of 4 rows, one SDOT per 4 rows. */
void qk_dot_q4_k_r8_neon(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        float32x4_t acc[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 1152;
            uint8_t v[4][32]; /* the scale vectors V0..V3 (qk.h) */
            qk_r8_vectors(b + 32, v);
            int32x4_t isum[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int g = 0; g < 4; g++) {
                int32x4_t lo[2] = {vdupq_n_s32(0), vdupq_n_s32(0)}, hi[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
                for (int c = 0; c < 8; c++) {
                    const uint8_t *q = b + 128 + 256 * g + 32 * c;
                    int32_t y4l, y4h;
                    memcpy(&y4l, x[i].qs + 64 * g + 4 * c, 4);
                    memcpy(&y4h, x[i].qs + 64 * g + 32 + 4 * c, 4);
                    const int8x16_t yl = vreinterpretq_s8_s32(vdupq_n_s32(y4l)), yh = vreinterpretq_s8_s32(vdupq_n_s32(y4h));
                    for (int half = 0; half < 2; half++) { /* rows 4 half .. 4 half + 3 */
                        const uint8x16_t qv = vld1q_u8(q + 16 * half);
                        lo[half] = sdot(lo[half], vreinterpretq_s8_u8(vandq_u8(qv, vdupq_n_u8(15))), yl);
                        hi[half] = sdot(hi[half], vreinterpretq_s8_u8(vshrq_n_u8(qv, 4)), yh);
                    }
                }
                for (int half = 0; half < 2; half++) { /* scales of sub-blocks 2g and 2g + 1 for these rows */
                    const int32x4_t sl = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(&v[g / 2][16 * (g % 2) + 4 * half])))));
                    const int32x4_t sh = vreinterpretq_s32_u32(vmovl_u16(vget_low_u16(vmovl_u8(vld1_u8(&v[g / 2][16 * (g % 2) + 8 + 4 * half])))));
                    isum[half] = vmlaq_s32(vmlaq_s32(isum[half], lo[half], sl), hi[half], sh);
                }
            }
            int32_t msum[8];
            for (int r = 0; r < 8; r++) {
                msum[r] = 0;
                for (int s = 0; s < 8; s++)
                    msum[r] += v[2 + s / 4][16 * (s / 2 % 2) + 2 * r + s % 2] * (x[i].bsums[2 * s] + x[i].bsums[2 * s + 1]);
            }
            for (int half = 0; half < 2; half++) {
                float d[4], dm[4], ms[4];
                for (int r = 0; r < 4; r++) {
                    d[r] = qk_f16_at(b + 2 * (4 * half + r));
                    dm[r] = qk_f16_at(b + 16 + 2 * (4 * half + r));
                    ms[r] = (float)msum[4 * half + r];
                }
                const float32x4_t yd = vdupq_n_f32(x[i].d);
                const float32x4_t part = vmlsq_f32(vmulq_f32(vld1q_f32(d), vcvtq_f32_s32(isum[half])), vld1q_f32(dm),
                                                   vld1q_f32(ms));
                acc[half] = vmlaq_f32(acc[half], yd, part);
            }
        }
        vst1q_f32(out + 8 * t, acc[0]);
        vst1q_f32(out + 8 * t + 4, acc[1]);
    }
}

/* Q8_0_R8: each 32-byte chunk is 4 weights of 8 rows; SDOT of signed weights and 4 broadcast activations. */
void qk_dot_q8_0_r8_neon(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        float32x4_t acc[2] = {vdupq_n_f32(0.0f), vdupq_n_f32(0.0f)};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 272;
            int32x4_t s[2] = {vdupq_n_s32(0), vdupq_n_s32(0)};
            for (int c = 0; c < 8; c++) {
                int32_t y4;
                memcpy(&y4, x[i].qs + 4 * c, 4);
                const int8x16_t y = vreinterpretq_s8_s32(vdupq_n_s32(y4));
                for (int half = 0; half < 2; half++)
                    s[half] = sdot(s[half], vld1q_s8((const int8_t *)b + 16 + 32 * c + 16 * half), y);
            }
            for (int half = 0; half < 2; half++) {
                float d[4];
                for (int r = 0; r < 4; r++) d[r] = qk_f16_at(b + 2 * (4 * half + r)) * x[i].d;
                acc[half] = vmlaq_f32(acc[half], vld1q_f32(d), vcvtq_f32_s32(s[half]));
            }
        }
        vst1q_f32(out + 8 * t, acc[0]);
        vst1q_f32(out + 8 * t + 4, acc[1]);
    }
}

#endif
