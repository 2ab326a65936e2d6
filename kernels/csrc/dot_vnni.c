/* The AVX-512 VNNI kernel set: qk_dot_*_vnni, the AVX2 kernels with vpdpbusd / vpdpwssd in place of
 * maddubs + madd + add (same integer results, fewer instructions: ~20-40 % faster when compute-bound,
 * as in prefill). 256-bit vectors only (AVX512VL), so no 512-bit frequency penalties anywhere. */
#define QK_VNNI 1
#include "x86_common.h"

#include "dot_x86_32.inc"
#include "dot_x86_k.inc"
#include "dot_x86_r8.inc"
