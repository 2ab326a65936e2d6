/* exp, silu and the GLU activations in plain C loops the compiler vectorises (libm's expf stays one call per value,
 * 8 % of a gpt-oss prompt's time). Callers wrap their row loops in QK_VECTOR_CLONES so the loop is built for
 * AVX-512, AVX2 and the baseline, chosen once at load by the CPU. */
#ifndef MOERUN_VEXP_H
#define MOERUN_VEXP_H

#include <math.h>
#include <stdint.h>

#if defined(__x86_64__) && defined(__linux__) && (defined(__clang__) || defined(__GNUC__))
#define QK_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define QK_VECTOR_CLONES
#endif

/* e^x for x clamped to [-87, 87]: x = m ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r times 2^m (relative
 * error ~2e-7). */
static inline float qk_vexp(float x) {
    x = x < -87.0f ? -87.0f : x > 87.0f ? 87.0f : x;
    const float m = nearbyintf(x * 1.44269504088896341f);
    const float r = (x - m * 0.693145751953125f) - m * 1.428606765330187045e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    union { int32_t i; float f; } e = {.i = ((int32_t)m + 127) * (1 << 23)};
    return p * e.f;
}

/* x / (1 + e^-x) */
static inline float qk_vsilu(float x) { return x / (1.0f + qk_vexp(-x)); }

/* gpt-oss's clamped SwiGLU (transformers' GptOssExperts._apply_gate). */
static inline float qk_vswiglu_oai(float g, float u, float alpha, float limit) {
    g = g > limit ? limit : g;
    u = u < -limit ? -limit : u > limit ? limit : u;
    return g / (1.0f + qk_vexp(-alpha * g)) * (u + 1.0f);
}

#endif
