/* Batches through AMX (amx.h): Intel's tile unit (Sapphire Rapids and later) multiplies 16 x 32 int8 by 32 x 8 int8
 * into 16 x 8 int32 sums in one TDPBSSD, where the VNNI kernels spend a vpdpbusd per 4 elements per token.
 *
 * The same integers as the VNNI kernels: for each 32-element block, the tiles sum the int8 products of 16 tokens'
 * quantized activations (act_q8_0, read where they lie) and 16 weight rows (two R8 groups, read where they lie for
 * Q8_0; MXFP4's nibbles through the code book once per 16 rows), and each token's 16 sums then take the block's
 * scales in the VNNI kernels' float steps and order. So a batch gives the same bits through the tiles or not, and a
 * token's logits do not depend on the batch it came in (drafts, prefix reuse, the server's batches).
 *
 * bf16 tiles would skip the per-block rescale (weights dequantized once, float sums over the whole row), but they
 * round the activations and Q8_0's weights otherwise than the one-token kernels: batches would then give other bits
 * than single tokens (bench/journal/issue-36.md, "AMX"). */
#define _GNU_SOURCE /* syscall */
#include "amx.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>

#include "qk.h"

#if QK_X86 && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define AMX_TARGET "avx2,fma,f16c,avx512f,avx512vl,avx512bw,avx512dq,amx-tile,amx-int8"
#define AMX_FN __attribute__((target(AMX_TARGET)))
#define AMX_INLINE static inline __attribute__((always_inline, target(AMX_TARGET)))

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static pthread_once_t amx_once = PTHREAD_ONCE_INIT;
static int amx_ok;             /* the CPU has the tiles and this process may use them: set once */
static atomic_int amx_on = -1; /* qk_set_amx's value */
static atomic_long amx_calls;  /* qk_amx_rows calls, for tests: whether the tiles ran */

static void amx_probe(void) {
    unsigned a, b, c, d;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl") || !__get_cpuid_count(7, 0, &a, &b, &c, &d))
        return;
    if (!(d >> 24 & 1) || !(d >> 25 & 1)) /* AMX-TILE, AMX-INT8 */
        return;
    amx_ok = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0; /* Linux 5.16+ */
}

int qk_amx_usable(void) {
    pthread_once(&amx_once, amx_probe);
    return amx_ok;
}

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Two sets of tiles, so that one block's product runs while the other's sums are read: C 0 / 1 (16 tokens x 16 rows,
 * int32), A 4 / 5 (16 tokens x 32 int8: one block of their activations), B 6 / 7 (8 rows of 4 elements x 16 weight
 * rows: group a's 8 in the first 32 bytes of a row, group b's in the last). The configuration is the thread's: each
 * call sets it and releases the tiles. */
AMX_INLINE void amx_config(void) {
    _Alignas(64) tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    static const uint8_t rows[8] = {16, 16, 0, 0, 16, 16, 8, 8}, colsb[8] = {64, 64, 0, 0, 32, 32, 64, 64};
    for (int i = 0; i < 8; i++) {
        cfg.rows[i] = rows[i];
        cfg.colsb[i] = colsb[i];
    }
    _tile_loadconfig(&cfg);
}

/* Chunk v of group a and w of group b as one B row of 64 bytes at dst. */
AMX_INLINE void b_row(uint8_t *dst, __m256i v, __m256i w) {
    _mm256_store_si256((__m256i *)dst, v);
    _mm256_store_si256((__m256i *)(dst + 32), w);
}

/* Q8_0_R8's blocks of 16 rows (groups at pa, pb) as B tiles of 512 bytes: row c = chunk c of each group. */
AMX_INLINE void unpack_q8_0(const uint8_t *pa, const uint8_t *pb, int64_t nb, uint8_t *dst) {
    for (int64_t i = 0; i < nb; i++, pa += 272, pb += 272, dst += 512)
        for (int c = 0; c < 8; c++)
            b_row(dst + 64 * c, _mm256_loadu_si256((const __m256i *)(pa + 16 + 32 * c)),
                  _mm256_loadu_si256((const __m256i *)(pb + 16 + 32 * c)));
}

/* MXFP4_R8's through the code book: row j < 4 the low nibbles of chunk j (elements 4j..4j+3), row 4 + j the high ones
 * (elements 16 + 4j..). */
AMX_INLINE void unpack_mxfp4(const uint8_t *pa, const uint8_t *pb, int64_t nb, uint8_t *dst) {
    const __m256i book = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)QK_KV_MXFP4));
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int64_t i = 0; i < nb; i++, pa += 136, pb += 136, dst += 512)
        for (int j = 0; j < 4; j++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(pa + 8 + 32 * j));
            const __m256i w = _mm256_loadu_si256((const __m256i *)(pb + 8 + 32 * j));
            b_row(dst + 64 * j, _mm256_shuffle_epi8(book, _mm256_and_si256(v, m4)),
                  _mm256_shuffle_epi8(book, _mm256_and_si256(w, m4)));
            b_row(dst + 256 + 64 * j, _mm256_shuffle_epi8(book, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4)),
                  _mm256_shuffle_epi8(book, _mm256_and_si256(_mm256_srli_epi16(w, 4), m4)));
        }
}

/* 16 E8M0 exponents -> 2^(e - 128) (subnormal for e < 2), as the VNNI kernels' r8_e8m0_half. */
AMX_INLINE __m512 e8m0_16(const uint8_t *a, const uint8_t *b) {
    uint64_t lo, hi;
    memcpy(&lo, a, 8);
    memcpy(&hi, b, 8);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_set_epi64x((long long)hi, (long long)lo));
    const __m512i normal = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
    const __m512i tiny = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), v);
    return _mm512_castsi512_ps(_mm512_mask_blend_epi32(_mm512_cmplt_epi32_mask(v, _mm512_set1_epi32(2)), normal, tiny));
}

AMX_INLINE __m512 f16_16(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}

/* Q4_K_R8 (1152 bytes a block of 8 rows x 256) and Q5_K_R8 (1408: each group of 4 chunks' fifth bits after its 256
 * bytes of nibbles): per block of 16 rows, in the scratch: each sub-block's B tile (the
 * nibbles as bytes), the sub-blocks' scales as int32, the mins as int16 pairs per row (the VNNI kernels' mp), d and
 * dmin as floats, 16 rows each. */
#define Q4K_SCALES 4096                /* after the 8 sub-blocks' tiles of 512 bytes */
#define Q4K_MINS (Q4K_SCALES + 8 * 64) /* 8 vectors of 16 int32 */
#define Q4K_D (Q4K_MINS + 4 * 64)      /* 4 vectors of 16 int16 pairs */
#define Q4K_STEP (Q4K_D + 2 * 64)      /* d, dmin */

/* The four 32-value scale vectors of an R8 block's lo[64] / hi[32] at p, as the VNNI kernels' r8_scales. */
AMX_INLINE void r8_scale_vectors(const uint8_t *p, __m256i v[4]) {
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i lo0 = _mm256_loadu_si256((const __m256i *)p), lo1 = _mm256_loadu_si256((const __m256i *)(p + 32));
    const __m256i hi = _mm256_loadu_si256((const __m256i *)(p + 64));
    v[0] = _mm256_or_si256(_mm256_and_si256(lo0, m4), _mm256_and_si256(_mm256_slli_epi16(hi, 4), m30));
    v[1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo0, 4), m4), _mm256_and_si256(_mm256_slli_epi16(hi, 2), m30));
    v[2] = _mm256_or_si256(_mm256_and_si256(lo1, m4), _mm256_and_si256(hi, m30));
    v[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lo1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(hi, 2), m30));
}

/* h's bits moved by s places (left if s > 0) in 16-bit lanes, then bit 4 of each byte alone: Q5_K_R8's fifth bit
 * (as the VNNI kernels' q5r8_fifth). */
AMX_INLINE __m256i fifth(__m256i h, const int s) {
    const __m256i m = s > 0 ? _mm256_slli_epi16(h, s) : s < 0 ? _mm256_srli_epi16(h, -s) : h;
    return _mm256_and_si256(m, _mm256_set1_epi8(0x10));
}

AMX_INLINE void unpack_q45k(const uint8_t *pa, const uint8_t *pb, int64_t nb, uint8_t *dst, const int hb) {
    const __m256i m4 = _mm256_set1_epi8(15);
    const int blk = hb ? 1408 : 1152, gstep = hb ? 320 : 256;
    for (int64_t i = 0; i < nb; i++, pa += blk, pb += blk, dst += Q4K_STEP) {
        for (int g = 0; g < 4; g++)
            for (int c = 0; c < 8; c++) { /* low nibbles: sub-block 2g, B row c; high: 2g + 1 */
                const __m256i v = _mm256_loadu_si256((const __m256i *)(pa + 128 + gstep * g + 32 * c));
                const __m256i w = _mm256_loadu_si256((const __m256i *)(pb + 128 + gstep * g + 32 * c));
                __m256i vl = _mm256_and_si256(v, m4), wl = _mm256_and_si256(w, m4);
                __m256i vh = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4), wh = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);
                if (hb) { /* bit 2j of qh vector c / 4 (j = c % 4): the low nibble's fifth bit, bit 2j + 1 the high one's */
                    const int j = c % 4;
                    const __m256i ha = _mm256_loadu_si256((const __m256i *)(pa + 128 + gstep * g + 256 + 32 * (c / 4)));
                    const __m256i hw = _mm256_loadu_si256((const __m256i *)(pb + 128 + gstep * g + 256 + 32 * (c / 4)));
                    vl = _mm256_or_si256(vl, fifth(ha, 4 - 2 * j));
                    wl = _mm256_or_si256(wl, fifth(hw, 4 - 2 * j));
                    vh = _mm256_or_si256(vh, fifth(ha, 3 - 2 * j));
                    wh = _mm256_or_si256(wh, fifth(hw, 3 - 2 * j));
                }
                b_row(dst + 1024 * g + 64 * c, vl, wl);
                b_row(dst + 1024 * g + 512 + 64 * c, vh, wh);
            }
        __m256i va[4], vb[4];
        r8_scale_vectors(pa + 32, va);
        r8_scale_vectors(pb + 32, vb);
        _Alignas(32) uint8_t sa[64], sb[64]; /* s?[8s + r]: scale of row r, sub-block s */
        _mm256_store_si256((__m256i *)sa, va[0]);
        _mm256_store_si256((__m256i *)(sa + 32), va[1]);
        _mm256_store_si256((__m256i *)sb, vb[0]);
        _mm256_store_si256((__m256i *)(sb + 32), vb[1]);
        for (int s = 0; s < 8; s++)
            _mm512_store_si512((void *)(dst + Q4K_SCALES + 64 * s),
                               _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)(sa + 8 * s)),
                                                                       _mm_loadl_epi64((const __m128i *)(sb + 8 * s)))));
        for (int p = 0; p < 4; p++) { /* mins as int16 pairs (m[2p], m[2p + 1]) per row: group a's rows, then b's */
            const __m256i vm = p < 2 ? va[2] : va[3], wm = p < 2 ? vb[2] : vb[3];
            const __m128i ha = p % 2 ? _mm256_extracti128_si256(vm, 1) : _mm256_castsi256_si128(vm);
            const __m128i hb = p % 2 ? _mm256_extracti128_si256(wm, 1) : _mm256_castsi256_si128(wm);
            _mm512_store_si512((void *)(dst + Q4K_MINS + 64 * p),
                               _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_cvtepu8_epi16(ha)), _mm256_cvtepu8_epi16(hb), 1));
        }
        _mm512_store_ps(dst + Q4K_D, f16_16(pa, pb));
        _mm512_store_ps(dst + Q4K_D + 64, f16_16(pa + 16, pb + 16));
    }
}

int64_t qk_amx_scratch(int qt, int64_t nb) { return qt == QT_Q4_K_R8 || qt == QT_Q5_K_R8 ? nb * Q4K_STEP : nb * 512; }

/* Unit u of a pass over 16 tokens (a 32-element block of Q8_0 / MXFP4, a sub-block of Q4_K) into C tile `c`: its A
 * (at x + a_off(u), the tokens' rows xrow apart) against its B tile (at b). Q4_K's nibbles are unsigned. */
#define AMX_UNIT(c, a, b, xa, xrow, bp, k4)                                                                            \
    do {                                                                                                               \
        _tile_zero(c);                                                                                                 \
        _tile_loadd(a, xa, xrow);                                                                                      \
        _tile_loadd(b, bp, 64);                                                                                        \
        if (k4)                                                                                                        \
            _tile_dpbsud(c, a, b);                                                                                     \
        else                                                                                                           \
            _tile_dpbssd(c, a, b);                                                                                     \
    } while (0)

/* One pass of 16 tokens (mt of them real) over a block of 16 rows: the units' products two sets of tiles in turn,
 * each unit's sums read while the next one's product runs, then the VNNI kernels' float steps into acc. u: the
 * unpacked rows (B tiles; Q4_K's scales too), pa / pb: the groups as stored (scales of Q8_0 / MXFP4). */
AMX_INLINE void amx_pass(int qt, const uint8_t *pa, const uint8_t *pb, const uint8_t *u, int64_t nb, const uint8_t *x,
                         int64_t xrow, int mt, __m512 acc[16]) {
    const int k4 = qt == QT_Q4_K_R8 || qt == QT_Q5_K_R8, mx = qt == QT_MXFP4_R8, blk = mx ? 136 : 272;
    const int64_t nu = k4 ? 8 * nb : nb;
    _Alignas(64) int32_t c[8][256]; /* unit u's sums at c[u % 8]: token m's 16 at + 16 m */
#define A_AT(v) (k4 ? x + 292 * ((v) / 8) + 4 + 32 * ((v) % 8) : x + 40 * (v) + 8)
#define B_AT(v) (k4 ? u + Q4K_STEP * ((v) / 8) + 512 * ((v) % 8) : u + 512 * (v))
    AMX_UNIT(0, 4, 6, A_AT(0), xrow, B_AT(0), k4);
    for (int64_t v = 0; v < nu; v++) {
        if (v % 2 == 0) {
            if (v + 1 < nu) AMX_UNIT(1, 5, 7, A_AT(v + 1), xrow, B_AT(v + 1), k4);
            _tile_stored(0, c[v % 8], 64);
        } else {
            if (v + 1 < nu) AMX_UNIT(0, 4, 6, A_AT(v + 1), xrow, B_AT(v + 1), k4);
            _tile_stored(1, c[v % 8], 64);
        }
        if (!k4) { /* block v: acc += d * x.d * sums, block after block */
            const __m512 d = mx ? e8m0_16(pa + blk * v, pb + blk * v) : f16_16(pa + blk * v, pb + blk * v);
            for (int m = 0; m < mt; m++) {
                float xd;
                memcpy(&xd, x + m * xrow + 40 * v, 4);
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(xd)),
                                         _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c[v % 8] + 16 * m))), acc[m]);
            }
        } else if (v % 8 == 7) { /* superblock i's 8 sub-blocks: the mins, then the scaled sums */
            const int64_t i = v / 8;
            const uint8_t *s = u + Q4K_STEP * i;
            const __m512 d = _mm512_load_ps(s + Q4K_D), dmin = _mm512_load_ps(s + Q4K_D + 64);
            const __m512i *sc = (const __m512i *)(s + Q4K_SCALES), *mp = (const __m512i *)(s + Q4K_MINS);
            for (int m = 0; m < mt; m++) {
                const uint8_t *y = x + m * xrow + 292 * i;
                const __m256i b = _mm256_loadu_si256((const __m256i *)(y + 260)); /* bsums */
                const __m128i s8 = _mm_hadd_epi16(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
                __m512i mi = _mm512_madd_epi16(mp[0], _mm512_set1_epi32(_mm_cvtsi128_si32(s8)));
                mi = _mm512_add_epi32(mi, _mm512_madd_epi16(mp[1], _mm512_set1_epi32(_mm_extract_epi32(s8, 1))));
                mi = _mm512_add_epi32(mi, _mm512_madd_epi16(mp[2], _mm512_set1_epi32(_mm_extract_epi32(s8, 2))));
                mi = _mm512_add_epi32(mi, _mm512_madd_epi16(mp[3], _mm512_set1_epi32(_mm_extract_epi32(s8, 3))));
                __m512i isum = _mm512_mullo_epi32(_mm512_load_si512((const void *)(c[0] + 16 * m)), sc[0]);
                for (int k = 1; k < 8; k++)
                    isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(_mm512_load_si512((const void *)(c[k] + 16 * m)), sc[k]));
                float xd;
                memcpy(&xd, y, 4);
                const __m512 yd = _mm512_set1_ps(xd);
                acc[m] = _mm512_fnmadd_ps(_mm512_mul_ps(dmin, yd), _mm512_cvtepi32_ps(mi), acc[m]);
                acc[m] = _mm512_fmadd_ps(_mm512_mul_ps(d, yd), _mm512_cvtepi32_ps(isum), acc[m]);
            }
        }
    }
#undef A_AT
#undef B_AT
}

AMX_FN void qk_amx_rows(int qt, const uint8_t *w, int64_t rowb, int64_t nb, int64_t r0, int64_t r1, const uint8_t *xq,
                        int64_t xrow, int64_t T, float *out, int64_t ostride, uint8_t *scratch) {
    atomic_fetch_add_explicit(&amx_calls, 1, memory_order_relaxed);
    amx_config();
    for (int64_t r = r0; r < r1; r += 16) {
        const uint8_t *pa = w + r / 8 * rowb, *pb = pa + rowb;
        if (qt == QT_MXFP4_R8)
            unpack_mxfp4(pa, pb, nb, scratch);
        else if (qt == QT_Q4_K_R8 || qt == QT_Q5_K_R8)
            unpack_q45k(pa, pb, nb, scratch, qt == QT_Q5_K_R8);
        else
            unpack_q8_0(pa, pb, nb, scratch);
        for (int64_t t0 = 0; t0 < T; t0 += 16) {
            const int mt = T - t0 < 16 ? (int)(T - t0) : 16; /* tokens of the pass that exist */
            __m512 acc[16];
            for (int m = 0; m < 16; m++) acc[m] = _mm512_setzero_ps();
            amx_pass(qt, pa, pb, scratch, nb, xq + t0 * xrow, xrow, mt, acc);
            for (int m = 0; m < mt; m++) _mm512_storeu_ps(out + (t0 + m) * ostride + (r - r0), acc[m]);
        }
    }
    _tile_release();
}

int qk_amx_type(int qt) { return qt == QT_Q8_0_R8 || qt == QT_MXFP4_R8 || qt == QT_Q4_K_R8 || qt == QT_Q5_K_R8; }

#else /* no tiles in this build */

static atomic_int amx_on = -1;
static atomic_long amx_calls;
int qk_amx_usable(void) { return 0; }
int qk_amx_type(int qt) { return 0; }
int64_t qk_amx_scratch(int qt, int64_t nb) { return 0; }
void qk_amx_rows(int qt, const uint8_t *w, int64_t rowb, int64_t nb, int64_t r0, int64_t r1, const uint8_t *xq,
                 int64_t xrow, int64_t T, float *out, int64_t ostride, uint8_t *scratch) {}

#endif

int qk_set_amx(int on) {
    if (on < -1 || on > 1) return -1;
    atomic_store(&amx_on, on);
    return 0;
}

int64_t qk_amx_calls(void) { return atomic_load(&amx_calls); }

int qk_amx(void) { return atomic_load_explicit(&amx_on, memory_order_relaxed) != 0 && qk_amx_usable(); }
