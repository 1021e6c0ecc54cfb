/* The functions that the matmul files (cpu_tiles.h lists them), cpu_moe.c, cpu_ops.c and cpu_recurrent.c export, for
 * cpu_stack.c to call within the same library and for the ctypes bindings. */
#ifndef LLMD_CPU_KERNELS_H
#define LLMD_CPU_KERNELS_H
#include <stdint.h>

int llmd_int8_matmul(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y, int64_t ldy, int64_t m,
                     int64_t n, int64_t k, int64_t g, int nthreads);
int llmd_int4_matmul(const float *x, int64_t ldx, const uint8_t *q, const float *s, const float *z, float *y,
                     int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t g, int nthreads);
int64_t llmd_q8_work_bytes(int64_t m, int64_t k, int64_t g);
int llmd_int8_matmul_q8(const float *x, int64_t ldx, const int8_t *q, const float *s, float *y, int64_t ldy,
                        int64_t m, int64_t n, int64_t k, int64_t g, void *work, int nthreads);
int llmd_int4_matmul_q8(const float *x, int64_t ldx, const uint8_t *q, const float *s, const float *z, float *y,
                        int64_t ldy, int64_t m, int64_t n, int64_t k, int64_t g, void *work, int nthreads);

/* GGUF blocks (cpu_gguf.c): `type` is the GGML type id; a part is one projection's blocks [n, K / elems * bytes]. */
typedef struct {
    int64_t type, n;
    const uint8_t *q;
} llmd_gguf_part;
int llmd_gguf_matmul(int type, const float *x, int64_t ldx, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                     int64_t n, int64_t k, int nthreads);
int llmd_gguf_parts_matmul(const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                           int64_t ldy, int64_t m, int64_t k, int nthreads);
/* the same with int8-quantized activations and integer dot products (cpu_gguf.c: the integer path) */
int llmd_gguf_matmul_q8(int type, const float *x, int64_t ldx, const uint8_t *q, float *y, int64_t ldy, int64_t m,
                        int64_t n, int64_t k, int nthreads);
int llmd_gguf_parts_matmul_q8(const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                              int64_t ldy, int64_t m, int64_t k, int nthreads);
/* and with int16-quantized activations (cpu_head.c: output heads and Q4_1 layers) */
int llmd_gguf_parts_matmul_q16(const llmd_gguf_part *parts, int64_t nparts, const float *x, int64_t ldx, float *y,
                               int64_t ldy, int64_t m, int64_t k, int nthreads);

/* A mixture-of-experts layer's packed experts (cpu_moe.c): gate_up [experts][gate_up_parts] (each expert's gate rows
 * then up rows, 2 * inter columns over K = hidden; the up rows alone, inter columns, for LLMD_MOE_RELU2) and down
 * [experts][down_parts] (hidden columns over K = inter), the same types and row counts in every expert; act:
 * LLMD_ACT_* of cpu_gguf.h (0 fp32, 1 int8, 2 int16); biases (or NULL) fp32 [experts][gate_up columns] and
 * [experts][hidden]; activation: LLMD_MOE_* (alpha, limit: the clamped one's). */
enum { LLMD_MOE_SILU = 0, LLMD_MOE_SWIGLU_CLAMPED = 1, LLMD_MOE_GELU = 2, LLMD_MOE_RELU2 = 3 };
typedef struct {
    int64_t experts, hidden, inter, gate_up_parts, down_parts;
    const llmd_gguf_part *gate_up, *down;
    int64_t gate_up_act, down_act;
    const float *gate_up_bias, *down_bias;
    int64_t activation;
    float alpha, limit;
} llmd_moe;
int llmd_moe_experts(const llmd_moe *moe, const float *x, int64_t ldx, int64_t T, int64_t k, const int64_t *ids,
                     const float *weights, float *out, int64_t ldo, int64_t *hits, int nthreads);

int llmd_rms_norm(const float *x, int64_t ldx, const float *w, float *y, int64_t ldy, int64_t rows, int64_t n,
                  float eps);
int llmd_rope(float *x, int64_t ldx, const float *cos, const float *ssin, int64_t rows, int64_t heads, int64_t d);
int llmd_silu_mul(const float *g, int64_t ldg, float *y, int64_t ldy, int64_t rows, int64_t n);
int llmd_gelu_mul(const float *g, int64_t ldg, float *y, int64_t ldy, int64_t rows, int64_t n);
int llmd_gelu_mul2(const float *g, int64_t ldg, const float *u, int64_t ldu, float *y, int64_t ldy, int64_t rows,
                   int64_t n);
int llmd_swiglu_clamped_mul(const float *g, int64_t ldg, float *y, int64_t ldy, int64_t rows, int64_t n, float alpha,
                            float limit);
int llmd_argmax_rows(const float *x, int64_t ldx, int64_t rows, int64_t n, int64_t *out);
/* one layer's paged KV cache: K and V [num_blocks, block_size, kv_heads, d] of `dtype` (KV_*); with KV_I8 also an
 * fp32 scale per (slot, KV head) for each, k_scale and v_scale [num_blocks, block_size, kv_heads] */
enum { KV_F32 = 0, KV_F16 = 1, KV_BF16 = 2, KV_I8 = 3 };
typedef struct {
    int64_t dtype, num_blocks, block_size, kv_heads, d;
    void *k, *v;
    float *k_scale, *v_scale;
} llmd_kv;

int llmd_write_kv(const float *k, int64_t ldk, const float *v, int64_t ldv, const int64_t *slots, int64_t rows,
                  const llmd_kv *kv);
int llmd_decode_attention(const float *q, int64_t ldq, const int64_t *rows, int64_t B, int64_t num_rows,
                          const llmd_kv *kv, const int64_t *block_tables, int64_t bt_stride, const int64_t *seq_lens,
                          int64_t heads, float scale, int64_t window, float softcap, const float *sinks, float *out,
                          int64_t ldo, int threads);
int llmd_prefill_attention(const float *q, int64_t ldq, int64_t q_len, int64_t ctx, const llmd_kv *kv,
                           const int64_t *table, int64_t table_len, int64_t heads, float scale, int64_t window,
                           float softcap, const float *sinks, float *out, int64_t ldo, int threads);
/* The recurrent layers of hybrid models (cpu_recurrent.c). A step's batch: `seqs` sequences over `tokens` rows,
 * sequence b's rows starts[b] .. starts[b + 1] - 1, its state at slot slots[b] of num_slots, or zero where fresh[b]
 * (its first chunk). */
typedef struct {
    int64_t seqs, num_slots, tokens;
    const int64_t *slots, *starts;
    const uint8_t *fresh;
} llmd_state_batch;
/* x [tokens, C] (row stride ldx), w [C, K], bias [C] or NULL, state [num_slots, C, K - 1]; out [tokens, C] */
int llmd_causal_conv1d(const float *x, int64_t ldx, int64_t C, const float *w, int64_t K, const float *bias,
                       float *state, const llmd_state_batch *sb, int silu, float *out, int64_t ldo, int nthreads);
/* q, k [tokens][hk heads][dk], v [tokens][hv heads][dv] (each with its row stride), g (log decay) and beta
 * [tokens][hv] (row strides ldg, ldb); state [num_slots, hv, dk, dv]; out [tokens][hv][dv] (row stride ldo) */
typedef struct {
    const float *q, *k, *v, *g, *beta;
    int64_t ldq, ldk, ldv, ldg, ldb;
    int64_t hk, hv, dk, dv;
    float scale;
} llmd_delta_rule;
int llmd_gated_delta_rule(const llmd_delta_rule *r, float *state, const llmd_state_batch *sb, float *out,
                          int64_t ldo, int nthreads);
/* Mamba2: x [tokens][h heads][p], dt [tokens][h] (before dt_bias), B and C [tokens][g groups][n] (each with its row
 * stride; group i serves heads i h / g ..); dt_bias, A (negative) and D [h]; dt clamped to [dt_min, dt_max];
 * state [num_slots, h, p, n]; out [tokens][h][p] (row stride ldo) */
typedef struct {
    const float *x, *dt, *B, *C, *dt_bias, *A, *D;
    int64_t ldx, lddt, ldb, ldc;
    int64_t h, g, p, n;
    float dt_min, dt_max;
} llmd_mamba2;
int llmd_mamba2_scan(const llmd_mamba2 *m, float *state, const llmd_state_batch *sb, float *out, int64_t ldo,
                     int nthreads);
#endif
