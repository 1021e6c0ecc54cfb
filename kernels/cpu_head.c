/* Packed output heads with int16-quantized activations (the GGUF int16 path: GGUFKernel(act="int16")).
 *
 * The head picks the next token, and its logits' gaps can be tiny: int8 activations (2^-7 of a block's largest value)
 * flip near-ties, while fp32 activations leave a large head (Gemma 3's 262144 x 640 Q8_0, 178 MB a token) bound by
 * its multiplies rather than by memory. Here each activation block of 32 is quantized to int16 (d = amax / 32767,
 * q = round(x / d): 256 times finer than int8) and meets the weights as int16 pairs in _mm256_madd_epi16. Weights
 * whose codes times their integer scales fit int16: Q8_0 (w = code, scale d), Q6_K (w = (u - 32) * sc_s with the
 * sub-block's int8 scale, |w| <= 4096; scale d per super-block) and Q4_1 (w = code, scale d, plus its block's minimum
 * m times the block's activation sum). Q4_1 takes this path for every layer, not only as a head: with int8
 * activations the bundled SmolLM2-135M Q4_1 loses its answers. Per output y[r, c], in this order whatever M, the
 * row's position, the tile or the thread count:
 *   for each block j of 32: dot = the 8 int32 lanes of madd(w[0..16), x[0..16)) + madd(w[16..32), x[16..32))
 *       (exact: |dot lane| <= 4 * 4096 * 32767 < 2^31); out = fma(float(dot), dw_j * dx_j, out);
 *       Q4_1: mins = fma(m_j, dx_j * float(Q_j), mins) (Q_j: the sum of the block's activation codes);
 *   y = hsum(out) (Q4_1: hsum(out) + mins).
 * The portable build computes the same lanes in plain C, so its results are the vector build's bits. The activation
 * rows are cpu_act.c's (gh_quantize_row), the column loop's caller cpu_gguf.c's. */
#include "cpu_tiles.h"

/* Blocks of 32 per unit and bytes per unit of each head type. */
#define GH_Q8_0_BLOCKS 1
#define GH_Q8_0_BYTES 34
#define GH_Q6_K_BLOCKS 8
#define GH_Q6_K_BYTES 210
#define GH_Q4_1_BLOCKS 1
#define GH_Q4_1_BYTES 20
/* whether a type's blocks add a minimum times the activations' sum */
#define GH_Q8_0_MINS 0
#define GH_Q6_K_MINS 0
#define GH_Q4_1_MINS 1

int gh_supported(int type) { return type == 8 || type == 14 || type == 3; }

#if defined(__AVX2__) && defined(__FMA__)

#define GH_DOT(w0, x0, w1, x1) DOT_S16_ACC(_mm256_madd_epi16(w0, x0), w1, x1)

/* Per type, one unit of one column: gh_T_decode keeps what its blocks share, gh_T_block gives block j's int16
 * weights w0 (elements 0-15), w1 (16-31) and its scale. */
typedef struct { __m256i u[8]; const uint8_t *q; float d; } gh_unit;

INLINE void gh_q8_0_decode(const uint8_t *q, gh_unit *s) { s->q = q; }
INLINE float gh_q8_0_block(const gh_unit *s, int j, __m256i *w0, __m256i *w1) {
    (void)j;
    *w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(s->q + 2)));
    *w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(s->q + 18)));
    return gguf_f16(s->q);
}

INLINE void gh_q4_1_decode(const uint8_t *q, gh_unit *s) { s->q = q; }
INLINE float gh_q4_1_block(const gh_unit *s, int j, __m256i *w0, __m256i *w1) {
    (void)j;
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(s->q + 4)));
    *w0 = _mm256_and_si256(v, _mm256_set1_epi16(0x0F)); /* elements 0-15: the low nibbles */
    *w1 = _mm256_srli_epi16(v, 4);
    return gguf_f16(s->q);
}

INLINE void gh_q6_k_decode(const uint8_t *q, gh_unit *s) {
    q6k_codes(q, s->u);
    s->d = gguf_f16(q + 208);
    s->q = q;
}
INLINE float gh_q6_k_block(const gh_unit *s, int j, __m256i *w0, __m256i *w1) {
    const __m256i c = _mm256_sub_epi8(s->u[j], _mm256_set1_epi8(32));
    const int8_t *sc = (const int8_t *)(s->q + 192);
    *w0 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(c)), _mm256_set1_epi16(sc[2 * j]));
    *w1 = _mm256_mullo_epi16(_mm256_cvtepi8_epi16(_mm256_extracti128_si256(c, 1)), _mm256_set1_epi16(sc[2 * j + 1]));
    return s->d;
}

/* A tile of R rows x up to C columns (cols), one unit of every column at a time; nu: units per row. */
#define GH_TILE(T, TU, R, C)                                                                                       \
    static void ght_##T##_##R(const uint8_t *q, int64_t rb, int cols, const int16_t *xq, const float *xd,        \
                              const int32_t *Q, int64_t K, int64_t nu, float *y, int64_t ldy) {                   \
        const int64_t nbx = K / QB;                                                                                \
        __m256 out[R][C];                                                                                          \
        float mins[R][C], xs[R]; /* Q4_1's minimum terms and a block's dx * Q per row */                         \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) out[r][c] = _mm256_setzero_ps(), mins[r][c] = 0.0f;   \
        for (int64_t b = 0; b < nu; b++) {                                                                         \
            if (GH_##TU##_MINS)                                                                                    \
                for (int r = 0; r < R; r++)                                                                        \
                    xs[r] = xd[r * nbx + b] * (float)(Q[r * (K / 16) + 2 * b] + Q[r * (K / 16) + 2 * b + 1]);      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) if (c < cols) {                                   \
                const uint8_t *qc = q + c * rb + b * GH_##TU##_BYTES;                                              \
                for (int p = 0; p < GH_##TU##_BYTES; p += 64)                                                      \
                    _mm_prefetch((const char *)(qc + PF_TILES * C * rb + p), _MM_HINT_T0);                       \
                gh_unit s;                                                                                         \
                gh_##T##_decode(qc, &s);                                                                           \
                _Pragma("GCC unroll 8") for (int j = 0; j < GH_##TU##_BLOCKS; j++) {                              \
                    __m256i w0, w1;                                                                                \
                    const __m256 dw = _mm256_set1_ps(gh_##T##_block(&s, j, &w0, &w1));                             \
                    const int64_t blk = GH_##TU##_BLOCKS * b + j;                                                  \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                         \
                        const int16_t *xr = xq + r * K + QB * blk;                                                 \
                        const __m256i dot =                                                                        \
                            GH_DOT(w0, _mm256_loadu_si256((const __m256i *)xr), w1,                               \
                                   _mm256_loadu_si256((const __m256i *)(xr + 16)));                               \
                        out[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot),                                       \
                                                    _mm256_mul_ps(dw, _mm256_broadcast_ss(xd + r * nbx + blk)),     \
                                                    out[r][c]);                                                    \
                        if (GH_##TU##_MINS) mins[r][c] = fmaf(gguf_f16(qc + 2), xs[r], mins[r][c]);                \
                    }                                                                                              \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C && c < cols; c++)                                                                \
                y[r * ldy + c] = GH_##TU##_MINS ? hsum(out[r][c]) + mins[r][c] : hsum(out[r][c]);                  \
    }
TILES_BY_ROWS(GH_TILE, q8_0, Q8_0)
TILES_BY_ROWS(GH_TILE, q6_k, Q6_K)
TILES_BY_ROWS(GH_TILE, q4_1, Q4_1)

typedef void (*gh_tile_fn)(const uint8_t *, int64_t, int, const int16_t *, const float *, const int32_t *, int64_t,
                           int64_t, float *, int64_t);
static const gh_tile_fn GH_Q8_0_TILES[4] = {ght_q8_0_1, ght_q8_0_2, ght_q8_0_3, ght_q8_0_4};
static const gh_tile_fn GH_Q6_K_TILES[4] = {ght_q6_k_1, ght_q6_k_2, ght_q6_k_3, ght_q6_k_4};
static const gh_tile_fn GH_Q4_1_TILES[4] = {ght_q4_1_1, ght_q4_1_2, ght_q4_1_3, ght_q4_1_4};

#else

/* block j of a unit at q -> its 32 int16 weights and scale (the vector build's values) */
static float gh_block_scalar(int type, const uint8_t *q, int j, int32_t *w) {
    if (type == 8) {
        for (int i = 0; i < QB; i++) w[i] = (int8_t)q[2 + i];
        return gguf_f16(q);
    }
    if (type == 3) {
        for (int i = 0; i < 16; i++) w[i] = q[4 + i] & 0xF, w[16 + i] = q[4 + i] >> 4;
        return gguf_f16(q);
    }
    for (int i = 0; i < QB; i++) { /* Q6_K element e: low nibble from ql, two high bits from qh */
        const int e = QB * j + i, h = e / 128, l = e % 32, t = e % 128 / 32;
        const int lo = q[64 * h + l + 32 * (t & 1)] >> (4 * (t >> 1)) & 0xF, hi = q[128 + 32 * h + l] >> (2 * t) & 3;
        w[i] = ((lo | hi << 4) - 32) * ((const int8_t *)(q + 192))[e / 16];
    }
    return gguf_f16(q + 208);
}

#endif

/* Columns [n0, n1) of y for rows [0, m) of the head path's row data (xd, xq: gh_quantize_row's; Q4_1 also the sums
 * of 16 Q: gh_sums_row's) and blocks q of GGML type `type`. */
void gh_cols(int type, const float *xd, const int32_t *Q, const int16_t *xq, const uint8_t *q, float *y, int64_t ldy,
             int64_t m, int64_t k, int64_t n0, int64_t n1) {
    const int unit_blocks = type == 14 ? GH_Q6_K_BLOCKS : 1;
    const int64_t nbx = k / QB, nu = nbx / unit_blocks;
    const int64_t rb = nu * (type == 8 ? GH_Q8_0_BYTES : type == 3 ? GH_Q4_1_BYTES : GH_Q6_K_BYTES);
#if defined(__AVX2__) && defined(__FMA__)
    const gh_tile_fn *tiles = type == 8 ? GH_Q8_0_TILES : type == 3 ? GH_Q4_1_TILES : GH_Q6_K_TILES;
    const int64_t chunk = (256 * 1024) / (2 * k) < 4 ? 4 : (256 * 1024) / (2 * k);
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
        for (int64_t c0 = n0; c0 < n1; c0 += 8) { /* 8 columns' blocks stay in cache over the rows */
            const int64_t c1 = c0 + 8 < n1 ? c0 + 8 : n1;
            for (int64_t r0 = m0; r0 < m1; r0 += 4) {
                const int rr = (int)(m1 - r0 < 4 ? m1 - r0 : 4), tc = GG_COLS[rr - 1];
                for (int64_t c = c0; c < c1; c += tc)
                    tiles[rr - 1](q + c * rb, rb, (int)(c1 - c < tc ? c1 - c : tc), xq + r0 * k, xd + r0 * nbx,
                                  Q ? Q + r0 * (k / 16) : NULL, k, nu, y + r0 * ldy + c, ldy);
            }
        }
    }
#else
    for (int64_t c = n0; c < n1; c++) {
        int32_t w[QB];
        for (int64_t r = 0; r < m; r++) {
            float out[8] = {0}, mins = 0.0f;
            for (int64_t blk = 0; blk < nbx; blk++) {
                const int64_t b = blk / unit_blocks;
                const uint8_t *qb = q + c * rb + b * (rb / nu);
                const float dw = gh_block_scalar(type, qb, (int)(blk % unit_blocks), w);
                const int16_t *xr = xq + r * k + QB * blk;
                const float s = dw * xd[r * nbx + blk];
                for (int l = 0; l < 8; l++) {
                    const int32_t dot = w[2 * l] * xr[2 * l] + w[2 * l + 1] * xr[2 * l + 1] +
                                        w[16 + 2 * l] * xr[16 + 2 * l] + w[17 + 2 * l] * xr[17 + 2 * l];
                    out[l] = fmaf((float)dot, s, out[l]);
                }
                if (type == 3) {
                    const int32_t *Qr = Q + r * (k / 16);
                    mins = fmaf(gguf_f16(qb + 2), xd[r * nbx + blk] * (float)(Qr[2 * blk] + Qr[2 * blk + 1]), mins);
                }
            }
            /* hsum's order */
            const float a0 = out[0] + out[4], a1 = out[1] + out[5], a2 = out[2] + out[6], a3 = out[3] + out[7];
            y[r * ldy + c] = type == 3 ? ((a0 + a2) + (a1 + a3)) + mins : (a0 + a2) + (a1 + a3);
        }
    }
#endif
}

/* 1 where the head path takes GGUF blocks of `type` (a GGML type id, or Q6_K_X8: cpu_interleaved.c's head tiles). */
int llmd_gguf_q16_type(int type) { return gh_supported(type) || type == LLMD_Q6K_X8; }
