/* A run of decoder layers over decode rows (one token per request) as one call (kernels/
   cpu_decode_stack.py): the same kernels as the separate calls, inside one OpenMP region, the ops
   separated by barriers and the buffers allocated once per call, instead of ~200 wrapped calls a step.

       per layer   pack(RMSNorm(h += mlp_out)) . W_qkv      gemm_pack_x + gemm_run (panel_gemm.c)
                   RoPE on q (and k), k and v to the cache   (layers that write the KV cache only)
                   decode attention over the paged cache     decode_attention_items (decode_attention.c)
                   attn . W_o;  pack(RMSNorm(h += o)) . W_gate_up;  pack(silu(gate) * up) . W_down
       at the end  h += mlp_out

   Every op is the same code on the same rows in the same order as the separate kernels', so the result
   is bit-identical to theirs. Every layer's linears are panel GEMM layouts. Inputs are checked before
   any work; a bad one returns its status with nothing written, h included.
   Build defines: decode_attention.c's (HEAD_DIM, GROUP, KV_BF16). */
#include "panel_gemm.c"
#include "decode_attention.c"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

struct stack_linear {
    const void *packed;   /* the panel GEMM's layout of W: (ceil(N / 16), K, 16) fp32 or 4-bit blocks */
    const float *bias;    /* (N,) or NULL */
    int64_t N, K;
    int64_t format;       /* PANEL_*: the panel GEMM's formats */
};

struct stack_layer {
    const float *input_norm, *post_norm;  /* (H,) */
    struct stack_linear qkv, o, gate_up, down;
    int64_t kv_slot;    /* its K at kv_cache + kv_slot * slot_stride, its V kv_stride further */
    int64_t window;     /* <= 0: none */
    int64_t group;      /* its kvcache group: the step's tables groups[group] */
    int64_t writes_kv;  /* qkv = [q | k | v]: RoPE on q and k, k and v written; else qkv = q */
};

struct stack_group {
    const int32_t *seq_lens;      /* (T,): context after this step, the query at seq_lens[t] - 1 */
    const int32_t *block_tables;  /* (T, >= max_blocks), rows bt_stride apart */
    int64_t bt_stride, max_blocks;
    const int64_t *slots;         /* (T,): where token t's K/V go (-1: nowhere); NULL if not written */
};

struct stack_step {
    float *h;                    /* (T, H) contiguous: the residual stream, updated in place */
    int64_t T, H;
    const int64_t *positions;    /* (T,) */
    const float *cos, *sin;      /* (max_pos, HEAD_DIM / 2) */
    int64_t max_pos;
    int64_t num_heads, kv_heads;
    kv_t *kv_cache;              /* slot s, K: kv_cache + s * slot_stride: (num_blocks, bs, kv_heads,
                                    HEAD_DIM) with blocks block_stride apart and dense rows; fp32, or
                                    bf16 with KV_BF16 */
    int64_t slot_stride, kv_stride, block_stride, num_blocks, bs;
    float eps, scale;
    double *timings;             /* NULL, or (3,): seconds added per phase (STACK_TIMED_*), wall time */
};

/* Phases timed when st->timings is given: by the region's thread 0 between the barriers that end each
   phase (every worksharing loop here ends with one), so each is the phase's wall time. */
#define STACK_TIMED_LINEAR 0     /* the four GEMMs with the ops packed in front of them */
#define STACK_TIMED_ATTENTION 1  /* decode attention over the paged cache */
#define STACK_TIMED_ROPE_KV 2    /* RoPE on q (and k), k and v written to the cache */
#ifdef _OPENMP
int omp_get_thread_num(void);
#define STACK_THREAD0 (omp_get_thread_num() == 0)
#else
#define STACK_THREAD0 1
#endif
#include <time.h>
static inline double stack_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
/* Adds the time since the last lap to phase i (no-op when not timed). */
#define STACK_LAP(i)                                    \
    if (timed) {                                        \
        const double now = stack_clock();               \
        st->timings[i] += now - lap;                    \
        lap = now;                                      \
    }

/* The first position a layer reads of a request with n positions */
static inline int64_t first_read(int64_t n, int64_t window) {
    return window > 0 && n > window ? n - window : 0;
}

/* 0, or what is wrong (nothing is written then): SWIFTKV_BAD_POSITION, SWIFTKV_BAD_LENGTH,
   SWIFTKV_BAD_BLOCK or SWIFTKV_BAD_SLOT */
static int check_step(const struct stack_step *st, const struct stack_layer *layers, int64_t n_layers,
                      const struct stack_group *groups) {
    for (int64_t t = 0; t < st->T; t++)
        if (st->positions[t] < 0 || st->positions[t] >= st->max_pos) return SWIFTKV_BAD_POSITION;
    for (int64_t l = 0; l < n_layers; l++) {
        const struct stack_group *g = groups + layers[l].group;
        for (int64_t t = 0; t < st->T; t++) {
            const int64_t n = g->seq_lens[t];
            if (n > g->max_blocks * st->bs) return SWIFTKV_BAD_LENGTH;
            const int32_t *bt = g->block_tables + t * g->bt_stride;
            for (int64_t b = first_read(n, layers[l].window) / st->bs; b * st->bs < n; b++)
                if (bt[b] < 0 || bt[b] >= st->num_blocks) return SWIFTKV_BAD_BLOCK;
            if (layers[l].writes_kv && (g->slots == NULL || g->slots[t] >= st->num_blocks * st->bs)) return SWIFTKV_BAD_SLOT;
        }
    }
    return 0;
}

/* The layers in order over the step's T rows, then h += the last layer's MLP output. Returns 0;
   SWIFTKV_NO_MEMORY; check_step's codes for a bad input (both with nothing written). */
int swiftkv_decode_stack(const struct stack_step *st, const struct stack_layer *layers, int64_t n_layers,
                         const struct stack_group *groups, int num_threads) {
    const int64_t T = st->T, H = st->H, q_width = st->num_heads * HEAD_DIM;
    const int64_t kv_row = st->kv_heads * HEAD_DIM;
    if (T == 0 || n_layers == 0) return 0;
    const int bad = check_step(st, layers, n_layers, groups);
    if (bad) return bad;
    int64_t max_k = 0, max_qkv = 0, max_gu = 0;
    for (int64_t l = 0; l < n_layers; l++) {
        const struct stack_layer *ly = layers + l;
        const int64_t ks[4] = {ly->qkv.K, ly->o.K, ly->gate_up.K, ly->down.K};
        for (int i = 0; i < 4; i++) max_k = ks[i] > max_k ? ks[i] : max_k;
        max_qkv = ly->qkv.N > max_qkv ? ly->qkv.N : max_qkv;
        max_gu = ly->gate_up.N > max_gu ? ly->gate_up.N : max_gu;
    }
    const int64_t xp_n = gemm_xp_floats(T, max_k);
    float *buf = malloc(sizeof(float) * (xp_n + T * (max_qkv + q_width + 2 * H + max_gu)));
    if (buf == NULL) return SWIFTKV_NO_MEMORY;
    float *xp = buf, *qkv = xp + xp_n, *attn = qkv + T * max_qkv, *o = attn + T * q_width;
    float *gu = o + T * H, *mlp = gu + T * max_gu;
    const struct gemm_rows rows = gemm_rows(T);
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
    const int timed = st->timings != NULL && STACK_THREAD0;
    double lap = timed ? stack_clock() : 0.0;
    for (int64_t l = 0; l < n_layers; l++) {
        const struct stack_layer *ly = layers + l;
        const struct stack_group *g = groups + ly->group;
        kv_t *k_cache = st->kv_cache + ly->kv_slot * st->slot_stride, *v_cache = k_cache + st->kv_stride;
        const int64_t nqkv = ly->qkv.N;
        gemm_pack_x(st->h, H, H, rows, PROLOGUE_RMS_NORM, l ? mlp : NULL, H, ly->input_norm, st->eps,
                    xp, (int)ly->qkv.format);
        gemm_run(xp, ly->qkv.packed, (int)ly->qkv.format, ly->qkv.bias, qkv, nqkv, H, rows);
        STACK_LAP(STACK_TIMED_LINEAR)
        #pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *row = qkv + t * nqkv;
            const int64_t p = st->positions[t] * (HEAD_DIM / 2);
            swiftkv_rope_row(row, st->num_heads + (ly->writes_kv ? st->kv_heads : 0), HEAD_DIM, st->cos + p,
                             st->sin + p);
            const int64_t s = ly->writes_kv ? g->slots[t] : -1;
            if (s >= 0) {
                kv_t *kc = k_cache + s / st->bs * st->block_stride + s % st->bs * kv_row;
                swiftkv_kv_store(kc, row + q_width, kv_row);
                swiftkv_kv_store(kc + st->kv_stride, row + q_width + kv_row, kv_row);
            }
        }
        STACK_LAP(STACK_TIMED_ROPE_KV)
        decode_attention_items(qkv, nqkv, k_cache, v_cache, st->block_stride, st->num_blocks, g->block_tables,
                               g->bt_stride, g->max_blocks, g->seq_lens, attn, T, st->kv_heads, st->bs,
                               ly->window, st->scale, num_threads, &failed);
        STACK_LAP(STACK_TIMED_ATTENTION)
        gemm_pack_x(attn, q_width, q_width, rows, PROLOGUE_NONE, NULL, 0, NULL, 0.f,
                    xp, (int)ly->o.format);
        gemm_run(xp, ly->o.packed, (int)ly->o.format, ly->o.bias, o, H, q_width, rows);
        gemm_pack_x(st->h, H, H, rows, PROLOGUE_RMS_NORM, o, H, ly->post_norm, st->eps,
                    xp, (int)ly->gate_up.format);
        gemm_run(xp, ly->gate_up.packed, (int)ly->gate_up.format, ly->gate_up.bias, gu, ly->gate_up.N, H,
                 rows);
        gemm_pack_x(gu, ly->gate_up.N, ly->down.K, rows, PROLOGUE_SILU_MUL, NULL, 0, NULL, 0.f,
                    xp, (int)ly->down.format);
        gemm_run(xp, ly->down.packed, (int)ly->down.format, ly->down.bias, mlp, H, ly->down.K, rows);
        STACK_LAP(STACK_TIMED_LINEAR)
    }
    }
    for (int64_t i = 0; i < T * H; i++) st->h[i] += mlp[i];
    free(buf);
    return failed;
}
