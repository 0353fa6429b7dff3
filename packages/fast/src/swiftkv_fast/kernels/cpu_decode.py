"""Decode attention on CPU over the paged KV cache as one compiled C kernel (fp32 queries over an fp32 or
bf16 cache; the `torch` backend's decode path).

One query per request (at position seq_lens[r] - 1) against its context, read straight from the cache
blocks through the block table: every K and V row is read once, no gathered copy, and the `group`
query heads of one KV head share each row read (GQA without repeats). Work items are requests, on
torch's own OpenMP thread pool, so that a block's K (or V) is read as one contiguous run of
block_size * kv_heads * head_dim values; only when there are fewer requests than threads are a
request's KV heads split over several items (a run of heads each). Per item: the scaled scores q.k of
every position, a softmax (max-subtracted, exp by a Cephes polynomial), then the weighted sum of V.
With a window W only positions >= seq_len - W are read; a row with seq_len 0 (padding) gets zeros.

Positions go in runs of DW (16 lanes with AVX-512, 8 with AVX2) inside one block: a run's DW dot
products of one query are folded into one vector of DW scores by DW - 1 two-vector shuffles
(`lane_sums`) instead of a horizontal sum each, its weighted V rows add up in registers (GROUP x VCH
vectors) instead of in the output's memory, the softmax's maximum is DW running maxima, and the
prefetch runs two runs ahead over K's runs and then V's. One thread with the rows in L2 (2 requests
x 300 tokens, 9 heads, 3 KV heads, head_dim 64; 2-core Intel Xeon, AVX-512): 82 -> 53 ns per
position (the serial scalar max alone was a fifth of the time). 16 requests x 300 tokens, 30 layers,
2 threads, caches swept out of L3 between rounds, interleaved over 8 rounds, median per step: blocks
scattered 21.2 -> 19.2 ms, blocks in order (as a fresh block pool hands them out) 16.0 -> 14.3 ms;
built for AVX2 (-march=haswell) on the same CPU 20.9 -> 19.8 and 19.4 -> 16.8 ms. At 700 tokens
(prefill-heavy's contexts) 45.3 -> 42.0 and 35.1 -> 31.0 ms, where reading the same bytes in the same
order with no arithmetic takes 32.2 and 25.9 ms: the kernel is at 77-84% of its reads, and those at
16-20 GB/s (a plain sum over one array reads 22 GB/s here with 2 threads). A decode step's attention
reads as many bytes as the weights at these contexts; only fewer bytes per cached value would lower it.

So a bf16 cache (engine kv_cache_dtype="bfloat16", -DKV_BF16=1) is read here too: each run of DW values
widens to fp32 exactly (zero-extend, shift into the upper half) in registers, and everything after is
the fp32 kernel's arithmetic. The same shape (16 requests, 30 layers, 2 threads, caches swept, fp32 and
bf16 caches interleaved over 8 rounds, medians; 2-core Intel Xeon, AVX-512): 300 tokens scattered
12.4 -> 8.5 ms, in order 12.1 -> 8.2; 700 tokens 28.7 -> 19.8 and 26.5 -> 17.8 (1.45-1.49x); built
for AVX2 (-march=haswell) on the same CPU, scattered, 16.0 -> 11.2 and 36.0 -> 25.9 ms (1.39-1.43x). The
widening through GCC's __builtin_convertvector split each 16-lane vector into two halves and an insert
and gave 1.15x; one vpmovzxwd from memory and a shift (intrinsics, AVX-512 or AVX2) give the above.

Measured against the gather + SDPA path it replaces, interleaved in one process (16 requests x 300
tokens, 9 heads, 3 KV heads, head_dim 64, blocks scattered over a cache larger than L3; AMD EPYC, AVX2):
4-7x faster per layer (0.50 vs 2.96 ms at 2 threads); in the engine (bench throughput --profile,
issue-4 mix) decode attention fell from ~37% to ~17% of a decode step.

The rows of the next block are prefetched into L2 (prefetcht2), not L1 (prefetcht0): a thread here is
limited by the misses it can keep in flight, not by the memory's bandwidth (one thread reads 8.5 GB/s
of this pattern where a plain sum reads 26), and prefetches to L1 hold the L1's few miss buffers. On a
Zen 4 EPYC with the cache in memory (the shape above, 30 layers, interleaved in one process): one
thread 27 -> 17 ms, two 14-15 -> 11 ms per step's 30 layers; from cache, 6.4 -> 7.0 (one thread).
Items of whole requests rather than (request, KV head) pairs, so that the rows and the prefetches are
one contiguous run per block, measured the same way on a Zen 3 EPYC (AVX2), interleaved: one thread
34.7-43.4 -> 24.6-31.2 ms, two 19.7-26.8 -> 15.5-21.1 ms per step's 30 layers.

What bounds it is the read pattern, not the arithmetic (2-core Intel Xeon, 2026-12-05; 16 requests x
700 tokens, 30 layers, caches swept, medians of 8 interleaved rounds): the kernel reads scattered 16-token
blocks (12 KB per K or V run) at 12.3 GB/s and blocks in order at 16.2, where a plain C loop summing
scattered 12 KB chunks of a 1 GB array reads 15-17 GB/s, 48 KB chunks 21 and 1 MB chunks 25. Neither
the prefetch distance (0-8 runs ahead: 11.9-12.0 GB/s), nor prefetching to L1, every fourth line or
one line per page, nor a vectorized softmax moved it. Larger blocks do: 64 / 128-token blocks 14.1 /
15.0 GB/s, and the engine on 16 x ~640 -> 64 greedy tokens (`block_size=`, 3 interleaved rounds) 110.9
-> 114.8 / 121.1 tok/s with SwiftKV off, 165.6 -> 169.0 / 170.3 at L = 15, the same tokens (vLLM's CPU
platform picks 128-token blocks where IPEX is installed). The default stays 16 (prefix-cache hits and
sliding-window frees come in whole blocks); `LLM(block_size=128)` suits long contexts.

The source is compiled at first use for each (head_dim, group) by kernels/cpu_compile.py (the system
C compiler, -O3 -march=native, OpenMP where torch uses it): about half a second, once per process and
shape. Without a compiler, or when no build loads, `kernel()` returns None (one warning) and the
caller keeps its portable path. SWIFTKV_CPU_DECODE_KERNEL=0 turns the kernel off. A seq_len beyond its
block table or a block id outside the cache raises ValueError before that request's rows are read.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import torch

from swiftkv_fast.kernels import cpu_compile
from swiftkv_fast.kernels.cpu_compile import compiler  # noqa: F401  (re-exported: tests and callers ask)

ENV_SWITCH = "SWIFTKV_CPU_DECODE_KERNEL"
MAX_GROUP = 16  # query heads per KV head the kernel keeps in registers / on the stack

SOURCE = (
    cpu_compile.EXPF
    + cpu_compile.KV_TYPES
    + r"""
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* The scores' and the outputs' vectors: DW lanes (16 with AVX-512 where HEAD_DIM allows, else 8). */
#if defined(__AVX512F__) && HEAD_DIM % 16 == 0
#define DW 16
#define DW_EVEN {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}
#define DW_ODD {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31}
#else
#define DW 8
#define DW_EVEN {0, 2, 4, 6, 8, 10, 12, 14}
#define DW_ODD {1, 3, 5, 7, 9, 11, 13, 15}
#endif
#define NV (HEAD_DIM / DW)
typedef float dvec __attribute__((vector_size(4 * DW), aligned(4)));
typedef int32_t dveci __attribute__((vector_size(4 * DW)));
/* output vectors accumulated at once per query group: GROUP x VCH of them stay in registers */
#define VCAP (16 / GROUP > 0 ? 16 / GROUP : 1)
#define VCH (NV % 8 == 0 && VCAP >= 8 ? 8 : NV % 4 == 0 && VCAP >= 4 ? 4 : NV % 2 == 0 && VCAP >= 2 ? 2 : 1)

/* DW cached values at p as floats: bf16 widens to fp32 exactly (zero-extend, shift into the upper half) */
#if KV_BF16 && DW == 16
#include <immintrin.h>
static inline dvec kv_vload(const kv_t *p) {  /* one vpmovzxwd from memory, one shift */
    return (dvec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#elif KV_BF16 && defined(__AVX2__)
#include <immintrin.h>
static inline dvec kv_vload(const kv_t *p) {
    return (dvec)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
}
#elif KV_BF16
typedef uint16_t kvvec __attribute__((vector_size(2 * DW), aligned(2)));
typedef uint32_t dvecu __attribute__((vector_size(4 * DW)));
static inline dvec kv_vload(const kv_t *p) {
    return (dvec)(__builtin_convertvector(*(const kvvec *)p, dvecu) << 16);
}
#else
static inline dvec kv_vload(const kv_t *p) { return *(const dvec *)p; }
#endif
#define KV_LINE (64 / (int64_t)sizeof(kv_t))  /* cached values per 64-byte line */

/* x[0..DW) -> one vector whose lane i is the sum of x[i]'s lanes (x is overwritten): pairs of
   vectors fold into one, each half the other's pairwise sums, DW - 1 shuffle pairs in all where DW
   separate horizontal sums take log2(DW) each. */
static inline dvec lane_sums(dvec *x) {
    const dveci even = DW_EVEN, odd = DW_ODD;
    #pragma GCC unroll 4
    for (int n = DW; n > 1; n /= 2)
        #pragma GCC unroll 8
        for (int i = 0; i < n / 2; i++)
            x[i] = __builtin_shuffle(x[2 * i], x[2 * i + 1], even)
                   + __builtin_shuffle(x[2 * i], x[2 * i + 1], odd);
    return x[0];
}

/* Where the run of positions [t, t + DW) (cut at its block's end and at n) starts in k (or v). */
static inline const kv_t *run_at(const kv_t *base, const int32_t *bt, int64_t block_stride, int64_t bs,
                                  int64_t row, int64_t t) {
    return base + (int64_t)bt[t / bs] * block_stride + (t % bs) * row;
}

static inline int64_t run_end(int64_t t, int64_t bs, int64_t n) {
    const int64_t block_end = (t / bs + 1) * bs, end = t + DW < block_end ? t + DW : block_end;
    return end < n ? end : n;
}

/* Prefetch into L2 the rows [t, run_end(t)) of the run at p: width values each, row apart. */
static inline void prefetch_run(const kv_t *p, int64_t rows, int64_t row, int64_t width) {
    if (width == row) width *= rows, rows = 1;  /* every head's values: one contiguous stretch */
    for (int64_t i = 0; i < rows; i++) {
        const kv_t *r = p + i * row;
        #pragma GCC unroll 4
        for (int64_t j = 0; j < width; j += KV_LINE) __builtin_prefetch(r + j, 0, 1);
    }
}

#define PF_RUNS 2  /* runs prefetched ahead of the one being read */

/* The prefetch cursor walks K's runs, then V's: *tp in [start, n) is K's run at *tp, in [n, n + len)
   V's at *tp - len. One call prefetches the run at the cursor and moves it on. */
static inline void prefetch_next(int64_t *tp, const kv_t *k, const kv_t *v, const int32_t *bt,
                                 int64_t block_stride, int64_t bs, int64_t row, int64_t width, int64_t start,
                                 int64_t n) {
    const int64_t len = n - start;
    if (*tp < n) {
        const int64_t e = run_end(*tp, bs, n);
        prefetch_run(run_at(k, bt, block_stride, bs, row, *tp), e - *tp, row, width);
        *tp = e;  /* run_end never passes n */
    } else if (*tp < n + len) {
        const int64_t t = *tp - len, e = run_end(t, bs, n);
        prefetch_run(run_at(v, bt, block_stride, bs, row, t), e - t, row, width);
        *tp = e + len;
    }
}

/* KV heads [h0, h1) of one request against positions [start, n): q: (heads, HEAD_DIM) from head h0's
   first query on; k, v point at head h0's values of block 0, row 0; s: (h1 - h0) * GROUP * (n - start)
   scores; o: (h1 - h0) * GROUP * HEAD_DIM outputs. Positions go in runs of up to DW inside one block
   (a position's values of these heads are adjacent, so a run is one contiguous stretch of memory),
   the next run prefetched into L2 while this one is used: blocks sit anywhere in the cache. A run's
   scores of one query come out as one vector (lane_sums), its outputs add up in registers. */
static void attend(const float *q, const kv_t *k, const kv_t *v, int64_t block_stride, const int32_t *bt,
                   int64_t bs, int64_t row, int64_t h0, int64_t h1, int64_t start, int64_t n, float scale,
                   float *s, float *o) {
    const int64_t len = n - start, heads = (h1 - h0) * GROUP, width = (h1 - h0) * HEAD_DIM;
    int64_t tp = start;
    for (int d = 0; d < PF_RUNS; d++) prefetch_next(&tp, k, v, bt, block_stride, bs, row, width, start, n);
    for (int64_t t0 = start; t0 < n;) {
        const int64_t t1 = run_end(t0, bs, n), rows = t1 - t0;
        const kv_t *kr = run_at(k, bt, block_stride, bs, row, t0);
        prefetch_next(&tp, k, v, bt, block_stride, bs, row, width, start, n);
        for (int64_t h = 0; h < h1 - h0; h++) {
            for (int g = 0; g < GROUP; g++) {
                const float *qg = q + (h * GROUP + g) * HEAD_DIM;
                dvec qv[NV], acc[DW];
                for (int j = 0; j < NV; j++) qv[j] = *(const dvec *)(qg + DW * j);
                #pragma GCC unroll 16
                for (int i = 0; i < DW; i++) {
                    const kv_t *kh = kr + i * row + h * HEAD_DIM;
                    dvec a = {0};
                    if (i < rows)
                        for (int j = 0; j < NV; j++) a += qv[j] * kv_vload(kh + DW * j);
                    acc[i] = a;
                }
                const dvec sc = lane_sums(acc) * scale;
                float *si = s + (h * GROUP + g) * len + (t0 - start);
                if (rows == DW) *(dvec *)si = sc;
                else for (int64_t i = 0; i < rows; i++) si[i] = sc[i];
            }
        }
        t0 = t1;
    }
    for (int64_t i = 0; i < heads; i++) {  /* softmax: each query's scores become its weights */
        float *si = s + i * len, lane_max[DW], m = -FLT_MAX, total = 0.f;
        int64_t t = 0;
        for (int l = 0; l < DW; l++) lane_max[l] = -FLT_MAX;
        for (; t + DW <= len; t += DW)  /* DW running maxima: one vector max per DW scores */
            for (int l = 0; l < DW; l++) lane_max[l] = si[t + l] > lane_max[l] ? si[t + l] : lane_max[l];
        for (; t < len; t++) m = si[t] > m ? si[t] : m;
        for (int l = 0; l < DW; l++) m = lane_max[l] > m ? lane_max[l] : m;
        for (t = 0; t < len; t++) {
            const float e = swiftkv_expf(si[t] - m);
            si[t] = e;
            total += e;
        }
        const float inv = len > 0 ? 1.f / total : 0.f;
        for (t = 0; t < len; t++) si[t] *= inv;
    }
    memset(o, 0, sizeof(float) * heads * HEAD_DIM);
    for (int64_t t0 = start; t0 < n;) {
        const int64_t t1 = run_end(t0, bs, n), rows = t1 - t0;
        const kv_t *vr = run_at(v, bt, block_stride, bs, row, t0);
        prefetch_next(&tp, k, v, bt, block_stride, bs, row, width, start, n);
        for (int64_t h = 0; h < h1 - h0; h++) {
            for (int j0 = 0; j0 < NV; j0 += VCH) {
                float *oh = o + h * GROUP * HEAD_DIM + DW * j0;
                dvec acc[GROUP][VCH];
                for (int g = 0; g < GROUP; g++)
                    for (int j = 0; j < VCH; j++) acc[g][j] = *(dvec *)(oh + g * HEAD_DIM + DW * j);
                for (int64_t i = 0; i < rows; i++) {
                    const kv_t *vh = vr + i * row + h * HEAD_DIM + DW * j0;
                    for (int g = 0; g < GROUP; g++) {
                        const float p = s[(h * GROUP + g) * len + (t0 - start) + i];
                        for (int j = 0; j < VCH; j++) acc[g][j] += p * kv_vload(vh + DW * j);
                    }
                }
                for (int g = 0; g < GROUP; g++)
                    for (int j = 0; j < VCH; j++) *(dvec *)(oh + g * HEAD_DIM + DW * j) = acc[g][j];
            }
        }
        t0 = t1;
    }
}

/* Inside a parallel region (a worksharing loop over the items, so every thread of the region must
   call it): q: (R, kv_heads * GROUP, HEAD_DIM), rows q_stride apart; k, v: (num_blocks, bs, kv_heads,
   HEAD_DIM), blocks block_stride apart; block_tables: (R, >= max_blocks), rows bt_stride apart, int32;
   seq_lens: (R,) int32; out: (R, kv_heads * GROUP, HEAD_DIM) contiguous. window <= 0: none. *failed
   (shared) becomes 1 when out of memory; 2 when a seq_len needs more than max_blocks blocks; 3 when a
   block id it reads is outside [0, num_blocks) (nothing is read then, that row's output is left). */
static void decode_attention_items(const float *q, int64_t q_stride, const kv_t *k, const kv_t *v,
                                   int64_t block_stride, int64_t num_blocks, const int32_t *block_tables,
                                   int64_t bt_stride, int64_t max_blocks, const int32_t *seq_lens,
                                   float *out, int64_t num_reqs, int64_t kv_heads, int64_t bs,
                                   int64_t window, float scale, int num_threads, int *failed) {
    const int64_t row = kv_heads * HEAD_DIM, heads = kv_heads * GROUP;
    /* items: (request, run of KV heads); all heads of a request in one item when there are requests
       enough for the threads, so that each block's rows are read as one run */
    int64_t runs = num_reqs >= num_threads ? 1 : (num_threads + num_reqs - 1) / num_reqs;
    runs = runs < kv_heads ? runs : kv_heads;
    const int64_t per = (kv_heads + runs - 1) / runs;  /* KV heads per item */
    runs = (kv_heads + per - 1) / per;
    #pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_reqs * runs; item++) {
        const int64_t r = item / runs, h0 = (item % runs) * per;
        const int64_t h1 = h0 + per < kv_heads ? h0 + per : kv_heads;
        const int64_t n = seq_lens[r], start = window > 0 && n > window ? n - window : 0;
        const int32_t *bt = block_tables + r * bt_stride;
        if (n > max_blocks * bs) {
            #pragma omp atomic write
            *failed = 2;
            continue;
        }
        int bad = 0;
        for (int64_t b = start / bs; b * bs < n; b++) bad |= bt[b] < 0 || bt[b] >= num_blocks;
        if (bad) {
            #pragma omp atomic write
            *failed = 3;
            continue;
        }
        float *s = malloc(sizeof(float) * (h1 - h0) * GROUP * (n - start > 0 ? n - start : 1));
        if (s == NULL) {
            #pragma omp atomic write
            *failed = 1;
            continue;
        }
        attend(q + r * q_stride + h0 * GROUP * HEAD_DIM, k + h0 * HEAD_DIM, v + h0 * HEAD_DIM, block_stride,
               bt, bs, row, h0, h1, start, n, scale, s, out + (r * heads + h0 * GROUP) * HEAD_DIM);
        free(s);
    }
}

/* decode_attention_items on num_threads threads; returns its failure code (0: none). */
int swiftkv_decode_attention(const float *q, int64_t q_stride, const kv_t *k, const kv_t *v,
                             int64_t block_stride, int64_t num_blocks, const int32_t *block_tables,
                             int64_t bt_stride, int64_t max_blocks, const int32_t *seq_lens, float *out,
                             int64_t num_reqs, int64_t kv_heads, int64_t bs, int64_t window, float scale,
                             int num_threads) {
    int failed = 0;
    #pragma omp parallel num_threads(num_threads)
    decode_attention_items(q, q_stride, k, v, block_stride, num_blocks, block_tables, bt_stride, max_blocks,
                           seq_lens, out, num_reqs, kv_heads, bs, window, scale, num_threads, &failed);
    return failed;
}
"""
)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def supports_shape(head_dim: int, group: int) -> bool:
    """The kernel is built for this head shape: head_dim a multiple of 8 (at most 256), group <= MAX_GROUP."""
    return head_dim % 8 == 0 and head_dim <= 256 and 1 <= group <= MAX_GROUP


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """The kernel applies: fp32 CPU queries, an fp32 or bf16 CPU cache, a supported head shape."""
    head_dim, kv_heads = k_cache.shape[-1], k_cache.shape[-2]
    return (
        q.is_cpu
        and k_cache.is_cpu
        and q.dtype == torch.float32
        and cpu_compile.kv_bf16(k_cache.dtype) is not None
        and q.shape[1] % kv_heads == 0
        and supports_shape(head_dim, q.shape[1] // kv_heads)
    )


# swiftkv_decode_attention's arguments: q, q_stride, k, v, block_stride, num_blocks, block_tables,
# bt_stride, max_blocks, seq_lens, out, num_reqs, kv_heads, bs, window, scale, num_threads
_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
_ARGTYPES += [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
_ARGTYPES += [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
_ARGTYPES += [ctypes.c_float, ctypes.c_int]


def kernel(head_dim: int, group: int, kv_dtype: torch.dtype = torch.float32) -> Callable | None:
    """The compiled kernel for this (head_dim, group) and a cache of `kv_dtype` (fp32 or bf16), built at
    the first call (kernels/cpu_compile.py); None when it cannot be built or loaded here (logged once) or
    is switched off."""
    if not enabled():
        return None
    functions = cpu_compile.load(
        "decode-attention",
        SOURCE,
        {"HEAD_DIM": head_dim, "GROUP": group, "KV_BF16": cpu_compile.kv_bf16(kv_dtype)},
        {"swiftkv_decode_attention": _ARGTYPES},
    )
    return None if functions is None else functions["swiftkv_decode_attention"]


def paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """What the paged C kernels (this one and kernels/cpu_prefill.py) read: q (..., H, D) with dense
    heads, seq_lens int32 contiguous, block_tables int32 with unit column stride; None when the cache
    blocks' rows are not dense (not a layout the engine makes)."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if k_cache.stride()[1:] != (kv_heads * head_dim, head_dim, 1) or v_cache.stride() != k_cache.stride():
        return None
    if q.stride()[-2:] != (head_dim, 1):
        q = q.contiguous()
    block_tables = block_tables.to(torch.int32)
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    return q, seq_lens.to(torch.int32).contiguous(), block_tables


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor | None:
    """q: (R, H, D) fp32; k_cache, v_cache: (num_blocks, block_size, kv_heads, D) fp32 or bf16; seq_lens
    (R,) int; block_tables (R, max_blocks) int -> (R, H, D), or None when the kernel does not apply here
    (`supports`) or is unavailable."""
    if not supports(q, k_cache):
        return None
    num_reqs, num_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    if v_cache.dtype != k_cache.dtype:
        return None
    fn = kernel(head_dim, num_heads // kv_heads, k_cache.dtype)
    if fn is None:
        return None
    inputs = paged_inputs(q, k_cache, v_cache, seq_lens, block_tables)
    if inputs is None:
        return None
    q, seq_lens, block_tables = inputs
    out = torch.empty((num_reqs, num_heads, head_dim), dtype=q.dtype)
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
        raise MemoryError(f"decode attention: out of memory for the scores of {num_reqs} requests")
    if status == 2:
        raise ValueError(
            f"decode attention: a seq_len (max {int(seq_lens.max())}) exceeds its block table "
            f"({block_tables.shape[1]} blocks of {block_size})"
        )
    if status == 3:
        raise ValueError(f"decode attention: a block table reads a block id outside [0, {num_blocks})")
    return out
