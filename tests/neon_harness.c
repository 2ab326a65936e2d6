/* The NEON kernel set against the portable one, built for AArch64 and run under qemu by
 * tests/test_neon_kernels.py (x86 machines have no NEON to run it on).
 *
 * Integer sums are exact in both sets, so outputs may differ only by float summation order: every dot of
 * every type (random bytes with sane scale fields, 1..4 tokens, 1..5 blocks) and a threaded matmul per type
 * must agree to 2e-5 relative. Prints "neon: <n> checks ok", or "neon: not available" and exits 3 when the
 * CPU lacks the dot-product extension (the module then falls back to the portable set), 1 on a mismatch. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "matmul.h"
#include "pool.h"
#include "qk.h"

static uint64_t rng = 88172645463325252ULL;
static uint32_t next(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)rng;
}
static float uniform(float lo, float hi) { return lo + (hi - lo) * (float)(next() >> 8) / 16777216.0f; }

static void put_f16(uint8_t *p, float v) { /* truncated to a normal half; below half's normals: 0 */
    uint32_t b;
    memcpy(&b, &v, 4);
    const uint16_t h = fabsf(v) < 6.2e-5f ? 0 : (uint16_t)(((b >> 16) & 0x8000) | ((((b >> 23) & 0xff) - 112) << 10) |
                                                          ((b >> 13) & 0x3ff));
    memcpy(p, &h, 2);
}

/* rows x nb blocks of GGUF type `qt` (random bytes, finite scales). */
static void fill(int qt, uint8_t *w, int rows, int nb) {
    const qtype_info *ti = &QK_TYPES[qt];
    for (int64_t i = 0; i < (int64_t)rows * nb; i++) {
        uint8_t *b = w + i * ti->blk_bytes;
        for (int j = 0; j < ti->blk_bytes; j++) b[j] = (uint8_t)next();
        switch (ti->ggml) {
        case GGML_Q8_0: case GGML_Q4_0: put_f16(b, uniform(-0.02f, 0.02f)); break;
        case GGML_Q4_K: case GGML_Q5_K: put_f16(b, uniform(1e-3f, 4e-3f)); put_f16(b + 2, uniform(1e-3f, 4e-3f)); break;
        case GGML_Q6_K: put_f16(b + 208, uniform(1e-4f, 4e-4f)); break;
        case GGML_IQ4_XS: put_f16(b, uniform(-2e-4f, 2e-4f)); break;
        case GGML_MXFP4: b[0] = (uint8_t)(118 + next() % 6); break;
        default: break;
        }
    }
}

static int check(const char *what, const float *a, const float *b, int n) {
    double diff = 0, ref = 0;
    for (int i = 0; i < n; i++) {
        diff += (a[i] - b[i]) * (double)(a[i] - b[i]);
        ref += b[i] * (double)b[i];
    }
    if (!(sqrt(diff) <= 2e-5 * sqrt(ref) + 1e-30)) {
        printf("neon: MISMATCH %s: relative %.3g\n", what, sqrt(diff / (ref + 1e-300)));
        return 1;
    }
    return 0;
}

int main(void) {
    const kernel_set *neon = qk_kernels(ISA_NEON), *scalar = qk_kernels(ISA_SCALAR);
    if (!neon) {
        printf("neon: not available (best set: %s)\n", qk_isa_name(qk_best_isa()));
        return 3;
    }
    if (qk_best_isa() != ISA_NEON) {
        printf("neon: available but not the best set\n");
        return 1;
    }
    int checks = 0, bad = 0;
    for (int qt = 0; qt < QT_COUNT; qt++) {
        const qtype_info *ti = &QK_TYPES[qt];
        const int rows = ti->rows, src = ti->rows > 1 ? qk_qtype_index(ti->ggml - QK_R8) : qt;
        for (int nb = 1; nb <= 5; nb++) {
            const int K = nb * ti->blk_elems, act = ti->act;
            uint8_t *w = malloc((size_t)rows * nb * QK_TYPES[src].blk_bytes);
            uint8_t *wr = malloc((size_t)rows * nb * QK_TYPES[src].blk_bytes);
            fill(src, w, rows, nb);
            if (rows > 1) qk_repack(ti->ggml, w, wr, rows, K);
            else memcpy(wr, w, (size_t)nb * ti->blk_bytes);
            const int xb = K / qk_act_elems(act) * qk_act_bytes(act);
            uint8_t *xq = malloc((size_t)DOT_MAX_NT * xb);
            float *x = malloc(sizeof(float) * K);
            const void *xs[DOT_MAX_NT];
            for (int t = 0; t < DOT_MAX_NT; t++) {
                for (int j = 0; j < K; j++) x[j] = uniform(-1.0f, 1.0f);
                scalar->quant[act](x, xq + t * xb, K);
                xs[t] = xq + t * xb;
            }
            for (int nt = 1; nt <= DOT_MAX_NT; nt++) {
                float a[DOT_MAX_NT * DOT_MAX_ROWS], b[DOT_MAX_NT * DOT_MAX_ROWS];
                neon->dot[qt](nb, wr, xs, nt, a);
                scalar->dot[qt](nb, wr, xs, nt, b);
                char what[64];
                snprintf(what, sizeof what, "%s nb=%d nt=%d", ti->name, nb, nt);
                bad += check(what, a, b, nt * rows);
                checks++;
            }
            free(w), free(wr), free(xq), free(x);
        }
        /* a threaded matmul: 64 rows, K = 4 blocks, 7 tokens */
        const int N = 64, nb = 4, K = nb * ti->blk_elems, T = 7;
        uint8_t *w = malloc((size_t)N * nb * QK_TYPES[src].blk_bytes), *wr = malloc((size_t)N * nb * QK_TYPES[src].blk_bytes);
        fill(src, w, N, nb);
        if (rows > 1) qk_repack(ti->ggml, w, wr, N, K);
        else memcpy(wr, w, (size_t)N * nb * ti->blk_bytes);
        float *x = malloc(sizeof(float) * T * K), *a = malloc(sizeof(float) * T * N), *b = malloc(sizeof(float) * T * N);
        for (int j = 0; j < T * K; j++) x[j] = uniform(-1.0f, 1.0f);
        qk_pool_set_threads(3, 50);
        if (qk_matmul(ISA_NEON, ti->ggml, wr, N, K, x, T, a) || qk_matmul(ISA_SCALAR, ti->ggml, wr, N, K, x, T, b)) {
            printf("neon: matmul %s failed\n", ti->name);
            bad++;
        } else {
            bad += check(ti->name, a, b, T * N);
        }
        checks++;
        free(w), free(wr), free(x), free(a), free(b);
    }
    if (bad) {
        printf("neon: %d of %d checks failed\n", bad, checks);
        return 1;
    }
    printf("neon: %d checks ok\n", checks);
    return 0;
}
