/* The fp32 glue of a decoder layer on the CPU: RMSNorm, RoPE, SiLU(gate) * up, writing K/V into the paged cache, and
 * attention over it: single-token (decode) queries, and causal chunks of new tokens (prefill, speculative verify).
 *
 * Each op is one call where torch needs five to fifteen small ones; on a small model at batch 1 those calls, not the
 * arithmetic, were a third of a decode step. Built into the same library as cpu_gemm.c (llmd.kernels.cpu_gemm).
 *
 * Every output row is computed by one thread in a fixed order, whatever the batch and thread count, so a sequence's
 * results never depend on what else runs in its step (llmd's exactness invariant).
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* tanh on 8 lanes (soft-capped attention scores): an odd Taylor polynomial to x^13 for |x| < 0.4 (truncation below
 * 5e-9 relative), else 1 - 2 / (exp(2|x|) + 1) with exp8 (relative error below 4e-7 there); the sign is put back
 * last. Each lane is the same function of its own input, so a score's value does not depend on its lane. */
INLINE __m256 tanh8(__m256 x) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    const __m256 a = _mm256_andnot_ps(sign, x), a2 = _mm256_mul_ps(a, a);
    __m256 p = _mm256_set1_ps(21844.0f / 6081075);
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-1382.0f / 155925));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(62.0f / 2835));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-17.0f / 315));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(2.0f / 15));
    p = _mm256_fmadd_ps(p, a2, _mm256_set1_ps(-1.0f / 3));
    const __m256 small = _mm256_fmadd_ps(_mm256_mul_ps(a, a2), p, a);
    const __m256 e = exp8(_mm256_add_ps(a, a)); /* exp8 clamps at 88: large |x| give 1 exactly, never inf / inf */
    const __m256 big = _mm256_sub_ps(one, _mm256_div_ps(_mm256_set1_ps(2.0f), _mm256_add_ps(e, one)));
    const __m256 t = _mm256_blendv_ps(big, small, _mm256_cmp_ps(a, _mm256_set1_ps(0.4f), _CMP_LT_OQ));
    return _mm256_or_ps(t, _mm256_and_ps(x, sign));
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

/* s[t] = exp(s[t] - max(s)), t < n; returns their sum (8 lane sums, then the lanes and the tail in a fixed order
 * that depends only on n) and puts max(s) in *max */
static float softmax_numerators(float *s, int64_t n, float *max) {
    float m = s[0], sum = 0.0f;
    int64_t t = 0;
#if SIMD
    __m256 mv = _mm256_set1_ps(m);
    for (; t + 8 <= n; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
#endif
    for (; t < n; t++) m = s[t] > m ? s[t] : m;
    t = 0;
#if SIMD
    mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), mv));
        _mm256_storeu_ps(s + t, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum8(acc);
#endif
    for (; t < n; t++) sum += s[t] = expf(s[t] - m);
    *max = m;
    return sum;
}

/* s[i] = cap * tanh(s[i] / cap), i < n (Gemma 2's attention logit soft-capping). With SIMD the tail goes through
 * tanh8 too, zero-padded, so every score gets the same function whatever n is and wherever it sits. */
static void soft_cap(float *s, int64_t n, float cap) {
    const float inv = 1.0f / cap;
    int64_t i = 0;
#if SIMD
    const __m256 vc = _mm256_set1_ps(cap), vi = _mm256_set1_ps(inv);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(s + i, _mm256_mul_ps(vc, tanh8(_mm256_mul_ps(_mm256_loadu_ps(s + i), vi))));
    if (i < n) {
        float t[8] = {0};
        memcpy(t, s + i, (size_t)(n - i) * sizeof(float));
        _mm256_storeu_ps(t, _mm256_mul_ps(vc, tanh8(_mm256_mul_ps(_mm256_loadu_ps(t), vi))));
        memcpy(s + i, t, (size_t)(n - i) * sizeof(float));
    }
#else
    for (; i < n; i++) s[i] = cap * tanhf(s[i] * inv);
#endif
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

/* gpt-oss's clamped SwiGLU: y[t, i] = (clamp(u, -limit, limit) + 1) * (a * sigmoid(a * alpha)), a = min(gate, limit),
 * u = up, with transformers' operations in its order (clamp, multiply, sigmoid = 1 / (1 + exp(-z)), multiply, add,
 * multiply), each rounded once, and silu_mul's exp. A NaN stays a NaN through the clamps, as in torch.clamp. */
int llmd_swiglu_clamped_mul(const float *g, int64_t ldg, float *y, int64_t ldy, int64_t rows, int64_t n, float alpha,
                            float limit) {
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = g + t * ldg, *up = gate + n;
        float *yr = y + t * ldy;
        int64_t i = 0;
#if SIMD
        const __m256 one = _mm256_set1_ps(1.0f), va = _mm256_set1_ps(alpha), hi = _mm256_set1_ps(limit),
                     lo = _mm256_set1_ps(-limit);
        for (; i + 8 <= n; i += 8) {
            /* min/max return their second operand when either is a NaN: the value, so it propagates */
            const __m256 a = _mm256_min_ps(hi, _mm256_loadu_ps(gate + i));
            const __m256 u = _mm256_max_ps(lo, _mm256_min_ps(hi, _mm256_loadu_ps(up + i)));
            const __m256 z = _mm256_mul_ps(a, va);
            const __m256 s = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), z))));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_add_ps(u, one), _mm256_mul_ps(a, s)));
        }
#endif
        for (; i < n; i++) {
            const float a = gate[i] > limit ? limit : gate[i];
            const float u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
            const float s = 1.0f / (1.0f + expf(-(a * alpha)));
            yr[i] = (u + 1.0f) * (a * s);
        }
    }
    return 0;
}

/* out[t] = the index of the largest x[t, i], the first of equal ones, a NaN counting as the largest (torch.argmax's
 * answer). The vector pass keeps each lane's first maximum; a row holding a NaN is scanned again in plain C. */
static int64_t argmax_scalar(const float *x, int64_t n) {
    int64_t best = 0;
    for (int64_t i = 1; i < n; i++) {
        if (x[best] != x[best]) break; /* the first NaN */
        if (x[i] > x[best] || x[i] != x[i]) best = i;
    }
    return best;
}

int llmd_argmax_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out) {
    if (n <= 0) return -1;
    for (int64_t t = 0; t < rows; t++) {
        const float *xr = x + t * ldx;
        int64_t i = 0;
#if SIMD
        if (n >= 32 && n < INT32_MAX) { /* four independent running maxima (the blend chain is the bound) */
            __m256 best[4], nan = _mm256_setzero_ps();
            __m256i at[4], idx[4];
            const __m256i step = _mm256_set1_epi32(32);
            for (int a = 0; a < 4; a++) {
                best[a] = _mm256_loadu_ps(xr + 8 * a);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(best[a], best[a], _CMP_UNORD_Q));
                at[a] = idx[a] = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(8 * a));
            }
            for (i = 32; i + 32 <= n; i += 32)
                for (int a = 0; a < 4; a++) {
                    idx[a] = _mm256_add_epi32(idx[a], step);
                    const __m256 v = _mm256_loadu_ps(xr + i + 8 * a);
                    const __m256 gt = _mm256_cmp_ps(v, best[a], _CMP_GT_OQ);
                    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                    best[a] = _mm256_blendv_ps(best[a], v, gt);
                    at[a] = _mm256_castps_si256(
                        _mm256_blendv_ps(_mm256_castsi256_ps(at[a]), _mm256_castsi256_ps(idx[a]), gt));
                }
            int64_t b = -1;
            if (!_mm256_movemask_ps(nan)) {
                float bv[32];
                int32_t bi[32];
                for (int a = 0; a < 4; a++) {
                    _mm256_storeu_ps(bv + 8 * a, best[a]);
                    _mm256_storeu_si256((__m256i *)(bi + 8 * a), at[a]);
                }
                b = bi[0]; /* each lane holds its first maximum: the largest, then the smallest index */
                for (int l = 1; l < 32; l++)
                    if (bv[l] > xr[b] || (bv[l] == xr[b] && bi[l] < b)) b = bi[l];
                for (; i < n; i++) {
                    if (xr[i] != xr[i]) {
                        b = -1;
                        break;
                    }
                    if (xr[i] > xr[b]) b = i;
                }
            }
            out[t] = b >= 0 ? b : argmax_scalar(xr, n); /* a NaN: the first one, found in plain C */
            continue;
        }
#endif
        out[t] = argmax_scalar(xr, n);
    }
    return 0;
}

/* y[t, i] = gelu_tanh(gate[t, i]) * up[t, i], gate and up [rows, n] with row strides ldg and ldu (GeGLU over separate
 * gate and up outputs: Gemma 4's MLP and its per-layer input gate). gelu_tanh(x) = 0.5 x (1 + tanh(u)) =
 * x / (1 + exp(-2u)), u = sqrt(2 / pi) (x + 0.044715 x^3): the form of silu_mul with the exponent 2u, so the same
 * exp. */
int llmd_gelu_mul2(const float *g, int64_t ldg, const float *u, int64_t ldu, float *y, int64_t ldy, int64_t rows,
                   int64_t n) {
    const float c2 = 1.5957691216057308f, k = 0.044715f; /* c2 = 2 sqrt(2 / pi) */
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = g + t * ldg, *up = u + t * ldu;
        float *yr = y + t * ldy;
        int64_t i = 0;
#if SIMD
        const __m256 one = _mm256_set1_ps(1.0f), vc = _mm256_set1_ps(-c2), vk = _mm256_set1_ps(k);
        for (; i + 8 <= n; i += 8) {
            __m256 a = _mm256_loadu_ps(gate + i);
            __m256 inner = _mm256_add_ps(a, _mm256_mul_ps(vk, _mm256_mul_ps(a, _mm256_mul_ps(a, a))));
            __m256 e = exp8(_mm256_mul_ps(vc, inner));
            _mm256_storeu_ps(yr + i, _mm256_mul_ps(_mm256_div_ps(a, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
        }
#endif
        for (; i < n; i++) {
            const float a = gate[i];
            yr[i] = a / (1.0f + expf(-c2 * (a + k * (a * (a * a))))) * up[i];
        }
    }
    return 0;
}

/* y[t, i] = gelu_tanh(g[t, i]) * g[t, n + i]: the fused gate/up output [rows, 2n] (GeGLU: Gemma 2 and 3). */
int llmd_gelu_mul(const float *g, int64_t ldg, float *y, int64_t ldy, int64_t rows, int64_t n) {
    return llmd_gelu_mul2(g, ldg, g + n, ldg, y, ldy, rows, n);
}

/* ---- the paged KV cache -------------------------------------------------------------------------------------------
 * One layer's cache (llmd_kv, cpu_kernels.h): K and V [num_blocks, block_size, kv_heads, d] in fp32, fp16, bf16 or
 * int8, the int8 one with an fp32 scale per (slot, KV head) for each (llmd.model.kv_int8: x ~= q * scale). The
 * attention kernels read the cache in its own type and widen it to fp32 in registers, so a compact cache halves
 * (fp16, bf16) or quarters (int8) the bytes a decode step reads; the arithmetic stays fp32. */

INLINE float bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

INLINE uint32_t f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* IEEE half <-> float, exact (half -> float) and round-to-nearest-even (float -> half), as torch and F16C do */
INLINE float half_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0) return sign ? -(float)m * 5.9604644775390625e-8f : (float)m * 5.9604644775390625e-8f;
    if (e == 31) return bits_f32(sign | 0x7f800000u | m << 13);
    return bits_f32(sign | (e + 112) << 23 | m << 13);
}

INLINE uint16_t f32_half(float f) {
    uint32_t u = f32_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return sign | 0x7e00;  /* NaN */
    if (u >= 0x477ff000u) return sign | 0x7c00; /* rounds past 65504: inf */
    if (u < 0x38800000u) return sign | (uint16_t)nearbyintf(bits_f32(u) * 16777216.0f); /* subnormal: x / 2^-24 */
    return sign | (uint16_t)(((u + 0xfff + ((u >> 13) & 1)) >> 13) - (112 << 10));
}

INLINE float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

INLINE uint16_t f32_bf16(float f) {
    const uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0; /* NaN, as torch writes it */
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

INLINE int64_t kv_elem_size(int64_t dt) { return dt == KV_F32 ? 4 : dt == KV_I8 ? 1 : 2; }

/* the cache's element i as fp32 (an int8 element unscaled) */
INLINE float load1(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return ((const float *)p)[i];
    if (DT == KV_F16) return half_f32(((const uint16_t *)p)[i]);
    if (DT == KV_BF16) return bf16_f32(((const uint16_t *)p)[i]);
    return (float)((const int8_t *)p)[i];
}

#if SIMD
/* elements i .. i + 7 as fp32 (int8 unscaled) */
INLINE __m256 load8(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return _mm256_loadu_ps((const float *)p + i);
    if (DT == KV_I8)
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)p + i))));
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    if (DT == KV_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* AVX-512 (a full-width unit on Zen 5 and Intel's server cores): attention's dot products and weighted sums 16 lanes
 * at a time, half the instructions of the 8-lane loops they precede */
#if SIMD && defined(__AVX512F__)
#define SIMD512 1
/* elements i .. i + 15 as fp32 (int8 unscaled) */
INLINE __m512 load16(const void *p, int64_t i, const int DT) {
    if (DT == KV_F32) return _mm512_loadu_ps((const float *)p + i);
    if (DT == KV_I8)
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)p + i))));
    const __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    if (DT == KV_F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* lane l + lane l + 8, l < 8 */
INLINE __m256 fold16(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#else
#define SIMD512 0
#endif

static int kv_ok(const llmd_kv *kv) {
    return kv && kv->k && kv->v && kv->dtype >= KV_F32 && kv->dtype <= KV_I8 && kv->num_blocks > 0 &&
           kv->block_size > 0 && kv->kv_heads > 0 && kv->d > 0 && (kv->dtype != KV_I8 || (kv->k_scale && kv->v_scale));
}

/* one token's `heads` rows of d values into a cache row (and its scales) of type dt */
static void store_row(void *dst, float *scales, const float *x, int64_t heads, int64_t d, int64_t dt) {
    const int64_t n = heads * d;
    if (dt == KV_F32) {
        memcpy(dst, x, (size_t)n * sizeof(float));
    } else if (dt == KV_F16) {
        uint16_t *h = (uint16_t *)dst;
        int64_t i = 0;
#if SIMD
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(h + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
        for (; i < n; i++) h[i] = f32_half(x[i]);
    } else if (dt == KV_BF16) {
        uint16_t *h = (uint16_t *)dst;
        for (int64_t i = 0; i < n; i++) h[i] = f32_bf16(x[i]);
    } else { /* int8: kv_int8.quantize_int8's operations, so the same values and scales */
        int8_t *qv = (int8_t *)dst;
        for (int64_t hd = 0; hd < heads; hd++) {
            const float *xr = x + hd * d;
            float amax = 0.0f;
            for (int64_t i = 0; i < d; i++) amax = fabsf(xr[i]) > amax ? fabsf(xr[i]) : amax;
            scales[hd] = amax / 127.0f;
            const float inv = 1.0f / (amax > FLT_MIN ? amax : FLT_MIN) * 127.0f;
            for (int64_t i = 0; i < d; i++) {
                float r = nearbyintf(xr[i] * inv);
                qv[hd * d + i] = (int8_t)(r > 127.0f ? 127.0f : r < -127.0f ? -127.0f : r);
            }
        }
    }
}

/* Store each new token's K and V (rows of kv_heads * d values, row strides ldk, ldv) into its cache slot. */
int llmd_write_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots, int64_t rows,
                  const llmd_kv *kv) {
    if (!kv_ok(kv)) return -1;
    const int64_t heads = kv->kv_heads, d = kv->d, width = heads * d, es = kv_elem_size(kv->dtype);
    const int64_t num_slots = kv->num_blocks * kv->block_size;
    for (int64_t t = 0; t < rows; t++) {
        const int64_t s = slots[t];
        if (s < 0 || s >= num_slots) return -1;
        store_row((char *)kv->k + s * width * es, kv->k_scale ? kv->k_scale + s * heads : NULL, k + t * ldk, heads, d,
                  kv->dtype);
        store_row((char *)kv->v + s * width * es, kv->v_scale ? kv->v_scale + s * heads : NULL, v + t * ldv, heads, d,
                  kv->dtype);
    }
    return 0;
}

int llmd_kv_dtype_supported(int64_t dt) { return dt >= KV_F32 && dt <= KV_I8; }

/* ---- attention ------------------------------------------------------------------------------------------------
 * Decode tokens and chunks of new tokens (prefill, speculative verify) share one tile: up to PQ queries on one KV
 * head. A query's context is cut into partitions of PART tokens from its start (fixed: it depends on nothing but the
 * context's length); per partition the tile computes each query's max score, sum of exponentials and unnormalised
 * weighted sum of V, and `combine` then merges a query's partitions in their order. Each query's scores, softmax and
 * sums are its own operations in a fixed order, whatever tile it shares, whichever thread runs which partition, so
 * a token's attention output is bit-identical decoded alone, decoded in a batch or verified in a chunk, at any
 * thread count: speculation and recompute after preemption do not change a sequence's numbers. The tile only shares
 * loads: each K row serves every query's dot product (2 tokens at a time), each V vector every query's weighted sum.
 * Decode runs the partitions of one sequence on all threads (flash-decoding), so a lone long context uses every
 * core and reads its KV once per KV head.
 * A sliding window (window W > 0) gives query j the tokens lo[j] <= t < len[j], lo[j] = max(0, len[j] - W): it
 * takes only the partitions that hold some of them, and within its first one the tokens before lo[j] add exact
 * zeros, as those past len[j] do. Partitions stay cut from the context's start, so a query's numbers still depend
 * only on its own position and window. No block wholly before lo[j] is read.
 * A soft-cap (cap > 0, Gemma 2) maps each of a query's scores to cap * tanh(score / cap) before its softmax, one
 * score at a time (`soft_cap`), so the invariants above hold with it; cap 0 leaves the scores untouched.
 * Attention sinks (gpt-oss; sinks non-NULL, one logit per query head): the head's sink joins the softmax denominator
 * of each of its queries and adds no value; `combine` takes it in as one more partition {m = sink, l = 1, acc = 0},
 * so it stays a per-query operation in a fixed order. NULL: the combine as it was, bit for bit. */
#define PQ 4
#define PART 256
#define PREFETCH 8 /* tokens */

/* where one KV head's rows lie: token t of a context is row off[t] (its slot), at element off[t] * row of k and v
 * (already offset to the head) and, for int8, scale off[t] * srow of ks and vs */
typedef struct {
    const void *k, *v;
    const float *ks, *vs;
    int64_t row, srow;
} head_view;

/* P queries (P <= PQ, compile-time like the cache type DT, so the accumulators stay in registers) over partition
 * [t0, t0 + PART) of their contexts: query j takes tokens max(t0, lo[j]) <= t < len[j]; each query with a token
 * there gets part[j] = {max score, sum of exp(score - max), sum of exp(score - max) * v [d]}. s: P * PART floats.
 * cap > 0: the scores are soft-capped first. */
INLINE void attend_part_p(const float *const *q, const int64_t *lo, const int64_t *len, const head_view *hv,
                          const int64_t *off, int64_t d, float scale, float cap, int64_t t0, float *s,
                          float *const *part, const int P, const int DT) {
    int64_t n = 0, i0 = PART, aj[PQ], nj[PQ];
    for (int j = 0; j < P; j++) {
        nj[j] = (len[j] < t0 + PART ? len[j] : t0 + PART) - t0;
        aj[j] = lo[j] > t0 ? lo[j] - t0 : 0;
        n = nj[j] > n ? nj[j] : n;
        i0 = aj[j] < i0 ? aj[j] : i0;
    }
    const int64_t row = hv->row, es = kv_elem_size(DT), bytes = d * es;
    for (int64_t i = i0; i < n; i += 2) {
        const int64_t t = t0 + i, t1 = i + 1 < n ? t + 1 : t;
        const int64_t r0 = off[t] * row, r1 = off[t1] * row;
        /* the cache rows are scattered by the block table: fetch K PREFETCH tokens ahead, and this token's V, which
         * the weighted sum below reads once the partition's scores are done */
        for (int u = 0; u < 2 && i + u < n; u++) {
            const char *vr = (const char *)hv->v + off[t + u] * row * es;
            for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(vr + c);
            if (i + u + PREFETCH < n) {
                const char *kr = (const char *)hv->k + off[t + u + PREFETCH] * row * es;
                for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(kr + c);
            }
        }
        int64_t c = 0;
        float d0[PQ] = {0}, d1[PQ] = {0};
#if SIMD
        __m256 a0[PQ], a1[PQ];
        for (int j = 0; j < P; j++) a0[j] = a1[j] = _mm256_setzero_ps();
#if SIMD512 /* 16 lanes, folded into the 8-lane sums (lane l + lane l + 8) before the rest of the head's values */
        __m512 w0[PQ], w1[PQ];
        for (int j = 0; j < P; j++) w0[j] = w1[j] = _mm512_setzero_ps();
        for (; c + 16 <= d; c += 16) {
            const __m512 kv0 = load16(hv->k, r0 + c, DT), kv1 = load16(hv->k, r1 + c, DT);
            for (int j = 0; j < P; j++) {
                const __m512 qv = _mm512_loadu_ps(q[j] + c);
                w0[j] = _mm512_fmadd_ps(qv, kv0, w0[j]);
                w1[j] = _mm512_fmadd_ps(qv, kv1, w1[j]);
            }
        }
        for (int j = 0; j < P; j++) a0[j] = fold16(w0[j]), a1[j] = fold16(w1[j]);
#endif
        for (; c + 8 <= d; c += 8) {
            const __m256 kv0 = load8(hv->k, r0 + c, DT), kv1 = load8(hv->k, r1 + c, DT);
            for (int j = 0; j < P; j++) {
                const __m256 qv = _mm256_loadu_ps(q[j] + c);
                a0[j] = _mm256_fmadd_ps(qv, kv0, a0[j]);
                a1[j] = _mm256_fmadd_ps(qv, kv1, a1[j]);
            }
        }
        for (int j = 0; j < P; j++) d0[j] = hsum8(a0[j]), d1[j] = hsum8(a1[j]);
#endif
        for (; c < d; c++) {
            const float k0 = load1(hv->k, r0 + c, DT), k1 = load1(hv->k, r1 + c, DT);
            for (int j = 0; j < P; j++) d0[j] += q[j][c] * k0, d1[j] += q[j][c] * k1;
        }
        const float f0 = DT == KV_I8 ? hv->ks[off[t] * hv->srow] * scale : scale;
        const float f1 = DT == KV_I8 ? hv->ks[off[t1] * hv->srow] * scale : scale;
        for (int j = 0; j < P; j++) {
            s[j * PART + i] = d0[j] * f0;
            if (i + 1 < n) s[j * PART + i + 1] = d1[j] * f1;
        }
    }
    for (int j = 0; j < P; j++) {
        float *sj = s + j * PART;
        if (nj[j] <= aj[j]) { /* a chunk's early query ends before this partition (or its window starts after it) */
            for (int64_t i = i0; i < n; i++) sj[i] = 0.0f;
            continue;
        }
        if (cap > 0.0f) soft_cap(sj + aj[j], nj[j] - aj[j], cap);
        part[j][1] = softmax_numerators(sj + aj[j], nj[j] - aj[j], part[j]);
        for (int64_t i = i0; i < aj[j]; i++) sj[i] = 0.0f;
        for (int64_t i = nj[j]; i < n; i++) sj[i] = 0.0f;
        if (DT == KV_I8)
            for (int64_t i = aj[j]; i < nj[j]; i++) sj[i] = sj[i] * hv->vs[off[t0 + i] * hv->srow];
    }
    int64_t c = 0;
#if SIMD512 /* each output lane the same sum in the same order as the 8-lane loop's */
    for (; c + 32 <= d; c += 32) {
        __m512 o0[PQ], o1[PQ];
        for (int j = 0; j < P; j++) o0[j] = o1[j] = _mm512_setzero_ps();
        for (int64_t i = i0; i < n; i++) {
            const int64_t r = off[t0 + i] * row;
            const __m512 v0 = load16(hv->v, r + c, DT), v1 = load16(hv->v, r + c + 16, DT);
            for (int j = 0; j < P; j++) {
                const __m512 p = _mm512_set1_ps(s[j * PART + i]);
                o0[j] = _mm512_fmadd_ps(p, v0, o0[j]);
                o1[j] = _mm512_fmadd_ps(p, v1, o1[j]);
            }
        }
        for (int j = 0; j < P; j++)
            if (nj[j] > aj[j]) {
                _mm512_storeu_ps(part[j] + 2 + c, o0[j]);
                _mm512_storeu_ps(part[j] + 2 + c + 16, o1[j]);
            }
    }
#endif
#if SIMD
    for (; c + 16 <= d; c += 16) {
        __m256 o0[PQ], o1[PQ];
        for (int j = 0; j < P; j++) o0[j] = o1[j] = _mm256_setzero_ps();
        for (int64_t i = i0; i < n; i++) {
            const int64_t r = off[t0 + i] * row;
            const __m256 v0 = load8(hv->v, r + c, DT), v1 = load8(hv->v, r + c + 8, DT);
            for (int j = 0; j < P; j++) {
                const __m256 p = _mm256_broadcast_ss(s + j * PART + i);
                o0[j] = _mm256_fmadd_ps(p, v0, o0[j]);
                o1[j] = _mm256_fmadd_ps(p, v1, o1[j]);
            }
        }
        for (int j = 0; j < P; j++)
            if (nj[j] > aj[j]) {
                _mm256_storeu_ps(part[j] + 2 + c, o0[j]);
                _mm256_storeu_ps(part[j] + 2 + c + 8, o1[j]);
            }
    }
#endif
    for (; c < d; c++)
        for (int j = 0; j < P; j++) {
            float acc = 0.0f;
            for (int64_t i = i0; i < n; i++) acc += s[j * PART + i] * load1(hv->v, off[t0 + i] * row + c, DT);
            if (nj[j] > aj[j]) part[j][2 + c] = acc;
        }
}

#define ATTEND_DT(P)                                                                                                 \
    switch (dt) {                                                                                                    \
    case KV_F32: attend_part_p(q, lo, len, hv, off, d, scale, cap, t0, s, part, P, KV_F32); break;                   \
    case KV_F16: attend_part_p(q, lo, len, hv, off, d, scale, cap, t0, s, part, P, KV_F16); break;                   \
    case KV_BF16: attend_part_p(q, lo, len, hv, off, d, scale, cap, t0, s, part, P, KV_BF16); break;                 \
    default: attend_part_p(q, lo, len, hv, off, d, scale, cap, t0, s, part, P, KV_I8); break;                        \
    }

static void attend_part(const float *const *q, const int64_t *lo, const int64_t *len, int nq, int64_t dt,
                        const head_view *hv, const int64_t *off, int64_t d, float scale, float cap, int64_t t0,
                        float *s, float *const *part) {
    switch (nq) {
    case 1: ATTEND_DT(1); break;
    case 2: ATTEND_DT(2); break;
    case 3: ATTEND_DT(3); break;
    default: ATTEND_DT(PQ); break;
    }
}

/* o = a query's attention output from its n partitions ({m, l, acc[d]} at part + p * stride), merged in partition
 * order: o = sum_p acc_p * w_p / sum_p l_p * w_p with w_p = exp(m_p - max m). (One partition: w = 1 exactly.)
 * sink (NULL: none): the query head's sink logit, one more term exp(sink - max m) of the denominator, the max taken
 * over it too. */
static void combine(float *part, int64_t n, int64_t stride, int64_t d, const float *sink, float *o) {
    float m = part[0], l = 0.0f;
    for (int64_t p = 1; p < n; p++) m = part[p * stride] > m ? part[p * stride] : m;
    if (sink) m = *sink > m ? *sink : m;
    for (int64_t p = 0; p < n; p++) {
        part[p * stride] = expf(part[p * stride] - m); /* the partition's weight, in place of its max */
        l += part[p * stride + 1] * part[p * stride];
    }
    if (sink) l += expf(*sink - m);
    const float inv = 1.0f / l;
    int64_t c = 0;
#if SIMD
    for (; c + 8 <= d; c += 8) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t p = 0; p < n; p++)
            acc = _mm256_fmadd_ps(_mm256_loadu_ps(part + p * stride + 2 + c), _mm256_broadcast_ss(part + p * stride),
                                  acc);
        _mm256_storeu_ps(o + c, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
    }
#endif
    for (; c < d; c++) {
        float acc = 0.0f;
        for (int64_t p = 0; p < n; p++) acc += part[p * stride + 2 + c] * part[p * stride];
        o[c] = acc * inv;
    }
}

/* token -> its slot, through a block table, for the tokens from .. len - 1 (off[t] for the others is not set) */
static void token_slots(int64_t *off, const int64_t *table, int64_t from, int64_t len, int64_t block_size) {
    for (int64_t t = from; t < len; t++) off[t] = table[t / block_size] * block_size + t % block_size;
}

/* the first token a query at position len - 1 attends to (window 0: none) */
static int64_t window_lo(int64_t len, int64_t window) { return window > 0 && len > window ? len - window : 0; }

static head_view head_of(const llmd_kv *kv, int64_t kvh) {
    const int64_t es = kv_elem_size(kv->dtype), d = kv->d;
    head_view hv = {(const char *)kv->k + kvh * d * es, (const char *)kv->v + kvh * d * es,
                    kv->k_scale ? kv->k_scale + kvh : NULL, kv->v_scale ? kv->v_scale + kvh : NULL,
                    kv->kv_heads * d, kv->kv_heads};
    return hv;
}

static int64_t parts_of(int64_t len) { return (len + PART - 1) / PART; }

/* Attention of B single-token queries over their paged contexts.
 * q: row b at q + rows[b] * ldq (rows NULL: row b) of num_rows, [heads, d] each; the output goes to the same row of
 * `out` (stride ldo). block_tables [B, bt_stride]; seq_lens [B]; sinks [heads] or NULL. A task is one partition of
 * one sequence's context for a tile of up to PQ query heads sharing a KV head, or for a single query head where tiles
 * leave too few tasks to share among the threads (short contexts); a second pass merges each query's partitions
 * (with its head's sink). A sequence's tasks go partition by partition, its KV heads within one, so the rows a
 * partition's first head brings into the cache serve the other heads too (a token's K and V rows hold every head). */
int llmd_decode_attention(const float *q, int64_t ldq, const int64_t *rows, int64_t B, int64_t num_rows,
                          const llmd_kv *kv, const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                          int64_t heads, float scale, int64_t window, float softcap, const float *sinks, float *out,
                          int64_t ldo, int threads) {
    if (!kv_ok(kv) || heads < 1 || heads % kv->kv_heads || window < 0 || !(softcap >= 0.0f)) return -1;
    const int64_t kv_heads = kv->kv_heads, d = kv->d, bs = kv->block_size, group = heads / kv_heads;
    int64_t total = 0, tasks_pq = 0;
    const int64_t per_group = (group + PQ - 1) / PQ;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b], row = rows ? rows[b] : b;
        if (len < 1 || row < 0 || row >= num_rows || (len + bs - 1) / bs > bt_stride) return -1;
        for (int64_t j = window_lo(len, window) / bs; j < (len + bs - 1) / bs; j++) {
            const int64_t blk = block_tables[b * bt_stride + j];
            if (blk < 0 || blk >= kv->num_blocks) return -1;
        }
        total += len;
        tasks_pq += (parts_of(len) - window_lo(len, window) / PART) * kv_heads * per_group;
    }
    const int tile = tasks_pq >= 2 * threads ? PQ : 1; /* queries per task */
    const int64_t tiles = tile == PQ ? per_group : group; /* tasks per KV head and partition */
    /* slots of every context, where each starts, and where each sequence's tasks start */
    int64_t *off = (int64_t *)malloc((size_t)(total + 2 * (B + 1)) * sizeof(int64_t));
    if (!off) return -2;
    int64_t *start = off + total, *first = start + B + 1;
    start[0] = first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t len = seq_lens[b], lo = window_lo(len, window);
        token_slots(off + start[b], block_tables + b * bt_stride, lo, len, bs);
        start[b + 1] = start[b] + len;
        first[b + 1] = first[b] + (parts_of(len) - lo / PART) * kv_heads * tiles;
    }
    const int64_t ntasks = first[B], stride = d + 2;
    float *partial = (float *)malloc((size_t)(ntasks * tile * stride + (int64_t)threads * PQ * PART) * sizeof(float));
    if (!partial) {
        free(off);
        return -2;
    }
    float *scores = partial + ntasks * tile * stride;
#pragma omp parallel num_threads(threads)
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
#pragma omp for schedule(static)
        for (int64_t task = 0; task < ntasks; task++) {
            int64_t lo = 0, hi = B; /* the sequence: first[b] <= task < first[b + 1] */
            while (hi - lo > 1) {
                const int64_t mid = (lo + hi) / 2;
                if (first[mid] <= task) lo = mid;
                else hi = mid;
            }
            const int64_t b = lo, local = task - first[b], wlo = window_lo(seq_lens[b], window);
            const int64_t p = wlo / PART + local / (kv_heads * tiles), kvh = local / tiles % kv_heads;
            const int64_t h0 = kvh * group + local % tiles * tile;
            const int nq = (int)(kvh * group + group - h0 < tile ? kvh * group + group - h0 : tile);
            const int64_t row = rows ? rows[b] : b;
            const float *qj[PQ];
            float *pj[PQ];
            int64_t lens[PQ], los[PQ];
            for (int j = 0; j < nq; j++) {
                qj[j] = q + row * ldq + (h0 + j) * d;
                pj[j] = partial + (task * tile + j) * stride;
                lens[j] = seq_lens[b];
                los[j] = wlo;
            }
            const head_view hv = head_of(kv, kvh);
            attend_part(qj, los, lens, nq, kv->dtype, &hv, off + start[b], d, scale, softcap, p * PART,
                        scores + (int64_t)tid * PQ * PART, pj);
        }
#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < B * heads; bh++) {
            const int64_t b = bh / heads, h = bh % heads, kvh = h / group, hi = h - kvh * group;
            const int64_t np = parts_of(seq_lens[b]) - window_lo(seq_lens[b], window) / PART;
            const int64_t task = first[b] + kvh * tiles + hi / tile;
            combine(partial + (task * tile + hi % tile) * stride, np, kv_heads * tiles * tile * stride, d,
                    sinks ? sinks + h : NULL, out + (rows ? rows[b] : b) * ldo + h * d);
        }
    }
    free(partial);
    free(off);
    return 0;
}

/* Causal attention of one sequence's chunk of q_len new tokens (positions ctx - q_len .. ctx - 1) over its paged
 * context of ctx tokens (table: its block table): query i sees tokens 0 .. ctx - q_len + i (with a window, the last
 * `window` of them; sinks [heads] or NULL). A KV head's queries are taken position by position, its query heads
 * within one, and a task is a block of up to QBLK of them: partition by partition, every tile of PQ queries in the
 * block that sees the partition, so each partition's K and V rows come from memory once per block and serve it
 * from the cache (at a long context they are far larger than the caches, and a task per tile re-read all of them
 * for every 4 queries), then each query's partitions are merged. A query's numbers are attend_part's and combine's,
 * whatever its block, tile and thread. */
#define QBLK 32
int llmd_prefill_attention(const float *q, int64_t ldq, int64_t q_len, int64_t ctx, const llmd_kv *kv,
                           const int64_t *table, int64_t table_len, int64_t heads, float scale, int64_t window,
                           float softcap, const float *sinks, float *out, int64_t ldo, int threads) {
    if (!kv_ok(kv) || heads < 1 || heads % kv->kv_heads || q_len < 1 || ctx < q_len || window < 0 ||
        !(softcap >= 0.0f))
        return -1;
    const int64_t bs = kv->block_size, d = kv->d, stride = d + 2;
    const int64_t lo0 = window_lo(ctx - q_len + 1, window); /* the first token the chunk's first query sees */
    if ((ctx + bs - 1) / bs > table_len) return -1;
    for (int64_t j = lo0 / bs; j < (ctx + bs - 1) / bs; j++)
        if (table[j] < 0 || table[j] >= kv->num_blocks) return -1;
    const int64_t group = heads / kv->kv_heads, per_head = group * q_len;
    /* a block of QBLK queries, or fewer (a multiple of PQ) where that leaves too few tasks for the threads */
    int64_t qblk = per_head * kv->kv_heads / (2 * (int64_t)threads) / PQ * PQ;
    qblk = qblk < PQ ? PQ : qblk > QBLK ? QBLK : qblk;
    const int64_t blocks = (per_head + qblk - 1) / qblk, nparts = parts_of(ctx);
    const int64_t per_thread = PQ * PART + qblk * nparts * stride;
    int64_t *off = (int64_t *)malloc((size_t)ctx * sizeof(int64_t));
    float *work = (float *)malloc((size_t)(threads * per_thread) * sizeof(float));
    if (!off || !work) {
        free(off);
        free(work);
        return -2;
    }
    token_slots(off, table, lo0, ctx, bs);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t task = 0; task < kv->kv_heads * blocks; task++) {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        const int64_t kvh = task / blocks, q0 = task % blocks * qblk;
        const int64_t nq = per_head - q0 < qblk ? per_head - q0 : qblk;
        float *scores = work + tid * per_thread, *partial = scores + PQ * PART;
        const float *qj[QBLK];
        int64_t len[QBLK], lo[QBLK], hj[QBLK];
        for (int64_t j = 0; j < nq; j++) { /* lengths, and so windows' starts, never decrease along the block */
            const int64_t i = (q0 + j) / group;
            hj[j] = kvh * group + (q0 + j) % group;
            qj[j] = q + i * ldq + hj[j] * d;
            len[j] = ctx - q_len + i + 1;
            lo[j] = window_lo(len[j], window);
        }
        const head_view hv = head_of(kv, kvh);
        for (int64_t p = lo[0] / PART; p < parts_of(len[nq - 1]); p++)
            for (int64_t t = 0; t < nq; t += PQ) {
                const int n = nq - t < PQ ? (int)(nq - t) : PQ;
                if (p < lo[t] / PART || p >= parts_of(len[t + n - 1])) continue; /* no query of the tile sees it */
                float *pj[PQ];
                for (int j = 0; j < n; j++) pj[j] = partial + ((t + j) * nparts + p) * stride;
                attend_part(qj + t, lo + t, len + t, n, kv->dtype, &hv, off, d, scale, softcap, p * PART, scores, pj);
            }
        for (int64_t j = 0; j < nq; j++) {
            const int64_t p0 = lo[j] / PART;
            const int64_t i = (q0 + j) / group;
            combine(partial + (j * nparts + p0) * stride, parts_of(len[j]) - p0, stride, d,
                    sinks ? sinks + hj[j] : NULL, out + i * ldo + hj[j] * d);
        }
    }
    free(work);
    free(off);
    return 0;
}
