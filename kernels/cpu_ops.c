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

/* Walk one KV head's cached rows of tokens 0..len-1 through a block table, with no division per token: `row`
 * points at token t's d values inside the loop body. */
#define FOR_EACH_TOKEN(cache, table, len, block_size, kv_heads, kvh, d, t, row)                                     \
    for (int64_t t = 0, blk_ = 0; t < (len); blk_++)                                                                \
        for (const float *row = (cache) + ((table)[blk_] * (block_size) * (kv_heads) + (kvh)) * (d),                \
                         *end_ = row + ((len) - t < (block_size) ? (len) - t : (block_size)) * (kv_heads) * (d);    \
             row < end_; row += (kv_heads) * (d), t++)

/* o[i] = inv * sum over t < len of p[t] * v_t[i], i < d */
static void weighted_rows(float *o, const float *p, float inv, const float *v_cache, const int64_t *table, int64_t len,
                          int64_t block_size, int64_t kv_heads, int64_t kvh, int64_t d) {
#if SIMD
    if (d % 16 == 0) {  /* 16 columns at a time; even and odd tokens in separate accumulators */
        for (int64_t i = 0; i < d; i += 16) {
            __m256 e0 = _mm256_setzero_ps(), e1 = e0, o0 = e0, o1 = e0;
            FOR_EACH_TOKEN(v_cache, table, len, block_size, kv_heads, kvh, d, t, vt) {
                __m256 pv = _mm256_set1_ps(p[t]);
                if (t & 1) {
                    o0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + i), o0);
                    o1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + i + 8), o1);
                } else {
                    e0 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + i), e0);
                    e1 = _mm256_fmadd_ps(pv, _mm256_loadu_ps(vt + i + 8), e1);
                }
            }
            __m256 iv = _mm256_set1_ps(inv);
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_add_ps(e0, o0), iv));
            _mm256_storeu_ps(o + i + 8, _mm256_mul_ps(_mm256_add_ps(e1, o1), iv));
        }
        return;
    }
#endif
    memset(o, 0, d * sizeof(float));
    FOR_EACH_TOKEN(v_cache, table, len, block_size, kv_heads, kvh, d, t, vt) {
        for (int64_t i = 0; i < d; i++) o[i] += p[t] * vt[i];
    }
    for (int64_t i = 0; i < d; i++) o[i] *= inv;
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

/* Attention of B single-token queries over their paged contexts.
 * q: row b at q + rows[b] * ldq (rows NULL: row b) of num_rows, [heads, d] each; the output goes to the same row of
 * `out` (stride ldo). Caches [num_blocks, block_size, kv_heads, d]; block_tables [B, bt_stride]; seq_lens [B].
 * Each query head is one task, so that even one sequence splits evenly over the threads.
 * The scores are kept for the softmax: `work` holds max(seq_lens) floats per thread. */
int llmd_decode_attention(const float *q, int64_t ldq, const int64_t *rows, int64_t B, int64_t num_rows,
                          const float *k_cache,
                          const float *v_cache, int64_t num_blocks, int64_t block_size, int64_t kv_heads, int64_t d,
                          const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens, int64_t heads,
                          float scale, float *out, int64_t ldo, float *work, int64_t work_per_thread, int threads) {
    const int64_t group = heads / kv_heads;
    for (int64_t b = 0; b < B; b++) {
        int64_t len = seq_lens[b];
        if (len < 1 || len > work_per_thread || (rows ? rows[b] : b) < 0 || (rows ? rows[b] : b) >= num_rows) return -1;
        for (int64_t j = 0; j < (len + block_size - 1) / block_size; j++) {
            int64_t blk = block_tables[b * bt_stride + j];
            if (blk < 0 || blk >= num_blocks) return -1;
        }
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < B * heads; task++) {  /* one query head each: even shares for few sequences */
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        const int64_t b = task / heads, h = task % heads, kvh = h / group, len = seq_lens[b];
        const int64_t row = rows ? rows[b] : b;
        const int64_t *table = block_tables + b * bt_stride;
        const float *qh = q + row * ldq + h * d;
        float *s = work + tid * work_per_thread;  /* scores, then unnormalised probabilities exp(s - max) */
        FOR_EACH_TOKEN(k_cache, table, len, block_size, kv_heads, kvh, d, t, kt) {
            s[t] = dot(qh, kt, d) * scale;
        }
        const float sum = softmax_numerators(s, len);
        weighted_rows(out + row * ldo + h * d, s, 1.0f / sum, v_cache, table, len, block_size, kv_heads, kvh, d);
    }
    return 0;
}

/* Causal attention of one sequence's chunk of q_len new tokens (positions ctx - q_len .. ctx - 1) over its paged
 * context of ctx tokens (table: its block table): query i sees tokens 0 .. ctx - q_len + i. A task is one query head
 * and a tile of 4 consecutive queries, whose dot products share each loaded K vector (2 tokens at a time) and whose
 * weighted sums share each loaded V vector. `work` holds 4 * ctx floats per thread. */
#define PQ 4
int llmd_prefill_attention(const float *q, int64_t ldq, int64_t q_len, int64_t ctx, const float *k_cache,
                           const float *v_cache, int64_t num_blocks, int64_t block_size, int64_t kv_heads, int64_t d,
                           const int64_t *table, int64_t heads, float scale, float *out, int64_t ldo, float *work,
                           int64_t work_per_thread, int threads) {
    if (q_len < 1 || ctx < q_len || PQ * ctx > work_per_thread) return -1;
    for (int64_t j = 0; j < (ctx + block_size - 1) / block_size; j++)
        if (table[j] < 0 || table[j] >= num_blocks) return -1;
    int64_t *off = (int64_t *)malloc((size_t)ctx * sizeof(int64_t)); /* token -> its row in the cache */
    if (!off) return -2;
    for (int64_t t = 0; t < ctx; t++) off[t] = (table[t / block_size] * block_size + t % block_size) * kv_heads * d;
    const int64_t group = heads / kv_heads, tiles = (q_len + PQ - 1) / PQ;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < heads * tiles; task++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        const int64_t h = task / tiles, i0 = (task % tiles) * PQ, kvh = h / group;
        const int nq = q_len - i0 < PQ ? (int)(q_len - i0) : PQ;
        const float *kb = k_cache + kvh * d, *vb = v_cache + kvh * d;
        const float *qj[PQ];
        int64_t len[PQ];
        for (int j = 0; j < PQ; j++) {  /* a short tile repeats its last query (computed, never stored) */
            const int64_t i = i0 + (j < nq ? j : nq - 1);
            qj[j] = q + i * ldq + h * d;
            len[j] = ctx - q_len + i + 1;
        }
        const int64_t longest = len[PQ - 1];
        float *s = work + tid * work_per_thread;  /* [PQ][ctx] scores, then probabilities (0 past a query's end) */
        for (int64_t t = 0; t < longest; t += 2) {
            const float *k0 = kb + off[t], *k1 = t + 1 < longest ? kb + off[t + 1] : k0;
            int64_t c = 0;
            float d0[PQ] = {0}, d1[PQ] = {0};
#if SIMD
            __m256 a0[PQ], a1[PQ];
            for (int j = 0; j < PQ; j++) a0[j] = a1[j] = _mm256_setzero_ps();
            for (; c + 8 <= d; c += 8) {
                const __m256 kv0 = _mm256_loadu_ps(k0 + c), kv1 = _mm256_loadu_ps(k1 + c);
                for (int j = 0; j < PQ; j++) {
                    const __m256 qv = _mm256_loadu_ps(qj[j] + c);
                    a0[j] = _mm256_fmadd_ps(qv, kv0, a0[j]);
                    a1[j] = _mm256_fmadd_ps(qv, kv1, a1[j]);
                }
            }
            for (int j = 0; j < PQ; j++) d0[j] = hsum8(a0[j]), d1[j] = hsum8(a1[j]);
#endif
            for (; c < d; c++)
                for (int j = 0; j < PQ; j++) d0[j] += qj[j][c] * k0[c], d1[j] += qj[j][c] * k1[c];
            for (int j = 0; j < PQ; j++) {
                s[j * ctx + t] = d0[j] * scale;
                if (t + 1 < longest) s[j * ctx + t + 1] = d1[j] * scale;
            }
        }
        float inv[PQ];
        for (int j = 0; j < PQ; j++) {
            float *sj = s + j * ctx;
            inv[j] = 1.0f / softmax_numerators(sj, len[j]);
            for (int64_t t = len[j]; t < longest; t++) sj[t] = 0.0f;
        }
        int64_t c = 0;
#if SIMD
        for (; c + 16 <= d; c += 16) {
            __m256 o0[PQ], o1[PQ];
            for (int j = 0; j < PQ; j++) o0[j] = o1[j] = _mm256_setzero_ps();
            for (int64_t t = 0; t < longest; t++) {
                const __m256 v0 = _mm256_loadu_ps(vb + off[t] + c), v1 = _mm256_loadu_ps(vb + off[t] + c + 8);
                for (int j = 0; j < PQ; j++) {
                    const __m256 p = _mm256_broadcast_ss(s + j * ctx + t);
                    o0[j] = _mm256_fmadd_ps(p, v0, o0[j]);
                    o1[j] = _mm256_fmadd_ps(p, v1, o1[j]);
                }
            }
            for (int j = 0; j < nq; j++) {
                float *o = out + (i0 + j) * ldo + h * d + c;
                _mm256_storeu_ps(o, _mm256_mul_ps(o0[j], _mm256_set1_ps(inv[j])));
                _mm256_storeu_ps(o + 8, _mm256_mul_ps(o1[j], _mm256_set1_ps(inv[j])));
            }
        }
#endif
        for (; c < d; c++)
            for (int j = 0; j < nq; j++) {
                float acc = 0.0f;
                for (int64_t t = 0; t < longest; t++) acc += s[j * ctx + t] * vb[off[t] + c];
                out[(i0 + j) * ldo + h * d + c] = acc * inv[j];
            }
    }
    free(off);
    return 0;
}
