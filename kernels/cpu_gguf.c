/* GGUF blocks: matmul straight from the file's block bytes (llmd_gguf_*; the types' own code is cpu_blocks32.c's and
 * cpu_kquants.c's, the output heads' cpu_head.c's, the activation rows cpu_act.c's).
 *
 * Weights: q uint8 [N, row bytes], each row K / block_elems blocks of a GGML type (layouts and the reference values:
 * llmd.kernels.gguf_blocks). llmd_gguf_dequant gives exactly the values of gguf.quants.dequantize (fp16 -> fp32
 * exactly, scale products first, then scale * q, then the offset, each rounded: the library is built with
 * -ffp-contract=off, so no multiply-add is fused). The matmul (llmd_gguf_matmul, see "The GGUF matmul" in cpu_tiles.h)
 * does not dequantize: it multiplies the blocks' integer codes with the activations per sub-block and applies each
 * sub-block's scale and offset once, in one fixed order per output, so a row's result is the same bits whatever the
 * batch, its position, the path or the thread count. */

#include "cpu_tiles.h"

/* the type table: the rows of cpu_blocks32.c and cpu_kquants.c */
const gguf_type *gguf_type_of(int type, int64_t k) {
    const gguf_type *t = NULL;
    for (int i = 0; i < LLMD_BLOCKS32_TYPES; i++)
        if (llmd_blocks32_types[i].type == type) t = &llmd_blocks32_types[i];
    for (int i = 0; i < LLMD_KQUANTS_TYPES; i++)
        if (llmd_kquants_types[i].type == type) t = &llmd_kquants_types[i];
    return t && k > 0 && k % t->elems == 0 ? t : NULL;
}

/* rows of block bytes (row stride ldq bytes) -> fp32 [rows, k] (row stride ldw); -1 for an unknown type or bad k. */
int llmd_gguf_dequant(int type, const uint8_t *q, int64_t ldq, int64_t rows, int64_t k, float *w, int64_t ldw) {
    const gguf_type *t = gguf_type_of(type, k);
    if (!t || rows < 0) return -1;
    for (int64_t r = 0; r < rows; r++) t->fn(q + r * ldq, k / t->elems, w + r * ldw);
    return 0;
}

/* ==== The fp32 path: a thread's columns in the types' tiles (cpu_tiles.h: "The GGUF matmul") ==================== */

#if defined(__AVX2__) && defined(__FMA__)
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
 * The activations are quantized as for int8/int4 (cpu_act.c: per block of 32, d_b = amax / 127, q = round(x / d_b)),
 * and every weight is again w = a_s * u + z_s (see "The GGUF matmul", cpu_tiles.h), now with u a byte code that meets
 * the activation bytes in an integer dot product per 32-element unit (DOT_U8S8: unsigned x signed bytes -> 8 int32
 * lanes of 4 elements each, exact). Per output y[r, c], in this order whatever M, the row's position, the part, the
 * tile or the thread count:
 *   blocks of 32 with a minimum (Q4_1, Q5_1): for each block j, out = fma(float(dot_j), a_j * d_j, out);
 *   signed blocks of 32 (Q4_0, Q5_0, Q8_0, IQ4_NL, MXFP4): one accumulator per output over the blocks' whole dot
 *       products (see GQS_TILE, cpu_blocks32.c);
 *   super-blocks of 256 (the K-quants, IQ4_XS): the sub-block scales in integer arithmetic, d once per super-block
 *       (see GQK_TILE, cpu_kquants.c);
 *   after each chunk of 256 elements: out = fma(z[0..8), S[0..8), out), then fma(z[8..16), S[8..16), out), with z the
 *       offsets of the chunk's 16-element sub-blocks (a 32-element sub-block's offset twice) and S = d_b * sum(q) over
 *       each 16 activations (row data, computed once per call); IQ4_XS (no offsets) skips this;
 *   y = hsum(out).
 * Codes are unsigned (0..63: nibbles, 5- and 6-bit codes, Q3_K's code + 4, Q6_K's + 32) except for the signed blocks
 * of 32 and IQ4_XS's table values, which are signed with z = 0 (GQ_SIGNED_DOT). A pair of products fits int16
 * (63 * 127 * 2 or 128 * 127 * 2 < 32768). The portable build dequantizes each column (the reference's values) and
 * sums d_b * (sum of q * w per block) in a fixed order, except for the signed blocks of 32, whose order it computes
 * in plain C (the vector build's bits). */

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
    const gq_tile_fn *tiles = t->qtiles;
    const gq_rows_fn rows_fn = t->qrows;
    const gq_pairs_fn pairs_fn = t->qpairs;
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
        gq_signed_cols(t, xd, xq, q, y, ldy, m, k, n0, n1);
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

/* ==== The GGUF matmuls in steps (cpu_gguf.h) ====================================================================
 *
 * Each path's activation rows are prepared once (plain C, row by row: a row's data never depends on the other rows),
 * a group of consecutive rows adds what a matmul over exactly those rows reads (the int8 and Q4_1's int16 lane layouts,
 * the fp32 rows transposed), and each thread computes ranges of output columns with the column loops above, which choose tiles
 * by the group's row count as the whole-matrix entries always did. The entries below are these steps in one parallel
 * region; cpu_moe.c runs a layer's experts with them. The arrays of a rows set, per path:
 *   fp32: a[0] gg_prepare's activations [kp], a[1] its sums [chunks * GG_XS] (portable: a[0] the row as given [K]);
 *   int8: a[0] d [K/32], a[1] S [gq_sums], a[2] the bytes q [K], a[3] C [K/4] (where LLMD_GX_C);
 *   int16: a[0] d [K/32], a[2] the codes q [K] (int16); for an interleaved Q6_K and Q4_1 (LLMD_GX_SUMS) also a[1]
 *       the sums of each 16 codes [K/16] (int32). */

static size_t gx_align(size_t bytes) { return (bytes + 63) / 64 * 64; }

void llmd_thread_id(int *tid, int *nth) { thread_id(tid, nth); }

int llmd_gx_takes(int act, int type, int64_t k) {
    if (LLMD_X8(type))
        return (act == LLMD_ACT_I8 || (act == LLMD_ACT_I16 && llmd_gguf_q16_type(type))) && k > 0 &&
               k % LLMD_X8_ELEMS(type) == 0;
    if (!gguf_type_of(type, k)) return 0;
    if (act == LLMD_ACT_F32) return 1;
    return k % QB == 0 && (act == LLMD_ACT_I8 || (act == LLMD_ACT_I16 && gh_supported(type)));
}

/* the interleaved types' one-row tiles read a broadcast copy of the row (vector builds) */
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define X8_BROADCAST LLMD_GX_BROADCAST
#else
#define X8_BROADCAST 0
#endif

int llmd_gx_flags(int act, int type) {
    if (act == LLMD_ACT_I16)
        return LLMD_X8(type) ? (type == LLMD_Q80_X8 ? 0 : LLMD_GX_SUMS) | X8_BROADCAST /* Q8_0: no minima */
                             : type == 3 ? LLMD_GX_SUMS | LLMD_GX_LANES : 0;
    if (act != LLMD_ACT_I8) return 0;
    if (gq_signed_type(type)) return LLMD_GX_C | LLMD_GX_LANES;
    /* IQ4_XS's, Q4_0_X8's and Q5_0_X8's sums; Q8_0_X8's and the IQ4s' offsets with VNNI */
    const int c = type == 23 || type == LLMD_IQ4XS_X8 || type == LLMD_IQ4NL_X8 || type == LLMD_Q40_X8 ||
                          type == LLMD_Q50_X8 || type == LLMD_Q80_X8
                      ? LLMD_GX_C
                      : 0;
    return LLMD_X8(type) && type != LLMD_Q80_X8 ? c | X8_BROADCAST : c; /* Q8_0: see X8_TYPES */
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
        if (flags & LLMD_GX_SUMS) r->row[1] = (size_t)(k / 16) * 4;
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
        if (r->flags & LLMD_GX_SUMS) gh_sums_row((const int16_t *)a2, r->k, (int32_t *)a1);
    }
}

void llmd_gx_copy(const llmd_gx_rows *dst, int64_t to, const llmd_gx_rows *src, int64_t from) {
    for (int i = 0; i < 4; i++)
        if (dst->row[i]) memcpy(dst->a[i] + to * dst->row[i], src->a[i] + from * src->row[i], dst->row[i]);
}

/* an int8 or int16 group's extra: its lane layout, then (one row) its broadcast copy (8 bytes an element either way:
 * 4 bytes or 4 int16 codes 8 or 4 times) */
static size_t gx_lanes_bytes(const llmd_gx_rows *r, int64_t m) {
    if (!(r->flags & LLMD_GX_LANES)) return 0;
    return gx_align(r->act == LLMD_ACT_I16 ? gh41_lanes_bytes(m, r->k) : gq_lanes_bytes(m, r->k));
}
static size_t gx_broadcast_bytes(const llmd_gx_rows *r, int64_t m) {
    return (r->flags & LLMD_GX_BROADCAST) && m == 1 ? gx_align((size_t)r->k * 8) : 0;
}

size_t llmd_gx_group_bytes(const llmd_gx_rows *r, int64_t m) {
#if defined(__AVX2__) && defined(__FMA__)
    if (r->act == LLMD_ACT_F32 && m >= RP_MIN_ROWS) /* the rows and their sums transposed */
        return gx_align((size_t)((m + 15) / 16 * 16) * (r->row[0] + r->row[1]));
#endif
    return r->act == LLMD_ACT_F32 ? 0 : gx_lanes_bytes(r, m) + gx_broadcast_bytes(r, m);
}

/* a one-row group's broadcast copy in its extra (after the lanes), or NULL */
static const void *gx_broadcast_row(const llmd_gx_group *g) {
    return gx_broadcast_bytes(&g->x, g->m) ? (const char *)g->extra + gx_lanes_bytes(&g->x, g->m) : NULL;
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
    if (r->act == LLMD_ACT_I16) {
        if (r->flags & LLMD_GX_LANES)
            gh41_fill_lanes(extra, (const float *)g->x.a[0], (const int32_t *)g->x.a[1], (const int16_t *)g->x.a[2], m,
                            g->x.k);
        if (gx_broadcast_bytes(r, m))
            gh_broadcast_row((const int16_t *)g->x.a[2], g->x.k, (int16_t *)((char *)extra + gx_lanes_bytes(r, m)));
    } else {
        if (r->flags & LLMD_GX_LANES)
            gq_fill_lanes(extra, (const float *)g->x.a[0], (const int8_t *)g->x.a[2], (const int32_t *)g->x.a[3], m,
                          g->x.k);
        if (gx_broadcast_bytes(r, m))
            gq_broadcast_row((const int8_t *)g->x.a[2], g->x.k, (int8_t *)extra + gx_lanes_bytes(r, m));
    }
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
    if (LLMD_X8(job->type) && x->act == LLMD_ACT_I16) {
        llmd_x8_cols_q16((int)job->type, (const float *)x->a[0], (const int32_t *)x->a[1], (const int16_t *)x->a[2],
                         gx_broadcast_row(g), job->q, job->y, job->ldy, m, k, n0, n1);
        return;
    }
    if (LLMD_X8(job->type)) {
        llmd_x8_cols((int)job->type, (const float *)x->a[0], (const float *)x->a[1], (const int8_t *)x->a[2],
                     (const int32_t *)x->a[3], gx_broadcast_row(g), job->q, job->y, job->ldy, m, k, n0, n1);
        return;
    }
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
        gh_cols((int)job->type, (const float *)x->a[0], x->row[1] ? (const int32_t *)x->a[1] : NULL,
                (const int16_t *)x->a[2], g->extra, job->q, job->y, job->ldy, m, k, n0, n1);
    }
}

/* The jobs' columns in units of 8, each costing its rows plus a few for decoding the weights, cut into GX_SHARES
 * shares of equal cost per thread that the team takes as each thread comes free: a thread slowed by another process
 * (a shared machine) leaves its shares to the others instead of holding every thread at the next barrier. A column's
 * result does not depend on which thread computes it. */
#define GX_SHARES 8
void llmd_gx_run(const llmd_gx_job *jobs, int64_t njobs, int nth, void *scratch) {
    int64_t total = 0;
    for (int64_t j = 0; j < njobs; j++) total += (jobs[j].n + 7) / 8 * (jobs[j].g->m + 4);
    const int64_t shares = (int64_t)nth * GX_SHARES;
#pragma omp for schedule(dynamic, 1) nowait
    for (int64_t share = 0; share < shares; share++) {
        const int64_t lo = total * share / shares, hi = total * (share + 1) / shares;
        int64_t at = 0;
        for (int64_t j = 0; j < njobs && at < hi; j++) {
            const int64_t units = (jobs[j].n + 7) / 8, w = jobs[j].g->m + 4;
            if (at + units * w > lo) { /* unit u is this share's where its cost starts in [lo, hi) */
                const int64_t u0 = lo > at ? (lo - at + w - 1) / w : 0;
                const int64_t u1 = (hi - at + w - 1) / w < units ? (hi - at + w - 1) / w : units;
                if (u0 < u1) llmd_gx_cols(&jobs[j], 8 * u0, 8 * u1 < jobs[j].n ? 8 * u1 : jobs[j].n, scratch);
            }
            at += units * w;
        }
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
        if (LLMD_X8(parts[i].type) && parts[i].n % 8) return -1; /* whole groups of 8 columns only */
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
        llmd_gx_run(jobs, nparts, nth, scratch + gx_align(sb) * (size_t)tid);
    }
    free(jobs), free(extra), free(buf), free(plan);
    return 0;
}

/* one part: y [M, N] = x [M, K] @ dequant(q).T for GGUF blocks of `type` (a GGML type id), q [N, K / elems * bytes] */
static int gx_one_part(int act, int type, const float *x, int64_t ldx, const uint8_t *q, float *y, int64_t ldy,
                       int64_t m, int64_t n, int64_t k, int nthreads) {
    const llmd_gguf_part part = {type, n, q};
    return gx_parts_matmul(act, &part, 1, x, ldx, y, ldy, m, k, nthreads);
}

/* y [M, N] = x [M, K] @ dequant(q).T for GGUF blocks of `type`: the fp32 path, the weights' exact values. */
int llmd_gguf_matmul(int type, const float *x, int64_t ldx, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                     int64_t n, int64_t k, int nthreads) {
    return gx_one_part(LLMD_ACT_F32, type, x, ldx, q, y, ldy, m, n, k, nthreads);
}

/* Parts of different GGUF types side by side on one input (a fused q/k/v or gate/up whose projections differ in type):
 * part i fills columns [col_i, col_i + n_i) of y, each with llmd_gguf_matmul's very results. */
int llmd_gguf_parts_matmul(const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                           int64_t ldy, int64_t m, int64_t k, int nthreads) {
    return gx_parts_matmul(LLMD_ACT_F32, parts, nparts, x, ldx, y, ldy, m, k, nthreads);
}

/* y [M, N] = q8(x) [M, K] @ dequant(q).T for GGUF blocks of `type`: the integer path of one part. */
int llmd_gguf_matmul_q8(int type, const float *x, int64_t ldx, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                        int64_t n, int64_t k, int nthreads) {
    return gx_one_part(LLMD_ACT_I8, type, x, ldx, q, y, ldy, m, n, k, nthreads);
}

/* llmd_gguf_parts_matmul with int8-quantized activations (quantized once for all parts); -1 for an unknown type or a
 * K the blocks do not divide, -2 out of memory. */
int llmd_gguf_parts_matmul_q8(const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                              int64_t ldy, int64_t m, int64_t k, int nthreads) {
    return gx_parts_matmul(LLMD_ACT_I8, parts, nparts, x, ldx, y, ldy, m, k, nthreads);
}

/* y [M, N] = q16(x) [M, K] @ dequant(q).T for Q8_0 or Q6_K blocks: the head path of one part. */
int llmd_gguf_matmul_q16(int type, const float *x, int64_t ldx, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                         int64_t n, int64_t k, int nthreads) {
    return gx_one_part(LLMD_ACT_I16, type, x, ldx, q, y, ldy, m, n, k, nthreads);
}

/* llmd_gguf_parts_matmul with int16-quantized activations (the output head's path); -1 for a type it does not take
 * or a K the blocks do not divide, -2 out of memory. */
int llmd_gguf_parts_matmul_q16(const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                               int64_t ldy, int64_t m, int64_t k, int nthreads) {
    return gx_parts_matmul(LLMD_ACT_I16, parts, nparts, x, ldx, y, ldy, m, k, nthreads);
}
