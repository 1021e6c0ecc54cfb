/* Weight-only quantized matmul on the CPU: y[M, N] = x[M, K] @ dequant(W).T with fp32 activations.
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

/* u8 x s8 dot product of 32 bytes -> 8 int32 lanes of 4 products each: one vpdpbusd where VNNI is built in, else
 * maddubs (int16 pairs) + madd. The same integers either way: no operand pair here reaches int16 saturation. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_U8S8_ACC(acc, u, s) _mm256_dpbusd_epi32(acc, u, s)
#elif defined(__AVXVNNI__)
#define DOT_U8S8_ACC(acc, u, s) _mm256_dpbusd_avx_epi32(acc, u, s)
#endif
#ifdef DOT_U8S8_ACC
#define DOT_U8S8(u, s) DOT_U8S8_ACC(_mm256_setzero_si256(), u, s)
#else
#define DOT_U8S8(u, s) _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1))
#endif

int llmd_cpu_gemm_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
#endif
}

/* This thread's number and the team's size (0 and 1 outside a parallel region or without OpenMP). */
static void thread_id(int *tid, int *nth) {
    *tid = 0;
    *nth = 1;
#ifdef _OPENMP
    *tid = omp_get_thread_num();
    *nth = omp_get_num_threads();
#endif
}

/* Threads split the output columns in units of 8; returns this thread's [n0, n1). */
static void column_range(int64_t n, int tid, int nth, int64_t *n0, int64_t *n1) {
    int64_t units = (n + 7) / 8;
    int64_t u0 = units * tid / nth, u1 = units * (tid + 1) / nth;
    *n0 = u0 * 8;
    *n1 = u1 * 8 < n ? u1 * 8 : n;
}

/* Rows per chunk: enough that a chunk of activations stays within ~256 KiB. */
static int64_t row_chunk(int64_t k) {
    int64_t rows = (256 * 1024 / 4) / (k > 0 ? k : 1);
    return rows < 8 ? 8 : rows;
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

/* Horizontal sum in a fixed order. */
INLINE float hsum(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}

/* Tiles of R rows x C columns are generated per shape (the sizes must be compile-time constants so that the
 * accumulators live in registers). */

/* The columns of one tile are separate short runs of memory (a few hundred bytes each), too short for the hardware
 * prefetcher to ramp up: each k-step prefetches one cache line of the tile PF_TILES ahead (whose C rows of
 * weights are one contiguous block), so that block arrives while this one is used. */
#ifndef PF_TILES
#define PF_TILES 2
#endif

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
/* [C - 1][R - 1]; C > 4 only for one row */
static const int8_tile_fn INT8_TILES[8][4] = {
    ROW_OF(int8_tile, 1), ROW_OF(int8_tile, 2), ROW_OF(int8_tile, 3), ROW_OF(int8_tile, 4),
    {int8_tile_1_5}, {int8_tile_1_6}, {int8_tile_1_7}, {int8_tile_1_8}};
static const panel_tile_fn PANEL_TILES[PANEL_C][4] = {ROW_OF(panel_tile, 1), ROW_OF(panel_tile, 2)};
static const int4_tile_fn INT4_TILES[8][4] = {
    ROW_OF(int4_tile, 1), ROW_OF(int4_tile, 2), ROW_OF(int4_tile, 3), ROW_OF(int4_tile, 4),
    {int4_tile_1_5}, {int4_tile_1_6}, {int4_tile_1_7}, {int4_tile_1_8}};

/* ---- many rows: vector lanes over rows (int8 and int4) --------------------------------------------------------
 * The tiles above put k in the vector lanes. From RP_MIN_ROWS rows a register instead holds one lane's running sum
 * for 8 rows at once: each weight is widened to fp32 once into a panel and broadcast, and an activation vector (8 rows
 * of one k, stored transposed) serves RP_COLS columns, so 2 x RP_COLS independent FMA chains keep both FMA units
 * busy. Every output gets the very operations of the tiles above in the same order (the lanes' sums, then hsum's
 * tree), so results are bit-identical whatever path a row takes (tested). */
#define RP_VECS 2 /* row vectors per tile: 16 rows */
#define RP_COLS 5 /* columns per tile: 10 accumulators, 2 activations and a weight fit the 16 registers */
#define RP_MIN_ROWS 16

/* Rows [0, m) of x, transposed per block of 16 rows into xt [block][kp][16] (k order; zero past K and past m); int4:
 * each value scaled as INT4_TILE scales it (2^-4j for nibble j = k % 8 < 7, its masked weights carrying 2^4j). */
static void transpose_into(float *xt, const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int int4) {
    memset(xt, 0, (size_t)((m + 15) / 16 * kp * 16) * 4);
    for (int64_t r = 0; r < m; r++) {
        float *xb = xt + (r / 16) * kp * 16 + r % 16;
        for (int64_t kk = 0; kk < k; kk++) {
            const int j = (int)(kk % 8);
            xb[kk * 16] = int4 && j < 7 ? x[r * ldx + kk] * (1.0f / (float)(1 << (4 * j))) : x[r * ldx + kk];
        }
    }
}

/* transpose_into a new buffer (32-byte aligned; NULL when out of memory) */
static float *transpose_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int int4,
                             size_t extra_floats) {
    const size_t floats = (size_t)((m + 15) / 16 * kp * 16);
    float *xt = (float *)aligned_alloc(32, ((floats + extra_floats) * 4 + 31) / 32 * 32);
    if (!xt) return NULL;
    memset(xt + floats, 0, extra_floats * 4);
    transpose_into(xt, x, ldx, m, k, kp, int4);
    return xt;
}

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

/* The rows-in-lanes loop of int8_rows and gguf_rows: x transposed in chunks of 16-row blocks, each thread's columns
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

#define QB 32

int64_t llmd_q8_work_bytes(int64_t m, int64_t k, int64_t g) {
    if (m < 0 || k <= 0 || g <= 0 || k % QB || g % QB || k % g) return -1;
    return m * (k / QB * 4 + k / g * 4 + k);
}

/* the largest |x| of a block of 32 */
static float block_amax(const float *xb) {
    float amax = 0.0f;
    for (int i = 0; i < QB; i++) {
        const float a = xb[i] < 0 ? -xb[i] : xb[i];
        amax = a > amax ? a : amax;
    }
    return amax;
}

/* Plain C (identical in every build): a row of K = nb * 32 values -> xq, d [nb], D [ng]. */
static void quantize_row(const float *x, int64_t k, int64_t g, int interleave, int8_t *xq, float *d, float *D) {
    const int64_t nb = k / QB, bpg = g / QB;
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * QB, amax = block_amax(xb);
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        int8_t *qb = xq + b * QB;
        for (int i = 0; i < QB; i++) {
            const int v = (int)__builtin_nearbyintf(xb[i] * id);
            sum += v;
            qb[interleave ? (i & 1) * 16 + (i >> 1) : i] = (int8_t)v;
        }
        d[b] = amax / 127.0f;
        const float ds = d[b] * (float)sum;
        if (b % bpg == 0) D[b / bpg] = ds;
        else D[b / bpg] += ds;
    }
}

/* Quantize rows [r0, r1) of x into the work buffer. */
static void quantize_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, int64_t g, int interleave,
                          void *work, int64_t m) {
    const int64_t nb = k / QB, ng = k / g;
    float *d = (float *)work, *D = d + m * nb;
    int8_t *xq = (int8_t *)(D + m * ng);
    for (int64_t r = r0; r < r1; r++) quantize_row(x + r * ldx, k, g, interleave, xq + r * k, d + r * nb, D + r * ng);
}

#if defined(__AVX2__) && defined(__FMA__)

/* Prefetch the block PF_TILES tiles ahead: a tile's C columns are one contiguous run, consumed BYTES per block. */
#define PREFETCH_TILE(base, C, BYTES, b)                                                                           \
    _Pragma("GCC unroll 8") for (int p = 0; p < (C) * (BYTES); p += 64)                                           \
        _mm_prefetch((const char *)(base) + PF_TILES * (C) * (BYTES) * nb + (b) * (C) * (BYTES) + p, _MM_HINT_T0)

/* Per block of rows r and column c: acc += float(dot) * (d_b * s_g). */
#define Q8_BLOCK_FMA(acc, u, s, dv, sv)                                                                            \
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(DOT_U8S8(u, s)), _mm256_mul_ps(dv, sv), acc)

/* R rows (quantized: bytes xq with stride K, block scales xd stride nb, group sums xD stride ng) x C columns. */
#define Q4_TILE(R, C)                                                                                              \
    static void q4_tile_##R##_##C(const int8_t *xq, const float *xd, const float *xD, const uint8_t *q,          \
                                  const float *s, const float *z, float *y, int64_t ldy, int64_t K, int64_t G) {  \
        const int64_t nb = K / QB, ng = K / G, bpg = G / QB, kh = K / 2;                                          \
        const __m256i mask = _mm256_set1_epi8(0x0F);                                                             \
        __m256 acc[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                      \
        int64_t g = 0, gb = 0;                                                                                     \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            PREFETCH_TILE(q, C, 16, b);                                                                            \
            __m256i xv[R];                                                                                         \
            __m256 dv[R];                                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                 \
                xv[r] = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QB));                               \
                dv[r] = _mm256_broadcast_ss(xd + r * nb + b);                                                      \
            }                                                                                                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                 \
                const __m128i p = _mm_loadu_si128((const __m128i *)(q + c * kh + b * 16));                        \
                const __m256i w = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(p, 4), p), mask);              \
                const __m256 sv = _mm256_broadcast_ss(s + c * ng + g);                                             \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                               \
                    Q8_BLOCK_FMA(acc[r][c], w, xv[r], dv[r], sv);                                                      \
            }                                                                                                      \
            if (++gb == bpg) {                                                                                     \
                gb = 0;                                                                                            \
                g++;                                                                                               \
            }                                                                                                      \
        }                                                                                                          \
        for (int c = 0; c < C; c++) add_zero_terms(&acc[0][c], R, C, s + c * ng, z + c * ng, xD, ng);          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++) y[r * ldy + c] = hsum(acc[r][c]);                                          \
    }

#define Q8W_TILE(R, C)                                                                                             \
    static void q8w_tile_##R##_##C(const int8_t *xq, const float *xd, const float *xD, const int8_t *q,          \
                                   const float *s, const float *z, float *y, int64_t ldy, int64_t K, int64_t G) { \
        (void)xD;                                                                                                  \
        (void)z;                                                                                                   \
        const int64_t nb = K / QB, ng = K / G, bpg = G / QB;                                                      \
        __m256 acc[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                      \
        int64_t g = 0, gb = 0;                                                                                     \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            PREFETCH_TILE(q, C, 32, b);                                                                            \
            __m256i xv[R];                                                                                         \
            __m256 dv[R];                                                                                          \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                 \
                xv[r] = _mm256_loadu_si256((const __m256i *)(xq + r * K + b * QB));                               \
                dv[r] = _mm256_broadcast_ss(xd + r * nb + b);                                                      \
            }                                                                                                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                 \
                const __m256i w = _mm256_loadu_si256((const __m256i *)(q + c * K + b * QB));                      \
                const __m256i aw = _mm256_abs_epi8(w);                                                             \
                const __m256 sv = _mm256_broadcast_ss(s + c * ng + g);                                             \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                               \
                    Q8_BLOCK_FMA(acc[r][c], aw, _mm256_sign_epi8(xv[r], w), dv[r], sv);                                \
            }                                                                                                      \
            if (++gb == bpg) {                                                                                     \
                gb = 0;                                                                                            \
                g++;                                                                                               \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++) y[r * ldy + c] = hsum(acc[r][c]);                                          \
    }

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
#define Q_ROW(T, C) {(q8_tile_fn)T##_1_##C, (q8_tile_fn)T##_2_##C, (q8_tile_fn)T##_3_##C, (q8_tile_fn)T##_4_##C}
static const q8_tile_fn Q4_TILES[8][4] = {
    Q_ROW(q4_tile, 1), Q_ROW(q4_tile, 2), Q_ROW(q4_tile, 3), Q_ROW(q4_tile, 4),
    {(q8_tile_fn)q4_tile_1_5}, {(q8_tile_fn)q4_tile_1_6}, {(q8_tile_fn)q4_tile_1_7}, {(q8_tile_fn)q4_tile_1_8}};
static const q8_tile_fn Q8W_TILES[8][4] = {
    Q_ROW(q8w_tile, 1), Q_ROW(q8w_tile, 2), Q_ROW(q8w_tile, 3), Q_ROW(q8w_tile, 4),
    {(q8_tile_fn)q8w_tile_1_5}, {(q8_tile_fn)q8w_tile_1_6}, {(q8_tile_fn)q8w_tile_1_7}, {(q8_tile_fn)q8w_tile_1_8}};

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

/* ==== GGUF blocks: matmul straight from the file's block bytes ==================================================
 *
 * Weights: q uint8 [N, row bytes], each row K / block_elems blocks of a GGML type (layouts and the reference values:
 * llmd.kernels.gguf_blocks). llmd_gguf_dequant gives exactly the values of gguf.quants.dequantize (fp16 -> fp32
 * exactly, scale products first, then scale * q, then the offset, each rounded: this file is built with
 * -ffp-contract=off, so no multiply-add is fused). The matmul (llmd_gguf_matmul, see "The GGUF matmul" below) does
 * not dequantize: it multiplies the blocks' integer codes with the activations per sub-block and applies each
 * sub-block's scale and offset once, in one fixed order per output, so a row's result is the same bits whatever the
 * batch, its position, the path or the thread count. */

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

static const float IQ4_KV[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
/* MXFP4's E2M1 codes as ggml keeps them: the values doubled (the scale halved, gguf_e8m0_half) */
static const float MXFP4_KV[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* An E8M0 exponent byte -> 2^(e - 128) exactly (ggml's ggml_e8m0_to_fp32_half: e = 0, 1 are fp32 subnormals). */
static inline float gguf_e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

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

static inline uint32_t gguf_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
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

__attribute__((unused)) static void dq_q2_k(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 84, w += 256) {
        const uint8_t *sc = q, *qs = q + 16;
        const float d = gguf_f16(q + 80), dmin = gguf_f16(q + 82);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int half = 0; half < 2; half++) { /* sub-block s = 8h + 2t + half: 16 elements */
                    const int s = 8 * h + 2 * t + half;
                    const float dl = d * (float)(sc[s] & 0xF), ml = dmin * (float)(sc[s] >> 4);
                    float *o = w + 16 * s;
                    const uint8_t *src = qs + 32 * h + 16 * half;
                    for (int l = 0; l < 16; l++) o[l] = dl * (float)((src[l] >> (2 * t)) & 3) - ml;
                }
    }
}

__attribute__((unused)) static void dq_q3_k(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 110, w += 256) {
        const uint8_t *hm = q, *qs = q + 32, *sb = q + 96;
        const float d = gguf_f16(q + 108);
        float dl[16];
        for (int s = 0; s < 16; s++) {
            const int low = s < 8 ? sb[s] & 0xF : sb[s - 8] >> 4, high = (sb[8 + s % 4] >> (2 * (s / 4))) & 3;
            dl[s] = d * (float)((int8_t)(low | high << 4) - 32);
        }
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++) {
                const int bit = 4 * h + t; /* element j = 128h + 32t + l: hmask bit j / 32 */
                for (int half = 0; half < 2; half++) {
                    const int s = 8 * h + 2 * t + half;
                    float *o = w + 16 * s;
                    const uint8_t *src = qs + 32 * h + 16 * half, *hs = hm + 16 * half;
                    for (int l = 0; l < 16; l++)
                        o[l] = dl[s] * (float)((int)((src[l] >> (2 * t)) & 3) - (((hs[l] >> bit) & 1) ? 0 : 4));
                }
            }
    }
}

/* Q4_K / Q5_K: the 6-bit scale and min of sub-block s from the 12 scale bytes. */
static inline void scale_min_k4(const uint8_t *b, int s, int *sc, int *mn) {
    if (s < 4) {
        *sc = b[s] & 63;
        *mn = b[s + 4] & 63;
    } else {
        *sc = (b[s + 4] & 0xF) | (b[s - 4] >> 6) << 4;
        *mn = (b[s + 4] >> 4) | (b[s] >> 6) << 4;
    }
}

__attribute__((unused)) static void dq_q4_k(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 144, w += 256) {
        const float d = gguf_f16(q), dmin = gguf_f16(q + 2);
        const uint8_t *qs = q + 16;
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                int sc, mn;
                scale_min_k4(q + 4, 2 * c + h, &sc, &mn);
                const float a = d * (float)sc, m = dmin * (float)mn;
                float *o = w + 64 * c + 32 * h;
                const uint8_t *src = qs + 32 * c;
                for (int l = 0; l < 32; l++) o[l] = a * (float)((src[l] >> (4 * h)) & 0xF) - m;
            }
    }
}

__attribute__((unused)) static void dq_q5_k(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 176, w += 256) {
        const float d = gguf_f16(q), dmin = gguf_f16(q + 2);
        const uint8_t *qh = q + 16, *qs = q + 48;
        for (int c = 0; c < 4; c++)
            for (int h = 0; h < 2; h++) {
                const int s = 2 * c + h;
                int sc, mn;
                scale_min_k4(q + 4, s, &sc, &mn);
                const float a = d * (float)sc, m = dmin * (float)mn;
                float *o = w + 32 * s;
                const uint8_t *src = qs + 32 * c;
                for (int l = 0; l < 32; l++)
                    o[l] = a * (float)(((src[l] >> (4 * h)) & 0xF) | ((qh[l] >> s) & 1) << 4) - m;
            }
    }
}

__attribute__((unused)) static void dq_q6_k(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 210, w += 256) {
        const uint8_t *ql = q, *qh = q + 128;
        const int8_t *sc = (const int8_t *)(q + 192);
        const float d = gguf_f16(q + 208);
        for (int h = 0; h < 2; h++)
            for (int t = 0; t < 4; t++)
                for (int half = 0; half < 2; half++) {
                    const int s = 8 * h + 2 * t + half;
                    const float a = d * (float)sc[s];
                    float *o = w + 16 * s;
                    const uint8_t *lo = ql + 64 * h + 32 * (t & 1) + 16 * half, *hi = qh + 32 * h + 16 * half;
                    const int shift = 4 * (t >> 1);
                    for (int l = 0; l < 16; l++)
                        o[l] = a * (float)((int)(((lo[l] >> shift) & 0xF) | ((hi[l] >> (2 * t)) & 3) << 4) - 32);
                }
    }
}

__attribute__((unused)) static void dq_iq4_xs(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 136, w += 256) {
        const float d = gguf_f16(q);
        const uint32_t sh = (uint32_t)q[2] | (uint32_t)q[3] << 8;
        const uint8_t *sl = q + 4, *qs = q + 8;
        for (int s = 0; s < 8; s++) {
            const int sc = (int)(((sl[s / 2] >> (4 * (s % 2))) & 0xF) | ((sh >> (2 * s)) & 3) << 4) - 32;
            const float a = d * (float)sc;
            float *o = w + 32 * s;
            for (int t = 0; t < 16; t++) o[t] = a * IQ4_KV[qs[16 * s + t] & 0xF];
            for (int t = 0; t < 16; t++) o[16 + t] = a * IQ4_KV[qs[16 * s + t] >> 4];
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* The vector dequantizers (llmd_gguf_dequant: the embeddings' rows, the reference's values): integer codes decoded
 * with byte operations, widened exactly to fp32, then the same multiplications and additions as the scalar ones above
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

INLINE void blk_iq4_xs(const uint8_t *q, float *w) {
    const float d = gguf_f16(q);
    const uint32_t sh = (uint32_t)q[2] | (uint32_t)q[3] << 8;
    for (int s = 0; s < 8; s++) {
        const int sc = (int)(((q[4 + s / 2] >> (4 * (s % 2))) & 0xF) | ((sh >> (2 * s)) & 3) << 4) - 32;
        const float a = d * (float)sc;
        emit32(iq4_lookup(nibbles32(q + 8 + 16 * s)), a, a, 0, OFF_NONE, w + 32 * s);
    }
}

INLINE void blk_q4_k(const uint8_t *q, float *w) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const float d = gguf_f16(q), dmin = gguf_f16(q + 2);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 + 32 * c));
        for (int h = 0; h < 2; h++) {
            int sc, mn;
            scale_min_k4(q + 4, 2 * c + h, &sc, &mn);
            const float a = d * (float)sc, m = dmin * (float)mn;
            const __m256i codes = _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4);
            emit32(codes, a, a, m, OFF_SUB, w + 64 * c + 32 * h);
        }
    }
}

INLINE void blk_q5_k(const uint8_t *q, float *w) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
    const float d = gguf_f16(q), dmin = gguf_f16(q + 2);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 16));
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 48 + 32 * c));
        for (int h = 0; h < 2; h++) {
            const int s = 2 * c + h;
            int sc, mn;
            scale_min_k4(q + 4, s, &sc, &mn);
            const float a = d * (float)sc, m = dmin * (float)mn;
            const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(s)), one);
            const __m256i codes = _mm256_or_si256(_mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4),
                                                  _mm256_slli_epi16(hb, 4));
            emit32(codes, a, a, m, OFF_SUB, w + 32 * s);
        }
    }
}

INLINE void blk_q6_k(const uint8_t *q, float *w) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3), off = _mm256_set1_epi8(32);
    const int8_t *sc = (const int8_t *)(q + 192);
    const float d = gguf_f16(q + 208);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(q + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(q + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * h));
        for (int t = 0; t < 4; t++) {
            const __m256i lo = t & 1 ? l1 : l0;
            const __m256i low = _mm256_and_si256(t >> 1 ? _mm256_srli_epi16(lo, 4) : lo, m4);
            const __m256i high = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), m2);
            const __m256i codes = _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(high, 4)), off);
            const int s = 8 * h + 2 * t;
            emit32(codes, d * (float)sc[s], d * (float)sc[s + 1], 0, OFF_NONE, w + 128 * h + 32 * t);
        }
    }
}

INLINE void blk_q2_k(const uint8_t *q, float *w) {
    const __m256i m2 = _mm256_set1_epi8(3);
    const uint8_t *sc = q;
    const float d = gguf_f16(q + 80), dmin = gguf_f16(q + 82);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 + 32 * h));
        for (int t = 0; t < 4; t++) {
            const int s = 8 * h + 2 * t; /* elements 128h + 32t + l: sub-block s for l < 16, s + 1 after */
            const __m256i codes = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * t)), m2);
            emit32h(codes, d * (float)(sc[s] & 0xF), d * (float)(sc[s + 1] & 0xF), dmin * (float)(sc[s] >> 4),
                    dmin * (float)(sc[s + 1] >> 4), OFF_SUB, w + 128 * h + 32 * t);
        }
    }
}

INLINE void blk_q3_k(const uint8_t *q, float *w) {
    const __m256i m2 = _mm256_set1_epi8(3), one = _mm256_set1_epi8(1);
    const uint8_t *sb = q + 96;
    const float d = gguf_f16(q + 108);
    float dl[16];
    for (int s = 0; s < 16; s++) {
        const int low = s < 8 ? sb[s] & 0xF : sb[s - 8] >> 4, high = (sb[8 + s % 4] >> (2 * (s / 4))) & 3;
        dl[s] = d * (float)((int8_t)(low | high << 4) - 32);
    }
    const __m256i hm = _mm256_loadu_si256((const __m256i *)q);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 + 32 * h));
        for (int t = 0; t < 4; t++) {
            const int s = 8 * h + 2 * t;
            const __m256i crumbs = _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(2 * t)), m2);
            const __m256i hb = _mm256_and_si256(_mm256_srl_epi16(hm, _mm_cvtsi32_si128(4 * h + t)), one);
            const __m256i minus4 = _mm256_slli_epi16(_mm256_xor_si256(hb, one), 2); /* 4 where the bit is clear */
            emit32(_mm256_sub_epi8(crumbs, minus4), dl[s], dl[s + 1], 0, OFF_NONE, w + 128 * h + 32 * t);
        }
    }
}

/* Per type: dqv_T dequantizes nb blocks (a panel's column, the embeddings' rows). */
#define GGUF_VECTOR(T, ELEMS, BYTES)                                                                               \
    static void dqv_##T(const uint8_t *q, int64_t nb, float *w) {                                                 \
        for (int64_t b = 0; b < nb; b++) blk_##T(q + b * BYTES, w + b * ELEMS);                    \
    }
GGUF_VECTOR(q4_0, 32, 18)
GGUF_VECTOR(q4_1, 32, 20)
GGUF_VECTOR(q5_0, 32, 22)
GGUF_VECTOR(q5_1, 32, 24)
GGUF_VECTOR(q8_0, 32, 34)
GGUF_VECTOR(iq4_nl, 32, 18)
GGUF_VECTOR(mxfp4, 32, 17)
GGUF_VECTOR(iq4_xs, 256, 136)
GGUF_VECTOR(q4_k, 256, 144)
GGUF_VECTOR(q5_k, 256, 176)
GGUF_VECTOR(q6_k, 256, 210)
GGUF_VECTOR(q2_k, 256, 84)
GGUF_VECTOR(q3_k, 256, 110)

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
#define gg_pair4 gg_pair

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

INLINE __m256i gg_mxfp4(const uint8_t *qs) { /* MXFP4 codes + 128 (116..140) */
    return mxfp4_lookup_128(_mm256_and_si256(gg_nib16(qs), _mm256_set1_epi8(0x0F)));
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
#define GG_M4 _mm256_set1_epi8(0x0F)
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
            gg_unit64(_mm256_set_m128i(hi, lo), gg_pair4(a + b), xu + 32 * b, ldp, out, os, R);                   \
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

/* Q4_K / Q5_K: the 8 scales a = d sc and offsets z = -(dmin mn) of a super-block, the 6-bit fields unpacked 4 at a
 * time from the 12 scale bytes (scale_min_k4's fields) */
INLINE void gg_k4_scales(const uint8_t *q, float *a, float *z) {
    uint32_t w[3];
    memcpy(w, q + 4, 12);
    const uint32_t sc_lo = w[0] & 0x3F3F3F3Fu, mn_lo = w[1] & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (w[2] & 0x0F0F0F0Fu) | ((w[0] >> 6) & 0x03030303u) << 4;
    const uint32_t mn_hi = ((w[2] >> 4) & 0x0F0F0F0Fu) | ((w[1] >> 6) & 0x03030303u) << 4;
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)((uint64_t)sc_hi << 32 | sc_lo))));
    const __m256 mn =
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)((uint64_t)mn_hi << 32 | mn_lo))));
    _mm256_store_ps(a, _mm256_mul_ps(_mm256_set1_ps(gguf_f16(q)), sc));
    _mm256_store_ps(z, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(gguf_f16(q + 2)), mn)));
}

INLINE void gc_q4_k(GG_ARGS) {
    (void)nu;
    float a[8] __attribute__((aligned(32))), z[8] __attribute__((aligned(32)));
    gg_k4_scales(q, a, z);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 + 32 * c));
        gg_unit(v, 0x0F, _mm256_broadcast_ss(a + 2 * c), xu + 64 * c, ldp, out, os, R);
        gg_unit(_mm256_srli_epi32(v, 4), 0x0F, _mm256_broadcast_ss(a + 2 * c + 1), xu + 64 * c + 32, ldp, out, os, R);
    }
    gg_zero(z, xs, lds, out, os, R, 0);
}

INLINE void gc_q5_k(GG_ARGS) {
    (void)nu;
    float a[8] __attribute__((aligned(32))), z[8] __attribute__((aligned(32)));
    gg_k4_scales(q, a, z);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 16)), m4 = GG_M4, b4 = _mm256_set1_epi8(0x10);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 48 + 32 * c));
        for (int h = 0; h < 2; h++) {
            const int s = 2 * c + h; /* bit s of each qh byte becomes the code's bit 4 */
            const __m256i codes = _mm256_or_si256(_mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4),
                                                  _mm256_and_si256(gg_shift(qh, 4 - s), b4));
            gg_unit(codes, 0x1F, _mm256_broadcast_ss(a + s), xu + 32 * s, ldp, out, os, R);
        }
    }
    gg_zero(z, xs, lds, out, os, R, 0);
}

INLINE void gc_q6_k(GG_ARGS) {
    (void)nu;
    float a[16] __attribute__((aligned(32))), z[16] __attribute__((aligned(32)));
    const __m256 d = _mm256_set1_ps(gguf_f16(q + 208)), m32 = _mm256_set1_ps(-32.0f);
    for (int i = 0; i < 2; i++) {
        const __m256 ai = _mm256_mul_ps(d, i8_to_f32(_mm_loadl_epi64((const __m128i *)(q + 192 + 8 * i))));
        _mm256_store_ps(a + 8 * i, ai);
        _mm256_store_ps(z + 8 * i, _mm256_mul_ps(ai, m32));
    }
    const __m256i m4 = GG_M4, b45 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(q + 64 * h));
        const __m256i l1 = _mm256_loadu_si256((const __m256i *)(q + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 128 + 32 * h));
        for (int t = 0; t < 4; t++) { /* elements 128h + 32t + l: low bits from l0/l1, bits 2t, 2t + 1 of qh on top */
            const __m256i lo = t & 1 ? l1 : l0;
            const __m256i codes = _mm256_or_si256(_mm256_and_si256(t >> 1 ? _mm256_srli_epi16(lo, 4) : lo, m4),
                                                  _mm256_and_si256(gg_shift(qh, 4 - 2 * t), b45));
            gg_unit(codes, 0x3F, gg_pair(a + 8 * h + 2 * t), xu + 128 * h + 32 * t, ldp, out, os, R);
        }
    }
    gg_zero(z, xs, lds, out, os, R, 1);
}

INLINE void gc_q2_k(GG_ARGS) {
    (void)nu;
    float a[16] __attribute__((aligned(32))), z[16] __attribute__((aligned(32)));
    const __m256 d = _mm256_set1_ps(gguf_f16(q + 80)), dmin = _mm256_set1_ps(gguf_f16(q + 82));
    const __m128i sc = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(sc, m4), hi = _mm_and_si128(_mm_srli_epi16(sc, 4), m4);
    for (int i = 0; i < 2; i++) {
        const __m128i l = i ? _mm_srli_si128(lo, 8) : lo, hh = i ? _mm_srli_si128(hi, 8) : hi;
        _mm256_store_ps(a + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(l))));
        _mm256_store_ps(z + 8 * i, _mm256_sub_ps(_mm256_setzero_ps(),
                                                 _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hh)))));
    }
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 + 32 * h));
        for (int t = 0; t < 4; t++)
            gg_unit(gg_shift(v, -2 * t), 0x03, gg_pair(a + 8 * h + 2 * t), xu + 128 * h + 32 * t, ldp, out, os, R);
    }
    gg_zero(z, xs, lds, out, os, R, 1);
}

/* Q3_K's 16 signed 6-bit scales (-32..31) as bytes: low 4 bits from the nibbles of bytes 96..103 (low nibbles for
 * s < 8), high 2 bits from bits 2 (s / 4) of byte 104 + s % 4 */
INLINE __m128i q3k_scales(const uint8_t *q) {
    const __m128i sb = _mm_loadl_epi64((const __m128i *)(q + 96)), m4 = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(sb, m4), _mm_and_si128(_mm_srli_epi16(sb, 4), m4));
    const __m128i high = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32((int)gguf_u32(q + 104)), _mm_setr_epi32(0, 2, 4, 6)),
                                       _mm_set1_epi8(3));
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(high, 4)), _mm_set1_epi8(32));
}

INLINE void gc_q3_k(GG_ARGS) {
    (void)nu;
    float a[16] __attribute__((aligned(32))), z[16] __attribute__((aligned(32)));
    const __m256 d = _mm256_set1_ps(gguf_f16(q + 108)), m4 = _mm256_set1_ps(-4.0f);
    const __m128i sc = q3k_scales(q);
    for (int i = 0; i < 2; i++) { /* a = d * sc, z = -4 a: the scalar products, 8 at a time */
        const __m256 ai = _mm256_mul_ps(d, i8_to_f32(i ? _mm_srli_si128(sc, 8) : sc));
        _mm256_store_ps(a + 8 * i, ai);
        _mm256_store_ps(z + 8 * i, _mm256_mul_ps(m4, ai));
    }
    const __m256i hm = _mm256_loadu_si256((const __m256i *)q), m2 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 + 32 * h));
        for (int t = 0; t < 4; t++) { /* u = crumb + 4 * (hmask bit 4h + t): the reference's crumb - (bit ? 0 : 4), + 4 */
            const __m256i codes = _mm256_or_si256(_mm256_and_si256(gg_shift(v, -2 * t), m2),
                                                  _mm256_and_si256(gg_shift(hm, 2 - (4 * h + t)), b2));
            gg_unit(codes, 0x07, gg_pair(a + 8 * h + 2 * t), xu + 128 * h + 32 * t, ldp, out, os, R);
        }
    }
    gg_zero(z, xs, lds, out, os, R, 1);
}

INLINE void gc_iq4_xs(GG_ARGS) {
    (void)nu;
    float z[8] __attribute__((aligned(32)));
    const float d = gguf_f16(q);
    const uint32_t sh = (uint32_t)q[2] | (uint32_t)q[3] << 8;
    for (int s = 0; s < 8; s++) {
        const int sc = (int)(((q[4 + s / 2] >> (4 * (s % 2))) & 0xF) | ((sh >> (2 * s)) & 3) << 4) - 32;
        const float a = d * (float)sc;
        z[s] = -128.0f * a;
        gg_unit(gg_iq4(q + 8 + 16 * s), 0xFF, _mm256_set1_ps(a), xu + 32 * s, ldp, out, os, R);
    }
    gg_zero(z, xs, lds, out, os, R, 0);
}

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
#define GG_TILES(T, BPC, BYTES)                                                                                    \
    GG_TILE(T, BPC, BYTES, 1, GG_C1) GG_TILE(T, BPC, BYTES, 2, GG_C2) GG_TILE(T, BPC, BYTES, 3, GG_C3)            \
    GG_TILE(T, BPC, BYTES, 4, GG_C4)
GG_TILES(q4_0, 8, 18)
GG_TILES(q4_1, 8, 20)
GG_TILES(q5_0, 8, 22)
GG_TILES(q5_1, 8, 24)
GG_TILES(q8_0, 8, 34)
GG_TILES(iq4_nl, 8, 18)
GG_TILES(mxfp4, 8, 17)
GG_TILES(iq4_xs, 1, 136)
GG_TILES(q4_k, 1, 144)
GG_TILES(q5_k, 1, 176)
GG_TILES(q6_k, 1, 210)
GG_TILES(q2_k, 1, 84)
GG_TILES(q3_k, 1, 110)
/* One column's panel for the rows-in-lanes path: P [kp] converted codes, P + kp [kp] lane scales (8 per unit),
 * P + 2 kp [chunks * GG_XS] offsets (kp: k, or k rounded up to a whole unit of 64 for the block pairs). */
#define GG_FILL(T, BPC, BYTES)                                                                                     \
    static void ggf_##T(const uint8_t *q, int64_t nb, float *P, int64_t kp) {                                     \
        for (int64_t b = 0, i = 0; b < nb; b += BPC, i++)                                                          \
            gc_##T(q + b * (BYTES), (int)(nb - b < BPC ? nb - b : BPC), P + i * GG_CHUNK, kp,                      \
                   P + 2 * kp + i * GG_XS, 0, NULL, 0, 0);                                                         \
    }
GG_FILL(q4_0, 8, 18)
GG_FILL(q4_1, 8, 20)
GG_FILL(q5_0, 8, 22)
GG_FILL(q5_1, 8, 24)
GG_FILL(q8_0, 8, 34)
GG_FILL(iq4_nl, 8, 18)
GG_FILL(mxfp4, 8, 17)
GG_FILL(iq4_xs, 1, 136)
GG_FILL(q4_k, 1, 144)
GG_FILL(q5_k, 1, 176)
GG_FILL(q6_k, 1, 210)
GG_FILL(q2_k, 1, 84)
GG_FILL(q3_k, 1, 110)
typedef void (*gg_tile_fn)(const uint8_t *, int64_t, int, const float *, int64_t, const float *, int64_t, int64_t,
                           float *, int64_t);
typedef void (*gg_fill_fn)(const uint8_t *, int64_t, float *, int64_t);
static const int GG_COLS[4] = {GG_C1, GG_C2, GG_C3, GG_C4};
#define GG_FNS(T) {ggt_##T##_1, ggt_##T##_2, ggt_##T##_3, ggt_##T##_4}, ggf_##T
#define DQ(scalar, vector) vector
#define GG(T, wide, sub, unit) GG_FNS(T), wide, sub, unit
#else
#define DQ(scalar, vector) scalar
#define GG(T, wide, sub, unit) {NULL}, NULL, wide, sub, unit
typedef void (*gg_tile_fn)(void);
typedef void (*gg_fill_fn)(void);
#endif

typedef void (*gguf_dq_fn)(const uint8_t *, int64_t, float *);
typedef struct {
    int type, elems, bytes;
    gguf_dq_fn fn;
    gg_tile_fn tiles[4]; /* R = 1..4 rows (AVX2) */
    gg_fill_fn fill;     /* a column's panel for the rows-in-lanes path */
    int wide, sub;       /* 8-bit codes (byte 3's activations unscaled); sub-block length (16 or 32) */
    int unit;            /* elements per unit: 32, or 64 for the nibble pairs of Q4_0 / Q4_1 */
} gguf_type;

/* GGML type ids (gguf.GGMLQuantizationType) */
static const gguf_type GGUF_TYPES[] = {
    {2, 32, 18, DQ(dq_q4_0, dqv_q4_0), GG(q4_0, 0, 32, 64)},
    {3, 32, 20, DQ(dq_q4_1, dqv_q4_1), GG(q4_1, 0, 32, 64)},
    {6, 32, 22, DQ(dq_q5_0, dqv_q5_0), GG(q5_0, 0, 32, 32)},
    {7, 32, 24, DQ(dq_q5_1, dqv_q5_1), GG(q5_1, 0, 32, 32)},
    {8, 32, 34, DQ(dq_q8_0, dqv_q8_0), GG(q8_0, 1, 32, 32)},
    {10, 256, 84, DQ(dq_q2_k, dqv_q2_k), GG(q2_k, 0, 16, 32)},
    {11, 256, 110, DQ(dq_q3_k, dqv_q3_k), GG(q3_k, 0, 16, 32)},
    {12, 256, 144, DQ(dq_q4_k, dqv_q4_k), GG(q4_k, 0, 32, 32)},
    {13, 256, 176, DQ(dq_q5_k, dqv_q5_k), GG(q5_k, 0, 32, 32)},
    {14, 256, 210, DQ(dq_q6_k, dqv_q6_k), GG(q6_k, 0, 16, 32)},
    {20, 32, 18, DQ(dq_iq4_nl, dqv_iq4_nl), GG(iq4_nl, 1, 32, 32)},
    {23, 256, 136, DQ(dq_iq4_xs, dqv_iq4_xs), GG(iq4_xs, 1, 32, 32)},
    {39, 32, 17, DQ(dq_mxfp4, dqv_mxfp4), GG(mxfp4, 1, 32, 32)},
};

static const gguf_type *gguf_type_of(int type, int64_t k) {
    for (size_t i = 0; i < sizeof GGUF_TYPES / sizeof GGUF_TYPES[0]; i++)
        if (GGUF_TYPES[i].type == type) return k > 0 && k % GGUF_TYPES[i].elems == 0 ? &GGUF_TYPES[i] : NULL;
    return NULL;
}

/* rows of block bytes (row stride ldq bytes) -> fp32 [rows, k] (row stride ldw); -1 for an unknown type or bad k. */
int llmd_gguf_dequant(int type, const uint8_t *q, int64_t ldq, int64_t rows, int64_t k, float *w, int64_t ldw) {
    const gguf_type *t = gguf_type_of(type, k);
    if (!t || rows < 0) return -1;
    for (int64_t r = 0; r < rows; r++) t->fn(q + r * ldq, k / t->elems, w + r * ldw);
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
/* The rows' activations as the tiles read them: xp [m][kp], unit u's position 8j + l holding x[32u + 4l + j] * 2^-8j
 * (8-bit codes: j = 3 unscaled; the block pairs: unit of 64, position 8p + l holding element 32 (l / 4) + 16 (p % 2)
 * + 4 (l % 4) + p / 2 times 2^-4p, p = 7 unscaled, zero past K); xs [m][chunks * GG_XS], the sums over each chunk's
 * sub-blocks in element order (plain C: the same bits whichever rows share the call), zero past the last one. */
static int64_t gg_padded(const gguf_type *t, int64_t k) { return (k + t->unit - 1) / t->unit * t->unit; }

static void gg_prepare(const gguf_type *t, const float *x, int64_t ldx, int64_t m, int64_t k, float *xp, float *xs) {
    const int64_t nc = (k + GG_CHUNK - 1) / GG_CHUNK, per = GG_CHUNK / t->sub, kp = gg_padded(t, k);
    const float scale[4] = {1.0f, 1.0f / 256.0f, 1.0f / 65536.0f, t->wide ? 1.0f : 1.0f / 16777216.0f};
    for (int64_t r = 0; r < m; r++) {
        const float *xr = x + r * ldx;
        float *pr = xp + r * kp, *sr = xs + r * nc * GG_XS;
        if (t->unit == 64)
            for (int64_t u = 0; u < kp; u += 64)
                for (int p = 0; p < 8; p++)
                    for (int l = 0; l < 8; l++) {
                        const int64_t e = u + 32 * (l / 4) + 16 * (p % 2) + 4 * (l % 4) + p / 2;
                        pr[u + 8 * p + l] = e < k ? xr[e] * (p < 7 ? 1.0f / (float)(1 << (4 * p)) : 1.0f) : 0.0f;
                    }
        else
            for (int64_t u = 0; u < k; u += 32)
                for (int j = 0; j < 4; j++)
                    for (int l = 0; l < 8; l++) pr[u + 8 * j + l] = xr[u + 4 * l + j] * scale[j];
        memset(sr, 0, (size_t)(nc * GG_XS) * 4);
        for (int64_t s = 0; s < k / t->sub; s++) {
            float sum = 0.0f;
            for (int e = 0; e < t->sub; e++) sum += xr[s * t->sub + e];
            sr[s / per * GG_XS + s % per] = sum;
        }
    }
}

/* Rows in the vector lanes (16 rows per block, RP_VECS vectors): output (r, c) lane l gets the very operations of the
 * tiles' lane l: per unit, the 4 products of its codes (broadcast from the panel) and the row's activations at
 * positions 8j + l, the lane's scale, and after each chunk the offset of sub-block l (and l + 8) times its sum; then
 * hsum's tree over the lanes (lane_sum). xt / xst: the tiles' activations and sums, transposed per block of 16 rows. */
INLINE void gg_rows_tile(const float *xt, const float *xst, const float *P, int64_t pst, int64_t K, int sub16, float *y,
                         int64_t ldy, int rows, const int C, const int U) {
    const int64_t nc = (K + GG_CHUNK - 1) / GG_CHUNK;
    __m256 out[RP_VECS][RP_COLS][8];
    for (int v = 0; v < RP_VECS; v++)
        for (int c = 0; c < C; c++)
            for (int l = 0; l < 8; l++) out[v][c][l] = _mm256_setzero_ps();
    for (int64_t i = 0; i < nc; i++) {
        const int64_t u1 = (i + 1) * GG_CHUNK < K ? (i + 1) * GG_CHUNK : K;
        for (int64_t u = i * GG_CHUNK; u < u1; u += U)
            for (int l = 0; l < 8; l++) {
                __m256 acc[RP_VECS][RP_COLS];
                _Pragma("GCC unroll 8") for (int j = 0; j < U / 8; j++) {
                    const float *xa = xt + (u + 8 * j + l) * 16;
                    const __m256 x0 = _mm256_load_ps(xa), x1 = _mm256_load_ps(xa + 8);
                    _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {
                        const __m256 w = _mm256_broadcast_ss(P + c * pst + u + 8 * j + l);
                        acc[0][c] = j ? _mm256_fmadd_ps(x0, w, acc[0][c]) : _mm256_mul_ps(x0, w);
                        acc[1][c] = j ? _mm256_fmadd_ps(x1, w, acc[1][c]) : _mm256_mul_ps(x1, w);
                    }
                }
                _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {
                    const __m256 sv = _mm256_broadcast_ss(P + c * pst + K + u + l);
                    _Pragma("GCC unroll 2") for (int v = 0; v < RP_VECS; v++)
                        out[v][c][l] = _mm256_fmadd_ps(acc[v][c], sv, out[v][c][l]);
                }
            }
        for (int h = 0; h < (sub16 ? 2 : 1); h++)
            for (int l = 0; l < 8; l++) {
                const float *xa = xst + (i * GG_XS + 8 * h + l) * 16;
                for (int c = 0; c < C; c++) {
                    const __m256 z = _mm256_broadcast_ss(P + c * pst + 2 * K + i * GG_XS + 8 * h + l);
                    for (int v = 0; v < RP_VECS; v++)
                        out[v][c][l] = _mm256_fmadd_ps(z, _mm256_load_ps(xa + 8 * v), out[v][c][l]);
                }
            }
    }
    for (int c = 0; c < C; c++)
        for (int v = 0; v < RP_VECS; v++) store_rows(lane_sum(out[v][c]), y + 8 * v * ldy + c, ldy, rows - 8 * v);
}

/* The rows-in-lanes path's panel of RP_COLS columns (32-byte aligned floats). */
static int64_t gg_panel_floats(const gguf_type *t, int64_t k) {
    return RP_COLS * (2 * gg_padded(t, k) + (k + GG_CHUNK - 1) / GG_CHUNK * GG_XS);
}

/* Columns [n0, n1) of y for rows [0, m) in the vector lanes (from RP_MIN_ROWS rows): xt / xst the rows' activations
 * and sums transposed per block of 16 rows (transpose_into), wp a panel of gg_panel_floats. */
static void gg_rows_cols(const gguf_type *t, const float *xt, const float *xst, const uint8_t *q, float *y,
                         int64_t ldy, int64_t m, int64_t k, int64_t n0, int64_t n1, float *wp) {
    const int64_t rb = k / t->elems * t->bytes, nb = k / t->elems, blocks = (m + 15) / 16;
    const int64_t lds = (k + GG_CHUNK - 1) / GG_CHUNK * GG_XS, kp = gg_padded(t, k);
    const int64_t pst = 2 * kp + lds; /* panel floats per column */
    const int64_t chunk_blocks = (row_chunk(k) + 15) / 16;
    for (int64_t b0 = 0; b0 < blocks; b0 += chunk_blocks) {
        const int64_t b1 = b0 + chunk_blocks < blocks ? b0 + chunk_blocks : blocks;
        for (int64_t c0 = n0; c0 < n1; c0 += RP_COLS) {
            const int cc = (int)(n1 - c0 < RP_COLS ? n1 - c0 : RP_COLS);
            for (int c = 0; c < cc; c++) t->fill(q + (c0 + c) * rb, nb, wp + c * pst, kp);
            for (int64_t b = b0; b < b1; b++) {
                const int rows = (int)(m - b * 16 < 16 ? m - b * 16 : 16);
                const float *xb = xt + b * kp * 16, *sb = xst + b * lds * 16;
                float *yb = y + b * 16 * ldy + c0;
                const int s16 = t->sub == 16;
#define ROWS_TILE(C)                                                                                               \
    (t->unit == 64 ? gg_rows_tile(xb, sb, wp, pst, kp, s16, yb, ldy, rows, C, 64)                                 \
                   : gg_rows_tile(xb, sb, wp, pst, kp, s16, yb, ldy, rows, C, 32))
                switch (cc) {
                case 1: ROWS_TILE(1); break;
                case 2: ROWS_TILE(2); break;
                case 3: ROWS_TILE(3); break;
                case 4: ROWS_TILE(4); break;
                default: ROWS_TILE(RP_COLS); break;
                }
#undef ROWS_TILE
            }
        }
    }
}

/* Columns [n0, n1) of y for rows [0, m) (fewer than RP_MIN_ROWS) in the tiles, from gg_prepare's xp and xs. */
static void gg_tile_cols(const gguf_type *t, const float *xp, const float *xs, const uint8_t *q, float *y,
                         int64_t ldy, int64_t m, int64_t k, int64_t n0, int64_t n1) {
    const int64_t rb = k / t->elems * t->bytes, nb = k / t->elems, lds = (k + GG_CHUNK - 1) / GG_CHUNK * GG_XS;
    const int64_t kp = gg_padded(t, k), chunk = row_chunk(k);
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
        for (int64_t c0 = n0; c0 < n1; c0 += 8) { /* 8 columns' weights stay in cache over the rows */
            const int64_t c1 = c0 + 8 < n1 ? c0 + 8 : n1;
            for (int64_t r0 = m0; r0 < m1; r0 += 4) {
                const int rr = (int)(m1 - r0 < 4 ? m1 - r0 : 4), tc = GG_COLS[rr - 1];
                for (int64_t c = c0; c < c1; c += tc)
                    t->tiles[rr - 1](q + c * rb, rb, (int)(c1 - c < tc ? c1 - c : tc), xp + r0 * kp, kp,
                                     xs + r0 * lds, lds, nb, y + r0 * ldy + c, ldy);
            }
        }
    }
}
#else
/* portable: columns [n0, n1) of y for rows x [m, k], each column dequantized into w [k] (the reference's values), then
 * one plain dot product per row */
static void gg_plain_cols(const gguf_type *t, const float *x, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                          int64_t k, int64_t n0, int64_t n1, float *w) {
    const int64_t rb = k / t->elems * t->bytes;
    for (int64_t c = n0; c < n1; c++) {
        t->fn(q + c * rb, k / t->elems, w);
        for (int64_t r = 0; r < m; r++) {
            float s = 0.0f;
            for (int64_t i = 0; i < k; i++) s += x[r * k + i] * w[i];
            y[r * ldy + c] = s;
        }
    }
}
#endif

/* ==== GGUF blocks with int8-quantized activations (the integer path) ==========================================
 *
 * The activations are quantized as for int8/int4 (quantize_row: per block of 32, d_b = amax / 127, q = round(x / d_b)),
 * and every weight is again w = a_s * u + z_s (see "The GGUF matmul" above), now with u a byte code that meets the
 * activation bytes in an integer dot product per 32-element unit (DOT_U8S8: unsigned x signed bytes -> 8 int32 lanes of
 * 4 elements each, exact). Per output y[r, c], in this order
 * whatever M, the row's position, the part, the tile or the thread count:
 *   blocks of 32 with a minimum (Q4_1, Q5_1): for each block j, out = fma(float(dot_j), a_j * d_j, out);
 *   signed blocks of 32 (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4): one accumulator per output over the blocks' whole dot
 *       products
 *       (see GQS_TILE);
 *   super-blocks of 256 (the K-quants, IQ4_XS): the sub-block scales in integer arithmetic, d once per super-block
 *       (see GQK_TILE below);
 *   after each chunk of 256 elements: out = fma(z[0..8), S[0..8), out), then fma(z[8..16), S[8..16), out), with z the
 *       offsets of the chunk's 16-element sub-blocks (a 32-element sub-block's offset twice) and S = d_b * sum(q) over
 *       each 16 activations (row data, computed once per call); IQ4_XS (no offsets) skips this;
 *   y = hsum(out).
 * Codes are unsigned (0..63: nibbles, 5- and 6-bit codes, Q3_K's code + 4, Q6_K's + 32) except for the signed blocks
 * of 32 and IQ4_XS's table values, which are signed with z = 0 (GQ_SIGNED_DOT). A pair of products fits int16
 * (63 * 127 * 2 or 128 * 127 * 2 < 32768). The portable build dequantizes each column (the reference's values) and
 * sums d_b * (sum of q * w per block) in a fixed order, except for the signed blocks of 32, whose order it computes
 * in plain C (the vector build's bits). */

/* Row data of the integer path: d [m][K/32], S [m][chunks * 16], the bytes q [m][K], C [m][K/4]: -128 times the
 * sum of each 4 bytes of q (see GQ_SIGNED_DOT); then, where m >= GQS_MIN_ROWS, the same rows in the vector lanes
 * (gq_lanes, for the signed blocks' rows-in-lanes paths), per group of 8 rows and step s (a block of 32), or under 8
 * rows per group of 4 and step s (a pair of blocks: lanes 0-3 the even one, 4-7 the odd one): XT [groups][s][8][8]
 * (at each of the step's 8 dwords, each lane the 4 bytes of its row), CB [groups][s][8] (C summed over the lane's
 * block) and DT [groups][s][8] (its d); lanes past m or past the last block hold zeros. */
static int64_t gq_sums(int64_t k) { return (k + 255) / 256 * 16; }
/* the signed blocks of 32 (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4): their own order, the lane layout */
static int gq_signed_type(int type) { return type == 2 || type == 6 || type == 8 || type == 20 || type == 39; }
#define GQS_MIN_ROWS 4 /* with VNNI, from 4 rows the signed blocks take the rows-in-lanes paths (see gq_cols) */
/* rows per group of the lane layout: 8, or under 8 rows 4, lanes 4-7 then holding the next block's (block pairs) */
static int64_t gq_group_rows(int64_t m) { return m >= 8 ? 8 : 4; }
static int64_t gq_groups(int64_t m) { return m >= GQS_MIN_ROWS ? (m + gq_group_rows(m) - 1) / gq_group_rows(m) : 0; }
/* int32 per group of XT, and of CB (DT: as many floats) */
static int64_t gq_xt_len(int64_t m, int64_t k) { return m >= 8 ? k / 4 * 8 : (k / QB + 1) / 2 * 64; }
static int64_t gq_cb_len(int64_t m, int64_t k) { return m >= 8 ? k / QB * 8 : (k / QB + 1) / 2 * 8; }

typedef struct {
    const int32_t *xt, *cb;
    const float *dt;
} gq_lanes;

/* the lane layout of row group g (rows 8g .. 8g + 7, or under 8 rows 4g .. 4g + 3) of m rows, in `lanes` */
static gq_lanes gq_lanes_in(const void *lanes, int64_t m, int64_t k, int64_t g) {
    const int64_t mg = gq_groups(m), xl = gq_xt_len(m, k), cl = gq_cb_len(m, k);
    const int32_t *xt = (const int32_t *)lanes, *cb = xt + mg * xl;
    const gq_lanes ln = {xt + g * xl, cb + g * cl, (const float *)(cb + mg * cl) + g * cl};
    return ln;
}

/* bytes of the lane layout of m rows */
static size_t gq_lanes_bytes(int64_t m, int64_t k) {
    return (size_t)(gq_groups(m) * 4 * (gq_xt_len(m, k) + 2 * gq_cb_len(m, k)));
}

/* One row's data (plain C: the same bits in every build): d [K/32], S [gq_sums(K)], the bytes q [K] and, with_c (the
 * signed blocks of 32 and IQ4_XS read it), C [K/4]. */
static void gq_quantize_row(const float *x, int64_t k, int with_c, float *d, float *S, int8_t *xq, int32_t *C) {
    float D; /* the whole row's sum (quantize_row's group sum), unused */
    quantize_row(x, k, k, 0, xq, d, &D);
    memset(S, 0, (size_t)gq_sums(k) * 4);
    for (int64_t s = 0; s < k / 16; s++) {
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += xq[16 * s + i];
        S[s] = d[s / 2] * (float)sum;
    }
    for (int64_t i = 0; with_c && i < k / 4; i++) {
        const int8_t *v = xq + 4 * i;
        C[i] = -128 * (v[0] + v[1] + v[2] + v[3]);
    }
}

/* The lane layout (gq_lanes_bytes) of rows [0, m) from their d, q and C (the signed blocks read it). */
static void gq_fill_lanes(void *lanes, const float *d, const int8_t *xq, const int32_t *C, int64_t m, int64_t k) {
    const int64_t nb = k / QB;
    for (int64_t g = 0; g < gq_groups(m); g++) {
        const gq_lanes ln = gq_lanes_in(lanes, m, k, g);
        int32_t *xt = (int32_t *)ln.xt, *cb = (int32_t *)ln.cb;
        float *dt = (float *)ln.dt;
        /* lane l, at step s (8 groups of 8 rows: the block; 4 rows: the block pair): row and block */
        const int pairs = m < 8;
        for (int64_t s = 0; s < (pairs ? (nb + 1) / 2 : nb); s++)
            for (int l = 0; l < 8; l++) {
                const int64_t r = pairs ? 4 * g + (l & 3) : 8 * g + l, b = pairs ? 2 * s + (l >> 2) : s;
                const int real = r < m && b < nb;
                int32_t sum = 0;
                for (int t = 0; t < 8; t++) {
                    int32_t v = 0;
                    if (real) memcpy(&v, xq + r * k + QB * b + 4 * t, 4), sum += C[r * (k / 4) + 8 * b + t];
                    xt[s * 64 + t * 8 + l] = v;
                }
                cb[s * 8 + l] = sum;
                dt[s * 8 + l] = real ? d[r * nb + b] : 0.0f;
            }
    }
}

#if defined(__AVX2__) && defined(__FMA__)

/* Per type, one chunk of one column: the codes u [8] of its units (element order), the units' scale vectors sv [8]
 * and the offsets z [16] of its 16-element sub-blocks (zeroed by the caller; nu blocks of 32, or one super-block). */
#define GQ_DEC(T) INLINE void gqd_##T(const uint8_t *q, int nu, __m256i *u, __m256 *sv, float *z)

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

INLINE __m256 gq_pair(float a0, float a1) {
    return _mm256_blend_ps(_mm256_set1_ps(a0), _mm256_set1_ps(a1), 0xF0);
}

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
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                             \
                    const float *sr = xs + r * lds + 16 * i;                                                       \
                    out[r][c] = _mm256_fmadd_ps(zl, _mm256_loadu_ps(sr), out[r][c]);                              \
                    out[r][c] = _mm256_fmadd_ps(zh, _mm256_loadu_ps(sr + 8), out[r][c]);                          \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C && c < cols; c++) y[r * ldy + c] = hsum(out[r][c]);                             \
    }
#define GQ_TILES(T, BPC, BYTES)                                                                                    \
    GQ_TILE(T, BPC, BYTES, 1, GG_C1) GQ_TILE(T, BPC, BYTES, 2, GG_C2)                                              \
    GQ_TILE(T, BPC, BYTES, 3, GG_C3) GQ_TILE(T, BPC, BYTES, 4, GG_C4)
GQ_TILES(q4_1, 8, 20)
GQ_TILES(q5_1, 8, 24)

/* Super-block types: the sub-block scales are small integers (a_s = d * sc_s) and meet the dot products in integer
 * arithmetic, as _mm256_madd_epi16's second operand (int16 pairs, both halves of each 32-bit lane holding sc_s), so
 * a unit costs one FMA by d_b per row; d is applied once per super-block. Per output, in this order:
 *   for each super-block: acc = sum over its units j of float(dot_j * sc) * d_j (mul, then 7 FMAs);
 *       out = fma(acc, d, out); out = fma(z[0..8), S[0..8), out); out = fma(z[8..16), S[8..16), out);
 *   y = hsum(out).
 * (|dot pair * sc| < 2^23: exact.) Per type, one super-block: codes u [8], madd scale operands scp [8], d and the
 * offset vectors zl, zh (16-element sub-blocks 0-7 and 8-15). */
#define GQK_DEC(T) INLINE void gqk_##T(const uint8_t *q, __m256i *u, __m256i *scp, float *d, __m256 *zl, __m256 *zh)

/* int32 lanes of small signed integers -> both int16 halves of each lane holding the value */
INLINE __m256i gq_twice(__m256i v) {
    return _mm256_or_si256(_mm256_and_si256(v, _mm256_set1_epi32(0xFFFF)), _mm256_slli_epi32(v, 16));
}

/* 8 sub-blocks of 32: unit s scales by lane s of sc; z [8] per sub-block -> per 16-element half */
INLINE void gq_units32(__m256i sc, __m256 z, __m256i *scp, __m256 *zl, __m256 *zh) {
    const __m256i p = gq_twice(sc);
    for (int s = 0; s < 8; s++) scp[s] = _mm256_permutevar8x32_epi32(p, _mm256_set1_epi32(s));
    *zl = _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
    *zh = _mm256_permutevar8x32_ps(z, _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7));
}

/* 16 sub-blocks of 16 (sc0: 0-7, sc1: 8-15): unit j's lanes 0-3 scale by sub-block 2j, lanes 4-7 by 2j + 1 */
INLINE void gq_units16(__m256i sc0, __m256i sc1, __m256i *scp) {
    const __m256i p0 = gq_twice(sc0), p1 = gq_twice(sc1);
    for (int j = 0; j < 8; j++) {
        const int s = 2 * (j % 4);
        const __m256i lanes = _mm256_setr_epi32(s, s, s, s, s + 1, s + 1, s + 1, s + 1);
        scp[j] = _mm256_permutevar8x32_epi32(j < 4 ? p0 : p1, lanes);
    }
}

/* Q4_K / Q5_K: the 6-bit scales and mins unpacked 4 at a time from the 12 scale bytes (scale_min_k4's fields) */
INLINE void gq_k4(const uint8_t *q, __m256i *scp, float *d, __m256 *zl, __m256 *zh) {
    uint32_t w[3];
    memcpy(w, q + 4, 12);
    const uint32_t sc_lo = w[0] & 0x3F3F3F3Fu, mn_lo = w[1] & 0x3F3F3F3Fu;
    const uint32_t sc_hi = (w[2] & 0x0F0F0F0Fu) | ((w[0] >> 6) & 0x03030303u) << 4;
    const uint32_t mn_hi = ((w[2] >> 4) & 0x0F0F0F0Fu) | ((w[1] >> 6) & 0x03030303u) << 4;
    const __m256i sc = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)((uint64_t)sc_hi << 32 | sc_lo)));
    const __m256 mn =
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)((uint64_t)mn_hi << 32 | mn_lo))));
    *d = gguf_f16(q);
    gq_units32(sc, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(gguf_f16(q + 2)), mn)), scp, zl, zh);
}

GQK_DEC(q4_k) {
    gq_k4(q, scp, d, zl, zh);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 + 32 * c));
        u[2 * c] = _mm256_and_si256(v, m4);
        u[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
}

GQK_DEC(q5_k) {
    gq_k4(q, scp, d, zl, zh);
    const __m256i qh = _mm256_loadu_si256((const __m256i *)(q + 16)), m4 = _mm256_set1_epi8(0x0F),
                  b4 = _mm256_set1_epi8(0x10);
    for (int c = 0; c < 4; c++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 48 + 32 * c));
        for (int h = 0; h < 2; h++) {
            const int s = 2 * c + h;
            u[s] = _mm256_or_si256(_mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4),
                                   _mm256_and_si256(gg_shift(qh, 4 - s), b4));
        }
    }
}

GQK_DEC(q6_k) { /* u = q + 32, z = -32 a */
    const __m256i sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 192)));
    const __m256i sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + 200)));
    *d = gguf_f16(q + 208);
    const __m256 m32d = _mm256_set1_ps(-32.0f * *d);
    *zl = _mm256_mul_ps(m32d, _mm256_cvtepi32_ps(sc0));
    *zh = _mm256_mul_ps(m32d, _mm256_cvtepi32_ps(sc1));
    gq_units16(sc0, sc1, scp);
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

GQK_DEC(q2_k) { /* a = d (sc & 15), z = -dmin (sc >> 4) */
    const __m128i b = _mm_loadu_si128((const __m128i *)q), m4 = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(b, m4), hi = _mm_and_si128(_mm_srli_epi16(b, 4), m4);
    *d = gguf_f16(q + 80);
    const __m256 mdmin = _mm256_set1_ps(-gguf_f16(q + 82));
    *zl = _mm256_mul_ps(mdmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)));
    *zh = _mm256_mul_ps(mdmin, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))));
    gq_units16(_mm256_cvtepu8_epi32(lo), _mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8)), scp);
    const __m256i m2 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 16 + 32 * h));
        for (int t = 0; t < 4; t++) u[4 * h + t] = _mm256_and_si256(gg_shift(v, -2 * t), m2);
    }
}

GQK_DEC(q3_k) { /* u = crumb + 4 * (hmask bit), z = -4 a */
    const __m128i sc = q3k_scales(q);
    const __m256i sc0 = _mm256_cvtepi8_epi32(sc), sc1 = _mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8));
    *d = gguf_f16(q + 108);
    const __m256 m4d = _mm256_set1_ps(-4.0f * *d);
    *zl = _mm256_mul_ps(m4d, _mm256_cvtepi32_ps(sc0));
    *zh = _mm256_mul_ps(m4d, _mm256_cvtepi32_ps(sc1));
    gq_units16(sc0, sc1, scp);
    const __m256i hm = _mm256_loadu_si256((const __m256i *)q), m2 = _mm256_set1_epi8(3), b2 = _mm256_set1_epi8(4);
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(q + 32 + 32 * h));
        for (int t = 0; t < 4; t++)
            u[4 * h + t] = _mm256_or_si256(_mm256_and_si256(gg_shift(v, -2 * t), m2),
                                           _mm256_and_si256(gg_shift(hm, 2 - (4 * h + t)), b2));
    }
}

/* IQ4_XS's 8 sub-block scales sc - 32 (int32 lanes): low 4 bits from nibble s of the 4 bytes at q + 4, high 2 from
 * bits 2s of the 2 bytes at q + 2 */
INLINE __m256i iq4xs_scales(const uint8_t *q) {
    const __m256i s = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i lo = _mm256_srlv_epi32(_mm256_set1_epi32((int)gguf_u32(q + 4)), _mm256_slli_epi32(s, 2));
    const __m256i hi = _mm256_srlv_epi32(_mm256_set1_epi32((int)(q[2] | q[3] << 8)), _mm256_slli_epi32(s, 1));
    const __m256i hi2 = _mm256_slli_epi32(_mm256_and_si256(hi, _mm256_set1_epi32(3)), 4);
    return _mm256_sub_epi32(_mm256_or_si256(_mm256_and_si256(lo, _mm256_set1_epi32(0xF)), hi2), _mm256_set1_epi32(32));
}

GQK_DEC(iq4_xs) { /* signed table codes, a = d (sc - 32), no offsets */
    *d = gguf_f16(q);
    gq_units32(iq4xs_scales(q), _mm256_setzero_ps(), scp, zl, zh);
    for (int s = 0; s < 8; s++) u[s] = iq4_lookup(nibbles32(q + 8 + 16 * s));
}

#define GQK_TILE(T, BYTES, SIGNED, R, C)                                                                           \
    static void gqt_##T##_##R(const uint8_t *q, int64_t rb, int cols, const int8_t *xq, const float *xd,         \
                              const float *xs, const int32_t *xc, int64_t K, int64_t nb, float *y, int64_t ldy) { \
        const int64_t nbx = K / QB, lds = gq_sums(K);                                                             \
        __m256 out[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) out[r][c] = _mm256_setzero_ps();                      \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) if (c < cols) {                                   \
                const uint8_t *qc = q + c * rb + b * (BYTES);                                                      \
                for (int p = 0; p < (BYTES); p += 64)                                                              \
                    _mm_prefetch((const char *)(qc + PF_TILES * C * rb + p), _MM_HINT_T0);                       \
                __m256i u[8], scp[8];                                                                              \
                __m256 zl, zh, acc[R];                                                                             \
                float d;                                                                                           \
                gqk_##T(qc, u, scp, &d, &zl, &zh);                                                                 \
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                                             \
                    const __m256i w = SIGNED ? _mm256_abs_epi8(u[j]) : u[j];                                       \
                    _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                         \
                        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + 256 * b + 32 * j));   \
                        const __m256i p = _mm256_maddubs_epi16(w, SIGNED ? _mm256_sign_epi8(xv, u[j]) : xv);       \
                        const __m256 t = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, scp[j]));                         \
                        const __m256 dv = _mm256_broadcast_ss(xd + r * nbx + 8 * b + j);                          \
                        acc[r] = j ? _mm256_fmadd_ps(t, dv, acc[r]) : _mm256_mul_ps(t, dv);                        \
                    }                                                                                              \
                }                                                                                                  \
                const __m256 dd = _mm256_set1_ps(d);                                                               \
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                             \
                    const float *sr = xs + r * lds + 16 * b;                                                       \
                    out[r][c] = _mm256_fmadd_ps(acc[r], dd, out[r][c]);                                            \
                    out[r][c] = _mm256_fmadd_ps(zl, _mm256_loadu_ps(sr), out[r][c]);                              \
                    out[r][c] = _mm256_fmadd_ps(zh, _mm256_loadu_ps(sr + 8), out[r][c]);                          \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C && c < cols; c++) y[r * ldy + c] = hsum(out[r][c]);                             \
    }
#define GQK_TILES(T, BYTES, SIGNED)                                                                                \
    GQK_TILE(T, BYTES, SIGNED, 1, GG_C1) GQK_TILE(T, BYTES, SIGNED, 2, GG_C2)                                      \
    GQK_TILE(T, BYTES, SIGNED, 3, GG_C3) GQK_TILE(T, BYTES, SIGNED, 4, GG_C4)
#if GQ_OFFSET_ROWS
/* IQ4_XS, one row, with VNNI: the codes + 128 against the activations, the accumulator starting at the row data C
 * (GQ_SIGNED_DOT), times the sub-block scale in int32: the integers GQK_TILE's madd makes */
static void gqt_iq4_xs_1(const uint8_t *q, int64_t rb, int cols, const int8_t *xq, const float *xd, const float *xs,
                         const int32_t *xc, int64_t K, int64_t nb, float *y, int64_t ldy) {
    (void)K, (void)ldy;
    __m256 out[GG_C1];
    for (int c = 0; c < GG_C1; c++) out[c] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        _Pragma("GCC unroll 8") for (int c = 0; c < GG_C1; c++) if (c < cols) {
            const uint8_t *qc = q + c * rb + b * 136;
            for (int p = 0; p < 136; p += 64)
                _mm_prefetch((const char *)(qc + PF_TILES * GG_C1 * rb + p), _MM_HINT_T0);
            const __m256i sc = iq4xs_scales(qc);
            __m256 acc = _mm256_setzero_ps();
            _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {
                const __m256i w = iq4_lookup_128(nibbles32(qc + 8 + 16 * j)); /* GQ_SIGNED_W of the codes */
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 256 * b + 32 * j));
                const __m256i dot = GQ_SIGNED_DOT(w, w, xv, xc + 64 * b + 8 * j, 1);
                const __m256 t =
                    _mm256_cvtepi32_ps(_mm256_mullo_epi32(dot, _mm256_permutevar8x32_epi32(sc, _mm256_set1_epi32(j))));
                const __m256 dv = _mm256_broadcast_ss(xd + 8 * b + j);
                acc = j ? _mm256_fmadd_ps(t, dv, acc) : _mm256_mul_ps(t, dv);
            }
            const __m256 zero = _mm256_setzero_ps(); /* GQK_TILE's (zero) offset terms, for its very bits */
            out[c] = _mm256_fmadd_ps(acc, _mm256_set1_ps(gguf_f16(qc)), out[c]);
            out[c] = _mm256_fmadd_ps(zero, _mm256_loadu_ps(xs + 16 * b), out[c]);
            out[c] = _mm256_fmadd_ps(zero, _mm256_loadu_ps(xs + 16 * b + 8), out[c]);
        }
    }
    for (int c = 0; c < GG_C1 && c < cols; c++) y[c] = hsum(out[c]);
}
#else
GQK_TILE(iq4_xs, 136, 1, 1, GG_C1)
#endif
GQK_TILE(iq4_xs, 136, 1, 2, GG_C2) GQK_TILE(iq4_xs, 136, 1, 3, GG_C3) GQK_TILE(iq4_xs, 136, 1, 4, GG_C4)
GQK_TILES(q4_k, 144, 0)
GQK_TILES(q5_k, 176, 0)
GQK_TILES(q6_k, 210, 0)
GQK_TILES(q2_k, 84, 0)
GQK_TILES(q3_k, 110, 0)


/* Many rows: one column at a time over up to GQ_ROWS rows, each chunk of the column decoded once for all of them (the
 * tiles above decode it once per 4 rows); the rows' running sums wait in memory between chunks. Each output gets the
 * very operations of the tiles above in the same order, so a row's result does not depend on the path. */
#define GQ_ROWS 16
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
                const float *sr = xs + r * lds + 16 * i;                                                           \
                acc = _mm256_fmadd_ps(zl, _mm256_loadu_ps(sr), acc);                                               \
                acc = _mm256_fmadd_ps(zh, _mm256_loadu_ps(sr + 8), acc);                                           \
                out[r] = acc;                                                                                      \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < rows; r++) y[r * ldy] = hsum(out[r]);                                                  \
    }
#define GQKM_TILE(T, BYTES, SIGNED)                                                                                \
    static void gqm_##T(const uint8_t *q, const int8_t *xq, const float *xd, const float *xs, const int32_t *xc,  \
                        const gq_lanes *ln, int64_t K, int64_t nb, float *y, int64_t ldy, int rows) {             \
        const int64_t nbx = K / QB, lds = gq_sums(K);                                                             \
        __m256 out[GQ_ROWS];                                                                                       \
        for (int r = 0; r < rows; r++) out[r] = _mm256_setzero_ps();                                               \
        for (int64_t b = 0; b < nb; b++) {                                                                         \
            __m256i u[8], scp[8];                                                                                  \
            __m256 zl, zh;                                                                                         \
            float d;                                                                                               \
            gqk_##T(q + b * (BYTES), u, scp, &d, &zl, &zh);                                                        \
            const __m256 dd = _mm256_set1_ps(d);                                                                   \
            __m256i aw[8]; /* the unsigned operands */                                                             \
            for (int j = 0; j < 8; j++) aw[j] = SIGNED ? _mm256_abs_epi8(u[j]) : u[j];                             \
            for (int r = 0; r < rows; r++) {                                                                       \
                __m256 acc = _mm256_setzero_ps();                                                                  \
                _Pragma("GCC unroll 8") for (int j = 0; j < 8; j++) {                                             \
                    const __m256i w = aw[j];                                                                       \
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + 256 * b + 32 * j));       \
                    const __m256i p = _mm256_maddubs_epi16(w, SIGNED ? _mm256_sign_epi8(xv, u[j]) : xv);           \
                    const __m256 t = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, scp[j]));                             \
                    const __m256 dv = _mm256_broadcast_ss(xd + r * nbx + 8 * b + j);                              \
                    acc = j ? _mm256_fmadd_ps(t, dv, acc) : _mm256_mul_ps(t, dv);                                  \
                }                                                                                                  \
                const float *sr = xs + r * lds + 16 * b;                                                           \
                __m256 o = _mm256_fmadd_ps(acc, dd, out[r]);                                                       \
                o = _mm256_fmadd_ps(zl, _mm256_loadu_ps(sr), o);                                                   \
                out[r] = _mm256_fmadd_ps(zh, _mm256_loadu_ps(sr + 8), o);                                          \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < rows; r++) y[r * ldy] = hsum(out[r]);                                                  \
    }
GQM_TILE(q4_1, 8, 20)
GQM_TILE(q5_1, 8, 24)
GQKM_TILE(iq4_xs, 136, 1)
GQKM_TILE(q4_k, 144, 0)
GQKM_TILE(q5_k, 176, 0)
GQKM_TILE(q6_k, 210, 0)
GQKM_TILE(q2_k, 84, 0)
GQKM_TILE(q3_k, 110, 0)

/* The signed blocks of 32 (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4) take another order: each block's whole dot product D_b
 * (exact int32) times P_b = d_b * dx_b, two accumulators per output, the even and the odd blocks',
 *   a_{b % 2} = fma(float(D_b), P_b, a_{b % 2}) for the blocks b in order;  y = a_0 + a_1.
 * The vector lanes then hold 8 outputs: 8 columns of each of 1-4 rows (gqt_T_R, the lane sums of their dot
 * products, gq_lane_sums), or from GQS_MIN_ROWS rows on 8 rows of one column (gqm_T, 8 rows and more) or 4 rows of
 * one column for a pair of blocks (gqf_T, fewer rows): the rows' activation bytes XT against broadcast weight bytes,
 * a vpdpbusd per 4 elements of each lane's row. */

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
INLINE __m256 gqs_f16_scales(__m256i dwords) {
    const __m256i h = _mm256_and_si256(dwords, _mm256_set1_epi32(0xFFFF));
    return _mm256_cvtph_ps(_mm_packus_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
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
 * the R rows. */
#define GQS_TILE(T, BYTES, R)                                                                                      \
    static void gqt_##T##_##R(const uint8_t *q, int64_t rb, int cols, const int8_t *xq, const float *xd,         \
                              const float *xs, const int32_t *xc, int64_t K, int64_t nb, float *y, int64_t ldy) { \
        (void)xs;                                                                                                  \
        enum { OFF = GQ_OFFSET_ROWS };                                                                             \
        const int64_t nbx = K / QB;                                                                                \
        const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);                                            \
        const __m256i valid = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);                                   \
        const __m256i at = _mm256_mullo_epi32(lane, _mm256_set1_epi32((int)rb));                                   \
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
            const __m256 sv = GQS_SCALES_##T(                                                                      \
                _mm256_mask_i32gather_epi32(_mm256_setzero_si256(), (const int *)(q + b * (BYTES)), at, valid, 1)); \
            _Pragma("GCC unroll 4") for (int r = 0; r < R; r++) {                                                 \
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + r * K + QB * b));                     \
                __m256i v[8];                                                                                      \
                _Pragma("GCC unroll 8") for (int c = 0; c < 8; c++)                                               \
                    v[c] = c < cols ? GQ_SIGNED_DOT(w[c], u[c], xv, xc + r * (K / 4) + 8 * b, OFF)                 \
                                    : _mm256_setzero_si256();                                                      \
                acc[r][b & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(gq_lane_sums(v)),                               \
                                                _mm256_mul_ps(sv, _mm256_set1_ps(xd[r * nbx + b])), acc[r][b & 1]); \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++) {                                                                              \
            float t[8];                                                                                            \
            _mm256_storeu_ps(t, _mm256_add_ps(acc[r][0], acc[r][1]));                                              \
            for (int c = 0; c < cols; c++) y[r * ldy + c] = t[c];                                                  \
        }                                                                                                          \
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

typedef void (*gq_tile_fn)(const uint8_t *, int64_t, int, const int8_t *, const float *, const float *,
                           const int32_t *, int64_t, int64_t, float *, int64_t);
typedef void (*gq_rows_fn)(const uint8_t *, const int8_t *, const float *, const float *, const int32_t *,
                           const gq_lanes *, int64_t, int64_t, float *, int64_t, int);
typedef void (*gq_pairs_fn)(const uint8_t *, const gq_lanes *, int64_t, float *, int64_t, int);
#define GQ_ROW(id, T) {id, {gqt_##T##_1, gqt_##T##_2, gqt_##T##_3, gqt_##T##_4}, gqm_##T, NULL}
#define GQS_ROW(id, T) {id, {gqt_##T##_1, gqt_##T##_2, gqt_##T##_3, gqt_##T##_4}, gqm_##T, gqf_##T}
static const struct {
    int type;
    gq_tile_fn tiles[4];
    gq_rows_fn rows;
    gq_pairs_fn pairs;
} GQ_TYPES[] = {GQS_ROW(2, q4_0),  GQ_ROW(3, q4_1),  GQS_ROW(6, q5_0),  GQ_ROW(7, q5_1),
                GQS_ROW(8, q8_0),  GQ_ROW(10, q2_k), GQ_ROW(11, q3_k), GQ_ROW(12, q4_k),
                GQ_ROW(13, q5_k), GQ_ROW(14, q6_k), GQS_ROW(20, iq4_nl), GQ_ROW(23, iq4_xs),
                GQS_ROW(39, mxfp4)};
#endif

/* Columns [n0, n1) of y for rows [0, m) of the integer path's row data (xd, xs, xq, xc: gq_quantize_row's, row r at
 * r times each one's length) and blocks q of type t; lanes: the rows' lane layout (gq_fill_lanes) where t is a signed
 * block of 32 and m >= GQS_MIN_ROWS, else unused; w: k floats of scratch (the portable build's dequantized column). */
static void gq_cols(const gguf_type *t, const float *xd, const float *xs, const int8_t *xq, const int32_t *xc,
                    const void *lanes, const uint8_t *q, float *y, int64_t ldy, int64_t m, int64_t k, int64_t n0,
                    int64_t n1, float *w) {
    const int64_t nb = k / t->elems, rb = nb * t->bytes, nbx = k / QB;
#if defined(__AVX2__) && defined(__FMA__)
    const int64_t lds = gq_sums(k);
    (void)w;
    const gq_tile_fn *tiles = NULL;
    gq_rows_fn rows_fn = NULL;
    gq_pairs_fn pairs_fn = NULL;
    for (size_t i = 0; i < sizeof GQ_TYPES / sizeof GQ_TYPES[0]; i++)
        if (GQ_TYPES[i].type == t->type)
            tiles = GQ_TYPES[i].tiles, rows_fn = GQ_TYPES[i].rows, pairs_fn = GQ_TYPES[i].pairs;
    /* the signed blocks of 32 (measured fastest so): with VNNI, up to 3 rows in the tiles, 4-7 in block pairs (gqf),
     * more in groups of 8 (gqm); without, the tiles up to 15 rows, then groups of 8 */
    const int is_signed = pairs_fn != NULL;
    const int signed_lanes = is_signed && m >= (GQ_OFFSET_ROWS ? GQS_MIN_ROWS : GQ_ROWS);
    const int64_t many = is_signed ? (signed_lanes ? 1 : m + 1) : GQ_ROWS / 2; /* rows from which gqm runs */
    /* rows whose bytes stay within ~256 KiB, a multiple of GQ_ROWS (the many-rows path starts at whole groups of 8) */
    const int64_t chunk = ((256 * 1024) / k / GQ_ROWS < 1 ? 1 : (256 * 1024) / k / GQ_ROWS) * GQ_ROWS;
    const gq_lanes none = {NULL, NULL, NULL};
    for (int64_t m0 = 0; m0 < m; m0 += chunk) {
        const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
        for (int64_t c0 = n0; c0 < n1; c0 += 8) { /* 8 columns' blocks stay in cache over the rows */
            const int64_t c1 = c0 + 8 < n1 ? c0 + 8 : n1;
            int64_t r0 = m0;
            for (; signed_lanes && m < 8 && r0 < m1; r0 += 4) { /* the signed blocks, 4-7 rows: block pairs */
                const gq_lanes ln = gq_lanes_in(lanes, m, k, r0 / 4);
                for (int64_t c = c0; c < c1; c++)
                    pairs_fn(q + c * rb, &ln, nb, y + r0 * ldy + c, ldy, (int)(m1 - r0 < 4 ? m1 - r0 : 4));
            }
            /* many rows: each column decoded once per GQ_ROWS (the signed blocks: 8 rows in the lanes) */
            for (; m1 - r0 >= many; r0 += GQ_ROWS) {
                const int rr = (int)(m1 - r0 < GQ_ROWS ? m1 - r0 : GQ_ROWS);
                const gq_lanes ln = is_signed ? gq_lanes_in(lanes, m, k, r0 / 8) : none;
                for (int64_t c = c0; c < c1; c++)
                    rows_fn(q + c * rb, xq + r0 * k, xd + r0 * nbx, xs + r0 * lds, xc + r0 * (k / 4), &ln, k, nb,
                            y + r0 * ldy + c, ldy, rr);
            }
            for (; r0 < m1; r0 += 4) {
                const int rr = (int)(m1 - r0 < 4 ? m1 - r0 : 4), tc = is_signed ? 8 : GG_COLS[rr - 1];
                for (int64_t c = c0; c < c1; c += tc)
                    tiles[rr - 1](q + c * rb, rb, (int)(c1 - c < tc ? c1 - c : tc), xq + r0 * k, xd + r0 * nbx,
                                  xs + r0 * lds, xc + r0 * (k / 4), k, nb, y + r0 * ldy + c, ldy);
            }
        }
    }
#else
    (void)xs, (void)xc, (void)lanes;
    if (gq_signed_type(t->type)) { /* the signed blocks' order (GQS_TILE) */
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
        return;
    }
    /* portable: each column dequantized (the reference's values), then per row sum_b d_b * (sum of q * w in block b) */
    for (int64_t c = n0; c < n1; c++) {
        t->fn(q + c * rb, nb, w);
        for (int64_t r = 0; r < m; r++) {
            float acc = 0.0f;
            for (int64_t b = 0; b < nbx; b++) {
                float s = 0.0f;
                for (int i = 0; i < QB; i++) s += (float)xq[r * k + b * QB + i] * w[b * QB + i];
                acc += xd[r * nbx + b] * s;
            }
            y[r * ldy + c] = acc;
        }
    }
#endif
}

/* ==== Packed output heads with int16-quantized activations ====================================================
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
 * The portable build computes the same lanes in plain C, so its results are the vector build's bits. */

/* One row's data (plain C): d [K/32], the codes q [K] (int16). */
static void gh_quantize_row(const float *x, int64_t k, float *d, int16_t *xq) {
    for (int64_t b = 0; b < k / QB; b++) {
        const float *xb = x + b * QB, amax = block_amax(xb);
        const float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int i = 0; i < QB; i++) xq[b * QB + i] = (int16_t)__builtin_nearbyintf(xb[i] * id);
        d[b] = amax / 32767.0f;
    }
}

/* Blocks of 32 per unit and bytes per unit of each head type. */
#define GH_Q8_0_BLOCKS 1
#define GH_Q8_0_BYTES 34
#define GH_Q6_K_BLOCKS 8
#define GH_Q6_K_BYTES 210

static int gh_supported(int type) { return type == 8 || type == 14; }

#if defined(__AVX2__) && defined(__FMA__)

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define GH_DOT(w0, x0, w1, x1) _mm256_dpwssd_epi32(_mm256_madd_epi16(w0, x0), w1, x1)
#elif defined(__AVXVNNI__)
#define GH_DOT(w0, x0, w1, x1) _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(w0, x0), w1, x1)
#else
#define GH_DOT(w0, x0, w1, x1) _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1))
#endif

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
    __m256i scp[8];
    __m256 zl, zh;
    gqk_q6_k(q, s->u, scp, &s->d, &zl, &zh);
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
#define GH_TILES(T, TU)                                                                                            \
    GH_TILE(T, TU, 1, GG_C1) GH_TILE(T, TU, 2, GG_C2) GH_TILE(T, TU, 3, GG_C3) GH_TILE(T, TU, 4, GG_C4)
GH_TILES(q8_0, Q8_0)
GH_TILES(q6_k, Q6_K)

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

/* Columns [n0, n1) of y for rows [0, m) of the head path's row data (xd, xq: gh_quantize_row's) and blocks q of GGML
 * type `type`. */
static void gh_cols(int type, const float *xd, const int16_t *xq, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                    int64_t k, int64_t n0, int64_t n1) {
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

/* 1 where the head path takes GGUF blocks of `type` (a GGML type id). */
int llmd_gguf_q16_type(int type) { return gh_supported(type); }

/* ==== The GGUF matmuls in steps (cpu_gguf.h) ====================================================================
 *
 * Each path's activation rows are prepared once (plain C, row by row: a row's data never depends on the other rows),
 * a group of consecutive rows adds what a matmul over exactly those rows reads (the int8 lane layout, the fp32 rows
 * transposed), and each thread computes ranges of output columns with the functions above, which choose their tiles
 * by the group's row count as the whole-matrix entries always did. The entries below are these steps in one parallel
 * region; cpu_moe.c runs a layer's experts with them. The arrays of a rows set, per path:
 *   fp32: a[0] gg_prepare's activations [kp], a[1] its sums [chunks * GG_XS] (portable: a[0] the row as given [K]);
 *   int8: a[0] d [K/32], a[1] S [gq_sums], a[2] the bytes q [K], a[3] C [K/4] (where LLMD_GX_C);
 *   int16: a[0] d [K/32], a[2] the codes q [K] (int16). */

static size_t gx_align(size_t bytes) { return (bytes + 63) / 64 * 64; }

void llmd_thread_id(int *tid, int *nth) { thread_id(tid, nth); }

int llmd_gx_takes(int act, int type, int64_t k) {
    if (!gguf_type_of(type, k)) return 0;
    if (act == LLMD_ACT_F32) return 1;
    return k % QB == 0 && (act == LLMD_ACT_I8 || (act == LLMD_ACT_I16 && gh_supported(type)));
}

int llmd_gx_flags(int act, int type) {
    if (act != LLMD_ACT_I8) return 0;
    return gq_signed_type(type) ? LLMD_GX_C | LLMD_GX_LANES : type == 23 ? LLMD_GX_C : 0;
}

/* 1 where rows prepared for type a serve type b on path `act` */
static int gx_same_rows(int act, int a, int b) { return act != LLMD_ACT_F32 || a == b; }

int64_t llmd_gx_layout_of(int act, const llmd_gguf_part *parts, int64_t i) {
    for (int64_t j = 0; j < i; j++)
        if (gx_same_rows(act, (int)parts[j].type, (int)parts[i].type)) return j;
    return i;
}

/* the rows' fields and row lengths, no arrays yet */
static void gx_init(llmd_gx_rows *r, int act, int type, int flags, int64_t k) {
    memset(r, 0, sizeof *r);
    r->act = act, r->type = type, r->flags = flags, r->k = k;
    const int64_t nbx = k / QB;
    if (act == LLMD_ACT_F32) {
#if defined(__AVX2__) && defined(__FMA__)
        const gguf_type *t = gguf_type_of(type, k);
        r->row[0] = (size_t)gg_padded(t, k) * 4;
        r->row[1] = (size_t)((k + GG_CHUNK - 1) / GG_CHUNK * GG_XS) * 4;
#else
        r->row[0] = (size_t)k * 4;
#endif
    } else if (act == LLMD_ACT_I8) {
        r->row[0] = (size_t)nbx * 4, r->row[1] = (size_t)gq_sums(k) * 4, r->row[2] = (size_t)k;
        r->row[3] = flags & LLMD_GX_C ? (size_t)k : 0; /* k / 4 int32 */
    } else {
        r->row[0] = (size_t)nbx * 4, r->row[2] = (size_t)k * 2;
    }
}

size_t llmd_gx_bytes(int act, int type, int flags, int64_t k, int64_t rows) {
    llmd_gx_rows r;
    gx_init(&r, act, type, flags, k);
    size_t bytes = 0;
    for (int i = 0; i < 4; i++) bytes += gx_align(r.row[i] * (size_t)rows);
    return bytes;
}

void llmd_gx_place(llmd_gx_rows *r, int act, int type, int flags, int64_t k, int64_t rows, void *buf) {
    gx_init(r, act, type, flags, k);
    char *at = (char *)buf;
    for (int i = 0; i < 4; i++) {
        r->a[i] = at;
        at += gx_align(r->row[i] * (size_t)rows);
    }
    if (!r->row[3]) r->a[3] = r->a[2]; /* int8 without C: a pointer the tiles pass along and never read */
}

void llmd_gx_prepare(const llmd_gx_rows *r, int64_t row, const float *x) {
    char *a0 = r->a[0] + row * r->row[0], *a1 = r->a[1] + row * r->row[1], *a2 = r->a[2] + row * r->row[2];
    if (r->act == LLMD_ACT_F32) {
#if defined(__AVX2__) && defined(__FMA__)
        gg_prepare(gguf_type_of(r->type, r->k), x, r->k, 1, r->k, (float *)a0, (float *)a1);
#else
        (void)a1, (void)a2;
        memcpy(a0, x, r->row[0]);
#endif
    } else if (r->act == LLMD_ACT_I8) {
        gq_quantize_row(x, r->k, r->flags & LLMD_GX_C, (float *)a0, (float *)a1, (int8_t *)a2,
                        (int32_t *)(r->a[3] + row * r->row[3]));
    } else {
        gh_quantize_row(x, r->k, (float *)a0, (int16_t *)a2);
    }
}

void llmd_gx_copy(const llmd_gx_rows *dst, int64_t to, const llmd_gx_rows *src, int64_t from) {
    for (int i = 0; i < 4; i++)
        if (dst->row[i]) memcpy(dst->a[i] + to * dst->row[i], src->a[i] + from * src->row[i], dst->row[i]);
}

size_t llmd_gx_group_bytes(const llmd_gx_rows *r, int64_t m) {
#if defined(__AVX2__) && defined(__FMA__)
    if (r->act == LLMD_ACT_F32 && m >= RP_MIN_ROWS) /* the rows and their sums transposed */
        return gx_align((size_t)((m + 15) / 16 * 16) * (r->row[0] + r->row[1]));
#endif
    if (r->act == LLMD_ACT_I8 && (r->flags & LLMD_GX_LANES)) return gx_align(gq_lanes_bytes(m, r->k));
    return 0;
}

void llmd_gx_make_group(llmd_gx_group *g, const llmd_gx_rows *r, int64_t r0, int64_t m, void *extra) {
    g->x = *r;
    for (int i = 0; i < 4; i++) g->x.a[i] += r0 * r->row[i];
    g->m = m;
    g->extra = llmd_gx_group_bytes(r, m) ? extra : NULL;
    if (!g->extra) return;
#if defined(__AVX2__) && defined(__FMA__)
    if (r->act == LLMD_ACT_F32) {
        const int64_t kp = (int64_t)(r->row[0] / 4), lds = (int64_t)(r->row[1] / 4);
        float *xt = (float *)extra;
        transpose_into(xt, (const float *)g->x.a[0], kp, m, kp, kp, 0);
        transpose_into(xt + (m + 15) / 16 * 16 * kp, (const float *)g->x.a[1], lds, m, lds, lds, 0);
        return;
    }
#endif
    gq_fill_lanes(extra, (const float *)g->x.a[0], (const int8_t *)g->x.a[2], (const int32_t *)g->x.a[3], m, g->x.k);
}

size_t llmd_gx_scratch_bytes(int act, int type, int64_t k, int64_t m) {
#if defined(__AVX2__) && defined(__FMA__)
    if (act == LLMD_ACT_F32 && m >= RP_MIN_ROWS) return gx_align((size_t)gg_panel_floats(gguf_type_of(type, k), k) * 4);
    return 0;
#else
    (void)type, (void)m;
    return act == LLMD_ACT_I16 ? 0 : gx_align((size_t)k * 4);
#endif
}

void llmd_gx_cols(const llmd_gx_job *job, int64_t n0, int64_t n1, void *scratch) {
    const llmd_gx_group *g = job->g;
    const llmd_gx_rows *x = &g->x;
    const int64_t k = x->k, m = g->m;
    const gguf_type *t = gguf_type_of((int)job->type, k);
    if (x->act == LLMD_ACT_F32) {
#if defined(__AVX2__) && defined(__FMA__)
        if (m >= RP_MIN_ROWS) {
            const float *xt = (const float *)g->extra;
            gg_rows_cols(t, xt, xt + (m + 15) / 16 * 16 * (int64_t)(x->row[0] / 4), job->q, job->y, job->ldy, m, k,
                         n0, n1, (float *)scratch);
        } else {
            gg_tile_cols(t, (const float *)x->a[0], (const float *)x->a[1], job->q, job->y, job->ldy, m, k, n0, n1);
        }
#else
        gg_plain_cols(t, (const float *)x->a[0], job->q, job->y, job->ldy, m, k, n0, n1, (float *)scratch);
#endif
    } else if (x->act == LLMD_ACT_I8) {
        gq_cols(t, (const float *)x->a[0], (const float *)x->a[1], (const int8_t *)x->a[2], (const int32_t *)x->a[3],
                g->extra, job->q, job->y, job->ldy, m, k, n0, n1, (float *)scratch);
    } else {
        gh_cols((int)job->type, (const float *)x->a[0], (const int16_t *)x->a[2], job->q, job->y, job->ldy, m, k, n0,
                n1);
    }
}

void llmd_gx_run(const llmd_gx_job *jobs, int64_t njobs, int tid, int nth, void *scratch) {
    /* a unit of 8 columns costs its rows plus a few for decoding the weights */
    int64_t total = 0;
    for (int64_t j = 0; j < njobs; j++) total += (jobs[j].n + 7) / 8 * (jobs[j].g->m + 4);
    const int64_t lo = total * tid / nth, hi = total * (tid + 1) / nth;
    int64_t at = 0;
    for (int64_t j = 0; j < njobs && at < hi; j++) {
        const int64_t units = (jobs[j].n + 7) / 8, w = jobs[j].g->m + 4;
        if (at + units * w > lo) { /* unit u is this thread's where its cost starts in [lo, hi) */
            const int64_t u0 = lo > at ? (lo - at + w - 1) / w : 0;
            const int64_t u1 = (hi - at + w - 1) / w < units ? (hi - at + w - 1) / w : units;
            if (u0 < u1) llmd_gx_cols(&jobs[j], 8 * u0, 8 * u1 < jobs[j].n ? 8 * u1 : jobs[j].n, scratch);
        }
        at += units * w;
    }
}

/* Parts side by side on one input through path `act`: part i fills columns [col_i, col_i + n_i) of y. The rows are
 * prepared once per layout (int8 and int16: once for every part), then every part's columns are shared out in one
 * parallel region. -1 for a type the path does not take or a K the blocks do not divide, -2 out of memory. */
static int gx_parts_matmul(int act, const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                           int64_t ldy, int64_t m, int64_t k, int nthreads) {
    if (m < 0 || nparts < 0) return -1;
    int flags = 0;
    for (int64_t i = 0; i < nparts; i++) {
        if (!llmd_gx_takes(act, (int)parts[i].type, k) || parts[i].n < 0) return -1;
        flags |= llmd_gx_flags(act, (int)parts[i].type);
    }
    if (m == 0 || nparts == 0) return 0;
    if (nthreads < 1) nthreads = 1;
    typedef struct {
        llmd_gx_rows rows;
        llmd_gx_group group;
        llmd_gx_job job;
        int64_t layout;
        size_t at; /* the rows', then the group's extra offset in buf */
    } part_plan;
    part_plan *plan = (part_plan *)calloc((size_t)nparts, sizeof *plan);
    if (!plan) return -2;
    size_t bytes = 0, sb = 0;
    for (int64_t i = 0; i < nparts; i++) {
        plan[i].layout = llmd_gx_layout_of(act, parts, i);
        const size_t s = llmd_gx_scratch_bytes(act, (int)parts[i].type, k, m);
        sb = s > sb ? s : sb;
        if (plan[i].layout != i) continue;
        plan[i].at = bytes;
        bytes += llmd_gx_bytes(act, (int)parts[i].type, flags, k, m);
    }
    char *buf = (char *)aligned_alloc(64, bytes + gx_align(sb) * (size_t)nthreads + 64);
    if (!buf) {
        free(plan);
        return -2;
    }
    for (int64_t i = 0; i < nparts; i++)
        if (plan[i].layout == i) llmd_gx_place(&plan[i].rows, act, (int)parts[i].type, flags, k, m, buf + plan[i].at);
    size_t extras = 0;
    for (int64_t i = 0; i < nparts; i++)
        if (plan[i].layout == i) plan[i].at = extras, extras += llmd_gx_group_bytes(&plan[i].rows, m);
    char *extra = (char *)aligned_alloc(64, extras + 64), *scratch = buf + bytes;
    if (!extra) {
        free(buf), free(plan);
        return -2;
    }
    llmd_gx_job *jobs = (llmd_gx_job *)calloc((size_t)nparts, sizeof *jobs);
    if (!jobs) {
        free(extra), free(buf), free(plan);
        return -2;
    }
    int64_t col = 0;
    for (int64_t i = 0; i < nparts; i++) {
        const llmd_gx_job job = {&plan[plan[i].layout].group, parts[i].type, parts[i].n, ldy, parts[i].q, y + col};
        jobs[i] = job;
        col += parts[i].n;
    }
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid, nth;
        thread_id(&tid, &nth);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < nparts; i++)
                if (plan[i].layout == i) llmd_gx_prepare(&plan[i].rows, r, x + r * ldx);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nparts; i++)
            if (plan[i].layout == i) llmd_gx_make_group(&plan[i].group, &plan[i].rows, 0, m, extra + plan[i].at);
        llmd_gx_run(jobs, nparts, tid, nth, scratch + gx_align(sb) * (size_t)tid);
    }
    free(jobs), free(extra), free(buf), free(plan);
    return 0;
}

/* y [M, N] = x [M, K] @ dequant(q).T for GGUF blocks of `type` (a GGML type id), q [N, K / elems * bytes]. */
int llmd_gguf_matmul(int type, const float *x, int64_t ldx, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                     int64_t n, int64_t k, int nthreads) {
    const llmd_gguf_part part = {type, n, q};
    return gx_parts_matmul(LLMD_ACT_F32, &part, 1, x, ldx, y, ldy, m, k, nthreads);
}

/* Parts of different GGUF types side by side on one input (a fused q/k/v or gate/up whose projections differ in type):
 * part i fills columns [col_i, col_i + n_i) of y, each with llmd_gguf_matmul's very results. */
int llmd_gguf_parts_matmul(const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                           int64_t ldy, int64_t m, int64_t k, int nthreads) {
    return gx_parts_matmul(LLMD_ACT_F32, parts, nparts, x, ldx, y, ldy, m, k, nthreads);
}

/* llmd_gguf_parts_matmul with int8-quantized activations (quantized once for all parts); -1 for an unknown type or a
 * K the blocks do not divide, -2 out of memory. */
int llmd_gguf_parts_matmul_q8(const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                              int64_t ldy, int64_t m, int64_t k, int nthreads) {
    return gx_parts_matmul(LLMD_ACT_I8, parts, nparts, x, ldx, y, ldy, m, k, nthreads);
}

/* y [M, N] = q8(x) [M, K] @ dequant(q).T for GGUF blocks of `type`: the integer path of one part. */
int llmd_gguf_matmul_q8(int type, const float *x, int64_t ldx, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                        int64_t n, int64_t k, int nthreads) {
    const llmd_gguf_part part = {type, n, q};
    return gx_parts_matmul(LLMD_ACT_I8, &part, 1, x, ldx, y, ldy, m, k, nthreads);
}

/* llmd_gguf_parts_matmul with int16-quantized activations (the output head's path); -1 for a type it does not take
 * or a K the blocks do not divide, -2 out of memory. */
int llmd_gguf_parts_matmul_q16(const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                               int64_t ldy, int64_t m, int64_t k, int nthreads) {
    return gx_parts_matmul(LLMD_ACT_I16, parts, nparts, x, ldx, y, ldy, m, k, nthreads);
}

/* y [M, N] = q16(x) [M, K] @ dequant(q).T for Q8_0 or Q6_K blocks: the head path of one part. */
int llmd_gguf_matmul_q16(int type, const float *x, int64_t ldx, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                         int64_t n, int64_t k, int nthreads) {
    const llmd_gguf_part part = {type, n, q};
    return gx_parts_matmul(LLMD_ACT_I16, &part, 1, x, ldx, y, ldy, m, k, nthreads);
}
