"""Prompt attention on CPU over the paged KV cache as one compiled C kernel (fp32 queries over an fp32 or
bf16 cache, whose keys and values the per-request copy below widens; the `torch` backend's prefill path
for prompt rows).

Request r's n_r queries sit at positions [s_r - n_r, s_r) (a fresh prompt, a chunk that continues one,
or a SwiftKV early-exit batch) and see the positions <= their own, and with a window W only those
> pos - W. Keys and values are read straight from the cache blocks through the block table: no gathered
copy, no padding between requests and no mask tensor.

Work items are (request, KV head, tile of QUERY_TILE positions) on torch's own OpenMP thread pool, the
tiles with the most keys first. An item holds the GROUP query heads of its KV head for its positions
as rows, and walks only the keys its rows can see, in chunks of KEY_CHUNK, flash-style (running max
and sum per row, the output rescaled as the max grows). First, in the same parallel region, every
request's visible keys are copied once per KV head into dense (keys, D) rows, which every tile of the
request reads. Everything inside a tile is transposed, rows in the vector lanes:
- the scores S^T (keys, rows) = K Q^T: a register block of RV row vectors (RV x VL query rows) by KB
  keys, one vector of Q^T per dimension used by KB broadcast key values (AVX-512: 32 rows x 12 keys
  in 24 of the 32 registers; AVX2: 16 rows x 6 keys in 12 of the 16);
- the online softmax runs on VL rows at once: the running max and sum are vectors, and only the chunks
  a row cannot wholly see (the causal diagonal, the window's edge, a tile's padded rows) mask, by
  comparing each key's position with the rows' positions; exp is the Cephes polynomial of
  cpu_compile.EXPF on vectors;
- O^T (D, rows) += V^T P^T: a register block of RV row vectors by DB output columns, one P^T vector
  per key used by DB broadcast values of that key's V row, read where it lies in its cache block.
A causal prompt of n tokens thus costs about n^2 / 2 (+ n * QUERY_TILE / 2) scores, where a padded or
per-request SDPA call on CPU computes whole 512-key splits.

Measured against the SDPA paths it replaces (the first version: rows in registers, K transposed), in
one process on a 2-core AMD EPYC (AVX2), 6 fresh prompts of 480-800 tokens, 9 heads, 3 KV heads,
head_dim 64, blocks scattered over the cache: 50 ms against 168 ms for one SDPA call per request and
149 ms for one padded call (3.3x / 2.9x). Then, on a 2-core Intel Xeon (AVX-512), 16 prompts of 640
(256) tokens, interleaved in one process: transposing the tile (rows in the lanes, no K transpose, the
softmax on vectors) took 57-59 ms to 55-56; a register block of two row vectors instead of one
(32 rows: half the loads of each key and V line per FMA) to 50-51 ms, 1.16x the first version in all
(256 tokens: 11.8 -> 10.6 ms, 1.11x). The AVX2 blocks, built on the same machine without AVX-512
(16 registers), measured the same as the first version's (71-72 ms). Transposing only the queries, or
only the keys into 16-key panels, or swapping the loops over keys and rows, each alone, measured the
same as before (within 2%); so did 64- or 256-key chunks, and tiles of 16 or 48 positions were slower.

A bf16 cache (kv_cache_dtype="bfloat16") is widened to fp32 once per request, values as well as keys
(packed like the keys), and the tiles run the fp32 code: 16 prompts of 640 tokens, one layer,
interleaved (2-core Intel Xeon): fp32 cache 37.8 ms, bf16 38.8 ms; widening each value where the P V
product broadcasts it instead took 46.2 against 40.7 ms.

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
    + cpu_compile.KV_TYPES
    + r"""
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define QUERY_TILE 32    /* positions per work item */
#define KEY_CHUNK 128    /* keys per online-softmax step */

#if defined(__AVX512F__) && !SWIFTKV_NO_AVX512
/* 32 vector registers of 16 lanes */
#define VL 16            /* lanes: query rows per vector */
#define RV 2             /* row vectors per register block (32 rows) */
#define KB 12            /* keys per QK register block: KB x RV = 24 accumulators */
#define DB 8             /* output columns per PV register block: DB x RV = 16 accumulators */
#else
/* 16 vector registers of 8 lanes */
#define VL 8
#define RV 2
#define KB 6             /* 12 accumulators */
#define DB 4             /* 8 accumulators */
#endif
#define BLOCK_ROWS (VL * RV)
typedef float vec __attribute__((vector_size(4 * VL), aligned(4)));
typedef int32_t vint __attribute__((vector_size(4 * VL), aligned(4)));
/* query rows of a tile, padded to whole register blocks */
#define TILE_ROWS ((QUERY_TILE * GROUP + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS)
#define VECS (TILE_ROWS / VL)

static inline vec splat(float x) { return (vec){0} + x; }
static inline vec vselect(vint mask, vec a, vec b) { return (vec)(((vint)a & mask) | ((vint)b & ~mask)); }
static inline vec vmax(vec a, vec b) { return vselect(a > b, a, b); }

/* The lanes (rows at positions pos) that see the key at position `key`: key <= pos, and with a window
   key > pos - window (edge = pos - window) */
static inline vint visible(vint pos, vint edge, int64_t key, int64_t window) {
    const vint kp = (vint){0} + (int32_t)key;
    return window > 0 ? (pos >= kp) & (edge < kp) : pos >= kp;
}

/* swiftkv_expf on every lane (cpu_compile.EXPF's steps) */
static inline vec vexpf(vec x) {
    x = vselect(x < splat(-87.0f), splat(-87.0f), x);
    x = vselect(x > splat(88.0f), splat(88.0f), x);
    const vec t = x * SWIFTKV_EXP_LOG2E + 0.5f;
    vint i = __builtin_convertvector(t, vint);
    i += (vint)(t < __builtin_convertvector(i, vec));  /* truncation -> floor */
    const vec n = __builtin_convertvector(i, vec);
    const vec r = SWIFTKV_EXP_REDUCE(x, n);
    return SWIFTKV_EXP_POLY(r) * (vec)((i + 127) << 23);
}

/* Scores of BLOCK_ROWS query rows against KB keys, transposed: sT[kk][0..BLOCK_ROWS) (rows lds apart)
   = keys[kk] . qT[.][0..BLOCK_ROWS), qT (HEAD_DIM, ldq) the rows' queries by dimension, keys
   (KB, HEAD_DIM) rows of the request's packed K */
static inline void qk_block(const float *qT, int64_t ldq, const float *keys, float *sT, int64_t lds) {
    vec acc[KB][RV];
    for (int kk = 0; kk < KB; kk++)
        for (int v = 0; v < RV; v++) acc[kk][v] = splat(0.f);
    for (int d = 0; d < HEAD_DIM; d++) {
        vec q[RV];
        for (int v = 0; v < RV; v++) q[v] = *(const vec *)(qT + d * ldq + v * VL);
        for (int kk = 0; kk < KB; kk++) {
            const float k = keys[kk * HEAD_DIM + d];
            for (int v = 0; v < RV; v++) acc[kk][v] += k * q[v];
        }
    }
    for (int kk = 0; kk < KB; kk++)
        for (int v = 0; v < RV; v++) *(vec *)(sT + kk * lds + v * VL) = acc[kk][v];
}

/* oT[d0 + dd][0..BLOCK_ROWS) (rows ldo apart) += sum over j < nk of pT[j][0..BLOCK_ROWS) (rows ldp
   apart) * vrow[j][d0 + dd], dd < DB */
static inline void pv_block(const float *pT, int64_t ldp, const float *const *vrow, int64_t nk, int64_t d0,
                            float *oT, int64_t ldo) {
    vec acc[DB][RV];
    for (int dd = 0; dd < DB; dd++)
        for (int v = 0; v < RV; v++) acc[dd][v] = *(const vec *)(oT + (d0 + dd) * ldo + v * VL);
    for (int64_t j = 0; j < nk; j++) {
        vec p[RV];
        for (int v = 0; v < RV; v++) p[v] = *(const vec *)(pT + j * ldp + v * VL);
        const float *vj = vrow[j] + d0;
        __asm__("" : "+r"(vj));  /* one pointer, the DB values at immediate offsets (else gcc keeps DB
                                    offsets in registers and spills them) */
        for (int dd = 0; dd < DB; dd++) {
            const float x = vj[dd];
            for (int v = 0; v < RV; v++) acc[dd][v] += x * p[v];
        }
    }
    for (int dd = 0; dd < DB; dd++)
        for (int v = 0; v < RV; v++) *(vec *)(oT + (d0 + dd) * ldo + v * VL) = acc[dd][v];
}

typedef struct {
    float qT[HEAD_DIM * TILE_ROWS], oT[HEAD_DIM * TILE_ROWS];  /* (HEAD_DIM, TILE_ROWS) */
    float sT[(KEY_CHUNK + KB) * TILE_ROWS];                     /* (keys, TILE_ROWS) */
    vec m[VECS], l[VECS];       /* running max and sum of each row */
    vint pos[VECS];             /* each row's position; -1 past the tile's rows */
    int64_t pmin[VECS], pmax[VECS];
    const float *vrow[KEY_CHUNK];
} Scratch;

/* Rows [t0, t0 + nt) of one request's queries (positions pos0 + t) and KV head h, a row per (position,
   query head of the group): keys its packed K (ldk, HEAD_DIM) from position k_first on, v its V (head
   h's values of block 0, row 0) or, in a bf16 cache, values its V widened and packed as the keys are. */
static void attend_tile(const float *q, int64_t q_stride, const float *keys, int64_t k_first, const kv_t *v,
                        const float *values, int64_t block_stride, const int32_t *bt, int64_t bs, int64_t row,
                        int64_t pos0, int64_t nt, int64_t window, float scale, float *out, int64_t out_stride,
                        Scratch *w) {
    const int64_t rows = nt * GROUP, rows_pad = (rows + BLOCK_ROWS - 1) / BLOCK_ROWS * BLOCK_ROWS;
    for (int64_t i = 0; i < rows_pad; i++) {
        if (i < rows) {
            const float *src = q + (i / GROUP) * q_stride + (i % GROUP) * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; d++) w->qT[d * TILE_ROWS + i] = src[d] * scale;
        } else {
            for (int d = 0; d < HEAD_DIM; d++) w->qT[d * TILE_ROWS + i] = 0.f;
        }
    }
    memset(w->oT, 0, sizeof(w->oT));
    for (int64_t rv = 0; rv < rows_pad / VL; rv++) {
        w->m[rv] = splat(-FLT_MAX);
        w->l[rv] = splat(0.f);
        for (int lane = 0; lane < VL; lane++) {
            const int64_t i = rv * VL + lane;
            w->pos[rv][lane] = i < rows ? (int32_t)(pos0 + i / GROUP) : -1;
        }
        const int64_t first = rv * VL, last = first + VL - 1 < rows - 1 ? first + VL - 1 : rows - 1;
        w->pmin[rv] = first + VL <= rows ? pos0 + first / GROUP : -1;  /* -1: a padded row, never full */
        w->pmax[rv] = pos0 + last / GROUP;
    }
    const int64_t lo = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0, hi = pos0 + nt;
    for (int64_t c0 = lo; c0 < hi; c0 += KEY_CHUNK) {
        const int64_t nk = hi - c0 < KEY_CHUNK ? hi - c0 : KEY_CHUNK;
        for (int64_t j = 0; j < nk; j++) {
            const int64_t p = c0 + j;
#if KV_BF16
            w->vrow[j] = values + (p - k_first) * HEAD_DIM;
#else
            w->vrow[j] = v + (int64_t)bt[p / bs] * block_stride + (p % bs) * row;
#endif
        }
        /* every block of KB keys reads a full block: the packed K has KB - 1 rows to spare past it */
        const float *kc = keys + (c0 - k_first) * HEAD_DIM;
        for (int64_t i = 0; i < rows_pad; i += BLOCK_ROWS)
            for (int64_t j = 0; j < nk; j += KB)
                qk_block(w->qT + i, TILE_ROWS, kc + j * HEAD_DIM, w->sT + j * TILE_ROWS + i, TILE_ROWS);
        /* the online softmax, VL rows at a time: masks only where a row of the vector cannot see a key
           of the chunk (the causal diagonal, the window's edge, padded rows) */
        for (int64_t rv = 0; rv < rows_pad / VL; rv++) {
            float *col = w->sT + rv * VL;
            const int full = w->pmin[rv] >= c0 + nk - 1 && (window <= 0 || c0 > w->pmax[rv] - window);
            const vint pos = w->pos[rv], edge = pos - (int32_t)(window > 0 ? window : 0);
            vec mx = w->m[rv], total = splat(0.f);
            if (full) {
                for (int64_t j = 0; j < nk; j++) mx = vmax(mx, *(const vec *)(col + j * TILE_ROWS));
            } else {
                for (int64_t j = 0; j < nk; j++) {
                    const vint seen = visible(pos, edge, c0 + j, window);
                    mx = vmax(mx, vselect(seen, *(const vec *)(col + j * TILE_ROWS), splat(-FLT_MAX)));
                }
            }
            const vec alpha = vexpf(w->m[rv] - mx);
            for (int64_t j = 0; j < nk; j++) {
                vec *s = (vec *)(col + j * TILE_ROWS);
                vec e = vexpf(*s - mx);
                if (!full) e = vselect(visible(pos, edge, c0 + j, window), e, splat(0.f));
                *s = e;
                total += e;
            }
            w->l[rv] = w->l[rv] * alpha + total;
            w->m[rv] = mx;
            for (int d = 0; d < HEAD_DIM; d++) *(vec *)(w->oT + d * TILE_ROWS + rv * VL) *= alpha;
        }
        for (int64_t i = 0; i < rows_pad; i += BLOCK_ROWS)
            for (int64_t d0 = 0; d0 < HEAD_DIM; d0 += DB)
                pv_block(w->sT + i, TILE_ROWS, w->vrow, nk, d0, w->oT + i, TILE_ROWS);
    }
    for (int64_t i = 0; i < rows; i++) {
        float *dst = out + (i / GROUP) * out_stride + (i % GROUP) * HEAD_DIM;
        const float inv = 1.f / w->l[i / VL][i % VL];
        for (int d = 0; d < HEAD_DIM; d++) dst[d] = w->oT[d * TILE_ROWS + i] * inv;
    }
}

/* q: (T, kv_heads * GROUP, HEAD_DIM), rows q_stride apart, request r's rows [cu_q[r], cu_q[r + 1]);
   k, v: (num_blocks, bs, kv_heads, HEAD_DIM), blocks block_stride apart; block_tables: (R, >= max_blocks)
   int32, rows bt_stride apart; seq_lens: (R,) int32; out: like q, contiguous (T, heads, HEAD_DIM).
   window <= 0: none. Checks everything first and returns, having read and written nothing: 2 when a
   request has more queries than positions or a negative length, or its seq_len needs more than
   max_blocks blocks; 3 when a block id it would read is outside [0, num_blocks); 1 when out of memory.
   Else 0. */
int swiftkv_prefill_attention(const float *q, int64_t q_stride, const kv_t *k, const kv_t *v,
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
    /* every request's visible keys, per KV head as dense (keys, HEAD_DIM) rows: k_first[r] is the first
       position its queries see, k_rows[r] the rows (its key count plus KB zero rows, which the last
       register block of a chunk may read) */
    int64_t *k_first = malloc(sizeof(int64_t) * 3 * (num_reqs + 1)), *k_rows = k_first + num_reqs + 1;
    int64_t *k_off = k_rows + num_reqs + 1;
    if (k_first == NULL) {
        free(first_item);
        return 1;
    }
    k_off[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t n = cu_q[r + 1] - cu_q[r], s = seq_lens[r], pos0 = s - n;
        k_first[r] = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
        k_rows[r] = n > 0 ? s - k_first[r] + KB : 0;
        k_off[r + 1] = k_off[r] + kv_heads * HEAD_DIM * k_rows[r];
    }
    /* a bf16 cache's values are widened once per request too (packed_v, laid out as the keys): the P V
       product then broadcasts fp32 values straight from memory, where widening each use cost 13% */
    const int64_t packed_n = k_off[num_reqs] > 0 ? k_off[num_reqs] : 1;
    float *packed = malloc(sizeof(float) * packed_n * (KV_BF16 ? 2 : 1));
    float *packed_v = KV_BF16 ? packed + packed_n : NULL;
    if (packed == NULL) {
        free(k_first);
        free(first_item);
        return 1;
    }
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    {
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < num_reqs; r++) {
            const int32_t *bt = block_tables + r * bt_stride;
            for (int64_t h = 0; h < kv_heads; h++) {
                float *dst = packed + k_off[r] + h * HEAD_DIM * k_rows[r];
                float *dst_v = KV_BF16 ? packed_v + (dst - packed) : NULL;  /* only rows < seq_len are read */
                for (int64_t j = 0; j < k_rows[r]; j++) {
                    const int64_t p = k_first[r] + j;
                    if (p < seq_lens[r]) {
                        const int64_t at = (int64_t)bt[p / bs] * block_stride + (p % bs) * row + h * HEAD_DIM;
                        swiftkv_kv_load(dst + j * HEAD_DIM, k + at, HEAD_DIM);
                        if (KV_BF16) swiftkv_kv_load(dst_v + j * HEAD_DIM, v + at, HEAD_DIM);
                    } else {
                        memset(dst + j * HEAD_DIM, 0, sizeof(float) * HEAD_DIM);
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
            const int64_t at = k_off[r] + h * HEAD_DIM * k_rows[r];
            attend_tile(q + offset, q_stride, packed + at, k_first[r], v + h * HEAD_DIM,
                        KV_BF16 ? packed_v + at : NULL, block_stride, block_tables + r * bt_stride, bs, row,
                        seq_lens[r] - n + t0, nt, window, scale,
                        out + ((int64_t)cu_q[r] + t0) * heads * HEAD_DIM + h * GROUP * HEAD_DIM,
                        heads * HEAD_DIM, w);
        }
        free(w);
    }
    free(packed);
    free(k_first);
    free(first_item);
    return failed;
}
"""
)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernel applies: where the decode kernel does (fp32 CPU queries, an fp32 or bf16 cache, group
    at most cpu_decode.MAX_GROUP, head_dim at most 256) and head_dim is a multiple of 16 (whole
    output-column blocks of the P V product)."""
    return cpu_decode.supports(q, k_cache) and k_cache.shape[-1] % 16 == 0


# swiftkv_prefill_attention's arguments: q, q_stride, k, v, block_stride, num_blocks, block_tables,
# bt_stride, max_blocks, cu_q, seq_lens, out, num_reqs, kv_heads, bs, window, scale, num_threads
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
_ARGTYPES += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
_ARGTYPES += [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
_ARGTYPES += [ctypes.c_int64, ctypes.c_float, ctypes.c_int]


def kernel(
    head_dim: int, group: int, avx512: bool = True, kv_dtype: torch.dtype = torch.float32
) -> Callable | None:
    """The compiled kernel for this (head_dim, group) and a cache of `kv_dtype` (fp32 or bf16), built at
    the first call (kernels/cpu_compile.py); None when it cannot be built or loaded here (logged once) or
    is switched off. `avx512=False` builds the 8-lane register blocks even where the compiler targets
    AVX-512 (tests check both paths)."""
    if not enabled():
        return None
    functions = cpu_compile.load(
        "prefill-attention",
        SOURCE,
        {
            "HEAD_DIM": head_dim,
            "GROUP": group,
            "SWIFTKV_NO_AVX512": int(not avx512),
            "KV_BF16": cpu_compile.kv_bf16(kv_dtype),
        },
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
    if v_cache.dtype != k_cache.dtype:
        return None
    fn = kernel(head_dim, num_heads // kv_heads, avx512, k_cache.dtype)
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
