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
 * per chunk.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

int llmd_cpu_gemm_simd(void) {
#if defined(__AVX2__) && defined(__FMA__)
    return 1;
#else
    return 0;
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

/* int4: activations already split per 16 k into [8 even k, 8 odd k] (xp, row stride K), so the low and high
 * nibbles of 8 bytes widen into two vectors that pair with them directly. G % 16 == 0.
 * w = (q - 8) * s + z = q * s + (z - 8 s), one FMA per 8 weights, shared by the R rows. */
#define INT4_TILE(R, C)                                                                                            \
    static void int4_tile_##R##_##C(const float *xp, const uint8_t *q, const float *s, const float *z, float *y,  \
                                    int64_t ldy, int64_t K, int64_t G) {                                          \
        const int64_t ng = K / G, kh = K / 2;                                                                      \
        const __m256i mask = _mm256_set1_epi32(0xF);                                                               \
        __m256 acc[R][C];                                                                                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < R; r++)                                                       \
        _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) acc[r][c] = _mm256_setzero_ps();                      \
        const __m256 eight = _mm256_set1_ps(8.0f);                                                                 \
        /* one flat loop over k (the group index advances on the side): a loop per group would let the compiler  \
         * hoist 2C scale/zero vectors out of it, evicting the accumulators from the 16 registers */             \
        int64_t g = 0, gend = G;                                                                                   \
        for (int64_t k = 0; k < K; k += 16) {                                                                      \
            if (k == gend) {                                                                                       \
                g++;                                                                                               \
                gend += G;                                                                                         \
            }                                                                                                      \
            _mm_prefetch((const char *)(q + PF_TILES * C * kh + (k >> 4) * (8 * C)), _MM_HINT_T0);                \
            __m256 xe[R], xo[R];                                                                                   \
            _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                                 \
                xe[r] = _mm256_loadu_ps(xp + r * K + k);                                                           \
                xo[r] = _mm256_loadu_ps(xp + r * K + k + 8);                                                       \
            }                                                                                                      \
            _Pragma("GCC unroll 8") for (int c = 0; c < C; c++) {                                                 \
                __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(q + c * kh + (k >> 1))));      \
                __m256 sv = _mm256_broadcast_ss(s + c * ng + g);                                                   \
                __m256 zv = _mm256_fnmadd_ps(eight, sv, _mm256_broadcast_ss(z + c * ng + g));                      \
                __m256 lo = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b, mask)), sv, zv);                \
                __m256 hi = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), sv, zv);                  \
                _Pragma("GCC unroll 8") for (int r = 0; r < R; r++) {                                             \
                    acc[r][c] = _mm256_fmadd_ps(xe[r], lo, acc[r][c]);                                             \
                    acc[r][c] = _mm256_fmadd_ps(xo[r], hi, acc[r][c]);                                             \
                }                                                                                                  \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C; c++) y[r * ldy + c] = hsum(acc[r][c]);                                          \
    }

/* Tile shapes: a single row streams TILE_C1 columns at a time (independent accumulators hide the FMA latency);
 * several rows share TILE_CM columns at a time, TILE_R rows per tile. Remainders use smaller tiles: every shape
 * computes each output with the same operations in the same order. */
#define TILE_R 4
#define TILE_C1 8
#define TILE_CM 4

#define TILES_FOR_C(T, C) T(1, C) T(2, C) T(3, C) T(4, C)
#define ALL_TILES(T)                                                                                               \
    TILES_FOR_C(T, 1) TILES_FOR_C(T, 2) TILES_FOR_C(T, 3) TILES_FOR_C(T, 4)                                       \
    T(1, 5) T(1, 6) T(1, 7) T(1, 8)
ALL_TILES(INT8_TILE)
ALL_TILES(INT4_TILE)

typedef void (*int8_tile_fn)(const float *, int64_t, const int8_t *, const float *, float *, int64_t, int64_t,
                             int64_t);
typedef void (*int4_tile_fn)(const float *, const uint8_t *, const float *, const float *, float *, int64_t, int64_t,
                             int64_t);

#define ROW_OF(T, C) {T##_1_##C, T##_2_##C, T##_3_##C, T##_4_##C}
/* [C - 1][R - 1]; C > 4 only for one row */
static const int8_tile_fn INT8_TILES[8][4] = {
    ROW_OF(int8_tile, 1), ROW_OF(int8_tile, 2), ROW_OF(int8_tile, 3), ROW_OF(int8_tile, 4),
    {int8_tile_1_5}, {int8_tile_1_6}, {int8_tile_1_7}, {int8_tile_1_8}};
static const int4_tile_fn INT4_TILES[8][4] = {
    ROW_OF(int4_tile, 1), ROW_OF(int4_tile, 2), ROW_OF(int4_tile, 3), ROW_OF(int4_tile, 4),
    {int4_tile_1_5}, {int4_tile_1_6}, {int4_tile_1_7}, {int4_tile_1_8}};

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
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        int64_t n0, n1;
        column_range(n, tid, nth, &n0, &n1);
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
#if defined(__AVX2__) && defined(__FMA__)
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
    return 0;
}

/* ---- int4 ---------------------------------------------------------------------------------------------------- */

int llmd_int4_matmul(const float *x, int64_t ldx, const uint8_t *q, const float *s, const float *z, float *y,
                     int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t g, int nthreads) {
    if (m < 0 || n < 0 || k <= 0 || g <= 0 || k % g || g % 2) return -1;
    if (nthreads < 1) nthreads = 1;
    const int64_t ng = k / g, kh = k / 2;
#if defined(__AVX2__) && defined(__FMA__)
    if (g % 16) return -1;
    /* Split every 16 activations into [x0 x2 .. x14, x1 x3 .. x15]: the low/high nibbles of 8 bytes. */
    float *xp = (float *)aligned_alloc(32, (size_t)((m * k * 4 + 31) / 32 * 32 + 32));
    if (!xp) return -2;
    for (int64_t r = 0; r < m; r++)
        for (int64_t i = 0; i < k; i += 16)
            for (int j = 0; j < 8; j++) {
                xp[r * k + i + j] = x[r * ldx + i + 2 * j];
                xp[r * k + i + 8 + j] = x[r * ldx + i + 2 * j + 1];
            }
    const int64_t chunk = row_chunk(k);
#endif
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid = 0, nth = 1;
#ifdef _OPENMP
        tid = omp_get_thread_num();
        nth = omp_get_num_threads();
#endif
        int64_t n0, n1;
        column_range(n, tid, nth, &n0, &n1);
#if defined(__AVX2__) && defined(__FMA__)
        for (int64_t m0 = 0; m0 < m; m0 += chunk) {
            const int64_t m1 = m0 + chunk < m ? m0 + chunk : m;
            const int tc = (m1 - m0) == 1 ? TILE_C1 : TILE_CM;
            for (int64_t c0 = n0; c0 < n1; c0 += tc) {
                const int cc = (int)(n1 - c0 < tc ? n1 - c0 : tc);
                for (int64_t r0 = m0; r0 < m1; r0 += TILE_R) {
                    const int rr = (int)(m1 - r0 < TILE_R ? m1 - r0 : TILE_R);
                    INT4_TILES[cc - 1][rr - 1](xp + r0 * k, q + c0 * kh, s + c0 * ng, z + c0 * ng, y + r0 * ldy + c0,
                                  ldy, k, g);
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
    free(xp);
#endif
    return 0;
}
