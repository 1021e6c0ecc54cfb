/* Internal to the CPU kernel library: what its matmul files share. The SIMD helpers and the tile scaffolding are
 * static inline (each file's tiles inline them); a function one file defines for another is LLMD_HIDDEN (no exported
 * symbol). Every file is built with -ffp-contract=off (no multiply-add fused unless written), so an output's operations
 * are the ones its code writes, in whichever file its tile lives.
 *
 *   cpu_gemm.c      llmd's int8 / int4 layer weights (llmd.kernels.quant_matmul's layouts), fp32 or int8 activations
 *   cpu_act.c       the activation rows each path reads: int8 and int16 per block of 32, the GGUF fp32 path's layout
 *   cpu_blocks32.c  GGUF blocks of 32: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, MXFP4
 *   cpu_kquants.c   GGUF super-blocks of 256: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS
 *   cpu_head.c      the output heads' path: Q8_0 and Q6_K blocks with int16 activations
 *   cpu_interleaved.c  Q4_0, the K-quants and IQ4_XS with 8 columns interleaved (the int8 path's layout for them, made
 *                   at load)
 *   cpu_gguf.c      the GGUF type table, each path's loop over a thread's columns, the steps of cpu_gguf.h and the
 *                   exported GGUF entries
 * A GGUF type's file holds its decoders for every path (the reference dequantize, the vector dequantize, the fp32
 * path's chunk decoder, the int8 path's tiles) and its row of the type table (gguf_type). */
#ifndef LLMD_CPU_TILES_H
#define LLMD_CPU_TILES_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_gguf.h"
#include "cpu_kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* ---- Work sharing and integer dot products ----------------------------------------------------------------------- */

/* u8 x s8 dot product of 32 bytes -> 8 int32 lanes of 4 products each: one vpdpbusd where VNNI is built in, else
 * maddubs (int16 pairs) + madd. The same integers either way: no operand pair here reaches int16 saturation. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_U8S8_ACC(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DOT_U8S8_ACC(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
/* acc + the int16 pairs' products summed into 8 int32 lanes: one vpdpwssd with VNNI, else madd + add */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_S16_ACC(acc, a, b) _mm256_dpwssd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define DOT_S16_ACC(acc, a, b) _mm256_dpwssd_avx_epi32(acc, a, b)
#else
#define DOT_S16_ACC(acc, a, b) _mm256_add_epi32(acc, _mm256_madd_epi16(a, b))
#endif
#ifdef DOT_U8S8_ACC
#define DOT_U8S8(u, s) DOT_U8S8_ACC(_mm256_setzero_si256(), u, s)
#else
#define DOT_U8S8(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
#endif

/* This thread's number and the team's size (0 and 1 outside a parallel region or without OpenMP). */
static inline void thread_id(int *tid, int *nth) {
    *tid = 0;
    *nth = 1;
#ifdef _OPENMP
    *tid = omp_get_thread_num();
    *nth = omp_get_num_threads();
#endif
}

/* Threads split the output columns in units of 8; returns this thread's [n0, n1). */
static inline void column_range(int64_t n, int tid, int nth, int64_t *n0, int64_t *n1) {
    int64_t units = (n + 7) / 8;
    int64_t u0 = units * tid / nth, u1 = units * (tid + 1) / nth;
    *n0 = u0 * 8;
    *n1 = u1 * 8 < n ? u1 * 8 : n;
}

/* Rows per chunk: enough that a chunk of activations stays within ~256 KiB. */
static inline int64_t row_chunk(int64_t k) {
    int64_t rows = (256 * 1024 / 4) / (k > 0 ? k : 1);
    return rows < 8 ? 8 : rows;
}

#define QB 32 /* activations are quantized per block of QB values (cpu_act.c) */

/* ---- GGUF block fields and the integer path's rows --------------------------------------------------------------- */

/* fp16 at p -> fp32, exactly (subnormals, infinities and NaNs included). */
static inline float gguf_f16(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
#ifdef __F16C__
    return _cvtsh_ss((unsigned short)h); /* the same exact conversion in one instruction */
#endif
    uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 0x1F, man = h & 0x3FF, bits;
    if (e == 0) {
        if (man == 0)
            bits = sign;
        else { /* subnormal: normalise */
            int s = -1;
            do {
                s++;
                man <<= 1;
            } while (!(man & 0x400));
            bits = sign | (uint32_t)(112 - s) << 23 | (man & 0x3FF) << 13;
        }
    } else if (e == 31)
        bits = sign | 0x7F800000u | man << 13;
    else
        bits = sign | (e + 112) << 23 | man << 13;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* IQ4_NL's and IQ4_XS's code values */
__attribute__((unused)) static const float IQ4_KV[16] =
    {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* An E8M0 exponent byte -> 2^(e - 128) exactly (ggml's ggml_e8m0_to_fp32_half: e = 0, 1 are fp32 subnormals). */
static inline float gguf_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint32_t gguf_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* The GGUF integer path's row data (cpu_act.c): per row gq_sums(K) sums of activations: 16 of each 16 per chunk of
 * 256, then (from gq_sums32_at(K)) 8 of each 32 per chunk (Q4_K_X8's and Q5_K_X8's mins). */
static inline int64_t gq_sums32_at(int64_t k) { return (k + 255) / 256 * 16; }
static inline int64_t gq_sums(int64_t k) { return (k + 255) / 256 * 24; }
/* the signed blocks of 32 (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4): their own order, the lane layout */
static inline int gq_signed_type(int type) { return type == 2 || type == 6 || type == 8 || type == 20 || type == 39; }
#define GQS_MIN_ROWS 4 /* with VNNI, from 4 rows the signed blocks take the rows-in-lanes paths (see gq_cols) */
#define GQ_ROWS 16     /* rows per call of a type's many-rows function (gq_rows_fn) */

/* one group of rows in the signed blocks' lane layout (gq_lanes_in) */
typedef struct {
    const int32_t *xt, *cb;
    const float *dt;
} gq_lanes;

#if defined(__AVX2__) && defined(__FMA__)

/* ---- Tiles (AVX2 + FMA builds) ----------------------------------------------------------------------------------- */

/* Horizontal sum in a fixed order. */
INLINE float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

INLINE __m256i gq_pair_sums(__m256i a, __m256i b) { /* per 128-bit half: a0+a2, b0+b2, a1+a3, b1+b3 */
    return _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
}
/* 8 vectors of int32 lanes -> one vector whose lane j is the sum of v[j]'s lanes (exact) */
INLINE __m256i gq_lane_sums(const __m256i *v) {
    const __m256i p01 = gq_pair_sums(v[0], v[1]), p23 = gq_pair_sums(v[2], v[3]);
    const __m256i p45 = gq_pair_sums(v[4], v[5]), p67 = gq_pair_sums(v[6], v[7]);
    /* per half: vectors 0-3 (4-7), each the sum of its half's 4 lanes */
    const __m256i q0 = _mm256_add_epi32(_mm256_unpacklo_epi64(p01, p23), _mm256_unpackhi_epi64(p01, p23));
    const __m256i q1 = _mm256_add_epi32(_mm256_unpacklo_epi64(p45, p67), _mm256_unpackhi_epi64(p45, p67));
    return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

/* the fp16s in the low halves of 8 dwords (8 blocks' scales, from gq_block_starts) as floats */
INLINE __m256 gqs_f16_scales(__m256i dwords) {
    const __m256i h = _mm256_and_si256(dwords, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

/* the first dwords of the blocks at q + c rb for the columns c < cols (0 past them) in lane c: 8 loads rather than a
 * gather, which Zen 1 runs in microcode (a third of a Q8_0 decode matmul's time there) */
INLINE __m256i gq_block_starts(const uint8_t *q, int64_t rb, int cols) {
    if (cols == 8)
        return _mm256_setr_epi32((int)gguf_u32(q), (int)gguf_u32(q + rb), (int)gguf_u32(q + 2 * rb),
                                 (int)gguf_u32(q + 3 * rb), (int)gguf_u32(q + 4 * rb), (int)gguf_u32(q + 5 * rb),
                                 (int)gguf_u32(q + 6 * rb), (int)gguf_u32(q + 7 * rb));
    int32_t v[8] = {0};
    for (int c = 0; c < cols; c++) v[c] = (int32_t)gguf_u32(q + c * rb);
    return _mm256_loadu_si256((const __m256i *)v);
}

/* Tiles of R rows x C columns are generated per shape (the sizes must be compile-time constants so that the
 * accumulators live in registers). */

/* The columns of one tile are separate short runs of memory (a few hundred bytes each), too short for the hardware
 * prefetcher to ramp up: each k-step prefetches one cache line of the tile PF_TILES ahead (whose C rows of
 * weights are one contiguous block), so that block arrives while this one is used. */
#ifndef PF_TILES
#define PF_TILES 2
#endif

/* Rows in the vector lanes (many rows: the int8 / int4 layers' and the GGUF fp32 path's): a tile holds RP_VECS
 * vectors of 8 rows against RP_COLS columns, from RP_MIN_ROWS rows. */
#define RP_VECS 2 /* row vectors per tile: 16 rows */
#define RP_COLS 5 /* columns per tile: 10 accumulators, 2 activations and a weight fit the 16 registers */
#define RP_MIN_ROWS 16

/* The sum of 8 lane vectors in hsum's order (vectors of rows). */
INLINE __m256 lane_sum(const __m256 *lanes) {
    __m256 a[4];
    for (int l = 0; l < 4; l++) a[l] = _mm256_add_ps(lanes[l], lanes[l + 4]);
    return _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]));
}

/* The first `rows` (at most 8) rows of t into y, row stride ldy. */
INLINE void store_rows(__m256 t, float *y, int64_t ldy, int rows) {
    float tv[8] __attribute__((aligned(32)));
    _mm256_store_ps(tv, t);
    for (int r = 0; r < 8 && r < rows; r++) y[r * ldy] = tv[r];
}

/* The vector dequantizers (llmd_gguf_dequant: the embeddings' rows, the reference's values): integer codes decoded
 * with byte operations, widened exactly to fp32, then the same multiplications and additions as the scalar ones
 * (elementwise, so the same bits). */

INLINE __m256 i8_to_f32(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }

INLINE void emit(__m256 v, float *w) { _mm256_storeu_ps(w, v); }

enum { OFF_NONE, OFF_ADD, OFF_SUB };

/* 32 int8 codes -> weights 0..32: a * q [+ b | - b] (a2 and b2 for the last 16) */
INLINE void emit32h(__m256i q, float a, float a2, float b, float b2, const int off, float *w) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; i++) {
        __m256 v = _mm256_mul_ps(_mm256_set1_ps(i < 2 ? a : a2), i8_to_f32(parts[i]));
        if (off == OFF_ADD) v = _mm256_add_ps(v, _mm256_set1_ps(i < 2 ? b : b2));
        if (off == OFF_SUB) v = _mm256_sub_ps(v, _mm256_set1_ps(i < 2 ? b : b2));
        emit(v, w + 8 * i);
    }
}

INLINE void emit32(__m256i q, float a, float a2, float b, const int off, float *w) {
    emit32h(q, a, a2, b, b, off, w);
}

/* 16 bytes of nibbles -> 32 codes: low nibbles are codes 0..15, high nibbles 16..31. */
INLINE __m256i nibbles32(const uint8_t *qs) { /* the 16 bytes in both halves, the upper half shifted right by 4 */
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)), _mm256_set1_epi8(0x0F));
}

INLINE __m256i iq4_lookup(__m256i codes) {
    const __m128i t = _mm_setr_epi8(-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113);
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), codes);
}
/* the same values + 128, as unsigned bytes */
INLINE __m256i iq4_lookup_128(__m256i codes) {
    const __m128i t = _mm_setr_epi8(1, 24, 45, 63, 79, 93, 106, 118, (char)129, (char)141, (char)153, (char)166,
                                    (char)181, (char)197, (char)217, (char)241);
    return _mm256_shuffle_epi8(_mm256_set_m128i(t, t), codes);
}

/* Per type: dqv_T dequantizes nb blocks (a panel's column, the embeddings' rows). */
#define GGUF_VECTOR(T, ELEMS, BYTES)                                                                               \
    static void dqv_##T(const uint8_t *q, int64_t nb, float *w) {                                                 \
        for (int64_t b = 0; b < nb; b++) blk_##T(q + b * BYTES, w + b * ELEMS);                    \
    }

/* ---- The GGUF matmul: integer codes times activations per sub-block, scaled once per sub-block -----------------
 *
 * Every weight of every type is w = a_s * u + z_s: u an unsigned integer code, a_s and z_s its sub-block's scale and
 * offset (Q4_0: u = q, a = d, z = -8d; Q8_0: u = q + 128, z = -128 d; Q4_K: a = d sc, z = -dmin mn; Q6_K: u = q + 32,
 * z = -32 a; IQ4, MXFP4: u = table value + 128, z = -128 a; ...). Per output y[r, c], in this order whatever M, the
 * row's position, the path or the thread count:
 *   for each 32-element unit of K: acc = sum over its elements of x_k u_k (8 lanes of 4 terms: mul, then 3 FMAs),
 *       out = fma(acc, a, out) (16-element sub-blocks: lanes 0-3 and 4-7 carry their own a);
 *   after each chunk of 256 elements (a super-block, or 8 blocks of 32): out = fma(z, X, out) with X the sums of x
 *       over the chunk's sub-blocks (lane s: sub-block s; a second FMA for 16 sub-blocks);
 *   y = hsum(out).
 * This is the int4 kernel's arithmetic: one AND, one conversion and one FMA per 8 weights, the scale once per
 * sub-block, instead of dequantizing each weight (conversion, multiply, offset) before its FMA. The codes of a unit
 * sit in a 32-byte vector in element order; byte j of each 32-bit lane is picked by an AND with mask << 8j, which
 * leaves u * 2^8j (converted exactly), and the activations are stored pre-multiplied by 2^-8j to pair with it (for
 * 8-bit codes byte 3 is shifted down and its activation left unscaled). Nibble codes are masked in place.
 * Each a_s * u is exact in fp32 (at most 24 significant bits: an fp16 scale times small integers; MXFP4's scale is a
 * power of two, exact short of fp32's range, which real blocks stay far from), so a one-hot
 * activation still yields the reference weight: fl(a u + z) = the reference's fl(a (u - off)) or fl(a q - m). */

#define GG_CHUNK 256 /* elements per chunk: the zero terms and the sums X are per chunk */
#define GG_XS 16     /* sums stored per chunk and row (16 sub-blocks at most) */

/* R = 0 fills a panel instead (the rows-in-lanes path): the unit's converted codes at xu (32 floats) and its lane
 * scales at xu + ldp, the operands the R-row tiles multiply. */
INLINE void gg_unit(__m256i cv, const int mask, __m256 sv, const float *xu, int64_t ldp, __m256 *out, const int os,
                    const int R) {
    __m256 f[4];
    _Pragma("GCC unroll 4") for (int j = 0; j < 4; j++) f[j] = _mm256_cvtepi32_ps(
        j == 3 && mask == 0xFF ? _mm256_srli_epi32(cv, 24) : _mm256_and_si256(cv, _mm256_set1_epi32(mask << (8 * j))));
    if (R == 0) {
        for (int j = 0; j < 4; j++) _mm256_store_ps((float *)xu + 8 * j, f[j]);
        _mm256_store_ps((float *)xu + ldp, sv);
        return;
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
        const float *xr = xu + r * ldp;
        __m256 acc = _mm256_mul_ps(_mm256_load_ps(xr), f[0]);
        acc = _mm256_fmadd_ps(_mm256_load_ps(xr + 8), f[1], acc);
        acc = _mm256_fmadd_ps(_mm256_load_ps(xr + 16), f[2], acc);
        acc = _mm256_fmadd_ps(_mm256_load_ps(xr + 24), f[3], acc);
        out[r * os] = _mm256_fmadd_ps(acc, sv, out[r * os]);
    }
}

/* The chunk's zero terms: 8 (or 16) sub-blocks' offsets z times the rows' sums there. */
INLINE void gg_zero(const float *z, const float *xs, int64_t lds, __m256 *out, const int os, const int R,
                    const int sub16) {
    if (R == 0) { /* a panel: the offsets at xs */
        memcpy((float *)xs, z, (sub16 ? 16 : 8) * sizeof(float));
        return;
    }
    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {
        out[r * os] = _mm256_fmadd_ps(_mm256_load_ps(z), _mm256_load_ps(xs + r * lds), out[r * os]);
        if (sub16) out[r * os] = _mm256_fmadd_ps(_mm256_load_ps(z + 8), _mm256_load_ps(xs + r * lds + 8), out[r * os]);
    }
}

/* lanes 0-3 scale a[0], lanes 4-7 a[1] (two 16-element sub-blocks in one unit) */
INLINE __m256 gg_pair(const float *a) {
    return _mm256_blend_ps(_mm256_broadcast_ss(a), _mm256_broadcast_ss(a + 1), 0xF0);
}

/* 16 bytes of nibbles in element order: low nibbles in bytes 0..15, high ones in 16..31 (each still needs its mask) */
INLINE __m256i gg_nib16(const uint8_t *qs) {
    const __m128i v = _mm_loadu_si128((const __m128i *)qs);
    return _mm256_set_m128i(_mm_srli_epi16(v, 4), v);
}

INLINE __m256i gg_iq4(const uint8_t *qs) { /* IQ4 codes + 128 (1..241) */
    const __m256i t = _mm256_add_epi8(iq4_lookup(_mm256_and_si256(gg_nib16(qs), _mm256_set1_epi8(0x0F))),
                                      _mm256_set1_epi8((char)0x80));
    return t;
}

/* 16-bit lanes of v shifted by s (left for s > 0, right for s < 0), a runtime count */
INLINE __m256i gg_shift(__m256i v, int s) {
    return s >= 0 ? _mm256_sll_epi16(v, _mm_cvtsi32_si128(s)) : _mm256_srl_epi16(v, _mm_cvtsi32_si128(-s));
}

/* One chunk of one column: q at its first block, nu blocks of 32 (or one super-block), xu and xs the chunk's
 * activations and sums for row 0 (rows at strides ldp, lds), out the rows' accumulators at stride os. */
#define GG_ARGS                                                                                                    \
    const uint8_t *q, int nu, const float *xu, int64_t ldp, const float *xs, int64_t lds, __m256 *out, const int os, \
        const int R

#define GG_M4 _mm256_set1_epi8(0x0F)

/* A tile of R rows x up to C columns (cols): each chunk of each column decoded once for the R rows. */
#define GG_TILE(T, BPC, BYTES, R, C)                                                                               \
    static void ggt_##T##_##R(const uint8_t *q, int64_t rb, int cols, const float *xp, int64_t ldp, const float *xs, \
                              int64_t lds, int64_t nb, float *y, int64_t ldy) {                                    \
        __m256 out[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) out[r][c] = _mm256_setzero_ps();                      \
        for (int64_t b = 0, i = 0; b < nb; b += BPC, i++) {                                                        \
            const int nu = (int)(nb - b < BPC ? nb - b : BPC);                                                     \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) if (c < cols) {                                   \
                const uint8_t *qc = q + c * rb + b * (BYTES);                                                      \
                for (int p = 0; p < nu * (BYTES); p += 64)                                                         \
                    _mm_prefetch((const char *)(qc + PF_TILES * C * rb + p), _MM_HINT_T0);                       \
                gc_##T(qc, nu, xp + i * GG_CHUNK, ldp, xs + i * GG_XS, lds, &out[0][c], C, R);                    \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C && c < cols; c++) y[r * ldy + c] = hsum(out[r][c]);                             \
    }
/* columns per tile for R rows: 8 accumulators */
#define GG_C1 8
#define GG_C2 4
#define GG_C3 2
#define GG_C4 2
__attribute__((unused)) static const int GG_COLS[4] = {GG_C1, GG_C2, GG_C3, GG_C4};
/* TILE(args, R, C): the tiles of 1 to 4 rows of a GGUF path, each with its columns per tile */
#define TILES_BY_ROWS(TILE, ...)                                                                                   \
    TILE(__VA_ARGS__, 1, GG_C1) TILE(__VA_ARGS__, 2, GG_C2) TILE(__VA_ARGS__, 3, GG_C3) TILE(__VA_ARGS__, 4, GG_C4)
#define GG_TILES(T, BPC, BYTES) TILES_BY_ROWS(GG_TILE, T, BPC, BYTES)
/* One column's panel for the rows-in-lanes path: P [kp] converted codes, P + kp [kp] lane scales (8 per unit),
 * P + 2 kp [chunks * GG_XS] offsets (kp: k, or k rounded up to a whole unit of 64 for the block pairs). */
#define GG_FILL(T, BPC, BYTES)                                                                                     \
    static void ggf_##T(const uint8_t *q, int64_t nb, float *P, int64_t kp) {                                     \
        for (int64_t b = 0, i = 0; b < nb; b += BPC, i++)                                                          \
            gc_##T(q + b * (BYTES), (int)(nb - b < BPC ? nb - b : BPC), P + i * GG_CHUNK, kp,                      \
                   P + 2 * kp + i * GG_XS, 0, NULL, 0, 0);                                                         \
    }

/* ---- The GGUF integer path's tiles ------------------------------------------------------------------------------- */

/* Signed codes u (the signed blocks of 32: |u| <= 128) against activation bytes xv: with VNNI (OFFSET) u + 128 as the
 * unsigned operand and the accumulator starting at -128 times each lane's 4 activation bytes (row data C at c), one
 * vpdpbusd; else |u| against the activations signed by u. The same integers either way (GQ_SIGNED_W: the unsigned
 * operand). */
#ifdef DOT_U8S8_ACC
#define GQ_OFFSET_ROWS 1
#else
#define GQ_OFFSET_ROWS 0
#define DOT_U8S8_ACC(acc, u, s) _mm256_add_epi32(acc, DOT_U8S8(u, s)) /* not used: keeps both branches compiling */
#endif
#define GQ_SIGNED_W(u, OFFSET) (OFFSET ? _mm256_xor_si256(u, _mm256_set1_epi8((char)0x80)) : _mm256_abs_epi8(u))
#define GQ_SIGNED_DOT(w, u, xv, c, OFFSET)                                                                         \
    (OFFSET ? DOT_U8S8_ACC(_mm256_loadu_si256((const __m256i *)(c)), w, xv) : DOT_U8S8(w, _mm256_sign_epi8(xv, u)))

/* The integer path's offset terms of a chunk: out + zl * S[0..8) + zh * S[8..16), the offsets of its 16-element
 * sub-blocks times a row's sums of them (sr: gq_sums' chunk) */
INLINE __m256 gq_offsets(__m256 out, __m256 zl, __m256 zh, const float *sr) {
    out = _mm256_fmadd_ps(zl, _mm256_loadu_ps(sr), out);
    return _mm256_fmadd_ps(zh, _mm256_loadu_ps(sr + 8), out);
}

/* Q6_K's codes u = q + 32 (0..63) of one super-block, 8 vectors of 32 in element order: the low 4 bits from ql, bits
 * 2t and 2t + 1 of qh on top (every path's Q6_K decoder: cpu_kquants.c's, the head's) */
INLINE void q6k_codes(const uint8_t *q, __m256i *u) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), b45 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(q + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(q + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * h));
        for (int t = 0; t < 4; t++) {
            const __m256i lo = t & 1 ? l1 : l0;
            u[4 * h + t] = _mm256_or_si256(_mm256_and_si256(t >> 1 ? _mm256_srli_epi16(lo, 4) : lo, m4),
                                           _mm256_and_si256(gg_shift(qh, 4 - 2 * t), b45));
        }
    }
}

/* ---- The GGUF type table ----------------------------------------------------------------------------------------- */

typedef void (*gg_tile_fn)(const uint8_t *, int64_t, int, const float *, int64_t, const float *, int64_t, int64_t,
                           float *, int64_t);
typedef void (*gg_fill_fn)(const uint8_t *, int64_t, float *, int64_t);
#define GG_FNS(T) {ggt_##T##_1, ggt_##T##_2, ggt_##T##_3, ggt_##T##_4}, ggf_##T
#define DQ(scalar, vector) vector
#define GG(T, wide, sub, unit) GG_FNS(T), wide, sub, unit
typedef void (*gq_tile_fn)(const uint8_t *, int64_t, int, const int8_t *, const float *, const float *,
                           const int32_t *, int64_t, int64_t, float *, int64_t);
typedef void (*gq_rows_fn)(const uint8_t *, const int8_t *, const float *, const float *, const int32_t *,
                           const gq_lanes *, int64_t, int64_t, float *, int64_t, int);
typedef void (*gq_pairs_fn)(const uint8_t *, const gq_lanes *, int64_t, float *, int64_t, int);
#define GQ(T, pairs) {gqt_##T##_1, gqt_##T##_2, gqt_##T##_3, gqt_##T##_4}, gqm_##T, pairs
#else
#define DQ(scalar, vector) scalar
#define GG(T, wide, sub, unit) {NULL}, NULL, wide, sub, unit
#define GQ(T, pairs) {NULL}, NULL, NULL
typedef void (*gg_tile_fn)(void);
typedef void (*gg_fill_fn)(void);
typedef void (*gq_tile_fn)(void);
typedef void (*gq_rows_fn)(void);
typedef void (*gq_pairs_fn)(void);
#endif

/* A GGUF block type: its GGML type id (gguf.GGMLQuantizationType), elements and bytes per block, and its functions on
 * each path (NULL in the portable build, which dequantizes instead; DQ, GG and GQ fill a row of the table). */
typedef void (*gguf_dq_fn)(const uint8_t *, int64_t, float *);
typedef struct {
    int type, elems, bytes;
    gguf_dq_fn fn;          /* nb blocks -> their weights, the reference's values */
    gg_tile_fn tiles[4];    /* fp32 path: R = 1..4 rows (AVX2) */
    gg_fill_fn fill;        /* fp32 path: a column's panel for the rows-in-lanes path */
    int wide, sub;          /* 8-bit codes (byte 3's activations unscaled); sub-block length (16 or 32) */
    int unit;               /* elements per unit: 32, or 64 for the nibble pairs of Q4_0 / Q4_1 */
    gq_tile_fn qtiles[4];   /* int8 path: R = 1..4 rows */
    gq_rows_fn qrows;       /* int8 path: many rows of one column */
    gq_pairs_fn qpairs;     /* int8 path, the signed blocks of 32: 4-7 rows in block pairs (else NULL) */
} gguf_type;

/* the rows of the type table: cpu_blocks32.c's and cpu_kquants.c's */
#define LLMD_BLOCKS32_TYPES 7
#define LLMD_KQUANTS_TYPES 6
LLMD_HIDDEN extern const gguf_type llmd_blocks32_types[LLMD_BLOCKS32_TYPES];
LLMD_HIDDEN extern const gguf_type llmd_kquants_types[LLMD_KQUANTS_TYPES];
/* the type with this id, where K is a whole number of its blocks; else NULL (cpu_gguf.c) */
LLMD_HIDDEN const gguf_type *gguf_type_of(int type, int64_t k);
/* K padded to whole units (the fp32 path's activation rows) */
static inline int64_t gg_padded(const gguf_type *t, int64_t k) { return (k + t->unit - 1) / t->unit * t->unit; }

/* ---- cpu_act.c: activation rows ---------------------------------------------------------------------------------- */
/* rows [r0, r1) of x quantized to int8 per block of 32 into the int8 / int4 layers' work buffer (llmd_q8_work_bytes of
 * m rows; interleave: each block's bytes as [even k | odd k], for int4's nibbles) */
LLMD_HIDDEN void quantize_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, int64_t g,
                               int interleave, void *work, int64_t m);
/* the GGUF integer path's row data of one row, and the signed blocks' lane layout of m rows */
LLMD_HIDDEN void gq_quantize_row(const float *x, int64_t k, int with_c, float *d, float *S, int8_t *xq, int32_t *C);
LLMD_HIDDEN size_t gq_lanes_bytes(int64_t m, int64_t k);
LLMD_HIDDEN void gq_fill_lanes(void *lanes, const float *d, const int8_t *xq, const int32_t *C, int64_t m, int64_t k);
LLMD_HIDDEN gq_lanes gq_lanes_in(const void *lanes, int64_t m, int64_t k, int64_t g);
/* a row's bytes with each 4 of them 8 times, xb [8 K] (the interleaved types' one-row tiles) */
LLMD_HIDDEN void gq_broadcast_row(const int8_t *xq, int64_t k, int8_t *xb);
/* the head path's row data of one row: d [K/32], int16 codes [K] */
LLMD_HIDDEN void gh_quantize_row(const float *x, int64_t k, float *d, int16_t *xq);
/* its codes' sums of 16 (an interleaved Q6_K head's rows), and its codes with each 4 of them 4 times, xb [4 K] */
LLMD_HIDDEN void gh_sums_row(const int16_t *xq, int64_t k, int32_t *sums);
LLMD_HIDDEN void gh_broadcast_row(const int16_t *xq, int64_t k, int16_t *xb);
#if defined(__AVX2__) && defined(__FMA__)
/* rows transposed per block of 16 rows (into xt, or a new buffer) */
LLMD_HIDDEN void transpose_into(float *xt, const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int int4);
LLMD_HIDDEN float *transpose_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int int4,
                                  size_t extra_floats);
/* the GGUF fp32 path's activations and sub-block sums of m rows */
LLMD_HIDDEN void gg_prepare(const gguf_type *t, const float *x, int64_t ldx, int64_t m, int64_t k, float *xp,
                            float *xs);
#else
/* cpu_blocks32.c, portable: columns [n0, n1) of the signed blocks of 32 on the integer path, in their vector order */
LLMD_HIDDEN void gq_signed_cols(const gguf_type *t, const float *xd, const int8_t *xq, const uint8_t *q, float *y,
                                int64_t ldy, int64_t m, int64_t k, int64_t n0, int64_t n1);
#endif

/* ---- cpu_head.c: the int16 path ---------------------------------------------------------------------------------- */
LLMD_HIDDEN int gh_supported(int type);
LLMD_HIDDEN void gh_cols(int type, const float *xd, const int32_t *Q, const int16_t *xq, const void *lanes,
                         const uint8_t *q, float *y, int64_t ldy, int64_t m, int64_t k, int64_t n0, int64_t n1);
/* Q4_1's lane layout of m rows (0 bytes under 8 rows, which take the per-row tile): cpu_gguf.c's group step */
LLMD_HIDDEN size_t gh41_lanes_bytes(int64_t m, int64_t k);
LLMD_HIDDEN void gh41_fill_lanes(void *lanes, const float *xd, const int32_t *Q, const int16_t *xq, int64_t m,
                                 int64_t k);
#endif
