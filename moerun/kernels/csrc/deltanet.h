/* Gated DeltaNet's decode step (moerun/model/deltanet.py's conv_step, delta_step and gated_norm in one call):
 * B sequences, one position each, their states updated in place in the pool's slots. */
#ifndef MOERUN_DELTANET_H
#define MOERUN_DELTANET_H

#include <stdint.h>

typedef struct {
    int64_t B, C, K, nk, nv, dk, dv;
    int tiled;                       /* value head h reads key head h % nk (else h / (nv / nk)) */
    const float *qkv;                /* [B, C] the projection before the conv1d: q (nk * dk), k, v (nv * dv) */
    const float *z;                  /* [B, nv * dv] the output gate */
    const float *beta;               /* [B, nv] logits */
    const float *alpha;              /* [B, nv] */
    float *conv;                     /* [slots, C, K - 1] */
    float *ssm;                      /* [slots, nv, dk, dv] */
    const int64_t *slots;            /* [B] */
    const uint8_t *fresh;            /* [B] 1: the sequence starts here (its slot's state is ignored) */
    const float *w;                  /* [C, K] */
    const float *a;                  /* [nv] ssm_a = -exp(A_log) */
    const float *dt;                 /* [nv] */
    const float *norm;               /* [dv] */
    float eps;
    float *y;                        /* [B, C] scratch: the conv1d's output after SiLU */
    float *out;                      /* [B, nv * dv] */
} qk_delta_args;

int qk_delta_step(const qk_delta_args *args);

/* The delta rule over T >= 1 positions of one sequence (deltanet_prompt.c; deltanet.py's delta_steps): q and k as
 * the conv1d (then SiLU) gives them, not yet L2-normalised; the state updated in place. Returns 0 or a QK_E* code. */
typedef struct {
    int64_t T, nk, nv, dk, dv;
    int64_t sq, sk, sv;              /* floats from one position's q (k, v) row to the next */
    int tiled;                       /* value head h reads key head h % nk (else h / (nv / nk)) */
    int isa;                         /* ISA_*: AVX-512 (ISA_VNNI), AVX2, else the portable set */
    const float *q, *k;              /* [T, nk, dk] rows sq (sk) apart */
    const float *v;                  /* [T, nv, dv] rows sv apart */
    const float *g, *beta;           /* [T, nv] the log decay, beta after its sigmoid */
    float *state;                    /* [nv, dk, dv] */
    const float *z;                  /* [T, nv, dv] rows sz apart: the output gate; NULL: out is S^T q itself */
    int64_t sz;
    const float *norm;               /* [dv] with z: out = norm * rms_norm(S^T q, eps) * silu(z) per head */
    float eps;
    float *out;                      /* [T, nv, dv] */
} qk_delta_prompt_args;

int qk_delta_prompt(const qk_delta_prompt_args *args);

/* The causal depthwise conv1d (then SiLU) over T >= 1 positions of one sequence (deltanet.py's conv_prompt): x [T, C]
 * rows sx apart, w [C, K] (K <= 16), state [C, K - 1] the inputs before x, replaced by the last K - 1 -> y [T, C]. */
int qk_delta_conv_prompt(int64_t T, int64_t C, int64_t K, const float *x, int64_t sx, const float *w, float *state,
                         float *y);

#endif
