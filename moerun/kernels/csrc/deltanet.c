/* Gated DeltaNet's decode step: per sequence the causal conv1d's window moves by one (then SiLU), q and k are
 * L2-normalised (q also scaled by dk^-1/2), and per value head the state S [dk, dv] decays by exp(g), learns
 * beta (v - S^T k) along k, and answers S^T q, which is RMS-normed and gated by silu(z). Two reads of S (the
 * second also writes it) instead of torch's six passes and temporaries; work items are (sequence, head) pairs
 * handed out as threads come, so any thread count gives the same result. */
#include "deltanet.h"

#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "pool.h"
#include "matmul.h"
#include "vexp.h"

#define CONV_ITEM 256 /* channels per conv1d work item */
#define DELTA_AHEAD 16 /* state rows prefetched ahead of the first pass over S */

/* The loops over a state row are plain C for the compiler to vectorise (silu through vexp.h, as the prompt's); on
 * x86-64 each task is built for AVX-512, AVX2 and the baseline, the best one chosen at load (ifunc). */

typedef struct {
    const qk_delta_args *a;
    atomic_long next;
    int64_t items;
} delta_job;

QK_VECTOR_CLONES static void conv_task(void *p, int tid, int nth) {
    (void)tid, (void)nth;
    delta_job *j = p;
    const qk_delta_args *a = j->a;
    const int64_t per = (a->C + CONV_ITEM - 1) / CONV_ITEM, K1 = a->K - 1;
    for (int64_t it; (it = atomic_fetch_add(&j->next, 1)) < j->items;) {
        const int64_t b = it / per, c0 = it % per * CONV_ITEM, c1 = c0 + CONV_ITEM < a->C ? c0 + CONV_ITEM : a->C;
        float *st = a->conv + a->slots[b] * a->C * K1;
        const float *x = a->qkv + b * a->C;
        if (K1 == 3 && !a->fresh[b]) { /* a window of 4 (Qwen3-Next, Qwen3.5): the loop below, unrolled, no calls */
            for (int64_t c = c0; c < c1; c++) {
                float *s = st + c * 3;
                const float *w = a->w + c * 4, s0 = s[0], s1 = s[1], s2 = s[2], xc = x[c];
                float acc = 0.0f;
                acc += s0 * w[0];
                acc += s1 * w[1];
                acc += s2 * w[2];
                acc += xc * w[3];
                a->y[b * a->C + c] = qk_vsilu(acc);
                s[0] = s1, s[1] = s2, s[2] = xc;
            }
            continue;
        }
        for (int64_t c = c0; c < c1; c++) {
            float *s = st + c * K1;
            if (a->fresh[b]) memset(s, 0, (size_t)K1 * sizeof(float));
            const float *w = a->w + c * a->K;
            float acc = 0.0f;
            for (int64_t t = 0; t < K1; t++) acc += s[t] * w[t];
            acc += x[c] * w[K1];
            a->y[b * a->C + c] = qk_vsilu(acc);
            if (K1 > 0) {
                memmove(s, s + 1, (size_t)(K1 - 1) * sizeof(float));
                s[K1 - 1] = x[c];
            }
        }
    }
}

static float inv_norm(const float *x, int64_t n) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += x[i] * x[i];
    return 1.0f / sqrtf(ss + 1e-6f);
}

QK_VECTOR_CLONES static void head_task(void *p, int tid, int nth) {
    (void)tid, (void)nth;
    delta_job *j = p;
    const qk_delta_args *a = j->a;
    const int64_t dk = a->dk, dv = a->dv, r = a->nv / a->nk;
    float q[1024], k[1024], kv[1024], o[1024];
    /* A thread claims its next item as it starts one, and reads the next item's state into L2 during this one's
     * second pass (a row of it per row of this one's): the first pass then reads from L2, not memory. */
    int64_t it = atomic_fetch_add(&j->next, 1), ahead = 0;
    for (int64_t nx; it < j->items; it = nx) {
        nx = atomic_fetch_add(&j->next, 1);
        const int64_t b = it / a->nv, h = it % a->nv, kh = a->tiled ? h % a->nk : h / r;
        float *S = a->ssm + (a->slots[b] * a->nv + h) * dk * dv;
        const float *Sn = nx < j->items ? a->ssm + (a->slots[nx / a->nv] * a->nv + nx % a->nv) * dk * dv : NULL;
        /* Without that (a thread's first item), S's rows are read DELTA_AHEAD ahead of the first pass (8 KB of a 128
         * x 128 state; the first ones while q and k are normed): the state comes from memory each step, and a pass
         * that waits on it lost 18 % (journal, issue 36) */
        if (!ahead)
            for (int64_t i = 0; i < DELTA_AHEAD && i < dk; i++)
                for (int64_t c = 0; c < dv; c += 16) __builtin_prefetch(S + i * dv + c, 0, 3);
        const float *y = a->y + b * a->C;
        const float *qs = y + kh * dk, *ks = y + a->nk * dk + kh * dk, *v = y + 2 * a->nk * dk + h * dv;
        const float qn = inv_norm(qs, dk) / sqrtf((float)dk), kn = inv_norm(ks, dk);
        for (int64_t i = 0; i < dk; i++) q[i] = qs[i] * qn, k[i] = ks[i] * kn;
        const float al = a->alpha[b * a->nv + h] + a->dt[h];
        const float sp = al > 20.0f ? al : log1pf(expf(al));
        const float decay = expf(a->a[h] * sp), beta = 1.0f / (1.0f + expf(-a->beta[b * a->nv + h]));
        if (a->fresh[b]) memset(S, 0, (size_t)(dk * dv) * sizeof(float));
        for (int64_t c = 0; c < dv; c++) kv[c] = 0.0f, o[c] = 0.0f;
        for (int64_t i = 0; i < dk; i++) {
            const float ki = k[i], *Si = S + i * dv;
            if (!ahead && i + DELTA_AHEAD < dk)
                for (int64_t c = 0; c < dv; c += 16) __builtin_prefetch(Si + DELTA_AHEAD * dv + c, 0, 3);
            for (int64_t c = 0; c < dv; c++) kv[c] += Si[c] * ki;
        }
        for (int64_t c = 0; c < dv; c++) kv[c] = (v[c] - kv[c] * decay) * beta; /* delta */
        for (int64_t i = 0; i < dk; i++) {
            const float ki = k[i], qi = q[i];
            float *Si = S + i * dv;
            if (Sn)
                for (int64_t c = 0; c < dv; c += 16) __builtin_prefetch(Sn + i * dv + c, 0, 2);
            for (int64_t c = 0; c < dv; c++) {
                const float s = Si[c] * decay + ki * kv[c];
                Si[c] = s;
                o[c] += s * qi;
            }
        }
        float ss = 0.0f;
        for (int64_t c = 0; c < dv; c++) ss += o[c] * o[c];
        const float rn = 1.0f / sqrtf(ss / (float)dv + a->eps);
        const float *z = a->z + b * a->nv * dv + h * dv;
        float *out = a->out + b * a->nv * dv + h * dv;
        for (int64_t c = 0; c < dv; c++) out[c] = a->norm[c] * (o[c] * rn) * qk_vsilu(z[c]);
        ahead = Sn != NULL && !a->fresh[nx / a->nv];
    }
}

int qk_delta_step(const qk_delta_args *a) {
    if (a->B < 1 || a->K < 1 || a->nk < 1 || a->nv % a->nk || a->dk > 1024 || a->dv > 1024 ||
        a->C != 2 * a->nk * a->dk + a->nv * a->dv)
        return QK_ESHAPE;
    delta_job j = {.a = a, .items = a->B * ((a->C + CONV_ITEM - 1) / CONV_ITEM)};
    atomic_init(&j.next, 0);
    qk_pool_run(conv_task, &j);
    j.items = a->B * a->nv;
    atomic_init(&j.next, 0);
    qk_pool_run(head_task, &j);
    return QK_OK;
}
