"""Prompt attention on CPU over the paged KV cache as one compiled C kernel (fp32; the `torch` backend's
prefill path for prompt rows).

Request r's n_r queries sit at positions [s_r - n_r, s_r) (a fresh prompt, a chunk that continues one,
or a SwiftKV early-exit batch) and see the positions <= their own, and with a window W only those
> pos - W. Keys and values are read straight from the cache blocks through the block table: no gathered
copy, no padding between requests and no mask tensor.

Work items are (request, KV head, tile of QUERY_TILE positions) on torch's own OpenMP thread pool, the
tiles with the most keys first. An item holds the GROUP query heads of its KV head for its positions
as one (GROUP * rows, D) block and walks only the keys its rows can see, in chunks of KEY_CHUNK, flash-
style (running max and sum per row, the output rescaled as the max grows). First, in the same parallel
region, every request's visible keys are transposed once per KV head into a (D, keys) panel, so that
the scores are a small GEMM (and no tile transposes its keys again: a 640-token prompt's 20 tiles
shared one transpose; 16 prompts of 480-780 tokens, interleaved on a 2-core AMD EPYC Zen 3: 120 ->
105 ms per layer). Per chunk:
- the scores: an RB x 16 register block of accumulators: where the compiler targets AVX-512, 16 rows
  of one 16-wide key vector (of the panel) each, else (AVX2) 6 rows of two 8-wide vectors;
- the softmax runs over each row's visible keys only (the causal diagonal and the window edge are
  ranges, never masks), exp by the same Cephes polynomial as the decode kernel;
- P @ V is a second small GEMM on V's rows as they lie in the blocks.
A causal prompt of n tokens thus costs about n^2 / 2 (+ n * QUERY_TILE / 2) scores, where a padded or
per-request SDPA call on CPU computes whole 512-key splits.

Measured against the SDPA paths it replaces, in one process on a 2-core AMD EPYC (AVX2), 6 fresh
prompts of 480-800 tokens, 9 heads, 3 KV heads, head_dim 64, blocks scattered over the cache: 50 ms
against 168 ms for one SDPA call per request and 149 ms for one padded call (3.3x / 2.9x); 640-token
prompts 60 / 172 / 86 ms. In the engine (`python -m bench throughput --mixes prefill-heavy --profile`)
attention is 20% of all the engine's time with it, against 27-28% before it on another such machine.
The 16-lane blocks against the 8-lane ones on a 2-core AMD EPYC Zen 4 (AVX-512), 16 prompts of 480-800
tokens, interleaved in one process, 30 rounds: 1.11x (median paired ratio; 126 against 113 GFLOP/s),
bit-identical outputs (each output lane sums the same products in the same order). A 16-row P @ V
block that keeps all HEAD_DIM columns of 4 rows in registers, loading each V row once per 4 rows
instead of once per 16-column pass, measured the same (1.00x): the FMAs are not waiting on loads.

The source is compiled at first use for each (head_dim, group) by kernels/cpu_compile.py (-O3
-march=native, OpenMP where torch uses it). Without a compiler, or when no build loads, `kernel()`
returns None (one warning) and the caller keeps its SDPA path. SWIFTKV_CPU_PREFILL_KERNEL=0 turns it
off. Every request's lengths and block ids are checked before any row is read; a bad one raises
ValueError and nothing is written.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import torch

from swiftkv_fast.kernels import cpu_compile, cpu_decode

ENV_SWITCH = "SWIFTKV_CPU_PREFILL_KERNEL"

SOURCE = (
    cpu_compile.EXPF
    + r"""
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QUERY_TILE 32    /* positions per work item */
#define KEY_CHUNK 128    /* keys per online-softmax step (a multiple of 16) */
#define DV (HEAD_DIM / 8)
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));

#if defined(__AVX512F__) && !SWIFTKV_NO_AVX512
/* 32 vector registers of 16 lanes: 16 query rows x 16 keys (or 16 output columns) in 16 accumulators,
   one key (or V) vector per step used by 16 broadcast values */
#define RB 16            /* query rows per register block */
typedef float v16 __attribute__((vector_size(64), aligned(4)));

/* s[RB][16] (rows lds apart) = qs[RB][HEAD_DIM] . kt[HEAD_DIM][16] (rows ldk apart) */
static inline void qk_block(const float *qs, const float *kt, int64_t ldk, float *s, int64_t lds) {
    v16 acc[RB];
    for (int r = 0; r < RB; r++) acc[r] = (v16){0};
    for (int d = 0; d < HEAD_DIM; d++) {
        const v16 k0 = *(const v16 *)(kt + d * ldk);
        for (int r = 0; r < RB; r++) acc[r] += qs[r * HEAD_DIM + d] * k0;
    }
    for (int r = 0; r < RB; r++) *(v16 *)(s + r * lds) = acc[r];
}

/* o[RB][HEAD_DIM] += p[RB][nk] (rows ldp apart) . V rows vrow[0..nk) */
static inline void pv_block(const float *p, int64_t ldp, const float *const *vrow, int64_t nk, float *o) {
    for (int c = 0; c < HEAD_DIM; c += 16) {
        v16 acc[RB];
        for (int r = 0; r < RB; r++) acc[r] = *(const v16 *)(o + r * HEAD_DIM + c);
        for (int64_t j = 0; j < nk; j++) {
            const v16 v0 = *(const v16 *)(vrow[j] + c);
            for (int r = 0; r < RB; r++) acc[r] += p[r * ldp + j] * v0;
        }
        for (int r = 0; r < RB; r++) *(v16 *)(o + r * HEAD_DIM + c) = acc[r];
    }
}
#else
/* 16 vector registers of 8 lanes: 6 query rows x 16 keys (or columns) in 12 accumulators */
#define RB 6             /* query rows per register block */
/* s[RB][16] (rows lds apart) = qs[RB][HEAD_DIM] . kt[HEAD_DIM][16] (rows ldk apart) */
static inline void qk_block(const float *qs, const float *kt, int64_t ldk, float *s, int64_t lds) {
    v8 acc[RB][2];
    for (int r = 0; r < RB; r++) acc[r][0] = acc[r][1] = (v8){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int d = 0; d < HEAD_DIM; d++) {
        const v8 k0 = *(const v8 *)(kt + d * ldk), k1 = *(const v8 *)(kt + d * ldk + 8);
        for (int r = 0; r < RB; r++) {
            const float x = qs[r * HEAD_DIM + d];
            acc[r][0] += x * k0;
            acc[r][1] += x * k1;
        }
    }
    for (int r = 0; r < RB; r++) {
        *(v8 *)(s + r * lds) = acc[r][0];
        *(v8 *)(s + r * lds + 8) = acc[r][1];
    }
}

/* o[RB][HEAD_DIM] += p[RB][nk] (rows ldp apart) . V rows vrow[0..nk) */
static inline void pv_block(const float *p, int64_t ldp, const float *const *vrow, int64_t nk, float *o) {
    for (int c = 0; c < HEAD_DIM; c += 16) {
        v8 acc[RB][2];
        for (int r = 0; r < RB; r++) {
            acc[r][0] = *(const v8 *)(o + r * HEAD_DIM + c);
            acc[r][1] = *(const v8 *)(o + r * HEAD_DIM + c + 8);
        }
        for (int64_t j = 0; j < nk; j++) {
            const v8 v0 = *(const v8 *)(vrow[j] + c), v1 = *(const v8 *)(vrow[j] + c + 8);
            for (int r = 0; r < RB; r++) {
                const float x = p[r * ldp + j];
                acc[r][0] += x * v0;
                acc[r][1] += x * v1;
            }
        }
        for (int r = 0; r < RB; r++) {
            *(v8 *)(o + r * HEAD_DIM + c) = acc[r][0];
            *(v8 *)(o + r * HEAD_DIM + c + 8) = acc[r][1];
        }
    }
}
#endif
#define TILE_ROWS (((QUERY_TILE * GROUP) + RB - 1) / RB * RB)

/* max(init, x[0..n)) */
static inline float row_max(const float *x, int64_t n, float init) {
    v8 m = {init, init, init, init, init, init, init, init};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const v8 xj = *(const v8 *)(x + j);
        const vi8 gt = xj > m;
        m = (v8)(((vi8)xj & gt) | ((vi8)m & ~gt));
    }
    float mx = init;
    for (int k = 0; k < 8; k++) mx = m[k] > mx ? m[k] : mx;
    for (; j < n; j++) mx = x[j] > mx ? x[j] : mx;
    return mx;
}

typedef struct {
    float qs[TILE_ROWS * HEAD_DIM], o[TILE_ROWS * HEAD_DIM], m[TILE_ROWS], l[TILE_ROWS];
    float s[TILE_ROWS * KEY_CHUNK];
    const float *vrow[KEY_CHUNK];
} Scratch;

/* Rows [t0, t0 + nt) of one request's queries (positions pos0 + t) and KV head h: kt is its keys'
   (HEAD_DIM, ldk) panel from position kt_first on, v its V (head h's values of block 0, row 0). */
static void attend_tile(const float *q, int64_t q_stride, const float *kt, int64_t kt_first, int64_t ldk,
                        const float *v, int64_t block_stride, const int32_t *bt, int64_t bs, int64_t row,
                        int64_t pos0, int64_t nt, int64_t window, float scale, float *out,
                        int64_t out_stride, Scratch *w) {
    const int64_t rows = nt * GROUP, rows_pad = (rows + RB - 1) / RB * RB;
    for (int64_t i = 0; i < rows_pad; i++) {
        float *qi = w->qs + i * HEAD_DIM;
        if (i < rows) {
            const float *src = q + (i / GROUP) * q_stride + (i % GROUP) * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; d++) qi[d] = src[d] * scale;
        } else {
            memset(qi, 0, sizeof(float) * HEAD_DIM);
        }
        memset(w->o + i * HEAD_DIM, 0, sizeof(float) * HEAD_DIM);
        w->m[i] = -FLT_MAX;
        w->l[i] = 0.f;
    }
    const int64_t lo = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0, hi = pos0 + nt;
    for (int64_t c0 = lo; c0 < hi; c0 += KEY_CHUNK) {
        const int64_t nk = hi - c0 < KEY_CHUNK ? hi - c0 : KEY_CHUNK, nk_pad = (nk + 15) / 16 * 16;
        for (int64_t j = 0; j < nk; j++) {
            const int64_t p = c0 + j;
            w->vrow[j] = v + (int64_t)bt[p / bs] * block_stride + (p % bs) * row;
        }
        const float *ktc = kt + (c0 - kt_first);
        for (int64_t i = 0; i < rows_pad; i += RB)
            for (int64_t j = 0; j < nk_pad; j += 16)
                qk_block(w->qs + i * HEAD_DIM, ktc + j, ldk, w->s + i * KEY_CHUNK + j, KEY_CHUNK);
        for (int64_t i = 0; i < rows_pad; i++) {
            float *si = w->s + i * KEY_CHUNK;
            const int64_t pos = pos0 + i / GROUP;
            int64_t a = window > 0 ? pos - window + 1 - c0 : 0, b = pos + 1 - c0;
            a = a < 0 ? 0 : a;
            b = b > nk ? nk : b;
            if (i >= rows || a >= b) {
                memset(si, 0, sizeof(float) * nk);
                continue;
            }
            const float mx = row_max(si + a, b - a, w->m[i]);
            const float alpha = swiftkv_expf(w->m[i] - mx);
            float total = 0.f;
            for (int64_t j = 0; j < a; j++) si[j] = 0.f;
            for (int64_t j = a; j < b; j++) {
                const float e = swiftkv_expf(si[j] - mx);
                si[j] = e;
                total += e;
            }
            for (int64_t j = b; j < nk; j++) si[j] = 0.f;
            w->l[i] = w->l[i] * alpha + total;
            w->m[i] = mx;
            if (alpha != 1.f)
                for (int d = 0; d < HEAD_DIM; d++) w->o[i * HEAD_DIM + d] *= alpha;
        }
        for (int64_t i = 0; i < rows_pad; i += RB)
            pv_block(w->s + i * KEY_CHUNK, KEY_CHUNK, w->vrow, nk, w->o + i * HEAD_DIM);
    }
    for (int64_t i = 0; i < rows; i++) {
        float *dst = out + (i / GROUP) * out_stride + (i % GROUP) * HEAD_DIM;
        const float inv = 1.f / w->l[i];
        for (int d = 0; d < HEAD_DIM; d++) dst[d] = w->o[i * HEAD_DIM + d] * inv;
    }
}

/* q: (T, kv_heads * GROUP, HEAD_DIM), rows q_stride apart, request r's rows [cu_q[r], cu_q[r + 1]);
   k, v: (num_blocks, bs, kv_heads, HEAD_DIM), blocks block_stride apart; block_tables: (R, >= max_blocks)
   int32, rows bt_stride apart; seq_lens: (R,) int32; out: like q, contiguous (T, heads, HEAD_DIM).
   window <= 0: none. Checks everything first and returns, having read and written nothing: 2 when a
   request has more queries than positions or a negative length, or its seq_len needs more than
   max_blocks blocks; 3 when a block id it would read is outside [0, num_blocks); 1 when out of memory.
   Else 0. */
int swiftkv_prefill_attention(const float *q, int64_t q_stride, const float *k, const float *v,
                              int64_t block_stride, int64_t num_blocks, const int32_t *block_tables,
                              int64_t bt_stride, int64_t max_blocks, const int32_t *cu_q,
                              const int32_t *seq_lens, float *out, int64_t num_reqs, int64_t kv_heads,
                              int64_t bs, int64_t window, float scale, int num_threads) {
    int64_t *first_item = malloc(sizeof(int64_t) * (num_reqs + 1));
    if (first_item == NULL) return 1;
    first_item[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t n = cu_q[r + 1] - cu_q[r], s = seq_lens[r];
        if (n < 0 || s < n || s > max_blocks * bs) {
            free(first_item);
            return 2;
        }
        const int64_t pos0 = s - n, lo = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
        const int32_t *bt = block_tables + r * bt_stride;
        for (int64_t b = n > 0 ? lo / bs : 0; n > 0 && b * bs < s; b++) {
            if (bt[b] < 0 || bt[b] >= num_blocks) {
                free(first_item);
                return 3;
            }
        }
        first_item[r + 1] = first_item[r] + kv_heads * ((n + QUERY_TILE - 1) / QUERY_TILE);
    }
    const int64_t num_items = first_item[num_reqs], row = kv_heads * HEAD_DIM, heads = kv_heads * GROUP;
    /* K^T of every request's visible keys, per KV head a (HEAD_DIM, ld) panel: kt_first[r] is the first
       position its queries see, kt_ld[r] the panel's row length (its key count rounded up to 16, plus
       16: a tile's chunk may start off the 16-key grid under a window, and reads a full 16-key block) */
    int64_t *kt_first = malloc(sizeof(int64_t) * 3 * (num_reqs + 1)), *kt_ld = kt_first + num_reqs + 1;
    int64_t *kt_off = kt_ld + num_reqs + 1;
    if (kt_first == NULL) {
        free(first_item);
        return 1;
    }
    kt_off[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t n = cu_q[r + 1] - cu_q[r], s = seq_lens[r], pos0 = s - n;
        kt_first[r] = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
        kt_ld[r] = n > 0 ? (s - kt_first[r] + 15) / 16 * 16 + 16 : 0;
        kt_off[r + 1] = kt_off[r] + kv_heads * HEAD_DIM * kt_ld[r];
    }
    float *kt = malloc(sizeof(float) * (kt_off[num_reqs] > 0 ? kt_off[num_reqs] : 1));
    if (kt == NULL) {
        free(kt_first);
        free(first_item);
        return 1;
    }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        /* the panels first: a request per item, every KV head of it */
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < num_reqs; r++) {
            const int64_t ld = kt_ld[r], first = kt_first[r];
            const int32_t *bt = block_tables + r * bt_stride;
            for (int64_t j = 0; j < ld; j++) {
                const int64_t p = first + j;
                for (int64_t h = 0; h < kv_heads; h++) {
                    float *dst = kt + kt_off[r] + h * HEAD_DIM * ld + j;
                    if (p < seq_lens[r]) {
                        const float *kr =
                            k + (int64_t)bt[p / bs] * block_stride + (p % bs) * row + h * HEAD_DIM;
                        for (int d = 0; d < HEAD_DIM; d++) dst[d * ld] = kr[d];
                    } else {
                        for (int d = 0; d < HEAD_DIM; d++) dst[d * ld] = 0.f;
                    }
                }
            }
        }
        Scratch *w = aligned_alloc(64, (sizeof(Scratch) + 63) / 64 * 64);
        if (w == NULL) {
            #pragma omp atomic write
            failed = 1;
        }
        #pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < num_items; item++) {
            if (w == NULL) continue;
            int64_t r = 0;
            while (first_item[r + 1] <= item) r++;
            const int64_t local = item - first_item[r], h = local % kv_heads;
            const int64_t n = cu_q[r + 1] - cu_q[r], num_tiles = (n + QUERY_TILE - 1) / QUERY_TILE;
            const int64_t t0 = (num_tiles - 1 - local / kv_heads) * QUERY_TILE;  /* most keys first */
            const int64_t nt = n - t0 < QUERY_TILE ? n - t0 : QUERY_TILE;
            const int64_t offset = ((int64_t)cu_q[r] + t0) * q_stride + h * GROUP * HEAD_DIM;
            attend_tile(q + offset, q_stride, kt + kt_off[r] + h * HEAD_DIM * kt_ld[r], kt_first[r], kt_ld[r],
                        v + h * HEAD_DIM, block_stride, block_tables + r * bt_stride, bs, row,
                        seq_lens[r] - n + t0, nt, window, scale,
                        out + ((int64_t)cu_q[r] + t0) * heads * HEAD_DIM + h * GROUP * HEAD_DIM,
                        heads * HEAD_DIM, w);
        }
        free(w);
    }
    free(kt);
    free(kt_first);
    free(first_item);
    return failed;
}
"""
)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernel applies: where the decode kernel does (fp32 CPU tensors, group at most
    cpu_decode.MAX_GROUP, head_dim at most 256) and head_dim is a multiple of 16 (two 8-wide vectors per
    register block)."""
    return cpu_decode.supports(q, k_cache) and k_cache.shape[-1] % 16 == 0


# swiftkv_prefill_attention's arguments: q, q_stride, k, v, block_stride, num_blocks, block_tables,
# bt_stride, max_blocks, cu_q, seq_lens, out, num_reqs, kv_heads, bs, window, scale, num_threads
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
_ARGTYPES += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
_ARGTYPES += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
_ARGTYPES += [ctypes.c_int64, ctypes.c_float, ctypes.c_int]


def kernel(head_dim: int, group: int, avx512: bool = True) -> Callable | None:
    """The compiled kernel for this (head_dim, group), built at the first call (kernels/cpu_compile.py);
    None when it cannot be built or loaded here (logged once) or is switched off. `avx512=False` builds
    the 8-lane register blocks even where the compiler targets AVX-512 (tests check both paths)."""
    if not enabled():
        return None
    functions = cpu_compile.load(
        "prefill-attention",
        SOURCE,
        {"HEAD_DIM": head_dim, "GROUP": group, "SWIFTKV_NO_AVX512": int(not avx512)},
        {"swiftkv_prefill_attention": _ARGTYPES},
    )
    return None if functions is None else functions["swiftkv_prefill_attention"]


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    window: int | None,
    scale: float,
    *,
    avx512: bool = True,
) -> torch.Tensor | None:
    """q: (T, H, D) fp32, request r's queries rows [cu_seqlens_q[r], cu_seqlens_q[r + 1]) at the last
    positions of its seq_lens[r]; k_cache, v_cache: (num_blocks, block_size, kv_heads, D); block_tables
    (R, max_blocks) int -> (T, H, D), or None when the kernel does not apply here (`supports`) or is
    unavailable."""
    if not supports(q, k_cache):
        return None
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    fn = kernel(head_dim, num_heads // kv_heads, avx512)
    if fn is None:
        return None
    inputs = cpu_decode.paged_inputs(q, k_cache, v_cache, seq_lens, block_tables)
    if inputs is None:
        return None
    q, seq_lens, block_tables = inputs
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    num_reqs = seq_lens.shape[0]
    if cu.shape[0] != num_reqs + 1 or int(cu[-1]) != num_tokens or int(cu[0]) != 0:
        raise ValueError(
            f"prefill attention: cu_seqlens_q {cu.tolist()} does not split {num_tokens} query rows "
            f"over {num_reqs} requests"
        )
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
    status = fn(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.stride(0),
        num_blocks,
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        cu.data_ptr(),
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_reqs,
        kv_heads,
        block_size,
        window or 0,
        scale,
        torch.get_num_threads(),
    )
    if status == 1:
        raise MemoryError("prefill attention: out of memory for a work item's scratch")
    if status == 2:
        raise ValueError(
            f"prefill attention: a request has more queries than positions, or a seq_len (max "
            f"{int(seq_lens.max())}) exceeds its block table ({block_tables.shape[1]} blocks of {block_size})"
        )
    if status == 3:
        raise ValueError(f"prefill attention: a block table reads a block id outside [0, {num_blocks})")
    return out
