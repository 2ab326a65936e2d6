/* moerun CPU kernels: shared declarations.
 *
 * Weights are read as stored in GGUF: rows of blocks, little-endian, no alignment guaranteed
 * (so every multi-byte field is read with memcpy or an unaligned vector load). Activations are
 * quantized once per call to one of two internal formats, and each weight row is dotted against
 * them with integer arithmetic, as llama.cpp does.
 *
 * Weight block layouts (byte offsets within one block; "element" = index within the block):
 *
 *   Q4_0   32 el, 18 B: d f16 @0 | qs[16] @2. qs[j] low nibble -> el j, high nibble -> el j+16.
 *          value = d * (q - 8).
 *   Q5_0   32 el, 22 B: d f16 @0 | qh u32 @2 | qs[16] @6, nibbles as Q4_0; bit j of qh is bit 4 of el j.
 *          value = d * (q - 16). (llama-quantize's stand-in for Q4_K where a row is not whole 256-blocks.)
 *   Q5_1   32 el, 24 B: d f16 @0 | m f16 @2 | qh u32 @4 | qs[16] @8, as Q5_0. value = d * q + m. (Its stand-in
 *          for Q5_K.)
 *   IQ4_NL 32 el, 18 B: d f16 @0 | qs[16] @2, nibbles as Q4_0. value = d * KV_IQ4NL[q]. (Its stand-in for IQ4_XS
 *          and the smaller IQ types.)
 *   Q8_0   32 el, 34 B: d f16 @0 | qs int8[32] @2. value = d * q.
 *   MXFP4  32 el, 17 B: e u8 (E8M0) @0 | qs[16] @1, nibbles as Q4_0.
 *          value = 2^(e-128) * KV_MXFP4[q] (the E2M1 code book doubled, so it is all integers).
 *   Q4_K  256 el, 144 B: d f16 @0 | dmin f16 @2 | scales[12] @4 | qs[128] @16.
 *          8 sub-blocks of 32, each with a 6-bit scale sc and 6-bit min m (packed, see unpack_q4k).
 *          qs[32g + j]: low nibble -> el 64g + j, high nibble -> el 64g + 32 + j (g = 0..3).
 *          value = d * sc[s] * q - dmin * m[s], s = el / 32.
 *   Q5_K  256 el, 176 B: d @0 | dmin @2 | scales[12] @4 | qh[32] @16 | qs[128] @48.
 *          As Q4_K, plus a fifth bit: bit k of qh[j] is bit 4 of el 32k + j.
 *   Q3_K  256 el, 110 B: hmask[32] @0 | qs[64] @32 | scales[12] @96 | d f16 @108.
 *          For half h (0, 1): qs[32 + 32h + j] bits 2k..2k+1 -> el 128h + 32k + j (j < 32), whose third bit is
 *          bit 4h + k of hmask[j]; sixteen 6-bit scales (qk_q3k_scales), one per 16 elements.
 *          value = d * (scale - 32) * (q - (third bit ? 0 : 4)).
 *   Q6_K  256 el, 210 B: ql[128] @0 | qh[64] @128 | scales int8[16] @192 | d f16 @208.
 *          For half h (0, 1): ql[64h + j] low nibble -> el 128h + j, high -> 128h + 64 + j (j < 64);
 *          qh[32h + j] bits 2k..2k+1 -> high 2 bits of el 128h + 32k + j (j < 32).
 *          value = d * scales[el / 16] * (q - 32).
 *   IQ4_XS 256 el, 136 B: d f16 @0 | scales_h u16 @2 | scales_l[4] @4 | qs[128] @8.
 *          8 sub-blocks of 32; scale of sub-block i = ((scales_l[i/2] >> 4*(i%2)) & 15
 *          | ((scales_h >> 2i) & 3) << 4) - 32. qs[16i + j] low nibble -> el 32i + j, high -> 32i+16+j.
 *          value = d * scale * KV_IQ4NL[q].
 *
 * Interleaved layout (ours, internal; made at load time by qk_repack, r8.c, for weights in memory moerun
 * owns; never in a file). Its type id is the source type's + QK_R8 (Q4_K_R8 = 1012). Rows go in groups of
 * 8; block i of a group (the 8 rows' block i) is one 1152-byte "R8 block", the bytes of the 8 source
 * blocks rearranged so that one 32-byte load holds 4 consecutive weights of each of the 8 rows, one
 * int32 lane per row (vpdpbusd against 4 activation bytes broadcast), and the scales unpack with a few
 * vector ops for all 8 rows at once:
 *   Q4_K_R8 @0 d[8] f16 | @16 dmin[8] f16 | @32 lo[64] | @96 hi[32] | @128 qs[1024].
 *          Four 32-value scale vectors V0..V3 (6-bit values): V0[8s + r] = sc of row r, sub-block s < 4;
 *          V1[8(s - 4) + r] = sc, s >= 4; V2[16p + 2r + h] = m of row r, sub-block 2p + h (p < 2);
 *          V3 the same for p = 2, 3. lo[j] = V0[j] & 15 | (V1[j] & 15) << 4, lo[32 + j] the same of V2,
 *          V3; hi[j] = the four values' top 2 bits, V0's in bits 0-1 .. V3's in bits 6-7.
 *          qs[256g + 32c + 4r + i] = source row r's qs[32g + 4c + i] (g < 4, c < 8, i < 4): low nibble
 *          = el 64g + 4c + i, high nibble = el 64g + 32 + 4c + i.
 *   Q5_K_R8 @0..128 as Q4_K_R8 (d, dmin, lo, hi) | @128 four groups g of 320 B: Q4_K_R8's qs[256g .. 256g + 256],
 *          then qh[64]: bit 2j + h of qh[32k + 4r + i] (k < 2, j < 4, h < 2) = the fifth bit of row r's element
 *          64g + 32h + 4c + i, c = 4k + j (h: the nibble of qs vector c). 1408 B; the fifth bits sit beside the
 *          nibbles they complete, so a block reads front to back. value = d * sc * q - dmin * m, q < 32.
 *   Q6_K_R8 @0 d[8] f16 | @16 sc[128] int8 | @144 16 x (ql vector 2m, ql vector 2m + 1, qh vector m), 32 B each.
 *          1680 B. Let q[e] be row r's 6-bit value (0..63) of element e and W_c the 8 rows' elements 4c..4c+3
 *          (c < 64), byte 4r + i = row r's element 4c + i. sc[16p + 2r + k] = row r's scale 2p + k (p < 8): the
 *          8 rows' pairs of scales, int16 pairs once widened. ql vector c (c < 32): low nibble = low 4 bits of
 *          W_c, high nibble = of W_{c+32} (el 128 + 4c + i). qh vector m: top 2 bits of W_{2m} in bits 0-1,
 *          W_{2m+1} in 2-3, W_{2m+32} in 4-5, W_{2m+33} in 6-7. So the kernels read a block once, front to
 *          back (two streams, ql and qh, left the prefetchers behind: 6 GB/s), 96 bytes giving four weights of
 *          sub-blocks m/2 and m/2 + 8. value = d * sc[el / 16] * (q - 32), as Q6_K.
 *   Q8_0_R8 @0 d[8] f16 | @16 qs[256]: qs[32c + 4r + i] = row r's element 4c + i (c < 8, i < 4). 272 B.
 *   MXFP4_R8 @0 e[8] (E8M0) | @8 qs[128]: qs[32g + 4r + i] = row r's qs[4g + i] (g < 4, i < 4): low nibble = el
 *          4g + i, high nibble = el 16 + 4g + i, so the low and high nibbles of one 32-byte load are two 4-weight
 *          chunks of the 8 rows. 136 B.
 *   IQ4_XS_R8 @0 d[8] f16 | @16 sl[32]: sl[8j + r] = row r's scales_l[j] | @48 sh[8] u16: row r's scales_h |
 *          @64 qs[1024]: qs[128s + 32g + 4r + i] = row r's qs[16s + 4g + i] (s < 8, g < 4, i < 4): low nibble = el
 *          32s + 4g + i, high nibble = el 32s + 16 + 4g + i (MXFP4_R8's chunks, per sub-block). 1088 B. Row r's
 *          scale of sub-block s = ((sl[8(s/2) + r] >> 4(s%2)) & 15 | ((sh[r] >> 2s) & 3) << 4) - 32.
 *   Q5_0_R8 @0 d[8] f16 | @16 qh[32]: byte 4r + i holds row r's fifth bits of el 4g + i in bit 2g and of el 16 + 4g +
 *          i in bit 2g + 1 (g < 4) | @48 qs[128] as MXFP4_R8's: qs[32g + 4r + i] = row r's qs[4g + i]. So one 32-byte
 *          load of the fifth bits serves the block's four chunk loads, each shifted by 2 (Q5_K_R8's trick). 176 B.
 *   Q5_1_R8 @0 d[8] f16 | @16 m[8] f16 | @32 qh[32] | @64 qs[128], qh and qs as Q5_0_R8's. 192 B.
 *   IQ4_NL_R8 @0 d[8] f16 | @16 qs[128] as MXFP4_R8's. 144 B.
 *   Q3_K_R8 @0 d[8] f16 | @16 the 8 rows' sixteen 6-bit scales packed as Q4_K_R8's lo[64] and hi[32] (@16, @80):
 *          vector m's byte 8(s % 4) + r = scale of row r, sub-block s = 4m + s % 4 | @112 hm[256]: hm[32v + 4r + i] = row r's
 *          hmask[4v + i] (v < 8) | @368 qs[512]: qs[32(8h + v) + 4r + i] = row r's qs[32h + 4v + i]. Bits 2k..2k+1 of a
 *          qs vector (h, v) are the 8 rows' el 128h + 32k + 4v + i, their third bits bit 4h + k of hm vector v: one
 *          sub-block (8h + 2k + v / 4) per shift. 880 B.
 *
 * Activation formats (ours, internal; f32 scales, values in [-127, 127], never -128):
 *   act_q8k  per 256: f32 d | int8 qs[256] | int16 bsums[16] (sums of each 16 qs), 292 B.
 *   act_q8_0 per 32:  f32 d | int32 s (the sum of qs) | int8 qs[32], 40 B.
 * K-quants (Q3_K, Q4_K, Q5_K, Q6_K) pair with act_q8k; Q4_0, Q5_0, Q5_1, Q8_0, MXFP4, IQ4_NL and IQ4_XS with act_q8_0.
 */
#ifndef MOERUN_QK_H
#define MOERUN_QK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#define QK_X86 1
#else
#define QK_X86 0
#endif
#if defined(__aarch64__) && defined(__GNUC__)
#define QK_NEON 1
#else
#define QK_NEON 0
#endif

/* ggml type ids (gguf.GGMLQuantizationType) of the weight types we read. */
enum { GGML_Q4_0 = 2, GGML_Q5_0 = 6, GGML_Q5_1 = 7, GGML_Q8_0 = 8, GGML_Q3_K = 11, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14,
       GGML_IQ4_NL = 20, GGML_IQ4_XS = 23, GGML_MXFP4 = 39 };
/* Our interleaved layouts (see above): type id = source ggml id + QK_R8. */
enum { QK_R8 = 1000, GGML_Q4_K_R8 = QK_R8 + GGML_Q4_K, GGML_Q8_0_R8 = QK_R8 + GGML_Q8_0,
       GGML_MXFP4_R8 = QK_R8 + GGML_MXFP4, GGML_Q6_K_R8 = QK_R8 + GGML_Q6_K,
       GGML_IQ4_XS_R8 = QK_R8 + GGML_IQ4_XS, GGML_Q5_K_R8 = QK_R8 + GGML_Q5_K,
       GGML_Q5_0_R8 = QK_R8 + GGML_Q5_0, GGML_Q5_1_R8 = QK_R8 + GGML_Q5_1, GGML_IQ4_NL_R8 = QK_R8 + GGML_IQ4_NL,
       GGML_Q3_K_R8 = QK_R8 + GGML_Q3_K };

/* Float weight types, read by the fused decode path's matmuls (fdot.c). */
enum { GGML_F32 = 0, GGML_F16 = 1 };
enum { FT_F32, FT_F16, FT_COUNT };

/* Our dense indices for those types. */
enum { QT_Q4_0, QT_Q8_0, QT_MXFP4, QT_Q4_K, QT_Q5_K, QT_Q6_K, QT_IQ4_XS, QT_Q4_K_R8, QT_Q8_0_R8, QT_MXFP4_R8,
       QT_Q6_K_R8, QT_IQ4_XS_R8, QT_Q5_K_R8, QT_Q5_0, QT_Q5_0_R8, QT_Q5_1, QT_Q5_1_R8, QT_IQ4_NL,
       QT_IQ4_NL_R8, QT_Q3_K, QT_Q3_K_R8, QT_COUNT };

/* Activation formats. */
enum { ACT_Q8K, ACT_Q8_0, ACT_COUNT };

/* Kernel sets, selectable per call: portable C; AVX2 + FMA + F16C; the same plus AVX-512 VNNI
 * (vpdpbusd / vpdpwssd on 256-bit vectors); AArch64 NEON with the dot-product extension (dot_neon.c).
 * All compute the same integer sums. */
enum { ISA_SCALAR, ISA_AVX2, ISA_VNNI, ISA_NEON, ISA_COUNT };

typedef struct { float d; int8_t qs[256]; int16_t bsums[16]; } act_q8k;
typedef struct { float d; int32_t s; int8_t qs[32]; } act_q8_0;

/* Quantize k floats (k a multiple of the format's block) into `out`. */
typedef void (*quant_fn)(const float *x, void *out, int64_t k);

/* out[t] = dot(weight row w of nb blocks, activation row x[t]) for t < nt, 1 <= nt <= the type's max_nt.
 * Each x[t] points to the first activation block of the row (act_q8k or act_q8_0).
 * Interleaved types (rows = 8): w is a group of 8 rows, out[8t + r] = dot(row r, x[t]). */
#define DOT_MAX_NT 8
#define DOT_MAX_ROWS 8
typedef void (*dot_fn)(int64_t nb, const uint8_t *w, const void *const *x, int nt, float *out);

typedef struct {
    int ggml;       /* ggml type id */
    const char *name;
    int blk_elems;  /* elements per weight block */
    int blk_bytes;  /* bytes per weight block */
    int act;        /* ACT_Q8K or ACT_Q8_0 */
    int rows;       /* rows per block (and per dot call): 1, or 8 for the interleaved layouts */
    int max_nt;     /* tokens per dot call at most (<= DOT_MAX_NT): more tokens per pass over the weights */
} qtype_info;

/* Two adjacent groups of an interleaved type at once (16 rows): groups w and w + gstride, out[16 t + r] = dot(row r,
 * x[t]) with rows 8..15 the second group's, bit for bit what two dot calls give; for batches of tokens. */
typedef void (*dot16_fn)(int64_t nb, const uint8_t *w, int64_t gstride, const void *const *x, int nt, float *out);

typedef struct {
    const char *name;
    quant_fn quant[ACT_COUNT];
    dot_fn dot[QT_COUNT];
    dot16_fn dot16[QT_COUNT]; /* NULL where the set has none */
} kernel_set;

extern const qtype_info QK_TYPES[QT_COUNT];

/* Returns the QT_* index of a ggml type id, or -1 when we have no kernel for it. */
int qk_qtype_index(int ggml);
/* Elements per activation block and bytes per activation block of an ACT_* format. */
int qk_act_elems(int act);
int qk_act_bytes(int act);
/* The kernel set for an ISA_* id, or NULL when this CPU (or build) cannot run it. */
const kernel_set *qk_kernels(int isa);
/* The best ISA this CPU runs. */
int qk_best_isa(void);
const char *qk_isa_name(int isa);

/* Dot for float weight rows (ggml F32 / F16) with kernel set `isa` (a float row per token, nb = the
 * row's length), or NULL for other types (fdot.c). */
dot_fn qk_fdot(int isa, int ggml);

/* out = dot(a quantized row of n weights in GGUF's layout, float x) with the bits qk_fdot's kernel gives for the row
 * dequantized (deqdot.c), or NULL where this ISA and type have no such kernel. */
typedef void (*deq_dot_fn)(int64_t n, const uint8_t *w, const float *x, float *out);
deq_dot_fn qk_deq_fdot(int isa, int ggml);

/* Portable kernels (dot_scalar.c); x86 ones (quant_avx2.c, dot_avx2.c, dot_vnni.c). */
void qk_quant_q8k_scalar(const float *x, void *out, int64_t k);
void qk_quant_q8_0_scalar(const float *x, void *out, int64_t k);
void qk_dot_scalar_q4_0(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q5_0(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q5_1(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_iq4_nl(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q8_0(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_mxfp4(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q4_k(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q5_k(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q6_k(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q3_k(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_iq4_xs(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q4_k_r8(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q5_k_r8(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q8_0_r8(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_mxfp4_r8(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q6_k_r8(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_iq4_xs_r8(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q5_0_r8(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q5_1_r8(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_iq4_nl_r8(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_scalar_q3_k_r8(int64_t, const uint8_t *, const void *const *, int, float *);
/* Q3_K_R8's repack and unpack of one block (r8_q3k.c). */
void qk_q3r8_pack_block(const uint8_t *const src[8], uint8_t *b);
void qk_q3r8_unpack_block(const uint8_t *b, uint8_t *const dst[8]);
/* Q6_K_R8's repack and unpack of one block (r8_q6k.c). */
void qk_q6r8_pack_block(const uint8_t *const src[8], uint8_t *b);
void qk_q6r8_unpack_block(const uint8_t *b, uint8_t *const dst[8]);
/* The four 32-value scale vectors V0..V3 of a Q4_K_R8 block (r8.c). */
void qk_r8_vectors(const uint8_t *p, uint8_t v[4][32]);
void qk_r8_pack_vectors(uint8_t v[4][32], uint8_t *p);
#if QK_X86
void qk_quant_q8k_avx2(const float *x, void *out, int64_t k);
void qk_quant_q8_0_avx2(const float *x, void *out, int64_t k);
#define QK_DECLARE_X86_DOTS(SUFFIX)                                                              \
    void qk_dot_q4_0##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);   \
    void qk_dot_q5_0##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);   \
    void qk_dot_q5_1##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);   \
    void qk_dot_iq4_nl##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *); \
    void qk_dot_q8_0##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);   \
    void qk_dot_mxfp4##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);  \
    void qk_dot_iq4_xs##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *); \
    void qk_dot_q4_k##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);   \
    void qk_dot_q5_k##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);   \
    void qk_dot_q6_k##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);   \
    void qk_dot_q3_k##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);   \
    void qk_dot_q4_k_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);  \
    void qk_dot_q5_k_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);  \
    void qk_dot_q8_0_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);  \
    void qk_dot_mxfp4_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);  \
    void qk_dot_q6_k_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);   \
    void qk_dot_iq4_xs_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *); \
    void qk_dot_q5_0_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);  \
    void qk_dot_q5_1_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);  \
    void qk_dot_iq4_nl_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *); \
    void qk_dot_q3_k_r8##SUFFIX(int64_t, const uint8_t *, const void *const *, int, float *);
QK_DECLARE_X86_DOTS(_avx2)
QK_DECLARE_X86_DOTS(_vnni)
void qk_dot16_q3_k_r8_vnni(int64_t, const uint8_t *, int64_t, const void *const *, int, float *);
void qk_dot16_q8_0_r8_vnni(int64_t, const uint8_t *, int64_t, const void *const *, int, float *);
void qk_dot16_q4_k_r8_vnni(int64_t, const uint8_t *, int64_t, const void *const *, int, float *);
void qk_dot16_q5_k_r8_vnni(int64_t, const uint8_t *, int64_t, const void *const *, int, float *);
void qk_dot16_q6_k_r8_vnni(int64_t, const uint8_t *, int64_t, const void *const *, int, float *);
void qk_dot16_mxfp4_r8_vnni(int64_t, const uint8_t *, int64_t, const void *const *, int, float *);
void qk_dot16_iq4_xs_r8_vnni(int64_t, const uint8_t *, int64_t, const void *const *, int, float *);
#endif
#if QK_NEON
void qk_dot_q8_0_neon(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_q4_0_neon(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_q4_k_neon(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_q6_k_neon(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_q4_k_r8_neon(int64_t, const uint8_t *, const void *const *, int, float *);
void qk_dot_q8_0_r8_neon(int64_t, const uint8_t *, const void *const *, int, float *);
#endif

/* ------------------------------------------------------------------------------ small helpers */

static inline uint16_t qk_rd16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t qk_rd32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

/* IEEE half -> float, exact for every input (normals and subnormals are rebiased by one multiply
 * by 2^112, which is exact; infinities and NaNs keep their payload). */
static inline float qk_f16(uint16_t h) {
    uint32_t em = (uint32_t)(h & 0x7fffu) << 13, bits;
    float f;
    if (em >= (0x7c00u << 13)) {
        bits = em | 0x7f800000u;
        memcpy(&f, &bits, 4);
    } else {
        memcpy(&f, &em, 4);
        f *= 0x1p112f;
    }
    memcpy(&bits, &f, 4);
    bits |= (uint32_t)(h & 0x8000u) << 16;
    memcpy(&f, &bits, 4);
    return f;
}

static inline float qk_f16_at(const uint8_t *p) { return qk_f16(qk_rd16(p)); }

/* Q3_K's 12 scale bytes -> its sixteen 6-bit scales (before the -32), as bytes in four words: scale s's low 4 bits
 * are byte s % 8's low nibble (s < 8) or high nibble, its high 2 bits bits 2(s / 4) and 2(s / 4) + 1 of byte 8 + s % 4. */
static inline void qk_q3k_scales(const uint8_t *p, uint32_t sc[4]) {
    uint32_t a[3];
    memcpy(a, p, 12);
    const uint32_t k4 = 0x0f0f0f0fu, k2 = 0x03030303u;
    sc[0] = (a[0] & k4) | ((a[2] & k2) << 4);
    sc[1] = (a[1] & k4) | (((a[2] >> 2) & k2) << 4);
    sc[2] = ((a[0] >> 4) & k4) | (((a[2] >> 4) & k2) << 4);
    sc[3] = ((a[1] >> 4) & k4) | (((a[2] >> 6) & k2) << 4);
}

/* E8M0 exponent byte -> 2^(e - 128) (half of the MX scale, to go with the doubled code book). */
static inline float qk_e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K packed scales: 12 bytes -> 8 six-bit scales and 8 six-bit mins.
 * Bytes 0-3: sc[0:4] low 6 bits, top 2 bits of sc[4:8]; bytes 4-7: same for the mins;
 * bytes 8-11: low nibble -> low 4 bits of sc[4:8], high nibble -> low 4 bits of m[4:8]. */
static inline void qk_unpack_q4k_scales(const uint8_t *q, uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = q[j] & 63;
        m[j] = q[j + 4] & 63;
        sc[j + 4] = (uint8_t)((q[j + 8] & 15) | ((q[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((q[j + 8] >> 4) | ((q[j + 4] >> 6) << 4));
    }
}

/* Non-linear 4-bit code books (gguf.quants IQ4_NL.kvalues; MXFP4's E2M1 values times two). */
static const int8_t QK_KV_IQ4NL[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                       1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t QK_KV_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#endif
