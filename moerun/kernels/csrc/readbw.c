/* The read-bandwidth probe (issue 21): how fast this machine's cores can stream memory, the way the kernels read
 * weights, so that "% of the bound" is against what the hardware gives rather than what one summing loop gets.
 *
 * qk_read_bw reads `nbytes` of `buf` on the kernel pool: each thread takes its own contiguous share and reads it
 * as `streams` interleaved sequential streams (the share cut into `streams` parts, one 64-byte line of each in
 * turn), with 32-byte loads folded into xor accumulators (integer, no float dependency chains), optionally with
 * a software prefetch `prefetch` bytes ahead in each stream. The result (xor of everything) keeps the loads.
 *
 * qk_dot_passes is its counterpart for a kernel: one-token passes over a matrix on the calling thread alone, with no
 * pool and no Python between them, so that a matrix held in L1 or L2 shows what a core computes (issue 36: through
 * Python and the pool each 295 KB call paid its set-up, and the one-token Q4_K_R8 kernel looked compute-bound at
 * 38-40 GB/s where it computes 61-68). */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"
#include "pool.h"
#include "qk.h"

#if QK_X86
#include <immintrin.h>
#define QK_RD_TARGET __attribute__((target("avx2")))
#else
#define QK_RD_TARGET
#endif

typedef struct {
    const uint8_t *buf;
    int64_t nbytes;
    int streams;
    int64_t prefetch;
    uint64_t xors[64];
} rd_ctx;

/* Four lines per step, each folded into its own register accumulator (no dependency chain through memory: a
 * spilled accumulator array held one thread to ~20 GB/s where the matvec kernels read 31). */
QK_RD_TARGET static uint64_t read_range(const uint8_t *p, int64_t n, int streams, int64_t prefetch) {
    const int64_t part = n / streams / 256 * 256;
#if QK_X86
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t off = 0; off < part; off += 256) {
        for (int s = 0; s < streams; s++) {
            const uint8_t *q = p + s * part + off;
            if (prefetch) {
                _mm_prefetch((const char *)(q + prefetch), _MM_HINT_T0);
                _mm_prefetch((const char *)(q + prefetch + 128), _MM_HINT_T0);
            }
            a0 = _mm256_xor_si256(a0, _mm256_xor_si256(_mm256_load_si256((const __m256i *)q),
                                                       _mm256_load_si256((const __m256i *)(q + 32))));
            a1 = _mm256_xor_si256(a1, _mm256_xor_si256(_mm256_load_si256((const __m256i *)(q + 64)),
                                                       _mm256_load_si256((const __m256i *)(q + 96))));
            a2 = _mm256_xor_si256(a2, _mm256_xor_si256(_mm256_load_si256((const __m256i *)(q + 128)),
                                                       _mm256_load_si256((const __m256i *)(q + 160))));
            a3 = _mm256_xor_si256(a3, _mm256_xor_si256(_mm256_load_si256((const __m256i *)(q + 192)),
                                                       _mm256_load_si256((const __m256i *)(q + 224))));
        }
    }
    const __m256i a = _mm256_xor_si256(_mm256_xor_si256(a0, a1), _mm256_xor_si256(a2, a3));
    uint64_t out[4];
    _mm256_storeu_si256((__m256i *)out, a);
    return out[0] ^ out[1] ^ out[2] ^ out[3];
#else
    uint64_t x0 = 0, x1 = 0;
    for (int64_t off = 0; off < part; off += 64)
        for (int s = 0; s < streams; s++) {
            uint64_t v[8];
            memcpy(v, p + s * part + off, 64);
            x0 ^= v[0] ^ v[2] ^ v[4] ^ v[6];
            x1 ^= v[1] ^ v[3] ^ v[5] ^ v[7];
        }
    (void)prefetch;
    return x0 ^ x1;
#endif
}

static void rd_task(void *p, int tid, int nth) {
    rd_ctx *c = p;
    const int64_t share = c->nbytes / nth / 64 * 64;
    const uint64_t x = read_range(c->buf + tid * share, share, c->streams, c->prefetch);
    if (tid < 64) c->xors[tid] = x;
}

int qk_read_bw(const uint8_t *buf, int64_t nbytes, int streams, int64_t prefetch, uint64_t *xor_out) {
    if (!buf || nbytes < 4096 || streams < 1 || streams > 64 || prefetch < 0 || ((uintptr_t)buf & 63))
        return QK_ESHAPE;
    rd_ctx c = {.buf = buf, .nbytes = nbytes, .streams = streams, .prefetch = prefetch};
    const int rc = qk_pool_run(rd_task, &c);
    uint64_t x = 0;
    for (int i = 0; i < 64; i++) x ^= c.xors[i];
    *xor_out = x;
    return rc ? QK_ENOMEM : 0;
}

int qk_dot_passes(int isa, int ggml, const uint8_t *w, int64_t N, int64_t K, const float *x, int64_t reps,
                  float *out) {
    const kernel_set *ks = qk_kernels(isa);
    const int qt = qk_qtype_index(ggml);
    if (!ks) return QK_EISA;
    if (qt < 0) return QK_ETYPE;
    const qtype_info *ti = &QK_TYPES[qt];
    if (N < 1 || K < 1 || reps < 1 || K % ti->blk_elems || N % ti->rows) return QK_ESHAPE;
    const int64_t nb = K / ti->blk_elems, group = nb * ti->blk_bytes;
    uint8_t *xq = malloc((size_t)(K / qk_act_elems(ti->act) * qk_act_bytes(ti->act)));
    if (!xq) return QK_ENOMEM;
    ks->quant[ti->act](x, xq, K);
    const void *xs[1] = {xq};
    for (int64_t r = 0; r < reps; r++)
        for (int64_t g = 0; g < N / ti->rows; g++) ks->dot[qt](nb, w + g * group, xs, 1, out + g * ti->rows);
    free(xq);
    return QK_OK;
}
