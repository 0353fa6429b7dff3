"""A run of decoder layers over decode-shaped rows (one token per request) on CPU in fp32 as one C call.

A decode step of 16 requests runs 30 layers of six ops each (the qkv GEMM with its RMSNorm, RoPE and
the KV write, attention, o_proj, gate_up with its RMSNorm, down with SiLU-and-mul). As separate
kernels they are ~200 wrapped calls a step, each 15-30 us of Python, ctypes and a fresh output tensor,
while the OpenMP threads wait: on a 2-core AMD EPYC Zen 3 (perf, decode steps at L = 15) the main thread
spent ~20% of its samples outside the kernels and the worker thread ~30% waiting for it. Here the same
kernels run inside one OpenMP region, the ops separated by barriers, with their buffers allocated
once per call:

    per layer   pack(RMSNorm(h += mlp_out)) . W_qkv     kernels/cpu_gemm.py gemm_pack_x + gemm_run
                RoPE on q (and k), k and v to the cache  (first-half layers only: `writes_kv`)
                decode attention over the paged cache    kernels/cpu_decode.py decode_attention_items
                attn . W_o;  pack(RMSNorm(h += o)) . W_gate_up;  pack(silu(gate) * up) . W_down
    at the end  h += mlp_out

Every op is the same code as the separate kernels', on the same rows in the same order, so the result
is bit-identical to them (tests/test_cpu_decode_stack.py). Measured on the Zen 3 VM, issue-4 workload
(16 x 256 -> 64) at L = 15, stack and per-op alternating in one process over 6 rounds: median decode
step (TPOT) 88.0 -> 78.7 ms. Prefetching the next layer's K/V blocks while this layer's o_proj and MLP
GEMMs run (to overlap the attention's memory reads with their FMAs) made it slower (189 -> 206 ms at
640-token contexts, interleaved): the GEMMs at 16 rows read their weights from memory too.

Every layer's linears must be the panel GEMM's layouts (PanelWeight); the model calls this only where
the kernel chooser runs the panel GEMM at the step's row count for every one of them
(model/decode_stack.py).

Inputs are checked before any work (positions within the RoPE table, seq_lens within the block tables,
the block ids read, the slots written): a bad one raises ValueError with nothing written, h included.
Built at first use per (head_dim, group) by kernels/cpu_compile.py; SWIFTKV_CPU_DECODE_STACK=0 turns it
off (the model then runs the ops one by one).
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import torch

from swiftkv_fast.kernels import cpu_compile, cpu_decode, cpu_gemm

ENV_SWITCH = "SWIFTKV_CPU_DECODE_STACK"

SOURCE = (
    cpu_gemm.SOURCE
    + cpu_decode.SOURCE
    + r"""
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

/* 0, or what is wrong (nothing is written then): 4 a position outside the RoPE table, 2 a seq_len
   beyond its block table, 3 a block id read outside the cache, 5 a slot written outside the cache */
static int check_step(const struct stack_step *st, const struct stack_layer *layers, int64_t n_layers,
                      const struct stack_group *groups) {
    for (int64_t t = 0; t < st->T; t++)
        if (st->positions[t] < 0 || st->positions[t] >= st->max_pos) return 4;
    for (int64_t l = 0; l < n_layers; l++) {
        const struct stack_group *g = groups + layers[l].group;
        for (int64_t t = 0; t < st->T; t++) {
            const int64_t n = g->seq_lens[t];
            if (n > g->max_blocks * st->bs) return 2;
            const int32_t *bt = g->block_tables + t * g->bt_stride;
            for (int64_t b = first_read(n, layers[l].window) / st->bs; b * st->bs < n; b++)
                if (bt[b] < 0 || bt[b] >= st->num_blocks) return 3;
            if (layers[l].writes_kv && (g->slots == NULL || g->slots[t] >= st->num_blocks * st->bs)) return 5;
        }
    }
    return 0;
}

/* The layers in order over the step's T rows, then h += the last layer's MLP output. Returns 0; 1 when
   the buffers cannot be allocated; check_step's codes for a bad input (both with nothing written). */
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
    if (buf == NULL) return 1;
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
"""
)


class StackLinear(ctypes.Structure):
    _fields_ = [
        ("packed", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("N", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("format", ctypes.c_int64),
    ]


class StackLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", StackLinear),
        ("o", StackLinear),
        ("gate_up", StackLinear),
        ("down", StackLinear),
        ("kv_slot", ctypes.c_int64),
        ("window", ctypes.c_int64),
        ("group", ctypes.c_int64),
        ("writes_kv", ctypes.c_int64),
    ]


class StackGroup(ctypes.Structure):
    _fields_ = [
        ("seq_lens", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("bt_stride", ctypes.c_int64),
        ("max_blocks", ctypes.c_int64),
        ("slots", ctypes.c_void_p),
    ]


class StackStep(ctypes.Structure):
    _fields_ = [
        ("h", ctypes.c_void_p),
        ("T", ctypes.c_int64),
        ("H", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("cos", ctypes.c_void_p),
        ("sin", ctypes.c_void_p),
        ("max_pos", ctypes.c_int64),
        ("num_heads", ctypes.c_int64),
        ("kv_heads", ctypes.c_int64),
        ("kv_cache", ctypes.c_void_p),
        ("slot_stride", ctypes.c_int64),
        ("kv_stride", ctypes.c_int64),
        ("block_stride", ctypes.c_int64),
        ("num_blocks", ctypes.c_int64),
        ("bs", ctypes.c_int64),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("timings", ctypes.c_void_p),
    ]


_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]

# StackStep.timings' entries, in order (STACK_TIMED_*)
TIMED_PHASES = ("linear", "attention", "rope_kv")

ERRORS = {
    1: (MemoryError, "no memory for the decode stack's buffers"),
    2: (ValueError, "a seq_len exceeds its block table"),
    3: (ValueError, "a block table reads a block id outside the cache"),
    4: (ValueError, "a position is outside the RoPE table"),
    5: (ValueError, "a KV slot is outside the cache"),
}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def kernel(head_dim: int, group: int, kv_dtype: torch.dtype = torch.float32) -> Callable | None:
    """The compiled stack for this (head_dim, group) and a cache of `kv_dtype` (fp32 or bf16), built at
    the first call; None when switched off, when the panel GEMM or decode-attention kernel is, or when it
    cannot be built here (logged once)."""
    if not (enabled() and cpu_gemm.enabled() and cpu_decode.enabled()):
        return None
    functions = cpu_compile.load(
        "decode-stack",
        SOURCE,
        {
            "HEAD_DIM": head_dim,
            "GROUP": group,
            "SWIFTKV_NO_AVX512": 0,
            "KV_BF16": cpu_compile.kv_bf16(kv_dtype),
        },
        {"swiftkv_decode_stack": _ARGTYPES},
    )
    return None if functions is None else functions["swiftkv_decode_stack"]
