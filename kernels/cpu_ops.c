/* The fp32 glue of a decoder layer on the CPU: RMSNorm, RoPE, SiLU(gate) * up, writing K/V into the paged cache, and
 * attention over it: single-token (decode) queries, and causal chunks of new tokens (prefill, speculative verify).
 *
 * Each op is one call where torch needs five to fifteen small ones; on a small model at batch 1 those calls, not the
 * arithmetic, were a third of a decode step. Built into the same library as cpu_gemm.c (llmd.kernels.cpu_gemm).
 *
 * Every output row is computed by one thread in a fixed order, whatever the batch and thread count, so a sequence's
 * results never depend on what else runs in its step (llmd's exactness invariant).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* ---- exp on 8 lanes: exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln2 / 2, exp(r) by a degree-6 polynomial
 * (Taylor coefficients; relative error below 2e-7 on that interval). Scalar code uses expf. ---------------------- */
#if defined(__AVX2__) && defined(__FMA__)
INLINE __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    /* ln 2 split in a part exact in float and a remainder, so r keeps its precision */
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

INLINE float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
#define SIMD 1
#else
#define SIMD 0
#endif

/* sum of a[i] * b[i], i < n; four independent accumulators so the FMAs' latencies overlap */
INLINE float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float s = 0.0f;
#if SIMD
    __m256 acc0 = _mm256_setzero_ps(), acc1 = acc0, acc2 = acc0, acc3 = acc0;
    for (; i + 32 <= n; i += 32) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
        acc2 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 16), _mm256_loadu_ps(b + i + 16), acc2);
        acc3 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 24), _mm256_loadu_ps(b + i + 24), acc3);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    s = hsum8(_mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3)));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* s[t] = exp(s[t] - max(s)), t < n; returns their sum */
static float softmax_numerators(float *s, int64_t n) {
    float m = s[0], sum = 0.0f;
    for (int64_t t = 1; t < n; t++) m = s[t] > m ? s[t] : m;
    int64_t t = 0;
#if SIMD
    const __m256 mv = _mm256_set1_ps(m);
    for (; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv)));
#endif
    for (; t < n; t++) s[t] = expf(s[t] - m);
    for (t = 0; t < n; t++) sum += s[t];
    return sum;
}

/* y = x / sqrt(mean(x^2) + eps) * w per row of n values (as transformers: normalise, then scale by w). */
int llmd_rms_norm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t rows, int64_t n,
                  float eps) {
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * ldx;
        float *yr = y + t * ldy;
        float inv = 1.0f / sqrtf(dot(xr, xr, n) / (float)n + eps);
        for (int64_t i = 0; i < n; i++) yr[i] = w[i] * (xr[i] * inv);
    }
    return 0;
}

/* Rotate-half RoPE in place on `heads` heads of `d` values at the start of each row of x (row stride ldx):
 * x[i] = x[i] * cos[i] + x[i +- d/2] * ssin[i], with cos and the signed sin [rows, d] (llmd.model.llama.apply_rope:
 * the same products and sum, so the same values). */
int llmd_rope(float *x, int64_t ldx, const float *cos, const float *ssin, int64_t rows, int64_t heads, int64_t d) {
    int64_t half = d / 2;
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos + t * d, *s = ssin + t * d;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * ldx + h * d;
            for (int64_t i = 0; i < half; i++) {
                float a = v[i], b = v[i + half];
                float lo = a * c[i], hi = b * c[i + half];
                v[i] = lo + b * s[i];
                v[i + half] = hi + a * s[i + half];
            }
        }
    }
    return 0;
}

/* y[t, i] = silu(g[t, i]) * g[t, n + i]: the fused gate/up output [rows, 2n] (row stride ldg) -> [rows, n]. */
int llmd_silu_mul(const float *g, int64_t ldg, float *y, int64_t ldy, int64_t rows, int64_t n) {
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = g + t * ldg, *up = gate + n;
        float *yr = y + t * ldy;
        int64_t i = 0;
#if SIMD
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; i + 8 <= n; i += 8) {
            __m256 a = _mm256_loadu_ps(gate + i);
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), a));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < n; i++) yr[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
    }
    return 0;
}

/* Copy each new token's K and V (rows of `width` values, row strides ldk, ldv) into its cache slot; a cache is
 * [slots, width] contiguous. */
int llmd_write_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots, int64_t rows,
                  float *k_cache, float *v_cache, int64_t width, int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++) {
        if (slots[t] < 0 || slots[t] >= num_slots) return -1;
        memcpy(k_cache + slots[t] * width, k + t * ldk, width * sizeof(float));
        memcpy(v_cache + slots[t] * width, v + t * ldv, width * sizeof(float));
    }
    return 0;
}

/* ---- attention ------------------------------------------------------------------------------------------------
 * Decode tokens and chunks of new tokens (prefill, speculative verify) share one tile: up to PQ queries on one KV
 * head, each seeing the first len[j] tokens of a paged context (off[t]: token t's row in the cache). Each query's
 * scores, softmax and weighted sum are its own operations in a fixed order, whatever tile it shares, so a token's
 * attention output is bit-identical decoded alone, decoded in a batch or verified in a chunk: speculation and
 * recompute after preemption do not change a sequence's numbers. The tile only shares loads: each K row serves every
 * query's dot product (2 tokens at a time), each V vector every query's weighted sum. */
#define PQ 4

/* A tile of P queries (P <= PQ, a compile-time constant so the accumulators stay in registers); `s` holds P rows of
 * `ctx` floats (ctx >= every len[j]). */
INLINE void attend_tile_p(const float *const *q, const int64_t *len, const float *kb, const float *vb,
                          const int64_t *off, int64_t d, float scale, float *const *oj, float *s, int64_t ctx,
                          const int P) {
    int64_t longest = 0;
    for (int j = 0; j < P; j++) longest = len[j] > longest ? len[j] : longest;
    for (int64_t t = 0; t < longest; t += 2) {
        const float *k0 = kb + off[t], *k1 = t + 1 < longest ? kb + off[t + 1] : k0;
        int64_t c = 0;
        float d0[PQ] = {0}, d1[PQ] = {0};
#if SIMD
        __m256 a0[PQ], a1[PQ];
        for (int j = 0; j < P; j++) a0[j] = a1[j] = _mm256_setzero_ps();
        for (; c + 8 <= d; c += 8) {
            const __m256 kv0 = _mm256_loadu_ps(k0 + c), kv1 = _mm256_loadu_ps(k1 + c);
            for (int j = 0; j < P; j++) {
                const __m256 qv = _mm256_loadu_ps(q[j] + c);
                a0[j] = _mm256_fmadd_ps(qv, kv0, a0[j]);
                a1[j] = _mm256_fmadd_ps(qv, kv1, a1[j]);
            }
        }
        for (int j = 0; j < P; j++) d0[j] = hsum8(a0[j]), d1[j] = hsum8(a1[j]);
#endif
        for (; c < d; c++)
            for (int j = 0; j < P; j++) d0[j] += q[j][c] * k0[c], d1[j] += q[j][c] * k1[c];
        for (int j = 0; j < P; j++) {
            s[j * ctx + t] = d0[j] * scale;
            if (t + 1 < longest) s[j * ctx + t + 1] = d1[j] * scale;
        }
    }
    float inv[PQ];
    for (int j = 0; j < P; j++) {
        const int64_t n = len[j];
        float *sj = s + j * ctx;
        inv[j] = 1.0f / softmax_numerators(sj, n);
        for (int64_t t = n; t < longest; t++) sj[t] = 0.0f;
    }
    int64_t c = 0;
#if SIMD
    for (; c + 16 <= d; c += 16) {
        __m256 o0[PQ], o1[PQ];
        for (int j = 0; j < P; j++) o0[j] = o1[j] = _mm256_setzero_ps();
        for (int64_t t = 0; t < longest; t++) {
            const __m256 v0 = _mm256_loadu_ps(vb + off[t] + c), v1 = _mm256_loadu_ps(vb + off[t] + c + 8);
            for (int j = 0; j < P; j++) {
                const __m256 p = _mm256_broadcast_ss(s + j * ctx + t);
                o0[j] = _mm256_fmadd_ps(p, v0, o0[j]);
                o1[j] = _mm256_fmadd_ps(p, v1, o1[j]);
            }
        }
        for (int j = 0; j < P; j++) {
            _mm256_storeu_ps(oj[j] + c, _mm256_mul_ps(o0[j], _mm256_set1_ps(inv[j])));
            _mm256_storeu_ps(oj[j] + c + 8, _mm256_mul_ps(o1[j], _mm256_set1_ps(inv[j])));
        }
    }
#endif
    for (; c < d; c++)
        for (int j = 0; j < P; j++) {
            float acc = 0.0f;
            for (int64_t t = 0; t < longest; t++) acc += s[j * ctx + t] * vb[off[t] + c];
            oj[j][c] = acc * inv[j];
        }
}

static void attend_tile(const float *const *q, const int64_t *len, int nq, const float *kb, const float *vb,
                        const int64_t *off, int64_t d, float scale, float *const *oj, float *s, int64_t ctx) {
    switch (nq) {
    case 1: attend_tile_p(q, len, kb, vb, off, d, scale, oj, s, ctx, 1); break;
    case 2: attend_tile_p(q, len, kb, vb, off, d, scale, oj, s, ctx, 2); break;
    case 3: attend_tile_p(q, len, kb, vb, off, d, scale, oj, s, ctx, 3); break;
    default: attend_tile_p(q, len, kb, vb, off, d, scale, oj, s, ctx, PQ); break;
    }
}

/* token -> its row offset in a cache [num_blocks, block_size, kv_heads, d], through a block table */
static void token_offsets(int64_t *off, const int64_t *table, int64_t len, int64_t block_size, int64_t kv_heads,
                          int64_t d) {
    for (int64_t t = 0; t < len; t++) off[t] = (table[t / block_size] * block_size + t % block_size) * kv_heads * d;
}

/* Attention of B single-token queries over their paged contexts.
 * q: row b at q + rows[b] * ldq (rows NULL: row b) of num_rows, [heads, d] each; the output goes to the same row of
 * `out` (stride ldo). Caches [num_blocks, block_size, kv_heads, d]; block_tables [B, bt_stride]; seq_lens [B].
 * A task is a tile of up to PQ query heads sharing a KV head, or a single query head where that leaves too few tasks
 * to share among the threads (one sequence). `work` holds PQ * max(seq_lens) floats per thread. */
int llmd_decode_attention(const float *q, int64_t ldq, const int64_t *rows, int64_t B, int64_t num_rows,
                          const float *k_cache, const float *v_cache, int64_t num_blocks, int64_t block_size,
                          int64_t kv_heads, int64_t d, const int64_t *block_tables, int64_t bt_stride,
                          const int64_t *seq_lens, int64_t heads, float scale, float *out, int64_t ldo, float *work,
                          int64_t work_per_thread, int threads) {
    const int64_t group = heads / kv_heads;
    int64_t total = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b], row = rows ? rows[b] : b;
        if (len < 1 || PQ * len > work_per_thread || row < 0 || row >= num_rows) return -1;
        for (int64_t j = 0; j < (len + block_size - 1) / block_size; j++) {
            const int64_t blk = block_tables[b * bt_stride + j];
            if (blk < 0 || blk >= num_blocks) return -1;
        }
        total += len;
    }
    int64_t *off = (int64_t *)malloc((size_t)(total + B + 1) * sizeof(int64_t)); /* offsets, then where each starts */
    if (!off) return -2;
    int64_t *start = off + total;
    start[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        token_offsets(off + start[b], block_tables + b * bt_stride, seq_lens[b], block_size, kv_heads, d);
        start[b + 1] = start[b] + seq_lens[b];
    }
    const int64_t per_group = (group + PQ - 1) / PQ;
    const int tile = B * kv_heads * per_group >= 2 * threads ? PQ : 1; /* queries per task */
    const int64_t tiles = tile == PQ ? per_group : group;           /* tasks per KV head */
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < B * kv_heads * tiles; task++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        const int64_t b = task / (kv_heads * tiles), kvh = task / tiles % kv_heads;
        const int64_t h0 = kvh * group + task % tiles * tile;
        const int nq = (int)(kvh * group + group - h0 < tile ? kvh * group + group - h0 : tile);
        const int64_t row = rows ? rows[b] : b, len = seq_lens[b];
        const float *qj[PQ];
        float *oj[PQ];
        int64_t lens[PQ];
        for (int j = 0; j < nq; j++) {
            qj[j] = q + row * ldq + (h0 + j) * d;
            oj[j] = out + row * ldo + (h0 + j) * d;
            lens[j] = len;
        }
        attend_tile(qj, lens, nq, k_cache + kvh * d, v_cache + kvh * d, off + start[b], d, scale, oj,
                    work + tid * work_per_thread, len);
    }
    free(off);
    return 0;
}

/* Causal attention of one sequence's chunk of q_len new tokens (positions ctx - q_len .. ctx - 1) over its paged
 * context of ctx tokens (table: its block table): query i sees tokens 0 .. ctx - q_len + i. A task is one query head
 * and a tile of PQ consecutive queries. `work` holds PQ * ctx floats per thread. */
int llmd_prefill_attention(const float *q, int64_t ldq, int64_t q_len, int64_t ctx, const float *k_cache,
                           const float *v_cache, int64_t num_blocks, int64_t block_size, int64_t kv_heads, int64_t d,
                           const int64_t *table, int64_t heads, float scale, float *out, int64_t ldo, float *work,
                           int64_t work_per_thread, int threads) {
    if (q_len < 1 || ctx < q_len || PQ * ctx > work_per_thread) return -1;
    for (int64_t j = 0; j < (ctx + block_size - 1) / block_size; j++)
        if (table[j] < 0 || table[j] >= num_blocks) return -1;
    int64_t *off = (int64_t *)malloc((size_t)ctx * sizeof(int64_t));
    if (!off) return -2;
    token_offsets(off, table, ctx, block_size, kv_heads, d);
    const int64_t group = heads / kv_heads, tiles = (q_len + PQ - 1) / PQ;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < heads * tiles; task++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        const int64_t h = task / tiles, i0 = (task % tiles) * PQ, kvh = h / group;
        const int nq = q_len - i0 < PQ ? (int)(q_len - i0) : PQ;
        const float *qj[PQ];
        float *oj[PQ];
        int64_t len[PQ];
        for (int j = 0; j < nq; j++) {
            qj[j] = q + (i0 + j) * ldq + h * d;
            oj[j] = out + (i0 + j) * ldo + h * d;
            len[j] = ctx - q_len + i0 + j + 1;
        }
        attend_tile(qj, len, nq, k_cache + kvh * d, v_cache + kvh * d, off, d, scale, oj,
                    work + tid * work_per_thread, ctx);
    }
    free(off);
    return 0;
}
