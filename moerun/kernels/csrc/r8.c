/* The interleaved layouts Q4_K_R8, Q5_K_R8, Q6_K_R8, Q8_0_R8, MXFP4_R8, IQ4_XS_R8, Q5_0_R8, Q5_1_R8 and IQ4_NL_R8 (qk.h): repacking from and back to GGUF's blocks (Q3_K_R8's: r8_q3k.c), and the
 * portable dots (Q3_K_R8's and Q6_K_R8's: r8_q3k.c, r8_q6k.c).
 *
 * qk_repack and qk_unpack are exact inverses on any bytes (the 12-byte packed scales map one to one onto
 * the 6-bit values), so a repacked tensor holds the file's weights, only in another order. */
#define _POSIX_C_SOURCE 200809L /* pread, off_t under -std=c11 */
#include <errno.h>
#include <stdatomic.h>
#include <string.h>
#include <unistd.h>

#include "matmul.h"
#include "pool.h"
#include "qk.h"

#define Q4K_BYTES 144
#define Q5K_BYTES 176
#define R8_BYTES (8 * Q4K_BYTES)
#define Q5R8_BYTES (8 * Q5K_BYTES)
#define Q80_BYTES 34
#define MXFP4_BYTES 17
#define Q6K_BYTES 210
#define IQ4XS_BYTES 136
#define Q50_BYTES 22
#define Q51_BYTES 24
#define IQ4NL_BYTES 18

#ifdef __SSE2__
#include <emmintrin.h>
#endif

/* dst[32c + 4r ..] = src[r][off + 4c ..] for c, r < 8: eight rows' 8 dwords into the interleaved order, an 8 x 8
 * transpose of dwords (SSE2: four 4 x 4 ones, 16 loads, 32 unpacks and 16 stores where 4-byte copies took 64 loads
 * and 64 stores; the repacks' qs / quant chunks). */
static void dword_transpose8(const uint8_t *const src[8], int64_t off, uint8_t *dst) {
#ifdef __SSE2__
    for (int cb = 0; cb < 2; cb++)
        for (int rb = 0; rb < 2; rb++) {
            const __m128i a0 = _mm_loadu_si128((const __m128i *)(src[4 * rb] + off + 16 * cb));
            const __m128i a1 = _mm_loadu_si128((const __m128i *)(src[4 * rb + 1] + off + 16 * cb));
            const __m128i a2 = _mm_loadu_si128((const __m128i *)(src[4 * rb + 2] + off + 16 * cb));
            const __m128i a3 = _mm_loadu_si128((const __m128i *)(src[4 * rb + 3] + off + 16 * cb));
            const __m128i t0 = _mm_unpacklo_epi32(a0, a1), t1 = _mm_unpackhi_epi32(a0, a1); /* a0 0 a1 0 a0 1 a1 1 */
            const __m128i t2 = _mm_unpacklo_epi32(a2, a3), t3 = _mm_unpackhi_epi32(a2, a3);
            uint8_t *o = dst + 128 * cb + 16 * rb; /* column 4cb + j of rows 4rb..4rb + 3 at o + 32j */
            _mm_storeu_si128((__m128i *)o, _mm_unpacklo_epi64(t0, t2));
            _mm_storeu_si128((__m128i *)(o + 32), _mm_unpackhi_epi64(t0, t2));
            _mm_storeu_si128((__m128i *)(o + 64), _mm_unpacklo_epi64(t1, t3));
            _mm_storeu_si128((__m128i *)(o + 96), _mm_unpackhi_epi64(t1, t3));
        }
#else
    for (int r = 0; r < 8; r++)
        for (int c = 0; c < 8; c++) memcpy(dst + 32 * c + 4 * r, src[r] + off + 4 * c, 4);
#endif
}

/* The four 32-value scale vectors of an R8 block from their packing at p (lo[64], hi[32]; layout: qk.h), and back. */
void qk_r8_vectors(const uint8_t *p, uint8_t v[4][32]) {
    for (int j = 0; j < 32; j++) {
        const uint8_t hi = p[64 + j];
        v[0][j] = (uint8_t)((p[j] & 15) | (hi & 3) << 4);
        v[1][j] = (uint8_t)((p[j] >> 4) | (hi >> 2 & 3) << 4);
        v[2][j] = (uint8_t)((p[32 + j] & 15) | (hi >> 4 & 3) << 4);
        v[3][j] = (uint8_t)((p[32 + j] >> 4) | (hi >> 6) << 4);
    }
}

void qk_r8_pack_vectors(uint8_t v[4][32], uint8_t *p) {
    for (int j = 0; j < 32; j++) {
        p[j] = (uint8_t)((v[0][j] & 15) | (v[1][j] & 15) << 4);
        p[32 + j] = (uint8_t)((v[2][j] & 15) | (v[3][j] & 15) << 4);
        p[64 + j] = (uint8_t)(v[0][j] >> 4 | (v[1][j] >> 4) << 2 | (v[2][j] >> 4) << 4 | (v[3][j] >> 4) << 6);
    }
}

/* Row r's scale and min of sub-block s, from the vectors. */
static int r8_sc(uint8_t v[4][32], int r, int s) { return v[s / 4][8 * (s % 4) + r]; }
static int r8_m(uint8_t v[4][32], int r, int s) { return v[2 + s / 4][16 * (s / 2 % 2) + 2 * r + s % 2]; }

/* Where Q4_K_R8 / Q5_K_R8 keep qs vector c of group g (qk.h), and Q4_K / Q5_K their qs. */
static int r8_qs_at(int hb, int g, int c) { return 128 + (hb ? 320 : 256) * g + 32 * c; }
static int k_qs_at(int hb) { return hb ? 48 : 16; }

/* Q5_K_R8's byte of the fifth bits of row r's elements 64g + 32h + 4c + i (i < 4), and its bit. */
static int q5r8_qh_at(int g, int c, int r, int i) { return 128 + 320 * g + 256 + 32 * (c / 4) + 4 * r + i; }
static int q5r8_bit(int c, int h) { return 2 * (c % 4) + h; }

/* One R8 block from 8 Q4_K (hb = 0) or Q5_K (hb = 1) blocks (src[r]: row r's block). */
static void q45r8_pack_block(const uint8_t *const src[8], uint8_t *b, int hb) {
    uint8_t v[4][32];
    for (int r = 0; r < 8; r++) {
        uint8_t sc[8], m[8];
        memcpy(b + 2 * r, src[r], 2);
        memcpy(b + 16 + 2 * r, src[r] + 2, 2);
        qk_unpack_q4k_scales(src[r] + 4, sc, m);
        for (int s = 0; s < 8; s++) {
            v[s / 4][8 * (s % 4) + r] = sc[s];
            v[2 + s / 4][16 * (s / 2 % 2) + 2 * r + s % 2] = m[s];
        }
        /* Q5_K: bit k of qh[j] is bit 4 of element 32k + j; bits 2g, 2g + 1 of qh word c (bytes 4c..) go to bits
         * q5r8_bit(c, 0..1) of the word for c / 4, a word at a time (a bit at a time held the repack to 0.3 GB/s) */
        for (int g = 0; hb && g < 4; g++)
            for (int cc = 0; cc < 2; cc++) {
                uint32_t w = 0;
                for (int k = 0; k < 4; k++) w |= (qk_rd32(src[r] + 16 + 4 * (4 * cc + k)) >> 2 * g & 0x03030303u) << q5r8_bit(k, 0);
                memcpy(b + q5r8_qh_at(g, 4 * cc, r, 0), &w, 4);
            }
    }
    for (int g = 0; g < 4; g++) dword_transpose8(src, k_qs_at(hb) + 32 * g, b + r8_qs_at(hb, g, 0));
    qk_r8_pack_vectors(v, b + 32);
}

/* The 8 Q4_K / Q5_K blocks (dst[r]) of an R8 block. */
static void q45r8_unpack_block(const uint8_t *b, uint8_t *const dst[8], int hb) {
    uint8_t v[4][32];
    qk_r8_vectors(b + 32, v);
    for (int r = 0; r < 8; r++) {
        uint8_t *o = dst[r];
        if (hb) memset(o + 16, 0, 32);
        memcpy(o, b + 2 * r, 2);
        memcpy(o + 2, b + 16 + 2 * r, 2);
        for (int j = 0; j < 4; j++) { /* the 12-byte packing of qk_unpack_q4k_scales, inverted */
            const int sl = r8_sc(v, r, j), sh = r8_sc(v, r, j + 4), ml = r8_m(v, r, j), mh = r8_m(v, r, j + 4);
            o[4 + j] = (uint8_t)(sl | (sh >> 4) << 6);
            o[8 + j] = (uint8_t)(ml | (mh >> 4) << 6);
            o[12 + j] = (uint8_t)((sh & 15) | (mh & 15) << 4);
        }
        for (int g = 0; g < 4; g++)
            for (int c = 0; c < 8; c++) {
                memcpy(o + k_qs_at(hb) + 32 * g + 4 * c, b + r8_qs_at(hb, g, c) + 4 * r, 4);
                for (int i = 0; hb && i < 4; i++)
                    for (int h = 0; h < 2; h++)
                        o[16 + 4 * c + i] |= (uint8_t)((b[q5r8_qh_at(g, c, r, i)] >> q5r8_bit(c, h) & 1) << (2 * g + h));
            }
    }
}

static void r8_pack_block(const uint8_t *const src[8], uint8_t *b) { q45r8_pack_block(src, b, 0); }
static void r8_unpack_block(const uint8_t *b, uint8_t *const dst[8]) { q45r8_unpack_block(b, dst, 0); }
static void q5r8_pack_block(const uint8_t *const src[8], uint8_t *b) { q45r8_pack_block(src, b, 1); }
static void q5r8_unpack_block(const uint8_t *b, uint8_t *const dst[8]) { q45r8_unpack_block(b, dst, 1); }

/* One block of 8 rows whose GGUF block is an f16 d then nc 4-byte chunks (Q8_0: 8, IQ4_NL: 4), and back: d of row r
 * at 2r, then chunk c of the 8 rows at 16 + 32c (Q8_0_R8; IQ4_NL_R8, whose chunks are MXFP4_R8's). */
static void d16_chunks_pack(const uint8_t *const src[8], uint8_t *b, const int nc) {
    for (int r = 0; r < 8; r++) memcpy(b + 2 * r, src[r], 2);
    if (nc == 8)
        dword_transpose8(src, 2, b + 16);
    else
        for (int r = 0; r < 8; r++)
            for (int c = 0; c < nc; c++) memcpy(b + 16 + 32 * c + 4 * r, src[r] + 2 + 4 * c, 4);
}

static void d16_chunks_unpack(const uint8_t *b, uint8_t *const dst[8], const int nc) {
    for (int r = 0; r < 8; r++) {
        memcpy(dst[r], b + 2 * r, 2);
        for (int c = 0; c < nc; c++) memcpy(dst[r] + 2 + 4 * c, b + 16 + 32 * c + 4 * r, 4);
    }
}

static void q8_pack_block(const uint8_t *const src[8], uint8_t *b) { d16_chunks_pack(src, b, 8); }
static void q8_unpack_block(const uint8_t *b, uint8_t *const dst[8]) { d16_chunks_unpack(b, dst, 8); }
static void iq4nl_pack_block(const uint8_t *const src[8], uint8_t *b) { d16_chunks_pack(src, b, 4); }
static void iq4nl_unpack_block(const uint8_t *b, uint8_t *const dst[8]) { d16_chunks_unpack(b, dst, 4); }

/* One MXFP4_R8 block from 8 MXFP4 blocks, and back: the 8 exponents, then 4-byte chunks g of the 8 rows. */
static void mxfp4_pack_block(const uint8_t *const src[8], uint8_t *b) {
    for (int r = 0; r < 8; r++) {
        b[r] = src[r][0];
        for (int g = 0; g < 4; g++) memcpy(b + 8 + 32 * g + 4 * r, src[r] + 1 + 4 * g, 4);
    }
}

static void mxfp4_unpack_block(const uint8_t *b, uint8_t *const dst[8]) {
    for (int r = 0; r < 8; r++) {
        dst[r][0] = b[r];
        for (int g = 0; g < 4; g++) memcpy(dst[r] + 1 + 4 * g, b + 8 + 32 * g + 4 * r, 4);
    }
}

/* One IQ4_XS_R8 block from 8 IQ4_XS blocks, and back: d, scales_l by byte, scales_h, then per sub-block the 8 rows'
 * 4-byte chunks as MXFP4_R8. */
static void iq4xs_pack_block(const uint8_t *const src[8], uint8_t *b) {
    for (int r = 0; r < 8; r++) {
        memcpy(b + 2 * r, src[r], 2);
        for (int j = 0; j < 4; j++) b[16 + 8 * j + r] = src[r][4 + j];
        memcpy(b + 48 + 2 * r, src[r] + 2, 2);
        for (int s = 0; s < 8; s++)
            for (int g = 0; g < 4; g++) memcpy(b + 64 + 128 * s + 32 * g + 4 * r, src[r] + 8 + 16 * s + 4 * g, 4);
    }
}

static void iq4xs_unpack_block(const uint8_t *b, uint8_t *const dst[8]) {
    for (int r = 0; r < 8; r++) {
        memcpy(dst[r], b + 2 * r, 2);
        for (int j = 0; j < 4; j++) dst[r][4 + j] = b[16 + 8 * j + r];
        memcpy(dst[r] + 2, b + 48 + 2 * r, 2);
        for (int s = 0; s < 8; s++)
            for (int g = 0; g < 4; g++) memcpy(dst[r] + 8 + 16 * s + 4 * g, b + 64 + 128 * s + 32 * g + 4 * r, 4);
    }
}

/* SPREAD[n]: bit i of the nibble n as bit 0 of byte i, so that a row's fifth bits go to their bytes a nibble at a time. */
static const uint32_t SPREAD[16] = {
    0x00000000u, 0x00000001u, 0x00000100u, 0x00000101u, 0x00010000u, 0x00010001u, 0x00010100u, 0x00010101u,
    0x01000000u, 0x01000001u, 0x01000100u, 0x01000101u, 0x01010000u, 0x01010001u, 0x01010100u, 0x01010101u,
};

/* One Q5_0_R8 (ns = 1) or Q5_1_R8 (ns = 2) block from 8 Q5_0 / Q5_1 blocks, and back: the 8 d (and the 8 m), the
 * fifth bits two per element pair (bit 2g of byte 4r + i: el 4g + i, bit 2g + 1: el 16 + 4g + i), then MXFP4_R8's
 * nibble chunks. A source block is its ns f16 scales, qh u32 and qs[16]. Byte 4r + i takes bit i of qh's nibbles g
 * and 4 + g: one table look-up a nibble for the four bytes (a bit at a time, 1.4 GB/s, was 6 % of V2-Lite's load). */
static void q5x_pack_block(const uint8_t *const src[8], uint8_t *b, const int ns) {
    uint8_t *h = b + 16 * ns, *q = h + 32;
    for (int r = 0; r < 8; r++) {
        const uint8_t *qs = src[r] + 2 * ns + 4;
        const uint32_t qh = qk_rd16(src[r] + 2 * ns) | (uint32_t)qk_rd16(src[r] + 2 * ns + 2) << 16;
        for (int k = 0; k < ns; k++) memcpy(b + 16 * k + 2 * r, src[r] + 2 * k, 2);
        uint32_t w = 0;
        for (int g = 0; g < 4; g++) {
            memcpy(q + 32 * g + 4 * r, qs + 4 * g, 4);
            w |= SPREAD[qh >> 4 * g & 15] << 2 * g | SPREAD[qh >> (16 + 4 * g) & 15] << (2 * g + 1);
        }
        memcpy(h + 4 * r, &w, 4); /* byte i: bits of element pairs i (little-endian, as GGUF) */
    }
}

static void q5x_unpack_block(const uint8_t *b, uint8_t *const dst[8], const int ns) {
    const uint8_t *h = b + 16 * ns, *q = h + 32;
    for (int r = 0; r < 8; r++) {
        uint32_t qh = 0;
        for (int k = 0; k < ns; k++) memcpy(dst[r] + 2 * k, b + 16 * k + 2 * r, 2);
        for (int g = 0; g < 4; g++) {
            memcpy(dst[r] + 2 * ns + 4 + 4 * g, q + 32 * g + 4 * r, 4);
            for (int i = 0; i < 4; i++)
                qh |= (uint32_t)(h[4 * r + i] >> (2 * g) & 1) << (4 * g + i) |
                      (uint32_t)(h[4 * r + i] >> (2 * g + 1) & 1) << (16 + 4 * g + i);
        }
        memcpy(dst[r] + 2 * ns, &qh, 4); /* little-endian, as GGUF */
    }
}

static void q50_pack_block(const uint8_t *const src[8], uint8_t *b) { q5x_pack_block(src, b, 1); }
static void q50_unpack_block(const uint8_t *b, uint8_t *const dst[8]) { q5x_unpack_block(b, dst, 1); }
static void q51_pack_block(const uint8_t *const src[8], uint8_t *b) { q5x_pack_block(src, b, 2); }
static void q51_unpack_block(const uint8_t *b, uint8_t *const dst[8]) { q5x_unpack_block(b, dst, 2); }

typedef struct {
    int type, src_type, blk_elems, blk_bytes; /* the interleaved type, its GGUF source and that's block */
    void (*pack)(const uint8_t *const src[8], uint8_t *b);
    void (*unpack)(const uint8_t *b, uint8_t *const dst[8]);
} relayout_kind;

static const relayout_kind KINDS[] = {
    {GGML_Q4_K_R8, GGML_Q4_K, 256, Q4K_BYTES, r8_pack_block, r8_unpack_block},
    {GGML_Q5_K_R8, GGML_Q5_K, 256, Q5K_BYTES, q5r8_pack_block, q5r8_unpack_block},
    {GGML_Q8_0_R8, GGML_Q8_0, 32, Q80_BYTES, q8_pack_block, q8_unpack_block},
    {GGML_MXFP4_R8, GGML_MXFP4, 32, MXFP4_BYTES, mxfp4_pack_block, mxfp4_unpack_block},
    {GGML_Q6_K_R8, GGML_Q6_K, 256, Q6K_BYTES, qk_q6r8_pack_block, qk_q6r8_unpack_block},
    {GGML_IQ4_XS_R8, GGML_IQ4_XS, 256, IQ4XS_BYTES, iq4xs_pack_block, iq4xs_unpack_block},
    {GGML_Q5_0_R8, GGML_Q5_0, 32, Q50_BYTES, q50_pack_block, q50_unpack_block},
    {GGML_Q5_1_R8, GGML_Q5_1, 32, Q51_BYTES, q51_pack_block, q51_unpack_block},
    {GGML_IQ4_NL_R8, GGML_IQ4_NL, 32, IQ4NL_BYTES, iq4nl_pack_block, iq4nl_unpack_block},
    {GGML_Q3_K_R8, GGML_Q3_K, 256, 110, qk_q3r8_pack_block, qk_q3r8_unpack_block},
};

static const relayout_kind *kind_of(int type) {
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++)
        if (KINDS[i].type == type) return &KINDS[i];
    return NULL;
}

/* Groups of 8 rows are independent: the pool's threads take runs of them (a model's worth of Q4_K is
 * gigabytes, rewritten once at load). */
#define GROUPS_PER_ITEM 64

typedef struct {
    const relayout_kind *k;
    const uint8_t *src;
    uint8_t *dst;
    int64_t groups, nb;
    int pack;
    atomic_long next;
} relayout_ctx;

static void relayout_task(void *p, int tid, int nth) {
    relayout_ctx *c = p;
    (void)tid, (void)nth;
    const int64_t bb = c->k->blk_bytes, rowb = c->nb * bb;
    for (;;) {
        const int64_t g0 = atomic_fetch_add(&c->next, GROUPS_PER_ITEM);
        if (g0 >= c->groups) break;
        for (int64_t g = g0; g < g0 + GROUPS_PER_ITEM && g < c->groups; g++)
            for (int64_t i = 0; i < c->nb; i++) {
                uint8_t *rows[8];
                for (int r = 0; r < 8; r++)
                    rows[r] = (uint8_t *)(c->pack ? c->src : c->dst) + (8 * g + r) * rowb + i * bb;
                if (c->pack)
                    c->k->pack((const uint8_t *const *)rows, c->dst + (g * c->nb + i) * 8 * bb);
                else
                    c->k->unpack(c->src + (g * c->nb + i) * 8 * bb, rows);
            }
    }
}

static int relayout(int type, const uint8_t *src, uint8_t *dst, int64_t N, int64_t K, int pack) {
    const relayout_kind *k = kind_of(type);
    if (!k) return QK_ETYPE;
    if (N < 8 || N % 8 || K < k->blk_elems || K % k->blk_elems) return QK_ESHAPE;
    relayout_ctx c = {k, src, dst, N / 8, K / k->blk_elems, pack, 0};
    qk_pool_run(relayout_task, &c); /* without workers it ran on this thread: done either way */
    return QK_OK;
}

int qk_repack(int to, const uint8_t *src, uint8_t *dst, int64_t N, int64_t K) {
    return relayout(to, src, dst, N, K, 1);
}

int qk_unpack(int from, const uint8_t *src, uint8_t *dst, int64_t N, int64_t K) {
    return relayout(from, src, dst, N, K, 0);
}

/* Every byte of [offset, offset + n) of fd into dst -> n, fewer where the file ends first, or -errno - 1000. */
static int64_t read_all(int fd, int64_t offset, uint8_t *dst, int64_t n) {
    for (int64_t got = 0; got < n;) {
        const ssize_t r = pread(fd, dst + got, (size_t)(n - got), (off_t)(offset + got));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return -(int64_t)errno - 1000;
        if (r == 0) return got;
        got += r;
    }
    return n;
}

/* Groups of 8 rows read into `scratch` (an L2-sized buffer the caller keeps) and repacked from there on the calling
 * thread, so the GGUF-layout bytes never take a buffer of the tensor's size: one pass over the file's bytes where a
 * read and a repack make two, and callers on several threads share the cores. */
int64_t qk_read_repack(int fd, int64_t offset, int to, uint8_t *dst, int64_t N, int64_t K, uint8_t *scratch,
                       int64_t scratch_bytes) {
    const relayout_kind *k = kind_of(to);
    if (!k) return QK_ETYPE;
    if (N < 8 || N % 8 || K < k->blk_elems || K % k->blk_elems) return QK_ESHAPE;
    const int64_t nb = K / k->blk_elems, group = 8 * nb * k->blk_bytes, groups = N / 8;
    if (scratch_bytes < group) return QK_ESHAPE;
    const int64_t per = scratch_bytes / group;
    for (int64_t g0 = 0; g0 < groups; g0 += per) {
        const int64_t n = g0 + per < groups ? per : groups - g0, want = n * group;
        const int64_t got = read_all(fd, offset + g0 * group, scratch, want);
        if (got < want) return got < 0 ? got : g0 * group + got;
        relayout_ctx c = {k, scratch, dst + g0 * group, n, nb, 1, 0};
        relayout_task(&c, 0, 1);
    }
    return groups * group;
}

/* A load's reads, shared by the threads that call this with the same jobs and counter: each takes the next job
 * nobody has taken (*next, atomically) until none is left, so one call per thread reads a whole model with the GIL
 * free throughout. jobs[QK_READ_JOB * i ..]: fd, offset, to, dst, N, K, where `to` is an interleaved type (the N
 * rows of K values repacked as qk_read_repack does, through this thread's scratch) or -1 (N bytes as stored).
 * done[i]: the job's result as qk_read_repack's, stored once the job has ended (the caller sets every entry below
 * QK_READ_PENDING first, so that a poll can tell finished jobs from the rest). */
void qk_read_jobs(const int64_t *jobs, int64_t n, int64_t *next, int64_t *done, uint8_t *scratch,
                  int64_t scratch_bytes) {
    for (int64_t i; (i = __atomic_fetch_add(next, 1, __ATOMIC_RELAXED)) < n;) {
        const int64_t *j = jobs + QK_READ_JOB * i;
        uint8_t *dst = (uint8_t *)(uintptr_t)j[3];
        const int64_t rc = j[2] < 0 ? read_all((int)j[0], j[1], dst, j[4])
                                    : qk_read_repack((int)j[0], j[1], (int)j[2], dst, j[4], j[5], scratch, scratch_bytes);
        __atomic_store_n(done + i, rc, __ATOMIC_RELEASE);
    }
}

/* Portable dot of 8 interleaved Q4_K (hb = 0) or Q5_K rows: out[8t + r] = sum_i y.d * (d_r * sum_s sc * (q . y)_s -
 * dmin_r * sum_s m * bsum_s), the integer sums exact as in the x86 kernels. */
static void q45r8_dot_scalar(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out, int hb) {
    for (int t = 0; t < nt; t++) {
        const act_q8k *x = xv[t];
        float acc[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * (hb ? Q5R8_BYTES : R8_BYTES);
            uint8_t v[4][32];
            qk_r8_vectors(b + 32, v);
            for (int r = 0; r < 8; r++) {
                int32_t isum = 0, msum = 0;
                for (int s = 0; s < 8; s++) {
                    const int g = s / 2, shift = 4 * (s % 2);
                    int32_t sub = 0;
                    for (int e = 0; e < 32; e++) {
                        const int c = e / 4, k = e % 4;
                        int q = (b[r8_qs_at(hb, g, c) + 4 * r + k] >> shift) & 15;
                        if (hb) q |= (b[q5r8_qh_at(g, c, r, k)] >> q5r8_bit(c, s % 2) & 1) << 4;
                        sub += q * x[i].qs[32 * s + e];
                    }
                    isum += r8_sc(v, r, s) * sub;
                    msum += r8_m(v, r, s) * (x[i].bsums[2 * s] + x[i].bsums[2 * s + 1]);
                }
                acc[r] += x[i].d * (qk_f16_at(b + 2 * r) * (float)isum - qk_f16_at(b + 16 + 2 * r) * (float)msum);
            }
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = acc[r];
    }
}

void qk_dot_scalar_q4_k_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    q45r8_dot_scalar(nb, w, xv, nt, out, 0);
}

void qk_dot_scalar_q5_k_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    q45r8_dot_scalar(nb, w, xv, nt, out, 1);
}

/* Portable Q8_0_R8 dot: out[8t + r] = sum_i d_r * x.d * (q_r . x.qs), the integer sums as the x86 kernels. */
void qk_dot_scalar_q8_0_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        float acc[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 8 * Q80_BYTES;
            for (int r = 0; r < 8; r++) {
                int32_t s = 0;
                for (int e = 0; e < 32; e++) s += (int8_t)b[16 + 32 * (e / 4) + 4 * r + e % 4] * x[i].qs[e];
                acc[r] += qk_f16_at(b + 2 * r) * x[i].d * (float)s;
            }
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = acc[r];
    }
}

/* Row r's 32 code-book weights of an MXFP4_R8-style chunk block at q (4 chunks of 32 bytes) dotted with y[32]. */
static int32_t r8_book_isum(const uint8_t *q, const int r, const int8_t *book, const int8_t *y) {
    int32_t s = 0;
    for (int e = 0; e < 16; e++) {
        const uint8_t v = q[32 * (e / 4) + 4 * r + e % 4];
        s += book[v & 15] * y[e] + book[v >> 4] * y[e + 16];
    }
    return s;
}

/* Row r's 32 5-bit values (0..31) of a Q5_0_R8 / Q5_1_R8 block (fifth bits at h, nibble chunks at q) dotted with y[32]. */
static int32_t q5r8_isum(const uint8_t *h, const uint8_t *q, const int r, const int8_t *y) {
    int32_t s = 0;
    for (int e = 0; e < 16; e++) {
        const int g = e / 4, k = e % 4;
        const uint8_t v = q[32 * g + 4 * r + k], b = h[4 * r + k];
        s += ((v & 15) | (b >> (2 * g) & 1) << 4) * y[e] + ((v >> 4) | (b >> (2 * g + 1) & 1) << 4) * y[e + 16];
    }
    return s;
}

/* Portable MXFP4_R8 dot: out[8t + r] = sum_i 2^(e_r - 128) * x.d * (q_r . x.qs), the code book doubled as in
 * the GGUF-layout kernels, the integer sums as the x86 kernels. */
void qk_dot_scalar_mxfp4_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        float acc[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 8 * MXFP4_BYTES;
            for (int r = 0; r < 8; r++)
                acc[r] += qk_e8m0_half(b[r]) * x[i].d * (float)r8_book_isum(b + 8, r, QK_KV_MXFP4, x[i].qs);
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = acc[r];
    }
}

/* Portable IQ4_XS_R8 dot: out[8t + r] = sum_i sum_s (d_r * scale_rs) * y.d * (q_rs . y.qs), the code book looked up as
 * in the GGUF-layout kernels, the float steps as the x86 kernels. */
void qk_dot_scalar_iq4_xs_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        float acc[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 8 * IQ4XS_BYTES;
            for (int r = 0; r < 8; r++) {
                const uint16_t sh = qk_rd16(b + 48 + 2 * r);
                for (int s = 0; s < 8; s++) {
                    const act_q8_0 *y = &x[8 * i + s];
                    const int ls = (((b[16 + 8 * (s / 2) + r] >> (4 * (s % 2))) & 15) | (((sh >> (2 * s)) & 3) << 4)) - 32;
                    const int32_t sum = r8_book_isum(b + 64 + 128 * s, r, QK_KV_IQ4NL, y->qs);
                    acc[r] += qk_f16_at(b + 2 * r) * (float)ls * y->d * (float)sum;
                }
            }
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = acc[r];
    }
}

/* Portable Q5_0_R8 dot: out[8t + r] = sum_i d_r * x.d * (q_r . x.qs - 16 x.s), q the 5-bit values 0..31, the integer
 * sums as the x86 kernels. */
void qk_dot_scalar_q5_0_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        float acc[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 8 * Q50_BYTES;
            for (int r = 0; r < 8; r++)
                acc[r] += qk_f16_at(b + 2 * r) * x[i].d * (float)(q5r8_isum(b + 16, b + 48, r, x[i].qs) - 16 * x[i].s);
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = acc[r];
    }
}

/* Portable Q5_1_R8 dot: out[8t + r] = sum_i x.d * (d_r * q_r . x.qs + m_r * x.s), the integer sums as the x86 kernels. */
void qk_dot_scalar_q5_1_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        float acc[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 8 * Q51_BYTES;
            for (int r = 0; r < 8; r++)
                acc[r] += x[i].d * (qk_f16_at(b + 2 * r) * (float)q5r8_isum(b + 32, b + 64, r, x[i].qs) +
                                    qk_f16_at(b + 16 + 2 * r) * (float)x[i].s);
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = acc[r];
    }
}

/* Portable IQ4_NL_R8 dot: out[8t + r] = sum_i d_r * x.d * (KV_IQ4NL[q_r] . x.qs), the integer sums as the x86 kernels. */
void qk_dot_scalar_iq4_nl_r8(int64_t nb, const uint8_t *w, const void *const *xv, int nt, float *out) {
    for (int t = 0; t < nt; t++) {
        const act_q8_0 *x = xv[t];
        float acc[8] = {0};
        for (int64_t i = 0; i < nb; i++) {
            const uint8_t *b = w + i * 8 * IQ4NL_BYTES;
            for (int r = 0; r < 8; r++)
                acc[r] += qk_f16_at(b + 2 * r) * x[i].d * (float)r8_book_isum(b + 16, r, QK_KV_IQ4NL, x[i].qs);
        }
        for (int r = 0; r < 8; r++) out[8 * t + r] = acc[r];
    }
}
