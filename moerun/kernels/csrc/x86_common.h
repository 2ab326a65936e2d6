/* Helpers for the x86 kernel files. A translation unit includes this header once, for one kernel
 * set: plain AVX2 (+FMA, F16C), or, with QK_VNNI defined as 1 first, the same kernels using the
 * AVX-512 VNNI dot-product instructions on 256-bit vectors (AVX512VL). Every function is compiled
 * through a target attribute, so the module builds with default flags, and the code only runs after
 * qk_kernels() has checked the CPU. Function names get the set's suffix through QK_NAME. */
#ifndef MOERUN_X86_COMMON_H
#define MOERUN_X86_COMMON_H

#include "pool.h"
#include "qk.h"

#if QK_X86
#include <immintrin.h>

#ifndef QK_VNNI
#define QK_VNNI 0
#endif
#if QK_VNNI
#define QK_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512vnni"
#define QK_NAME(base) base##_vnni
#else
#define QK_TARGET "avx2,fma,f16c"
#define QK_NAME(base) base##_avx2
#endif

#define QK_AVX2 __attribute__((target(QK_TARGET)))
#define QK_AVX2_INLINE static inline __attribute__((always_inline, target(QK_TARGET)))

/* acc + the pairwise int16 products of a and b, summed into int32 lanes (vpdpwssd with VNNI). */
QK_AVX2_INLINE __m256i madd_acc(__m256i acc, __m256i a, __m256i b) {
#if QK_VNNI
    return _mm256_dpwssd_epi32(acc, a, b);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(a, b));
#endif
}

/* h's bits moved by s places (left if s > 0) in 16-bit lanes, s a constant once inlined: for |s| < 8 a byte's bits
 * s.. (or ..7 - s) come from its own byte, the rest from its neighbour, which the callers' masks drop. */
QK_AVX2_INLINE __m256i shift16(__m256i h, const int s) {
    return s > 0 ? _mm256_slli_epi16(h, s) : s < 0 ? _mm256_srli_epi16(h, -s) : h;
}

/* exp on 8 lanes: Cephes' expf (range reduction by ln 2 in two parts, degree-5 polynomial), within
 * 2 ulp of expf on the softmax's inputs (<= 0); below -87.3 it flushes towards 0. */
QK_AVX2_INLINE __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
    __m256 fx = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

/* Weight rows stream from DRAM: prefetch this many bytes ahead of the block being read (about the
 * memory latency times one core's bandwidth; measured best among 0.5-4 KB on Zen 4, where it lifts a
 * T = 1 Q4_K GEMV from ~11 to ~16 GB/s per thread). Past the end of a row it fetches the next row,
 * which is usually the next one read. Prefetches never fault. */
#define QK_PREFETCH_AHEAD 2048

/* The interleaved kernels' prefetch, with hint (QK_PF_*, pool.h), of the lines that start within the `bytes` from `pf`
 * bytes past b (pf: qk_prefetch() on one-token passes, else 0): over a run of contiguous blocks, each line once. With
 * near > 0 (qk_prefetch_near(), one-token passes) the lines `near` bytes past b go to L1 as well.
 * _mm_prefetch takes its hint as a compile-time constant: where the kernel is instantiated per hint (R8_KERNEL) the
 * switch folds away; elsewhere it is one predictable branch per block, outside the loop over lines. */
QK_AVX2_INLINE void r8_prefetch(const uint8_t *b, int bytes, int64_t pf, int64_t near, const int hint) {
    if (!pf) return;
    if (near) {
        const uintptr_t s = (uintptr_t)b + (uintptr_t)near, e = s + (uintptr_t)bytes;
        for (uintptr_t p = (s + 63) & ~(uintptr_t)63; p < e; p += 64) _mm_prefetch((const char *)p, _MM_HINT_T0);
    }
    const uintptr_t s = (uintptr_t)b + (uintptr_t)pf, e = s + (uintptr_t)bytes;
    uintptr_t p = (s + 63) & ~(uintptr_t)63;
    switch (hint) {
    case QK_PF_T0:
        for (; p < e; p += 64) _mm_prefetch((const char *)p, _MM_HINT_T0);
        break;
    case QK_PF_T2:
        for (; p < e; p += 64) _mm_prefetch((const char *)p, _MM_HINT_T2);
        break;
    case QK_PF_NTA:
        for (; p < e; p += 64) _mm_prefetch((const char *)p, _MM_HINT_NTA);
        break;
    default:
        for (; p < e; p += 64) _mm_prefetch((const char *)p, _MM_HINT_T1);
        break;
    }
}

/* An interleaved kernel's passes of one token, with the prefetch hint a compile-time constant: one loop per hint,
 * chosen once per call. IMPL(nb, w, x, nt, out, hint). */
#define QK_PF_ONE(IMPL, nb, w, x, out)                         \
    switch (qk_prefetch_hint()) {                              \
    case QK_PF_T0: IMPL(nb, w, x, 1, out, QK_PF_T0); break;    \
    case QK_PF_T2: IMPL(nb, w, x, 1, out, QK_PF_T2); break;    \
    case QK_PF_NTA: IMPL(nb, w, x, 1, out, QK_PF_NTA); break;  \
    default: IMPL(nb, w, x, 1, out, QK_PF_T1); break;          \
    }

/* l2 (one token, and qk_prefetch() > 0: a CPU where the interleaved kernels prefetch too) prefetches into L2, not L1:
 * on the Intel VM +8-11% for one GGUF-layout matrix from DRAM (RESULTS.md); Zen 4's best stays T0. */
QK_AVX2_INLINE void avx2_prefetch_block(const uint8_t *b, int bytes, int l2) {
    if (l2)
        for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)b + QK_PREFETCH_AHEAD + o, _MM_HINT_T1);
    else
        for (int o = 0; o < bytes; o += 64) _mm_prefetch((const char *)b + QK_PREFETCH_AHEAD + o, _MM_HINT_T0);
}

QK_AVX2_INLINE float avx2_f16(const uint8_t *p) { return _cvtsh_ss(qk_rd16(p)); }

QK_AVX2_INLINE float avx2_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

QK_AVX2_INLINE float avx2_hsum128(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Sum of w[i] * y[i] over 32 signed bytes, as 8 int32 lanes (each the sum of 4 products).
 * maddubs wants an unsigned first operand, so it gets |w| and y takes w's sign. |w| may be 128
 * (w = -128 wraps to 0x80, which maddubs reads as 128); y must lie in [-127, 127]. */
QK_AVX2_INLINE __m256i avx2_dot32_i8(__m256i w, __m256i y) {
#if QK_VNNI /* vpdpbusd: u8 x s8, four products per int32 lane, no int16 step */
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
#else
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(y, w));
    return _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
#endif
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles in the low 128-bit lane, high nibbles in the high. */
QK_AVX2_INLINE __m256i avx2_nibbles32(const uint8_t *p) {
    const __m128i b = _mm_loadu_si128((const __m128i *)p);
    const __m256i v = _mm256_insertf128_si256(_mm256_castsi128_si256(b), _mm_srli_epi16(b, 4), 1);
    return _mm256_and_si256(v, _mm256_set1_epi8(15));
}

/* Instantiate a kernel body for a compile-time token count, so its per-token arrays live in
 * registers and its token loops unroll. */
/* Up to 8 tokens (the interleaved kernels' max_nt): in one call with VNNI (32 vector registers), in calls of
 * at most 4 without. out holds 8 rows per token. */
#if QK_VNNI
#define QK_NT_DISPATCH8(IMPL, nb, w, x, nt, out) \
    switch (nt) {                                \
    case 1: IMPL(nb, w, x, 1, out); break;       \
    case 2: IMPL(nb, w, x, 2, out); break;       \
    case 3: IMPL(nb, w, x, 3, out); break;       \
    case 4: IMPL(nb, w, x, 4, out); break;       \
    case 5: IMPL(nb, w, x, 5, out); break;       \
    case 6: IMPL(nb, w, x, 6, out); break;       \
    case 7: IMPL(nb, w, x, 7, out); break;       \
    default: IMPL(nb, w, x, 8, out); break;      \
    }
#else
#define QK_NT_DISPATCH8(IMPL, nb, w, x, nt, out)                                   \
    for (int t0_ = 0; t0_ < (nt); t0_ += 4) {                                      \
        const int n_ = (nt) - t0_ < 4 ? (nt) - t0_ : 4;                           \
        QK_NT_DISPATCH(IMPL, nb, w, (x) + t0_, n_, (out) + 8 * t0_)                 \
    }
#endif

#define QK_NT_DISPATCH(IMPL, nb, w, x, nt, out)  \
    switch (nt) {                                \
    case 1: IMPL(nb, w, x, 1, out); break;       \
    case 2: IMPL(nb, w, x, 2, out); break;       \
    case 3: IMPL(nb, w, x, 3, out); break;       \
    default: IMPL(nb, w, x, 4, out); break;      \
    }

#endif
#endif
