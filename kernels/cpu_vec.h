/* Vector helpers that more than one of the CPU kernel files use outside the matmul tiles (cpu_ops.c, cpu_recurrent.c):
 * static inline, so each file inlines its own copy, the same operations wherever they run. LLMD_VEC: 1 where they
 * are built (AVX2 with FMA and F16C, as the library's SIMD code), else 0 (the files' scalar code). */
#ifndef LLMD_CPU_VEC_H
#define LLMD_CPU_VEC_H

#ifdef __AVX2__
#include <immintrin.h>
#endif

#define INLINE static inline __attribute__((always_inline))

/* ---- exp on 8 lanes: exp(x) = 2^n * exp(r), n = round(x / ln 2), |r| <= ln2 / 2, exp(r) by a degree-6 polynomial
 * (Taylor coefficients; relative error below 2e-7 on that interval). Scalar code uses expf. ---------------------- */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
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

/* the sum of the 8 lanes, in a fixed order */
INLINE float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    a = _mm_add_ss(a, _mm_movehdup_ps(a));
    return _mm_cvtss_f32(a);
}
#define LLMD_VEC 1
#else
#define LLMD_VEC 0
#endif
#endif
