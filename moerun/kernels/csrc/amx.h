/* Batches through Intel's AMX tiles (amx.c): the int8 sums of 16 tokens x 16 rows a block in one tile product each,
 * then the VNNI kernels' float steps, so the bits are theirs. For the prompt's matrices and the experts that many tokens
 * chose; one-token passes and small batches keep the VNNI kernels. */
#ifndef MOERUN_AMX_H
#define MOERUN_AMX_H

#include <stdint.h>

/* Tokens at least, per matrix (an expert's share of a batch), for the tiles: a tile holds 16. */
#define QK_AMX_MIN_TOKENS 16

/* 1 when the tiles are on and usable (the CPU has AMX-INT8, the kernel granted the tile state), else 0.
 * qk_set_amx(-1): on where usable (the default), 0: off, 1: on where usable. -> 0, or -1 for another value. */
int qk_amx(void);
int qk_amx_usable(void);
int qk_set_amx(int on);
/* qk_amx_rows calls so far (tests: whether a batch took the tiles). */
int64_t qk_amx_calls(void);

/* Whether the tiles take the interleaved type `qt` (a QT_* index): Q8_0_R8, MXFP4_R8, Q4_K_R8 and Q5_K_R8. */
int qk_amx_type(int qt);

/* Bytes of scratch qk_amx_rows needs for rows of nb blocks of type qt (64-byte aligned memory). */
int64_t qk_amx_scratch(int qt, int64_t nb);

/* out[t * ostride + (r - r0)] = row r of W . x_t for r0 <= r < r1 and t < T, the bits the VNNI kernels give. W: a
 * matrix of interleaved type qt (groups of 8 rows, rowb bytes a group, nb blocks a row); r0 and r1 multiples of 16.
 * xq: the activations quantized (act_q8_0, or act_q8k for Q4_K_R8 / Q5_K_R8), a row of xrow bytes each, readable
 * (any values) up to T rounded up to 16 rows. scratch: qk_amx_scratch(qt, nb) bytes, 64-byte aligned. */
void qk_amx_rows(int qt, const uint8_t *w, int64_t rowb, int64_t nb, int64_t r0, int64_t r1, const uint8_t *xq,
                 int64_t xrow, int64_t T, float *out, int64_t ostride, uint8_t *scratch);

#endif
