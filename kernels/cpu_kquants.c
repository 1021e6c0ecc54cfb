/* GGUF super-blocks of 256 elements with a scale per sub-block of 16 or 32 (layouts and reference values:
 * llmd.kernels.gguf_blocks): the K-quants Q2_K, Q3_K, Q4_K, Q5_K, Q6_K and IQ4_XS (IQ4_NL's table values under 6-bit
 * sub-block scales). Per type:
 *   the reference dequantize (dq_T, plain C) and the vector one (blk_T, dqv_T): llmd_gguf_dequant's values;
 *   the fp32 path's decoder of a super-block (gc_T, "The GGUF matmul" in cpu_tiles.h) and its tiles;
 *   the integer path's tiles (cpu_gguf.c: "GGUF blocks with int8-quantized activations"), the sub-block scales in
 *       integer arithmetic (GQK_TILE, GQKM_TILE);
 * and their rows of the type table (llmd_kquants_types). Q6_K's codes are cpu_tiles.h's (q6k_codes: the head reads
 * them too). */
#include "cpu_tiles.h"

/* ---- Dequantize (the reference's values; the vector forms in AVX2 builds) ---------------------------------------- */

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

/* Q3_K: the 16 sub-block scales d (sc - 32) of a super-block, sc's low 4 bits from the nibbles of bytes 96..103 (low
 * nibbles for s < 8), its high 2 from bits 2 (s / 4) of byte 104 + s % 4 */
static inline void q3k_sub_scales(const uint8_t *q, float *dl) {
    const uint8_t *sb = q + 96;
    const float d = gguf_f16(q + 108);
    for (int s = 0; s < 16; s++) {
        const int low = s < 8 ? sb[s] & 0xF : sb[s - 8] >> 4, high = (sb[8 + s % 4] >> (2 * (s / 4))) & 3;
        dl[s] = d * (float)((int8_t)(low | high << 4) - 32);
    }
}

__attribute__((unused)) static void dq_q3_k(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 110, w += 256) {
        const uint8_t *hm = q, *qs = q + 32;
        float dl[16];
        q3k_sub_scales(q, dl);
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

/* IQ4_XS: sub-block s's scale sc - 32, sc's low 4 bits from nibble s of bytes 4..7, its high 2 from bits 2s of the
 * 16-bit word at byte 2 */
static inline int iq4xs_scale(const uint8_t *q, int s) {
    const uint32_t sh = (uint32_t)q[2] | (uint32_t)q[3] << 8;
    return (int)(((q[4 + s / 2] >> (4 * (s % 2))) & 0xF) | ((sh >> (2 * s)) & 3) << 4) - 32;
}

__attribute__((unused)) static void dq_iq4_xs(const uint8_t *q, int64_t nb, float *w) {
    for (int64_t b = 0; b < nb; b++, q += 136, w += 256) {
        const float d = gguf_f16(q);
        const uint8_t *qs = q + 8;
        for (int s = 0; s < 8; s++) {
            const float a = d * (float)iq4xs_scale(q, s);
            float *o = w + 32 * s;
            for (int t = 0; t < 16; t++) o[t] = a * IQ4_KV[qs[16 * s + t] & 0xF];
            for (int t = 0; t < 16; t++) o[16 + t] = a * IQ4_KV[qs[16 * s + t] >> 4];
        }
    }
}

#if defined(__AVX2__) && defined(__FMA__)

INLINE void blk_iq4_xs(const uint8_t *q, float *w) {
    const float d = gguf_f16(q);
    for (int s = 0; s < 8; s++) {
        const float a = d * (float)iq4xs_scale(q, s);
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
    const int8_t *sc = (const int8_t *)(q + 192);
    const float d = gguf_f16(q + 208);
    __m256i u[8];
    q6k_codes(q, u);
    for (int j = 0; j < 8; j++) /* elements 32j..: sub-blocks 2j and 2j + 1 */
        emit32(_mm256_sub_epi8(u[j], _mm256_set1_epi8(32)), d * (float)sc[2 * j], d * (float)sc[2 * j + 1], 0,
               OFF_NONE, w + 32 * j);
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
    float dl[16];
    q3k_sub_scales(q, dl);
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

GGUF_VECTOR(iq4_xs, 256, 136)
GGUF_VECTOR(q4_k, 256, 144)
GGUF_VECTOR(q5_k, 256, 176)
GGUF_VECTOR(q6_k, 256, 210)
GGUF_VECTOR(q2_k, 256, 84)
GGUF_VECTOR(q3_k, 256, 110)

/* ---- The fp32 path ----------------------------------------------------------------------------------------------- */

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
    __m256i u[8];
    q6k_codes(q, u);
    for (int j = 0; j < 8; j++) gg_unit(u[j], 0x3F, gg_pair(a + 2 * j), xu + 32 * j, ldp, out, os, R);
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
    for (int s = 0; s < 8; s++) {
        const float a = d * (float)iq4xs_scale(q, s);
        z[s] = -128.0f * a;
        gg_unit(gg_iq4(q + 8 + 16 * s), 0xFF, _mm256_set1_ps(a), xu + 32 * s, ldp, out, os, R);
    }
    gg_zero(z, xs, lds, out, os, R, 0);
}

GG_TILES(iq4_xs, 1, 136)
GG_TILES(q4_k, 1, 144)
GG_TILES(q5_k, 1, 176)
GG_TILES(q6_k, 1, 210)
GG_TILES(q2_k, 1, 84)
GG_TILES(q3_k, 1, 110)
GG_FILL(iq4_xs, 1, 136)
GG_FILL(q4_k, 1, 144)
GG_FILL(q5_k, 1, 176)
GG_FILL(q6_k, 1, 210)
GG_FILL(q2_k, 1, 84)
GG_FILL(q3_k, 1, 110)

/* ---- The integer path --------------------------------------------------------------------------------------------
 *
 * Super-block types: the sub-block scales are small integers (a_s = d * sc_s) and meet the dot products in integer
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
    q6k_codes(q, u);
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
                _Pragma("GCC unroll 4") for (int r = 0; r < R; r++)                                               \
                    out[r][c] = gq_offsets(_mm256_fmadd_ps(acc[r], dd, out[r][c]), zl, zh, xs + r * lds + 16 * b); \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < R; r++)                                                                                \
            for (int c = 0; c < C && c < cols; c++) y[r * ldy + c] = hsum(out[r][c]);                             \
    }
#define GQK_TILES(T, BYTES, SIGNED) TILES_BY_ROWS(GQK_TILE, T, BYTES, SIGNED)
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
            out[c] = gq_offsets(_mm256_fmadd_ps(acc, _mm256_set1_ps(gguf_f16(qc)), out[c]), zero, zero, xs + 16 * b);
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

/* Many rows: one column at a time over up to GQ_ROWS rows, each super-block of the column decoded once for all of them
 * (the tiles above decode it once per 4 rows); the rows' running sums wait in memory between super-blocks. Each output
 * gets the very operations of the tiles above in the same order, so a row's result does not depend on the path. */
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
                out[r] = gq_offsets(_mm256_fmadd_ps(acc, dd, out[r]), zl, zh, xs + r * lds + 16 * b);              \
            }                                                                                                      \
        }                                                                                                          \
        for (int r = 0; r < rows; r++) y[r * ldy] = hsum(out[r]);                                                  \
    }
GQKM_TILE(iq4_xs, 136, 1)
GQKM_TILE(q4_k, 144, 0)
GQKM_TILE(q5_k, 176, 0)
GQKM_TILE(q6_k, 210, 0)
GQKM_TILE(q2_k, 84, 0)
GQKM_TILE(q3_k, 110, 0)
#endif

const gguf_type llmd_kquants_types[LLMD_KQUANTS_TYPES] = {
    {10, 256, 84, DQ(dq_q2_k, dqv_q2_k), GG(q2_k, 0, 16, 32), GQ(q2_k, NULL)},
    {11, 256, 110, DQ(dq_q3_k, dqv_q3_k), GG(q3_k, 0, 16, 32), GQ(q3_k, NULL)},
    {12, 256, 144, DQ(dq_q4_k, dqv_q4_k), GG(q4_k, 0, 32, 32), GQ(q4_k, NULL)},
    {13, 256, 176, DQ(dq_q5_k, dqv_q5_k), GG(q5_k, 0, 32, 32), GQ(q5_k, NULL)},
    {14, 256, 210, DQ(dq_q6_k, dqv_q6_k), GG(q6_k, 0, 16, 32), GQ(q6_k, NULL)},
    {23, 256, 136, DQ(dq_iq4_xs, dqv_iq4_xs), GG(iq4_xs, 1, 32, 32), GQ(iq4_xs, NULL)},
};
