/* Weight-only quantized matmul on the CPU: y[M, N] = x[M, K] @ dequant(W).T for llmd's own int8 / int4 layers, with
 * fp32 activations, or int8-quantized ones (the integer path, below). The GGUF block types' matmuls are cpu_gguf.c's
 * (cpu_tiles.h lists the library's matmul files).
 *
 * Weight layouts are llmd.kernels.quant_matmul's, read in place (no repacking, no extra memory):
 *   int8: q int8 [N, K], s fp32 [N, K/G]; w = q * s.
 *   int4: q uint8 [N, K/2] (k = 2i in the low nibble of byte i, 2i + 1 in the high one), s and z fp32 [N, K/G];
 *         w = (q - 8) * s + z.
 *
 * Each output y[m, n] is one dot product accumulated in the same order whatever M is, whichever rows share the
 * call and however many threads run: register tiles over rows and columns only change which outputs are computed
 * together, never the order of one output's additions. So a row's result does not depend on its batch (llmd's
 * exactness invariant). Build with -ffp-contract=off so the compiler does not fuse the scalar code differently in
 * different tile shapes.
 *
 * Decode (M = 1) is memory-bound: each thread streams its columns' packed weights once, widens them to fp32 in
 * registers and multiplies. For larger M a tile of R rows x C columns reuses each dequantized weight vector from a
 * register across R rows; rows are taken in chunks whose activations fit in L2 so the weights are re-read only once
 * per chunk. From 16 rows (prefill, large batches) the vector lanes go over rows instead of k (int8_rows,
 * int4_rows), with the same per-output arithmetic.
 */
#include "cpu_tiles.h"

int llmd_cpu_gemm_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX2__) && defined(__FMA__)

/* In a parallel region: this thread's columns [n0, n1) and a panel of `floats` floats for them; NULL, with *rc set
 * to -2, when out of memory. */
static float *thread_panel(int64_t n, size_t floats, int64_t *n0, int64_t *n1, int *rc) {
    int tid, nth;
    thread_id(&tid, &nth);
    column_range(n, tid, nth, n0, n1);
    float *wp = (float *)aligned_alloc(32, (floats * 4 + 31) / 32 * 32);
    if (!wp) {
#pragma omp atomic write
        *rc = -2;
    }
    return wp;
}

/* int8: rows x[0..R) (row stride ldx), columns q/s rows [0..C). k runs in steps of 8 within groups of G
 * (G % 8 == 0, or G == K per channel, where a K that is not a multiple of 8 ends in a scalar tail). */
#define INT8_TILE(R, C)                                                                                            \
    static void int8_tile_##R##_##C(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y,       \
                                    int64_t ldy, int64_t K, int64_t G) {                                          \
        const int64_t ng = K / G, kv = K & ~(int64_t)7;                                                           \
        __m256 acc[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                      \
        for (int64_t g = 0; g < ng; g++) {                                                                         \
            const int64_t kend = (g + 1) * G < kv ? (g + 1) * G : kv;                                              \
            for (int64_t k = g * G; k < kend; k += 8) {                                                            \
                _mm_prefetch((const char *)(q + PF_TILES * C * K + (k >> 3) * (8 * C)), _MM_HINT_T0);            \
                __m256 xv[R];                                                                                      \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + k);     \
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                             \
                    __m128i b = _mm_loadl_epi64((const __m128i *)(q + c * K + k));                                \
                    __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),                          \
                                             _mm256_broadcast_ss(s + c * ng + g));                                \
                    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                           \
                        acc[r][c] = _mm256_fmadd_ps(xv[r], w, acc[r][c]);                                          \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++) {                                                                          \
                float t = hsum(acc[r][c]);                                                                         \
                for (int64_t k = kv; k < K; k++) /* only per channel: ng == 1 */                                  \
                    t += x[r * ldx + k] * ((float)q[c * K + k] * s[c * ng]);                                       \
                y[r * ldy + c] = t;                                                                                \
            }                                                                                                      \
    }

/* int8 with many rows: a panel of columns is first widened into fp32 (w = q * s, INT8_TILE's very products), then
 * each tile of rows multiplies the panel from L1 instead of widening every weight again for each row tile. Each
 * output's operations and their order are INT8_TILE's, so a row's result is the same bits as on the other paths. */
static void int8_panel(const int8_t *q, const float *s, int64_t K, int64_t G, int cols, float *w) {
    const int64_t ng = K / G, kv = K & ~(int64_t)7;
    for (int c = 0; c < cols; c++) {
        for (int64_t k = 0; k < kv; k += 8) {
            __m128i b = _mm_loadl_epi64((const __m128i *)(q + c * K + k));
            _mm256_storeu_ps(w + c * K + k, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
                                                          _mm256_broadcast_ss(s + c * ng + k / G)));
        }
        for (int64_t k = kv; k < K; k++) w[c * K + k] = (float)q[c * K + k] * s[c * ng];  /* per channel only */
    }
}

#define PANEL_TILE(R, C)                                                                                           \
    static void panel_tile_##R##_##C(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy,        \
                                     int64_t K) {                                                                 \
        const int64_t kv = K & ~(int64_t)7;                                                                        \
        __m256 acc[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                      \
        for (int64_t k = 0; k < kv; k += 8) {                                                                      \
            __m256 xv[R];                                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) xv[r] = _mm256_loadu_ps(x + r * ldx + k);         \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                 \
                const __m256 wv = _mm256_loadu_ps(w + c * K + k);                                                  \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                               \
                    acc[r][c] = _mm256_fmadd_ps(xv[r], wv, acc[r][c]);                                             \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++) {                                                                          \
                float t = hsum(acc[r][c]);                                                                         \
                for (int64_t k = kv; k < K; k++) t += x[r * ldx + k] * w[c * K + k];                               \
                y[r * ldy + c] = t;                                                                                \
            }                                                                                                      \
    }

/* The int4 zero term, added to a tile's accumulators before their horizontal sums: acc[r] lane i gains
 * sum over groups g = i, i + 8, ... of (z_g - 8 s_g) D_g, in a fixed order (the last step masked). */
INLINE void add_zero_terms(__m256 *acc, int rows, int stride, const float *s, const float *z, const float *D,
                           int64_t ng) {
    const __m256 eight = _mm256_set1_ps(8.0f);
    for (int64_t i = 0; i < ng; i += 8) {
        const int64_t left = ng - i;
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(left > 8 ? 8 : (int)left),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        const __m256 zz = _mm256_fnmadd_ps(eight, _mm256_maskload_ps(s + i, keep), _mm256_maskload_ps(z + i, keep));
        for (int r = 0; r < rows; r++)
            acc[r * stride] = _mm256_fmadd_ps(zz, _mm256_maskload_ps(D + r * ng + i, keep), acc[r * stride]);
    }
}

/* int4 with fp32 activations, per chunk of 64 k (32 packed bytes per column, one 256-bit load):
 *   sum_k x_k w_k = sum_chunks sum_lanes s_g(lane) * (sum_j x q) + sum_g (z_g - 8 s_g) X_g,   X_g = sum of x over g.
 * Lane l of a chunk's 32 bytes holds k = 8l .. 8l + 7, nibble j being k = 8l + j; so masking nibble j in place
 * (AND with 0xF << 4j) leaves q * 2^4j in each lane, whose int->float conversion is exact, and the activations are
 * stored pre-multiplied by 2^-4j to pair with it (exact unless |x| < 2^-102 turns subnormal): one AND, one
 * conversion and one FMA per 8 weights (nibble 7 is shifted down instead, its AND mask would be the sign bit), about
 * half the instructions of widening, dequantizing and multiplying each weight. The activations are stored chunk by
 * chunk, the rows of a chunk side by side (xp[chunk][row][64]), so a tile's rows sit at fixed offsets from one
 * pointer (a stride per row cost general registers and spills). The 8 products per lane are summed per chunk, then
 * scaled by the lane's group scale (lanes of one chunk may belong to different groups: a gather table per chunk);
 * the zero term comes at the end from the per-row group sums X. A last partial chunk (K % 64) reads its bytes into
 * a zeroed block and meets zero activations. */
typedef struct {
    __m256i idx;  /* lane -> group index relative to g0 */
    __m256i keep; /* groups present in the chunk (for a masked load of its scales) */
    int64_t g0;
} int4_chunk;

#define INT4_TILE(R, C)                                                                                            \
    static void int4_tile_##R##_##C(const float *xp, int64_t ldp, const float *xs, const int4_chunk *ch,          \
                                    const uint8_t *q, const float *s, const float *z, float *y, int64_t ldy,      \
                                    int64_t K, int64_t G) {                                                       \
        const int64_t ng = K / G, kh = K / 2, nc = (K + 63) / 64;                                                 \
        /* running totals in memory: updated once per chunk, they leave the registers to the chunk's sums */     \
        float out[R][C][8] __attribute__((aligned(32)));                                                           \
        memset(out, 0, sizeof out);                                                                                \
        /* the scales and zeros of the tile PF_TILES ahead (the zeros are read only at the end: unfetched, their  \
         * misses would stall each tile when the weights stream from memory) */                                   \
        for (int64_t p = 0; p < C * ng; p += 16) {                                                                 \
            _mm_prefetch((const char *)(s + PF_TILES * C * ng + p), _MM_HINT_T0);                                 \
            _mm_prefetch((const char *)(z + PF_TILES * C * ng + p), _MM_HINT_T0);                                 \
        }                                                                                                          \
        for (int64_t i = 0; i < nc; i++) {                                                                         \
            _Pragma("GCC unroll 8") for (int p = 0; p < C * 32; p += 64)                                          \
                _mm_prefetch((const char *)(q + PF_TILES * C * kh + i * (32 * C) + p), _MM_HINT_T0);            \
            /* a last partial chunk: its bytes copied into a zeroed block */                                    \
            const uint8_t *qc = q + i * 32;                                                                        \
            int64_t ldq = kh;                                                                                      \
            uint8_t part[C * 32];                                                                                  \
            if (kh - i * 32 < 32) {                                                                                \
                memset(part, 0, sizeof part);                                                                      \
                for (int c = 0; c < C; c++) memcpy(part + c * 32, qc + c * kh, (size_t)(kh - i * 32));            \
                qc = part;                                                                                         \
                ldq = 32;                                                                                          \
            }                                                                                                      \
            __m256 acc[R][C];                                                                                      \
            const float *xc = xp + i * ldp;                                                                        \
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                                                 \
                const __m256i mask = _mm256_set1_epi32(0xF << (4 * j));                                            \
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                             \
                    const __m256i v = _mm256_loadu_si256((const __m256i *)(qc + c * ldq));                        \
                    const __m256 f = _mm256_cvtepi32_ps(j < 7 ? _mm256_and_si256(v, mask)                          \
                                                              : _mm256_srli_epi32(v, 28));                         \
                    _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                         \
                        const __m256 xv = _mm256_load_ps(xc + r * 64 + 8 * j);                                     \
                        acc[r][c] = j == 0 ? _mm256_mul_ps(xv, f) : _mm256_fmadd_ps(xv, f, acc[r][c]);            \
                    }                                                                                              \
                }                                                                                                  \
            }                                                                                                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                 \
                __m256 sv; /* each lane's group scale. Group 32 (GGUF's): lanes 0-3 take s[2i] and 4-7 s[2i + 1],   \
                            * two broadcasts in place of the general gather (~7 % of a decode matmul) */          \
                if (G == 32 && i * 64 + 64 <= K) {                                                                 \
                    const __m256 two = _mm256_castpd_ps(_mm256_broadcast_sd((const double *)(s + c * ng + 2 * i))); \
                    sv = _mm256_blend_ps(_mm256_moveldup_ps(two), _mm256_movehdup_ps(two), 0xF0);                  \
                } else                                                                                             \
                    sv = _mm256_permutevar8x32_ps(_mm256_maskload_ps(s + c * ng + ch[i].g0, ch[i].keep), ch[i].idx); \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                               \
                    _mm256_store_ps(out[r][c], _mm256_fmadd_ps(acc[r][c], sv, _mm256_load_ps(out[r][c])));        \
            }                                                                                                      \
        }                                                                                                          \
        __m256 tot[R][C];                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++) tot[r][c] = _mm256_load_ps(out[r][c]);                                     \
        for (int c = 0; c < C; c++) add_zero_terms(&tot[0][c], R, C, s + c * ng, z + c * ng, xs, ng);          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++) y[r * ldy + c] = hsum(tot[r][c]);                                          \
    }

/* Tile shapes: a single row streams TILE_C1 columns at a time (independent accumulators hide the FMA latency);
 * several rows share TILE_CM columns at a time, TILE_R rows per tile. Remainders use smaller tiles: every shape
 * computes each output with the same operations in the same order. */
#define TILE_R 4
#define TILE_C1 8
#define TILE_CM 4
#define PANEL_ROWS 8 /* int8 rows from which the panel path pays (fewer: widening in the tiles is faster) */
#define PANEL_W 8    /* columns widened per int8 panel */
#define PANEL_C 2    /* columns per panel tile: 4 x 2 accumulators, 4 activations and a weight fit the registers */
/* int4 tiles hold only the chunk sums in registers (the running totals live in memory): one row streams 8 columns
 * (8 independent FMA chains), several rows take 4 x 2 (each widened weight vector serves 4 rows; measured best of
 * 4x1, 2x2, 4x2, 4x3 on an AVX2 EPYC) */
#ifndef INT4_TILE_R
#define INT4_TILE_R 4
#endif
#ifndef INT4_TILE_C1
#define INT4_TILE_C1 8
#endif
#ifndef INT4_TILE_CM
#define INT4_TILE_CM 2
#endif

#define TILES_FOR_C(T, C) T(1, C) T(2, C) T(3, C) T(4, C)
#define ALL_TILES(T)                                                                                               \
    TILES_FOR_C(T, 1) TILES_FOR_C(T, 2) TILES_FOR_C(T, 3) TILES_FOR_C(T, 4)                                       \
    T(1, 5) T(1, 6) T(1, 7) T(1, 8)
ALL_TILES(INT8_TILE)
TILES_FOR_C(PANEL_TILE, 1) TILES_FOR_C(PANEL_TILE, 2)
ALL_TILES(INT4_TILE)

typedef void (*int8_tile_fn)(const float *, int64_t, const int8_t *, const float *, float *, int64_t, int64_t,
                             int64_t);
typedef void (*panel_tile_fn)(const float *, int64_t, const float *, float *, int64_t, int64_t);
typedef void (*int4_tile_fn)(const float *, int64_t, const float *, const int4_chunk *, const uint8_t *,
                             const float *, const float *, float *, int64_t, int64_t, int64_t);

#define ROW_OF(T, C) {T##_1_##C, T##_2_##C, T##_3_##C, T##_4_##C}
/* ALL_TILES' functions as a table [C - 1][R - 1] (C > 4 only for one row) */
#define ALL_TILES_TABLE(T)                                                                                         \
    {ROW_OF(T, 1), ROW_OF(T, 2), ROW_OF(T, 3), ROW_OF(T, 4), {T##_1_5}, {T##_1_6}, {T##_1_7}, {T##_1_8}}
static const int8_tile_fn INT8_TILES[8][4] = ALL_TILES_TABLE(int8_tile);
static const panel_tile_fn PANEL_TILES[PANEL_C][4] = {ROW_OF(panel_tile, 1), ROW_OF(panel_tile, 2)};
static const int4_tile_fn INT4_TILES[8][4] = ALL_TILES_TABLE(int4_tile);

/* ---- many rows: vector lanes over rows (int8 and int4) --------------------------------------------------------
 * The tiles above put k in the vector lanes. From RP_MIN_ROWS rows a register instead holds one lane's running sum
 * for 8 rows at once: each weight is widened to fp32 once into a panel and broadcast, and an activation vector (8 rows
 * of one k, stored transposed) serves RP_COLS columns, so 2 x RP_COLS independent FMA chains keep both FMA units
 * busy. Every output gets the very operations of the tiles above in the same order (the lanes' sums, then hsum's
 * tree), so results are bit-identical whatever path a row takes (tested). */

/* int8: lane l of output (r, c) sums x[k] * w[k] (w = q * s, int8_panel's products) over k = 8i + l, i rising;
 * per channel, a K that is not a multiple of 8 then adds its tail k one by one after the lanes' sum. */
INLINE void int8_rows_tile(const float *xt, const float *wp, int64_t K, float *y, int64_t ldy, int rows,
                           const int C) {
    const int64_t kv = K & ~(int64_t)7;
    __m256 lanes[RP_VECS][RP_COLS][8];
    for (int l = 0; l < 8; l++) {
        __m256 acc[RP_VECS][RP_COLS];
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[0][c] = acc[1][c] = _mm256_setzero_ps();
        for (int64_t k = l; k < kv; k += 8) {
            const __m256 x0 = _mm256_load_ps(xt + k * 16), x1 = _mm256_load_ps(xt + k * 16 + 8);
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {
                const __m256 w = _mm256_broadcast_ss(wp + c * K + k);
                acc[0][c] = _mm256_fmadd_ps(x0, w, acc[0][c]);
                acc[1][c] = _mm256_fmadd_ps(x1, w, acc[1][c]);
            }
        }
        for (int c = 0; c < C; c++) lanes[0][c][l] = acc[0][c], lanes[1][c][l] = acc[1][c];
    }
    for (int c = 0; c < C; c++)
        for (int v = 0; v < RP_VECS; v++) {
            __m256 t = lane_sum(lanes[v][c]);
            for (int64_t k = kv; k < K; k++) /* the scalar tail, as INT8_TILE adds it: t += x * w */
                t = _mm256_add_ps(t, _mm256_mul_ps(_mm256_load_ps(xt + k * 16 + 8 * v),
                                                   _mm256_broadcast_ss(wp + c * K + k)));
            store_rows(t, y + 8 * v * ldy + c, ldy, rows - 8 * v);
        }
}

/* The rows-in-lanes loop of int8_rows: x transposed in chunks of 16-row blocks, each thread's columns
 * widened RP_COLS at a time into an fp32 panel by `fill(ctx, c0, cols, panel)`, then int8_rows_tile on every block. */
typedef void (*panel_fill)(const void *ctx, int64_t c0, int cols, float *w);

static int rows_by_panels(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t m, int64_t n, int64_t k,
                          int nthreads, panel_fill fill, const void *ctx) {
    const int64_t blocks = (m + 15) / 16;
    float *xt = transpose_rows(x, ldx, m, k, k, 0, 0);
    if (!xt) return -2;
    const int64_t chunk_blocks = (row_chunk(k) + 15) / 16;
    int rc = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int64_t n0, n1;
        float *wp = thread_panel(n, (size_t)(RP_COLS * k), &n0, &n1, &rc);
        for (int64_t b0 = 0; wp && b0 < blocks; b0 += chunk_blocks) {
            const int64_t b1 = b0 + chunk_blocks < blocks ? b0 + chunk_blocks : blocks;
            for (int64_t c0 = n0; c0 < n1; c0 += RP_COLS) {
                const int cc = (int)(n1 - c0 < RP_COLS ? n1 - c0 : RP_COLS);
                fill(ctx, c0, cc, wp);
                for (int64_t b = b0; b < b1; b++) {
                    const int rows = (int)(m - b * 16 < 16 ? m - b * 16 : 16);
                    const float *xb = xt + b * k * 16;
                    float *yb = y + b * 16 * ldy + c0;
                    switch (cc) {
                    case 1: int8_rows_tile(xb, wp, k, yb, ldy, rows, 1); break;
                    case 2: int8_rows_tile(xb, wp, k, yb, ldy, rows, 2); break;
                    case 3: int8_rows_tile(xb, wp, k, yb, ldy, rows, 3); break;
                    case 4: int8_rows_tile(xb, wp, k, yb, ldy, rows, 4); break;
                    default: int8_rows_tile(xb, wp, k, yb, ldy, rows, RP_COLS); break;
                    }
                }
            }
        }
        free(wp);
    }
    free(xt);
    return rc;
}

typedef struct { const int8_t *q; const float *s; int64_t k, g; } int8_weights;

static void int8_fill(const void *ctx, int64_t c0, int cols, float *w) {
    const int8_weights *a = (const int8_weights *)ctx;
    int8_panel(a->q + c0 * a->k, a->s + c0 * (a->k / a->g), a->k, a->g, cols, w);
}

static int int8_rows(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y, int64_t ldy, int64_t m,
                     int64_t n, int64_t k, int64_t g, int nthreads) {
    const int8_weights a = {q, s, k, g};
    return rows_by_panels(x, ldx, y, ldy, m, n, k, nthreads, int8_fill, &a);
}

#endif /* AVX2 */

/* ---- int8 ---------------------------------------------------------------------------------------------------- */

int llmd_int8_matmul(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y, int64_t ldy,
                     int64_t m, int64_t n, int64_t k, int64_t g, int nthreads) {
    if (m < 0 || n < 0 || k <= 0 || g <= 0 || k % g) return -1;
#if defined(__AVX2__) && defined(__FMA__)
    if (g != k && g % 8) return -1;
#endif
    if (nthreads < 1) nthreads = 1;
    const int64_t ng = k / g, chunk = row_chunk(k);
#if defined(__AVX2__) && defined(__FMA__)
    if (m >= RP_MIN_ROWS) return int8_rows(x, ldx, q, s, y, ldy, m, n, k, g, nthreads);
    float *panels = NULL;
    if (m >= PANEL_ROWS && !(panels = (float *)aligned_alloc(32, ((size_t)nthreads * PANEL_W * k * 4 + 31) / 32 * 32)))
        return -2;
#endif
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid, nth;
        thread_id(&tid, &nth);
        int64_t n0, n1;
        column_range(n, tid, nth, &n0, &n1);
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
#if defined(__AVX2__) && defined(__FMA__)
            if (m1 - m0 >= PANEL_ROWS) {
                float *panel = panels + (size_t)tid * PANEL_W * k;
                for (int64_t p0 = n0; p0 < n1; p0 += PANEL_W) {
                    const int pw = (int)(n1 - p0 < PANEL_W ? n1 - p0 : PANEL_W);
                    int8_panel(q + p0 * k, s + p0 * ng, k, g, pw, panel);
                    for (int64_t r0 = m0; r0 < m1; r0 += TILE_R) {  /* a tile of rows stays in L1 over the panel */
                        const int rr = (int)(m1 - r0 < TILE_R ? m1 - r0 : TILE_R);
                        for (int c = 0; c < pw; c += PANEL_C) {
                            const int cc = pw - c < PANEL_C ? pw - c : PANEL_C;
                            PANEL_TILES[cc - 1][rr - 1](x + r0 * ldx, ldx, panel + c * k, y + r0 * ldy + p0 + c,
                                                        ldy, k);
                        }
                    }
                }
                continue;
            }
            const int tc = (m1 - m0) == 1 ? TILE_C1 : TILE_CM;
            for (int64_t c0 = n0; c0 < n1; c0 += tc) {
                const int cc = (int)(n1 - c0 < tc ? n1 - c0 : tc);
                for (int64_t r0 = m0; r0 < m1; r0 += TILE_R) {
                    const int rr = (int)(m1 - r0 < TILE_R ? m1 - r0 : TILE_R);
                    INT8_TILES[cc - 1][rr - 1](x + r0 * ldx, ldx, q + c0 * k, s + c0 * ng, y + r0 * ldy + c0, ldy, k, g);
                }
            }
#else
            for (int64_t r = m0; r < m1; r++)
                for (int64_t c = n0; c < n1; c++) {
                    float t = 0.0f;
                    for (int64_t i = 0; i < k; i++) t += x[r * ldx + i] * ((float)q[c * k + i] * s[c * ng + i / g]);
                    y[r * ldy + c] = t;
                }
#endif
        }
    }
#if defined(__AVX2__) && defined(__FMA__)
    free(panels);
#endif
    return 0;
}

/* ---- int4 ---------------------------------------------------------------------------------------------------- */

#if defined(__AVX2__) && defined(__FMA__)
/* int4 with many rows (see above): INT4_TILE gives output (r, c) eight running sums, lane l of chunk i summing
 * k = 64i + 8l + j for j = 0..7, then scales, totals, adds the zero terms and sums the lanes; here with rows in the
 * vector lanes. */
/* Widen a column's packed weights into the panel as INT4_TILE widens them: for chunk i, nibble j and lane l,
 * w[64i + 8j + l] is q * 2^4j for j < 7 (its masked lane; the activations carry 2^-4j) and q for j = 7. A partial last
 * chunk reads zeros. */
static void int4_panel(const uint8_t *q, int64_t kh, int64_t nc, float *w) {
    for (int64_t i = 0; i < nc; i++) {
        __m256i v;
        if (kh - i * 32 >= 32)
            v = _mm256_loadu_si256((const __m256i *)(q + i * 32));
        else {
            uint8_t part[32] = {0};
            memcpy(part, q + i * 32, (size_t)(kh - i * 32));
            v = _mm256_loadu_si256((const __m256i *)part);
        }
        for (int j = 0; j < 8; j++)
            _mm256_store_ps(w + i * 64 + 8 * j,
                            _mm256_cvtepi32_ps(j < 7 ? _mm256_and_si256(v, _mm256_set1_epi32(0xF << (4 * j)))
                                                     : _mm256_srli_epi32(v, 28)));
    }
}

INLINE void int4_rows_tile(const float *xt, const float *dt, const float *wp, int64_t kp, const float *s,
                           const float *z, float *y, int64_t ldy, int rows, int64_t K, int64_t G, const int C) {
    const int64_t ng = K / G, nc = kp / 64;
    __m256 out[RP_VECS][RP_COLS][8];
    for (int v = 0; v < RP_VECS; v++)
        for (int c = 0; c < C; c++)
            for (int l = 0; l < 8; l++) out[v][c][l] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nc; i++)
        for (int l = 0; l < 8; l++) {
            const int64_t kk = 64 * i + 8 * l, g = (kk < K ? kk : K - 1) / G; /* a padded lane: the last group */
            __m256 acc[RP_VECS][RP_COLS];
            const float *xa = xt + (64 * i + 8 * l) * 16, *wa = wp + 64 * i + l; /* x in k order, w in (i, j, l) */
            {
                const __m256 x0 = _mm256_load_ps(xa), x1 = _mm256_load_ps(xa + 8);
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {
                    const __m256 w = _mm256_broadcast_ss(wa + c * kp);
                    acc[0][c] = _mm256_mul_ps(x0, w);
                    acc[1][c] = _mm256_mul_ps(x1, w);
                }
            }
            _Pragma("GCC unroll 8") for (int j = 1; j < 8; j++) {
                const __m256 x0 = _mm256_load_ps(xa + j * 16), x1 = _mm256_load_ps(xa + j * 16 + 8);
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {
                    const __m256 w = _mm256_broadcast_ss(wa + c * kp + 8 * j);
                    acc[0][c] = _mm256_fmadd_ps(x0, w, acc[0][c]);
                    acc[1][c] = _mm256_fmadd_ps(x1, w, acc[1][c]);
                }
            }
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {
                const __m256 sv = _mm256_broadcast_ss(s + c * ng + g);
                _Pragma("GCC unroll 2") for (int v = 0; v < RP_VECS; v++)
                    out[v][c][l] = _mm256_fmadd_ps(acc[v][c], sv, out[v][c][l]);
            }
        }
    /* add_zero_terms lane by lane (a lane past the last group adds 0 * 0, as its masked loads do), then hsum's
     * tree over the lanes; all on vectors of rows */
    for (int c = 0; c < C; c++) {
        for (int64_t g0 = 0; g0 < ng; g0 += 8)
            for (int l = 0; l < 8; l++) {
                const int64_t g = g0 + l;
                const __m256 zz = g < ng ? _mm256_set1_ps(fmaf(-8.0f, s[c * ng + g], z[c * ng + g]))
                                         : _mm256_setzero_ps();
                for (int v = 0; v < RP_VECS; v++) {
                    const __m256 d = g < ng ? _mm256_load_ps(dt + g * 16 + 8 * v) : _mm256_setzero_ps();
                    out[v][c][l] = _mm256_fmadd_ps(zz, d, out[v][c][l]);
                }
            }
        for (int v = 0; v < RP_VECS; v++) store_rows(lane_sum(out[v][c]), y + 8 * v * ldy + c, ldy, rows - 8 * v);
    }
}

/* m >= RP_MIN_ROWS rows: activations transposed per block of 16 rows (xt [block][kp][16], the 2^-4j scaling of
 * INT4_TILE's), their group sums likewise (dt [block][ng][16]); each thread widens its columns RP_COLS at a time
 * and runs them over the row blocks of a chunk that stays in L2. */
static int int4_rows(const float *x, int64_t ldx, const uint8_t *q, const float *s, const float *z, float *y,
                     int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t g, int nthreads) {
    const int64_t ng = k / g, kh = k / 2, nc = (k + 63) / 64, kp = nc * 64, blocks = (m + 15) / 16;
    /* (i, l, j) order is plain k order; the group sums dt [block][ng][16] follow the activations */
    float *xt = transpose_rows(x, ldx, m, k, kp, 1, (size_t)(blocks * ng * 16));
    if (!xt) return -2;
    float *dt = xt + blocks * kp * 16;
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        for (int64_t gi = 0; gi < ng; gi++) {
            float t = 0.0f;
            for (int64_t kk = gi * g; kk < (gi + 1) * g; kk++) t += xr[kk];
            dt[(r / 16) * ng * 16 + gi * 16 + r % 16] = t;
        }
    }
    const int64_t chunk_blocks = (row_chunk(k) + 15) / 16;
    int rc = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int64_t n0, n1;
        float *wp = thread_panel(n, (size_t)(RP_COLS * kp), &n0, &n1, &rc);
        for (int64_t b0 = 0; wp && b0 < blocks; b0 += chunk_blocks) {
            const int64_t b1 = b0 + chunk_blocks < blocks ? b0 + chunk_blocks : blocks;
            for (int64_t c0 = n0; c0 < n1; c0 += RP_COLS) {
                const int cc = (int)(n1 - c0 < RP_COLS ? n1 - c0 : RP_COLS);
                for (int c = 0; c < cc; c++) int4_panel(q + (c0 + c) * kh, kh, nc, wp + c * kp);
                for (int64_t b = b0; b < b1; b++) {
                    const int rows = (int)(m - b * 16 < 16 ? m - b * 16 : 16);
                    const float *xb = xt + b * kp * 16, *db = dt + b * ng * 16;
                    float *yb = y + b * 16 * ldy + c0;
                    const float *sc = s + c0 * ng, *zc = z + c0 * ng;
                    switch (cc) {
                    case 1: int4_rows_tile(xb, db, wp, kp, sc, zc, yb, ldy, rows, k, g, 1); break;
                    case 2: int4_rows_tile(xb, db, wp, kp, sc, zc, yb, ldy, rows, k, g, 2); break;
                    case 3: int4_rows_tile(xb, db, wp, kp, sc, zc, yb, ldy, rows, k, g, 3); break;
                    case 4: int4_rows_tile(xb, db, wp, kp, sc, zc, yb, ldy, rows, k, g, 4); break;
                    default: int4_rows_tile(xb, db, wp, kp, sc, zc, yb, ldy, rows, k, g, RP_COLS); break;
                    }
                }
            }
        }
        free(wp);
    }
    free(xt);
    return rc;
}
#endif

int llmd_int4_matmul(const float *x, int64_t ldx, const uint8_t *q, const float *s, const float *z, float *y,
                     int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t g, int nthreads) {
    if (m < 0 || n < 0 || k <= 0 || g <= 0 || k % g || g % 2) return -1;
    if (nthreads < 1) nthreads = 1;
    const int64_t ng = k / g, kh = k / 2;
#if defined(__AVX2__) && defined(__FMA__)
    if (g % 16) return -1;
    if (m >= RP_MIN_ROWS) return int4_rows(x, ldx, q, s, z, y, ldy, m, n, k, g, nthreads);
    /* Per row: the activations in the kernel's order (xp, see INT4_TILE; zero beyond K) and its group sums xs,
     * computed once per call in plain C (the same bits whichever rows share the call); per chunk its gather table. */
    const int64_t nc = (k + 63) / 64, kp = nc * 64;
    const size_t xp_bytes = (size_t)(m * kp) * 4, xs_bytes = ((size_t)(m * ng) * 4 + 31) / 32 * 32;
    char *buf = (char *)aligned_alloc(32, xp_bytes + xs_bytes + (size_t)nc * sizeof(int4_chunk) + 32);
    if (!buf) return -2;
    float *xp = (float *)buf, *xs = (float *)(buf + xp_bytes);
    int4_chunk *ch = (int4_chunk *)(buf + xp_bytes + xs_bytes);
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        for (int64_t i = 0; i < nc; i++)
            for (int j = 0; j < 8; j++) {
                const float scale = j < 7 ? 1.0f / (float)(1 << (4 * j)) : 1.0f;
                for (int l = 0; l < 8; l++) {
                    const int64_t kk = i * 64 + 8 * l + j;
                    xp[i * m * 64 + r * 64 + 8 * j + l] = kk < k ? xr[kk] * scale : 0.0f;
                }
            }
        for (int64_t gi = 0; gi < ng; gi++) {
            float t = 0.0f;
            for (int64_t kk = gi * g; kk < (gi + 1) * g; kk++) t += xr[kk];
            xs[r * ng + gi] = t;
        }
    }
    for (int64_t i = 0; i < nc; i++) {
        const int64_t g0 = i * 64 / g, glast = ((i * 64 + 64 < k ? i * 64 + 64 : k) - 1) / g;
        int32_t idx[8], keep[8];
        for (int l = 0; l < 8; l++) {
            const int64_t kk = i * 64 + 8 * l;
            idx[l] = (int32_t)((kk < k ? kk / g : glast) - g0);
            keep[l] = l <= glast - g0 ? -1 : 0;
        }
        ch[i].idx = _mm256_loadu_si256((const __m256i *)idx);
        ch[i].keep = _mm256_loadu_si256((const __m256i *)keep);
        ch[i].g0 = g0;
    }
    const int64_t chunk = row_chunk(k);
#endif
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid, nth;
        thread_id(&tid, &nth);
        int64_t n0, n1;
        column_range(n, tid, nth, &n0, &n1);
#if defined(__AVX2__) && defined(__FMA__)
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            const int tc = (m1 - m0) == 1 ? INT4_TILE_C1 : INT4_TILE_CM;
            for (int64_t c0 = n0; c0 < n1; c0 += tc) {
                const int cc = (int)(n1 - c0 < tc ? n1 - c0 : tc);
                for (int64_t r0 = m0; r0 < m1; r0 += INT4_TILE_R) {
                    const int rr = (int)(m1 - r0 < INT4_TILE_R ? m1 - r0 : INT4_TILE_R);
                    INT4_TILES[cc - 1][rr - 1](xp + r0 * 64, m * 64, xs + r0 * ng, ch, q + c0 * kh, s + c0 * ng,
                                               z + c0 * ng, y + r0 * ldy + c0, ldy, k, g);
                }
            }
        }
#else
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = n0; c < n1; c++) {
                float t = 0.0f;
                for (int64_t i = 0; i < k; i++) {
                    const uint8_t b = q[c * kh + i / 2];
                    const float v = (float)((i & 1) ? b >> 4 : b & 0xF) - 8.0f;
                    t += x[r * ldx + i] * (v * s[c * ng + i / g] + z[c * ng + i / g]);
                }
                y[r * ldy + c] = t;
            }
#endif
    }
#if defined(__AVX2__) && defined(__FMA__)
    free(buf);
#endif
    return 0;
}

/* ==== Integer path: int8-quantized activations ================================================================
 *
 * Each activation row is quantized to int8 in blocks of 32 along K: d = amax / 127, q = round(x * (127 / amax))
 * (ties to even), so x ~ d * q. Every block of 32 weights then meets a block of 32 activation bytes in an integer
 * dot product (AVX2: _mm256_maddubs_epi16 unsigned x signed bytes -> int16 pairs, _mm256_madd_epi16 -> 8 int32),
 * which is exact, and one fp32 FMA per block adds it scaled by d * s:
 *   int8 weights w = q_w * s:              sum_k x_k w_k = sum_b d_b s_g dot_b(q_x, q_w)
 *   int4 weights w = (q_w - 8) s + z:     sum_k x_k w_k = sum_b d_b s_g dot_b(q_x, q_w) + sum_g (z_g - 8 s_g) D_g
 * with q_w in 0..15 as the unsigned operand and D_g = sum over the group's blocks of d_b * sum(q_x). int8 weights
 * are signed: their absolute value is the unsigned operand and their sign moves onto the activation byte.
 *
 * A row's quantization depends on that row only, and each output's float operations (per block, in block order,
 * then the fixed horizontal sum and the zero term) are the same in every tile shape, row count and thread count,
 * so batching never changes a row's result. K and the weight group must be multiples of 32.
 *
 * Work buffer (caller-owned, llmd_q8_work_bytes): per row the block scales d [K/32] fp32, the group sums D [K/G]
 * fp32, then the bytes q_x [K]. For int4 each block's bytes are stored as [even k | odd k] to meet the low and high
 * nibbles of 16 packed bytes. */

int64_t llmd_q8_work_bytes(int64_t m, int64_t k, int64_t g) {
    if (m < 0 || k <= 0 || g <= 0 || k % QB || g % QB || k % g) return -1;
    return m * (k / QB * 4 + k / g * 4 + k);
}

#if defined(__AVX2__) && defined(__FMA__)

/* Prefetch the block PF_TILES tiles ahead: a tile's C columns are one contiguous run, consumed BYTES per block. */
#define PREFETCH_TILE(base, C, BYTES, b)                                                                           \
    _Pragma("GCC unroll 8") for (int p = 0; p < (C) * (BYTES); p += 64)                                           \
        _mm_prefetch((const char *)(base) + PF_TILES * (C) * (BYTES) * nb + (b) * (C) * (BYTES) + p, _MM_HINT_T0)

/* Per block of rows r and column c: acc += float(dot) * (d_b * s_g). */
#define Q8_BLOCK_FMA(acc, u, s, dv, sv)                                                                            \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT_U8S8(u, s)), _mm256_mul_ps(dv, sv), acc)

/* A block's 16 bytes of int4 nibbles as 32 codes 0..15 in the work buffer's order: low nibbles, then high ones */
INLINE __m256i q4_codes(const uint8_t *qb) {
    const __m128i p = _mm_loadu_si128((const __m128i *)qb);
    return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), _mm256_set1_epi8(0x0F));
}

/* R rows (quantized: bytes xq with stride K, block scales xd stride nb, group sums xD stride ng) x C columns of int4
 * weights (INT4: a block's nibbles the unsigned operand as they are, then the zero terms) or int8 ones (their absolute
 * value the unsigned operand, their sign moved onto the activation bytes). */
#define Q8_TILE(T, INT4, R, C)                                                                                     \
    static void T##_tile_##R##_##C(const int8_t *xq, const float *xd, const float *xD, const void *qv,             \
                                   const float *s, const float *z, float *y, int64_t ldy, int64_t K, int64_t G) { \
        const int64_t nb = K / QB, ng = K / G, bpg = G / QB, wb = INT4 ? QB / 2 : QB, ldq = INT4 ? K / 2 : K;      \
        const uint8_t *q = (const uint8_t *)qv;                                                                    \
        __m256 acc[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                      \
        int64_t g = 0, gb = 0;                                                                                     \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            PREFETCH_TILE(q, C, wb, b);                                                                            \
            __m256i xv[R];                                                                                         \
            __m256 dv[R];                                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                 \
                xv[r] = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QB));                               \
                dv[r] = _mm256_broadcast_ss(xd + r * nb + b);                                                      \
            }                                                                                                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                 \
                const uint8_t *qb = q + c * ldq + b * wb;                                                          \
                const __m256i w = INT4 ? q4_codes(qb) : _mm256_loadu_si256((const __m256i *)qb);                   \
                const __m256i u = INT4 ? w : _mm256_abs_epi8(w); /* the unsigned operand */                        \
                const __m256 sv = _mm256_broadcast_ss(s + c * ng + g);                                             \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                               \
                    Q8_BLOCK_FMA(acc[r][c], u, INT4 ? xv[r] : _mm256_sign_epi8(xv[r], w), dv[r], sv);              \
            }                                                                                                      \
            if (++gb == bpg) {                                                                                     \
                gb = 0;                                                                                            \
                g++;                                                                                               \
            }                                                                                                      \
        }                                                                                                          \
        if (INT4)                                                                                                  \
            for (int c = 0; c < C; c++) add_zero_terms(&acc[0][c], R, C, s + c * ng, z + c * ng, xD, ng);          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++) y[r * ldy + c] = hsum(acc[r][c]);                                          \
    }
#define Q4_TILE(R, C) Q8_TILE(q4, 1, R, C)
#define Q8W_TILE(R, C) Q8_TILE(q8w, 0, R, C)

#ifndef Q8_TILE_R
#define Q8_TILE_R 4
#endif
#ifndef Q8_TILE_CM
#define Q8_TILE_CM 2
#endif
#define Q8_TILE_C1 8

ALL_TILES(Q4_TILE)
ALL_TILES(Q8W_TILE)

/* One signature for both weight kinds (int8 ignores z and D). */
typedef void (*q8_tile_fn)(const int8_t *, const float *, const float *, const void *, const float *, const float *,
                           float *, int64_t, int64_t, int64_t);
static const q8_tile_fn Q4_TILES[8][4] = ALL_TILES_TABLE(q4_tile);
static const q8_tile_fn Q8W_TILES[8][4] = ALL_TILES_TABLE(q8w_tile);

#else /* scalar: the same sums, one output at a time */

static float q8_scalar_dot(const int8_t *xq, const float *xd, const float *xD, const void *qv, const float *s,
                           const float *z, int64_t K, int64_t G, int int4) {
    const int64_t nb = K / QB, ng = K / G, bpg = G / QB;
    float t = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        int32_t dot = 0;
        for (int i = 0; i < QB; i++) {
            int w;
            if (int4) {
                const uint8_t byte = ((const uint8_t *)qv)[b * 16 + (i & 15)];
                w = i < 16 ? byte & 0xF : byte >> 4;  /* xq holds [even k | odd k] */
            } else {
                w = ((const int8_t *)qv)[b * QB + i];
            }
            dot += w * xq[b * QB + i];
        }
        t += (float)dot * (xd[b] * s[b / bpg]);
    }
    if (int4)
        for (int64_t i = 0; i < ng; i++) t += (z[i] - 8.0f * s[i]) * xD[i];
    return t;
}

#endif

static int q8_matmul(const float *x, int64_t ldx, const void *q, const float *s, const float *z, float *y,
                     int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t g, void *work, int nthreads, int int4) {
    if (m < 0 || n < 0 || llmd_q8_work_bytes(m, k, g) < 0 || (m > 0 && !work)) return -1;
    if (nthreads < 1) nthreads = 1;
    const int64_t nb = k / QB, ng = k / g, wrow = int4 ? k / 2 : k;
    const float *xd = (const float *)work, *xD = xd + m * nb;
    const int8_t *xq = (const int8_t *)(xD + m * ng);
    const int64_t chunk = (256 * 1024) / k < 8 ? 8 : (256 * 1024) / k;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid, nth;
        thread_id(&tid, &nth);
        /* each thread quantizes a share of the rows (a row's bytes do not depend on who does it) */
        quantize_rows(x, ldx, m * tid / nth, m * (tid + 1) / nth, k, g, int4, work, m);
#pragma omp barrier
        int64_t n0, n1;
        column_range(n, tid, nth, &n0, &n1);
#if defined(__AVX2__) && defined(__FMA__)
        const q8_tile_fn(*tiles)[4] = int4 ? Q4_TILES : Q8W_TILES;
        const uint8_t *qb = (const uint8_t *)q;
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            const int tc = (m1 - m0) == 1 ? Q8_TILE_C1 : Q8_TILE_CM;
            for (int64_t c0 = n0; c0 < n1; c0 += tc) {
                const int cc = (int)(n1 - c0 < tc ? n1 - c0 : tc);
                for (int64_t r0 = m0; r0 < m1; r0 += Q8_TILE_R) {
                    const int rr = (int)(m1 - r0 < Q8_TILE_R ? m1 - r0 : Q8_TILE_R);
                    tiles[cc - 1][rr - 1](xq + r0 * k, xd + r0 * nb, xD + r0 * ng, qb + c0 * wrow, s + c0 * ng,
                                          int4 ? z + c0 * ng : NULL, y + r0 * ldy + c0, ldy, k, g);
                }
            }
        }
#else
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = n0; c < n1; c++)
                y[r * ldy + c] = q8_scalar_dot(xq + r * k, xd + r * nb, xD + r * ng,
                                               (const uint8_t *)q + c * wrow, s + c * ng, int4 ? z + c * ng : NULL,
                                               k, g, int4);
#endif
    }
    return 0;
}

/* int8 weights [N, K] (scales [N, K/G]) with int8-quantized activations; work: llmd_q8_work_bytes(m, k, g). */
int llmd_int8_matmul_q8(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y, int64_t ldy,
                        int64_t m, int64_t n, int64_t k, int64_t g, void *work, int nthreads) {
    return q8_matmul(x, ldx, q, s, NULL, y, ldy, m, n, k, g, work, nthreads, 0);
}

/* int4 weights [N, K/2] (scales, zeros [N, K/G]) with int8-quantized activations. */
int llmd_int4_matmul_q8(const float *x, int64_t ldx, const uint8_t *q, const float *s, const float *z, float *y,
                        int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t g, void *work, int nthreads) {
    return q8_matmul(x, ldx, q, s, z, y, ldy, m, n, k, g, work, nthreads, 1);
}

