/* The attention half of a decoder layer for a few rows at once (decode steps), in one call (attn.c). */
#ifndef MOERUN_ATTN_H
#define MOERUN_ATTN_H

#include <stdint.h>

#include "matmul.h"

/* A layer's constant part, built once per layer by the Python side from the field names below (an
 * X-macro, so the binding can hand the names over and the two sides cannot drift apart). Addresses are
 * of float32 vectors (0: absent) or of weight matrices of ggml type *_type (quantized, F32 or F16).
 * A layer is a mixer then an FFN, each on its normed input with a residual.
 * The mixer (kind): 0 attention, 1 gated DeltaNet (linear attention, the ssm_* fields).
 * Attention: qk_norm 0 none, 1 over the whole q / k vector, 2 per head. rope: 0 interleaved pairs, 1 neox
 * halves, over the first rope_dim dimensions of each head (the rest pass through; the tables are
 * [positions, rope_dim / 2]). attn_gate: wq gives each head's q then its output gate (2 * head_dim rows a head),
 * and the head's output is scaled by sigmoid(gate). bo the output projection's bias [hidden]; sinks [n_heads], a
 * logit per head in the softmax's denominator; window > 0: each row attends to its last `window` positions only.
 * fparams -> float [routed_scale, softmax scale (0: head_dim ** -0.5)].
 * The FFN: router == 0, a dense layer: the sh_* matrices are its FFN. Else routed experts: router_b the router's
 * bias; gating 0: softmax over the experts, 1 (gpt-oss): the top n_used logits then a softmax over them, 2: sigmoid
 * scores; with 0 and 2 the top n_used are chosen by score + score_b (a correction bias, or 0) within the best
 * topk_groups of n_groups groups (a group scored by its best expert, group_score 0, or its best two summed, 1),
 * weighted by their scores, renormalised when norm_topk; every weight times routed_scale. gate/up/down (0: not
 * given): the routed experts as qk_expert_mats (base, stride, type), n_ff their intermediate size, act a
 * QK_ACT_* with act_params -> float [alpha, limit]; gate_b, up_b [n_experts, n_ff], down_b [n_experts, hidden] the
 * experts' biases (qk_expert_fn). sh_gate/sh_up [sh_ff, hidden], sh_down [hidden, sh_ff]: a shared expert
 * beside the routed ones (down(silu(gate x) * up x)), scaled by sigmoid(x . sh_gate_inp) when that is given.
 * Gated DeltaNet: ssm_qkv [C, hidden] (q, k: ssm_nk heads of ssm_dk; v: ssm_nv heads of ssm_dv; through a causal
 * conv1d of width ssm_k, weights ssm_conv [C, ssm_k]); ssm_z [nv * dv, hidden] the output gate; beta and alpha
 * from ssm_ba ([b (r), a (r)] per key head, r = nv / nk) or ssm_beta and ssm_alpha [nv, hidden]; ssm_a, ssm_dt
 * [nv]; ssm_norm [dv] the gated norm; ssm_out [hidden, nv * dv]; ssm_tiled: value head h reads key head h % nk
 * (else h / r). Its state (deltanet.h) lives in the pool's conv [slots, C, ssm_k - 1] and ssm [slots, nv, dk, dv],
 * passed where an attention layer's kc and vc go.
 * Multi-head latent attention (kind 2, DeepSeek's MLA, absorbed): n_heads heads of head_dim = nope + rope_dim query
 * dimensions (the last rope_dim rotated); q = xn wq ([n_heads * head_dim, hidden]), or with q_rank > 0 q =
 * q_a_norm(xn wq_a) wq (wq_a [q_rank, hidden], wq [n_heads * head_dim, q_rank]); the latent [mla_rank + rope_dim]
 * = [kv_a_norm(c), rope(k_pe)] for [c, k_pe] = xn wkv_a, stored in the cache (kc: [slots, mla_rank + rope_dim]; vc
 * is not read). Each head's query enters the latent space through wk_b [n_heads, mla_rank, nope], attends over the
 * latents (keys: the whole latent; values: its first mla_rank values), and leaves through wv_b [n_heads, mla_v,
 * mla_rank]; x += o wo ([hidden, n_heads * mla_v]). wk_b and wv_b are float32 (type 0) or quantized in GGUF's layout
 * (their ggml types): either way each product is the float one of the dequantized weights (deqdot.c). */
#define QK_ATTN_FIELDS(X)                                                                          \
    X(hidden) X(n_heads) X(n_kv_heads) X(head_dim) X(qk_norm) X(neox)                               \
    X(attn_norm) X(ffn_norm) X(q_norm) X(k_norm) X(bq) X(bk) X(bv)                                  \
    X(wq) X(wq_type) X(wk) X(wk_type) X(wv) X(wv_type) X(wo) X(wo_type)                             \
    X(router) X(router_type) X(n_experts) X(n_used) X(norm_topk)                                    \
    X(gate) X(gate_stride) X(gate_type) X(up) X(up_stride) X(up_type) X(down) X(down_stride)         \
    X(down_type) X(n_ff)                                                                            \
    X(bo) X(sinks) X(window) X(router_b) X(gating) X(act) X(act_params) X(gate_b) X(up_b) X(down_b) \
    X(kind) X(rope_dim) X(attn_gate) X(fparams) X(score_b) X(n_groups) X(topk_groups) X(group_score)  \
    X(sh_gate) X(sh_gate_type) X(sh_up) X(sh_up_type) X(sh_down) X(sh_down_type) X(sh_ff)            \
    X(sh_gate_inp)                                                                                  \
    X(ssm_qkv) X(ssm_qkv_type) X(ssm_z) X(ssm_z_type) X(ssm_ba) X(ssm_ba_type) X(ssm_beta)           \
    X(ssm_beta_type) X(ssm_alpha) X(ssm_alpha_type) X(ssm_out) X(ssm_out_type) X(ssm_conv) X(ssm_k)  \
    X(ssm_nk) X(ssm_nv) X(ssm_dk) X(ssm_dv) X(ssm_tiled) X(ssm_a) X(ssm_dt) X(ssm_norm)              \
    X(mla_rank) X(mla_v) X(q_rank) X(wq_a) X(wq_a_type) X(q_a_norm) X(wkv_a) X(wkv_a_type) X(kv_a_norm) \
    X(wk_b) X(wk_b_type) X(wv_b) X(wv_b_type)

enum { QK_MIX_ATTN = 0, QK_MIX_DELTA = 1, QK_MIX_MLA = 2 };

#define QK_ATTN_MEMBER(name) int64_t name;
typedef struct {
    QK_ATTN_FIELDS(QK_ATTN_MEMBER)
} qk_attn_desc;
#undef QK_ATTN_MEMBER

/* For rows r < B (token at position pos[r] of a sequence whose cache slot of position p is slots[r][p], and
 * whose recurrent state, for a DeltaNet layer, is slot sslots[r] of the pool's states; nstates of them):
 * the mixer, x += mix(attn_norm(x)) in place: attention (q, k, v = xn Wq, xn Wk, xn Wv, + biases, clamped to
 * +-clip when clip > 0, q/k norms, RoPE from the tables cos/sin; k, v stored at the row's slot of kc, vc
 * ([slots, n_kv_heads * head_dim] of this layer); o = softmax(scale q k^T) v over positions 0..pos[r] (the last
 * `window` of them; with sinks in the denominator); gated; x += o Wo + bo), or gated DeltaNet (kc, vc: the
 * layer's conv and ssm states, rows of one sequence stepped in their order; a row at position 0 starts from
 * zeros); then xn_out = ffn_norm(x); for MoE layers ids_out / w_out [B, n_used] = the chosen experts of
 * xn_out Wr + br as `gating` says, best first.
 * ktype / vtype: the caches' storage as ggml type ids: 0 F32, 1 F16 (kc, vc then hold halves), 8 Q8_0 (each
 * slot's row in blocks of 32 values, an f16 scale and 32 int8; head_dim must be whole blocks); written here as
 * moerun.quant.quantize writes them and read directly by the attention loops.
 * Rows of one sequence see each other's keys (the causal mask within the step). With moe != 0 the FFN is
 * finished too (the routed experts given, and the shared expert; a dense layer's FFN): the whole layer.
 * Returns 0 or QK_E*. */
int qk_attn_block(int isa, const qk_attn_desc *d, float *x, int64_t B, const int64_t *const *slots,
                  const int64_t *pos, void *kc, void *vc, const float *rope_cos, const float *rope_sin,
                  float eps, float clip, float *xn_out, int64_t *ids_out, float *w_out, int moe, int ktype,
                  int vtype, const int64_t *sslots, int64_t nstates);

/* The attention mixer alone (attn.c): x += attention(attn_norm(x)) as qk_attn_block's kind 0. then: the job after
 * its output projection (qk_matmuls_then), or NULL. */
int qk_attn_mix(int isa, const qk_attn_desc *d, float *x, int64_t B, const int64_t *const *slots,
                const int64_t *pos, void *kc, void *vc, const float *rope_cos, const float *rope_sin, float eps,
                float clip, int ktype, int vtype, const qk_then *then);

/* MLA's mixer alone (mla.c): x += latent attention(attn_norm(x)) as qk_attn_block's kind 2, the latent cache
 * kc of ggml type ktype (F32, F16, or Q8_0 when mla_rank and rope_dim are whole blocks); then as qk_attn_mix's. */
int qk_mla_mix(int isa, const qk_attn_desc *d, float *x, int64_t B, const int64_t *const *slots, const int64_t *pos,
               void *kc, const float *rope_cos, const float *rope_sin, float eps, int ktype, const qk_then *then);

/* The matrices of a layer's first product, all against attn_norm(x) (K = hidden): mats[0..n), n returned. The
 * mixers take them from here (qk_attn_first: q, k, v; qk_mla_first: q or q_a, and kv_a), and so does the job
 * before, to prefetch them (qk_matmuls_then). */
int qk_layer_first(const qk_attn_desc *d, qk_wmat mats[QK_MM_MAX]);
int qk_attn_first(const qk_attn_desc *d, qk_wmat mats[QK_MM_MAX]);
int qk_mla_first(const qk_attn_desc *d, qk_wmat mats[QK_MM_MAX]);

/* out = w * (x / rms(x)) over n values, the mean of squares accumulated in double (out may be x). */
void qk_rms_norm(const float *x, const float *w, int64_t n, float eps, float *out);

/* The layer loop's per-row pieces in the arithmetic of the fused layers (moerun.kernels.rows), so that a step
 * gives the same bits either way: RMSNorm of `rows` rows of n values; RoPE over the first R dimensions of each of
 * `heads` heads of D values in T rows (tables [T, R / 2]); x *= sigmoid(gate) over n values; attention of B rows
 * (q [B, nh * D]) over float32 keys and values [*, nkv * D] (row r's position p at row slots[r][p]) as the fused
 * attention computes it (scale <= 0: D ** -0.5) -> att [B, nh * D]; a router's choice for B rows of logits [B, E]
 * (used up) as qk_attn_block's gating says (n_used, gating, score_b, n_groups, topk_groups, group_score,
 * norm_topk, fparams[0] the scale). The norm and RoPE rows of a big step (65,536 values or more) go over the kernel
 * pool, each row as alone: call them from outside a pool job. */
void qk_rms_norm_rows(const float *x, const float *w, int64_t rows, int64_t n, float eps, float *out);
void qk_rope_rows(float *x, int64_t T, int64_t heads, int64_t D, const float *cos, const float *sin, int64_t R,
                  int neox);
void qk_gate_mul(float *x, const float *gate, int64_t n);
int qk_attend_rows(int isa, const float *q, int64_t B, int64_t nh, int64_t nkv, int64_t D, const float *k,
                   const float *v, const int64_t *const *slots, const int64_t *pos, int64_t window, const float *sinks,
                   float scale, float *att);
int qk_route_rows(const qk_attn_desc *d, float *logits, int64_t B, int64_t E, int64_t *ids, float *w);
/* MLA's attention for B rows as qk_mla_mix computes it (mla.c): q [B, nh, nope + R] (rotated), float32 W_UK
 * [nh * rank, nope] and W_UV [nh * dv, rank], the float32 latents [*, rank + R] (row r's position p at row
 * slots[r][p]) -> o [B, nh * dv]. */
int qk_mla_attend_rows(int isa, const float *q, int64_t B, int64_t nh, int64_t rank, int64_t R, int64_t nope,
                       int64_t dv, const float *wk_b, const float *wv_b, const float *cache,
                       const int64_t *const *slots, const int64_t *pos, float scale, float *o);

/* out [B, H] = down(silu(g) * u) for g, u [B, F] (g is overwritten), scaled row by row by sigmoid(gl[r]) when gl
 * is given: a shared expert's or a dense FFN's second half, the same arithmetic in the fused layers and the layer
 * loop (moerun.kernels.cpu.glu_down), so where it runs never changes a bit. */
int qk_glu_down(int isa, float *g, const float *u, int64_t B, int64_t F, int64_t H, const qk_wmat *down,
                const float *gl, float *out);

/* Whether layer d finishes its FFN in qk_attn_block(..., moe = 1): its routed experts given, or a dense FFN. */
int qk_layer_whole(const qk_attn_desc *d);

/* n whole layers (descs[l], each qk_layer_whole) one after the other on the same rows: layer l's caches (or
 * states) kcs[l], vcs[l], its slot tables wslots for a windowed layer (its ring), else slots; sslots [B] the
 * rows' state slots (NULL without DeltaNet layers). xn_out, ids_out, w_out: the last layer's (scratch of
 * B * max n_used).
 * head (or NULL): then logits [B, head->N] = rms_norm(x, out_norm) head^T as well, so a decode step is one
 * call from the embeddings to the logits (no torch operation between kernel calls: after a step has
 * streamed the weights through the caches, the first torch operation alone took ~0.1 ms, cold code).
 * nslots / nwslots / nstates: the slots the caches of the layers without / with a window, and the states, hold;
 * every slot the rows' tables name for positions 0..pos[r] must lie below them (else QK_ESLOT, before anything
 * is written).
 * embd (or NULL): x [B, hidden] is first set to the rows tokens[0..B) of this embedding table (GGUF layout,
 * embd->N rows; a token outside it: QK_ETOKEN, nothing written), so the step starts from token ids. */
int qk_decode_layers(int isa, int64_t n, const qk_attn_desc *const *descs, float *x, int64_t B,
                     const int64_t *const *slots, const int64_t *const *wslots, const int64_t *pos,
                     void *const *kcs, void *const *vcs, const float *rope_cos, const float *rope_sin, float eps,
                     float clip, float *xn_out, int64_t *ids_out, float *w_out, const float *out_norm,
                     const qk_wmat *head, float *logits, int ktype, int vtype, int64_t nslots, int64_t nwslots,
                     const qk_wmat *embd, const int64_t *tokens, const int64_t *sslots, int64_t nstates);

/* logits [B, head->N] = rms_norm(x [B, H], out_norm) head^T (xn: B * H floats of scratch). */
int qk_head(int isa, const float *x, int64_t B, int64_t H, const float *out_norm, float eps, const qk_wmat *head,
            float *xn, float *logits);

/* A prompt's causal GQA attention (attn_prompt.c): q [T, nh, D], k [S, nkv, D], v [S, nkv, Dv] floats, positions
 * q_pos [T] and k_pos [S] (ascending); each query sees the keys at positions <= its own (and, window > 0, above
 * its own - window); sinks [nh] or NULL: a logit per head in the softmax's sum, with no value. -> out [T, nh, Dv]. */
int qk_attn_prompt(int isa, const float *q, int64_t T, int64_t nh, int64_t D, const float *k, const float *v,
                   int64_t S, int64_t nkv, int64_t Dv, const int64_t *q_pos, const int64_t *k_pos, float scale,
                   int64_t window, const float *sinks, float *out);

#endif
