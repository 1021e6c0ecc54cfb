/* The recurrent layers of hybrid models on the CPU (Qwen3.5's Gated DeltaNet, the Mamba2 layers of Granite 4 and
 * Nemotron-H): the three functions of llmd.model.recurrent over a step's flattened batch of sequences, each reading
 * and writing its state at its slot (llmd_state_batch: slots, token offsets, which sequences start from a zero state).
 * Bound by llmd.kernels.cpu_recurrent; built into the same library as cpu_gemm.c (llmd.kernels.cpu_gemm).
 *
 *   llmd_causal_conv1d      the short depthwise causal convolution (K taps) with the K-1 inputs before each
 *                           sequence's tokens read from its conv state and the last K-1 written back; SiLU.
 *   llmd_gated_delta_rule   the gated delta rule, token by token: q, k L2-normalised, q scaled, and per token
 *                           S <- S exp(g); S <- S + k (beta (v - S^T k))^T; o = S^T q.
 *   llmd_mamba2_scan        Mamba2's selective scan, token by token: dt = clamp(softplus(dt + dt_bias)), and per token
 *                           and head S <- S exp(dt A) + (dt x) B^T; y = S C + D x.
 *
 * Work is shared out by (sequence, block of channels), (sequence, value head, tile of value columns) and (sequence,
 * head, tile of state rows): a column of the delta rule's state depends only on its own column (S^T k reduces over
 * the key dimension), a row of Mamba2's only on its own row (S C reduces over the state dimension), so a tile runs
 * all of its sequence's tokens with its slice of the state in L1, and no sum is ever split between threads. Every
 * value is computed by one thread in an order fixed by its own sequence, head and column (or row), so a sequence's
 * results are the same bits whatever else is in the batch and however many threads run (llmd's exactness invariant).
 * The delta rule's vector code pads a tile to whole vectors instead of a scalar tail, so a column's operations do not
 * depend on where its tile ends either; the scan's vectors run along a row, which every tile holds whole.
 *
 * Why the recurrence and not the chunked (matmul) form: at Qwen3.5's Dk = Dv = 128 and chunks of 64 the chunked form
 * does 1.57 times the recurrence's flops (its within-chunk products add ~6 C (Dk + Dv) per token to the 6 Dk Dv of its
 * state products, against the recurrence's 7 Dk Dv), while the recurrence, its state slice in L1, runs at 70 % of the
 * rate torch's matmul reaches on the chunked form's products (one core: 66 against 94 GFLOP/s), so even a chunked form
 * at torch's matmul rate would be slower: tests/benchmarks/bench_cpu_recurrent.py prints the figures. For Mamba2's
 * scan the chunked (SSD) form does the recurrence's flops (4 P N + 2 L P per token and head against 5 P N: 1.00x at
 * Granite 4.0-H's P = 64, N = 128 and chunks of 64), and the recurrence runs at 61 GFLOP/s against the 65 to 88
 * torch's matmul reaches on the chunked form's products (one core), so a chunked form would gain 1.4x at most.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"
#include "cpu_vec.h"

#define CONV_BLOCK 64  /* channels per work item of the convolution */
#define MAX_TAPS 16    /* the convolution's K */
#define TILE 32        /* value columns per work item of the delta rule: four vectors */
#define MAX_DK 256     /* key dimension the delta rule takes (its state tile lives on the thread's stack) */
#define SCAN_ROWS 16   /* state rows (of a head's head_dim) per work item of the Mamba2 scan */

static int check_batch(const llmd_state_batch *sb) {
    if (sb->seqs < 0 || sb->num_slots <= 0 || (sb->seqs > 0 && sb->starts[0] < 0)) return -1;
    for (int64_t b = 0; b < sb->seqs; b++)
        if (sb->slots[b] < 0 || sb->slots[b] >= sb->num_slots || sb->starts[b + 1] < sb->starts[b] ||
            sb->starts[b + 1] > sb->tokens)
            return -1;
    return 0;
}

/* ---- causal depthwise convolution --------------------------------------------------------------------------------- */

/* Sequence b's channels c0 .. c0 + nc - 1: window = (its K-1 state inputs, its n inputs), out[t] = silu(bias +
 * sum_j w[j] window[t + j]) (the products summed j = 0 .. K-1, each added by one fused multiply-add), the last K-1
 * of the window written back. */
static void conv_block(const float *x, int64_t ldx, int64_t C, const float *w, int64_t K, const float *bias,
                       float *state, const llmd_state_batch *sb, int64_t b, int64_t c0, int silu, float *out,
                       int64_t ldo) {
    const int64_t nc = C - c0 < CONV_BLOCK ? C - c0 : CONV_BLOCK, K1 = K - 1, s0 = sb->starts[b],
                  n = sb->starts[b + 1] - s0;
    float *st = state + sb->slots[b] * C * K1;
    float hist[MAX_TAPS - 1][CONV_BLOCK], wt[MAX_TAPS][CONV_BLOCK];
    for (int64_t c = 0; c < nc; c++) {
        for (int64_t i = 0; i < K1; i++) hist[i][c] = sb->fresh[b] ? 0.0f : st[(c0 + c) * K1 + i];
        for (int64_t j = 0; j < K; j++) wt[j][c] = w[(c0 + c) * K + j];
    }
    const float *bb = bias ? bias + c0 : NULL;
    for (int64_t t = 0; t < n; t++) {
        const float *row[MAX_TAPS]; /* tap j reads window[t + j]: a state input, or input t + j - (K-1) */
        for (int64_t j = 0; j < K; j++) {
            const int64_t p = t + j - K1;
            row[j] = p < 0 ? hist[K1 + p] : x + (s0 + p) * ldx + c0;
        }
        float *o = out + (s0 + t) * ldo + c0;
        int64_t c = 0;
#if LLMD_VEC
        const __m256 one = _mm256_set1_ps(1.0f);
        for (; c + 8 <= nc; c += 8) {
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(wt[0] + c), _mm256_loadu_ps(row[0] + c));
            for (int64_t j = 1; j < K; j++)
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(wt[j] + c), _mm256_loadu_ps(row[j] + c), acc);
            if (bb) acc = _mm256_add_ps(acc, _mm256_loadu_ps(bb + c));
            if (silu) acc = _mm256_div_ps(acc, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), acc))));
            _mm256_storeu_ps(o + c, acc);
        }
#endif
        for (; c < nc; c++) { /* the channels past the last whole vector (the same ones in every call) */
            float acc = wt[0][c] * row[0][c];
            for (int64_t j = 1; j < K; j++) acc = fmaf(wt[j][c], row[j][c], acc);
            if (bb) acc += bb[c];
            o[c] = silu ? acc / (1.0f + expf(-acc)) : acc;
        }
    }
    for (int64_t i = 0; i < K1; i++) { /* window[n + i]: a state input still, or input n + i - (K-1) */
        const int64_t p = n + i - K1;
        const float *src = p < 0 ? hist[K1 + p] : x + (s0 + p) * ldx + c0;
        for (int64_t c = 0; c < nc; c++) st[(c0 + c) * K1 + i] = src[c];
    }
}

int llmd_causal_conv1d(const float *x, int64_t ldx, int64_t C, const float *w, int64_t K, const float *bias,
                       float *state, const llmd_state_batch *sb, int silu, float *out, int64_t ldo, int nthreads) {
    if (C <= 0 || K < 1 || K > MAX_TAPS || check_batch(sb)) return -1;
    const int64_t blocks = (C + CONV_BLOCK - 1) / CONV_BLOCK, items = sb->seqs * blocks;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t it = 0; it < items; it++)
        conv_block(x, ldx, C, w, K, bias, state, sb, it / blocks, it % blocks * CONV_BLOCK, silu, out, ldo);
    return 0;
}

/* ---- gated delta rule --------------------------------------------------------------------------------------------- */

/* y = x / sqrt(sum(x^2) + 1e-6) * scale over d values (llmd.model.recurrent.l2norm, then the scale) */
static void l2norm(const float *x, int64_t d, float scale, float *y) {
    int64_t i = 0;
    float ss = 0.0f;
#if LLMD_VEC
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(x + i), acc);
    ss = hsum8(acc);
#endif
    for (; i < d; i++) ss = fmaf(x[i], x[i], ss);
    const float inv = 1.0f / sqrtf(ss + 1e-6f);
    for (i = 0; i < d; i++) y[i] = x[i] * inv * scale;
}

/* One token on a state tile S [dk][W] (W = 8 NV columns, row-major): S *= decay, mem = S^T k, delta = (v - mem) beta,
 * S += k delta^T, o = S^T q. Each column's sums run over the key index in order, one fused multiply-add per term. */
#if LLMD_VEC
INLINE void token_step(float *S, int64_t dk, const int NV, const float *qn, const float *kn, const float *v,
                       float decay, float beta, float *o) {
    const int64_t W = 8 * NV;
    const __m256 vd = _mm256_set1_ps(decay), vb = _mm256_set1_ps(beta);
    __m256 acc[4], delta[4];
    for (int u = 0; u < NV; u++) acc[u] = _mm256_setzero_ps();
    for (int64_t i = 0; i < dk; i++) {
        const __m256 ki = _mm256_set1_ps(kn[i]);
        for (int u = 0; u < NV; u++) {
            const __m256 s = _mm256_mul_ps(_mm256_load_ps(S + i * W + 8 * u), vd);
            _mm256_store_ps(S + i * W + 8 * u, s);
            acc[u] = _mm256_fmadd_ps(s, ki, acc[u]);
        }
    }
    for (int u = 0; u < NV; u++) {
        delta[u] = _mm256_mul_ps(_mm256_sub_ps(_mm256_load_ps(v + 8 * u), acc[u]), vb);
        acc[u] = _mm256_setzero_ps();
    }
    for (int64_t i = 0; i < dk; i++) {
        const __m256 ki = _mm256_set1_ps(kn[i]), qi = _mm256_set1_ps(qn[i]);
        for (int u = 0; u < NV; u++) {
            const __m256 s = _mm256_fmadd_ps(ki, delta[u], _mm256_load_ps(S + i * W + 8 * u));
            _mm256_store_ps(S + i * W + 8 * u, s);
            acc[u] = _mm256_fmadd_ps(s, qi, acc[u]);
        }
    }
    for (int u = 0; u < NV; u++) _mm256_store_ps(o + 8 * u, acc[u]);
}
#else
static void token_step(float *S, int64_t dk, int64_t W, const float *qn, const float *kn, const float *v, float decay,
                       float beta, float *o) {
    float mem[TILE] = {0}, delta[TILE];
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < W; j++) {
            S[i * W + j] *= decay;
            mem[j] += S[i * W + j] * kn[i];
        }
    for (int64_t j = 0; j < W; j++) delta[j] = (v[j] - mem[j]) * beta, o[j] = 0.0f;
    for (int64_t i = 0; i < dk; i++)
        for (int64_t j = 0; j < W; j++) {
            S[i * W + j] += kn[i] * delta[j];
            o[j] += S[i * W + j] * qn[i];
        }
}
#endif

/* Sequence b, value head h, value columns j0 .. j0 + nj - 1: every token of the sequence in order, the state tile
 * read from its slot (or zero) first and written back after the last token. */
static void delta_tile(const llmd_delta_rule *r, float *state, const llmd_state_batch *sb, int64_t b, int64_t h,
                       int64_t j0, float *out, int64_t ldo) {
    const int64_t dk = r->dk, dv = r->dv, nj = dv - j0 < TILE ? dv - j0 : TILE, hk = h / (r->hv / r->hk);
#if LLMD_VEC
    const int64_t W = (nj + 7) / 8 * 8; /* padded to whole vectors: the padding columns stay zero */
#else
    const int64_t W = nj;
#endif
    _Alignas(32) float S[MAX_DK * TILE], qn[MAX_DK], kn[MAX_DK], v[TILE], o[TILE];
    float *st = state + ((sb->slots[b] * r->hv + h) * dk) * dv + j0;
    if (sb->fresh[b] || nj < W) memset(S, 0, (size_t)(dk * W) * sizeof(float));
    if (!sb->fresh[b])
        for (int64_t i = 0; i < dk; i++) memcpy(S + i * W, st + i * dv, (size_t)nj * sizeof(float));
    for (int64_t j = nj; j < W; j++) v[j] = 0.0f;
    for (int64_t t = sb->starts[b]; t < sb->starts[b + 1]; t++) {
        l2norm(r->q + t * r->ldq + hk * dk, dk, r->scale, qn);
        l2norm(r->k + t * r->ldk + hk * dk, dk, 1.0f, kn);
        memcpy(v, r->v + t * r->ldv + h * dv + j0, (size_t)nj * sizeof(float));
        const float decay = expf(r->g[t * r->ldg + h]), beta = r->beta[t * r->ldb + h];
#if LLMD_VEC
        switch (W / 8) {
        case 1: token_step(S, dk, 1, qn, kn, v, decay, beta, o); break;
        case 2: token_step(S, dk, 2, qn, kn, v, decay, beta, o); break;
        case 3: token_step(S, dk, 3, qn, kn, v, decay, beta, o); break;
        default: token_step(S, dk, 4, qn, kn, v, decay, beta, o); break;
        }
#else
        token_step(S, dk, W, qn, kn, v, decay, beta, o);
#endif
        memcpy(out + t * ldo + h * dv + j0, o, (size_t)nj * sizeof(float));
    }
    for (int64_t i = 0; i < dk; i++) memcpy(st + i * dv, S + i * W, (size_t)nj * sizeof(float));
}

int llmd_gated_delta_rule(const llmd_delta_rule *r, float *state, const llmd_state_batch *sb, float *out,
                          int64_t ldo, int nthreads) {
    if (r->hk <= 0 || r->hv <= 0 || r->hv % r->hk || r->dk <= 0 || r->dk > MAX_DK || r->dv <= 0 || check_batch(sb))
        return -1;
    const int64_t tiles = (r->dv + TILE - 1) / TILE, items = sb->seqs * r->hv * tiles;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t it = 0; it < items; it++)
        delta_tile(r, state, sb, it / (r->hv * tiles), it / tiles % r->hv, it % tiles * TILE, out, ldo);
    return 0;
}

/* ---- Mamba2 selective scan --------------------------------------------------------------------------------------- */

/* A token's step size: softplus as torch computes it (the input itself above 20), clamped to [lo, hi] */
static float mamba2_dt(float raw, float lo, float hi) {
    const float sp = raw > 20.0f ? raw : log1pf(expf(raw));
    return fminf(fmaxf(sp, lo), hi);
}

/* One token on R consecutive state rows (row r at S + r n, n values): S[r] = S[r] decay + u[r] B (u = dt x), then
 * y[r] = S[r] . C. A row's sum runs over the state index in a fixed order (in the vector code: index i into lane i % 8,
 * the lanes summed by hsum8, then the tail past the last whole vector in order), one fused multiply-add per term; the
 * R rows are interleaved only to give the core independent chains, each row's operations those of a row alone. */
#if LLMD_VEC
INLINE void scan_rows(float *S, int64_t n, const int R, const float *u, const float *B, const float *C, float decay,
                      float *y) {
    const __m256 vd = _mm256_set1_ps(decay);
    __m256 acc[4], vu[4];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps(), vu[r] = _mm256_set1_ps(u[r]);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 b = _mm256_loadu_ps(B + i), c = _mm256_loadu_ps(C + i);
        for (int r = 0; r < R; r++) {
            const __m256 s = _mm256_fmadd_ps(vu[r], b, _mm256_mul_ps(_mm256_loadu_ps(S + r * n + i), vd));
            _mm256_storeu_ps(S + r * n + i, s);
            acc[r] = _mm256_fmadd_ps(s, c, acc[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum8(acc[r]);
    for (; i < n; i++)
        for (int r = 0; r < R; r++) {
            const float s = fmaf(u[r], B[i], S[r * n + i] * decay);
            S[r * n + i] = s;
            y[r] = fmaf(s, C[i], y[r]);
        }
}
#else
static void scan_rows(float *S, int64_t n, int R, const float *u, const float *B, const float *C, float decay,
                      float *y) {
    for (int r = 0; r < R; r++) {
        y[r] = 0.0f;
        for (int64_t i = 0; i < n; i++) {
            const float s = fmaf(u[r], B[i], S[r * n + i] * decay);
            S[r * n + i] = s;
            y[r] = fmaf(s, C[i], y[r]);
        }
    }
}
#endif

/* Sequence b, head h, state rows p0 .. p0 + np - 1: every token of the sequence in order. The tile's rows are one
 * contiguous block of its slot ([p][n]), updated in place (zeroed first where the sequence is fresh): a decode token
 * then reads and writes its state once. */
static void scan_tile(const llmd_mamba2 *m, float *state, const llmd_state_batch *sb, int64_t b, int64_t h, int64_t p0,
                      float *out, int64_t ldo) {
    const int64_t n = m->n, np = m->p - p0 < SCAN_ROWS ? m->p - p0 : SCAN_ROWS, grp = h / (m->h / m->g);
    float *S = state + ((sb->slots[b] * m->h + h) * m->p + p0) * n;
    if (sb->fresh[b]) memset(S, 0, (size_t)(np * n) * sizeof(float));
    const float A = m->A[h], D = m->D[h], bias = m->dt_bias[h];
    for (int64_t t = sb->starts[b]; t < sb->starts[b + 1]; t++) {
        const float dt = mamba2_dt(m->dt[t * m->lddt + h] + bias, m->dt_min, m->dt_max), decay = expf(dt * A);
        const float *x = m->x + t * m->ldx + h * m->p + p0, *B = m->B + t * m->ldb + grp * n,
                    *C = m->C + t * m->ldc + grp * n;
        float u[SCAN_ROWS], y[SCAN_ROWS];
        for (int64_t r = 0; r < np; r++) u[r] = dt * x[r];
        int64_t r = 0;
        for (; r + 4 <= np; r += 4) scan_rows(S + r * n, n, 4, u + r, B, C, decay, y + r);
        switch (np - r) {
        case 3: scan_rows(S + r * n, n, 3, u + r, B, C, decay, y + r); break;
        case 2: scan_rows(S + r * n, n, 2, u + r, B, C, decay, y + r); break;
        case 1: scan_rows(S + r * n, n, 1, u + r, B, C, decay, y + r); break;
        default: break;
        }
        float *o = out + t * ldo + h * m->p + p0;
        for (r = 0; r < np; r++) o[r] = y[r] + D * x[r];
    }
}

int llmd_mamba2_scan(const llmd_mamba2 *m, float *state, const llmd_state_batch *sb, float *out, int64_t ldo,
                     int nthreads) {
    if (m->h <= 0 || m->g <= 0 || m->h % m->g || m->p <= 0 || m->n <= 0 || check_batch(sb)) return -1;
    const int64_t tiles = (m->p + SCAN_ROWS - 1) / SCAN_ROWS, items = sb->seqs * m->h * tiles;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t it = 0; it < items; it++)
        scan_tile(m, state, sb, it / (m->h * tiles), it / tiles % m->h, it % tiles * SCAN_ROWS, out, ldo);
    return 0;
}
