/* The pieces of the attention loops that the GQA mixer (attn.c) and MLA's (mla.c) share. */
#ifndef MOERUN_ATTN_CORE_H
#define MOERUN_ATTN_CORE_H

#include <stdint.h>

/* The cache's storage kinds (KV_F32, KV_F16, KV_Q8_0: ggml's blocks of 32, an f16 scale then 32 int8). A row of
 * D values of one head starts at base + slot * stride (bytes); a Q8_0 head holds D / 32 whole blocks. */
enum { KV_F32, KV_F16, KV_Q8_0, KV_KINDS };

/* s[j] = scale * q . k_j, k_j at kbase + slot[j] * stride, for j < n (D values each). */
typedef void (*scores_fn)(float *s, const float *q, int64_t n, const uint8_t *kbase, const int64_t *slot,
                          int64_t stride, int64_t D, float scale);
/* s[j] = exp(s[j] - max) for j < n; returns the sum. */
typedef float (*softmax_fn)(float *s, int64_t n, float max);
/* out[D] = sum_j p[j] * v_j, v_j at vbase + slot[j] * stride. */
typedef void (*wsum_fn)(float *out, const float *p, int64_t n, const uint8_t *vbase, const int64_t *slot,
                        int64_t stride, int64_t D);

/* One GQA group: out[i * Dv ..] = softmax(scale * q_i . k_j (+ the sink sinks[i] in the sum))_j . v_j for the g heads
 * q[i * D ..] that share a key/value head, over n keys of D values and kind kkind and values of kind vkind, the first
 * Dv values of their rows (D, Dv % 16 == 0; a Q8_0 head is whole blocks; vbase == kbase: the values are the keys' own
 * rows, as MLA's latents); s: scratch of 8 * n floats. */
#define AG_AHEAD 8 /* rows the group kernel prefetches ahead of the key and value rows it reads */
typedef void (*group_fn)(float *out, const float *q, int64_t g, int64_t n, const uint8_t *kbase, const uint8_t *vbase,
                         const int64_t *slot, int64_t kstride, int64_t vstride, int64_t D, int64_t Dv, int kkind,
                         int vkind, float scale, const float *sinks, float *s);

typedef struct {
    scores_fn scores[KV_KINDS];
    softmax_fn exp_sum;
    wsum_fn wsum[KV_KINDS];
    group_fn group; /* or NULL: the per-head loops */
} attn_kernels;

void qk_attn_group_vnni(float *out, const float *q, int64_t g, int64_t n, const uint8_t *kbase, const uint8_t *vbase,
                        const int64_t *slot, int64_t kstride, int64_t vstride, int64_t D, int64_t Dv, int kkind,
                        int vkind, float scale, const float *sinks, float *s);

/* Floats of scores scratch the attention job needs per query row (attn_task: each item's at least 8 keys' worth a
 * head). */
static inline int64_t qk_group_slots(int64_t g) { return g < 8 ? 8 : g; } /* heads' worth of scores an item */
static inline int64_t qk_score_floats(int64_t nh, int64_t nkv, int64_t maxkeys) {
    return nkv * qk_group_slots(nh / nkv) * maxkeys;
}

/* The loops for an ISA (AVX2 on x86 unless scalar is asked for; with AVX-512 VNNI, the group kernel too). */
const attn_kernels *qk_attn_kernels(int isa);

/* ggml's type id of a cache (0 F32, 1 F16, 8 Q8_0) -> its kind, or -1; bytes of n values of a kind (n a multiple
 * of 32 for Q8_0). */
int qk_kv_kind(int ggml_type);
int64_t qk_kind_bytes(int kind, int64_t n);

/* One row of n values into the cache's kind, as moerun.quant.quantize writes them. */
void qk_store_row(int kind, uint8_t *dst, const float *src, int64_t n);

/* One head's RoPE at one position over its first R dimensions: neox rotates (x[i], x[i + R/2]), interleaved
 * (x[2i], x[2i + 1]). */
void qk_rope(float *x, const float *cos, const float *sin, int64_t R, int neox);

#endif
