/* A decoder layer for a few rows at once (see attn.h): its mixer (attention, attn.c, or gated DeltaNet,
 * deltanet.c), then its FFN (routing, the routed experts, a shared expert or a dense FFN), and a run of such
 * layers from token ids to logits in one call (qk_decode_layers).
 *
 * Matrix products go through qk_matmuls (one pool job for every product of one input); routing and the
 * element-wise steps are a few thousand floats per row and stay on the calling thread. Every value is
 * computed by one thread in a fixed order, so results do not depend on the thread count. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "attn.h"
#include "deltanet.h"
#include "matmul.h"
#include "qk.h"
#include "vexp.h"

static const float *fptr(int64_t a) { return (const float *)(uintptr_t)a; }
static const uint8_t *bptr(int64_t a) { return (const uint8_t *)(uintptr_t)a; }
static float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }

/* ------------------------------------------------------------------------------------ routing */

/* The top k of p (ties: the lower id first; -inf never), best first: ids, and p's values in w; p is used up. */
static void top_k(float *p, int64_t E, int64_t k, int64_t *ids, float *w) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; e++)
            if (p[e] != -INFINITY && (best < 0 || p[e] > p[best])) best = e;
        ids[j] = best;
        w[j] = best < 0 ? 0.0f : p[best];
        if (best >= 0) p[best] = -INFINITY; /* taken */
    }
}

/* choice [E] with every expert outside the best topk_groups of n_groups groups set to -inf (gs: n_groups floats
 * of scratch); a group scores its best expert (group_score 0) or its best two summed (1). */
static void limit_groups(const qk_attn_desc *d, float *choice, int64_t E, float *gs) {
    const int64_t G = d->n_groups, per = E / G;
    for (int64_t g = 0; g < G; g++) {
        float b1 = -INFINITY, b2 = -INFINITY;
        for (int64_t e = g * per; e < (g + 1) * per; e++) {
            const float c = choice[e];
            if (c > b1) b2 = b1, b1 = c;
            else if (c > b2) b2 = c;
        }
        gs[g] = d->group_score ? b1 + b2 : b1;
    }
    for (int64_t j = 0; j < d->topk_groups; j++) { /* mark the kept groups with NAN, the others stay scores */
        int64_t best = -1;
        for (int64_t g = 0; g < G; g++)
            if (!isnan(gs[g]) && (best < 0 || gs[g] > gs[best])) best = g;
        gs[best] = NAN;
    }
    for (int64_t g = 0; g < G; g++)
        if (!isnan(gs[g]))
            for (int64_t e = g * per; e < (g + 1) * per; e++) choice[e] = -INFINITY;
}

/* One row's experts from its router logits [E] (used up): ids and weights [n_used], best first, as the layer's
 * gating says (attn.h); p: E floats, gs: n_groups floats of scratch. */
static void route(const qk_attn_desc *d, float *logits, int64_t E, float *p, float *gs, int64_t *ids, float *w) {
    const int64_t k = d->n_used;
    const float scale = fptr(d->fparams) ? fptr(d->fparams)[0] : 1.0f;
    float max = -INFINITY, sum = 0.0f;
    if (d->gating == 1) { /* the top k logits, then a softmax over them */
        for (int64_t e = 0; e < E; e++) p[e] = logits[e];
        top_k(p, E, k, ids, w);
        max = w[0];
        for (int64_t j = 0; j < k; j++) sum += w[j] = expf(w[j] - max);
        for (int64_t j = 0; j < k; j++) w[j] /= sum;
    } else {
        if (d->gating == 2) {
            for (int64_t e = 0; e < E; e++) logits[e] = sigmoidf(logits[e]);
        } else {
            for (int64_t e = 0; e < E; e++) max = logits[e] > max ? logits[e] : max;
            for (int64_t e = 0; e < E; e++) sum += logits[e] = expf(logits[e] - max);
            for (int64_t e = 0; e < E; e++) logits[e] /= sum;
        }
        const float *sb = fptr(d->score_b);
        for (int64_t e = 0; e < E; e++) p[e] = sb ? logits[e] + sb[e] : logits[e];
        if (d->n_groups > 1) limit_groups(d, p, E, gs);
        top_k(p, E, k, ids, w);
        float chosen = 0.0f;
        for (int64_t j = 0; j < k; j++) chosen += w[j] = logits[ids[j]];
        if (d->norm_topk) {
            const float div = d->gating == 2 ? chosen + 1e-20f : chosen;
            for (int64_t j = 0; j < k; j++) w[j] /= div;
        }
    }
    if (scale != 1.0f)
        for (int64_t j = 0; j < k; j++) w[j] *= scale;
}

int qk_route_rows(const qk_attn_desc *d, float *logits, int64_t B, int64_t E, int64_t *ids, float *w) {
    if (B < 1 || E < 1 || d->n_used < 1 || d->n_used > E || d->n_groups < 1 || E % d->n_groups ||
        d->topk_groups < 1 || d->topk_groups > d->n_groups || d->topk_groups * (E / d->n_groups) < d->n_used)
        return QK_ESHAPE;
    float *p = malloc((size_t)(E + d->n_groups) * sizeof(float));
    if (!p) return QK_ENOMEM;
    for (int64_t r = 0; r < B; r++) route(d, logits + r * E, E, p, p + E, ids + r * d->n_used, w + r * d->n_used);
    free(p);
    return QK_OK;
}

/* ------------------------------------------------------------------------------------ the FFN */

/* g = silu(g) * u over n values (vexp.h). */
QK_VECTOR_CLONES static void silu_mul_rows(float *g, const float *u, int64_t n) {
    for (int64_t i = 0; i < n; i++) g[i] = qk_vsilu(g[i]) * u[i];
}

static int glu_down(int isa, float *g, const float *u, int64_t B, int64_t F, int64_t H, const qk_wmat *down,
                    const float *gl, float *out, const qk_then *then) {
    silu_mul_rows(g, u, B * F);
    const int rc = qk_matmuls_then(isa, 1, down, F, g, B, &out, then);
    for (int64_t r = 0; !rc && gl && r < B; r++) {
        const float s = sigmoidf(gl[r]);
        for (int64_t i = 0; i < H; i++) out[r * H + i] = s * out[r * H + i];
    }
    return rc;
}

int qk_glu_down(int isa, float *g, const float *u, int64_t B, int64_t F, int64_t H, const qk_wmat *down,
                const float *gl, float *out) {
    return glu_down(isa, g, u, B, F, H, down, gl, out, NULL);
}

int qk_layer_whole(const qk_attn_desc *d) {
    return d->router ? d->gate && d->up && d->down : d->sh_gate && d->sh_up && d->sh_down;
}

/* The FFN's first product against ffn_norm(x): the router, and with moe (a whole layer) a shared expert's (or dense
 * FFN's) gate and up and the shared expert's gate input; mats[0..n), n returned (0: none). */
static int ffn_first(const qk_attn_desc *d, int moe, qk_wmat mats[QK_MM_MAX]) {
    const int sh = moe && qk_layer_whole(d) && d->sh_gate;
    int n = 0;
    if (d->router) mats[n++] = (qk_wmat){bptr(d->router), (int)d->router_type, d->n_experts};
    if (sh) {
        mats[n++] = (qk_wmat){bptr(d->sh_gate), (int)d->sh_gate_type, d->sh_ff};
        mats[n++] = (qk_wmat){bptr(d->sh_up), (int)d->sh_up_type, d->sh_ff};
        if (d->sh_gate_inp) mats[n++] = (qk_wmat){bptr(d->sh_gate_inp), GGML_F32, 1};
    }
    return n;
}

/* xn_out = ffn_norm(x); routing (ids_out, w_out); with moe (a whole layer) x += routed + shared, or the dense FFN.
 * next: the job after the layer's last (qk_matmuls_then), or NULL. */
static int ffn(int isa, const qk_attn_desc *d, float *x, int64_t B, float eps, float *xn_out, int64_t *ids_out,
               float *w_out, int moe, const qk_then *next) {
    const int64_t H = d->hidden, E = d->router ? d->n_experts : 0, k = E ? d->n_used : 0;
    if (E && (k < 1 || k > E || d->n_groups < 1 || E % d->n_groups || d->topk_groups < 1 ||
              d->topk_groups > d->n_groups || d->topk_groups * (E / d->n_groups) < k))
        return QK_ESHAPE;
    moe = moe && qk_layer_whole(d);
    const int sh = moe && d->sh_gate, gated = sh && d->sh_gate_inp;
    const int64_t F = sh ? d->sh_ff : 0;
    if (sh && F < 1) return QK_ESHAPE;
    const int64_t nfloat = B * (2 * E + 2 * F + 1 + 2 * H + k) + d->n_groups;
    float *mem = malloc((size_t)nfloat * sizeof(float));
    if (!mem) return QK_ENOMEM;
    float *logits = mem, *probs = logits + B * E, *g = probs + B * E, *u = g + B * F, *gl = u + B * F;
    float *sho = gl + B, *moe_out = sho + B * H, *gs = moe_out + B * H;
    int32_t *ids32 = (int32_t *)(gs + d->n_groups);

    for (int64_t r = 0; r < B; r++) qk_rms_norm(x + r * H, fptr(d->ffn_norm), H, eps, xn_out + r * H);
    qk_wmat mats[QK_MM_MAX];
    float *outs[QK_MM_MAX];
    const int n = ffn_first(d, moe, mats);
    int o = 0;
    if (E) outs[o++] = logits;
    if (sh) outs[o++] = g, outs[o++] = u;
    if (gated) outs[o++] = gl;
    const qk_wmat wd = {bptr(d->sh_down), (int)d->sh_down_type, H};
    const qk_then to_down = {1, &wd, F}, *after = sh ? &to_down : next; /* the job after the routed experts' */
    int rc = n ? qk_matmuls_then(isa, n, mats, H, xn_out, B, outs, E ? NULL : after) : QK_OK;
    const float *br = fptr(d->router_b);
    for (int64_t r = 0; !rc && E && r < B; r++) {
        if (br)
            for (int64_t e = 0; e < E; e++) logits[r * E + e] += br[e];
        route(d, logits + r * E, E, probs + r * E, gs, ids_out + r * k, w_out + r * k);
    }
    if (!rc && moe && E) {
        for (int64_t p = 0; p < B * k; p++) ids32[p] = (int32_t)ids_out[p];
        const qk_expert_mats eg = {bptr(d->gate), d->gate_stride, (int)d->gate_type};
        const qk_expert_mats eu = {bptr(d->up), d->up_stride, (int)d->up_type};
        const qk_expert_mats ed = {bptr(d->down), d->down_stride, (int)d->down_type};
        const float *ap = fptr(d->act_params);
        const qk_expert_fn fn = {(int)d->act, ap ? ap[0] : 0.0f, ap ? ap[1] : 0.0f, fptr(d->gate_b), fptr(d->up_b),
                                 fptr(d->down_b)};
        rc = qk_moe_ffn(isa, xn_out, B, H, ids32, w_out, (int)k, eg, eu, ed, E, d->n_ff, moe_out, 0, &fn, after);
    }
    if (!rc && sh) rc = glu_down(isa, g, u, B, F, H, &wd, gated ? gl : NULL, sho, next);
    if (!rc && moe) /* x + (routed + shared), as the torch path sums */
        for (int64_t i = 0; i < B * H; i++) x[i] += E && sh ? moe_out[i] + sho[i] : E ? moe_out[i] : sho[i];
    free(mem);
    return rc;
}

/* ------------------------------------------------------------------------------ gated DeltaNet */

/* DeltaNet's first product: qkv, z, and b and a (one matrix, or beta and alpha apart). */
static int delta_first(const qk_attn_desc *d, qk_wmat mats[QK_MM_MAX]) {
    const int64_t nv = d->ssm_nv, C = 2 * d->ssm_nk * d->ssm_dk + nv * d->ssm_dv;
    mats[0] = (qk_wmat){bptr(d->ssm_qkv), (int)d->ssm_qkv_type, C};
    mats[1] = (qk_wmat){bptr(d->ssm_z), (int)d->ssm_z_type, nv * d->ssm_dv};
    if (d->ssm_ba) {
        mats[2] = (qk_wmat){bptr(d->ssm_ba), (int)d->ssm_ba_type, 2 * nv};
        return 3;
    }
    mats[2] = (qk_wmat){bptr(d->ssm_beta), (int)d->ssm_beta_type, nv};
    mats[3] = (qk_wmat){bptr(d->ssm_alpha), (int)d->ssm_alpha_type, nv};
    return 4;
}

int qk_layer_first(const qk_attn_desc *d, qk_wmat mats[QK_MM_MAX]) {
    return d->kind == QK_MIX_DELTA ? delta_first(d, mats) : d->kind == QK_MIX_MLA ? qk_mla_first(d, mats)
                                                                                : qk_attn_first(d, mats);
}

/* x += DeltaNet(attn_norm(x)) Wout; conv, ssm: the layer's states, row r's at slot sslots[r]. Rows of one
 * sequence (the same slot) step one after the other: each wave holds rows of distinct slots. then: the job after
 * Wout's. */
static int delta_mix(int isa, const qk_attn_desc *d, float *x, int64_t B, const int64_t *pos, float *conv, float *ssm,
                     const int64_t *sslots, float eps, const qk_then *then) {
    const int64_t H = d->hidden, nk = d->ssm_nk, nv = d->ssm_nv, dk = d->ssm_dk, dv = d->ssm_dv;
    const int64_t C = 2 * nk * dk + nv * dv, Z = nv * dv;
    if (nk < 1 || nv % nk || d->ssm_k < 1 || !sslots || !conv || !ssm) return QK_ESHAPE;
    const int ba = d->ssm_ba != 0;
    const int64_t nfloat = B * (H + 2 * C + 2 * Z + 4 * nv + H) + B;
    float *mem = malloc((size_t)nfloat * sizeof(float));
    if (!mem) return QK_ENOMEM;
    float *xn = mem, *qkv = xn + B * H, *z = qkv + B * C, *bab = z + B * Z, *beta = bab + 2 * B * nv;
    float *alpha = beta + B * nv, *y = alpha + B * nv, *out = y + B * C, *o = out + B * Z;
    uint8_t *fresh = (uint8_t *)(o + B * H);

    for (int64_t r = 0; r < B; r++) qk_rms_norm(x + r * H, fptr(d->attn_norm), H, eps, xn + r * H);
    qk_wmat mats[QK_MM_MAX];
    float *outs[4] = {qkv, z, ba ? bab : beta, alpha};
    const qk_wmat wo = {bptr(d->ssm_out), (int)d->ssm_out_type, H};
    const qk_then to_wo = {1, &wo, Z};
    int rc = qk_matmuls_then(isa, delta_first(d, mats), mats, H, xn, B, outs, &to_wo);
    if (!rc && ba) { /* [b (r), a (r)] per key head -> beta, alpha [B, nv] */
        const int64_t rr = nv / nk;
        for (int64_t r = 0; r < B; r++)
            for (int64_t kh = 0; kh < nk; kh++)
                for (int64_t j = 0; j < rr; j++) {
                    beta[r * nv + kh * rr + j] = bab[r * 2 * nv + kh * 2 * rr + j];
                    alpha[r * nv + kh * rr + j] = bab[r * 2 * nv + kh * 2 * rr + rr + j];
                }
    }
    for (int64_t r = 0; r < B; r++) fresh[r] = pos[r] == 0;
    for (int64_t start = 0, end; !rc && start < B; start = end) {
        for (end = start + 1; end < B; end++) { /* the wave ends before a slot it holds comes again */
            int64_t seen = 0;
            for (int64_t j = start; j < end; j++) seen |= sslots[j] == sslots[end];
            if (seen) break;
        }
        const qk_delta_args a = {.B = end - start, .C = C, .K = d->ssm_k, .nk = nk, .nv = nv, .dk = dk, .dv = dv,
                                 .tiled = (int)d->ssm_tiled, .qkv = qkv + start * C, .z = z + start * Z,
                                 .beta = beta + start * nv, .alpha = alpha + start * nv, .conv = conv, .ssm = ssm,
                                 .slots = sslots + start, .fresh = fresh + start, .w = fptr(d->ssm_conv),
                                 .a = fptr(d->ssm_a), .dt = fptr(d->ssm_dt), .norm = fptr(d->ssm_norm), .eps = eps,
                                 .y = y + start * C, .out = out + start * Z};
        rc = qk_delta_step(&a);
    }
    if (!rc) rc = qk_matmuls_then(isa, 1, &wo, Z, out, B, &o, then);
    for (int64_t i = 0; !rc && i < B * H; i++) x[i] += o[i];
    free(mem);
    return rc;
}

/* ------------------------------------------------------------------------------------ the calls */

static int states_within(int64_t B, const int64_t *sslots, int64_t nstates) {
    for (int64_t r = 0; r < B; r++)
        if (!sslots || sslots[r] < 0 || sslots[r] >= nstates) return 0;
    return 1;
}

/* qk_attn_block, next: the job after the layer's last (qk_matmuls_then), or NULL. */
static int attn_block(int isa, const qk_attn_desc *d, float *x, int64_t B, const int64_t *const *slots,
                      const int64_t *pos, void *kc, void *vc, const float *rope_cos, const float *rope_sin, float eps,
                      float clip, float *xn_out, int64_t *ids_out, float *w_out, int moe, int ktype, int vtype,
                      const int64_t *sslots, int64_t nstates, const qk_then *next) {
    if (!qk_kernels(isa)) return QK_EISA;
    if (B < 1 || d->hidden < 1) return QK_ESHAPE;
    for (int64_t r = 0; r < B; r++)
        if (pos[r] < 0) return QK_ESHAPE;
    qk_wmat mats[QK_MM_MAX];
    const qk_then ffn0 = {ffn_first(d, moe, mats), mats, d->hidden}; /* the job after the mixer's last */
    int rc;
    if (d->kind == QK_MIX_DELTA) {
        if (!states_within(B, sslots, nstates)) return QK_ESLOT;
        rc = delta_mix(isa, d, x, B, pos, kc, vc, sslots, eps, &ffn0);
    } else if (d->kind == QK_MIX_MLA) {
        rc = qk_mla_mix(isa, d, x, B, slots, pos, kc, rope_cos, rope_sin, eps, ktype, &ffn0);
    } else {
        rc = qk_attn_mix(isa, d, x, B, slots, pos, kc, vc, rope_cos, rope_sin, eps, clip, ktype, vtype, &ffn0);
    }
    return rc ? rc : ffn(isa, d, x, B, eps, xn_out, ids_out, w_out, moe, next);
}

int qk_attn_block(int isa, const qk_attn_desc *d, float *x, int64_t B, const int64_t *const *slots,
                  const int64_t *pos, void *kc, void *vc, const float *rope_cos, const float *rope_sin,
                  float eps, float clip, float *xn_out, int64_t *ids_out, float *w_out, int moe, int ktype,
                  int vtype, const int64_t *sslots, int64_t nstates) {
    return attn_block(isa, d, x, B, slots, pos, kc, vc, rope_cos, rope_sin, eps, clip, xn_out, ids_out, w_out, moe,
                      ktype, vtype, sslots, nstates, NULL);
}

/* Whether every slot tables[r] names for positions 0..pos[r] lies in [0, nslots). */
static int slots_within(int64_t B, const int64_t *const *tables, const int64_t *pos, int64_t nslots) {
    for (int64_t r = 0; r < B; r++) {
        if (pos[r] < 0) return 0;
        for (int64_t p = 0; p <= pos[r]; p++)
            if (tables[r][p] < 0 || tables[r][p] >= nslots) return 0;
    }
    return 1;
}

static int head_then(int isa, const float *x, int64_t B, int64_t H, const float *out_norm, float eps,
                     const qk_wmat *head, float *xn, float *logits, const qk_then *then) {
    for (int64_t r = 0; r < B; r++) qk_rms_norm(x + r * H, out_norm, H, eps, xn + r * H);
    return qk_matmuls_then(isa, 1, head, H, xn, B, &logits, then);
}

int qk_decode_layers(int isa, int64_t n, const qk_attn_desc *const *descs, float *x, int64_t B,
                     const int64_t *const *slots, const int64_t *const *wslots, const int64_t *pos,
                     void *const *kcs, void *const *vcs, const float *rope_cos, const float *rope_sin, float eps,
                     float clip, float *xn_out, int64_t *ids_out, float *w_out, const float *out_norm,
                     const qk_wmat *head, float *logits, int ktype, int vtype, int64_t nslots, int64_t nwslots,
                     const qk_wmat *embd, const int64_t *tokens, const int64_t *sslots, int64_t nstates) {
    int windowed = 0, plain = 0, linear = 0;
    for (int64_t l = 0; l < n; l++) {
        if (!qk_layer_whole(descs[l])) return QK_EMISSING;
        if (descs[l]->kind == QK_MIX_DELTA) linear = 1;
        else if (descs[l]->window) windowed = 1;
        else plain = 1;
    }
    if ((plain && !slots_within(B, slots, pos, nslots)) || (windowed && !slots_within(B, wslots, pos, nwslots)) ||
        (linear && !states_within(B, sslots, nstates)))
        return QK_ESLOT;
    if (embd) {
        for (int64_t r = 0; r < B; r++)
            if (tokens[r] < 0 || tokens[r] >= embd->N) return QK_ETOKEN;
        const int rc = qk_dequant_rows(embd->ggml, embd->w, embd->N, n ? descs[0]->hidden : 0, tokens, B, x);
        if (rc) return rc;
    }
    qk_wmat mats[QK_MM_MAX];
    for (int64_t l = 0; l < n; l++) {
        const qk_attn_desc *d = descs[l];
        qk_then next = {0, mats, d->hidden}; /* the next layer's first job, or the head */
        if (l + 1 < n) next.n = qk_layer_first(descs[l + 1], mats);
        else if (head) next = (qk_then){1, head, d->hidden};
        const int rc = attn_block(isa, d, x, B, d->window ? wslots : slots, pos, kcs[l], vcs[l], rope_cos, rope_sin,
                                  eps, clip, xn_out, ids_out, w_out, 1, ktype, vtype, sslots, nstates, &next);
        if (rc) return rc;
    }
    if (!head) return QK_OK;
    const qk_then step = {n ? qk_layer_first(descs[0], mats) : 0, mats, n ? descs[0]->hidden : 0}; /* the next step's */
    return head_then(isa, x, B, descs[n - 1]->hidden, out_norm, eps, head, xn_out, logits, &step);
}

int qk_head(int isa, const float *x, int64_t B, int64_t H, const float *out_norm, float eps, const qk_wmat *head,
            float *xn, float *logits) {
    return head_then(isa, x, B, H, out_norm, eps, head, xn, logits, NULL);
}
