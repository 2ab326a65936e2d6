/* The AVX-512 VNNI kernel set: qk_dot_*_vnni, the AVX2 kernels with vpdpbusd / vpdpwssd in place of
 * maddubs + madd + add (same integer results, fewer instructions: ~20-40 % faster when compute-bound,
 * as in prefill), on 256-bit vectors (AVX512VL); and qk_dot16_*_vnni, 512-bit kernels over 16 interleaved rows
 * for batches of tokens (dot_x86_r16.inc). */
#define QK_VNNI 1
#include "x86_common.h"

#include "dot_x86_32.inc"
#include "dot_x86_k.inc"
#include "dot_x86_r8.inc"
#include "dot_x86_r8_32.inc"
#include "dot_x86_r8_wide.inc"
#include "dot_x86_r16.inc"
