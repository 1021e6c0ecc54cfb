/* The GGUF matmuls of cpu_gguf.c in their steps, for a kernel that runs many weights' matmuls in one parallel region
 * (cpu_moe.c: a mixture-of-experts layer): activation rows prepared once for an activation path, a group of consecutive
 * rows taken as one matmul's input, and a range of one weight's output columns computed for a group. Every output
 * gets the very operations of llmd_gguf_parts_matmul(_q8, _q16), whatever the rows' grouping, the column range or the
 * thread: those entries are these steps. Internal to the library (hidden symbols). */
#ifndef LLMD_CPU_GGUF_H
#define LLMD_CPU_GGUF_H
#include <stddef.h>
#include <stdint.h>

#include "cpu_kernels.h"

#define LLMD_HIDDEN __attribute__((visibility("hidden")))

/* llmd's own type ids of the blocks of 32, the K-quants and the IQ4s with 8 columns interleaved (cpu_interleaved.c):
 * the int8 path (Q6_K_X8, Q4_1_X8 and Q8_0_X8 the int16 one too: output heads, Q4_1 layers), N % 8 == 0, K a
 * multiple of LLMD_X8_ELEMS */
#define LLMD_Q40_X8 1002
#define LLMD_Q41_X8 1003
#define LLMD_Q50_X8 1006
#define LLMD_Q51_X8 1007
#define LLMD_Q80_X8 1008
#define LLMD_Q2K_X8 1010
#define LLMD_Q3K_X8 1011
#define LLMD_Q4K_X8 1012
#define LLMD_Q5K_X8 1013
#define LLMD_Q6K_X8 1014
#define LLMD_IQ4NL_X8 1020
#define LLMD_IQ4XS_X8 1023
#define LLMD_X8(type)                                                                                                  \
    (LLMD_X8_ELEMS(type) == 32 || (type) == LLMD_Q2K_X8 || (type) == LLMD_Q3K_X8 || (type) == LLMD_Q4K_X8 ||         \
     (type) == LLMD_Q5K_X8 || (type) == LLMD_Q6K_X8 || (type) == LLMD_IQ4XS_X8)
#define LLMD_X8_ELEMS(type) /* elements per block: 32 for the interleaved blocks of 32 */                          \
    ((type) == LLMD_Q40_X8 || (type) == LLMD_Q41_X8 || (type) == LLMD_Q50_X8 || (type) == LLMD_Q51_X8 ||             \
             (type) == LLMD_Q80_X8 || (type) == LLMD_IQ4NL_X8                                                        \
         ? 32                                                                                                        \
         : 256)

/* activation paths: fp32 (the weights' exact values), int8 and int16 per block of 32 (cpu_act.c) */
enum { LLMD_ACT_F32 = 0, LLMD_ACT_I8 = 1, LLMD_ACT_I16 = 2 };
/* what the row data must hold for a type (llmd_gx_flags): int8's C, a lane layout per group (int8's signed blocks,
 * int16's Q4_1), int16's sums of 16, a one-row group's broadcast copy (the interleaved types, vector builds) */
enum { LLMD_GX_C = 1, LLMD_GX_LANES = 2, LLMD_GX_SUMS = 4, LLMD_GX_BROADCAST = 8 };

/* Prepared activation rows of one path, as arrays of rows: row r of array i at a[i] + r * row[i] (cpu_gguf.c names
 * the arrays per path). fp32 rows are laid out for one GGML type (`type`); int8 and int16 rows serve every type. */
typedef struct {
    int act, type, flags;
    int64_t k;
    char *a[4];
    size_t row[4];
} llmd_gx_rows;

/* m consecutive rows as one matmul's input, with what such a matmul adds (`extra`: int8's lane layout, fp32's rows
 * transposed into the vector lanes) */
typedef struct {
    llmd_gx_rows x; /* moved to the group's first row */
    int64_t m;
    void *extra;
} llmd_gx_group;

/* one weight's columns for a group: y [m, n] (row stride ldy) = group @ dequant(q [n, row bytes] of `type`).T */
typedef struct {
    const llmd_gx_group *g;
    int64_t type, n, ldy;
    const uint8_t *q;
    float *y;
} llmd_gx_job;

/* 1 where the int16 path takes blocks of `type` (cpu_head.c; exported) */
int llmd_gguf_q16_type(int type);
/* 1 where path `act` takes blocks of `type` for this K */
LLMD_HIDDEN int llmd_gx_takes(int act, int type, int64_t k);
/* LLMD_GX_* that rows for blocks of `type` need on path `act` */
LLMD_HIDDEN int llmd_gx_flags(int act, int type);
/* bytes of `rows` rows, and laying them out in buf (64-byte aligned) */
LLMD_HIDDEN size_t llmd_gx_bytes(int act, int type, int flags, int64_t k, int64_t rows);
LLMD_HIDDEN void llmd_gx_place(llmd_gx_rows *r, int act, int type, int flags, int64_t k, int64_t rows, void *buf);
/* row `row` from x [k] (plain C: the same bits in every build), or copied from another set's row */
LLMD_HIDDEN void llmd_gx_prepare(const llmd_gx_rows *r, int64_t row, const float *x);
LLMD_HIDDEN void llmd_gx_copy(const llmd_gx_rows *dst, int64_t to, const llmd_gx_rows *src, int64_t from);
/* the group of rows [r0, r0 + m), its extra (llmd_gx_group_bytes, 64-byte aligned) filled */
LLMD_HIDDEN size_t llmd_gx_group_bytes(const llmd_gx_rows *r, int64_t m);
LLMD_HIDDEN void llmd_gx_make_group(llmd_gx_group *g, const llmd_gx_rows *r, int64_t r0, int64_t m, void *extra);
/* scratch bytes a thread needs for a job of `type` over m rows (64-byte aligned) */
LLMD_HIDDEN size_t llmd_gx_scratch_bytes(int act, int type, int64_t k, int64_t m);
/* columns [n0, n1) of one job (n0 a multiple of 8) */
LLMD_HIDDEN void llmd_gx_cols(const llmd_gx_job *job, int64_t n0, int64_t n1, void *scratch);
/* columns [n0, n1) (multiples of 8) of an interleaved weight (LLMD_X8) on the int8 path's rows, one row from its
 * broadcast copy xb where given (cpu_interleaved.c) */
LLMD_HIDDEN void llmd_x8_cols(int type, const float *xd, const float *S, const int8_t *xq, const int32_t *C,
                              const int8_t *xb, const uint8_t *q, float *y, int64_t ldy, int64_t m, int64_t k,
                              int64_t n0, int64_t n1);
/* the same on the int16 path's rows of an interleaved Q6_K, Q4_1 or Q8_0 weight (cpu_interleaved.c) */
LLMD_HIDDEN void llmd_x8_cols_q16(int type, const float *xd, const int32_t *Q, const int16_t *x, const int16_t *xb,
                                  const uint8_t *q, float *y, int64_t ldy, int64_t m, int64_t k, int64_t n0,
                                  int64_t n1);
/* the jobs' columns shared out among the nth threads of the enclosing parallel region (every thread calls it; no
 * barrier at its end): units of 8 columns, weighted by their rows */
LLMD_HIDDEN void llmd_gx_run(const llmd_gx_job *jobs, int64_t njobs, int nth, void *scratch);
/* the first of parts [0, i] whose rows serve part i on path `act` */
LLMD_HIDDEN int64_t llmd_gx_layout_of(int act, const llmd_gguf_part *parts, int64_t i);
/* this thread's number and the team's size (0 and 1 outside a parallel region) */
LLMD_HIDDEN void llmd_thread_id(int *tid, int *nth);
#endif
