/* Decode attention over the paged KV cache (kernels/cpu_decode.py): one query per request (at position
   seq_lens[r] - 1) against its context, read straight from the cache blocks through the block table.
   Every K and V row is read once, no gathered copy, and the GROUP query heads of one KV head share each
   row read (GQA without repeats). With a window W only positions >= seq_len - W are read; a request
   with seq_len 0 (padding) gets zeros.

   Work items are requests (a run of a request's KV heads each only when there are fewer requests than
   threads), so that a block's K (or V) is read as one contiguous run. Per item: the scaled scores of
   every position, a softmax, then the weighted sum of V. Positions go in runs of DW inside one block: a
   run's DW dot products of one query fold into one vector of scores (lane_sums), its weighted V rows add
   up in registers, and the run PF_RUNS ahead is prefetched a few lines per query head while this one
   is used (a thread is limited by the misses it keeps in flight beside its arithmetic). The kernel is
   bound by its reads: a bf16 cache (-DKV_BF16=1) halves them, widening each run to fp32 exactly in
   registers.

   Build defines: HEAD_DIM (a multiple of 8, at most 256), GROUP (query heads per KV head, at most 16),
   KV_BF16. */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "isa.h"

/* The scores' and the outputs' vectors: DW lanes (16 with AVX-512 where HEAD_DIM allows, else 8). */
#if SWIFTKV_AVX512 && HEAD_DIM % 16 == 0
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
/* output vectors of one query accumulated at once in registers */
#define VCH (NV % 8 == 0 ? 8 : NV % 4 == 0 ? 4 : NV % 2 == 0 ? 2 : 1)

/* DW cached values at p as floats: bf16 widens to fp32 exactly (zero-extend, shift into the upper half) */
#if KV_BF16 && DW == 16
static inline dvec kv_vload(const kv_t *p) {  /* one vpmovzxwd from memory, one shift */
    return (dvec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
}
#elif KV_BF16 && SWIFTKV_AVX2
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

/* Software prefetch of the run PF_RUNS ahead, spread over the steps of the run being read: a burst of
   a whole run's lines at once fills the core's miss buffers and stalls the loads in between, while a
   few lines per step keep the reads in flight beside the arithmetic. */
#define PF_RUNS 2

typedef struct {
    const kv_t *p;                 /* the queued run: rows of width values, row apart */
    int64_t rows, row, width;
    int64_t i, j;                  /* the next line to prefetch: row i, value j */
    int64_t per_step;              /* lines per prefetch_step */
} prefetcher;

static inline void prefetch_step(prefetcher *pf) {
    for (int64_t c = pf->per_step; c > 0 && pf->i < pf->rows; c--) {
        __builtin_prefetch(pf->p + pf->i * pf->row + pf->j, 0, 3);
        if ((pf->j += KV_LINE) >= pf->width) pf->j = 0, pf->i++;
    }
}

/* Queue the rows [0, rows) of the run at p (width values each, row apart) to be prefetched over `steps`
   prefetch_step calls; what is left of the run queued before is prefetched now. */
static inline void prefetch_queue(prefetcher *pf, const kv_t *p, int64_t rows, int64_t row, int64_t width,
                                  int64_t steps) {
    pf->per_step = INT64_MAX;
    prefetch_step(pf);
    if (width == row) width *= rows, rows = 1;  /* every head's values: one contiguous stretch */
    const int64_t lines = rows * ((width + KV_LINE - 1) / KV_LINE);
    *pf = (prefetcher){p, rows, row, width, 0, 0, (lines + steps - 1) / steps};
}

/* The prefetch cursor walks K's runs, then V's: *tp in [start, n) is K's run at *tp, in [n, n + len)
   V's at *tp - len. One call queues the run at the cursor and moves the cursor on. */
static inline void prefetch_next(prefetcher *pf, int64_t *tp, const kv_t *k, const kv_t *v, const int32_t *bt,
                                 int64_t block_stride, int64_t bs, int64_t row, int64_t width, int64_t start,
                                 int64_t n, int64_t steps) {
    const int64_t len = n - start;
    if (*tp < n) {
        const int64_t e = run_end(*tp, bs, n);
        prefetch_queue(pf, run_at(k, bt, block_stride, bs, row, *tp), e - *tp, row, width, steps);
        *tp = e;  /* run_end never passes n */
    } else if (*tp < n + len) {
        const int64_t t = *tp - len, e = run_end(t, bs, n);
        prefetch_queue(pf, run_at(v, bt, block_stride, bs, row, t), e - t, row, width, steps);
        *tp = e + len;
    }
}

/* KV heads [h0, h1) of one request against positions [start, n): q: (heads, HEAD_DIM) from head h0's
   first query on; k, v point at head h0's values of block 0, row 0; s: (h1 - h0) * GROUP * (n - start)
   scores; o: (h1 - h0) * GROUP * HEAD_DIM outputs. Positions go in runs of up to DW inside one block
   (a position's values of these heads are adjacent, so a run is one contiguous stretch of memory),
   a later run prefetched while this one is used: blocks sit anywhere in the cache. A run's scores of
   one query come out as one vector (lane_sums), its outputs add up in registers. */
static void attend(const float *q, const kv_t *k, const kv_t *v, int64_t block_stride, const int32_t *bt,
                   int64_t bs, int64_t row, int64_t h0, int64_t h1, int64_t start, int64_t n, float scale,
                   float *s, float *o) {
    const int64_t len = n - start, heads = (h1 - h0) * GROUP, width = (h1 - h0) * HEAD_DIM;
    int64_t tp = start;
    prefetcher pf = {0};
    for (int d = 0; d < PF_RUNS; d++)
        prefetch_next(&pf, &tp, k, v, bt, block_stride, bs, row, width, start, n, 1);
    for (int64_t t0 = start; t0 < n;) {
        const int64_t t1 = run_end(t0, bs, n), rows = t1 - t0;
        const kv_t *kr = run_at(k, bt, block_stride, bs, row, t0);
        prefetch_next(&pf, &tp, k, v, bt, block_stride, bs, row, width, start, n, heads);
        for (int64_t h = 0; h < h1 - h0; h++) {
            for (int g = 0; g < GROUP; g++) {
                prefetch_step(&pf);
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
        prefetch_next(&pf, &tp, k, v, bt, block_stride, bs, row, width, start, n, heads);
        for (int64_t h = 0; h < h1 - h0; h++) {
            for (int g = 0; g < GROUP; g++) {
                prefetch_step(&pf);
                const float *sg = s + (h * GROUP + g) * len + (t0 - start);
                for (int j0 = 0; j0 < NV; j0 += VCH) {
                    float *og = o + (h * GROUP + g) * HEAD_DIM + DW * j0;
                    dvec acc[VCH];
                    for (int j = 0; j < VCH; j++) acc[j] = *(dvec *)(og + DW * j);
                    for (int64_t i = 0; i < rows; i++) {
                        const kv_t *vh = vr + i * row + h * HEAD_DIM + DW * j0;
                        const float p = sg[i];
                        for (int j = 0; j < VCH; j++) acc[j] += p * kv_vload(vh + DW * j);
                    }
                    for (int j = 0; j < VCH; j++) *(dvec *)(og + DW * j) = acc[j];
                }
            }
        }
        t0 = t1;
    }
}

/* Inside a parallel region (a worksharing loop over the items, so every thread of the region must
   call it): q: (R, kv_heads * GROUP, HEAD_DIM), rows q_stride apart; k, v: (num_blocks, bs, kv_heads,
   HEAD_DIM), blocks block_stride apart; block_tables: (R, >= max_blocks), rows bt_stride apart, int32;
   seq_lens: (R,) int32; out: (R, kv_heads * GROUP, HEAD_DIM) contiguous. window <= 0: none. *failed
   (shared) becomes SWIFTKV_NO_MEMORY, SWIFTKV_BAD_LENGTH (a seq_len needs more than max_blocks blocks)
   or SWIFTKV_BAD_BLOCK (a block id it reads is outside [0, num_blocks): nothing is read then, that
   request's output is left). */
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
            *failed = SWIFTKV_BAD_LENGTH;
            continue;
        }
        int bad = 0;
        for (int64_t b = start / bs; b * bs < n; b++) bad |= bt[b] < 0 || bt[b] >= num_blocks;
        if (bad) {
            #pragma omp atomic write
            *failed = SWIFTKV_BAD_BLOCK;
            continue;
        }
        float *s = malloc(sizeof(float) * (h1 - h0) * GROUP * (n - start > 0 ? n - start : 1));
        if (s == NULL) {
            #pragma omp atomic write
            *failed = SWIFTKV_NO_MEMORY;
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
