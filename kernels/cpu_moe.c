/* A mixture-of-experts layer's experts for one step in one call (llama.cpp's mul_mat_id), on packed GGUF experts:
 *   out[t] = sum over the slots j of token t, in slot order, of weights[t, j] * down_e(act(gate_e(x_t), up_e(x_t))),
 *   e = ids[t, j], act silu(gate) * up or gpt-oss's clamped SwiGLU (llmd_swiglu_clamped_mul), each projection
 *   optionally biased per expert (its output row + bias[e], as the Python path adds it); or, ungated (Nemotron-H's
 *   LLMD_MOE_RELU2), down_e(relu(up_e(x_t))^2), the gate_up parts then holding the up rows alone.
 * The step's (token, slot) pairs are sorted by expert (a stable counting sort), so expert e's pairs are consecutive
 * rows and its weights are read once for all of them: at decode only the chosen experts' rows are read, at prefill each
 * expert's tokens are one matmul over its rows (the GGUF tiles of cpu_gguf.c and the type files, chosen by that
 * expert's row count). One parallel region runs the phases, separated by barriers:
 *   1. each token's activations prepared once for the gate_up path (quantized on the int8 / int16 paths), copied to
 *      its pairs, and each expert's group of rows made;
 *   2. every (expert, part)'s gate_up columns shared out among the threads (llmd_gx_run);
 *   3. per pair, its expert's gate_up bias added, the activation (llmd_silu_mul, llmd_gelu_mul or
 *      llmd_swiglu_clamped_mul, cpu_ops.c; relu(v)^2 as v > 0 ? v * v : 0, torch's relu(v).square()),
 *      prepared for the down path; the groups made;
 *   4. down, as 2;
 *   5. per token, its k outputs plus their experts' down biases, times their weights, summed in slot order.
 * Exactness: a row's output is llmd_gguf_parts_matmul(_q8, _q16)'s for that row alone (cpu_gguf.h), a bias is one
 * rounded addition per value, the activations go row by row (the ops the Python path calls), and the sum takes the
 * slots in order with one rounding per product and per addition (-ffp-contract=off), as
 * torch's `out = out + slots[:, j] * w[:, j]` does: the Python grouping's very bits (llmd.model.moe.Experts), whatever
 * the step's other tokens, the thread count or the order the experts run in. */
#include <stdlib.h>
#include <string.h>

#include "cpu_gguf.h"
#include "cpu_kernels.h"

#define MAX_PARTS 8 /* parts per projection (gate and up: 2) */

/* the call's buffers (at most 8 + 2 * (6 + 2 * MAX_PARTS + 1) + 1), freed together */
typedef struct {
    void *p[64];
    int n, failed;
} arena;

static void *take(arena *a, size_t bytes) {
    void *p = a->n < 64 ? aligned_alloc(64, (bytes + 63) / 64 * 64 + 64) : NULL;
    if (!p) a->failed = 1;
    else a->p[a->n++] = p;
    return p;
}

static void release(arena *a) {
    for (int i = 0; i < a->n; i++) free(a->p[i]);
}

/* the parts of one projection: the same type and row count in every expert, taken by the path for K, n columns */
static int check_parts(const llmd_gguf_part *parts, int64_t experts, int64_t np, int act, int64_t k, int64_t n) {
    if (np <= 0 || np > MAX_PARTS) return -1;
    int64_t cols = 0;
    for (int64_t i = 0; i < np; i++) {
        if (!llmd_gx_takes(act, (int)parts[i].type, k) || parts[i].n <= 0) return -1;
        cols += parts[i].n;
        for (int64_t e = 1; e < experts; e++)
            if (parts[e * np + i].type != parts[i].type || parts[e * np + i].n != parts[i].n) return -1;
    }
    return cols == n ? 0 : -1;
}

/* One projection over the sorted pairs: the pairs' rows per layout (and the tokens' for gate_up), each active expert's
 * group and jobs (writing y [P, n] in pair order), the group extras and the scratch a thread needs. */
typedef struct {
    int act, flags;
    int64_t np, k;
    const llmd_gguf_part *parts;
    int64_t *layout;         /* [np]: the part whose rows serve part i */
    llmd_gx_rows *tok, *pair; /* [np], where layout[i] == i */
    llmd_gx_group *groups;   /* [active][np] */
    llmd_gx_job *jobs;       /* [active][np] */
    char *extra;             /* the groups' extras, group [x][i] at extra_at[x * np + i] */
    size_t *extra_at;
    size_t scratch;          /* bytes a thread needs for any of the jobs */
} proj;

/* the columns of an expert's gate_up output: gate then up, or up alone */
static int64_t gate_up_width(const llmd_moe *moe) {
    return moe->activation == LLMD_MOE_RELU2 ? moe->inter : 2 * moe->inter;
}

static void plan_proj(proj *p, arena *a, const llmd_moe *moe, int gate_up, int64_t T, int64_t P, int64_t A,
                      const int64_t *active, const int64_t *start, float *y) {
    p->act = (int)(gate_up ? moe->gate_up_act : moe->down_act);
    p->np = gate_up ? moe->gate_up_parts : moe->down_parts;
    p->k = gate_up ? moe->hidden : moe->inter;
    p->parts = gate_up ? moe->gate_up : moe->down;
    const int64_t np = p->np, ldy = gate_up ? gate_up_width(moe) : moe->hidden;
    p->flags = 0;
    for (int64_t i = 0; i < np; i++) p->flags |= llmd_gx_flags(p->act, (int)p->parts[i].type);
    p->layout = (int64_t *)take(a, (size_t)np * sizeof(int64_t));
    p->tok = (llmd_gx_rows *)take(a, (size_t)np * sizeof(llmd_gx_rows));
    p->pair = (llmd_gx_rows *)take(a, (size_t)np * sizeof(llmd_gx_rows));
    p->groups = (llmd_gx_group *)take(a, (size_t)(A * np) * sizeof(llmd_gx_group));
    p->jobs = (llmd_gx_job *)take(a, (size_t)(A * np) * sizeof(llmd_gx_job));
    p->extra_at = (size_t *)take(a, (size_t)(A * np) * sizeof(size_t));
    if (a->failed) return;
    for (int64_t i = 0; i < np; i++) {
        const int type = (int)p->parts[i].type;
        p->layout[i] = llmd_gx_layout_of(p->act, p->parts, i);
        if (p->layout[i] != i) continue;
        void *tok = T ? take(a, llmd_gx_bytes(p->act, type, p->flags, p->k, T)) : NULL;
        void *pair = take(a, llmd_gx_bytes(p->act, type, p->flags, p->k, P));
        if (a->failed) return;
        if (tok) llmd_gx_place(&p->tok[i], p->act, type, p->flags, p->k, T, tok);
        llmd_gx_place(&p->pair[i], p->act, type, p->flags, p->k, P, pair);
    }
    size_t extras = 0;
    p->scratch = 0;
    for (int64_t x = 0; x < A; x++) {
        const int64_t e = active[x], m = start[e + 1] - start[e];
        int64_t col = 0;
        for (int64_t i = 0; i < np; i++) {
            const llmd_gguf_part *part = &p->parts[e * np + i];
            const size_t s = llmd_gx_scratch_bytes(p->act, (int)part->type, p->k, m);
            p->scratch = s > p->scratch ? s : p->scratch;
            if (p->layout[i] == i) p->extra_at[x * np + i] = extras, extras += llmd_gx_group_bytes(&p->pair[i], m);
            const llmd_gx_job job = {&p->groups[x * np + p->layout[i]], part->type, part->n, ldy, part->q,
                                     y + start[e] * ldy + col};
            p->jobs[x * np + i] = job;
            col += part->n;
        }
    }
    p->extra = (char *)take(a, extras);
}

/* expert active[x]'s groups of pair rows (a thread's share of the experts) */
static void make_groups(const proj *p, int64_t x, const int64_t *active, const int64_t *start) {
    const int64_t e = active[x];
    for (int64_t i = 0; i < p->np; i++)
        if (p->layout[i] == i)
            llmd_gx_make_group(&p->groups[x * p->np + i], &p->pair[i], start[e], start[e + 1] - start[e],
                               p->extra + p->extra_at[x * p->np + i]);
}

/* out [T, hidden] (row stride ldo) for x [T, hidden] (row stride ldx) and each token's experts ids [T, k] with their
 * weights [T, k]; hits [experts] (or NULL) gains each expert's pairs. -1 for a bad argument (an id out of range, parts
 * that do not fit the shapes, a type the path does not take), -2 out of memory. */
int llmd_moe_experts(const llmd_moe *moe, const float *x, int64_t ldx, int64_t T, int64_t k, const int64_t *ids,
                     const float *weights, float *out, int64_t ldo, int64_t *hits, int nthreads) {
    const int64_t E = moe->experts, H = moe->hidden, I = moe->inter;
    if (E <= 0 || H <= 0 || I <= 0 || T < 0 || k <= 0 || k > E) return -1;
    if (moe->activation != LLMD_MOE_SILU && moe->activation != LLMD_MOE_SWIGLU_CLAMPED
        && moe->activation != LLMD_MOE_GELU && moe->activation != LLMD_MOE_RELU2) return -1;
    const int64_t G = gate_up_width(moe);
    if (check_parts(moe->gate_up, E, moe->gate_up_parts, (int)moe->gate_up_act, H, G) ||
        check_parts(moe->down, E, moe->down_parts, (int)moe->down_act, I, H))
        return -1;
    const int64_t P = T * k;
    for (int64_t p = 0; p < P; p++)
        if (ids[p] < 0 || ids[p] >= E) return -1;
    if (T == 0) return 0;
    if (nthreads < 1) nthreads = 1;

    arena a = {{0}, 0, 0};
    int64_t *start = (int64_t *)take(&a, (size_t)(E + 1) * sizeof(int64_t));
    int64_t *next = (int64_t *)take(&a, (size_t)E * sizeof(int64_t));
    int64_t *order = (int64_t *)take(&a, (size_t)P * sizeof(int64_t)); /* sorted row -> pair */
    int64_t *pos = (int64_t *)take(&a, (size_t)P * sizeof(int64_t));   /* pair -> sorted row */
    int64_t *active = (int64_t *)take(&a, (size_t)E * sizeof(int64_t));
    float *gu_out = (float *)take(&a, (size_t)(P * G) * sizeof(float));
    float *down_out = (float *)take(&a, (size_t)(P * H) * sizeof(float));
    const int64_t ldh = (I + 15) / 16 * 16;
    float *hidden = (float *)take(&a, (size_t)(nthreads * ldh) * sizeof(float)); /* a thread's activation row */
    if (a.failed) {
        release(&a);
        return -2;
    }
    /* the pairs sorted by expert, in pair order within each */
    memset(start, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t p = 0; p < P; p++) start[ids[p] + 1]++;
    int64_t A = 0;
    for (int64_t e = 0; e < E; e++) {
        if (hits) hits[e] += start[e + 1];
        if (start[e + 1]) active[A++] = e;
        start[e + 1] += start[e];
        next[e] = start[e];
    }
    for (int64_t p = 0; p < P; p++) {
        pos[p] = next[ids[p]]++;
        order[pos[p]] = p;
    }
    proj gu, dn;
    plan_proj(&gu, &a, moe, 1, T, P, A, active, start, gu_out);
    if (!a.failed) plan_proj(&dn, &a, moe, 0, 0, P, A, active, start, down_out);
    const size_t sb = a.failed ? 0 : (gu.scratch > dn.scratch ? gu.scratch : dn.scratch);
    char *scratch = a.failed ? NULL : (char *)take(&a, sb * (size_t)nthreads);
    if (a.failed) {
        release(&a);
        return -2;
    }

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        int tid, nth;
        llmd_thread_id(&tid, &nth);
        /* 1. the tokens' rows, once each, then copied to their pairs */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++)
            for (int64_t i = 0; i < gu.np; i++)
                if (gu.layout[i] == i) llmd_gx_prepare(&gu.tok[i], t, x + t * ldx);
#pragma omp for schedule(static)
        for (int64_t s = 0; s < P; s++)
            for (int64_t i = 0; i < gu.np; i++)
                if (gu.layout[i] == i) llmd_gx_copy(&gu.pair[i], s, &gu.tok[i], order[s] / k);
#pragma omp for schedule(dynamic)
        for (int64_t e = 0; e < A; e++) make_groups(&gu, e, active, start);
        /* 2. gate_up */
        llmd_gx_run(gu.jobs, A * gu.np, nth, scratch + sb * (size_t)tid);
#pragma omp barrier
        /* 3. the bias, the activation, prepared for down */
        float *h = hidden + ldh * tid;
#pragma omp for schedule(static)
        for (int64_t s = 0; s < P; s++) {
            float *g = gu_out + s * G;
            if (moe->gate_up_bias) {
                const float *b = moe->gate_up_bias + ids[order[s]] * G;
                for (int64_t c = 0; c < G; c++) g[c] = g[c] + b[c];
            }
            if (moe->activation == LLMD_MOE_RELU2)
                for (int64_t c = 0; c < I; c++) h[c] = g[c] > 0.0f ? g[c] * g[c] : 0.0f;
            else if (moe->activation == LLMD_MOE_SILU) llmd_silu_mul(g, 2 * I, h, I, 1, I);
            else if (moe->activation == LLMD_MOE_GELU) llmd_gelu_mul(g, 2 * I, h, I, 1, I);
            else llmd_swiglu_clamped_mul(g, 2 * I, h, I, 1, I, moe->alpha, moe->limit);
            for (int64_t i = 0; i < dn.np; i++)
                if (dn.layout[i] == i) llmd_gx_prepare(&dn.pair[i], s, h);
        }
#pragma omp for schedule(dynamic)
        for (int64_t e = 0; e < A; e++) make_groups(&dn, e, active, start);
        /* 4. down */
        llmd_gx_run(dn.jobs, A * dn.np, nth, scratch + sb * (size_t)tid);
#pragma omp barrier
        /* 5. the biases, then the weighted sum in slot order */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * ldo;
            for (int64_t j = 0; moe->down_bias && j < k; j++) {
                float *y = down_out + pos[t * k + j] * H;
                const float *b = moe->down_bias + ids[t * k + j] * H;
                for (int64_t c = 0; c < H; c++) y[c] = y[c] + b[c];
            }
            const float *y0 = down_out + pos[t * k] * H;
            const float w0 = weights[t * k];
            for (int64_t c = 0; c < H; c++) o[c] = y0[c] * w0;
            for (int64_t j = 1; j < k; j++) {
                const float *y = down_out + pos[t * k + j] * H;
                const float w = weights[t * k + j];
                for (int64_t c = 0; c < H; c++) o[c] = o[c] + y[c] * w;
            }
        }
    }
    release(&a);
    return 0;
}
