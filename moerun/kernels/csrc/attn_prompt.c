/* A prompt's causal GQA attention (issue 21): flash-style, one pass over the keys with a running max and sum per
 * query row, so no [T, S] score matrix is stored and the keys a query cannot see are never read.
 *
 * A work item is one KV head and a block of consecutive queries: its rows are (query, query head of that KV
 * head), about ROWS_PER of them. Keys go in chunks (KC, NC for the portable set); the AVX-512 set transposes every
 * head's keys once per call ([D][16] per 16 keys: a copy of K, S * nkv * D floats) and a chunk of them then serves
 * every row of an item from L1 (scores of 8 rows x 32 keys per step); the weighted values go into an item-local
 * output buffer, two rows per read of a value row. Per row, the visible keys are
 * one index range [lo, hi) (k_pos ascending: causal, and the window's start); a chunk outside every row's range
 * of a tile is skipped. Every value is computed by one thread in a fixed order: results do not depend on the
 * thread count. The AVX-512 set (ISA_VNNI) and the portable one run the same steps; their float sums differ
 * only in order. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "matmul.h"
#include "pool.h"
#include "qk.h"

#if QK_X86
#include <immintrin.h>
#define QK_AP_TARGET __attribute__((target("avx512f,fma")))
#endif

#define NC 16        /* keys per chunk of the portable set */
#define KC 64        /* keys per chunk of the AVX-512 set: four vectors of scores per row */
#define MR 8         /* rows per tile of the score product */
#define ROWS_PER 128 /* rows (queries x heads of a group) per work item, about */
#define MAX_D 256

typedef struct {
    const float *q, *k, *v, *sinks;
    const int64_t *lo, *hi; /* per query: visible key index range */
    int64_t T, S, nh, nkv, g, D, Dv, qb, nblocks;
    float scale;
    int isa;
    float *kt;              /* AVX-512 set: every KV head's keys transposed by 16, [nkv][S16 / 16][D][16] */
    int64_t S16;
    float *obuf;            /* per thread: qb * g * Dv floats, then 2 * qb * g (running max, sum) */
    int64_t obuf_floats;
    float *out;
    atomic_long next;
} ap_ctx;

/* ---------------------------------------------------------------------------------- portable */

static void ap_item_scalar(const ap_ctx *c, int64_t h, int64_t t0, int64_t t1, float *o, float *mx, float *sm) {
    const int64_t g = c->g, D = c->D, Dv = c->Dv, nrows = (t1 - t0) * g;
    int64_t klo = c->lo[t0], khi = c->hi[t1 - 1];
    for (int64_t t = t0; t < t1; t++) {
        klo = c->lo[t] < klo ? c->lo[t] : klo;
        khi = c->hi[t] > khi ? c->hi[t] : khi;
    }
    for (int64_t k0 = klo; k0 < khi; k0 += NC) {
        const int64_t nk = khi - k0 < NC ? khi - k0 : NC;
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t t = t0 + r / g, head = h * g + r % g;
            const int64_t a = c->lo[t] > k0 ? c->lo[t] - k0 : 0, b = c->hi[t] - k0 < nk ? c->hi[t] - k0 : nk;
            if (a >= b) continue;
            const float *qr = c->q + (t * c->nh + head) * D;
            float s[NC], cmax = -INFINITY;
            for (int64_t j = a; j < b; j++) {
                const float *kr = c->k + ((k0 + j) * c->nkv + h) * D;
                float acc = 0.0f;
                for (int64_t d = 0; d < D; d++) acc += qr[d] * kr[d];
                s[j] = acc * c->scale;
                cmax = s[j] > cmax ? s[j] : cmax;
            }
            const float mnew = cmax > mx[r] ? cmax : mx[r], alpha = expf(mx[r] - mnew);
            float *orow = o + r * Dv, psum = 0.0f;
            for (int64_t i = 0; i < Dv; i++) orow[i] *= alpha;
            for (int64_t j = a; j < b; j++) {
                const float p = expf(s[j] - mnew);
                psum += p;
                const float *vr = c->v + ((k0 + j) * c->nkv + h) * Dv;
                for (int64_t i = 0; i < Dv; i++) orow[i] += p * vr[i];
            }
            sm[r] = sm[r] * alpha + psum;
            mx[r] = mnew;
        }
    }
}

/* ---------------------------------------------------------------------------------- AVX-512 */

#if QK_X86
/* exp(x) for 16 lanes: x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial for e^r, 2^n by scalef (lanes at
 * -inf give 0). Relative error ~2e-7. */
static inline __attribute__((always_inline, target("avx512f,fma"))) __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* Vectors i..i+w of two output rows: o = o * alpha + sum_j p_j v_j over keys [jlo, jb) (p 0 outside a row's keys;
 * a row not `one` / `two` is not written). Inlined with w = 4 for the whole quarters. */
static inline __attribute__((always_inline, target("avx512f,fma"))) void pv_part(
    float *o0, float *o1, __m512 al0, __m512 al1, const float *p0, const float *p1, const float *vc, int64_t vstride,
    int64_t jlo, int64_t jb, int one, int two, int64_t i, const int w) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 x0[4], x1[4];
    for (int q = 0; q < w; q++) {
        x0[q] = _mm512_mul_ps(_mm512_loadu_ps(o0 + (i + q) * 16), al0);
        x1[q] = _mm512_mul_ps(_mm512_loadu_ps(o1 + (i + q) * 16), al1);
    }
    for (int64_t j = jlo; j < jb; j++) {
        const __m512 w0 = one ? _mm512_set1_ps(p0[j]) : zero, w1 = two ? _mm512_set1_ps(p1[j]) : zero;
        const float *vr = vc + j * vstride;
        for (int q = 0; q < w; q++) {
            const __m512 vv = _mm512_loadu_ps(vr + q * 16);
            x0[q] = _mm512_fmadd_ps(w0, vv, x0[q]);
            x1[q] = _mm512_fmadd_ps(w1, vv, x1[q]);
        }
    }
    for (int q = 0; q < w; q++) {
        if (one) _mm512_storeu_ps(o0 + (i + q) * 16, x0[q]);
        if (two) _mm512_storeu_ps(o1 + (i + q) * 16, x1[q]);
    }
}

QK_AP_TARGET static void ap_item_avx512(const ap_ctx *c, int64_t h, int64_t t0, int64_t t1, float *o, float *mx,
                                        float *sm) {
    const int64_t g = c->g, D = c->D, Dv = c->Dv, nrows = (t1 - t0) * g, nv = Dv / 16;
    int64_t klo = c->lo[t0], khi = c->hi[t1 - 1];
    for (int64_t t = t0; t < t1; t++) {
        klo = c->lo[t] < klo ? c->lo[t] : klo;
        khi = c->hi[t] > khi ? c->hi[t] : khi;
    }
    const float *kth = c->kt + h * c->S16 * D; /* this head's keys, transposed by 16 (ap_transpose_task) */
    _Alignas(64) float s[MR * KC];
    const __m512 scale = _mm512_set1_ps(c->scale), ninf = _mm512_set1_ps(-INFINITY);
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const int64_t vstride = c->nkv * Dv;
    for (int64_t k0 = klo / 16 * 16; k0 < khi; k0 += KC) {
        const int64_t nk = khi - k0 < KC ? khi - k0 : KC, nsub = (nk + 15) / 16;
        const float *kt = kth + k0 * D; /* kt[(j / 16 * D + d) * 16 + j % 16]: key k0 + j, element d */
        const float *vc = c->v + (k0 * c->nkv + h) * Dv;
        for (int64_t r0 = 0; r0 < nrows; r0 += MR) {
            const int mr = (int)(nrows - r0 < MR ? nrows - r0 : MR);
            int64_t a[MR], b[MR];
            const float *qr[MR];
            int any = 0;
            for (int m = 0; m < MR; m++) {
                const int64_t r = r0 + (m < mr ? m : 0), t = t0 + r / g;
                a[m] = c->lo[t] > k0 ? c->lo[t] - k0 : 0;
                b[m] = m < mr ? (c->hi[t] - k0 < nk ? c->hi[t] - k0 : nk) : 0;
                any |= a[m] < b[m];
                qr[m] = c->q + (t * c->nh + h * g + r % g) * D;
            }
            if (!any) continue;
            for (int64_t u = 0; u < nsub; u += 2) { /* scores of 32 keys (two vectors) for the tile's rows */
                __m512 acc[2][MR];
                for (int m = 0; m < MR; m++) acc[0][m] = acc[1][m] = _mm512_setzero_ps();
                const float *k0p = kt + u * D * 16, *k1p = kt + (u + 1 < nsub ? u + 1 : u) * D * 16;
                for (int64_t d = 0; d < D; d++) {
                    const __m512 kd0 = _mm512_load_ps(k0p + d * 16), kd1 = _mm512_load_ps(k1p + d * 16);
                    for (int m = 0; m < MR; m++) {
                        const __m512 qd = _mm512_set1_ps(qr[m][d]);
                        acc[0][m] = _mm512_fmadd_ps(qd, kd0, acc[0][m]);
                        acc[1][m] = _mm512_fmadd_ps(qd, kd1, acc[1][m]);
                    }
                }
                for (int x = 0; x < 2 && u + x < nsub; x++) {
                    const __m512i lane = _mm512_add_epi32(iota, _mm512_set1_epi32((int)((u + x) * 16)));
                    for (int m = 0; m < MR; m++) {
                        const __mmask16 vis = _mm512_cmpge_epi32_mask(lane, _mm512_set1_epi32((int)a[m])) &
                                              _mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32((int)b[m]));
                        _mm512_store_ps(s + m * KC + (u + x) * 16,
                                        _mm512_mask_mov_ps(ninf, vis, _mm512_mul_ps(acc[x][m], scale)));
                    }
                }
            }
            float al[MR];
            for (int m = 0; m < mr; m++) { /* running max and sum; s becomes the weights (0 where hidden) */
                if (a[m] >= b[m]) continue;
                const int64_t r = r0 + m;
                float *sr = s + m * KC;
                __m512 vmax = ninf;
                for (int64_t u = 0; u < nsub; u++) vmax = _mm512_max_ps(vmax, _mm512_load_ps(sr + u * 16));
                const float cmax = _mm512_reduce_max_ps(vmax), mnew = cmax > mx[r] ? cmax : mx[r];
                al[m] = mx[r] == -INFINITY ? 0.0f : expf(mx[r] - mnew);
                __m512 vsum = _mm512_setzero_ps();
                for (int64_t u = 0; u < nsub; u++) {
                    const __m512 su = _mm512_load_ps(sr + u * 16); /* hidden keys: exactly 0 */
                    const __m512 e = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(su, ninf, _CMP_NEQ_OQ),
                                                         exp16(_mm512_sub_ps(su, _mm512_set1_ps(mnew))));
                    vsum = _mm512_add_ps(vsum, e);
                    _mm512_store_ps(sr + u * 16, e);
                }
                sm[r] = sm[r] * al[m] + _mm512_reduce_add_ps(vsum);
                mx[r] = mnew;
            }
            for (int m = 0; m < mr; m += 2) { /* o = o * alpha + p V, two rows per read of V */
                const int two = m + 1 < mr && a[m + 1] < b[m + 1];
                if (a[m] >= b[m] && !two) continue;
                const int64_t ja = a[m] < b[m] ? a[m] : a[m + 1], jb = two && b[m + 1] > b[m] ? b[m + 1] : b[m];
                const int64_t jlo = two && a[m] < b[m] && a[m + 1] < ja ? a[m + 1] : ja;
                const float *p0 = s + m * KC, *p1 = s + (m + 1) * KC;
                float *o0 = o + (r0 + m) * Dv, *o1 = o + (r0 + m + (two ? 1 : 0)) * Dv;
                const __m512 al0 = _mm512_set1_ps(a[m] < b[m] ? al[m] : 1.0f), al1 = _mm512_set1_ps(two ? al[m + 1] : 1.0f);
                const int one = a[m] < b[m];
                int64_t i = 0;
                for (; i + 4 <= nv; i += 4) pv_part(o0, o1, al0, al1, p0, p1, vc + i * 16, vstride, jlo, jb, one, two, i, 4);
                if (i < nv) pv_part(o0, o1, al0, al1, p0, p1, vc + i * 16, vstride, jlo, jb, one, two, i, (int)(nv - i));
            }
        }
    }
}
#endif

/* ------------------------------------------------------------------------------------- the call */

/* The AVX-512 set's prologue: each KV head's keys transposed by 16 once per call (not once per work item); keys past
 * the last repeat it (they are always masked). */
static void ap_transpose_task(void *p, int tid, int nth) {
    ap_ctx *c = p;
    const int64_t groups = c->S16 / 16, total = c->nkv * groups, D = c->D;
    for (int64_t it = tid; it < total; it += nth) {
        const int64_t h = it / groups, g0 = it % groups * 16;
        float *dst = c->kt + (h * c->S16 + g0) * D;
        for (int64_t j = 0; j < 16; j++) {
            const int64_t key = g0 + j < c->S ? g0 + j : c->S - 1;
            const float *kr = c->k + (key * c->nkv + h) * D;
            for (int64_t d = 0; d < D; d++) dst[d * 16 + j] = kr[d];
        }
    }
}

static void ap_task(void *p, int tid, int nth) {
    ap_ctx *c = p;
    (void)nth;
    float *o = c->obuf + (int64_t)tid * c->obuf_floats;
    const int64_t total = c->nkv * c->nblocks;
    for (int64_t it; (it = atomic_fetch_add_explicit(&c->next, 1, memory_order_relaxed)) < total;) {
        const int64_t blk = c->nblocks - 1 - it / c->nkv, h = it % c->nkv; /* the longest blocks first */
        const int64_t t0 = blk * c->qb, t1 = t0 + c->qb < c->T ? t0 + c->qb : c->T, nrows = (t1 - t0) * c->g;
        float *mx = o + c->qb * c->g * c->Dv, *sm = mx + c->qb * c->g;
        memset(o, 0, (size_t)(nrows * c->Dv) * sizeof(float));
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t head = h * c->g + r % c->g;
            mx[r] = c->sinks ? c->sinks[head] : -INFINITY; /* a sink: one more logit, exp(0) = 1 in the sum */
            sm[r] = c->sinks ? 1.0f : 0.0f;
        }
#if QK_X86
        if (c->isa == ISA_VNNI)
            ap_item_avx512(c, h, t0, t1, o, mx, sm);
        else
#endif
            ap_item_scalar(c, h, t0, t1, o, mx, sm);
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t t = t0 + r / c->g, head = h * c->g + r % c->g;
            const float inv = sm[r] > 0.0f ? 1.0f / sm[r] : 0.0f;
            float *dst = c->out + (t * c->nh + head) * c->Dv;
            for (int64_t i = 0; i < c->Dv; i++) dst[i] = o[r * c->Dv + i] * inv;
        }
    }
}

int qk_attn_prompt(int isa, const float *q, int64_t T, int64_t nh, int64_t D, const float *k, const float *v,
                   int64_t S, int64_t nkv, int64_t Dv, const int64_t *q_pos, const int64_t *k_pos, float scale,
                   int64_t window, const float *sinks, float *out) {
    if (!qk_kernels(isa)) return QK_EISA;
    if (T < 1 || S < 1 || nkv < 1 || nh % nkv || D < 1 || D > MAX_D || Dv < 16 || Dv % 16 || window < 0)
        return QK_ESHAPE;
    for (int64_t j = 1; j < S; j++)
        if (k_pos[j] <= k_pos[j - 1]) return QK_ESHAPE; /* ascending */
    int64_t *lo = malloc((size_t)(2 * T) * sizeof(int64_t));
    if (!lo) return QK_ENOMEM;
    int64_t *hi = lo + T;
    for (int64_t t = 0; t < T; t++) { /* hi: keys at positions <= q_pos[t]; lo: above q_pos[t] - window */
        int64_t a = 0, b = S;
        while (a < b) {
            const int64_t m = (a + b) / 2;
            if (k_pos[m] <= q_pos[t]) a = m + 1; else b = m;
        }
        hi[t] = a;
        a = 0, b = S;
        while (window && a < b) {
            const int64_t m = (a + b) / 2;
            if (k_pos[m] <= q_pos[t] - window) a = m + 1; else b = m;
        }
        lo[t] = window ? a : 0;
    }
    const int64_t g = nh / nkv, qb = ROWS_PER / g > 1 ? ROWS_PER / g : 1;
    const int nth = qk_pool_threads();
    const int64_t obuf_floats = qb * g * Dv + 2 * qb * g + 16;
    float *obuf = malloc((size_t)(nth * obuf_floats) * sizeof(float));
    if (!obuf) {
        free(lo);
        return QK_ENOMEM;
    }
    ap_ctx c = {.q = q, .k = k, .v = v, .sinks = sinks, .lo = lo, .hi = hi, .T = T, .S = S, .nh = nh, .nkv = nkv, .g = g,
                .D = D, .Dv = Dv, .qb = qb, .nblocks = (T + qb - 1) / qb, .scale = scale, .isa = isa, .obuf = obuf,
                .obuf_floats = obuf_floats, .out = out};
    atomic_init(&c.next, 0);
    if (isa == ISA_VNNI) {
        c.S16 = (S + 15) / 16 * 16;
        c.kt = aligned_alloc(64, (size_t)(nkv * c.S16 * D) * sizeof(float)); /* a multiple of 64 bytes: S16 % 16 = 0 */
        if (!c.kt) {
            free(obuf);
            free(lo);
            return QK_ENOMEM;
        }
        qk_pool_run(ap_transpose_task, &c);
    }
    qk_pool_run(ap_task, &c);
    free(c.kt);
    free(obuf);
    free(lo);
    return QK_OK;
}
