/* Token sampling's passes over a vocabulary of logits, one thread, in a fixed order of float operations, so that
 * every kernel set (portable, AVX2, AVX-512: the same C compiled per target, vectorised by the compiler, with
 * -ffp-contract=off) gives the same bits, and so does moerun.kernels.sample's torch twin of each step:
 *
 *   exp32(x)    Cephes' expf in float32 multiplies and adds, 0 below -64 (no subnormal results);
 *   block sums  of SAMP_BLOCK weights in double: 16 lanes (token i of a block in lane i % 16) summed row after
 *               row, then the lanes in order; blocks summed in order;
 *   the draw    llama.cpp's inverse CDF: weights exp32(x / t - m) (m the largest kept x / t), one uniform double
 *               u, the first block whose running sum exceeds u times the total, then the first token in it whose
 *               running sum (in double, in token order, plus the blocks before) does.
 *
 * samp_cut finds the cut top-p and min-p make over a whole vocabulary without sorting it: top-p's probability
 * mass per bucket of value, then a sort of the two buckets around the cut; it answers 0 where a tie or rounding at
 * the cut could make the sorted chain keep another set (the caller then sorts).
 *
 * samp_argmax is greedy decoding's pick: the first index of the largest logit (torch.argmax's), or -1 where any
 * logit is NaN, in one pass of 16 lanes over the vocabulary and a scan for the first index holding that value. */
#include "sample.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "qk.h"

#define SL 16
#define SR (SAMP_BLOCK / SL)
#define SPAN 32.0f
#define EXP_FLOOR -64.0f

#define INL static inline __attribute__((always_inline))

/* v where c, else 0.0f, without a branch (a conditional float multiply would not vectorise without masks). */
INL float keep_if(int c, float v) {
    uint32_t b;
    memcpy(&b, &v, sizeof b);
    b &= -(uint32_t)(c != 0);
    memcpy(&v, &b, sizeof v);
    return v;
}

INL float exp32(float x) {
    const int in = x >= EXP_FLOOR;
    uint32_t xb, fb, ib;
    const float floor_ = EXP_FLOOR;
    memcpy(&xb, &x, sizeof xb);
    memcpy(&fb, &floor_, sizeof fb);
    const uint32_t pick = -(uint32_t)in;
    xb = (xb & pick) | (fb & ~pick);
    float xc;
    memcpy(&xc, &xb, sizeof xc);
    const float k = xc * 1.44269504088896341f + 12582912.0f;
    const float n = k - 12582912.0f;
    const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = (p * (r * r) + r) + 1.0f;
    memcpy(&ib, &k, sizeof ib);
    const uint32_t bits = (ib - 0x4B400000u + 127u) << 23;
    float s;
    memcpy(&s, &bits, sizeof s);
    return keep_if(in, e * s);
}

INL double block_sum(const float *w) {
    double acc[SL];
    for (int l = 0; l < SL; l++) acc[l] = w[l];
    for (int r = 1; r < SR; r++)
        for (int l = 0; l < SL; l++) acc[l] += w[r * SL + l];
    double s = acc[0];
    for (int l = 1; l < SL; l++) s += acc[l];
    return s;
}

/* w[SAMP_BLOCK] = exp32(x / t - m) where x >= cut, else 0; zero past len. */
INL void weights(const float *x, int64_t len, float t, float m, float cut, float *w) {
    for (int64_t i = 0; i < len; i++) {
        w[i] = keep_if(x[i] >= cut, exp32(x[i] / t - m));
    }
    for (int64_t i = len; i < SAMP_BLOCK; i++) w[i] = 0.0f;
}

/* The largest x >= cut; NaN if any x is NaN. */
INL float kept_max(const float *x, int64_t n, float cut) {
    float m = -INFINITY;
    uint32_t nan = 0;
    int64_t i = 0;
    for (; i + SAMP_BLOCK <= n; i += SAMP_BLOCK) {
        float c[SAMP_BLOCK];
        uint32_t bad = 0;
        for (int j = 0; j < SAMP_BLOCK; j++) {
            const float v = x[i + j];
            c[j] = v >= cut ? v : -INFINITY;
            bad |= v != v;
        }
        for (int w = SAMP_BLOCK / 2; w >= 1; w /= 2)
            for (int j = 0; j < w; j++) c[j] = c[j + w] > c[j] ? c[j + w] : c[j];
        m = c[0] > m ? c[0] : m;
        nan |= bad;
    }
    for (; i < n; i++) {
        m = (x[i] >= cut) & (x[i] > m) ? x[i] : m;
        nan |= x[i] != x[i];
    }
    return nan ? NAN : m;
}

#define SAMP_STACK_BLOCKS 1024

INL int64_t draw_body(const float *x, int64_t n, float t, float cut, double u) {
    const float mx = kept_max(x, n, cut);
    if (!isfinite(mx)) return -1;
    const float m = mx / t;
    const int64_t nb = (n + SAMP_BLOCK - 1) / SAMP_BLOCK;
    double stack[SAMP_STACK_BLOCKS + 1]; /* vocabularies up to 262,144 tokens: no allocation a token */
    double *cum = nb <= SAMP_STACK_BLOCKS ? stack : malloc((size_t)(nb + 1) * sizeof *cum);
    if (!cum) return -2;
    float w[SAMP_BLOCK];
    cum[0] = 0.0;
    for (int64_t b = 0; b < nb; b++) {
        const int64_t len = n - b * SAMP_BLOCK < SAMP_BLOCK ? n - b * SAMP_BLOCK : SAMP_BLOCK;
        weights(x + b * SAMP_BLOCK, len, t, m, cut, w);
        cum[b + 1] = cum[b] + block_sum(w);
    }
    const double total = cum[nb], target = u * total;
    int64_t b = 0, last = 0;
    for (int64_t i = 1; i <= nb; i++) b += cum[i] <= target, last += cum[i] < total;
    b = b < last ? b : last;
    const int64_t len = n - b * SAMP_BLOCK < SAMP_BLOCK ? n - b * SAMP_BLOCK : SAMP_BLOCK;
    weights(x + b * SAMP_BLOCK, len, t, m, cut, w);
    double within[SAMP_BLOCK], run = 0.0;
    for (int i = 0; i < SAMP_BLOCK; i++) run += w[i], within[i] = run + cum[b];
    if (cum != stack) free(cum);
    int64_t j = 0, cap = 0;
    for (int i = 0; i < SAMP_BLOCK; i++) j += within[i] <= target, cap += within[i] < within[SAMP_BLOCK - 1];
    return b * SAMP_BLOCK + (j < cap ? j : cap);
}

/* The sum of exp32(x - mx) over x [n], block by block (the normaliser of top-p's probabilities). */
INL double norm_body(const float *x, int64_t n, float mx) {
    float w[SAMP_BLOCK];
    double total = 0.0;
    for (int64_t b = 0; b * SAMP_BLOCK < n; b++) {
        const int64_t len = n - b * SAMP_BLOCK < SAMP_BLOCK ? n - b * SAMP_BLOCK : SAMP_BLOCK;
        weights(x + b * SAMP_BLOCK, len, 1.0f, mx, -INFINITY, w);
        total += block_sum(w);
    }
    return total;
}

INL int bucket_of(float v, float mx) {
    const float d = (mx - v) * ((float)SAMP_BUCKETS / SPAN);
    return d < (float)SAMP_BUCKETS ? (int)d : SAMP_BUCKETS;
}

INL int near_rounding(double s, double slack) {
    const float f = (float)s;
    const double up = ((double)f + (double)nextafterf(f, INFINITY)) / 2;
    const double down = ((double)f + (double)nextafterf(f, -INFINITY)) / 2;
    return up - s < slack || s - down < slack;
}

static void sort_desc(uint32_t *k, uint32_t *tmp, int64_t m) {
    for (int64_t i = 0; i < m; i++) k[i] = (k[i] & 0x80000000u) ? k[i] : ~(k[i] | 0x80000000u);
    for (int shift = 0; shift < 32; shift += 8) {
        int64_t count[257] = {0};
        for (int64_t i = 0; i < m; i++) count[((k[i] >> shift) & 255) + 1]++;
        for (int d = 0; d < 256; d++) count[d + 1] += count[d];
        for (int64_t i = 0; i < m; i++) tmp[count[(k[i] >> shift) & 255]++] = k[i];
        uint32_t *s = k;
        k = tmp, tmp = s;
    }
    for (int64_t i = 0; i < m; i++) k[i] = (k[i] & 0x80000000u) ? k[i] : ~(k[i] | 0x80000000u);
}

INL int cut_body(const float *x, int64_t n, float tp, int use_tp, float lmp, int use_mp, double *hist,
                 uint32_t *keys, int64_t cap, float *cut) {
    const float mx = kept_max(x, n, -INFINITY);
    if (!isfinite(mx)) return 0;
    const float tau = use_mp ? mx + lmp : -INFINITY;
    *cut = tau;
    if (!use_tp) return 1;
    const float z = (float)norm_body(x, n, mx);
    for (int b = 0; b <= SAMP_BUCKETS; b++) hist[b] = 0.0;
    double kl[SL] = {0.0};
    float p[SAMP_BLOCK];
    int bk[SAMP_BLOCK];
    for (int64_t i0 = 0; i0 < n; i0 += SAMP_BLOCK) {
        const int64_t len = n - i0 < SAMP_BLOCK ? n - i0 : SAMP_BLOCK;
        const float *xb = x + i0;
        for (int64_t i = 0; i < len; i++) p[i] = exp32(xb[i] - mx) / z, bk[i] = bucket_of(xb[i], mx);
        if (use_mp && len == SAMP_BLOCK)
            for (int r = 0; r < SR; r++)
                for (int l = 0; l < SL; l++) kl[l] += (double)keep_if(xb[r * SL + l] >= tau, p[r * SL + l]);
        else if (use_mp)
            for (int64_t i = 0; i < len; i++) kl[i % SL] += (double)keep_if(xb[i] >= tau, p[i]);
        for (int64_t i = 0; i < len; i++) hist[bk[i]] += p[i];
    }
    double kept = 0.0;
    for (int l = 0; l < SL; l++) kept += kl[l];
    if (use_mp && kept + 1e-6 < (double)tp) return 1;
    double above = 0.0;
    int b = 0;
    for (; b <= SAMP_BUCKETS && above + hist[b] < (double)tp; b++) above += hist[b];
    if (b >= SAMP_BUCKETS - 1 || above > (double)tp - 1e-7) return 0;
    int64_t m = 0;
    for (int64_t i0 = 0; i0 < n; i0 += SAMP_BLOCK) {
        const int64_t len = n - i0 < SAMP_BLOCK ? n - i0 : SAMP_BLOCK;
        int hit = 0;
        for (int64_t i = 0; i < len; i++) bk[i] = bucket_of(x[i0 + i], mx) - b, hit |= (unsigned)bk[i] <= 1u;
        if (!hit) continue;
        for (int64_t i = 0; i < len; i++)
            if ((unsigned)bk[i] <= 1u) {
                if (m == cap) return 0;
                memcpy(&keys[m++], &x[i0 + i], sizeof(float));
            }
    }
    sort_desc(keys, keys + cap, m);
    const double slack = (2.0 * (double)n + SAMP_BUCKETS + 2.0 * (double)m + 64.0) * 0x1p-53;
    double s = above;
    int64_t t = -1;
    float prev = 0.0f, before = 0.0f;
    for (int64_t i = 0; i < m; i++) {
        float v;
        memcpy(&v, &keys[i], sizeof v);
        const float q = exp32(v - mx) / z;
        s += q;
        before = (float)s - q;
        const int keep = before < tp;
        if (fabsf(before - tp) <= 0x1p-21f && near_rounding(s, slack)) return 0;
        if (t < 0 && !keep) {
            if (i == 0 || prev == v) return 0;
            t = i;
        } else if (t >= 0 && keep) {
            return 0;
        }
        prev = v;
    }
    if (t < 0 || !(before - tp > 0x1p-21f)) return 0;
    memcpy(cut, &keys[t - 1], sizeof(float));
    if (*cut < tau) *cut = tau;
    return 1;
}

INL void exp_body(const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i++) out[i] = exp32(x[i]);
}

/* A float's bits as an int32 in the floats' order (negative ones' magnitude bits flipped): -0.0 just below +0.0. */
INL int32_t order_key(uint32_t b) { return (int32_t)(b ^ ((uint32_t)((int32_t)b >> 31) >> 1)); }

/* Integer maxima in 16 lanes vectorise (a float max with NaN in play does not); per chunk of ARGMAX_CHUNK the
 * largest key, kept with its chunk where it beats the earlier ones, so the final scan reads one chunk. */
#define ARGMAX_CHUNK 2048

/* One value into its lane: the largest magnitude's bits (a NaN's exceed +inf's) and the largest order key. */
INL void argmax_lane(uint32_t b, uint32_t *am, int32_t *km) {
    const uint32_t a = b & 0x7fffffffu;
    const int32_t k = order_key(b);
    *am = a > *am ? a : *am;
    *km = k > *km ? k : *km;
}

INL int64_t argmax_body(const float *x, int64_t n) {
    if (n <= 0) return -1;
    const uint32_t *u = (const uint32_t *)(const void *)x;
    int32_t best = INT32_MIN;
    uint32_t worst = 0; /* the largest magnitude's bits: above +inf's, a NaN */
    int64_t at = 0;
    for (int64_t c = 0; c < n; c += ARGMAX_CHUNK) {
        const int64_t len = n - c < ARGMAX_CHUNK ? n - c : ARGMAX_CHUNK;
        int32_t km[SL];
        uint32_t am[SL];
        for (int l = 0; l < SL; l++) {
            km[l] = INT32_MIN;
            am[l] = 0;
        }
        int64_t i = 0;
        for (; i + SL <= len; i += SL)
            for (int l = 0; l < SL; l++) argmax_lane(u[c + i + l], &am[l], &km[l]);
        for (int l = 0; i + l < len; l++) argmax_lane(u[c + i + l], &am[l], &km[l]);
        for (int l = 0; l < SL; l++) {
            worst = am[l] > worst ? am[l] : worst;
            if (km[l] > best) {
                best = km[l];
                at = c;
            }
        }
    }
    if (worst > 0x7f800000u) return -1;
    const uint32_t bits = (uint32_t)best ^ ((uint32_t)(best >> 31) >> 1);
    float mx;
    memcpy(&mx, &bits, sizeof mx);
    if (mx == 0.0f) at = 0; /* -0.0 and +0.0 are equal, and their keys are not: the first of either */
    for (int64_t i = at; i < n; i++)
        if (x[i] == mx) return i;
    return -1;
}

typedef struct {
    int64_t (*argmax)(const float *, int64_t);
    int64_t (*draw)(const float *, int64_t, float, float, double);
    double (*norm)(const float *, int64_t, float);
    int (*cut)(const float *, int64_t, float, int, float, int, double *, uint32_t *, int64_t, float *);
    void (*exp)(const float *, int64_t, float *);
} samp_fns;

#define SAMP_SET(sfx, attr)                                                                                           \
    attr static int64_t argmax_##sfx(const float *x, int64_t n) { return argmax_body(x, n); }                          \
    attr static int64_t draw_##sfx(const float *x, int64_t n, float t, float cut, double u) {                         \
        return draw_body(x, n, t, cut, u);                                                                            \
    }                                                                                                                 \
    attr static double norm_##sfx(const float *x, int64_t n, float mx) { return norm_body(x, n, mx); }                \
    attr static int cut_##sfx(const float *x, int64_t n, float tp, int use_tp, float lmp, int use_mp, double *hist,   \
                              uint32_t *keys, int64_t cap, float *cut) {                                              \
        return cut_body(x, n, tp, use_tp, lmp, use_mp, hist, keys, cap, cut);                                         \
    }                                                                                                                 \
    attr static void exp_##sfx(const float *x, int64_t n, float *out) { exp_body(x, n, out); }                        \
    static const samp_fns FNS_##sfx = {argmax_##sfx, draw_##sfx, norm_##sfx, cut_##sfx, exp_##sfx};

SAMP_SET(portable, )
#if QK_X86
SAMP_SET(avx2, __attribute__((target("avx2"))))
SAMP_SET(avx512, __attribute__((target("avx2,avx512f,avx512vl,avx512bw"))))
#endif

static const samp_fns *fns(int isa) {
#if QK_X86
    if (isa == ISA_VNNI && qk_kernels(ISA_VNNI)) return &FNS_avx512;
    if (isa == ISA_AVX2 && qk_kernels(ISA_AVX2)) return &FNS_avx2;
#endif
    return &FNS_portable;
}

int64_t samp_argmax(int isa, const float *x, int64_t n) { return fns(isa)->argmax(x, n); }

int64_t samp_draw(int isa, const float *x, int64_t n, float t, float cut, double u) {
    return fns(isa)->draw(x, n, t, cut, u);
}

double samp_norm(int isa, const float *x, int64_t n, float mx) { return fns(isa)->norm(x, n, mx); }

int samp_cut(int isa, const float *x, int64_t n, float top_p, int use_top_p, float log_min_p, int use_min_p,
             double *hist, uint32_t *keys, int64_t cap, float *cut) {
    return fns(isa)->cut(x, n, top_p, use_top_p, log_min_p, use_min_p, hist, keys, cap, cut);
}

void samp_exp(int isa, const float *x, int64_t n, float *out) { fns(isa)->exp(x, n, out); }

typedef struct {
    int64_t id;
    float v;
} samp_pair;

static int by_id(const void *a, const void *b) {
    const int64_t x = ((const samp_pair *)a)->id, y = ((const samp_pair *)b)->id;
    return (x > y) - (x < y);
}

/* Top-p and min-p over top-k's candidates vals [k] (sorted descending, ids [k]), as the chain applies them (each
 * token's mask on its own), then the draw over the k in token order, dropped ones -inf: sv, sid [k] scratch.
 * -> the token id (-1: the largest logit not finite, -2: out of memory). */
int64_t samp_topk(int isa, const float *vals, const int64_t *ids, int64_t k, float t, float top_p, int use_top_p,
                  float log_min_p, int use_min_p, double u, float *sv, int64_t *sid) {
    if (k < 1 || !isfinite(vals[0])) return -1;
    const float mx = vals[0], tau = use_min_p ? mx + log_min_p : -INFINITY;
    const float z = use_top_p ? (float)samp_norm(isa, vals, k, mx) : 1.0f;
    samp_pair *pr = malloc((size_t)k * sizeof *pr);
    if (!pr) return -2;
    double s = 0.0;
    for (int64_t i = 0; i < k; i++) {
        int keep = !(vals[i] < tau);
        if (use_top_p) {
            const float q = exp32(vals[i] - mx) / z;
            s += q;
            keep &= i == 0 || (float)s - q < top_p;
        }
        pr[i].id = ids[i], pr[i].v = keep ? vals[i] : -INFINITY;
    }
    qsort(pr, (size_t)k, sizeof *pr, by_id);
    for (int64_t i = 0; i < k; i++) sv[i] = pr[i].v, sid[i] = pr[i].id;
    free(pr);
    const int64_t j = samp_draw(isa, sv, k, t, -INFINITY, u);
    return j < 0 ? j : sid[j];
}
