/* Packed output heads with int16-quantized activations (the GGUF int16 path: GGUFKernel(act="int16")).
 *
 * The head picks the next token, and its logits' gaps can be tiny: int8 activations (2^-7 of a block's largest value)
 * flip near-ties, while fp32 activations leave a large head (Gemma 3's 262144 x 640 Q8_0, 178 MB a token) bound by
 * its multiplies rather than by memory. Here each activation block of 32 is quantized to int16 (d = amax / 32767,
 * q = round(x / d): 256 times finer than int8) and meets the weights as int16 pairs in _mm256_madd_epi16. Weights
 * whose codes times their integer scales fit int16: Q8_0 (w = code, scale d) and Q6_K (w = (u - 32) * sc_s with the
 * sub-block's int8 scale, |w| <= 4096; scale d per super-block). Per output y[r, c], in this order whatever M, the
 * row's position, the tile or the thread count:
 *   for each block j of 32: dot = the 8 int32 lanes of madd(w[0..16), x[0..16)) + madd(w[16..32), x[16..32))
 *       (exact: |dot lane| <= 4 * 4096 * 32767 < 2^31); out = fma(float(dot), dw_j * dx_j, out);
 *   y = hsum(out).
 * Q4_1 takes this path for every layer, not only as a head (with int8 activations the bundled SmolLM2-135M Q4_1
 * loses its answers), in an order of its own (below). The portable build computes the same lanes in plain C, so its
 * results are the vector build's bits. The activation rows are cpu_act.c's (gh_quantize_row; Q4_1 also reads their
 * sums of 16, gh_sums_row, and from 8 rows on their lane layout, gh41_fill_lanes), the column loop's caller
 * cpu_gguf.c's. */
#include "cpu_tiles.h"

/* Blocks of 32 per unit and bytes per unit of each head type. */
#define GH_Q8_0_BLOCKS 1
#define GH_Q8_0_BYTES 34
#define GH_Q6_K_BLOCKS 8
#define GH_Q6_K_BYTES 210
#define GH_Q4_1_BYTES 20

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
                              int64_t K, int64_t nu, float *y, int64_t ldy) {                                     \
        const int64_t nbx = K / QB;                                                                                \
        __m256 out[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) out[r][c] = _mm256_setzero_ps();                      \
        for (int64_t b = 0; b < nu; b++) {                                                                         \
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
                    }                                                                                              \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C && c < cols; c++) y[r * ldy + c] = hsum(out[r][c]);                             \
    }
TILES_BY_ROWS(GH_TILE, q8_0, Q8_0)
TILES_BY_ROWS(GH_TILE, q6_k, Q6_K)

typedef void (*gh_tile_fn)(const uint8_t *, int64_t, int, const int16_t *, const float *, int64_t, int64_t, float *,
                           int64_t);
static const gh_tile_fn GH_Q8_0_TILES[4] = {ght_q8_0_1, ght_q8_0_2, ght_q8_0_3, ght_q8_0_4};
static const gh_tile_fn GH_Q6_K_TILES[4] = {ght_q6_k_1, ght_q6_k_2, ght_q6_k_3, ght_q6_k_4};

#else

/* block j of a unit at q -> its 32 int16 weights and scale (the vector build's values) */
static float gh_block_scalar(int type, const uint8_t *q, int j, int32_t *w) {
    if (type == 8) {
        for (int i = 0; i < QB; i++) w[i] = (int8_t)q[2 + i];
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

/* ---- Q4_1 (w = d q + m, codes 0..15) ---------------------------------------------------------------------------
 * Per output y[r, c], in this order whatever M, the row's position, the tile or the thread count:
 *   for each block b: D_b = the sum of its 32 codes times the int16 activation codes (exact, and |D_b| < 2^24, so
 *       float(D_b) is exact too); out = fma(float(D_b), d_b dx_b, out); mins = fma(m_b, dx_b float(Q_b), mins)
 *       (Q_b: the row's sum of the block's activation codes);
 *   y = out + mins.
 * Fewer than 8 rows: a row takes 8 columns at a time, its 8 dot products' lanes summed into one vector whose lanes are
 * the columns (gq_lane_sums). From 8 rows on, 8 rows lie in the lanes (the group's lane layout, gh41_fill_lanes:
 * per block and pair of elements, the 8 rows' two codes side by side) against each column's code pairs broadcast:
 * one vpmaddwd serves 16 products where the per-row tile's serves 16 of one row with a sum to reduce. */
#define GH41_LANE_ROWS 8

/* the lane layout of rows [0, m), per group of 8 rows (a last group's missing rows zero) and block b: xt [16 pairs][8
 * rows][2] codes, then dx [8] and dx float(Q_b) [8] */
#define GH41_LANE_BLOCK (16 * 8 * 2 * 2 + 2 * 8 * 4)

size_t gh41_lanes_bytes(int64_t m, int64_t k) {
    return m < GH41_LANE_ROWS ? 0 : (size_t)((m + 7) / 8) * (size_t)(k / QB) * GH41_LANE_BLOCK;
}

void gh41_fill_lanes(void *lanes, const float *xd, const int32_t *Q, const int16_t *xq, int64_t m, int64_t k) {
    const int64_t nb = k / QB;
    memset(lanes, 0, gh41_lanes_bytes(m, k));
    for (int64_t r = 0; r < m; r++) {
        char *g = (char *)lanes + (size_t)(r / 8) * (size_t)nb * GH41_LANE_BLOCK;
        const int l = (int)(r % 8);
        for (int64_t b = 0; b < nb; b++) {
            int16_t *xt = (int16_t *)(g + b * GH41_LANE_BLOCK);
            float *dx = (float *)(xt + 256);
            for (int p = 0; p < 16; p++) {
                xt[16 * p + 2 * l] = xq[r * k + QB * b + 2 * p];
                xt[16 * p + 2 * l + 1] = xq[r * k + QB * b + 2 * p + 1];
            }
            dx[l] = xd[r * nb + b];
            dx[8 + l] = xd[r * nb + b] * (float)(Q[r * (k / 16) + 2 * b] + Q[r * (k / 16) + 2 * b + 1]);
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* one row (codes x, scales dx, sums of 16 Q) against up to 8 columns (cols) */
static void gh41_row(const uint8_t *q, int64_t rb, int cols, const int16_t *x, const float *dx, const int32_t *Q,
                     int64_t nb, float *y) {
    const __m256i m4 = _mm256_set1_epi16(0x0F);
    __m256 out = _mm256_setzero_ps(), mins = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)(x + QB * b));
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)(x + QB * b + 16));
        __m256i v[8];
        _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++) {
            v[c] = _mm256_setzero_si256();
            if (c < cols) {
                const uint8_t *qb = q + c * rb + b * GH_Q4_1_BYTES;
                _mm_prefetch((const char *)(qb + PF_TILES * 8 * rb), _MM_HINT_T0);
                const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qb + 4)));
                v[c] = _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(w, m4), x0),
                                        _mm256_madd_epi16(_mm256_srli_epi16(w, 4), x1));
            }
        }
        const __m256i dm = gq_block_starts(q + b * GH_Q4_1_BYTES, rb, cols); /* d and m of the 8 columns */
        const __m256 d = gqs_f16_scales(dm), m = gqs_f16_scales(_mm256_srli_epi32(dm, 16));
        out = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gq_lane_sums(v)), _mm256_mul_ps(d, _mm256_set1_ps(dx[b])), out);
        mins = _mm256_fmadd_ps(m, _mm256_set1_ps(dx[b] * (float)(Q[2 * b] + Q[2 * b + 1])), mins);
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_add_ps(out, mins));
    for (int c = 0; c < cols; c++) y[c] = t[c];
}

/* 8 rows of a group's lane layout g (rows of them real) against C columns (1 or 2) */
#define GH41_LANES(C)                                                                                              \
    static void gh41_lanes_##C(const uint8_t *q, int64_t rb, const char *g, int64_t nb, float *y, int64_t ldy,     \
                               int rows) {                                                                         \
        const __m256i m4 = _mm256_set1_epi16(0x0F);                                                                \
        __m256 out[C], mins[C];                                                                                    \
        for (int c = 0; c < C; c++) out[c] = mins[c] = _mm256_setzero_ps();                                        \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            const int16_t *xt = (const int16_t *)(g + b * GH41_LANE_BLOCK);                                        \
            const float *dx = (const float *)(xt + 256);                                                           \
            int32_t pairs[C][16] __attribute__((aligned(32))); /* the codes of elements 2p, 2p + 1 */             \
            __m256i a[C][2];                                                                                       \
            _Pragma("GCC unroll 2") for (int c = 0; c < C; c++) {                                                 \
                const uint8_t *qb = q + c * rb + b * GH_Q4_1_BYTES;                                                \
                const __m256i w = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(qb + 4)));               \
                _mm256_store_si256((__m256i *)pairs[c], _mm256_and_si256(w, m4));                                  \
                _mm256_store_si256((__m256i *)(pairs[c] + 8), _mm256_srli_epi16(w, 4));                            \
                a[c][0] = a[c][1] = _mm256_setzero_si256();                                                        \
            }                                                                                                      \
            _Pragma("GCC unroll 16") for (int p = 0; p < 16; p++) {                                               \
                const __m256i xv = _mm256_load_si256((const __m256i *)(xt + 16 * p));                              \
                _Pragma("GCC unroll 2") for (int c = 0; c < C; c++)                                               \
                    a[c][p & 1] = _mm256_add_epi32(a[c][p & 1],                                                    \
                                                   _mm256_madd_epi16(xv, _mm256_set1_epi32(pairs[c][p])));         \
            }                                                                                                      \
            const __m256 dxv = _mm256_load_ps(dx), xs = _mm256_load_ps(dx + 8);                                    \
            _Pragma("GCC unroll 2") for (int c = 0; c < C; c++) {                                                 \
                const uint8_t *qb = q + c * rb + b * GH_Q4_1_BYTES;                                                \
                const __m256 D = _mm256_cvtepi32_ps(_mm256_add_epi32(a[c][0], a[c][1]));                           \
                out[c] = _mm256_fmadd_ps(D, _mm256_mul_ps(_mm256_set1_ps(gguf_f16(qb)), dxv), out[c]);            \
                mins[c] = _mm256_fmadd_ps(_mm256_set1_ps(gguf_f16(qb + 2)), xs, mins[c]);                         \
            }                                                                                                      \
        }                                                                                                          \
        for (int c = 0; c < C; c++) {                                                                              \
            float t[8];                                                                                            \
            _mm256_storeu_ps(t, _mm256_add_ps(out[c], mins[c]));                                                   \
            for (int l = 0; l < rows; l++) y[l * ldy + c] = t[l];                                                  \
        }                                                                                                          \
    }
GH41_LANES(1)
GH41_LANES(2)
#endif

/* Columns [n0, n1) of Q4_1 blocks q for rows [0, m) of the int16 path's row data (xd, Q, xq), and their lane layout
 * (lanes; NULL under GH41_LANE_ROWS rows). */
static void gh41_cols(const float *xd, const int32_t *Q, const int16_t *xq, const void *lanes, const uint8_t *q,
                      float *y, int64_t ldy, int64_t m, int64_t k, int64_t n0, int64_t n1) {
    const int64_t nb = k / QB, rb = nb * GH_Q4_1_BYTES;
#if defined(__AVX2__) && defined(__FMA__)
    if (lanes) {
        /* row groups whose lane layout stays in L2, each column's blocks reused across them */
        const int64_t groups = (m + 7) / 8, chunk = (256 * 1024) / (nb * GH41_LANE_BLOCK) < 1 ? 1
                                                    : (256 * 1024) / (nb * GH41_LANE_BLOCK);
        for (int64_t g0 = 0; g0 < groups; g0 += chunk)
            for (int64_t c = n0; c < n1; c += 2)
                for (int64_t g = g0; g < groups && g < g0 + chunk; g++) {
                    const char *lg = (const char *)lanes + (size_t)g * (size_t)nb * GH41_LANE_BLOCK;
                    const int rows = (int)(m - 8 * g < 8 ? m - 8 * g : 8);
                    if (n1 - c >= 2)
                        gh41_lanes_2(q + c * rb, rb, lg, nb, y + 8 * g * ldy + c, ldy, rows);
                    else
                        gh41_lanes_1(q + c * rb, rb, lg, nb, y + 8 * g * ldy + c, ldy, rows);
                }
        return;
    }
    for (int64_t c0 = n0; c0 < n1; c0 += 8)
        for (int64_t r = 0; r < m; r++)
            gh41_row(q + c0 * rb, rb, (int)(n1 - c0 < 8 ? n1 - c0 : 8), xq + r * k, xd + r * nb, Q + r * (k / 16), nb,
                     y + r * ldy + c0);
#else
    (void)lanes;
    for (int64_t c = n0; c < n1; c++)
        for (int64_t r = 0; r < m; r++) {
            float out = 0.0f, mins = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *qb = q + c * rb + b * GH_Q4_1_BYTES;
                const int16_t *xr = xq + r * k + QB * b;
                int32_t D = 0;
                for (int i = 0; i < 16; i++) D += (qb[4 + i] & 0xF) * xr[i] + (qb[4 + i] >> 4) * xr[16 + i];
                const float dx = xd[r * nb + b];
                out = fmaf((float)D, gguf_f16(qb) * dx, out);
                mins = fmaf(gguf_f16(qb + 2), dx * (float)(Q[r * (k / 16) + 2 * b] + Q[r * (k / 16) + 2 * b + 1]),
                            mins);
            }
            y[r * ldy + c] = out + mins;
        }
#endif
}

/* Columns [n0, n1) of y for rows [0, m) of the head path's row data (xd, xq: gh_quantize_row's; Q4_1 also the sums
 * of 16 Q and the group's lane layout, or NULL) and blocks q of GGML type `type`. */
void gh_cols(int type, const float *xd, const int32_t *Q, const int16_t *xq, const void *lanes, const uint8_t *q,
             float *y, int64_t ldy, int64_t m, int64_t k, int64_t n0, int64_t n1) {
    if (type == 3) {
        gh41_cols(xd, Q, xq, lanes, q, y, ldy, m, k, n0, n1);
        return;
    }
    (void)Q, (void)lanes;
    const int unit_blocks = type == 8 ? GH_Q8_0_BLOCKS : GH_Q6_K_BLOCKS;
    const int64_t nbx = k / QB, nu = nbx / unit_blocks, rb = nu * (type == 8 ? GH_Q8_0_BYTES : GH_Q6_K_BYTES);
#if defined(__AVX2__) && defined(__FMA__)
    const gh_tile_fn *tiles = type == 8 ? GH_Q8_0_TILES : GH_Q6_K_TILES;
    const int64_t chunk = (256 * 1024) / (2 * k) < 4 ? 4 : (256 * 1024) / (2 * k);
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
        for (int64_t c0 = n0; c0 < n1; c0 += 8) { /* 8 columns' blocks stay in cache over the rows */
            const int64_t c1 = c0 + 8 < n1 ? c0 + 8 : n1;
            for (int64_t r0 = m0; r0 < m1; r0 += 4) {
                const int rr = (int)(m1 - r0 < 4 ? m1 - r0 : 4), tc = GG_COLS[rr - 1];
                for (int64_t c = c0; c < c1; c += tc)
                    tiles[rr - 1](q + c * rb, rb, (int)(c1 - c < tc ? c1 - c : tc), xq + r0 * k, xd + r0 * nbx, k, nu,
                                  y + r0 * ldy + c, ldy);
            }
        }
    }
#else
    for (int64_t c = n0; c < n1; c++) {
        int32_t w[QB];
        for (int64_t r = 0; r < m; r++) {
            float out[8] = {0};
            for (int64_t blk = 0; blk < nbx; blk++) {
                const int64_t b = blk / unit_blocks;
                const float dw = gh_block_scalar(type, q + c * rb + b * (rb / nu), (int)(blk % unit_blocks), w);
                const int16_t *xr = xq + r * k + QB * blk;
                const float s = dw * xd[r * nbx + blk];
                for (int l = 0; l < 8; l++) {
                    const int32_t dot = w[2 * l] * xr[2 * l] + w[2 * l + 1] * xr[2 * l + 1] +
                                        w[16 + 2 * l] * xr[16 + 2 * l] + w[17 + 2 * l] * xr[17 + 2 * l];
                    out[l] = fmaf((float)dot, s, out[l]);
                }
            }
            /* hsum's order */
            const float a0 = out[0] + out[4], a1 = out[1] + out[5], a2 = out[2] + out[6], a3 = out[3] + out[7];
            y[r * ldy + c] = (a0 + a2) + (a1 + a3);
        }
    }
#endif
}

/* 1 where the head path takes GGUF blocks of `type` (a GGML type id, or Q6_K_X8, Q4_1_X8 and Q8_0_X8:
 * cpu_interleaved.c's int16 tiles). */
int llmd_gguf_q16_type(int type) {
    return gh_supported(type) || type == LLMD_Q6K_X8 || type == LLMD_Q41_X8 || type == LLMD_Q80_X8;
}
