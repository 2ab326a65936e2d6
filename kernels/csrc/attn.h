/* The attention half of a decoder layer for a few rows at once (decode steps), in one call (attn.c). */
#ifndef MOERUN_ATTN_H
#define MOERUN_ATTN_H

#include <stdint.h>

#include "matmul.h"

/* A layer's constant part, built once per layer by the Python side from the field names below (an
 * X-macro, so the binding can hand the names over and the two sides cannot drift apart). Addresses are
 * of float32 vectors (0: absent) or of weight matrices of ggml type *_type (quantized, F32 or F16).
 * qk_norm: 0 none, 1 over the whole q / k vector, 2 per head. rope: 0 interleaved pairs, 1 neox halves.
 * router == 0: a dense layer (no routing outputs). gate/up/down (0: not given): the routed experts as
 * qk_expert_mats (base, stride, type), n_ff their intermediate size; with them the call can finish the
 * whole layer (see `moe` below).
 * gpt-oss's additions (0: absent): bo the output projection's bias [hidden]; sinks [n_heads], a logit per head
 * in the softmax's denominator; window > 0: each row attends to its last `window` positions only; router_b the
 * router's bias; gating 0: softmax over the experts then the top n_used (renormalised when norm_topk), 1: the
 * top n_used logits then a softmax over them; act a QK_ACT_* with act_params -> float [alpha, limit]; gate_b,
 * up_b [n_experts, n_ff], down_b [n_experts, hidden] the experts' biases (qk_expert_fn). */
#define QK_ATTN_FIELDS(X)                                                                          \
    X(hidden) X(n_heads) X(n_kv_heads) X(head_dim) X(qk_norm) X(neox)                               \
    X(attn_norm) X(ffn_norm) X(q_norm) X(k_norm) X(bq) X(bk) X(bv)                                  \
    X(wq) X(wq_type) X(wk) X(wk_type) X(wv) X(wv_type) X(wo) X(wo_type)                             \
    X(router) X(router_type) X(n_experts) X(n_used) X(norm_topk)                                    \
    X(gate) X(gate_stride) X(gate_type) X(up) X(up_stride) X(up_type) X(down) X(down_stride)         \
    X(down_type) X(n_ff)                                                                            \
    X(bo) X(sinks) X(window) X(router_b) X(gating) X(act) X(act_params) X(gate_b) X(up_b) X(down_b)

#define QK_ATTN_MEMBER(name) int64_t name;
typedef struct {
    QK_ATTN_FIELDS(QK_ATTN_MEMBER)
} qk_attn_desc;
#undef QK_ATTN_MEMBER

/* For rows r < B (token at position pos[r] of a sequence whose cache slot of position p is slots[r][p]):
 *   xn = attn_norm(x); q, k, v = xn Wq, xn Wk, xn Wv (+ biases, clamped to +-clip when clip > 0, q/k norms,
 *   RoPE from the tables cos/sin [positions, head_dim / 2]); k, v stored at the row's slot of kc, vc
 *   ([slots, n_kv_heads * head_dim] of this layer); o = softmax(q k^T / sqrt(head_dim)) v over positions
 *   0..pos[r] (the last `window` of them; with sinks in the denominator); x += o Wo + bo (in place);
 *   xn_out = ffn_norm(x); for MoE layers ids_out / w_out [B, n_used] = the chosen experts of xn_out Wr + br
 *   as `gating` says, best first.
 * ktype / vtype: the caches' storage as ggml type ids: 0 F32, 1 F16 (kc, vc then hold halves), 8 Q8_0 (each
 * slot's row in blocks of 32 values, an f16 scale and 32 int8; head_dim must be whole blocks); written here as
 * moerun.quant.quantize writes them and read directly by the attention loops.
 * Rows of one sequence see each other's keys (the causal mask within the step). With moe != 0 and the
 * experts given, the routed experts' output (qk_moe_ffn of xn_out) is added to x too: the whole layer.
 * Returns 0 or QK_E*. */
int qk_attn_block(int isa, const qk_attn_desc *d, float *x, int64_t B, const int64_t *const *slots,
                  const int64_t *pos, void *kc, void *vc, const float *rope_cos, const float *rope_sin,
                  float eps, float clip, float *xn_out, int64_t *ids_out, float *w_out, int moe, int ktype,
                  int vtype);

/* n whole layers (descs[l], each with its experts) one after the other on the same rows: layer l's caches
 * kcs[l], vcs[l], its slot tables wslots for a windowed layer (its ring), else slots. xn_out, ids_out, w_out:
 * the last layer's.
 * head (or NULL): then logits [B, head->N] = rms_norm(x, out_norm) head^T as well, so a decode step is one
 * call from the embeddings to the logits (no torch operation between kernel calls: after a step has
 * streamed the weights through the caches, the first torch operation alone took ~0.1 ms, cold code).
 * nslots / nwslots: the slots the caches of the layers without / with a window hold; every slot the rows' tables
 * name for positions 0..pos[r] must lie below them (else QK_ESLOT, before anything is written).
 * embd (or NULL): x [B, hidden] is first set to the rows tokens[0..B) of this embedding table (GGUF layout,
 * embd->N rows; a token outside it: QK_ETOKEN, nothing written), so the step starts from token ids. */
int qk_decode_layers(int isa, int64_t n, const qk_attn_desc *const *descs, float *x, int64_t B,
                     const int64_t *const *slots, const int64_t *const *wslots, const int64_t *pos,
                     void *const *kcs, void *const *vcs, const float *rope_cos, const float *rope_sin, float eps,
                     float clip, float *xn_out, int64_t *ids_out, float *w_out, const float *out_norm,
                     const qk_wmat *head, float *logits, int ktype, int vtype, int64_t nslots, int64_t nwslots,
                     const qk_wmat *embd, const int64_t *tokens);

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
