/* Token sampling's passes over a vocabulary of logits (sample.c; moerun.kernels.sample). */
#ifndef MOERUN_SAMPLE_H
#define MOERUN_SAMPLE_H

#include <stdint.h>

#define SAMP_BLOCK 256
#define SAMP_BUCKETS 4096

int64_t samp_argmax(int isa, const float *x, int64_t n);
int64_t samp_draw(int isa, const float *x, int64_t n, float t, float cut, double u);
double samp_norm(int isa, const float *x, int64_t n, float mx);
int samp_cut(int isa, const float *x, int64_t n, float top_p, int use_top_p, float log_min_p, int use_min_p,
             double *hist, uint32_t *keys, int64_t cap, float *cut);
int64_t samp_topk(int isa, const float *vals, const int64_t *ids, int64_t k, float t, float top_p, int use_top_p,
                  float log_min_p, int use_min_p, double u, float *sv, int64_t *sid);
void samp_exp(int isa, const float *x, int64_t n, float *out);

#endif
