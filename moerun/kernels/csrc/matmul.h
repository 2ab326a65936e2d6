/* matmul and fused MoE expert FFN over GGUF blocks (matmul.c). Both return 0 or a QK_E* code. */
#ifndef MOERUN_MATMUL_H
#define MOERUN_MATMUL_H

#include <stdint.h>

#include "pool.h"

enum { QK_OK = 0, QK_ENOMEM = -1, QK_EISA = -2, QK_ETYPE = -3, QK_ESHAPE = -4, QK_EIDS = -5, QK_EMISSING = -6, QK_ESLOT = -7,
       QK_ETOKEN = -8 };

/* out[T, N] = x[T, K] @ W[N, K]^T; W is N rows of ggml type `ggml` (row stride: whole blocks). */
int qk_matmul(int isa, int ggml, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t T,
              float *out);

/* Several matrices against the same x [T, K] in one pool job (x quantized once per activation format):
 * out[j][T, w[j].N] = x @ W_j^T. ggml may also be GGML_F32 / GGML_F16 (float rows, no quantization). */
#define QK_MM_MAX 4
typedef struct {
    const uint8_t *w;
    int ggml;
    int64_t N;
} qk_wmat;
int qk_matmuls(int isa, int n, const qk_wmat *w, int64_t K, const float *x, int64_t T, float *const *out);
/* The qk_matmuls job that comes next (n matrices against one input of K values, as many rows as this call's), or
 * n = 0 for one not known: a thread done with its share of this call prefetches where its share of that job starts
 * (pool.h's qk_pool_run_then). */
typedef struct {
    int n;
    const qk_wmat *w;
    int64_t K;
} qk_then;
int qk_matmuls_then(int isa, int n, const qk_wmat *w, int64_t K, const float *x, int64_t T, float *const *out,
                    const qk_then *then);
/* Where each thread's share of the qk_matmuls job `then` (T rows) starts: spans[t] for t < the count returned (the
 * pool's threads, at most QK_THEN_MAX; 0 when then is NULL, empty or not a shape qk_matmuls takes, or while
 * qk_idle_prefetch() is 0). For other jobs to pass to qk_pool_run_then. */
int qk_then_spans(int isa, const qk_then *then, int64_t T, qk_span *spans);

/* Where each expert's copy of one matrix lies: with stride > 0, expert e's rows start at base + e * stride
 * (a stacked [E, rows, cols] tensor); with stride == 0, base points to E little-endian uint64 addresses,
 * 0 for an expert that is not provided (an error if routed to). `type` is the ggml type. */
typedef struct {
    const uint8_t *base;
    int64_t stride;
    int type;
} qk_expert_mats;

/* What each expert computes around its three matrices: the activation (QK_ACT_SWIGLU: silu(g) * u;
 * QK_ACT_SWIGLU_OAI, gpt-oss: g' = min(g, limit), g' * sigmoid(alpha g') * (clamp(u, -limit, limit) + 1)) and
 * optional biases by expert id (gate_b, up_b: E x I floats, down_b: E x H; NULL: none). */
enum { QK_ACT_SWIGLU = 0, QK_ACT_SWIGLU_OAI = 1 };
typedef struct {
    int act;
    float alpha, limit;
    const float *gate_b, *up_b, *down_b;
} qk_expert_fn;

/* out[T, H] = sum_j wts[t, j] * down_e(silu(gate_e x_t) * up_e x_t), e = ids[t, j], j < k, summed in
 * the order of j (fn: another activation and biases, or NULL). gate/up: [I, H] per expert, down: [H, I], each
 * matrix kind of its own ggml type.
 * A pair whose id is negative is skipped (it adds nothing). pairs != 0: no sum; out is [T * k, H] and row
 * t * k + j holds wts[t, j] * down_e(...) for that pair (0 for a skipped pair), so pairs computed by several
 * calls, summed in the order of j afterwards, give exactly the sum one call gives. then: the job after the down
 * projection's, or NULL (qk_matmuls_then). */
int qk_moe_ffn(int isa, const float *x, int64_t T, int64_t H, const int32_t *ids, const float *wts, int k,
               qk_expert_mats gate, qk_expert_mats up, qk_expert_mats down, int64_t E, int64_t I, float *out,
               int pairs, const qk_expert_fn *fn, const qk_then *then);

/* W[N, K] of GGUF type Q4_K into the interleaved layout `to` (GGML_Q4_K_R8; N a multiple of 8), and back
 * (qk_unpack, `from` the interleaved type). src and dst must not overlap; same byte count both ways (r8.c). */
int qk_repack(int to, const uint8_t *src, uint8_t *dst, int64_t N, int64_t K);
int qk_unpack(int from, const uint8_t *src, uint8_t *dst, int64_t N, int64_t K);
/* The same repack of N rows read from file `fd` at `offset`, a scratch buffer's worth at a time on the calling
 * thread (scratch_bytes >= 8 rows): -> the bytes read (N rows' worth unless the file ends first), a QK_E* code, or
 * -1000 - errno when a read fails. */
int64_t qk_read_repack(int fd, int64_t offset, int to, uint8_t *dst, int64_t N, int64_t K, uint8_t *scratch,
                       int64_t scratch_bytes);
/* Many reads on the threads that share `next` (r8.c): jobs of QK_READ_JOB int64 each (fd, offset, to or -1, dst, N,
 * K), done[i] set from QK_READ_PENDING to the job's qk_read_repack-style result when it ends. */
#define QK_READ_JOB 6
#define QK_READ_PENDING INT64_MIN
void qk_read_jobs(const int64_t *jobs, int64_t n, int64_t *next, int64_t *done, uint8_t *scratch,
                  int64_t scratch_bytes);

/* out[n, K] = rows[i] of W[N, K] (ggml type `ggml`) as floats, the values gguf.quants gives. */
int qk_dequant_rows(int ggml, const uint8_t *w, int64_t N, int64_t K, const int64_t *rows, int64_t n, float *out);
/* The same on the thread pool (from Python, never from inside a pool job). */
int qk_dequant_rows_mt(int ggml, const uint8_t *w, int64_t N, int64_t K, const int64_t *rows, int64_t n, float *out);

/* The read-bandwidth probe (readbw.c): read nbytes of buf (64-byte aligned) on the kernel pool, each thread its
 * share as `streams` interleaved streams, prefetching `prefetch` bytes ahead (0: none); *xor_out: the data's xor. */
int qk_read_bw(const uint8_t *buf, int64_t nbytes, int streams, int64_t prefetch, uint64_t *xor_out);
/* reps one-token passes of W [N, K] (ggml type; whole blocks, N a multiple of its rows per call) against x [K] on the
 * calling thread, nothing else between them (readbw.c); out[N]: the products, what qk_matmul gives for that row. */
int qk_dot_passes(int isa, int ggml, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t reps,
                  float *out);

#endif
