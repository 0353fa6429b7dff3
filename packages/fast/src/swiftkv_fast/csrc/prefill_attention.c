/* Prompt attention over the paged KV cache (kernels/cpu_prefill.py). Request r's n_r queries sit at
   positions [s_r - n_r, s_r) (a fresh prompt, a chunk that continues one, or a SwiftKV early-exit
   batch) and see the positions <= their own, and with a window W only those > pos - W. Keys and values
   are read from the cache blocks through the block table: no gathered copy, no padding between
   requests, no mask tensor.

   First every request's visible keys are copied once per KV head into dense (keys, HEAD_DIM) rows (a
   bf16 cache's values too, widened once). Work items are then (request, KV head, tile of QUERY_TILE
   positions), the tiles with the most keys first. An item holds the GROUP query heads of its KV head
   for its positions as rows and walks only the keys they can see, KEY_CHUNK at a time, flash-style
   (running max and sum per row). Inside a tile everything is transposed, rows in the vector lanes:
   S^T = K Q^T by register blocks of RV x VL rows and KB keys, the online softmax on VL rows at once
   (masking only the chunks a row cannot wholly see), O^T += V^T P^T by blocks of RV x VL rows and DB
   output columns. A causal prompt of n tokens costs about n^2 / 2 scores.

   Build defines: HEAD_DIM (a multiple of 16), GROUP, KV_BF16, SWIFTKV_NO_AVX512 (1: the 8-lane blocks
   even where AVX-512 is there; tests run both). */
#include <float.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "isa.h"

#define QUERY_TILE 32    /* positions per work item */
#define KEY_CHUNK 128    /* keys per online-softmax step */

#if SWIFTKV_AVX512
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

/* swiftkv_expf on every lane (common.h's steps) */
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
   window <= 0: none. Checks everything first and returns, having read and written nothing:
   SWIFTKV_BAD_LENGTH when a request has more queries than positions or a negative length, or its
   seq_len needs more than max_blocks blocks; SWIFTKV_BAD_BLOCK when a block id it would read is outside
   [0, num_blocks); SWIFTKV_NO_MEMORY. Else 0. */
int swiftkv_prefill_attention(const float *q, int64_t q_stride, const kv_t *k, const kv_t *v,
                              int64_t block_stride, int64_t num_blocks, const int32_t *block_tables,
                              int64_t bt_stride, int64_t max_blocks, const int32_t *cu_q,
                              const int32_t *seq_lens, float *out, int64_t num_reqs, int64_t kv_heads,
                              int64_t bs, int64_t window, float scale, int num_threads) {
    int64_t *first_item = malloc(sizeof(int64_t) * (num_reqs + 1));
    if (first_item == NULL) return SWIFTKV_NO_MEMORY;
    first_item[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t n = cu_q[r + 1] - cu_q[r], s = seq_lens[r];
        if (n < 0 || s < n || s > max_blocks * bs) {
            free(first_item);
            return SWIFTKV_BAD_LENGTH;
        }
        const int64_t pos0 = s - n, lo = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
        const int32_t *bt = block_tables + r * bt_stride;
        for (int64_t b = n > 0 ? lo / bs : 0; n > 0 && b * bs < s; b++) {
            if (bt[b] < 0 || bt[b] >= num_blocks) {
                free(first_item);
                return SWIFTKV_BAD_BLOCK;
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
        return SWIFTKV_NO_MEMORY;
    }
    k_off[0] = 0;
    for (int64_t r = 0; r < num_reqs; r++) {
        const int64_t n = cu_q[r + 1] - cu_q[r], s = seq_lens[r], pos0 = s - n;
        k_first[r] = window > 0 && pos0 - window + 1 > 0 ? pos0 - window + 1 : 0;
        k_rows[r] = n > 0 ? s - k_first[r] + KB : 0;
        k_off[r + 1] = k_off[r] + kv_heads * HEAD_DIM * k_rows[r];
    }
    /* a bf16 cache's values are widened once per request too (packed_v, laid out as the keys): the P V
       product then broadcasts fp32 values straight from memory instead of widening each use */
    const int64_t packed_n = k_off[num_reqs] > 0 ? k_off[num_reqs] : 1;
    float *packed = malloc(sizeof(float) * packed_n * (KV_BF16 ? 2 : 1));
    float *packed_v = KV_BF16 ? packed + packed_n : NULL;
    if (packed == NULL) {
        free(k_first);
        free(first_item);
        return SWIFTKV_NO_MEMORY;
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
            failed = SWIFTKV_NO_MEMORY;
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
