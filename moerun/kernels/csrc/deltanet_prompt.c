/* Gated DeltaNet's delta rule over T positions of one sequence (moerun/model/deltanet.py's delta_steps: the
 * recurrence itself, not the chunked form). A state column depends only on its own column of v, so a work item is
 * one value head and a block of state columns [dk, BW] (32 KB for 64 columns: it stays in L1), run through all T
 * positions (work items are handed out as threads come). One pass over the block per position: with S the block after position t-1 and kv = S^T k_t,
 *
 *     delta = beta_t (v_t - exp(g_t) kv);   S <- exp(g_t) S + k_t delta^T;   o_t = S^T q_t;   kv <- S^T k_{t+1}
 *
 * the last two accumulated while each row of S is written. q and k enter raw: their L2 norms (and dk^-1/2) scale
 * delta and o per position instead. Each item is computed by one thread in a fixed order, so results do not depend
 * on the thread count. The AVX-512 and AVX2 sets use FMA; the portable set separate products and sums.
 *
 * With the output gate, a second pass RMS-norms each head's output and multiplies it by silu(z) (gated_norm). The
 * prompt's conv1d (+ SiLU) is here too: work items are blocks of channels, each run through the T positions. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>

#include "deltanet.h"
#include "matmul.h"
#include "pool.h"
#include "qk.h"
#include "vexp.h"

#if QK_X86
#include <immintrin.h>
#endif

#define NVEC 4 /* vectors per column block: 64 columns with AVX-512, 32 with AVX2 */
#define SCALAR_BW 64
#define LPAD 16 /* the SIMD sets work on a copy of their block, rows 64 + LPAD floats apart (1.2x over in place) */

#define NORM_ITEM 16 /* positions per work item of the first pass */

typedef struct {
    const qk_delta_prompt_args *a;
    int64_t bw, blocks; /* columns per block, blocks per head */
    float *rn;          /* [T, nk, 2] k's inverse L2 norm, q's times dk^-1/2 */
    float *d;           /* [T, nv] exp(g) */
    float *buf;         /* per thread: a block of the state, rows LPAD floats apart beyond its width */
    int64_t buf_floats;
    atomic_long next;
} prompt_job;

static float sumsq(const float *x, int64_t n) {
    float acc[8] = {0}, ss = 0.0f;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++) acc[l] += x[i + l] * x[i + l];
    for (; i < n; i++) acc[0] += x[i] * x[i];
    for (int l = 0; l < 8; l++) ss += acc[l];
    return ss;
}

static float rnorm(const float *x, int64_t n) { return 1.0f / sqrtf(sumsq(x, n) + 1e-6f); }

static void norm_task(void *ctx, int tid, int nth) {
    (void)tid, (void)nth;
    prompt_job *j = ctx;
    const qk_delta_prompt_args *a = j->a;
    for (int64_t it; (it = atomic_fetch_add(&j->next, 1)) * NORM_ITEM < a->T;) {
        const int64_t t1 = (it + 1) * NORM_ITEM < a->T ? (it + 1) * NORM_ITEM : a->T;
        for (int64_t t = it * NORM_ITEM; t < t1; t++) {
            for (int64_t kh = 0; kh < a->nk; kh++) {
                j->rn[(t * a->nk + kh) * 2] = rnorm(a->k + t * a->sk + kh * a->dk, a->dk);
                j->rn[(t * a->nk + kh) * 2 + 1] = rnorm(a->q + t * a->sq + kh * a->dk, a->dk) / sqrtf((float)a->dk);
            }
            for (int64_t h = 0; h < a->nv; h++) j->d[t * a->nv + h] = expf(a->g[t * a->nv + h]);
        }
    }
}

static int64_t key_head(const qk_delta_prompt_args *a, int64_t h) {
    return a->tiled ? h % a->nk : h / (a->nv / a->nk);
}

/* Per position t of head h: exp(g), beta, k's inverse norm, q's (times dk^-1/2); the raw k and q rows. */
typedef struct {
    float d, beta, rk, rq;
    const float *k, *q, *v;
} pos_t;

static pos_t position(const prompt_job *j, int64_t h, int64_t kh, int64_t t) {
    const qk_delta_prompt_args *a = j->a;
    return (pos_t){.d = j->d[t * a->nv + h], .beta = a->beta[t * a->nv + h], .rk = j->rn[(t * a->nk + kh) * 2],
                   .rq = j->rn[(t * a->nk + kh) * 2 + 1], .k = a->k + t * a->sk + kh * a->dk,
                   .q = a->q + t * a->sq + kh * a->dk, .v = a->v + t * a->sv + h * a->dv};
}

/* The decay is kept apart while it is above RESCALE: the block holds S / c, c the product of the decays since it was
 * last multiplied out, so a position costs S + k delta^T / c (one product per element less) and S^T q, S^T k come
 * out times c. A position that would take c below RESCALE (or above 1 / RESCALE) multiplies c into the block (c = 1
 * again). */
#define RESCALE 1e-12f

static void item_scalar(const prompt_job *pj, int64_t h, int64_t c0, int64_t w) {
    const qk_delta_prompt_args *a = pj->a;
    const int64_t dk = a->dk, dv = a->dv, kh = key_head(a, h);
    float *S = a->state + h * dk * dv + c0;
    float kv[SCALAR_BW], o[SCALAR_BW], kn[SCALAR_BW], dd[SCALAR_BW], c = 1.0f;
    pos_t p = position(pj, h, kh, 0);
    for (int64_t j = 0; j < w; j++) kv[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < w; j++) kv[j] += S[i * dv + j] * p.k[i];
    for (int64_t t = 0; t < a->T; t++) {
        const pos_t nx = t + 1 < a->T ? position(pj, h, kh, t + 1) : p;
        const float cn = c * p.d, m = cn * p.rk;
        const int full = !(cn >= RESCALE && cn <= 1.0f / RESCALE);
        const float br = p.beta * p.rk / (full ? 1.0f : cn);
        for (int64_t j = 0; j < w; j++) dd[j] = (p.v[c0 + j] - kv[j] * m) * br, o[j] = kn[j] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            const float ki = p.k[i], qi = p.q[i], xi = nx.k[i];
            float *Si = S + i * dv;
            for (int64_t j = 0; j < w; j++) {
                const float s = (full ? Si[j] * cn : Si[j]) + ki * dd[j];
                Si[j] = s;
                o[j] += s * qi;
                kn[j] += s * xi;
            }
        }
        c = full ? 1.0f : cn;
        float *out = a->out + (t * a->nv + h) * dv + c0;
        for (int64_t j = 0; j < w; j++) out[j] = o[j] * (p.rq * c), kv[j] = kn[j];
        p = nx;
    }
    if (c != 1.0f)
        for (int64_t i = 0; i < dk; i++)
            for (int64_t j = 0; j < w; j++) S[i * dv + j] *= c;
}

#if QK_X86
/* One item with n vectors of L lanes (n <= NVEC, a constant where inlined). */
#define DP_ROWS(VEC, L, SET1, STORE, FMA, FIRST)                                                                      \
    for (int64_t i = 0; i < dk; i++) {                                                                                \
        const VEC ki = SET1(p.k[i]), qi = SET1(p.q[i]), xi = SET1(nx.k[i]);                                           \
        float *Si = S + i * ls;                                                                                       \
        for (int j = 0; j < n; j++) {                                                                                 \
            const VEC s = FMA(ki, dd[j], FIRST);                                                                      \
            STORE(Si + j * L, s);                                                                                     \
            o[j] = FMA(s, qi, o[j]);                                                                                  \
            kn[j] = FMA(s, xi, kn[j]);                                                                                \
        }                                                                                                             \
    }

#define DP_ITEM(NAME, TARGET, VEC, L, LOAD, STORE, SET1, MUL, FMA, ZERO)                                              \
    static inline __attribute__((always_inline, target(TARGET))) void NAME(const prompt_job *pj, int64_t h,           \
                                                                           int64_t c0, const int n, int tid) {        \
        const qk_delta_prompt_args *a = pj->a;                                                                        \
        const int64_t dk = a->dk, dv = a->dv, kh = key_head(a, h);                                                    \
        float *G = a->state + h * dk * dv + c0, *S = pj->buf + tid * pj->buf_floats, c = 1.0f;                        \
        const int64_t ls = n * L + LPAD;                                                                              \
        for (int64_t i = 0; i < dk; i++)                                                                              \
            for (int j = 0; j < n; j++) STORE(S + i * ls + j * L, LOAD(G + i * dv + j * L));                          \
        VEC kv[NVEC], o[NVEC], kn[NVEC], dd[NVEC];                                                                    \
        pos_t p = position(pj, h, kh, 0);                                                                             \
        for (int j = 0; j < n; j++) kv[j] = ZERO();                                                                   \
        for (int64_t i = 0; i < dk; i++) {                                                                            \
            const VEC ki = SET1(p.k[i]);                                                                              \
            for (int j = 0; j < n; j++) kv[j] = FMA(LOAD(S + i * ls + j * L), ki, kv[j]);                             \
        }                                                                                                             \
        for (int64_t t = 0; t < a->T; t++) {                                                                          \
            const pos_t nx = t + 1 < a->T ? position(pj, h, kh, t + 1) : p;                                           \
            const float cn = c * p.d;                                                                                 \
            const int full = !(cn >= RESCALE && cn <= 1.0f / RESCALE);                                                \
            const VEC m = SET1(-(cn * p.rk)), br = SET1(p.beta * p.rk / (full ? 1.0f : cn)), d = SET1(cn);            \
            for (int j = 0; j < n; j++)                                                                               \
                dd[j] = MUL(FMA(kv[j], m, LOAD(p.v + c0 + j * L)), br), o[j] = ZERO(), kn[j] = ZERO();                \
            if (full) {                                                                                               \
                DP_ROWS(VEC, L, SET1, STORE, FMA, MUL(LOAD(Si + j * L), d))                                           \
            } else {                                                                                                  \
                DP_ROWS(VEC, L, SET1, STORE, FMA, LOAD(Si + j * L))                                                   \
            }                                                                                                         \
            c = full ? 1.0f : cn;                                                                                     \
            float *out = a->out + (t * a->nv + h) * dv + c0;                                                          \
            const VEC rq = SET1(p.rq * c);                                                                            \
            for (int j = 0; j < n; j++) STORE(out + j * L, MUL(o[j], rq)), kv[j] = kn[j];                             \
            p = nx;                                                                                                   \
        }                                                                                                             \
        const VEC cv = SET1(c);                                                                                       \
        for (int64_t i = 0; i < dk; i++)                                                                              \
            for (int j = 0; j < n; j++) STORE(G + i * dv + j * L, MUL(LOAD(S + i * ls + j * L), cv));                 \
    }

DP_ITEM(item512, "avx512f,fma", __m512, 16, _mm512_loadu_ps, _mm512_storeu_ps, _mm512_set1_ps, _mm512_mul_ps,
        _mm512_fmadd_ps, _mm512_setzero_ps)
DP_ITEM(item256, "avx2,fma", __m256, 8, _mm256_loadu_ps, _mm256_storeu_ps, _mm256_set1_ps, _mm256_mul_ps,
        _mm256_fmadd_ps, _mm256_setzero_ps)

__attribute__((target("avx512f,fma"))) static void item_avx512(const prompt_job *pj, int64_t h, int64_t c0,
                                                                int n, int tid) {
    switch (n) {
    case 4: item512(pj, h, c0, 4, tid); break;
    case 3: item512(pj, h, c0, 3, tid); break;
    case 2: item512(pj, h, c0, 2, tid); break;
    default: item512(pj, h, c0, 1, tid);
    }
}

__attribute__((target("avx2,fma"))) static void item_avx2(const prompt_job *pj, int64_t h, int64_t c0, int n,
                                                             int tid) {
    switch (n) {
    case 4: item256(pj, h, c0, 4, tid); break;
    case 3: item256(pj, h, c0, 3, tid); break;
    case 2: item256(pj, h, c0, 2, tid); break;
    default: item256(pj, h, c0, 1, tid);
    }
}
#endif

static void prompt_task(void *ctx, int tid, int nth) {
    (void)nth;
    prompt_job *j = ctx;
    const qk_delta_prompt_args *a = j->a;
    for (int64_t it; (it = atomic_fetch_add(&j->next, 1)) < a->nv * j->blocks;) {
        const int64_t h = it / j->blocks, c0 = it % j->blocks * j->bw;
        const int64_t w = a->dv - c0 < j->bw ? a->dv - c0 : j->bw;
#if QK_X86
        if (a->isa == ISA_VNNI && a->dv % 16 == 0) {
            item_avx512(j, h, c0, (int)(w / 16), tid);
            continue;
        }
        if (a->isa == ISA_AVX2 && a->dv % 8 == 0) {
            item_avx2(j, h, c0, (int)(w / 8), tid);
            continue;
        }
#endif
        item_scalar(j, h, c0, w);
    }
}

/* x / (1 + e^-x) over a row (vexp.h). */
static inline void silu_row(float *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = qk_vsilu(x[i]);
}

QK_VECTOR_CLONES static void gate_task(void *ctx, int tid, int nth) {
    (void)tid, (void)nth;
    prompt_job *j = ctx;
    const qk_delta_prompt_args *a = j->a;
    float sz[1024];
    for (int64_t it; (it = atomic_fetch_add(&j->next, 1)) * NORM_ITEM < a->T;) {
        const int64_t t1 = (it + 1) * NORM_ITEM < a->T ? (it + 1) * NORM_ITEM : a->T;
        for (int64_t t = it * NORM_ITEM; t < t1; t++)
            for (int64_t h = 0; h < a->nv; h++) {
                float *o = a->out + (t * a->nv + h) * a->dv;
                const float *z = a->z + t * a->sz + h * a->dv;
                const float rn = 1.0f / sqrtf(sumsq(o, a->dv) / (float)a->dv + a->eps);
                silu_row(sz, z, a->dv);
                for (int64_t c = 0; c < a->dv; c++) o[c] = a->norm[c] * (o[c] * rn) * sz[c];
            }
    }
}

int qk_delta_prompt(const qk_delta_prompt_args *a) {
    if (!qk_kernels(a->isa)) return QK_EISA;
    if (a->T < 1 || a->nk < 1 || a->nv < 1 || a->nv % a->nk || a->dk < 1 || a->dv < 1 || (a->z && a->dv > 1024))
        return QK_ESHAPE;
    prompt_job j = {.a = a, .bw = SCALAR_BW};
#if QK_X86
    if (a->isa == ISA_VNNI && a->dv % 16 == 0) j.bw = 16 * NVEC;
    else if (a->isa == ISA_AVX2 && a->dv % 8 == 0) j.bw = 8 * NVEC;
#endif
    j.blocks = (a->dv + j.bw - 1) / j.bw;
    j.rn = malloc((size_t)(a->T * (2 * a->nk + a->nv)) * sizeof(float));
    if (!j.rn) return QK_ENOMEM;
    j.d = j.rn + 2 * a->T * a->nk;
    atomic_init(&j.next, 0);
    qk_pool_run(norm_task, &j);
    j.buf_floats = (a->dk * (j.bw + LPAD) + 15) / 16 * 16;
    j.buf = aligned_alloc(64, (size_t)(qk_pool_threads() * j.buf_floats) * sizeof(float));
    if (!j.buf) {
        free(j.rn);
        return QK_ENOMEM;
    }
    atomic_init(&j.next, 0);
    qk_pool_run(prompt_task, &j);
    if (a->z) {
        atomic_init(&j.next, 0);
        qk_pool_run(gate_task, &j);
    }
    free(j.buf);
    free(j.rn);
    return QK_OK;
}

#define CONV_CB 256 /* channels per work item of the conv1d */

typedef struct {
    int64_t T, C, K, sx;
    const float *x, *w;
    float *state, *y;
    atomic_long next;
} conv_job;

QK_VECTOR_CLONES static void conv_task(void *ctx, int tid, int nth) {
    (void)tid, (void)nth;
    conv_job *j = ctx;
    const int64_t T = j->T, C = j->C, K = j->K, K1 = K - 1;
    float wt[16][CONV_CB], acc[CONV_CB];
    for (int64_t it; (it = atomic_fetch_add(&j->next, 1)) * CONV_CB < C;) {
        const int64_t c0 = it * CONV_CB, n = C - c0 < CONV_CB ? C - c0 : CONV_CB;
        float *st = j->state + c0 * K1;
        for (int64_t c = 0; c < n; c++)
            for (int64_t i = 0; i < K; i++) wt[i][c] = j->w[(c0 + c) * K + i];
        for (int64_t t = 0; t < T; t++) {
            for (int64_t c = 0; c < n; c++) acc[c] = 0.0f;
            for (int64_t i = 0; i < K; i++) {
                const int64_t u = t - K1 + i; /* the input position */
                if (u >= 0) {
                    const float *xr = j->x + u * j->sx + c0;
                    for (int64_t c = 0; c < n; c++) acc[c] += xr[c] * wt[i][c];
                } else {
                    for (int64_t c = 0; c < n; c++) acc[c] += st[c * K1 + K1 + u] * wt[i][c];
                }
            }
            silu_row(j->y + t * C + c0, acc, n);
        }
        for (int64_t c = 0; c < n; c++) /* ascending i: state[i + T] is read before it is written */
            for (int64_t i = 0; i < K1; i++)
                st[c * K1 + i] = i + T < K1 ? st[c * K1 + i + T] : j->x[(i + T - K1) * j->sx + c0 + c];
    }
}

int qk_delta_conv_prompt(int64_t T, int64_t C, int64_t K, const float *x, int64_t sx, const float *w, float *state,
                         float *y) {
    if (T < 1 || C < 1 || K < 1 || K > 16) return QK_ESHAPE;
    conv_job j = {.T = T, .C = C, .K = K, .sx = sx, .x = x, .w = w, .state = state, .y = y};
    atomic_init(&j.next, 0);
    qk_pool_run(conv_task, &j);
    return QK_OK;
}
