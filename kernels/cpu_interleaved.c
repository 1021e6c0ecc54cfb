/* Q4_K repacked for the CPU's integer path: 8 output columns interleaved ("Q4_K_X8", llmd's own type id 1012), and the
 * other K-quants, IQ4_XS and the blocks of 32 (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) likewise.
 *
 * In the file's layout one column's super-block is one 144-byte block, so a vector holds 32 codes of one column: its
 * dot product ends in a horizontal sum and each sub-block's scale costs a conversion per column. Interleaved, a vector
 * holds 4 codes of each of 8 columns and the lanes are the columns: an int8 dot product (vpdpbusd, or maddubs + madd)
 * against 4 broadcast activations serves 8 outputs, and scales, activation scales and mins apply per lane with no
 * horizontal sum. The bits are the file's, rearranged (llmd.kernels.gguf_blocks.q4k_x8_pack): the same size, every
 * value the same. A group of 8 columns' super-block (1152 bytes, the 8 blocks' bytes) holds:
 *   [0, 16)     d of the 8 columns (fp16), [16, 32) their dmin (fp16);
 *   [32, 64)    byte i = 8j + c (j < 4): scale of sub-block j of column c, low 4 bits; high nibble: sub-block j + 4's;
 *   [64, 96)    the same for the mins;
 *   [96, 128)   byte i: bits 0-1 the scale's bits 4-5 for sub-block j, 2-3 for j + 4; bits 4-5, 6-7: the mins';
 *   [128, 1152) 32 bytes per (c, g) at 32 (8c + g): 4 bytes of each column (column-major), the file's code bytes
 *               32c + 4g .. 32c + 4g + 3: low nibbles elements 64c + 4g.., high nibbles elements 64c + 32 + 4g...
 *
 * Per output (row r, column c), in this order whatever the rows, the columns' range or the thread:
 *   for each super-block b: dot_j = sum of the 32 codes times the int8 activations of unit j (exact integers);
 *   s = float(dot_0 sc_0) xd_0, then s = fma(float(dot_j sc_j), xd_j, s) for j = 1..7;
 *   m = mn_0 S_0, then m = fma(mn_j, S_j, m) (S_j: the row's sum of unit j's dequantized activations, xd_j times
 *   the sum of its codes);
 *   out = fma(s, d, out); out = fma(-m, dmin, out).
 * The portable build computes the same operations in plain C (fmaf).
 * Where 512-bit VNNI is built in, Q4_K's, Q5_K's, Q6_K's and Q8_0's prompt tiles (X16_MIN_ROWS rows and more) take two
 * neighbouring column groups at once, 16 lanes, each lane's operations the 8-lane tile's: the same results.
 *
 * Q5_K likewise ("Q5_K_X8", 1013; gguf_blocks.q5k_x8_pack), 1408 bytes: Q4_K_X8's 1152 bytes of its d, dmin,
 * scales, mins and low 4 bits, then the fifth bits in runs of 4 bytes per column (32 bytes at 1152 + 32g: qh bytes
 * 4g .. 4g + 3, bit j of a byte sub-block j's): codes 0..31, the same operations per output as Q4_K_X8.
 *
 * Q6_K the same way ("Q6_K_X8", 1014; gguf_blocks.q6k_x8_pack): a group's super-block (1680 bytes) holds d of the 8
 * columns (fp16, [0, 16)), the 16 int8 scales as byte 16 + 8s + c, then the codes re-coded so that two of every four
 * are whole bytes: position (h, g, c, i) (elements 128h + 32t + 4g + i of column c for the 4 units t) is byte
 * o = 256h + 32g + 4c + i of three runs, X at 144 + o: unit 0's code | unit 2's top 2 bits << 6; Y at 656 + o: unit
 * 1's | unit 3's top 2 bits << 6; Z at 1168 + o: unit 2's low 4 bits | unit 3's << 4 (the file's ql bytes 64h + 4g + i
 * and 64h + 32 + 4g + i and qh byte 32h + 4g + i hold the same 24 bits). Its sub-blocks are 16 codes (u = q + 32,
 * 0..63), taken in the order
 * s = 8h + 2u + e for h, e (the half of unit u), u: per output and super-block,
 *   s_acc = fma(float(dot_s sc_s), xd_(s/2), s_acc) from float(dot_s sc_s) xd_(s/2) for the first;
 *   m_acc = fma(float(sc_s), S_s, m_acc) likewise;   out = fma(s_acc, d, out); out = fma(m_acc, -32 d, out).
 *
 * IQ4_XS likewise ("IQ4_XS_X8", 1023; gguf_blocks.iq4xs_x8_pack), 1088 bytes: d (fp16, [0, 16)), the 6-bit scales'
 * low 4 bits as Q4_K's ([16, 48)), their top 2 bits (byte 8p + c, bits 2k: sub-block 4p + k, [48, 64)), then the codes
 * in runs of 4 bytes per column (32 bytes at 64 + 32 (4j + g): qs bytes 16j + 4g ..: low nibbles elements 32j + 4g..,
 * high ones 32j + 16 + 4g..). Its codes are signed table values (the exact integer dot product: IQ_DOT), then per
 * output s = fma(float(dot_j (sc_j - 32)), xd_j, s) from the first product, out = fma(s, d, out).
 *
 * Q2_K and Q3_K ("Q2_K_X8", 1010, 672 bytes; "Q3_K_X8", 1011, 880 bytes; gguf_blocks.X8_FIELDS): each
 * field of the 8 columns side by side, fp16s as 8 fp16s and other bytes column-interleaved (byte i of column c at
 * 8i + c). Q2_K: d [0, 16), dmin [16, 32), the 16 scale bytes (scale | min << 4 of sub-block s, [32, 160)), then the
 * 2-bit codes in runs of 4 bytes per column (32 bytes at 160 + 32 (8h + g): qs bytes 32h + 4g ..). Q3_K: d [0, 16),
 * the 12 scale bytes [16, 112), the high bits in runs (32 bytes at 112 + 32g: hmask bytes 4g ..), then the low 2 bits
 * as Q2_K's codes from 368. Unit j = 4h + t is bits 2t of runs (h, g) (Q3_K: plus bit j of the hmask runs as bit 2:
 * u = q + 4, 0..7), its sub-blocks 2j (g < 4) and 2j + 1; per output and super-block, with sc Q3_K's scales minus 32
 * and mn Q2_K's mins or Q3_K's sc:
 *   s = fma(float(dot_2j sc_2j + dot_2j+1 sc_2j+1), xd_j, s) from the product for j = 0;
 *   m = fma(mn_s, S_s, m) for s = 0..15 from mn_0 S_0;   out = fma(s, d, out); out = fma(-m, dmin, out) (Q3_K:
 *   out = fma(m, -4 d, out)).
 *
 * Q4_0 ("Q4_0_X8", 1002; gguf_blocks.X8_FIELDS), 144 bytes a block of 32: d [0, 16), then the codes in runs of 4
 * bytes per column (32 bytes at 16 + 32g: qs bytes 4g ..: low nibbles elements 4g.., high ones 16 + 4g..). Per
 * output, for each block b: out = fma(float(dot_b - 8 sum(q_b)), d xd_b, out) (sum(q_b): the row's codes).
 * Q4_1 ("Q4_1_X8", 1003), 160 bytes: d [0, 16), m [16, 32), then the codes as Q4_0_X8's from 32. Per output, for each
 * block b: out = fma(float(dot_b), d xd_b, out); out = fma(m, S_b, out) (S_b: the row's sum of the block's dequantized
 * activations). Q5_0 ("Q5_0_X8", 1006; 176 bytes) and Q5_1 ("Q5_1_X8", 1007; 192 bytes): Q4_0_X8's and Q4_1_X8's
 * fields with the fifth bits before the codes, a 4-byte run per column re-ordered (x8_q5_bits), codes 0..31; Q5_0 as
 * Q4_0 with -16 sum(q_b), Q5_1 as Q4_1. IQ4_NL ("IQ4_NL_X8", 1020): Q4_0_X8's layout, its codes signed table values
 * (IQ4_XS_X8's dot products): out = fma(float(dot_b), d xd_b, out).
 *
 * Q8_0 ("Q8_0_X8", 1008; gguf_blocks.X8_FIELDS), 272 bytes a block of 32: d [0, 16), then the codes in runs of 4 bytes
 * per column (32 bytes at 16 + 32g: qs bytes 4g ..). Per output the file layout's tiles' order (cpu_blocks32.c, the
 * signed blocks), so the results are theirs bit for bit: a_(b % 2) = fma(float(D_b), d xd_b, a_(b % 2)) for the blocks
 * b in order (D_b: the block's exact integer dot product), out = a_0 + a_1. */
#include "cpu_tiles.h"

#define Q40X8_BYTES 144
#define Q41X8_BYTES 160
#define Q80X8_BYTES 272
#define Q2X8_BYTES 672
#define Q3X8_BYTES 880
#define X8_BYTES 1152
#define Q5X8_BYTES 1408
#define Q6X8_BYTES 1680
#define IQX8_BYTES 1088
/* Super-blocks prefetched ahead, and how. Q6_K's 27 lines a super-block into L2, 2 ahead (into L1 they streamed at
 * half the rate: more lines than its miss buffers); Q4_K's 18 (and IQ4_XS's 17) 4 ahead as non-temporal (into L1,
 * kept out of the outer caches: 5-7 % faster at one row on Zen 1 than into L1 2 ahead, the weights are read once);
 * Q4_0's, Q4_1's and Q8_0's blocks the same distance in bytes */
#define X8_PF 4
#define X8_HINT _MM_HINT_NTA
#define Q40X8_PF 32
#define Q41X8_PF 29
#define Q80X8_PF 17
#define Q6X8_PF 2
#define Q6X8_HINT _MM_HINT_T1

/* The blocks of 32 interleaved: per kind its bytes (8 columns' blocks), where its fields start (Q4_1's and Q5_1's
 * minima, Q5_0's and Q5_1's fifth bits; 0: none) and its codes, the code offset's divisor of the row data's C sums
 * (Q4_0: -8 times the activation sum, Q5_0: -16 times; 0: none) and the blocks prefetched ahead */
enum { B32_Q4_0, B32_Q4_1, B32_Q5_0, B32_Q5_1, B32_IQ4_NL };
/* IQ4_NL's and IQ4_XS's code values (the portable tiles') */
__attribute__((unused)) static const int8_t IQ4_CODES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                                             1,    13,   25,  38,  53,  69,  89,  113};
static const struct {
    int64_t bytes, mins, qh, codes, offset, pf;
} B32[] = {{Q40X8_BYTES, 0, 0, 16, 16, Q40X8_PF},
           {Q41X8_BYTES, 16, 0, 32, 0, Q41X8_PF},
           {176, 0, 16, 48, 8, 26},  /* Q5_0 */
           {192, 16, 32, 64, 0, 24}, /* Q5_1 */
           {Q40X8_BYTES, 0, 0, 16, 0, Q40X8_PF}};

/* Q6_K_X8's code of unit u at position o (see above) of a group's super-block g */
static inline int q6x8_code(const uint8_t *g, int64_t o, int u) {
    const uint8_t X = g[144 + o], Y = g[656 + o], Z = g[1168 + o];
    return u == 0 ? X & 63 : u == 1 ? Y & 63 : u == 2 ? (Z & 15) | (X >> 6) << 4 : (Z >> 4) | (Y >> 6) << 4;
}

/* Every tile's arguments: a column group's super-blocks q (nb of them), then rows [0, R) of the integer path's row data
 * (row r's bytes at xq + r k, activation scales at xd + r nbx, sums at S + r lds, C at C + r k / 4; each type reads
 * what it needs), and the outputs y (row stride ldy, 8 columns). */
#define X8_TILE_ARGS                                                                                                   \
    const uint8_t *q, int64_t nb, const int8_t *xq, int64_t k, const float *xd, int64_t nbx, const float *S,          \
        int64_t lds, const int32_t *C, float *y, int64_t ldy
typedef void (*x8_tile)(X8_TILE_ARGS);

/* the 64 scales and 64 mins of a group's super-block g as bytes sc [8j + c], mn [8j + c] */
static inline void x8_scales(const uint8_t *g, uint8_t *sc, uint8_t *mn) {
#if defined(__AVX2__)
    const __m256i ls = _mm256_loadu_si256((const __m256i *)(g + 32));
    const __m256i lm = _mm256_loadu_si256((const __m256i *)(g + 64));
    const __m256i h = _mm256_loadu_si256((const __m256i *)(g + 96));
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    _mm256_storeu_si256((__m256i *)sc, _mm256_or_si256(_mm256_and_si256(ls, m4),
                                                       _mm256_and_si256(_mm256_slli_epi16(h, 4), m30)));
    _mm256_storeu_si256((__m256i *)(sc + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ls, 4), m4),
                                                              _mm256_and_si256(_mm256_slli_epi16(h, 2), m30)));
    _mm256_storeu_si256((__m256i *)mn, _mm256_or_si256(_mm256_and_si256(lm, m4), _mm256_and_si256(h, m30)));
    _mm256_storeu_si256((__m256i *)(mn + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(lm, 4), m4),
                                                              _mm256_and_si256(_mm256_srli_epi16(h, 2), m30)));
#else
    for (int i = 0; i < 32; i++) {
        const uint8_t h = g[96 + i];
        sc[i] = (uint8_t)((g[32 + i] & 15) | (h & 3) << 4);
        sc[32 + i] = (uint8_t)((g[32 + i] >> 4) | (h >> 2 & 3) << 4);
        mn[i] = (uint8_t)((g[64 + i] & 15) | (h >> 4 & 3) << 4);
        mn[32 + i] = (uint8_t)((g[64 + i] >> 4) | (h >> 6) << 4);
    }
#endif
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define X8_DOT(acc, u, s) DOT_U8S8_ACC(acc, u, s) /* vpdpbusd, or maddubs + madd + add (codes < 64: no saturation) */

/* An accumulator kept a chain: gcc otherwise regroups a sum's unrolled terms into a tree, all live at once, which
 * spills most of them to the stack. */
static inline __m256i x8_chain(__m256i v) {
    __asm__("" : "+x"(v));
    return v;
}

/* The 4 activation bytes of row r at element off in all 8 lanes: broadcast from the row's bytes, or, in a one-row
 * tile given the row's broadcast copy (BC: xq holds each 4 bytes 8 times, gq_broadcast_row), one plain load that
 * the multiply takes as its memory operand (Zen 1's broadcasts cost vector ops: the compute-bound one-row tiles gain
 * 3-10 %; not Q8_0's, see X8_TYPES) */
INLINE __m256i x8_bcast(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
#define X8_XV(BC, r, off) \
    ((BC) ? _mm256_loadu_si256((const __m256i *)(xq + 8 * (off))) : x8_bcast(xq + (r) * k + (off)))

/* A Q4_K sub-block's integer sum times its 8 columns' scales sc8 (8 bytes; int32 lanes out). With VNNI the sum is
 * vpdpbusd's int32 lanes, then multiplied. Else the sub-block's 8 maddubs are summed in int16 lanes (a lane's 16
 * products of 4-bit codes and int8 activations stay within 16 * 15 * 128 = 30720 < 2^15) and one vpmaddwd against
 * the scales, each repeated in both int16 halves of its column's lane, widens and scales them at once: the same
 * integers with 1 multiply in place of 9, in the unit (vpmaddubsw's) that bounds the decode tile where 256-bit
 * multiplies issue as two halves (Zen 1). */
#if GQ_OFFSET_ROWS
#define X8_SUB_ACC(acc, u, s) DOT_U8S8_ACC(acc, u, s)
#define X8_SUB_SCALED(acc, sc8) _mm256_mullo_epi32(acc, _mm256_cvtepu8_epi32(sc8))
#else
#define X8_SUB_ACC(acc, u, s) x8_chain(_mm256_add_epi16(acc, _mm256_maddubs_epi16(u, s)))
#define X8_SUB_SCALED(acc, sc8) _mm256_madd_epi16(acc, _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc8, sc8)))
#endif

/* one row's 8 outputs of a column group q (nb super-blocks); bc: xq is the row's broadcast copy */
INLINE void x8_row(const uint8_t *q, int64_t nb, const int8_t *xq, const float *xd, const float *S32, float *y,
                   const int bc) {
    const int64_t k = 0; /* one row: X8_XV's row offset */
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 out = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * X8_BYTES;
        for (int p = 0; p < X8_BYTES; p += 64) _mm_prefetch((const char *)(g + X8_PF * X8_BYTES + p), X8_HINT);
        uint8_t sc[64], mn[64];
        x8_scales(g, sc, mn);
        __m256i acc[8];
        for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_si256();
        _Pragma("GCC unroll 8") for (int kk = 0; kk < 8; kk++) {
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {
                const __m256i w = _mm256_loadu_si256((const __m256i *)(g + 128 + 32 * (8 * c + kk)));
                const int64_t at = 256 * b + 64 * c + 4 * kk;
                acc[2 * c] = X8_SUB_ACC(acc[2 * c], _mm256_and_si256(w, m4), X8_XV(bc, 0, at));
                acc[2 * c + 1] = X8_SUB_ACC(acc[2 * c + 1], _mm256_and_si256(_mm256_srli_epi16(w, 4), m4),
                                            X8_XV(bc, 0, at + 32));
            }
        }
        __m256 s = _mm256_setzero_ps(), m = _mm256_setzero_ps();
        _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
            const __m128i scj = _mm_loadl_epi64((const __m128i *)(sc + 8 * j));
            const __m256 t = _mm256_cvtepi32_ps(X8_SUB_SCALED(acc[j], scj));
            const __m256 dv = _mm256_set1_ps(xd[8 * b + j]);
            s = j ? _mm256_fmadd_ps(t, dv, s) : _mm256_mul_ps(t, dv);
            const __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + 8 * j))));
            const __m256 sj = _mm256_set1_ps(S32[8 * b + j]);
            m = j ? _mm256_fmadd_ps(mv, sj, m) : _mm256_mul_ps(mv, sj);
        }
        out = _mm256_fmadd_ps(s, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g)), out);
        out = _mm256_fnmadd_ps(m, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))), out);
    }
    _mm256_storeu_ps(y, out);
}

/* Q5_K's fifth bit of sub-block j's codes, from a run of its high-bit bytes v (bit j of each byte), as bit 4 of each
 * byte (a 16-bit shift moves no other byte's bit into bit 4) */
INLINE __m256i q5_bit4(__m256i v, int j) {
    const __m256i at = j <= 4 ? _mm256_slli_epi16(v, 4 - j) : _mm256_srli_epi16(v, j - 4);
    return _mm256_and_si256(at, _mm256_set1_epi8(0x10));
}

/* R rows of a Q4_K (QH 0: 2..4 rows) or Q5_K (QH 1: 1..4 rows) column group: each 32 bytes of codes loaded and split
 * once for all rows; a chunk of 64 codes at a time (units 2c, 2c + 1), so 2R integer sums are live. Q5_K's codes
 * reach 31, so without VNNI its int16 sums are scaled and widened every 4 code vectors (4 * 2 * 31 * 128 < 2^15), its
 * integers dot_j sc_j the same. The same operations per output as x8_row. */
#define X8K_ROWS(NAME, R, QH, BC, SUFFIX)                                                                              \
    static void NAME##_##R##SUFFIX(X8_TILE_ARGS) {                                                                     \
        (void)C;                                                                                                       \
        const int64_t bytes = QH ? Q5X8_BYTES : X8_BYTES;                                                            \
        const int halves = QH && !GQ_OFFSET_ROWS; /* Q5_K's int16 sums scaled twice a sub-block */                  \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                                                   \
        __m256 out[R], s[R], m[R];                                                                                   \
        for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * bytes;                                                                        \
            for (int p = 0; p < bytes; p += 64) _mm_prefetch((const char *)(g + X8_PF * bytes + p), X8_HINT);       \
            uint8_t sc[64], mn[64];                                                                                  \
            x8_scales(g, sc, mn);                                                                                    \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                                                   \
                __m256i a[2][R], dot[2][R];                                                                          \
                for (int r = 0; r < R; r++) a[0][r] = a[1][r] = _mm256_setzero_si256();                              \
                _Pragma("GCC unroll 8") for (int kk = 0; kk < 8; kk++) {                                            \
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(g + 128 + 32 * (8 * c + kk)));            \
                    __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);        \
                    if (QH) {                                                                                        \
                        const __m256i v = _mm256_loadu_si256((const __m256i *)(g + X8_BYTES + 32 * kk));             \
                        lo = _mm256_or_si256(lo, q5_bit4(v, 2 * c)), hi = _mm256_or_si256(hi, q5_bit4(v, 2 * c + 1)); \
                    }                                                                                                \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const int64_t at = 256 * b + 64 * c + 4 * kk;                                                \
                        a[0][r] = X8_SUB_ACC(a[0][r], lo, X8_XV(BC, r, at));                                         \
                        a[1][r] = X8_SUB_ACC(a[1][r], hi, X8_XV(BC, r, at + 32));                                    \
                    }                                                                                                \
                    if (kk == 7 || (halves && kk == 3))                                                              \
                        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                       \
                            const __m128i scj = _mm_loadl_epi64((const __m128i *)(sc + 8 * (2 * c + h)));            \
                            for (int r = 0; r < R; r++) {                                                            \
                                const __m256i part = X8_SUB_SCALED(a[h][r], scj);                                    \
                                dot[h][r] = halves && kk == 7 ? _mm256_add_epi32(dot[h][r], part) : part;            \
                                a[h][r] = _mm256_setzero_si256();                                                    \
                            }                                                                                        \
                        }                                                                                            \
                }                                                                                                    \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                               \
                    const int j = 2 * c + h;                                                                         \
                    const __m256 mv =                                                                                \
                        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(mn + 8 * j))));    \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const __m256 t = _mm256_cvtepi32_ps(dot[h][r]);                                              \
                        const __m256 dv = _mm256_set1_ps(xd[r * nbx + 8 * b + j]);                                   \
                        const __m256 sj = _mm256_set1_ps(S[r * lds + 2 * nbx + 8 * b + j]);                          \
                        s[r] = j ? _mm256_fmadd_ps(t, dv, s[r]) : _mm256_mul_ps(t, dv);                              \
                        m[r] = j ? _mm256_fmadd_ps(mv, sj, m[r]) : _mm256_mul_ps(mv, sj);                            \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));                                   \
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));                         \
            for (int r = 0; r < R; r++) {                                                                            \
                out[r] = _mm256_fmadd_ps(s[r], d, out[r]);                                                           \
                out[r] = _mm256_fnmadd_ps(m[r], dmin, out[r]);                                                       \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, out[r]);                                           \
    }
X8K_ROWS(x8_rows, 2, 0, 0, )
X8K_ROWS(x8_rows, 3, 0, 0, )
X8K_ROWS(x8_rows, 4, 0, 0, )
X8K_ROWS(q5x8_rows, 1, 1, 0, )
X8K_ROWS(q5x8_rows, 1, 1, 1, b)
X8K_ROWS(q5x8_rows, 2, 1, 0, )
X8K_ROWS(q5x8_rows, 3, 1, 0, )
X8K_ROWS(q5x8_rows, 4, 1, 0, )

/* Where 512-bit VNNI is built in (Zen 4 and 5, Intel's AVX-512 cores): R rows (2..4) of two neighbouring Q4_K (QH 0)
 * or Q5_K (QH 1) column groups at once, the first group's 8 columns in lanes 0..7 and the next one's (nb super-blocks
 * on) in 8..15, so each vpdpbusd serves 16 columns. Each lane's operations are X8K_ROWS(R)'s, so every output is
 * theirs bit for bit; prompts and batched decode (compute-bound) gain, a one-row decode (memory-bound) keeps its 8-lane
 * tile. */
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define X16_PAIRS 1
/* 8 bytes at a and 8 at b, widened to 16 int32 lanes */
INLINE __m512i x16_bytes(const uint8_t *a, const uint8_t *b) {
    const __m128i lo = _mm_loadl_epi64((const __m128i *)a), hi = _mm_loadl_epi64((const __m128i *)b);
    return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(lo, hi));
}
/* 32 bytes at g + at (lanes 0..7) and at g2 + at (8..15) */
INLINE __m512i x16_load(const uint8_t *g, const uint8_t *g2, int64_t at) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(g + at))),
                              _mm256_loadu_si256((const __m256i *)(g2 + at)), 1);
}
/* q5_bit4 on 16 lanes */
INLINE __m512i q5_bit4_16(__m512i v, int j) {
    const __m512i at = j <= 4 ? _mm512_slli_epi16(v, 4 - j) : _mm512_srli_epi16(v, j - 4);
    return _mm512_and_si512(at, _mm512_set1_epi8(0x10));
}
/* lanes 0..7 to y, 8..15 to y + 8 */
INLINE void x16_store(float *y, __m512 v) {
    _mm256_storeu_ps(y, _mm512_castps512_ps256(v));
    _mm256_storeu_ps(y + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
/* 8 fp16s at a and 8 at b as 16 floats */
INLINE __m512 x16_halves(const uint8_t *a, const uint8_t *b) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
/* super-block b's bytes of both column groups, `pf` super-blocks ahead (the 8-lane tiles' distance and hint) */
#define X16_PREFETCH(g, g2, bytes, pf, hint)                                                                          \
    for (int p = 0; p < (bytes); p += 64) {                                                                          \
        _mm_prefetch((const char *)((g) + (pf) * (bytes) + p), hint);                                                \
        _mm_prefetch((const char *)((g2) + (pf) * (bytes) + p), hint);                                               \
    }
#define X16K_ROWS(NAME, R, QH)                                                                                         \
    static void NAME##_##R(X8_TILE_ARGS) {                                                                             \
        (void)C;                                                                                                       \
        const int64_t bytes = QH ? Q5X8_BYTES : X8_BYTES;                                                            \
        const uint8_t *q2 = q + nb * bytes;                                                                            \
        const __m512i m4 = _mm512_set1_epi8(0x0F);                                                                   \
        __m512 out[R], s[R], m[R];                                                                                   \
        for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * bytes, *g2 = q2 + b * bytes;                                                  \
            X16_PREFETCH(g, g2, bytes, X8_PF, X8_HINT);                                                              \
            uint8_t sc[64], mn[64], sc2[64], mn2[64];                                                                \
            x8_scales(g, sc, mn), x8_scales(g2, sc2, mn2);                                                           \
            _Pragma("GCC unroll 4") for (int c = 0; c < 4; c++) {                                                   \
                __m512i a[2][R];                                                                                     \
                for (int r = 0; r < R; r++) a[0][r] = a[1][r] = _mm512_setzero_si512();                              \
                _Pragma("GCC unroll 8") for (int kk = 0; kk < 8; kk++) {                                            \
                    const __m512i w = x16_load(g, g2, 128 + 32 * (8 * c + kk));                                      \
                    __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);        \
                    if (QH) {                                                                                        \
                        const __m512i v = x16_load(g, g2, X8_BYTES + 32 * kk);                                       \
                        lo = _mm512_or_si512(lo, q5_bit4_16(v, 2 * c));                                              \
                        hi = _mm512_or_si512(hi, q5_bit4_16(v, 2 * c + 1));                                          \
                    }                                                                                                \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const int8_t *x = xq + r * k + 256 * b + 64 * c + 4 * kk;                                    \
                        int32_t x0, x1;                                                                              \
                        memcpy(&x0, x, 4), memcpy(&x1, x + 32, 4);                                                   \
                        a[0][r] = _mm512_dpbusd_epi32(a[0][r], lo, _mm512_set1_epi32(x0));                          \
                        a[1][r] = _mm512_dpbusd_epi32(a[1][r], hi, _mm512_set1_epi32(x1));                          \
                    }                                                                                                \
                }                                                                                                    \
                _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++) {                                               \
                    const int j = 2 * c + h;                                                                         \
                    const __m512i scj = x16_bytes(sc + 8 * j, sc2 + 8 * j);                                          \
                    const __m512 mv = _mm512_cvtepi32_ps(x16_bytes(mn + 8 * j, mn2 + 8 * j));                         \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const __m512 t = _mm512_cvtepi32_ps(_mm512_mullo_epi32(a[h][r], scj));                       \
                        const __m512 dv = _mm512_set1_ps(xd[r * nbx + 8 * b + j]);                                   \
                        const __m512 sj = _mm512_set1_ps(S[r * lds + 2 * nbx + 8 * b + j]);                          \
                        s[r] = j ? _mm512_fmadd_ps(t, dv, s[r]) : _mm512_mul_ps(t, dv);                              \
                        m[r] = j ? _mm512_fmadd_ps(mv, sj, m[r]) : _mm512_mul_ps(mv, sj);                            \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
            const __m512 d = x16_halves(g, g2), dmin = x16_halves(g + 16, g2 + 16);                                  \
            for (int r = 0; r < R; r++) {                                                                            \
                out[r] = _mm512_fmadd_ps(s[r], d, out[r]);                                                           \
                out[r] = _mm512_fnmadd_ps(m[r], dmin, out[r]);                                                       \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) x16_store(y + r * ldy, out[r]);                                                  \
    }
X16K_ROWS(x16_rows, 2, 0)
X16K_ROWS(x16_rows, 3, 0)
X16K_ROWS(x16_rows, 4, 0)
X16K_ROWS(q5x16_rows, 2, 1)
X16K_ROWS(q5x16_rows, 3, 1)
X16K_ROWS(q5x16_rows, 4, 1)
#else
#define X16_PAIRS 0
#endif

/* Q6_K_X8's code of unit u (q + 32, 0..63) at run gi of half h of a group's super-block g (16-bit shifts: the bits
 * masked in come from the byte itself) */
INLINE __m256i q6x8_unit(const uint8_t *g, int h, int gi, int u) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
    const __m256i W = _mm256_loadu_si256((const __m256i *)(g + 144 + 512 * (u & 1) + 32 * (8 * h + gi)));
    if (u < 2) return _mm256_and_si256(W, _mm256_set1_epi8(0x3F));
    const __m256i Z = _mm256_loadu_si256((const __m256i *)(g + 1168 + 32 * (8 * h + gi)));
    return _mm256_or_si256(_mm256_and_si256(u == 2 ? Z : _mm256_srli_epi16(Z, 4), m4),
                           _mm256_and_si256(_mm256_srli_epi16(W, 2), m30));
}

/* the codes of units 0..3 at run gi of half h */
INLINE void q6x8_codes(const uint8_t *g, int h, int gi, __m256i c[4]) {
    for (int u = 0; u < 4; u++) c[u] = q6x8_unit(g, h, gi, u);
}

/* Q6_K_X8: R rows (1..4) of a column group; per (h, e) the 4 units' sums of 16 codes are live per row */
#define Q6X8_ROWS(R, BC, SUFFIX)                                                                                       \
    static void q6x8_rows_##R##SUFFIX(X8_TILE_ARGS) {                                                                  \
        (void)C;                                                                                                       \
        __m256 out[R], sa[R], ma[R];                                                                                 \
        for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * Q6X8_BYTES;                                                                   \
            for (int p = 0; p < Q6X8_BYTES; p += 64)                                                                 \
                _mm_prefetch((const char *)(g + Q6X8_PF * Q6X8_BYTES + p), Q6X8_HINT);                                \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                                                     \
            _Pragma("GCC unroll 2") for (int e = 0; e < 2; e++) {                                                   \
                __m256i a[4][R];                                                                                     \
                for (int u = 0; u < 4; u++)                                                                          \
                    for (int r = 0; r < R; r++) a[u][r] = _mm256_setzero_si256();                                    \
                _Pragma("GCC unroll 4") for (int gg = 0; gg < 4; gg++) {                                            \
                    const int gi = 4 * e + gg;                                                                       \
                    __m256i c[4];                                                                                    \
                    q6x8_codes(g, h, gi, c);                                                                         \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                             \
                    _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++)                                             \
                        a[u][r] = X8_DOT(a[u][r], c[u], X8_XV(BC, r, 256 * b + 128 * h + 32 * u + 4 * gi));          \
                }                                                                                                    \
                _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {                                               \
                    const int s = 8 * h + 2 * u + e, first = h == 0 && e == 0 && u == 0;                             \
                    const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + 16 + 8 * s)));    \
                    const __m256 scf = _mm256_cvtepi32_ps(sc);                                                       \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const __m256 t = _mm256_cvtepi32_ps(_mm256_mullo_epi32(a[u][r], sc));                        \
                        const __m256 dv = _mm256_set1_ps(xd[r * nbx + 8 * b + s / 2]);                               \
                        const __m256 sv = _mm256_set1_ps(S[r * lds + 16 * b + s]);                                   \
                        sa[r] = first ? _mm256_mul_ps(t, dv) : _mm256_fmadd_ps(t, dv, sa[r]);                        \
                        ma[r] = first ? _mm256_mul_ps(scf, sv) : _mm256_fmadd_ps(scf, sv, ma[r]);                    \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));                                   \
            const __m256 dm = _mm256_mul_ps(d, _mm256_set1_ps(-32.0f));                                              \
            for (int r = 0; r < R; r++) {                                                                            \
                out[r] = _mm256_fmadd_ps(sa[r], d, out[r]);                                                          \
                out[r] = _mm256_fmadd_ps(ma[r], dm, out[r]);                                                         \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, out[r]);                                           \
    }
#if X16_PAIRS
/* Q6_K_X8's unit u at run gi of half h for two column groups' super-blocks g (lanes 0..7) and g2 (8..15) */
INLINE __m512i q6x16_unit(const uint8_t *g, const uint8_t *g2, int h, int gi, int u) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    const int64_t w = 144 + 512 * (u & 1) + 32 * (8 * h + gi), z = 1168 + 32 * (8 * h + gi);
    const __m512i W = x16_load(g, g2, w);
    if (u < 2) return _mm512_and_si512(W, _mm512_set1_epi8(0x3F));
    const __m512i Z = x16_load(g, g2, z);
    return _mm512_or_si512(_mm512_and_si512(u == 2 ? Z : _mm512_srli_epi16(Z, 4), m4),
                           _mm512_and_si512(_mm512_srli_epi16(W, 2), m30));
}

/* Q6_K_X8: R rows (2..4) of two column groups at once, as X16K_ROWS: each lane's operations Q6X8_ROWS(R)'s */
#define Q6X16_ROWS(R)                                                                                                  \
    static void q6x16_rows_##R(X8_TILE_ARGS) {                                                                         \
        (void)C;                                                                                                       \
        const uint8_t *q2 = q + nb * Q6X8_BYTES;                                                                       \
        __m512 out[R], sa[R], ma[R];                                                                                 \
        for (int r = 0; r < R; r++) out[r] = _mm512_setzero_ps();                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * Q6X8_BYTES, *g2 = q2 + b * Q6X8_BYTES;                                        \
            X16_PREFETCH(g, g2, Q6X8_BYTES, Q6X8_PF, Q6X8_HINT);                                                     \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                                                     \
            _Pragma("GCC unroll 2") for (int e = 0; e < 2; e++) {                                                   \
                __m512i a[4][R];                                                                                     \
                for (int u = 0; u < 4; u++)                                                                          \
                    for (int r = 0; r < R; r++) a[u][r] = _mm512_setzero_si512();                                    \
                _Pragma("GCC unroll 4") for (int gg = 0; gg < 4; gg++) {                                            \
                    const int gi = 4 * e + gg;                                                                       \
                    _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {                                           \
                        const __m512i c = q6x16_unit(g, g2, h, gi, u);                                               \
                        _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                       \
                            int32_t x;                                                                               \
                            memcpy(&x, xq + r * k + 256 * b + 128 * h + 32 * u + 4 * gi, 4);                         \
                            a[u][r] = _mm512_dpbusd_epi32(a[u][r], c, _mm512_set1_epi32(x));                        \
                        }                                                                                            \
                    }                                                                                                \
                }                                                                                                    \
                _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {                                               \
                    const int s = 8 * h + 2 * u + e, first = h == 0 && e == 0 && u == 0;                             \
                    const __m512i sc = _mm512_cvtepi8_epi32(_mm_unpacklo_epi64(                                      \
                        _mm_loadl_epi64((const __m128i *)(g + 16 + 8 * s)),                                          \
                        _mm_loadl_epi64((const __m128i *)(g2 + 16 + 8 * s))));                                       \
                    const __m512 scf = _mm512_cvtepi32_ps(sc);                                                       \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const __m512 t = _mm512_cvtepi32_ps(_mm512_mullo_epi32(a[u][r], sc));                        \
                        const __m512 dv = _mm512_set1_ps(xd[r * nbx + 8 * b + s / 2]);                               \
                        const __m512 sv = _mm512_set1_ps(S[r * lds + 16 * b + s]);                                   \
                        sa[r] = first ? _mm512_mul_ps(t, dv) : _mm512_fmadd_ps(t, dv, sa[r]);                        \
                        ma[r] = first ? _mm512_mul_ps(scf, sv) : _mm512_fmadd_ps(scf, sv, ma[r]);                    \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
            const __m512 d = x16_halves(g, g2), dm = _mm512_mul_ps(d, _mm512_set1_ps(-32.0f));                       \
            for (int r = 0; r < R; r++) {                                                                            \
                out[r] = _mm512_fmadd_ps(sa[r], d, out[r]);                                                          \
                out[r] = _mm512_fmadd_ps(ma[r], dm, out[r]);                                                         \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) x16_store(y + r * ldy, out[r]);                                                  \
    }
Q6X16_ROWS(2)
Q6X16_ROWS(3)
Q6X16_ROWS(4)
#endif
#if GQ_OFFSET_ROWS
Q6X8_ROWS(1, 0, )
Q6X8_ROWS(1, 1, b)
#else
/* Q6_K_X8, one row, without VNNI: as Q6X8_ROWS(1), but a unit's products are summed in int16 lanes two code vectors
 * at a time (a lane's 4 products of 6-bit codes and int8 activations stay within 4 * 63 * 128 = 32256 < 2^15) and
 * each pair is widened and scaled by one vpmaddwd against the unit's scales (as X8_SUB_SCALED): 2 multiplies in place
 * of 5 besides the maddubs, the same integers dot_s sc_s. */
INLINE void q6x8_row(X8_TILE_ARGS, const int bc) {
    (void)nbx, (void)lds, (void)C, (void)ldy;
    __m256 out = _mm256_setzero_ps(), sa = out, ma = out;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * Q6X8_BYTES;
        for (int p = 0; p < Q6X8_BYTES; p += 64) _mm_prefetch((const char *)(g + Q6X8_PF * Q6X8_BYTES + p), Q6X8_HINT);
        _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)
        _Pragma("GCC unroll 2") for (int e = 0; e < 2; e++) {
            __m256i a[4];
            _Pragma("GCC unroll 2") for (int pair = 0; pair < 2; pair++) {
                __m256i p[4];
                _Pragma("GCC unroll 2") for (int half = 0; half < 2; half++) {
                    const int gi = 4 * e + 2 * pair + half;
                    __m256i c[4];
                    q6x8_codes(g, h, gi, c);
                    _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
                        const __m256i xv = X8_XV(bc, 0, 256 * b + 128 * h + 32 * u + 4 * gi);
                        const __m256i prod = _mm256_maddubs_epi16(c[u], xv);
                        p[u] = half ? _mm256_add_epi16(p[u], prod) : prod;
                    }
                }
                _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
                    const __m128i sc8 = _mm_loadl_epi64((const __m128i *)(g + 16 + 8 * (8 * h + 2 * u + e)));
                    const __m256i scaled = _mm256_madd_epi16(p[u], _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc8, sc8)));
                    a[u] = pair ? _mm256_add_epi32(a[u], scaled) : scaled;
                }
            }
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {
                const int s = 8 * h + 2 * u + e, first = h == 0 && e == 0 && u == 0;
                const __m128i sc8 = _mm_loadl_epi64((const __m128i *)(g + 16 + 8 * s));
                const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8));
                const __m256 t = _mm256_cvtepi32_ps(a[u]);
                const __m256 dv = _mm256_set1_ps(xd[8 * b + s / 2]), sv = _mm256_set1_ps(S[16 * b + s]);
                sa = first ? _mm256_mul_ps(t, dv) : _mm256_fmadd_ps(t, dv, sa);
                ma = first ? _mm256_mul_ps(scf, sv) : _mm256_fmadd_ps(scf, sv, ma);
            }
        }
        const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));
        out = _mm256_fmadd_ps(sa, d, out);
        out = _mm256_fmadd_ps(ma, _mm256_mul_ps(d, _mm256_set1_ps(-32.0f)), out);
    }
    _mm256_storeu_ps(y, out);
}
static void q6x8_rows_1(X8_TILE_ARGS) { q6x8_row(q, nb, xq, k, xd, nbx, S, lds, C, y, ldy, 0); }
static void q6x8_rows_1b(X8_TILE_ARGS) { q6x8_row(q, nb, xq, k, xd, nbx, S, lds, C, y, ldy, 1); }
#endif
Q6X8_ROWS(2, 0, )
Q6X8_ROWS(3, 0, )
Q6X8_ROWS(4, 0, )

/* Q8_0_X8: R rows of a column group, a block of 32 elements at a time: per run of 4 codes, the 8 columns' |w| against
 * the broadcast activations signed by w (maddubs: 2 * 128 * 127 < 2^15, then madd), or with VNNI w + 128 against them
 * from the block's offset (the sum of its C, -128 times its sums of 4); the same integers D_b either way */
#define Q80X8_ROWS(R)                                                                                                  \
    static void q80x8_rows_##R(X8_TILE_ARGS) {                                                                         \
        (void)S, (void)lds;                                                                                            \
        __m256 acc[R][2];                                                                                            \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();                                     \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * Q80X8_BYTES;                                                                  \
            for (int p = 0; p < Q80X8_BYTES; p += 64)                                                                \
                _mm_prefetch((const char *)(g + Q80X8_PF * Q80X8_BYTES + p), X8_HINT);                               \
            __m256i D[R];                                                                                            \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                   \
                const int32_t *c = C + r * (k / 4) + 8 * b;                                                          \
                D[r] = GQ_OFFSET_ROWS ? _mm256_set1_epi32(c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7])     \
                                      : _mm256_setzero_si256();                                                      \
            }                                                                                                        \
            _Pragma("GCC unroll 8") for (int gg = 0; gg < 8; gg++) {                                                \
                const __m256i w = _mm256_loadu_si256((const __m256i *)(g + 16 + 32 * gg));                           \
                const __m256i u = GQ_SIGNED_W(w, GQ_OFFSET_ROWS);                                                    \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                               \
                    const __m256i xv = X8_XV(0, r, 32 * b + 4 * gg);                                                 \
                    D[r] = GQ_OFFSET_ROWS ? DOT_U8S8_ACC(D[r], u, xv)                                                \
                                          : _mm256_add_epi32(D[r], DOT_U8S8(u, _mm256_sign_epi8(xv, w)));            \
                }                                                                                                    \
            }                                                                                                        \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));                                   \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                   \
                const __m256 P = _mm256_mul_ps(d, _mm256_set1_ps(xd[r * nbx + b]));                                  \
                acc[r][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(D[r]), P, acc[r][b & 1]);                         \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, _mm256_add_ps(acc[r][0], acc[r][1]));              \
    }
Q80X8_ROWS(1)
Q80X8_ROWS(2)
Q80X8_ROWS(3)
Q80X8_ROWS(4)
#if X16_PAIRS
/* Q8_0_X8: R rows (2..4) of two column groups at once, as X16K_ROWS: each lane's operations Q80X8_ROWS(R)'s */
#define Q80X16_ROWS(R)                                                                                                 \
    static void q80x16_rows_##R(X8_TILE_ARGS) {                                                                        \
        (void)S, (void)lds;                                                                                            \
        const uint8_t *q2 = q + nb * Q80X8_BYTES;                                                                      \
        __m512 acc[R][2];                                                                                            \
        for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();                                     \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * Q80X8_BYTES, *g2 = q2 + b * Q80X8_BYTES;                                      \
            X16_PREFETCH(g, g2, Q80X8_BYTES, Q80X8_PF, X8_HINT);                                                     \
            __m512i D[R];                                                                                            \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                   \
                const int32_t *c = C + r * (k / 4) + 8 * b;                                                          \
                D[r] = _mm512_set1_epi32(c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7]);                     \
            }                                                                                                        \
            _Pragma("GCC unroll 8") for (int gg = 0; gg < 8; gg++) {                                                \
                const __m512i u = _mm512_xor_si512(x16_load(g, g2, 16 + 32 * gg), _mm512_set1_epi8((char)0x80));     \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                               \
                    int32_t x;                                                                                       \
                    memcpy(&x, xq + r * k + 32 * b + 4 * gg, 4);                                                     \
                    D[r] = _mm512_dpbusd_epi32(D[r], u, _mm512_set1_epi32(x));                                      \
                }                                                                                                    \
            }                                                                                                        \
            const __m512 d = x16_halves(g, g2);                                                                      \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                   \
                const __m512 P = _mm512_mul_ps(d, _mm512_set1_ps(xd[r * nbx + b]));                                  \
                acc[r][b & 1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(D[r]), P, acc[r][b & 1]);                         \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) x16_store(y + r * ldy, _mm512_add_ps(acc[r][0], acc[r][1]));                     \
    }
Q80X16_ROWS(2)
Q80X16_ROWS(3)
Q80X16_ROWS(4)
#endif

/* Q2_K_X8's and Q3_K_X8's sub-block s: the 8 columns' scales (Q2_K: 4 bits; Q3_K: 6 bits minus 32, signed) and
 * Q2_K's mins as 8 bytes */
INLINE __m128i lowk_scales(const uint8_t *g, int s, int q3) {
    uint64_t v, hi;
    if (!q3) {
        memcpy(&v, g + 32 + 8 * s, 8);
        return _mm_cvtsi64_si128((long long)(v & 0x0F0F0F0F0F0F0F0FULL));
    }
    memcpy(&v, g + 16 + 8 * (s % 8), 8);
    memcpy(&hi, g + 80 + 8 * (s % 4), 8);
    v = (v >> 4 * (s / 8) & 0x0F0F0F0F0F0F0F0FULL) | (hi >> 2 * (s / 4) & 0x0303030303030303ULL) << 4;
    return _mm_sub_epi8(_mm_cvtsi64_si128((long long)v), _mm_set1_epi8(32));
}

INLINE __m128i lowk_mins(const uint8_t *g, int s) {
    uint64_t v;
    memcpy(&v, g + 32 + 8 * s, 8);
    return _mm_cvtsi64_si128((long long)(v >> 4 & 0x0F0F0F0F0F0F0F0FULL));
}

/* Q2_K_X8 (Q3 0) and Q3_K_X8 (Q3 1): R rows (1..4) of a column group. Unit j = 4h + t is bits 2t of the code runs
 * (h, g) (positions 128h + 32t + 4g ..; Q3_K's third bit is bit 4h + t of high-bit run g): its sub-block 2j from
 * runs g < 4, 2j + 1 from g >= 4, each summed in int16 lanes (a lane's 8 products of codes < 8 and int8 activations
 * stay within 8 * 7 * 128 < 2^15) and scaled by one vpmaddwd. */
#define X8LOW_ROWS(NAME, R, Q3, BC, SUFFIX)                                                                            \
    static void NAME##_##R##SUFFIX(X8_TILE_ARGS) {                                                                     \
        (void)C;                                                                                                       \
        const int64_t bytes = Q3 ? Q3X8_BYTES : Q2X8_BYTES;                                                          \
        const int codes = Q3 ? 368 : 160;                                                                            \
        const __m256i m3 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);                                            \
        __m256 out[R], s[R], m[R];                                                                                   \
        for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * bytes;                                                                        \
            for (int p = 0; p < bytes; p += 64) _mm_prefetch((const char *)(g + X8_PF * bytes + p), X8_HINT);       \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                                                     \
            _Pragma("GCC unroll 4") for (int t = 0; t < 4; t++) {                                                   \
                const int j = 4 * h + t;                                                                             \
                __m256i a[2][R];                                                                                     \
                for (int r = 0; r < R; r++) a[0][r] = a[1][r] = _mm256_setzero_si256();                              \
                _Pragma("GCC unroll 8") for (int gg = 0; gg < 8; gg++) {                                            \
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(g + codes + 32 * (8 * h + gg)));          \
                    __m256i u = _mm256_and_si256(t ? _mm256_srli_epi16(w, 2 * t) : w, m3);                           \
                    if (Q3) {                                                                                        \
                        const __m256i hm = _mm256_loadu_si256((const __m256i *)(g + 112 + 32 * gg));                 \
                        const int bit = 4 * h + t;                                                                   \
                        const __m256i at = bit >= 2 ? _mm256_srli_epi16(hm, bit - 2) : _mm256_slli_epi16(hm, 2 - bit); \
                        u = _mm256_or_si256(u, _mm256_and_si256(at, b2));                                            \
                    }                                                                                                \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const __m256i xv = X8_XV(BC, r, 256 * b + 128 * h + 32 * t + 4 * gg);                        \
                        a[gg / 4][r] = x8_chain(_mm256_add_epi16(a[gg / 4][r], _mm256_maddubs_epi16(u, xv)));        \
                    }                                                                                                \
                }                                                                                                    \
                const __m128i sc0 = lowk_scales(g, 2 * j, Q3), sc1 = lowk_scales(g, 2 * j + 1, Q3);                  \
                const __m128i mn0 = Q3 ? sc0 : lowk_mins(g, 2 * j), mn1 = Q3 ? sc1 : lowk_mins(g, 2 * j + 1);        \
                const __m256i p0 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc0, sc0));                                \
                const __m256i p1 = _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(sc1, sc1));                                \
                const __m256 mv0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mn0));                                    \
                const __m256 mv1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(mn1));                                    \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                               \
                    const __m256 tt = _mm256_cvtepi32_ps(                                                            \
                        _mm256_add_epi32(_mm256_madd_epi16(a[0][r], p0), _mm256_madd_epi16(a[1][r], p1)));            \
                    const __m256 dv = _mm256_set1_ps(xd[r * nbx + 8 * b + j]);                                       \
                    const __m256 s0 = _mm256_set1_ps(S[r * lds + 16 * b + 2 * j]);                                   \
                    const __m256 s1 = _mm256_set1_ps(S[r * lds + 16 * b + 2 * j + 1]);                               \
                    s[r] = j ? _mm256_fmadd_ps(tt, dv, s[r]) : _mm256_mul_ps(tt, dv);                                \
                    m[r] = _mm256_fmadd_ps(mv1, s1, j ? _mm256_fmadd_ps(mv0, s0, m[r]) : _mm256_mul_ps(mv0, s0));    \
                }                                                                                                    \
            }                                                                                                        \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));                                   \
            const __m256 dm = Q3 ? _mm256_mul_ps(d, _mm256_set1_ps(-4.0f))                                           \
                                 : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));                      \
            for (int r = 0; r < R; r++) {                                                                            \
                out[r] = _mm256_fmadd_ps(s[r], d, out[r]);                                                           \
                out[r] = Q3 ? _mm256_fmadd_ps(m[r], dm, out[r]) : _mm256_fnmadd_ps(m[r], dm, out[r]);                \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, out[r]);                                           \
    }
X8LOW_ROWS(q2x8_rows, 1, 0, 0, )
X8LOW_ROWS(q2x8_rows, 1, 0, 1, b)
X8LOW_ROWS(q2x8_rows, 2, 0, 0, )
X8LOW_ROWS(q2x8_rows, 3, 0, 0, )
X8LOW_ROWS(q2x8_rows, 4, 0, 0, )
X8LOW_ROWS(q3x8_rows, 1, 1, 0, )
X8LOW_ROWS(q3x8_rows, 1, 1, 1, b)
X8LOW_ROWS(q3x8_rows, 2, 1, 0, )
X8LOW_ROWS(q3x8_rows, 3, 1, 0, )
X8LOW_ROWS(q3x8_rows, 4, 1, 0, )

/* IQ4_XS's signed codes in a dot product: with VNNI the table + 128 (unsigned) and the row's C added after (IQ_C);
 * else |w| against x with w's sign (maddubs on (w + 128) x would saturate its int16 pairs). The same integers. */
#if GQ_OFFSET_ROWS /* VNNI (cpu_tiles.h defines DOT_U8S8_ACC either way) */
#define IQ_LUT(codes) iq4_lookup_128(codes)
#define IQ_DOT(acc, w, x) DOT_U8S8_ACC(acc, w, x)
#define IQ_C 1
#else
#define IQ_LUT(codes) iq4_lookup(codes)
#define IQ_DOT(acc, w, x) \
    _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)), \
                                            _mm256_set1_epi16(1)))
#define IQ_C 0
#endif

/* IQ4_XS_X8's 64 scales minus 32 as int8 sc [8j + c] */
INLINE void iqx8_scales(const uint8_t *g, int8_t *sc) {
    const __m256i l = _mm256_loadu_si256((const __m256i *)(g + 16)), m4 = _mm256_set1_epi8(0x0F);
    const __m256i shifts = _mm256_setr_epi64x(0, 2, 4, 6), m3 = _mm256_set1_epi8(3), m32 = _mm256_set1_epi8(32);
    int64_t h0, h1;
    memcpy(&h0, g + 48, 8);
    memcpy(&h1, g + 56, 8);
    const __m256i a = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(h0), shifts), m3);
    const __m256i b = _mm256_and_si256(_mm256_srlv_epi64(_mm256_set1_epi64x(h1), shifts), m3);
    _mm256_storeu_si256((__m256i *)sc, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l, m4),
                                                                       _mm256_slli_epi16(a, 4)), m32));
    _mm256_storeu_si256((__m256i *)(sc + 32),
                        _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l, 4), m4),
                                                        _mm256_slli_epi16(b, 4)), m32));
}

/* IQ4_XS_X8: R rows of a column group, P units' sums live per row at a time (P = 8 for one row: 8 independent
 * chains; 2 for more rows, whose sums are chains of their own) */
#define IQX8_ROWS(R, P, BC, SUFFIX)                                                                                    \
    static void iqx8_rows_##R##SUFFIX(X8_TILE_ARGS) {                                                                  \
        (void)S, (void)lds;                                                                                            \
        const __m256i m4 = _mm256_set1_epi8(0x0F);                                                                   \
        __m256 out[R], sa[R];                                                                                        \
        for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * IQX8_BYTES;                                                                   \
            for (int p = 0; p < IQX8_BYTES; p += 64)                                                                 \
                _mm_prefetch((const char *)(g + X8_PF * IQX8_BYTES + p), X8_HINT);                              \
            int8_t sc[64];                                                                                           \
            iqx8_scales(g, sc);                                                                                      \
            _Pragma("GCC unroll 8") for (int j0 = 0; j0 < 8; j0 += (P)) {                                           \
                __m256i a[P][R];                                                                                     \
                for (int u = 0; u < (P); u++)                                                                        \
                    for (int r = 0; r < R; r++) a[u][r] = _mm256_setzero_si256();                                    \
                _Pragma("GCC unroll 4") for (int gg = 0; gg < 4; gg++)                                              \
                _Pragma("GCC unroll 8") for (int u = 0; u < (P); u++) {                                             \
                    const int j = j0 + u;                                                                            \
                    const __m256i w = _mm256_loadu_si256((const __m256i *)(g + 64 + 32 * (4 * j + gg)));            \
                    const __m256i lo = IQ_LUT(_mm256_and_si256(w, m4));                                              \
                    const __m256i hi = IQ_LUT(_mm256_and_si256(_mm256_srli_epi16(w, 4), m4));                        \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const int64_t at = 256 * b + 32 * j + 4 * gg;                                                \
                        a[u][r] = IQ_DOT(IQ_DOT(a[u][r], lo, X8_XV(BC, r, at)), hi, X8_XV(BC, r, at + 16));          \
                    }                                                                                                \
                }                                                                                                    \
                _Pragma("GCC unroll 8") for (int u = 0; u < (P); u++) {                                             \
                    const int j = j0 + u;                                                                            \
                    const __m256i scj = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(sc + 8 * j)));       \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const int32_t *c = C + r * (k / 4) + 64 * b + 8 * j;                                         \
                        const int32_t corr = IQ_C ? c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7] : 0;      \
                        const __m256i dot = _mm256_add_epi32(a[u][r], _mm256_set1_epi32(corr));                      \
                        const __m256 t = _mm256_cvtepi32_ps(_mm256_mullo_epi32(dot, scj));                           \
                        const __m256 dv = _mm256_set1_ps(xd[r * nbx + 8 * b + j]);                                   \
                        sa[r] = j ? _mm256_fmadd_ps(t, dv, sa[r]) : _mm256_mul_ps(t, dv);                            \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));                                   \
            for (int r = 0; r < R; r++) out[r] = _mm256_fmadd_ps(sa[r], d, out[r]);                                  \
        }                                                                                                            \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, out[r]);                                           \
    }
IQX8_ROWS(1, 8, 0, )
IQX8_ROWS(1, 8, 1, b)
IQX8_ROWS(2, 2, 0, )
IQX8_ROWS(3, 2, 0, )
IQX8_ROWS(4, 2, 0, )

/* The blocks of 32 (B32 kinds): R rows of a column group, a block at a time. Q4_0's and Q4_1's 8 maddubs per row are
 * summed in int16 lanes (8 * 2 * 15 * 127 < 2^15), Q5_0's and Q5_1's (codes to 31) in two, 4 each, widened by
 * vpmaddwd; IQ4_NL's signed table values as IQ4_XS_X8's (IQ_DOT). Q4_0 and Q5_0 offset the block by -8 or -16 times
 * its activation sum, IQ4_NL with VNNI its table's +128 (the row data's C: -128 times the sums of 4); Q4_1 and Q5_1
 * add the minimum times the block's sum of dequantized activations (the row data's sums of 32). */
#define X8B_ROWS(NAME, R, KIND, BC, SUFFIX)                                                                            \
    static void NAME##_##R##SUFFIX(X8_TILE_ARGS) {                                                                     \
        (void)S, (void)lds, (void)C;                                                                                   \
        const int64_t bytes = B32[KIND].bytes, pf = B32[KIND].pf;                                                    \
        const int q5 = B32[KIND].qh > 0, iq = KIND == B32_IQ4_NL;                                                    \
        const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1), zero = _mm256_setzero_si256();       \
        __m256 out[R];                                                                                               \
        for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * bytes;                                                                        \
            for (int p = 0; p < bytes; p += 64) _mm_prefetch((const char *)(g + pf * bytes + p), X8_HINT);           \
            __m256i a[2][R]; /* int16 sums: the low and high nibbles' (one for both but in Q5_*); IQ4_NL int32 */    \
            for (int r = 0; r < R; r++) a[0][r] = a[1][r] = zero;                                                    \
            const __m256i v = q5 ? _mm256_loadu_si256((const __m256i *)(g + B32[KIND].qh)) : zero;                    \
            _Pragma("GCC unroll 4") for (int gg = 0; gg < 4; gg++) {                                                \
                const __m256i w = _mm256_loadu_si256((const __m256i *)(g + B32[KIND].codes + 32 * gg));              \
                __m256i lo = _mm256_and_si256(w, m4), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), m4);            \
                if (q5) lo = _mm256_or_si256(lo, q5_bit4(v, gg)), hi = _mm256_or_si256(hi, q5_bit4(v, 4 + gg));      \
                if (iq) lo = IQ_LUT(lo), hi = IQ_LUT(hi);                                                            \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                               \
                    const __m256i xl = X8_XV(BC, r, 32 * b + 4 * gg), xh = X8_XV(BC, r, 32 * b + 16 + 4 * gg);       \
                    if (iq) {                                                                                        \
                        a[0][r] = IQ_DOT(IQ_DOT(a[0][r], lo, xl), hi, xh);                                           \
                    } else {                                                                                         \
                        a[0][r] = _mm256_add_epi16(a[0][r], _mm256_maddubs_epi16(lo, xl));                           \
                        a[q5][r] = _mm256_add_epi16(a[q5][r], _mm256_maddubs_epi16(hi, xh));                         \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));                                   \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                   \
                __m256i I = iq ? a[0][r] : _mm256_madd_epi16(a[0][r], ones);                                         \
                if (q5) I = _mm256_add_epi32(I, _mm256_madd_epi16(a[1][r], ones));                                  \
                if (B32[KIND].offset || (iq && IQ_C)) {                                                              \
                    const int32_t *c = C + r * (k / 4) + 8 * b;                                                      \
                    const int32_t sum = c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7];                       \
                    I = _mm256_add_epi32(I, _mm256_set1_epi32(iq ? sum : sum / B32[KIND].offset));                   \
                }                                                                                                    \
                out[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(I), _mm256_mul_ps(d, _mm256_set1_ps(xd[r * nbx + b])),   \
                                         out[r]);                                                                    \
                if (B32[KIND].mins)                                                                                  \
                    out[r] = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16))),            \
                                             _mm256_set1_ps(S[r * lds + gq_sums32_at(k) + b]), out[r]);              \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, out[r]);                                           \
    }
#define X8B_TILES(NAME, KIND)                                                                                          \
    X8B_ROWS(NAME, 1, KIND, 0, )                                                                                       \
    X8B_ROWS(NAME, 1, KIND, 1, b) X8B_ROWS(NAME, 2, KIND, 0, ) X8B_ROWS(NAME, 3, KIND, 0, ) X8B_ROWS(NAME, 4, KIND, 0, )
X8B_TILES(q40x8_rows, B32_Q4_0)
X8B_TILES(q41x8_rows, B32_Q4_1)
X8B_TILES(q50x8_rows, B32_Q5_0)
X8B_TILES(q51x8_rows, B32_Q5_1)
X8B_TILES(nlx8_rows, B32_IQ4_NL)
#else
/* IQ4_XS_X8, one row (the vector build's iqx8_rows_R arguments) */
static void iqx8_rows_1(X8_TILE_ARGS) {
    const int8_t *kv = IQ4_CODES;
    (void)k, (void)nbx, (void)ldy, (void)S, (void)lds, (void)C;
    float out[8] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * IQX8_BYTES;
        const int8_t *xb = xq + 256 * b;
        for (int c = 0; c < 8; c++) {
            float sa = 0.0f;
            for (int j = 0; j < 8; j++) {
                int32_t dot = 0;
                for (int gg = 0; gg < 4; gg++)
                    for (int i = 0; i < 4; i++) {
                        const uint8_t v = g[64 + 32 * (4 * j + gg) + 4 * c + i];
                        dot += kv[v & 15] * xb[32 * j + 4 * gg + i] + kv[v >> 4] * xb[32 * j + 16 + 4 * gg + i];
                    }
                const int lo = j < 4 ? g[16 + 8 * j + c] & 15 : g[16 + 8 * (j - 4) + c] >> 4;
                const int hi = g[48 + 8 * (j / 4) + c] >> 2 * (j % 4) & 3;
                const float t = (float)(dot * ((lo | hi << 4) - 32));
                sa = j ? fmaf(t, xd[8 * b + j], sa) : t * xd[8 * b + j];
            }
            out[c] = fmaf(sa, gguf_f16(g + 2 * c), out[c]);
        }
    }
    memcpy(y, out, sizeof out);
}

/* Q6_K_X8, one row (R = 1: the arguments of the vector build's q6x8_rows_R) */
static void q6x8_rows_1(X8_TILE_ARGS) {
    (void)k, (void)nbx, (void)lds, (void)ldy, (void)C;
    float out[8] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * Q6X8_BYTES;
        const int8_t *xb = xq + 256 * b;
        for (int c = 0; c < 8; c++) {
            float sa = 0.0f, ma = 0.0f;
            for (int h = 0; h < 2; h++)
                for (int e = 0; e < 2; e++)
                    for (int u = 0; u < 4; u++) {
                        int32_t dot = 0;
                        for (int gg = 0; gg < 4; gg++)
                            for (int i = 0; i < 4; i++) {
                                const int gi = 4 * e + gg;
                                dot += q6x8_code(g, 256 * h + 32 * gi + 4 * c + i, u) *
                                       xb[128 * h + 32 * u + 4 * gi + i];
                            }
                        const int s = 8 * h + 2 * u + e, sc = (int8_t)g[16 + 8 * s + c];
                        const float t = (float)(dot * sc), dv = xd[8 * b + s / 2], sv = S[16 * b + s];
                        const int first = h == 0 && e == 0 && u == 0;
                        sa = first ? t * dv : fmaf(t, dv, sa);
                        ma = first ? (float)sc * sv : fmaf((float)sc, sv, ma);
                    }
            const float d = gguf_f16(g + 2 * c);
            out[c] = fmaf(sa, d, out[c]);
            out[c] = fmaf(ma, d * -32.0f, out[c]);
        }
    }
    memcpy(y, out, sizeof out);
}

/* a blocks-of-32 kind, one row: each block's exact integer dot product (IQ4_NL's from its signed values; the others'
 * from their codes, plus the offset) */
static void x8b_row(X8_TILE_ARGS, const int kind) {
    (void)nbx, (void)lds, (void)ldy;
    const int64_t bytes = B32[kind].bytes;
    float out[8] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * bytes, *codes = g + B32[kind].codes;
        const int8_t *xb = xq + 32 * b;
        const int32_t *c = C + 8 * b;
        const int32_t corr =
            B32[kind].offset ? (c[0] + c[1] + c[2] + c[3] + c[4] + c[5] + c[6] + c[7]) / B32[kind].offset : 0;
        for (int col = 0; col < 8; col++) {
            const uint32_t qh = B32[kind].qh ? gguf_u32(g + B32[kind].qh + 4 * col) : 0; /* x8_q5_bits' order */
            int32_t dot = 0;
            for (int gg = 0; gg < 4; gg++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t v = codes[32 * gg + 4 * col + i];
                    int lo = (v & 15) | (qh >> (8 * i + gg) & 1) << 4;
                    int hi = (v >> 4) | (qh >> (8 * i + 4 + gg) & 1) << 4;
                    if (kind == B32_IQ4_NL) lo = IQ4_CODES[lo], hi = IQ4_CODES[hi];
                    dot += lo * xb[4 * gg + i] + hi * xb[16 + 4 * gg + i];
                }
            out[col] = fmaf((float)(dot + corr), gguf_f16(g + 2 * col) * xd[b], out[col]);
            if (B32[kind].mins) out[col] = fmaf(gguf_f16(g + 16 + 2 * col), S[gq_sums32_at(k) + b], out[col]);
        }
    }
    memcpy(y, out, sizeof out);
}
static void q40x8_rows_1(X8_TILE_ARGS) { x8b_row(q, nb, xq, k, xd, nbx, S, lds, C, y, ldy, B32_Q4_0); }
static void q41x8_rows_1(X8_TILE_ARGS) { x8b_row(q, nb, xq, k, xd, nbx, S, lds, C, y, ldy, B32_Q4_1); }
static void q50x8_rows_1(X8_TILE_ARGS) { x8b_row(q, nb, xq, k, xd, nbx, S, lds, C, y, ldy, B32_Q5_0); }
static void q51x8_rows_1(X8_TILE_ARGS) { x8b_row(q, nb, xq, k, xd, nbx, S, lds, C, y, ldy, B32_Q5_1); }
static void nlx8_rows_1(X8_TILE_ARGS) { x8b_row(q, nb, xq, k, xd, nbx, S, lds, C, y, ldy, B32_IQ4_NL); }

/* Q8_0_X8, one row */
static void q80x8_rows_1(X8_TILE_ARGS) {
    (void)k, (void)S, (void)lds, (void)nbx, (void)ldy, (void)C;
    float acc[2][8] = {{0}};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * Q80X8_BYTES;
        for (int col = 0; col < 8; col++) {
            int32_t dot = 0;
            for (int i = 0; i < 32; i++) dot += (int8_t)g[16 + 32 * (i / 4) + 4 * col + i % 4] * xq[32 * b + i];
            acc[b & 1][col] = fmaf((float)dot, gguf_f16(g + 2 * col) * xd[b], acc[b & 1][col]);
        }
    }
    for (int col = 0; col < 8; col++) y[col] = acc[0][col] + acc[1][col];
}

/* one row of a Q2_K (q3 0) or Q3_K (q3 1) column group */
static void x8low_row(const uint8_t *q, int64_t nb, const int8_t *xq, const float *xd, const float *S, float *y,
                      int q3) {
    const int codes = q3 ? 368 : 160;
    float out[8] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * (q3 ? Q3X8_BYTES : Q2X8_BYTES);
        const int8_t *xb = xq + 256 * b;
        for (int c = 0; c < 8; c++) {
            float s = 0.0f, m = 0.0f;
            for (int j = 0; j < 8; j++) {
                const int h = j / 4, t = j % 4;
                int32_t dot[2] = {0, 0}, sc[2], mn[2];
                for (int gg = 0; gg < 8; gg++)
                    for (int i = 0; i < 4; i++) {
                        int u = g[codes + 32 * (8 * h + gg) + 4 * c + i] >> 2 * t & 3;
                        if (q3) u |= (g[112 + 32 * gg + 4 * c + i] >> j & 1) << 2;
                        dot[gg / 4] += u * xb[128 * h + 32 * t + 4 * gg + i];
                    }
                for (int e = 0; e < 2; e++) {
                    const int sub = 2 * j + e;
                    if (q3) {
                        const int lo = g[16 + 8 * (sub % 8) + c] >> 4 * (sub / 8) & 15;
                        sc[e] = mn[e] = (lo | (g[80 + 8 * (sub % 4) + c] >> 2 * (sub / 4) & 3) << 4) - 32;
                    } else {
                        sc[e] = g[32 + 8 * sub + c] & 15, mn[e] = g[32 + 8 * sub + c] >> 4;
                    }
                }
                const float tt = (float)(dot[0] * sc[0] + dot[1] * sc[1]);
                const float s0 = S[16 * b + 2 * j], s1 = S[16 * b + 2 * j + 1];
                s = j ? fmaf(tt, xd[8 * b + j], s) : tt * xd[8 * b + j];
                m = fmaf((float)mn[1], s1, j ? fmaf((float)mn[0], s0, m) : (float)mn[0] * s0);
            }
            const float d = gguf_f16(g + 2 * c);
            out[c] = fmaf(s, d, out[c]);
            out[c] = q3 ? fmaf(m, d * -4.0f, out[c]) : fmaf(-m, gguf_f16(g + 16 + 2 * c), out[c]);
        }
    }
    memcpy(y, out, sizeof out);
}

static void q2x8_rows_1(X8_TILE_ARGS) {
    (void)k, (void)nbx, (void)lds, (void)C, (void)ldy;
    x8low_row(q, nb, xq, xd, S, y, 0);
}

static void q3x8_rows_1(X8_TILE_ARGS) {
    (void)k, (void)nbx, (void)lds, (void)C, (void)ldy;
    x8low_row(q, nb, xq, xd, S, y, 1);
}

/* one row of a Q4_K (qh 0) or Q5_K (qh 1) column group */
static void x8k_row(const uint8_t *q, int64_t nb, const int8_t *xq, const float *xd, const float *S32, float *y,
                    int qh) {
    float out[8] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * (qh ? Q5X8_BYTES : X8_BYTES);
        const int8_t *xb = xq + 256 * b;
        uint8_t sc[64], mn[64];
        x8_scales(g, sc, mn);
        for (int c = 0; c < 8; c++) {
            int32_t dot[8] = {0};
            for (int u = 0; u < 4; u++)
                for (int k = 0; k < 8; k++)
                    for (int e = 0; e < 4; e++) {
                        const uint8_t v = g[128 + 32 * (8 * u + k) + 4 * c + e];
                        const uint8_t h = qh ? g[X8_BYTES + 32 * k + 4 * c + e] : 0;
                        dot[2 * u] += ((v & 15) | (h >> 2 * u & 1) << 4) * xb[64 * u + 4 * k + e];
                        dot[2 * u + 1] += ((v >> 4) | (h >> (2 * u + 1) & 1) << 4) * xb[64 * u + 32 + 4 * k + e];
                    }
            float s = 0.0f, m = 0.0f;
            for (int j = 0; j < 8; j++) {
                const float t = (float)(dot[j] * sc[8 * j + c]), mv = (float)mn[8 * j + c];
                s = j ? fmaf(t, xd[8 * b + j], s) : t * xd[8 * b + j];
                m = j ? fmaf(mv, S32[8 * b + j], m) : mv * S32[8 * b + j];
            }
            out[c] = fmaf(s, gguf_f16(g + 2 * c), out[c]);
            out[c] = fmaf(-m, gguf_f16(g + 16 + 2 * c), out[c]);
        }
    }
    memcpy(y, out, sizeof out);
}

static void x8_row(const uint8_t *q, int64_t nb, const int8_t *xq, const float *xd, const float *S32, float *y,
                   int bc) {
    (void)bc; /* the portable build has no broadcast rows */
    x8k_row(q, nb, xq, xd, S32, y, 0);
}

static void q5x8_rows_1(X8_TILE_ARGS) {
    (void)k, (void)lds, (void)C, (void)ldy;
    x8k_row(q, nb, xq, xd, S + 2 * nbx, y, 1);
}
#endif

/* Q4_K_X8's one-row tiles, in every tile's arguments */
static void x8_rows_1(X8_TILE_ARGS) {
    (void)k, (void)lds, (void)C, (void)ldy;
    x8_row(q, nb, xq, xd, S + 2 * nbx, y, 0);
}

/* Each type's bytes per row and super-block, its tiles of 1..X8_MAX_ROWS rows and (vector builds) its one-row tile
 * on a broadcast row */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
static void x8_rows_1b(X8_TILE_ARGS) {
    (void)k, (void)lds, (void)C, (void)ldy;
    x8_row(q, nb, xq, xd, S + 2 * nbx, y, 1);
}
#define X8_MAX_ROWS 4
#define X8_TILES(f) {f##_1, f##_2, f##_3, f##_4}
#define X8_ROW_TILES(f) X8_TILES(f), f##_1b, {NULL}
#else
#define X8_MAX_ROWS 1
#define X8_TILES(f) {f##_1}
#define X8_ROW_TILES(f) X8_TILES(f), NULL, {NULL}
#endif
/* X8_ROW_TILES with the two-group tiles p##_2 .. p##_4 where built */
#if X16_PAIRS
#define X8_PAIR_TILES(f, p) X8_TILES(f), f##_1b, {NULL, p##_2, p##_3, p##_4}
#else
#define X8_PAIR_TILES(f, p) X8_ROW_TILES(f)
#endif
/* the two-group tiles from 8 rows on: below, the tiles stream at memory speed, and two streams at once read slower
 * (Q6_K at 2-4 rows: 10-15 % on Zen 5) */
#define X16_MIN_ROWS 8
/* Q8_0 streams at memory speed from one row on: there the broadcast copy only adds cache traffic (8 % slower) */
static const struct {
    int type;
    int64_t bytes;
    x8_tile tiles[X8_MAX_ROWS];
    x8_tile broadcast_row;
    x8_tile pairs[X8_MAX_ROWS]; /* where given: 2..X8_MAX_ROWS rows of two column groups (16 lanes) */
} X8_TYPES[] = {{LLMD_Q40_X8, 18, X8_ROW_TILES(q40x8_rows)},
                {LLMD_Q41_X8, 20, X8_ROW_TILES(q41x8_rows)},
                {LLMD_Q50_X8, 22, X8_ROW_TILES(q50x8_rows)},
                {LLMD_Q51_X8, 24, X8_ROW_TILES(q51x8_rows)},
                {LLMD_IQ4NL_X8, 18, X8_ROW_TILES(nlx8_rows)},
#if X16_PAIRS
                {LLMD_Q80_X8, 34, X8_TILES(q80x8_rows), NULL, {NULL, q80x16_rows_2, q80x16_rows_3, q80x16_rows_4}},
#else
                {LLMD_Q80_X8, 34, X8_TILES(q80x8_rows), NULL, {NULL}},
#endif
                {LLMD_Q2K_X8, 84, X8_ROW_TILES(q2x8_rows)},
                {LLMD_Q3K_X8, 110, X8_ROW_TILES(q3x8_rows)},
                {LLMD_Q4K_X8, 144, X8_PAIR_TILES(x8_rows, x16_rows)},
                {LLMD_Q5K_X8, 176, X8_PAIR_TILES(q5x8_rows, q5x16_rows)},
                {LLMD_Q6K_X8, 210, X8_PAIR_TILES(q6x8_rows, q6x16_rows)},
                {LLMD_IQ4XS_X8, 136, X8_ROW_TILES(iqx8_rows)}};

/* X8_TYPES' entry of `type`, or -1 */
static int x8_entry(int type) {
    for (int t = 0; t < (int)(sizeof X8_TYPES / sizeof X8_TYPES[0]); t++)
        if (X8_TYPES[t].type == type) return t;
    return -1;
}

/* Columns [n0, n1) (multiples of 8) of y [m, ldy] from the integer path's rows (xd [K/32], S [gq_sums(K)], xq [K] and
 * C [K/4] per row) and an interleaved weight q of `type`: per group of 8 columns (two groups at once from X16_MIN_ROWS
 * rows where the type has such tiles), the rows in tiles of up to 4, in chunks of rows whose activations stay in L2;
 * one row from its broadcast copy xb where given (gq_broadcast_row). */
void llmd_x8_cols(int type, const float *xd, const float *S, const int8_t *xq, const int32_t *C, const int8_t *xb,
                  const uint8_t *q, float *y, int64_t ldy, int64_t m, int64_t k, int64_t n0, int64_t n1) {
    const int t = x8_entry(type); /* llmd_gx_takes admits only these types */
    const int64_t nb = k / LLMD_X8_ELEMS(type), nbx = k / QB, lds = gq_sums(k), rb = nb * X8_TYPES[t].bytes;
    if (m == 1 && xb && X8_TYPES[t].broadcast_row) {
        for (int64_t c0 = n0; c0 < n1; c0 += 8)
            X8_TYPES[t].broadcast_row(q + c0 * rb, nb, xb, k, xd, nbx, S, lds, C, y + c0, ldy);
        return;
    }
    const int64_t chunk = (256 * 1024) / k < 1 ? 1 : (256 * 1024) / k;
    const int pairs = m >= X16_MIN_ROWS && X8_TYPES[t].pairs[X8_MAX_ROWS - 1];
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
        for (int64_t c0 = n0; c0 < n1;) {
            const int64_t groups = pairs && c0 + 16 <= n1 ? 2 : 1;
            for (int64_t r = m0; r < m1;) {
                const int rr = m1 - r >= X8_MAX_ROWS ? X8_MAX_ROWS : (int)(m1 - r);
                const x8_tile pair = groups == 2 ? X8_TYPES[t].pairs[rr - 1] : NULL;
                for (int64_t c = c0; c < c0 + 8 * groups; c += pair ? 16 : 8)
                    (pair ? pair : X8_TYPES[t].tiles[rr - 1])(q + c * rb, nb, xq + r * k, k, xd + r * nbx, nbx,
                                                              S + r * lds, lds, C + r * (k / 4), y + r * ldy + c, ldy);
                r += rr;
            }
            c0 += 8 * groups;
        }
    }
}

/* ==== Q6_K_X8, Q4_1_X8 and Q8_0_X8 on the int16 path (output heads, Q4_1 layers; cpu_head.c) =====================
 *
 * An output head's Q6_K table interleaved as above, against int16 activation codes q. The 6-bit codes u are widened
 * to int16 lanes (unpacked with zeros: a 256-bit vector of 4 codes of 8 columns becomes columns 0, 1, 4, 5 and 2, 3,
 * 6, 7, each as two pairs) and meet the codes q of their 4 positions in vpmaddwd (vpdpwssd with VNNI), so a
 * sub-block's integer dot product is
 *   I_s = sum(u q) - 32 Q_s   (Q_s: the row's sum of the sub-block's 16 codes; = sum((u - 32) q))
 * exactly (|sum(u q)| <= 16 * 63 * 32767 and |I_s sc_s| <= 16 * 32 * 32767 * 128 < 2^31), a column's pairs summed by
 * one vphaddd per sub-block. Per output (row r, column c), in this order whatever the rows, the columns' range or the
 * thread, the sub-blocks s = 8h + 2u + e taken for h, e, u:
 *   per super-block b: acc = float(I_s sc_s) xd_(s/2) for the first, then acc = fma(float(I_s sc_s), xd_(s/2), acc);
 *   out = fma(acc, d, out).
 * Q4_1_X8 (a Q4_1 layer, or head) the same way, its codes 0..15: per block b, I = sum(u q) (exact: |I| <= 32 * 15 *
 * 32767), out = fma(float(I), d xd_b, out); out = fma(m, xd_b float(Q_2b + Q_2b+1), out). Q8_0_X8 (a head): per
 * block b, I = sum(w q) (exact: |I| <= 32 * 128 * 32767), out = fma(float(I), d xd_b, out).
 * The portable build computes the same operations in plain C. */

/* a head tile's arguments: a column group's super-blocks q (nb), rows [0, R) of the head path's row data (row r: the
 * codes at x + r k, activation scales at xd + r nbx, sub-block sums at Q + r k / 16) */
#define X8H_TILE_ARGS                                                                                                  \
    const uint8_t *q, int64_t nb, const int16_t *x, int64_t k, const float *xd, int64_t nbx, const int32_t *Q,        \
        float *y, int64_t ldy
typedef void (*x8h_tile)(X8H_TILE_ARGS);

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* the 4 int16 codes of row r at element off in each 64-bit lane: broadcast, or (BC: one row's broadcast copy x, each 4
 * codes 4 times, gh_broadcast_row) loaded */
INLINE __m256i x8h_bcast(const int16_t *p) {
    int64_t v;
    memcpy(&v, p, 8);
    return _mm256_set1_epi64x(v);
}
#define X8H_XV(BC, r, off) \
    ((BC) ? _mm256_loadu_si256((const __m256i *)(x + 4 * (off))) : x8h_bcast(x + (r) * k + (off)))

#define Q6X8H_ROWS(R, BC, SUFFIX)                                                                                      \
    static void q6x8h_rows_##R##SUFFIX(X8H_TILE_ARGS) {                                                                \
        const __m256i zero = _mm256_setzero_si256();                                                                 \
        __m256 out[R], acc[R];                                                                                       \
        for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * Q6X8_BYTES;                                                                   \
            for (int p = 0; p < Q6X8_BYTES; p += 64)                                                                 \
                _mm_prefetch((const char *)(g + Q6X8_PF * Q6X8_BYTES + p), Q6X8_HINT);                                \
            _Pragma("GCC unroll 2") for (int h = 0; h < 2; h++)                                                     \
            _Pragma("GCC unroll 2") for (int e = 0; e < 2; e++)                                                     \
            _Pragma("GCC unroll 4") for (int u = 0; u < 4; u++) {                                                   \
                __m256i lo[R], hi[R]; /* columns 0, 1, 4, 5 and 2, 3, 6, 7: two int32 pairs each */                   \
                for (int r = 0; r < R; r++) lo[r] = hi[r] = zero;                                                    \
                _Pragma("GCC unroll 4") for (int gg = 0; gg < 4; gg++) {                                            \
                    const int gi = 4 * e + gg;                                                                       \
                    const __m256i c = q6x8_unit(g, h, gi, u);                                                        \
                    const __m256i c_lo = _mm256_unpacklo_epi8(c, zero), c_hi = _mm256_unpackhi_epi8(c, zero);        \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const __m256i xv = X8H_XV(BC, r, 256 * b + 128 * h + 32 * u + 4 * gi);                       \
                        lo[r] = DOT_S16_ACC(lo[r], c_lo, xv);                                                        \
                        hi[r] = DOT_S16_ACC(hi[r], c_hi, xv);                                                        \
                    }                                                                                                \
                }                                                                                                    \
                const int s = 8 * h + 2 * u + e, first = h == 0 && e == 0 && u == 0;                                 \
                const __m256i sc = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(g + 16 + 8 * s)));        \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                               \
                    const __m256i I = _mm256_sub_epi32(_mm256_hadd_epi32(lo[r], hi[r]),                              \
                                                       _mm256_set1_epi32(32 * Q[r * (k / 16) + 16 * b + s]));        \
                    const __m256 t = _mm256_cvtepi32_ps(_mm256_mullo_epi32(I, sc));                                  \
                    const __m256 dv = _mm256_set1_ps(xd[r * nbx + 8 * b + s / 2]);                                   \
                    acc[r] = first ? _mm256_mul_ps(t, dv) : _mm256_fmadd_ps(t, dv, acc[r]);                          \
                }                                                                                                    \
            }                                                                                                        \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));                                   \
            for (int r = 0; r < R; r++) out[r] = _mm256_fmadd_ps(acc[r], d, out[r]);                                 \
        }                                                                                                            \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, out[r]);                                           \
    }
/* a head tile macro's instances: 1 to 4 rows, and one row from its broadcast copy */
#define X8H_TILE_SET(ROWS) ROWS(1, 0, ) ROWS(1, 1, b) ROWS(2, 0, ) ROWS(3, 0, ) ROWS(4, 0, )
X8H_TILE_SET(Q6X8H_ROWS)

/* Q4_1_X8 (Q8 0) and Q8_0_X8 (Q8 1) on the int16 path: each 32 bytes of codes widened to int16 lanes as Q6_K_X8's
 * units (Q8_0's unpacked with their signs), Q4_1's then split into their low and high nibbles */
#define X8H32_ROWS(NAME, R, Q8, BC, SUFFIX)                                                                            \
    static void NAME##_##R##SUFFIX(X8H_TILE_ARGS) {                                                                    \
        const int64_t bytes = Q8 ? Q80X8_BYTES : Q41X8_BYTES, pf = Q8 ? Q80X8_PF : Q41X8_PF;                         \
        const __m256i zero = _mm256_setzero_si256(), m4 = _mm256_set1_epi16(0x0F);                                   \
        __m256 out[R];                                                                                               \
        for (int r = 0; r < R; r++) out[r] = _mm256_setzero_ps();                                                    \
        for (int64_t b = 0; b < nb; b++) {                                                                           \
            const uint8_t *g = q + b * bytes;                                                                        \
            for (int p = 0; p < bytes; p += 64) _mm_prefetch((const char *)(g + pf * bytes + p), X8_HINT);           \
            __m256i lo[R], hi[R]; /* columns 0, 1, 4, 5 and 2, 3, 6, 7: two int32 pairs each */                       \
            for (int r = 0; r < R; r++) lo[r] = hi[r] = zero;                                                        \
            _Pragma("GCC unroll 8") for (int gg = 0; gg < (Q8 ? 8 : 4); gg++) {                                     \
                const __m256i w = _mm256_loadu_si256((const __m256i *)(g + (Q8 ? 16 : 32) + 32 * gg));               \
                const __m256i fill = Q8 ? _mm256_cmpgt_epi8(zero, w) : zero;                                         \
                const __m256i w_lo = _mm256_unpacklo_epi8(w, fill), w_hi = _mm256_unpackhi_epi8(w, fill);            \
                _Pragma("GCC unroll 2") for (int half = 0; half < (Q8 ? 1 : 2); half++) { /* Q4_1: low, high */     \
                    const __m256i c_lo = Q8 ? w_lo : half ? _mm256_srli_epi16(w_lo, 4) : _mm256_and_si256(w_lo, m4); \
                    const __m256i c_hi = Q8 ? w_hi : half ? _mm256_srli_epi16(w_hi, 4) : _mm256_and_si256(w_hi, m4); \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                           \
                        const __m256i xv = X8H_XV(BC, r, 32 * b + 16 * half + 4 * gg);                               \
                        lo[r] = x8_chain(DOT_S16_ACC(lo[r], c_lo, xv));                                              \
                        hi[r] = x8_chain(DOT_S16_ACC(hi[r], c_hi, xv));                                              \
                    }                                                                                                \
                }                                                                                                    \
            }                                                                                                        \
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)g));                                   \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                   \
                const float xdb = xd[r * nbx + b];                                                                   \
                const __m256 t = _mm256_cvtepi32_ps(_mm256_hadd_epi32(lo[r], hi[r]));                                \
                out[r] = _mm256_fmadd_ps(t, _mm256_mul_ps(d, _mm256_set1_ps(xdb)), out[r]);                          \
                if (!Q8) {                                                                                           \
                    const int32_t *Qb = Q + r * (k / 16) + 2 * b;                                                    \
                    const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(g + 16)));                   \
                    out[r] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xdb * (float)(Qb[0] + Qb[1])), out[r]);              \
                }                                                                                                    \
            }                                                                                                        \
        }                                                                                                            \
        for (int r = 0; r < R; r++) _mm256_storeu_ps(y + r * ldy, out[r]);                                           \
    }
#define Q41X8H_ROWS(R, BC, SUFFIX) X8H32_ROWS(q41x8h_rows, R, 0, BC, SUFFIX)
#define Q80X8H_ROWS(R, BC, SUFFIX) X8H32_ROWS(q80x8h_rows, R, 1, BC, SUFFIX)
X8H_TILE_SET(Q41X8H_ROWS)
X8H_TILE_SET(Q80X8H_ROWS)
#define X8H_ROW_TILES(f) X8_TILES(f), f##_1b
#else
static void q6x8h_rows_1(X8H_TILE_ARGS) {
    (void)k, (void)nbx, (void)ldy;
    float out[8] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * Q6X8_BYTES;
        for (int c = 0; c < 8; c++) {
            float acc = 0.0f;
            for (int h = 0; h < 2; h++)
                for (int e = 0; e < 2; e++)
                    for (int u = 0; u < 4; u++) {
                        int32_t dot = 0;
                        for (int gg = 0; gg < 4; gg++)
                            for (int i = 0; i < 4; i++) {
                                const int gi = 4 * e + gg;
                                dot += q6x8_code(g, 256 * h + 32 * gi + 4 * c + i, u) *
                                       x[256 * b + 128 * h + 32 * u + 4 * gi + i];
                            }
                        const int s = 8 * h + 2 * u + e;
                        const int32_t I = dot - 32 * Q[16 * b + s];
                        const float t = (float)(I * (int8_t)g[16 + 8 * s + c]), dv = xd[8 * b + s / 2];
                        acc = h == 0 && e == 0 && u == 0 ? t * dv : fmaf(t, dv, acc);
                    }
            out[c] = fmaf(acc, gguf_f16(g + 2 * c), out[c]);
        }
    }
    memcpy(y, out, sizeof out);
}

/* Q4_1_X8 (q8 0) and Q8_0_X8 (q8 1) on the int16 path, one row */
static void x8h32_row(X8H_TILE_ARGS, const int q8) {
    (void)k, (void)nbx, (void)ldy;
    float out[8] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *g = q + b * (q8 ? Q80X8_BYTES : Q41X8_BYTES);
        const float xdb = xd[b], S = q8 ? 0.0f : xdb * (float)(Q[2 * b] + Q[2 * b + 1]);
        for (int c = 0; c < 8; c++) {
            int32_t dot = 0;
            for (int gg = 0; gg < (q8 ? 8 : 4); gg++)
                for (int i = 0; i < 4; i++) {
                    const uint8_t v = g[(q8 ? 16 : 32) + 32 * gg + 4 * c + i];
                    const int16_t *xb = x + 32 * b + 4 * gg + i;
                    dot += q8 ? (int8_t)v * xb[0] : (v & 15) * xb[0] + (v >> 4) * xb[16];
                }
            out[c] = fmaf((float)dot, gguf_f16(g + 2 * c) * xdb, out[c]);
            if (!q8) out[c] = fmaf(gguf_f16(g + 16 + 2 * c), S, out[c]);
        }
    }
    memcpy(y, out, sizeof out);
}
static void q41x8h_rows_1(X8H_TILE_ARGS) { x8h32_row(q, nb, x, k, xd, nbx, Q, y, ldy, 0); }
static void q80x8h_rows_1(X8H_TILE_ARGS) { x8h32_row(q, nb, x, k, xd, nbx, Q, y, ldy, 1); }
#define X8H_ROW_TILES(f) X8_TILES(f), NULL
#endif
/* the types the head path takes interleaved, with their file blocks' bytes and tiles */
static const struct {
    int type;
    int64_t bytes;
    x8h_tile tiles[X8_MAX_ROWS];
    x8h_tile broadcast_row;
} X8H_TYPES[] = {{LLMD_Q6K_X8, 210, X8H_ROW_TILES(q6x8h_rows)},
                 {LLMD_Q41_X8, 20, X8H_ROW_TILES(q41x8h_rows)},
                 {LLMD_Q80_X8, 34, X8H_ROW_TILES(q80x8h_rows)}};

/* Columns [n0, n1) (multiples of 8) of y [m, ldy] from the head path's rows (xd [K/32], Q [K/16], x [K] per row:
 * gh_quantize_row's and gh_sums_row's) and an interleaved weight q of `type` (X8H_TYPES), in chunks of rows whose
 * codes stay in L2; one row from its broadcast copy xb where given (gh_broadcast_row). */
void llmd_x8_cols_q16(int type, const float *xd, const int32_t *Q, const int16_t *x, const int16_t *xb,
                      const uint8_t *q, float *y, int64_t ldy, int64_t m, int64_t k, int64_t n0, int64_t n1) {
    int t = 0;
    while (X8H_TYPES[t].type != type) t++; /* llmd_gx_takes admits only these types */
    const int64_t nb = k / LLMD_X8_ELEMS(type), nbx = k / QB, rb = nb * X8H_TYPES[t].bytes;
    if (m == 1 && xb && X8H_TYPES[t].broadcast_row) {
        for (int64_t c0 = n0; c0 < n1; c0 += 8)
            X8H_TYPES[t].broadcast_row(q + c0 * rb, nb, xb, k, xd, nbx, Q, y + c0, ldy);
        return;
    }
    const int64_t chunk = (128 * 1024) / k < 1 ? 1 : (128 * 1024) / k;
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
        for (int64_t c0 = n0; c0 < n1; c0 += 8)
            for (int64_t r = m0; r < m1;) {
                const int rr = m1 - r >= X8_MAX_ROWS ? X8_MAX_ROWS : (int)(m1 - r);
                X8H_TYPES[t].tiles[rr - 1](q + c0 * rb, nb, x + r * k, k, xd + r * nbx, nbx, Q + r * (k / 16),
                                           y + r * ldy + c0, ldy);
                r += rr;
            }
    }
}

/* ==== Packing: the file's rows -> the interleaved layout, in place (gguf_blocks.x8_pack is the reference) ========= */

/* Q5_0's or Q5_1's 32 fifth bits (bit e: element e's) in the order its tiles read them: byte i's bit j is element
 * 4j + i's for j < 4 (the low nibbles of run j), 16 + 4 (j - 4) + i's after (the high ones): run g's bits are then
 * bits g and 4 + g of each byte, moved to bit 4 by one shift (q5_bit4) */
static uint32_t x8_q5_bits(uint32_t qh) {
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 8; j++) v |= (qh >> (j < 4 ? 4 * j + i : 16 + 4 * (j - 4) + i) & 1u) << (8 * i + j);
    return v;
}

/* one group of 8 rows' super-block b: src = the 8 rows (row stride rb), dst = its X8 block */
static void x8_pack_block(int type, const uint8_t *src, int64_t rb, uint8_t *dst) {
    if (type == LLMD_Q4K_X8 || type == LLMD_Q5K_X8) {
        const int codes = type == LLMD_Q5K_X8 ? 48 : 16; /* Q5_K's fifth bits sit between the scales and the codes */
        uint8_t sc[8][8], mn[8][8]; /* [column][sub-block] */
        for (int c = 0; c < 8; c++) {
            const uint8_t *s = src + c * rb;
            memcpy(dst + 2 * c, s, 2), memcpy(dst + 16 + 2 * c, s + 2, 2);
            for (int j = 0; j < 8; j++) {
                const uint8_t *b = s + 4;
                sc[c][j] = (uint8_t)(j < 4 ? b[j] & 63 : (b[j + 4] & 15) | (b[j - 4] >> 6) << 4);
                mn[c][j] = (uint8_t)(j < 4 ? b[j + 4] & 63 : (b[j + 4] >> 4) | (b[j] >> 6) << 4);
            }
            for (int r = 0; r < 32; r++) memcpy(dst + 128 + 32 * r + 4 * c, s + codes + 4 * r, 4); /* r = 8c' + g */
            if (type == LLMD_Q5K_X8)
                for (int r = 0; r < 8; r++) memcpy(dst + X8_BYTES + 32 * r + 4 * c, s + 16 + 4 * r, 4);
        }
        for (int j = 0; j < 4; j++)
            for (int c = 0; c < 8; c++) {
                dst[32 + 8 * j + c] = (uint8_t)((sc[c][j] & 15) | (sc[c][j + 4] & 15) << 4);
                dst[64 + 8 * j + c] = (uint8_t)((mn[c][j] & 15) | (mn[c][j + 4] & 15) << 4);
                dst[96 + 8 * j + c] = (uint8_t)(sc[c][j] >> 4 | (sc[c][j + 4] >> 4) << 2 | (mn[c][j] >> 4) << 4 |
                                                (mn[c][j + 4] >> 4) << 6);
            }
    } else if (LLMD_X8_ELEMS(type) == 32) { /* d (and m) as 8 fp16s, the fifth bits and codes in runs of 4 bytes */
        const int fp16s = type == LLMD_Q41_X8 || type == LLMD_Q51_X8 ? 2 : 1;
        const int runs = (type == LLMD_Q80_X8 ? 8 : 4) + (type == LLMD_Q50_X8 || type == LLMD_Q51_X8);
        for (int c = 0; c < 8; c++) {
            for (int f = 0; f < fp16s; f++) memcpy(dst + 16 * f + 2 * c, src + c * rb + 2 * f, 2);
            for (int r = 0; r < runs; r++)
                memcpy(dst + 16 * fp16s + 32 * r + 4 * c, src + c * rb + 2 * fp16s + 4 * r, 4);
            if (runs == 5) { /* Q5_0, Q5_1: the fifth bits in the tiles' order */
                uint8_t *qh = dst + 16 * fp16s + 4 * c;
                const uint32_t v = x8_q5_bits(gguf_u32(qh));
                for (int i = 0; i < 4; i++) qh[i] = (uint8_t)(v >> 8 * i);
            }
        }
    } else if (type == LLMD_Q2K_X8 || type == LLMD_Q3K_X8) {
        const int q3 = type == LLMD_Q3K_X8;
        for (int c = 0; c < 8; c++) {
            const uint8_t *s = src + c * rb;
            if (q3) {
                memcpy(dst + 2 * c, s + 108, 2);
                for (int i = 0; i < 12; i++) dst[16 + 8 * i + c] = s[96 + i];
                for (int r = 0; r < 8; r++) memcpy(dst + 112 + 32 * r + 4 * c, s + 4 * r, 4); /* hmask: g */
            } else {
                memcpy(dst + 2 * c, s + 80, 2), memcpy(dst + 16 + 2 * c, s + 82, 2);
                for (int i = 0; i < 16; i++) dst[32 + 8 * i + c] = s[i];
            }
            for (int r = 0; r < 16; r++) memcpy(dst + (q3 ? 368 : 160) + 32 * r + 4 * c, s + (q3 ? 32 : 16) + 4 * r, 4);
        }
    } else if (type == LLMD_Q6K_X8) {
        for (int c = 0; c < 8; c++) {
            const uint8_t *s = src + c * rb;
            memcpy(dst + 2 * c, s + 208, 2);
            for (int j = 0; j < 16; j++) dst[16 + 8 * j + c] = s[192 + j];
            for (int h = 0; h < 2; h++)
                for (int at = 0; at < 32; at++) { /* at = 4g + i */
                    const uint8_t A = s[64 * h + at], B = s[64 * h + 32 + at], H = s[128 + 32 * h + at];
                    const int o = 256 * h + 32 * (at / 4) + 4 * c + at % 4;
                    dst[144 + o] = (uint8_t)((A & 15) | (H & 3) << 4 | (H >> 4 & 3) << 6);
                    dst[656 + o] = (uint8_t)((B & 15) | (H >> 2 & 3) << 4 | (H >> 6) << 6);
                    dst[1168 + o] = (uint8_t)(A >> 4 | (B >> 4) << 4);
                }
        }
    } else { /* IQ4_XS */
        memset(dst + 16, 0, 48);
        for (int c = 0; c < 8; c++) {
            const uint8_t *s = src + c * rb;
            memcpy(dst + 2 * c, s, 2);
            const int high = s[2] | s[3] << 8;
            for (int j = 0; j < 8; j++) {
                const int low = s[4 + j / 2] >> 4 * (j % 2) & 15;
                dst[16 + 8 * (j % 4) + c] |= (uint8_t)(low << 4 * (j / 4));
                dst[48 + 8 * (j / 4) + c] |= (uint8_t)((high >> 2 * j & 3) << 2 * (j % 4));
            }
            for (int r = 0; r < 32; r++) memcpy(dst + 64 + 32 * r + 4 * c, s + 8 + 4 * r, 4);
        }
    }
}

/* rows [n, rb] of the file's type (n % 8 == 0) rearranged in place into `type`'s layout: 0, -1 for a type or shape
 * it does not take, -2 out of memory (one group's bytes of scratch) */
int llmd_x8_pack(int type, uint8_t *q, int64_t n, int64_t rb) {
    const int t = x8_entry(type);
    if (t < 0 || n % 8 || rb % X8_TYPES[t].bytes) return -1;
    const int64_t bytes = X8_TYPES[t].bytes, nb = rb / bytes;
    uint8_t *group = (uint8_t *)malloc((size_t)(8 * rb));
    if (!group) return -2;
    for (int64_t g0 = 0; g0 < n; g0 += 8) {
        uint8_t *at = q + g0 * rb;
        memcpy(group, at, (size_t)(8 * rb));
        for (int64_t b = 0; b < nb; b++) x8_pack_block(type, group + b * bytes, rb, at + b * 8 * bytes);
    }
    free(group);
    return 0;
}

/* x8_q5_bits' inverse: the file's qh word of a column's run */
static uint32_t x8_q5_file_bits(uint32_t v) {
    uint32_t qh = 0;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 8; j++) qh |= (v >> (8 * i + j) & 1u) << (j < 4 ? 4 * j + i : 16 + 4 * (j - 4) + i);
    return qh;
}

/* column c of a group's block g of a blocks-of-32 layout, or of Q6_K_X8, into the file's block d (x8_pack_block's
 * inverse) */
static void x8_unpack_column(int type, const uint8_t *g, int64_t c, uint8_t *d) {
    if (type == LLMD_Q6K_X8) {
        memcpy(d + 208, g + 2 * c, 2);
        for (int j = 0; j < 16; j++) d[192 + j] = g[16 + 8 * j + c];
        for (int h = 0; h < 2; h++)
            for (int at = 0; at < 32; at++) {
                const int64_t o = 256 * h + 32 * (at / 4) + 4 * c + at % 4;
                int u[4];
                for (int t = 0; t < 4; t++) u[t] = q6x8_code(g, o, t);
                d[64 * h + at] = (uint8_t)((u[0] & 15) | (u[2] & 15) << 4);
                d[64 * h + 32 + at] = (uint8_t)((u[1] & 15) | (u[3] & 15) << 4);
                d[128 + 32 * h + at] = (uint8_t)(u[0] >> 4 | (u[1] >> 4) << 2 | (u[2] >> 4) << 4 | (u[3] >> 4) << 6);
            }
        return;
    }
    const int fp16s = type == LLMD_Q41_X8 || type == LLMD_Q51_X8 ? 2 : 1;
    const int runs = (type == LLMD_Q80_X8 ? 8 : 4) + (type == LLMD_Q50_X8 || type == LLMD_Q51_X8);
    for (int f = 0; f < fp16s; f++) memcpy(d + 2 * f, g + 16 * f + 2 * c, 2);
    for (int r = 0; r < runs; r++) memcpy(d + 2 * fp16s + 4 * r, g + 16 * fp16s + 32 * r + 4 * c, 4);
    if (runs == 5) { /* Q5_0, Q5_1: the fifth bits back in the file's order */
        const uint32_t qh = x8_q5_file_bits(gguf_u32(d + 2 * fp16s));
        for (int i = 0; i < 4; i++) d[2 * fp16s + i] = (uint8_t)(qh >> 8 * i);
    }
}

/* rows ids[0..count) of a Q6_K_X8 or blocks-of-32 interleaved table q [n, rb] in the file's layout into out [count, rb]
 * (a tied embedding's lookup in a table its head interleaved); -1 for another type or an id out of range */
int llmd_x8_rows(int type, const uint8_t *q, int64_t n, int64_t rb, const int64_t *ids, int64_t count, uint8_t *out) {
    const int t = x8_entry(type);
    if (t < 0 || (type != LLMD_Q6K_X8 && LLMD_X8_ELEMS(type) != 32) || n % 8 || rb % X8_TYPES[t].bytes) return -1;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= n) return -1;
    const int64_t bytes = X8_TYPES[t].bytes;
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *group = q + ids[i] / 8 * 8 * rb;
        for (int64_t b = 0; b < rb / bytes; b++)
            x8_unpack_column(type, group + 8 * b * bytes, ids[i] % 8, out + i * rb + b * bytes);
    }
    return 0;
}
