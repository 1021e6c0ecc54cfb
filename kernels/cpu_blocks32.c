/* GGUF blocks of 32 elements, one scale each (layouts and reference values: llmd.kernels.gguf_blocks): Q4_0, Q4_1,
 * Q5_0, Q5_1, Q8_0, IQ4_NL and MXFP4 (fp16 scales, MXFP4's an E8M0 exponent; Q4_1 and Q5_1 add an fp16 minimum).
 * Per type:
 *   the reference dequantize (dq_T, plain C) and the vector one (blk_T, dqv_T): llmd_gguf_dequant's values;
 *   the fp32 path's decoder of a chunk of 8 blocks (gc_T, "The GGUF matmul" in cpu_tiles.h) and its tiles;
 *   the integer path's tiles (cpu_gguf.c: "GGUF blocks with int8-quantized activations"): Q4_1 and Q5_1 with an
 *       offset per block (GQ_TILE, GQM_TILE), the signed blocks Q4_0, Q5_0, Q8_0, IQ4_NL and MXFP4 in an order of
 *       their own (GQS_TILE, GQSM_TILE, GQSF_TILE);
 * and their rows of the type table (llmd_blocks32_types). */
#include "cpu_tiles.h"

/* ---- Dequantize (the reference's values; the vector forms in AVX2 builds) ---------------------------------------- */

/* MXFP4's E2M1 codes as ggml keeps them: the values doubled (the scale halved, gguf_e8m0_half) */
static const float MXFP4_KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* One block row each: nb blocks at q -> nb * block_elems floats at w. */
__attribute__((unused)) static void dq_q4_0(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 18, w += 32) {
        const float d = gguf_f16(q);
        for (int j = 0; j < 16; j++) w[j] = d * (float)((q[2 + j] & 0xF) - 8);
        for (int j = 0; j < 16; j++) w[16 + j] = d * (float)((q[2 + j] >> 4) - 8);
    }
}

__attribute__((unused)) static void dq_q4_1(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 20, w += 32) {
        const float d = gguf_f16(q), m = gguf_f16(q + 2);
        for (int j = 0; j < 16; j++) w[j] = d * (float)(q[4 + j] & 0xF) + m;
        for (int j = 0; j < 16; j++) w[16 + j] = d * (float)(q[4 + j] >> 4) + m;
    }
}

__attribute__((unused)) static void dq_q5_0(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 22, w += 32) {
        const float d = gguf_f16(q);
        const uint32_t qh = gguf_u32(q + 2);
        for (int j = 0; j < 16; j++) w[j] = d * (float)((int)((q[6 + j] & 0xF) | ((qh >> j) & 1) << 4) - 16);
        for (int j = 0; j < 16; j++) w[16 + j] = d * (float)((int)((q[6 + j] >> 4) | ((qh >> (16 + j)) & 1) << 4) - 16);
    }
}

__attribute__((unused)) static void dq_q5_1(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 24, w += 32) {
        const float d = gguf_f16(q), m = gguf_f16(q + 2);
        const uint32_t qh = gguf_u32(q + 4);
        for (int j = 0; j < 16; j++) w[j] = d * (float)((q[8 + j] & 0xF) | ((qh >> j) & 1) << 4) + m;
        for (int j = 0; j < 16; j++) w[16 + j] = d * (float)((q[8 + j] >> 4) | ((qh >> (16 + j)) & 1) << 4) + m;
    }
}

__attribute__((unused)) static void dq_q8_0(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 34, w += 32) {
        const float d = gguf_f16(q);
        const int8_t *qs = (const int8_t *)(q + 2);
        for (int j = 0; j < 32; j++) w[j] = (float)qs[j] * d;
    }
}

__attribute__((unused)) static void dq_iq4_nl(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 18, w += 32) {
        const float d = gguf_f16(q);
        for (int j = 0; j < 16; j++) w[j] = d * IQ4_KV[q[2 + j] & 0xF];
        for (int j = 0; j < 16; j++) w[16 + j] = d * IQ4_KV[q[2 + j] >> 4];
    }
}

__attribute__((unused)) static void dq_mxfp4(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 17, w += 32) {
        const float d = gguf_e8m0_half(q[0]);
        for (int j = 0; j < 16; j++) w[j] = d * MXFP4_KV[q[1 + j] & 0xF];
        for (int j = 0; j < 16; j++) w[16 + j] = d * MXFP4_KV[q[1 + j] >> 4];
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* bit j of `bits` -> byte j of the result: 0x10 where set, else 0 (the fifth bit of a 5-bit code). */
#if defined(__AVX512VL__) && defined(__AVX512BW__)
INLINE __m256i fifth_bits(uint32_t bits) { return _mm256_maskz_mov_epi8((__mmask32)bits, _mm256_set1_epi8(0x10)); }
#else
INLINE __m256i fifth_bits(uint32_t bits) {
    const __m256i which = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,  /* byte j: byte j / 8 */
                                           2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), which);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ULL);
    return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(0x10));
}
#endif

INLINE __m256i mxfp4_lookup(__m256i codes) {
    const __m128i t = _mm_setr_epi8(0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12);
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), codes);
}
/* the same values + 128, as unsigned bytes */
INLINE __m256i mxfp4_lookup_128(__m256i codes) {
    const __m128i t = _mm_setr_epi8((char)128, (char)129, (char)130, (char)131, (char)132, (char)134, (char)136,
                                    (char)140, (char)128, 127, 126, 125, 124, 122, 120, 116);
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), codes);
}

/* One block each: q -> weights w. */
INLINE void blk_q4_0(const uint8_t *q, float *w) {
    const float d = gguf_f16(q);
    emit32(_mm256_sub_epi8(nibbles32(q + 2), _mm256_set1_epi8(8)), d, d, 0, OFF_NONE, w);
}

INLINE void blk_q4_1(const uint8_t *q, float *w) {
    const float d = gguf_f16(q);
    emit32(nibbles32(q + 4), d, d, gguf_f16(q + 2), OFF_ADD, w);
}

INLINE void blk_q5_0(const uint8_t *q, float *w) {
    const float d = gguf_f16(q);
    const __m256i v = _mm256_or_si256(nibbles32(q + 6), fifth_bits(gguf_u32(q + 2)));
    emit32(_mm256_sub_epi8(v, _mm256_set1_epi8(16)), d, d, 0, OFF_NONE, w);
}

INLINE void blk_q5_1(const uint8_t *q, float *w) {
    const float d = gguf_f16(q);
    emit32(_mm256_or_si256(nibbles32(q + 8), fifth_bits(gguf_u32(q + 4))), d, d, gguf_f16(q + 2), OFF_ADD, w);
}

INLINE void blk_q8_0(const uint8_t *q, float *w) {
    const __m256 dv = _mm256_set1_ps(gguf_f16(q));
    for (int i = 0; i < 4; i++) /* 8 codes per load, widened from memory */
        emit(_mm256_mul_ps(i8_to_f32(_mm_loadl_epi64((const __m128i *)(q + 2 + 8 * i))), dv), w + 8 * i);
}

INLINE void blk_iq4_nl(const uint8_t *q, float *w) {
    const float d = gguf_f16(q);
    emit32(iq4_lookup(nibbles32(q + 2)), d, d, 0, OFF_NONE, w);
}

INLINE void blk_mxfp4(const uint8_t *q, float *w) {
    const float d = gguf_e8m0_half(q[0]);
    emit32(mxfp4_lookup(nibbles32(q + 1)), d, d, 0, OFF_NONE, w);
}

GGUF_VECTOR(q4_0, 32, 18)
GGUF_VECTOR(q4_1, 32, 20)
GGUF_VECTOR(q5_0, 32, 22)
GGUF_VECTOR(q5_1, 32, 24)
GGUF_VECTOR(q8_0, 32, 34)
GGUF_VECTOR(iq4_nl, 32, 18)
GGUF_VECTOR(mxfp4, 32, 17)

/* ---- The fp32 path ----------------------------------------------------------------------------------------------- */

INLINE __m256i gg_mxfp4(const uint8_t *qs) { /* MXFP4 codes + 128 (116..140) */
    return mxfp4_lookup_128(_mm256_and_si256(gg_nib16(qs), _mm256_set1_epi8(0x0F)));
}

/* blocks of 32 with one scale d = SCALE(qb) (an fp16 at the block's start, or MXFP4's E8M0 byte): codes from
 * DECODE(qb), offset ZERO (d and qb in scope) */
#define GG_BLOCKS_SCALED(T, BYTES, SCALE, MASK, DECODE, ZERO)                                                     \
    INLINE void gc_##T(GG_ARGS) {                                                                                  \
        float z[8] __attribute__((aligned(32))) = {0};                                                             \
        for (int b = 0; b < nu; b++) {                                                                             \
            const uint8_t *qb = q + b * (BYTES);                                                                   \
            const float d = SCALE(qb);                                                                             \
            z[b] = (ZERO);                                                                                         \
            gg_unit((DECODE), MASK, _mm256_set1_ps(d), xu + 32 * b, ldp, out, os, R);                             \
        }                                                                                                          \
        gg_zero(z, xs, lds, out, os, R, 0);                                                                        \
    }
#define GG_BLOCKS(T, BYTES, MASK, DECODE, ZERO) GG_BLOCKS_SCALED(T, BYTES, gguf_f16, MASK, DECODE, ZERO)
#define GG_E8M0(qb) gguf_e8m0_half((qb)[0])
/* Q4_0 / Q4_1: two blocks per unit of 64, their 16 code bytes side by side in one vector (lanes 0-3 block b, 4-7
 * block b + 1) as the int4 kernel holds its nibbles: nibble p of each lane is picked in place by an AND with
 * 0xF << 4p (p = 7: a shift), the activations pre-multiplied by 2^-4p (see gg_prepare), 8 products per lane before
 * the lanes' scales (d_b, d_b+1). An odd last block pairs with zero codes. */
INLINE void gg_unit64(__m256i cv, __m256 sv, const float *xu, int64_t ldp, __m256 *out, const int os, const int R) {
    __m256 f[8];
    _Pragma("GCC unroll 8") for (int p = 0; p < 8; p++) f[p] = _mm256_cvtepi32_ps(
        p == 7 ? _mm256_srli_epi32(cv, 28) : _mm256_and_si256(cv, _mm256_set1_epi32(0xF << (4 * p))));
    if (R == 0) {
        for (int p = 0; p < 8; p++) _mm256_store_ps((float *)xu + 8 * p, f[p]);
        _mm256_store_ps((float *)xu + ldp, sv);
        return;
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
        const float *xr = xu + r * ldp;
        __m256 acc = _mm256_mul_ps(_mm256_load_ps(xr), f[0]);
        _Pragma("GCC unroll 8") for (int p = 1; p < 8; p++) acc = _mm256_fmadd_ps(_mm256_load_ps(xr + 8 * p), f[p], acc);
        out[r * os] = _mm256_fmadd_ps(acc, sv, out[r * os]);
    }
}

#define GG_PAIRS(T, BYTES, QS, ZERO)                                                                               \
    INLINE void gc_##T(GG_ARGS) {                                                                                  \
        float z[8] __attribute__((aligned(32))) = {0}, a[8] __attribute__((aligned(32))) = {0};                    \
        for (int b = 0; b < nu; b++) {                                                                             \
            const uint8_t *qb = q + b * (BYTES);                                                                   \
            const float d = a[b] = gguf_f16(qb);                                                                   \
            (void)d;                                                                                               \
            z[b] = (ZERO);                                                                                         \
        }                                                                                                          \
        for (int b = 0; b < nu; b += 2) {                                                                          \
            const __m128i lo = _mm_loadu_si128((const __m128i *)(q + b * (BYTES) + (QS)));                         \
            const __m128i hi = b + 1 < nu ? _mm_loadu_si128((const __m128i *)(q + (b + 1) * (BYTES) + (QS)))        \
                                          : _mm_setzero_si128();                                                   \
            gg_unit64(_mm256_set_m128i(hi, lo), gg_pair(a + b), xu + 32 * b, ldp, out, os, R);                    \
        }                                                                                                          \
        gg_zero(z, xs, lds, out, os, R, 0);                                                                        \
    }
GG_PAIRS(q4_0, 18, 2, -8.0f * d)
GG_PAIRS(q4_1, 20, 4, gguf_f16(qb + 2))
GG_BLOCKS(q5_0, 22, 0x1F, _mm256_or_si256(_mm256_and_si256(gg_nib16(qb + 6), GG_M4), fifth_bits(gguf_u32(qb + 2))),
          -16.0f * d)
GG_BLOCKS(q5_1, 24, 0x1F, _mm256_or_si256(_mm256_and_si256(gg_nib16(qb + 8), GG_M4), fifth_bits(gguf_u32(qb + 4))),
          gguf_f16(qb + 2))
GG_BLOCKS(q8_0, 34, 0xFF, _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(qb + 2)), _mm256_set1_epi8((char)0x80)),
          -128.0f * d)
GG_BLOCKS(iq4_nl, 18, 0xFF, gg_iq4(qb + 2), -128.0f * d)
GG_BLOCKS_SCALED(mxfp4, 17, GG_E8M0, 0xFF, gg_mxfp4(qb + 1), -128.0f * d)

GG_TILES(q4_0, 8, 18)
GG_TILES(q4_1, 8, 20)
GG_TILES(q5_0, 8, 22)
GG_TILES(q5_1, 8, 24)
GG_TILES(q8_0, 8, 34)
GG_TILES(iq4_nl, 8, 18)
GG_TILES(mxfp4, 8, 17)
GG_FILL(q4_0, 8, 18)
GG_FILL(q4_1, 8, 20)
GG_FILL(q5_0, 8, 22)
GG_FILL(q5_1, 8, 24)
GG_FILL(q8_0, 8, 34)
GG_FILL(iq4_nl, 8, 18)
GG_FILL(mxfp4, 8, 17)

/* ---- The integer path: blocks with a minimum (Q4_1, Q5_1) -------------------------------------------------------- */

/* Per type, one chunk of one column: the codes u [8] of its units (element order), the units' scale vectors sv [8]
 * and the offsets z [16] of its 16-element sub-blocks (zeroed by the caller; nu blocks of 32, or one super-block). */
#define GQ_DEC(T) INLINE void gqd_##T(const uint8_t *q, int nu, __m256i *u, __m256 *sv, float *z)

/* One block of 32: its codes u, scale d and offset z. */
#define GQ_SMALL(T, BYTES, CODES, ZERO)                                                                            \
    INLINE __m256i gq1_##T(const uint8_t *qb, float *d, float *z) {                                               \
        *d = gguf_f16(qb);                                                                                         \
        *z = (ZERO);                                                                                               \
        return (CODES);                                                                                            \
    }                                                                                                              \
    GQ_DEC(T) {                                                                                                    \
        for (int b = 0; b < nu; b++) {                                                                             \
            float d;                                                                                               \
            u[b] = gq1_##T(q + b * (BYTES), &d, &z[2 * b]);                                                        \
            z[2 * b + 1] = z[2 * b];                                                                               \
            sv[b] = _mm256_set1_ps(d);                                                                             \
        }                                                                                                          \
    }
GQ_SMALL(q4_1, 20, nibbles32(qb + 4), gguf_f16(qb + 2))
GQ_SMALL(q5_1, 24, _mm256_or_si256(nibbles32(qb + 8), fifth_bits(gguf_u32(qb + 4))), gguf_f16(qb + 2))

/* Blocks of 32: a tile of R rows x up to C columns (cols), one block of every column at a time (the rows' activation
 * block loaded once for the C columns; nothing decoded waits in registers), the offsets of a chunk of 8 blocks applied
 * after it. xq, xd, xs, xc: row 0's bytes, block scales, sums and C (strides K, K / 32, gq_sums(K), K / 4); nb: GGUF
 * blocks per row. */
#define GQ_TILE(T, BPC, BYTES, R, C)                                                                               \
    static void gqt_##T##_##R(const uint8_t *q, int64_t rb, int cols, const int8_t *xq, const float *xd,         \
                              const float *xs, const int32_t *xc, int64_t K, int64_t nb, float *y, int64_t ldy) { \
        const int64_t nbx = K / QB, lds = gq_sums(K);                                                             \
        __m256 out[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) out[r][c] = _mm256_setzero_ps();                      \
        for (int64_t b0 = 0, i = 0; b0 < nb; b0 += BPC, i++) {                                                     \
            const int nu = (int)(nb - b0 < BPC ? nb - b0 : BPC);                                                   \
            float z[C][16] __attribute__((aligned(32)));                                                           \
            for (int j = 0; j < nu; j++) {                                                                         \
                const int64_t b = b0 + j;                                                                          \
                __m256i xv[R];                                                                                     \
                __m256 dv[R];                                                                                      \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                             \
                    xv[r] = _mm256_loadu_si256((const __m256i *)(xq + r * K + 32 * b));                           \
                    dv[r] = _mm256_broadcast_ss(xd + r * nbx + b);                                                 \
                }                                                                                                  \
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) if (c < cols) {                               \
                    const uint8_t *qb = q + c * rb + b * (BYTES);                                                  \
                    _mm_prefetch((const char *)(qb + PF_TILES * C * rb), _MM_HINT_T0);                            \
                    float d;                                                                                       \
                    const __m256i u = gq1_##T(qb, &d, &z[c][2 * j]);                                               \
                    z[c][2 * j + 1] = z[c][2 * j];                                                                 \
                    const __m256 sv = _mm256_set1_ps(d);                                                           \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                           \
                        out[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT_U8S8(u, xv[r])), _mm256_mul_ps(sv, dv[r]), \
                                                    out[r][c]);                                                    \
                }                                                                                                  \
            }                                                                                                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) if (c < cols) {                                   \
                for (int j = 2 * nu; j < 16; j++) z[c][j] = 0.0f;                                                  \
                const __m256 zl = _mm256_load_ps(z[c]), zh = _mm256_load_ps(z[c] + 8);                             \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                               \
                    out[r][c] = gq_offsets(out[r][c], zl, zh, xs + r * lds + 16 * i);                              \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C && c < cols; c++) y[r * ldy + c] = hsum(out[r][c]);                             \
    }
TILES_BY_ROWS(GQ_TILE, q4_1, 8, 20)
TILES_BY_ROWS(GQ_TILE, q5_1, 8, 24)

/* Many rows: one column at a time over up to GQ_ROWS rows, each chunk of the column decoded once for all of them (the
 * tiles above decode it once per 4 rows); the rows' running sums wait in memory between chunks. Each output gets the
 * very operations of the tiles above in the same order, so a row's result does not depend on the path. */
#define GQM_TILE(T, BPC, BYTES)                                                                                    \
    static void gqm_##T(const uint8_t *q, const int8_t *xq, const float *xd, const float *xs, const int32_t *xc,  \
                        const gq_lanes *ln, int64_t K, int64_t nb, float *y, int64_t ldy, int rows) {             \
        const int64_t nbx = K / QB, lds = gq_sums(K);                                                             \
        __m256 out[GQ_ROWS];                                                                                       \
        for (int r = 0; r < rows; r++) out[r] = _mm256_setzero_ps();                                               \
        for (int64_t b = 0, i = 0; b < nb; b += BPC, i++) {                                                        \
            const int nu = (int)(nb - b < BPC ? nb - b : BPC);                                                     \
            __m256i u[8];                                                                                          \
            __m256 sv[8];                                                                                          \
            float z[16] __attribute__((aligned(32))) = {0};                                                        \
            gqd_##T(q + b * (BYTES), nu, u, sv, z);                                                                \
            const __m256 zl = _mm256_load_ps(z), zh = _mm256_load_ps(z + 8);                                      \
            for (int r = 0; r < rows; r++) {                                                                       \
                __m256 acc = out[r];                                                                               \
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) if (j < nu) { /* unrolled: in registers */    \
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + 256 * i + 32 * j));       \
                    const __m256i dot = DOT_U8S8(u[j], xv);                                                        \
                    const __m256 dv = _mm256_broadcast_ss(xd + r * nbx + 8 * i + j);                              \
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sv[j], dv), acc);                 \
                }                                                                                                  \
                out[r] = gq_offsets(acc, zl, zh, xs + r * lds + 16 * i);                                           \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < rows; r++) y[r * ldy] = hsum(out[r]);                                                  \
    }
GQM_TILE(q4_1, 8, 20)
GQM_TILE(q5_1, 8, 24)

/* ---- The integer path: the signed blocks (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4) ---------------------------------------
 *
 * The signed blocks of 32 (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4) take another order: each block's whole dot product D_b
 * (exact int32) times P_b = d_b * dx_b, two accumulators per output, the even and the odd blocks',
 *   a_{b % 2} = fma(float(D_b), P_b, a_{b % 2}) for the blocks b in order;  y = a_0 + a_1.
 * The vector lanes then hold 8 outputs: 8 columns of each of 1-4 rows (gqt_T_R, the lane sums of their dot
 * products, gq_lane_sums), or from GQS_MIN_ROWS rows on 8 rows of one column (gqm_T, 8 rows and more) or 4 rows of
 * one column for a pair of blocks (gqf_T, fewer rows): the rows' activation bytes XT against broadcast weight bytes,
 * a vpdpbusd per 4 elements of each lane's row. */


/* the signed codes of one block at qb: Q4_0's nibble - 8, Q5_0's 5-bit code - 16, Q8_0's byte, IQ4_NL's and MXFP4's
 * table values (MXFP4's E2M1 values doubled, as llama.cpp's integer dot product takes them) */
#define GQS_CODES_q4_0(qb) _mm256_sub_epi8(nibbles32((qb) + 2), _mm256_set1_epi8(8))
#define GQS_CODES_q5_0(qb) \
    _mm256_sub_epi8(_mm256_or_si256(nibbles32((qb) + 6), fifth_bits(gguf_u32((qb) + 2))), _mm256_set1_epi8(16))
#define GQS_CODES_q8_0(qb) _mm256_loadu_si256((const __m256i *)((qb) + 2))
#define GQS_CODES_iq4_nl(qb) iq4_lookup(nibbles32((qb) + 2))
#define GQS_CODES_mxfp4(qb) mxfp4_lookup(nibbles32((qb) + 1))
/* GQ_SIGNED_W of those codes, straight from the block where that saves an operation */
#define GQS_W_q4_0(qb, OFF) (OFF ? _mm256_add_epi8(nibbles32((qb) + 2), _mm256_set1_epi8(120)) \
                                 : GQ_SIGNED_W(GQS_CODES_q4_0(qb), 0))
#define GQS_W_q5_0(qb, OFF) GQ_SIGNED_W(GQS_CODES_q5_0(qb), OFF)
#define GQS_W_q8_0(qb, OFF) GQ_SIGNED_W(GQS_CODES_q8_0(qb), OFF)
#define GQS_W_iq4_nl(qb, OFF) (OFF ? iq4_lookup_128(nibbles32((qb) + 2)) : GQ_SIGNED_W(GQS_CODES_iq4_nl(qb), 0))
#define GQS_W_mxfp4(qb, OFF) (OFF ? mxfp4_lookup_128(nibbles32((qb) + 1)) : GQ_SIGNED_W(GQS_CODES_mxfp4(qb), 0))
/* a block's scale: the fp16 at its start, MXFP4's E8M0 byte; GQS_SCALES_T: 8 blocks' from the dwords at their starts */
#define GQS_D_q4_0 gguf_f16
#define GQS_D_q5_0 gguf_f16
#define GQS_D_q8_0 gguf_f16
#define GQS_D_iq4_nl gguf_f16
#define GQS_D_mxfp4 GG_E8M0
INLINE __m256 gqs_e8m0_scales(__m256i dwords) { /* gguf_e8m0_half of the low bytes */
    const __m256i e = _mm256_and_si256(dwords, _mm256_set1_epi32(0xFF));
    const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e)));
}
#define GQS_SCALES_q4_0 gqs_f16_scales
#define GQS_SCALES_q5_0 gqs_f16_scales
#define GQS_SCALES_q8_0 gqs_f16_scales
#define GQS_SCALES_iq4_nl gqs_f16_scales
#define GQS_SCALES_mxfp4 gqs_e8m0_scales

/* R rows (1-4), up to 8 columns (cols) in the lanes; block b of every column at a time, its codes decoded once for
 * the R rows. The accumulators of the even and odd blocks trade places after each block (y = a_0 + a_1 either way). */
#define GQS_TILE(T, BYTES, R)                                                                                      \
    INLINE void gqt_body_##T##_##R(const uint8_t *q, int64_t rb, int cols, const int8_t *xq, const float *xd,    \
                                   const int32_t *xc, int64_t K, int64_t nb, float *y, int64_t ldy) {            \
        enum { OFF = GQ_OFFSET_ROWS };                                                                             \
        const int64_t nbx = K / QB;                                                                                \
        __m256 acc[R][2];                                                                                          \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                                   \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            __m256i u[8], w[8];                                                                                    \
            _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {                                                 \
                u[c] = w[c] = _mm256_setzero_si256();                                                              \
                if (c < cols) {                                                                                    \
                    const uint8_t *qb = q + c * rb + b * (BYTES);                                                  \
                    _mm_prefetch((const char *)(qb + PF_TILES * 8 * rb), _MM_HINT_T0);                            \
                    u[c] = GQS_CODES_##T(qb); /* unused (and not computed) where OFF */                            \
                    w[c] = GQS_W_##T(qb, OFF);                                                                     \
                }                                                                                                  \
            }                                                                                                      \
            const __m256 sv = GQS_SCALES_##T(gq_block_starts(q + b * (BYTES), rb, cols));                         \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                 \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + QB * b));                     \
                __m256i v[8];                                                                                      \
                _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++)                                               \
                    v[c] = c < cols ? GQ_SIGNED_DOT(w[c], u[c], xv, xc + r * (K / 4) + 8 * b, OFF)                 \
                                    : _mm256_setzero_si256();                                                      \
                acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gq_lane_sums(v)),                                   \
                                            _mm256_mul_ps(sv, _mm256_set1_ps(xd[r * nbx + b])), acc[r][0]);         \
                const __m256 other = acc[r][1]; /* [0] takes the next block: the even and odd blocks alternate */  \
                acc[r][1] = acc[r][0];                                                                             \
                acc[r][0] = other;                                                                                 \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++) {                                                                              \
            float t[8];                                                                                            \
            _mm256_storeu_ps(t, _mm256_add_ps(acc[r][0], acc[r][1]));                                              \
            for (int c = 0; c < cols; c++) y[r * ldy + c] = t[c];                                                  \
        }                                                                                                          \
    }                                                                                                              \
    static void gqt_##T##_##R(const uint8_t *q, int64_t rb, int cols, const int8_t *xq, const float *xd,         \
                              const float *xs, const int32_t *xc, int64_t K, int64_t nb, float *y, int64_t ldy) { \
        (void)xs;                                                                                                  \
        if (cols == 8) /* a whole group of columns, compiled with no per-column test */                           \
            gqt_body_##T##_##R(q, rb, 8, xq, xd, xc, K, nb, y, ldy);                                               \
        else                                                                                                       \
            gqt_body_##T##_##R(q, rb, cols, xq, xd, xc, K, nb, y, ldy);                                            \
    }
#define GQS_TILES(T, BYTES) GQS_TILE(T, BYTES, 1) GQS_TILE(T, BYTES, 2) GQS_TILE(T, BYTES, 3) GQS_TILE(T, BYTES, 4)
GQS_TILES(q4_0, 18)
GQS_TILES(q5_0, 22)
GQS_TILES(q8_0, 34)
GQS_TILES(iq4_nl, 18)
GQS_TILES(mxfp4, 17)

/* 1 to 16 rows (two groups of 8 in the lanes) of one column. With VNNI the weight bytes + 128 are the unsigned
 * operand and each accumulator starts at the group's CB (see GQ_SIGNED_DOT), else |w| against the activations signed
 * by w. */
#define GQSM_TILE(T, BYTES)                                                                                        \
    static void gqm_##T(const uint8_t *q, const int8_t *xq, const float *xd, const float *xs, const int32_t *xc,  \
                        const gq_lanes *ln, int64_t K, int64_t nb, float *y, int64_t ldy, int rows) {             \
        (void)xq, (void)xd, (void)xs, (void)xc;                                                                    \
        const int ng = rows > 8 ? 2 : 1;                                                                           \
        const int64_t gs = (K / 4) * 8, gb = nb * 8; /* group strides of XT and of CB / DT */                     \
        __m256 acc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}}; \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            const uint8_t *qb = q + b * (BYTES);                                                                   \
            const __m256i u = GQS_CODES_##T(qb);                                                                   \
            int32_t wb[8] __attribute__((aligned(32))), ub[8] __attribute__((aligned(32)));                        \
            _mm256_store_si256((__m256i *)wb, GQS_W_##T(qb, GQ_OFFSET_ROWS));                                      \
            _mm256_store_si256((__m256i *)ub, u);                                                                  \
            const __m256 sv = _mm256_set1_ps(GQS_D_##T(qb));                                                       \
            for (int g = 0; g < ng; g++) {                                                                         \
                const int32_t *xt = ln->xt + g * gs + 64 * b;                                                      \
                __m256i D[2] = {GQ_OFFSET_ROWS ? _mm256_loadu_si256((const __m256i *)(ln->cb + g * gb + 8 * b))    \
                                               : _mm256_setzero_si256(),                                           \
                                _mm256_setzero_si256()}; /* two chains: vpdpbusd's latency */                      \
                _Pragma("GCC unroll 8") for (int t = 0; t < 8; t++) {                                             \
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xt + 8 * t));                          \
                    D[t & 1] = GQ_OFFSET_ROWS                                                                      \
                                   ? DOT_U8S8_ACC(D[t & 1], _mm256_set1_epi32(wb[t]), xv)                          \
                                   : _mm256_add_epi32(D[t & 1], DOT_U8S8(_mm256_set1_epi32(wb[t]),                 \
                                                                   _mm256_sign_epi8(xv, _mm256_set1_epi32(ub[t])))); \
                }                                                                                                  \
                const __m256 P = _mm256_mul_ps(sv, _mm256_loadu_ps(ln->dt + g * gb + 8 * b));                      \
                acc[g][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(D[0], D[1])), P, acc[g][b & 1]); \
            }                                                                                                      \
        }                                                                                                          \
        for (int g = 0; g < ng; g++) {                                                                             \
            float t[8];                                                                                            \
            _mm256_storeu_ps(t, _mm256_add_ps(acc[g][0], acc[g][1]));                                              \
            for (int l = 0; l < 8 && 8 * g + l < rows; l++) y[(8 * g + l) * ldy] = t[l];                           \
        }                                                                                                          \
    }

/* The dword t of each 128-bit half, in all four of its lanes */
#define GQ_DWORD(v, t) _mm256_shuffle_epi32(v, (t) * 0x55)
/* Up to 4 rows (one group, lanes 0-3 the even block of a pair, 4-7 the odd one) of one column. */
#define GQSF_STEP(t)                                                                                               \
    do {                                                                                                           \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xt + 8 * (t)));                                    \
        const __m256i w = GQ_DWORD((t) < 4 ? wl : wh, (t) & 3);                                                    \
        const __m256i us = GQ_DWORD((t) < 4 ? lo : hi, (t) & 3); /* the signs (no VNNI) */                       \
        D[(t) & 1] = GQ_OFFSET_ROWS ? DOT_U8S8_ACC(D[(t) & 1], w, xv)                                             \
                                    : _mm256_add_epi32(D[(t) & 1], DOT_U8S8(w, _mm256_sign_epi8(xv, us)));         \
    } while (0)
#define GQSF_TILE(T, BYTES)                                                                                        \
    static void gqf_##T(const uint8_t *q, const gq_lanes *ln, int64_t nb, float *y, int64_t ldy, int rows) {      \
        __m256 acc = _mm256_setzero_ps();                                                                          \
        for (int64_t p = 0; 2 * p < nb; p++) {                                                                     \
            const uint8_t *qb = q + 2 * p * (BYTES);                                                               \
            const int two = 2 * p + 1 < nb;                                                                        \
            const __m256i u0 = GQS_CODES_##T(qb), u1 = two ? GQS_CODES_##T(qb + (BYTES)) : _mm256_setzero_si256(); \
            /* dwords 0-3 (4-7) of the even block in the low half, of the odd one in the high half */             \
            const __m256i lo = _mm256_permute2x128_si256(u0, u1, 0x20), hi = _mm256_permute2x128_si256(u0, u1, 0x31); \
            const __m256i wl = GQ_SIGNED_W(lo, GQ_OFFSET_ROWS), wh = GQ_SIGNED_W(hi, GQ_OFFSET_ROWS);              \
            const __m256 sv = _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_set1_ps(GQS_D_##T(qb))),            \
                                                   _mm_set1_ps(two ? GQS_D_##T(qb + (BYTES)) : 0.0f), 1);          \
            const int32_t *xt = ln->xt + 64 * p;                                                                   \
            __m256i D[2] = {GQ_OFFSET_ROWS ? _mm256_loadu_si256((const __m256i *)(ln->cb + 8 * p))                 \
                                           : _mm256_setzero_si256(),                                               \
                            _mm256_setzero_si256()};                                                               \
            GQSF_STEP(0); GQSF_STEP(1); GQSF_STEP(2); GQSF_STEP(3);                                                \
            GQSF_STEP(4); GQSF_STEP(5); GQSF_STEP(6); GQSF_STEP(7);                                                \
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(D[0], D[1])),                                \
                                  _mm256_mul_ps(sv, _mm256_loadu_ps(ln->dt + 8 * p)), acc);                        \
        }                                                                                                          \
        float t[8];                                                                                                \
        _mm256_storeu_ps(t, acc);                                                                                  \
        for (int r = 0; r < rows; r++) y[r * ldy] = t[r] + t[4 + r];                                               \
    }
GQSF_TILE(q4_0, 18)
GQSF_TILE(q5_0, 22)
GQSF_TILE(q8_0, 34)
GQSF_TILE(iq4_nl, 18)
GQSF_TILE(mxfp4, 17)

GQSM_TILE(q4_0, 18)
GQSM_TILE(q5_0, 22)
GQSM_TILE(q8_0, 34)
GQSM_TILE(iq4_nl, 18)
GQSM_TILE(mxfp4, 17)
#else
/* portable: columns [n0, n1) of y for rows [0, m) of the integer path's row data (xd, xq) on the signed blocks' order
 * (GQS_TILE), in plain C: the vector build's bits */
void gq_signed_cols(const gguf_type *t, const float *xd, const int8_t *xq, const uint8_t *q, float *y, int64_t ldy,
                    int64_t m, int64_t k, int64_t n0, int64_t n1) {
    const int64_t nb = k / t->elems, rb = nb * t->bytes, nbx = k / QB;
    for (int64_t c = n0; c < n1; c++)
        for (int64_t r = 0; r < m; r++) {
            float acc[2] = {0.0f, 0.0f};
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *qb = q + c * rb + b * t->bytes;
                const int at = t->type == 6 ? 6 : t->type == 39 ? 1 : 2; /* the codes' first byte */
                int32_t D = 0;
                for (int i = 0; i < QB; i++) {
                    const int nib = i < 16 ? qb[at + i] & 15 : qb[at + i - 16] >> 4;
                    const int v = t->type == 2    ? nib - 8
                                  : t->type == 6  ? (nib | (int)(gguf_u32(qb + 2) >> i & 1) << 4) - 16
                                  : t->type == 8  ? (int8_t)qb[2 + i]
                                  : t->type == 39 ? (int)MXFP4_KV[nib]
                                                  : (int)IQ4_KV[nib];
                    D += v * xq[r * k + b * QB + i];
                }
                const float d = t->type == 39 ? gguf_e8m0_half(qb[0]) : gguf_f16(qb);
                acc[b & 1] = fmaf((float)D, d * xd[r * nbx + b], acc[b & 1]);
            }
            y[r * ldy + c] = acc[0] + acc[1];
        }
}
#endif

const gguf_type llmd_blocks32_types[LLMD_BLOCKS32_TYPES] = {
    {2, 32, 18, DQ(dq_q4_0, dqv_q4_0), GG(q4_0, 0, 32, 64), GQ(q4_0, gqf_q4_0)},
    {3, 32, 20, DQ(dq_q4_1, dqv_q4_1), GG(q4_1, 0, 32, 64), GQ(q4_1, NULL)},
    {6, 32, 22, DQ(dq_q5_0, dqv_q5_0), GG(q5_0, 0, 32, 32), GQ(q5_0, gqf_q5_0)},
    {7, 32, 24, DQ(dq_q5_1, dqv_q5_1), GG(q5_1, 0, 32, 32), GQ(q5_1, NULL)},
    {8, 32, 34, DQ(dq_q8_0, dqv_q8_0), GG(q8_0, 1, 32, 32), GQ(q8_0, gqf_q8_0)},
    {20, 32, 18, DQ(dq_iq4_nl, dqv_iq4_nl), GG(iq4_nl, 1, 32, 32), GQ(iq4_nl, gqf_iq4_nl)},
    {39, 32, 17, DQ(dq_mxfp4, dqv_mxfp4), GG(mxfp4, 1, 32, 32), GQ(mxfp4, gqf_mxfp4)},
};
