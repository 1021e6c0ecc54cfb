/* A model's whole stack of decoder layers on the CPU in one call, for Llama-shaped layers whose projections are the
 * quantized layers of cpu_gemm.c and cpu_gguf.c (fused qkv and gate/up, optional biases), and Gemma 2's and 3's
 * (sandwich norms, GELU-tanh; Gemma 3's q/k norms and local and global RoPE tables; Gemma 2's soft-capped attention;
 * llmd.model.gemma).
 *
 * A layer is the same sequence of calls that llmd.model.llama makes one by one from Python (RMSNorm, qkv matmul,
 * RoPE, K/V write, attention, o matmul, residual add, RMSNorm, gate/up matmul, SiLU * up, down matmul, residual add),
 * with the same arguments, so the hidden states come out bit for bit the same. What goes away is ~12 Python-level
 * calls per layer, each costing tens of microseconds of interpreter, ctypes and tensor allocation: at batch 1 on a
 * small model that was a third of a decode step. Gemma 2's layers are Gemma 3's without q/k norms, with soft-capped
 * attention (llmd_layer.softcap). Gemma 4's dense layers (gemma4_stack) have projections apart, per-layer head shapes
 * and MLP widths, layers sharing an earlier layer's K/V, per-layer inputs and output scalars.
 */
#include <stdlib.h>
#include <string.h>

#include "cpu_kernels.h"

/* GGUF: q -> `group` parts (llmd_gguf_part); GGUF_Q8, GGUF_Q16: the same on the int8 and int16 paths */
enum { LIN_INT8 = 0, LIN_INT4 = 1, LIN_INT8_Q8 = 2, LIN_INT4_Q8 = 3, LIN_GGUF = 4, LIN_GGUF_Q8 = 5, LIN_GGUF_Q16 = 6 };

typedef struct {
    int64_t kind, n, k, group;
    const void *q;
    const float *s, *z, *bias; /* z: int4 only; bias may be NULL */
} llmd_linear;

typedef struct {
    const float *input_norm, *post_norm;
    llmd_linear qkv, o, gate_up, down;
    llmd_kv kv; /* the layer's paged KV cache, in any of its element types */
    int64_t window; /* sliding window of its attention (0: none) */
    /* Gemma (NULL / 0 for Llama-shaped layers): RMSNorm weights over each q and k head before RoPE (Gemma 3);
     * "sandwich" norms of the attention and MLP outputs before their residual adds (post_norm is then the
     * pre-feedforward norm);
     * local_rope: this layer rotates with the step's local tables (cos_local, ssin_local). */
    const float *q_norm, *k_norm, *attn_out_norm, *mlp_out_norm;
    int64_t local_rope;
    float softcap; /* attention logit soft-cap (Gemma 2; 0: none) */
    /* Gemma 4 (dims.gemma4; llmd.model.gemma4): q, k and v apart (qkv is q alone; v.q NULL: V is K's projection
     * before its norm, attention_k_eq_v), gate and up apart (gate_up is the gate), the per-layer input gate and
     * projection (dims.ple), the ones of V's weightless norm, the per-layer input's output norm, the layer's own
     * head shape and MLP width, and the scalar its output is multiplied by. */
    llmd_linear k, v, up, ple_gate, ple_proj;
    const float *v_norm, *ple_norm;
    int64_t head_dim, kv_heads, intermediate;
    int64_t kv_shared; /* attends over its cache (an earlier layer's) and computes and stores no K/V */
    float scalar;
} llmd_layer;

enum { ACT_SILU = 0, ACT_GELU_TANH = 1 };

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate;
    float eps, scale;
    int64_t act; /* the gated MLP's activation: ACT_SILU (Llama) or ACT_GELU_TANH (Gemma) */
    /* Gemma 4's layers (llmd_layer's Gemma 4 part); head_dim, kv_heads and intermediate are then the largest of its
     * layers', and ple the per-layer inputs' width (0: none) */
    int64_t gemma4, ple;
} llmd_dims;

/* One step's flattened batch of T new tokens. Decodes (single-token queries) are described as for
 * llmd_decode_attention; each other sequence is a chunk (prefill or speculative verify): chunks[i] = {first row,
 * rows, context length after the step, index of its block table in chunk_tables}.
 * window: in a model that mixes sliding-window and global layers, the window layers' own KV group (its slots, decode
 * and chunk tables; the same T and rows; its RoPE tables unused), which every layer with a window reads and writes,
 * as paged_attention picks meta.window_group; NULL: one group. */
typedef struct llmd_step {
    int64_t T;
    const float *cos, *ssin;   /* [T, head_dim] */
    const int64_t *slots;      /* [T] */
    int64_t num_decodes;
    const int64_t *decode_rows; /* NULL: row b is decode b */
    const int64_t *decode_tables, *decode_lens;
    int64_t decode_stride;
    int64_t num_chunks;
    const int64_t *chunks; /* [num_chunks, 4] */
    const int64_t *chunk_tables; /* [num_tables, chunk_stride] */
    int64_t num_tables, chunk_stride;
    const float *cos_local, *ssin_local; /* [T, head_dim]: the tables of layers with local_rope (may be NULL) */
    const struct llmd_step *window;
    const float *per_layer; /* Gemma 4 with dims.ple: the per-layer inputs [T, num_layers, ple] */
} llmd_step;

/* y[m, n] = x @ W.T (+ bias); 0, or -2 (no memory) / -3 (the kernel refused the shape). */
static int linear(const llmd_linear *l, const float *x, int64_t ldx, float *y, int64_t m, int nth) {
    int rc;
    if (l->kind == LIN_INT8)
        rc = llmd_int8_matmul(x, ldx, (const int8_t *)l->q, l->s, y, l->n, m, l->n, l->k, l->group, nth);
    else if (l->kind == LIN_INT4)
        rc = llmd_int4_matmul(x, ldx, (const uint8_t *)l->q, l->s, l->z, y, l->n, m, l->n, l->k, l->group, nth);
    else if (l->kind == LIN_GGUF)
        rc = llmd_gguf_parts_matmul((const llmd_gguf_part *)l->q, l->group, x, ldx, y, l->n, m, l->k, nth);
    else if (l->kind == LIN_GGUF_Q8)
        rc = llmd_gguf_parts_matmul_q8((const llmd_gguf_part *)l->q, l->group, x, ldx, y, l->n, m, l->k, nth);
    else if (l->kind == LIN_GGUF_Q16)
        rc = llmd_gguf_parts_matmul_q16((const llmd_gguf_part *)l->q, l->group, x, ldx, y, l->n, m, l->k, nth);
    else {
        const int64_t bytes = llmd_q8_work_bytes(m, l->k, l->group);
        void *work = bytes > 0 ? aligned_alloc(64, ((size_t)bytes + 63) / 64 * 64) : NULL;
        if (!work) return bytes > 0 ? -2 : -3;
        rc = l->kind == LIN_INT8_Q8
                 ? llmd_int8_matmul_q8(x, ldx, (const int8_t *)l->q, l->s, y, l->n, m, l->n, l->k, l->group, work, nth)
                 : llmd_int4_matmul_q8(x, ldx, (const uint8_t *)l->q, l->s, l->z, y, l->n, m, l->n, l->k, l->group,
                                       work, nth);
        free(work);
    }
    if (rc == -2) return -2;
    if (rc != 0) return -3;
    if (l->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t c = 0; c < l->n; c++) y[r * l->n + c] = y[r * l->n + c] + l->bias[c];
    return 0;
}

static void add_rows(float *x, const float *y, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = x[i] + y[i];
}

/* The attention of the step's rows over the layer's cache, H heads of d values (KV heads: KV). */
static int attention(const llmd_dims *dm, const llmd_layer *L, const llmd_step *st, const float *qkv, int64_t ldq,
                     int64_t H, int64_t KV, int64_t d, float *out, int nth) {
    if (L->kv.kv_heads != KV || L->kv.d != d) return -1;
    if (st->num_decodes) {
        const int rc = llmd_decode_attention(qkv, ldq, st->decode_rows, st->num_decodes, st->T, &L->kv,
                                             st->decode_tables, st->decode_stride, st->decode_lens, H, dm->scale,
                                             L->window, L->softcap, NULL, out, H * d, nth);
        if (rc) return rc;
    }
    for (int64_t i = 0; i < st->num_chunks; i++) {
        const int64_t *c = st->chunks + 4 * i;
        if (c[0] < 0 || c[1] < 1 || c[0] + c[1] > st->T || c[3] < 0 || c[3] >= st->num_tables) return -1;
        const int rc = llmd_prefill_attention(qkv + c[0] * ldq, ldq, c[1], c[2], &L->kv,
                                              st->chunk_tables + c[3] * st->chunk_stride, st->chunk_stride, H,
                                              dm->scale, L->window, L->softcap, NULL, out + c[0] * H * d, H * d,
                                              nth);
        if (rc) return rc;
    }
    return 0;
}

static void scale_rows(float *x, float s, int64_t count) {
    for (int64_t i = 0; i < count; i++) x[i] = x[i] * s;
}

/* Gemma 4's layers (llmd.model.gemma4.Gemma4DecoderLayer, the same calls in the same order): q, k and v apart, each
 * head normed (V without a weight), RoPE with the layer kind's tables, K/V stored unless the layer shares an earlier
 * layer's; sandwich norms around attention and a GeGLU MLP of the layer's width; then the per-layer input block
 * (x += norm(proj(gelu_tanh(gate(x)) * per_layer[:, l]))) and the layer's scalar. */
static int gemma4_stack(const llmd_dims *dm, const llmd_layer *layers, const llmd_step *st, float *x, int nth) {
    const int64_t T = st->T, D = dm->hidden, H = dm->heads, dmax = dm->head_dim, P = dm->ple, NL = dm->num_layers;
    if (P && !st->per_layer) return -1;
    const size_t floats = (size_t)(T * (D + 4 * H * dmax + D + 3 * dm->intermediate + 2 * P));
    float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!buf) return -2;
    /* (k and v each fit H * dmax: a layer has no more KV heads than heads) */
    float *h = buf, *q = h + T * D, *k = q + T * H * dmax, *v = k + T * H * dmax, *att = v + T * H * dmax,
          *y = att + T * H * dmax, *gate = y + T * D, *up = gate + T * dm->intermediate,
          *act = up + T * dm->intermediate, *pg = act + T * dm->intermediate, *pa = pg + T * P;
    int rc = 0;
    for (int64_t l = 0; l < NL && rc == 0; l++) {
        const llmd_layer *L = layers + l;
        const llmd_step *g = L->window && st->window ? st->window : st;
        const int64_t d = L->head_dim, KV = L->kv_heads, I = L->intermediate;
        const float *cos = L->local_rope ? st->cos_local : st->cos, *ssin = L->local_rope ? st->ssin_local : st->ssin;
        if (d > dmax || KV > H || I > dm->intermediate || !cos || !ssin || L->kv.kv_heads != KV || L->kv.d != d) {
            rc = -1;
            break;
        }
        llmd_rms_norm(x, D, L->input_norm, h, D, T, D, dm->eps);
        if ((rc = linear(&L->qkv, h, D, q, T, nth))) break;
        llmd_rms_norm(q, d, L->q_norm, q, d, T * H, d, dm->eps);
        llmd_rope(q, H * d, cos, ssin, T, H, d);
        if (!L->kv_shared) {
            if ((rc = linear(&L->k, h, D, k, T, nth))) break;
            if (L->v.q) {
                if ((rc = linear(&L->v, h, D, v, T, nth))) break;
                llmd_rms_norm(v, d, L->v_norm, v, d, T * KV, d, dm->eps);
            } else {
                llmd_rms_norm(k, d, L->v_norm, v, d, T * KV, d, dm->eps);
            }
            llmd_rms_norm(k, d, L->k_norm, k, d, T * KV, d, dm->eps);
            llmd_rope(k, KV * d, cos, ssin, T, KV, d);
            if (llmd_write_kv(k, KV * d, v, KV * d, g->slots, T, &L->kv)) {
                rc = -1;
                break;
            }
        }
        if ((rc = attention(dm, L, g, q, H * d, H, KV, d, att, nth))) break;
        if ((rc = linear(&L->o, att, H * d, y, T, nth))) break;
        llmd_rms_norm(y, D, L->attn_out_norm, y, D, T, D, dm->eps);
        add_rows(x, y, T * D);
        llmd_rms_norm(x, D, L->post_norm, h, D, T, D, dm->eps);
        if ((rc = linear(&L->gate_up, h, D, gate, T, nth)) || (rc = linear(&L->up, h, D, up, T, nth))) break;
        llmd_gelu_mul2(gate, I, up, I, act, I, T, I);
        if ((rc = linear(&L->down, act, I, y, T, nth))) break;
        llmd_rms_norm(y, D, L->mlp_out_norm, y, D, T, D, dm->eps);
        add_rows(x, y, T * D);
        if (P) {
            if ((rc = linear(&L->ple_gate, x, D, pg, T, nth))) break;
            llmd_gelu_mul2(pg, P, st->per_layer + l * P, NL * P, pa, P, T, P);
            if ((rc = linear(&L->ple_proj, pa, P, y, T, nth))) break;
            llmd_rms_norm(y, D, L->ple_norm, y, D, T, D, dm->eps);
            add_rows(x, y, T * D);
        }
        scale_rows(x, L->scalar, T * D);
    }
    free(buf);
    return rc;
}

/* Run every layer on x [T, hidden] in place. 0, or -1 (a slot, row, length or block id outside its buffer),
 * -2 (out of memory), -3 (a matmul refused its shape). */
int llmd_decoder_stack(const llmd_dims *dm, const llmd_layer *layers, const llmd_step *st, float *x, int nth) {
    if (st->T < 1) return 0;
    if (st->window && st->window->T != st->T) return -1;
    if (dm->gemma4) return gemma4_stack(dm, layers, st, x, nth);
    const int64_t T = st->T, D = dm->hidden, H = dm->heads, KV = dm->kv_heads, d = dm->head_dim,
                  I = dm->intermediate, qkv_w = (H + 2 * KV) * d;
    const size_t floats = (size_t)(T * (D + qkv_w + H * d + D + 2 * I + I));
    float *buf = (float *)aligned_alloc(64, (floats * sizeof(float) + 63) / 64 * 64);
    if (!buf) return -2;
    float *h = buf, *qkv = h + T * D, *att = qkv + T * qkv_w, *y = att + T * H * d, *gu = y + T * D,
          *act = gu + T * 2 * I;
    int rc = 0;
    for (int64_t l = 0; l < dm->num_layers && rc == 0; l++) {
        const llmd_layer *L = layers + l;
        const llmd_step *g = L->window && st->window ? st->window : st; /* the KV group of this layer */
        llmd_rms_norm(x, D, L->input_norm, h, D, T, D, dm->eps);
        if ((rc = linear(&L->qkv, h, D, qkv, T, nth))) break;
        if (L->q_norm && L->k_norm)
            for (int64_t t = 0; t < T; t++) { /* in place, one head of d values per row */
                llmd_rms_norm(qkv + t * qkv_w, d, L->q_norm, qkv + t * qkv_w, d, H, d, dm->eps);
                llmd_rms_norm(qkv + t * qkv_w + H * d, d, L->k_norm, qkv + t * qkv_w + H * d, d, KV, d, dm->eps);
            }
        if (L->local_rope && !(st->cos_local && st->ssin_local)) {
            rc = -1;
            break;
        }
        llmd_rope(qkv, qkv_w, L->local_rope ? st->cos_local : st->cos, L->local_rope ? st->ssin_local : st->ssin, T,
                  H + KV, d);
        if (L->kv.kv_heads != KV || L->kv.d != d ||
            llmd_write_kv(qkv + H * d, qkv_w, qkv + (H + KV) * d, qkv_w, g->slots, T, &L->kv)) {
            rc = -1;
            break;
        }
        if ((rc = attention(dm, L, g, qkv, qkv_w, H, KV, d, att, nth))) break;
        if ((rc = linear(&L->o, att, H * d, y, T, nth))) break;
        if (L->attn_out_norm) llmd_rms_norm(y, D, L->attn_out_norm, y, D, T, D, dm->eps);
        add_rows(x, y, T * D);
        llmd_rms_norm(x, D, L->post_norm, h, D, T, D, dm->eps);
        if ((rc = linear(&L->gate_up, h, D, gu, T, nth))) break;
        if (dm->act == ACT_GELU_TANH)
            llmd_gelu_mul(gu, 2 * I, act, I, T, I);
        else
            llmd_silu_mul(gu, 2 * I, act, I, T, I);
        if ((rc = linear(&L->down, act, I, y, T, nth))) break;
        if (L->mlp_out_norm) llmd_rms_norm(y, D, L->mlp_out_norm, y, D, T, D, dm->eps);
        add_rows(x, y, T * D);
    }
    free(buf);
    return rc;
}
