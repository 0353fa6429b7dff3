/* y = x W^T (+ b) on AMX tiles for a weight that is exactly 4-bit blocks (kernels/cpu_amx_q4.py;
   W = d q + m per 32 inputs of an output row, codes q in [0, 16)), in fp32 arithmetic: every product is
   exact. A code is exact in bf16; every fp32 input v is split into hi = bf16(v), mid = bf16(v - hi),
   lo = v - hi - mid (exact in bf16), so each bf16 product is exact in TDPBF16PS's fp32 accumulators.
   Per block of 32 inputs the tiles give S = sum_k x_k q_k, then y += d S + m X, X the block's row sum,
   in fp32 vector FMAs: the fp32 dot product, summed in another order than a sequential FMA chain.
   Codes as bf16 tiles (NB, KB, 16, 32) in VNNI order, d and m as (NB, KB, 16) fp32. A register block is
   32 rows x 32 columns; work items are (256 rows, 32 columns) over the OpenMP threads.
   Where SWIFTKV_AMX is 0 it returns SWIFTKV_NO_AMX. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "isa.h"

#if SWIFTKV_AMX
#define TILE 512   /* bf16 values in one tile: 16 rows of 32 */
#define ROWS_PER_ITEM 256

typedef float vec __attribute__((vector_size(64), aligned(4)));

/* y (M, N) contiguous = x (M, K = 32 KB; rows ldx apart) times W^T for W = d q + m, plus bias unless
   NULL. codes: (NB, KB, 16, 32) bf16; d, m: (NB, KB, 16); NB even. xs: room for the split x, 3 pieces of
   ceil(M / 32) * 2 * KB tiles; sums: room for ceil(M / 32) * 32 * KB floats. */
int swiftkv_amx_q4_linear(const float *x, int64_t ldx, int64_t M, int64_t N, int64_t KB,
                          const uint16_t *codes, const float *d, const float *m, const float *bias,
                          float *y, uint16_t *xs, float *sums, int num_threads) {
    const int64_t MB = (M + 31) / 32 * 2, NP = (N + 31) / 32, piece = MB * KB * TILE;
    const int64_t items_m = (M + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    #pragma omp parallel num_threads(num_threads)
    {
        /* x -> three (MB, KB, 16, 32) bf16 pieces and the row sums of each block, zeros past M */
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < MB * 16; r++) {
            uint16_t *rh = xs + (r / 16) * KB * TILE + (r % 16) * 32;
            float *rs = sums + r * KB;
            if (r >= M) {
                for (int64_t kb = 0; kb < KB; kb++) {
                    for (int p = 0; p < 3; p++) memset(rh + p * piece + kb * TILE, 0, 64);
                    rs[kb] = 0.f;
                }
                continue;
            }
            const float *xr = x + r * ldx;
            for (int64_t kb = 0; kb < KB; kb++) {
                float s = 0.f;
                for (int k = 0; k < 32; k++) {
                    const float v = xr[kb * 32 + k];
                    uint16_t *t = rh + kb * TILE + k;
                    split3(v, t, t + piece, t + 2 * piece);
                    s += v;
                }
                rs[kb] = s;
            }
        }
        amx_tile_config(8);
        float part[32 * 32];  /* a block of inputs' S, as (32 rows, 32 columns) */
        vec acc[32][2];       /* the register block's y */
        #pragma omp for schedule(static) collapse(2)
        for (int64_t item = 0; item < items_m; item++) {
            for (int64_t np = 0; np < NP; np++) {
                const uint16_t *b0 = codes + 2 * np * KB * TILE, *b1 = b0 + KB * TILE;
                const float *d0 = d + 2 * np * KB * 16, *d1 = d0 + KB * 16;
                const float *m0 = m + 2 * np * KB * 16, *m1 = m0 + KB * 16;
                const int64_t m_end = (item + 1) * ROWS_PER_ITEM < M ? (item + 1) * ROWS_PER_ITEM : M;
                for (int64_t row = item * ROWS_PER_ITEM; row < m_end; row += 32) {
                    const uint16_t *a0 = xs + (row / 16) * KB * TILE, *a1 = a0 + KB * TILE;
                    for (int r = 0; r < 32; r++) acc[r][0] = acc[r][1] = (vec){0};
                    for (int64_t kb = 0; kb < KB; kb++) {
                        const int64_t o = kb * TILE;
                        _tile_zero(0);
                        _tile_zero(1);
                        _tile_zero(2);
                        _tile_zero(3);
                        _tile_loadd(6, b0 + o, 64);
                        _tile_loadd(7, b1 + o, 64);
                        for (int p = 0; p < 3; p++) {
                            _tile_loadd(4, a0 + p * piece + o, 64);
                            _tile_loadd(5, a1 + p * piece + o, 64);
                            BLOCK_PRODUCTS();
                        }
                        _tile_stored(0, part, 128);
                        _tile_stored(1, part + 16, 128);
                        _tile_stored(2, part + 512, 128);
                        _tile_stored(3, part + 528, 128);
                        const vec dv0 = *(const vec *)(d0 + kb * 16), dv1 = *(const vec *)(d1 + kb * 16);
                        const vec mv0 = *(const vec *)(m0 + kb * 16), mv1 = *(const vec *)(m1 + kb * 16);
                        const float *rs = sums + row * KB + kb;
                        for (int r = 0; r < 32; r++) {
                            const float xsum = rs[r * KB];
                            acc[r][0] += dv0 * *(const vec *)(part + 32 * r) + mv0 * xsum;
                            acc[r][1] += dv1 * *(const vec *)(part + 32 * r + 16) + mv1 * xsum;
                        }
                    }
                    const int64_t cols = N - np * 32 < 32 ? N - np * 32 : 32;
                    for (int64_t r = 0; r < 32 && row + r < M; r++) {
                        float *yr = y + (row + r) * N + np * 32;
                        const float *a = (const float *)acc[r];
                        for (int64_t c = 0; c < cols; c++) yr[c] = a[c] + (bias ? bias[np * 32 + c] : 0.f);
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}
#else
int swiftkv_amx_q4_linear(const float *x, int64_t ldx, int64_t M, int64_t N, int64_t KB,
                          const uint16_t *codes, const float *d, const float *m, const float *bias,
                          float *y, uint16_t *xs, float *sums, int num_threads) {
    return SWIFTKV_NO_AMX;
}
#endif
