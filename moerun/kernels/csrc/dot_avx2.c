/* The AVX2 (+FMA, F16C) kernel set: qk_dot_*_avx2. Bodies in dot_x86_*.inc. */
#include "x86_common.h"

#include "dot_x86_32.inc"
#include "dot_x86_k.inc"
#include "dot_x86_r8.inc"
#include "dot_x86_r8_32.inc"
