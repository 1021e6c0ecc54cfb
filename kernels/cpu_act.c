/* The activation rows each matmul path reads, prepared row by row in plain C: a row's data is the same bits in every
 * build, whichever rows share the call and whichever thread prepares it.
 *   int8 per block of 32 (quantize_row: d = amax / 127, q = round(x * (127 / amax)), ties to even): the int8 / int4
 *       layers' work buffer (quantize_rows, cpu_gemm.c) and the GGUF integer path's row data (gq_quantize_row, with
 *       the sums of each 16 and the signed blocks' C; gq_fill_lanes: the same rows in the vector lanes);
 *   int16 per block of 32 (gh_quantize_row): the output heads' (cpu_head.c); an interleaved Q6_K head also reads the
 *       sums of each 16 (gh_sums_row);
 *   fp32: the GGUF fp32 path's activations and sub-block sums (gg_prepare), rows transposed into the vector lanes
 *       (transpose_into). */
#include "cpu_tiles.h"

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
void quantize_rows(const float *x, int64_t ldx, int64_t r0, int64_t r1, int64_t k, int64_t g, int interleave,
                          void *work, int64_t m) {
    const int64_t nb = k / QB, ng = k / g;
    float *d = (float *)work, *D = d + m * nb;
    int8_t *xq = (int8_t *)(D + m * ng);
    for (int64_t r = r0; r < r1; r++) quantize_row(x + r * ldx, k, g, interleave, xq + r * k, d + r * nb, D + r * ng);
}

#if defined(__AVX2__) && defined(__FMA__)

/* Rows [0, m) of x, transposed per block of 16 rows into xt [block][kp][16] (k order; zero past K and past m); int4:
 * each value scaled as INT4_TILE scales it (2^-4j for nibble j = k % 8 < 7, its masked weights carrying 2^4j). */
void transpose_into(float *xt, const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int int4) {
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
float *transpose_rows(const float *x, int64_t ldx, int64_t m, int64_t k, int64_t kp, int int4,
                             size_t extra_floats) {
    const size_t floats = (size_t)((m + 15) / 16 * kp * 16);
    float *xt = (float *)aligned_alloc(32, ((floats + extra_floats) * 4 + 31) / 32 * 32);
    if (!xt) return NULL;
    memset(xt + floats, 0, extra_floats * 4);
    transpose_into(xt, x, ldx, m, k, kp, int4);
    return xt;
}

/* The rows' activations as the tiles read them: xp [m][kp], unit u's position 8j + l holding x[32u + 4l + j] * 2^-8j
 * (8-bit codes: j = 3 unscaled; the block pairs: unit of 64, position 8p + l holding element 32 (l / 4) + 16 (p % 2)
 * + 4 (l % 4) + p / 2 times 2^-4p, p = 7 unscaled, zero past K); xs [m][chunks * GG_XS], the sums over each chunk's
 * sub-blocks in element order (plain C: the same bits whichever rows share the call), zero past the last one. */
void gg_prepare(const gguf_type *t, const float *x, int64_t ldx, int64_t m, int64_t k, float *xp, float *xs) {
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

#endif

/* Row data of the integer path: d [m][K/32], S [m][chunks * 16], the bytes q [m][K], C [m][K/4]: -128 times the
 * sum of each 4 bytes of q (see GQ_SIGNED_DOT); then, where m >= GQS_MIN_ROWS, the same rows in the vector lanes
 * (gq_lanes, for the signed blocks' rows-in-lanes paths), per group of 8 rows and step s (a block of 32), or under 8
 * rows per group of 4 and step s (a pair of blocks: lanes 0-3 the even one, 4-7 the odd one): XT [groups][s][8][8]
 * (at each of the step's 8 dwords, each lane the 4 bytes of its row), CB [groups][s][8] (C summed over the lane's
 * block) and DT [groups][s][8] (its d); lanes past m or past the last block hold zeros. */
/* rows per group of the lane layout: 8, or under 8 rows 4, lanes 4-7 then holding the next block's (block pairs) */
static int64_t gq_group_rows(int64_t m) { return m >= 8 ? 8 : 4; }
static int64_t gq_groups(int64_t m) { return m >= GQS_MIN_ROWS ? (m + gq_group_rows(m) - 1) / gq_group_rows(m) : 0; }
/* int32 per group of XT, and of CB (DT: as many floats) */
static int64_t gq_xt_len(int64_t m, int64_t k) { return m >= 8 ? k / 4 * 8 : (k / QB + 1) / 2 * 64; }
static int64_t gq_cb_len(int64_t m, int64_t k) { return m >= 8 ? k / QB * 8 : (k / QB + 1) / 2 * 8; }

/* the lane layout of row group g (rows 8g .. 8g + 7, or under 8 rows 4g .. 4g + 3) of m rows, in `lanes` */
gq_lanes gq_lanes_in(const void *lanes, int64_t m, int64_t k, int64_t g) {
    const int64_t mg = gq_groups(m), xl = gq_xt_len(m, k), cl = gq_cb_len(m, k);
    const int32_t *xt = (const int32_t *)lanes, *cb = xt + mg * xl;
    const gq_lanes ln = {xt + g * xl, cb + g * cl, (const float *)(cb + mg * cl) + g * cl};
    return ln;
}

/* bytes of the lane layout of m rows */
size_t gq_lanes_bytes(int64_t m, int64_t k) {
    return (size_t)(gq_groups(m) * 4 * (gq_xt_len(m, k) + 2 * gq_cb_len(m, k)));
}

/* One row's data (plain C: the same bits in every build): d [K/32], S [gq_sums(K)], the bytes q [K] and, with_c (the
 * signed blocks of 32 and IQ4_XS read it), C [K/4]. */
void gq_quantize_row(const float *x, int64_t k, int with_c, float *d, float *S, int8_t *xq, int32_t *C) {
    float D; /* the whole row's sum (quantize_row's group sum), unused */
    quantize_row(x, k, k, 0, xq, d, &D);
    memset(S, 0, (size_t)gq_sums(k) * 4);
    float *S32 = S + gq_sums32_at(k);
    for (int64_t s = 0, first = 0; s < k / 16; s++) { /* first: the previous sum of 16, the block's first half */
        int sum = 0;
        for (int i = 0; i < 16; i++) sum += xq[16 * s + i];
        S[s] = d[s / 2] * (float)sum;
        if (s % 2) S32[s / 2] = d[s / 2] * (float)(first + sum);
        first = sum;
    }
    for (int64_t i = 0; with_c && i < k / 4; i++) {
        const int8_t *v = xq + 4 * i;
        C[i] = -128 * (v[0] + v[1] + v[2] + v[3]);
    }
}

/* The lane layout (gq_lanes_bytes) of rows [0, m) from their d, q and C (the signed blocks read it). */
void gq_fill_lanes(void *lanes, const float *d, const int8_t *xq, const int32_t *C, int64_t m, int64_t k) {
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

/* A row's bytes q [K] broadcast for the interleaved one-row tiles: each 4 bytes 8 times, xb [8 K] */
void gq_broadcast_row(const int8_t *xq, int64_t k, int8_t *xb) {
    for (int64_t i = 0; i < k; i += 4)
        for (int l = 0; l < 8; l++) memcpy(xb + 8 * i + 4 * l, xq + i, 4);
}

/* A row's int16 codes broadcast for the interleaved one-row head tiles: each 4 codes 4 times, xb [4 K] */
void gh_broadcast_row(const int16_t *xq, int64_t k, int16_t *xb) {
    for (int64_t i = 0; i < k; i += 4)
        for (int l = 0; l < 4; l++) memcpy(xb + 4 * i + 4 * l, xq + i, 8);
}

/* One row's data (plain C): d [K/32], the codes q [K] (int16). */
void gh_quantize_row(const float *x, int64_t k, float *d, int16_t *xq) {
    for (int64_t b = 0; b < k / QB; b++) {
        const float *xb = x + b * QB, amax = block_amax(xb);
        const float id = amax > 0.0f ? 32767.0f / amax : 0.0f;
        for (int i = 0; i < QB; i++) xq[b * QB + i] = (int16_t)__builtin_nearbyintf(xb[i] * id);
        d[b] = amax / 32767.0f;
    }
}


/* int16 codes [K] -> the sums of each 16 codes [K/16] */
void gh_sums_row(const int16_t *xq, int64_t k, int32_t *sums) {
    for (int64_t s = 0; s < k / 16; s++) {
        int32_t t = 0;
        for (int i = 0; i < 16; i++) t += xq[16 * s + i];
        sums[s] = t;
    }
}
