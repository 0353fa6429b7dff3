/* y = x W^T (+ b) on AMX tiles (kernels/cpu_amx.py), two forms:
   - bf16x3 (PyTorch's "high" float32 matmul precision): every fp32 value v is split into bf16
     hi = bf16(v) and lo = bf16(v - hi); a product is a_hi b_hi + a_hi b_lo + a_lo b_hi (a_lo b_lo, about
     2^-16 of it, is dropped), each term a bf16 product accumulated in fp32 by TDPBF16PS;
   - exact, for a weight whose values are exact in bf16 (lo NULL): x is split in three parts that sum to
     it exactly, so every product is exact and the sums fp32, fp32 arithmetic for the same three tile
     products per block.
   W is packed once into (NB, KB, 16, 32) bf16 tiles in the VNNI order TDPBF16PS reads (tile row k / 2
   holds inputs k, k + 1 of the 16 columns); each call splits x the same way. A register block of
   32 rows x 32 columns keeps four fp32 accumulator tiles over the whole of K; work items are (256 rows,
   32 columns), in contiguous runs per thread so that a thread's rows stay in its L2.
   Where SWIFTKV_AMX is 0 every function returns SWIFTKV_NO_AMX. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"
#include "isa.h"

#if SWIFTKV_AMX
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE 512   /* bf16 values in one tile: 16 rows of 32 */
#define ROWS_PER_ITEM 256

/* 0 when this process may use the AMX tile state, 1 when Linux refuses it (arch_prctl, Linux 5.16+;
   asked once: Linux keeps it for the process) */
int swiftkv_amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) ? 1 : 0;
}

static inline void split(float v, uint16_t *hi, uint16_t *lo) {
    const uint16_t h = bf16_round(v);
    *hi = h;
    *lo = bf16_round(v - bf16_value(h));
}

/* W (N, K), rows ldw apart -> hi, lo: (NB, KB, 16, 32) with tile row k / 2 holding (k, k + 1) of the 16
   columns side by side (VNNI), zeros past N and K; NB = 16-column blocks, KB = 32-feature blocks */
int swiftkv_amx_pack(const float *w, int64_t ldw, int64_t N, int64_t K, int64_t NB, int64_t KB,
                     uint16_t *hi, uint16_t *lo, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int64_t nb = 0; nb < NB; nb++) {
        for (int64_t kb = 0; kb < KB; kb++) {
            uint16_t *th = hi + (nb * KB + kb) * TILE, *tl = lo != NULL ? lo + (nb * KB + kb) * TILE : NULL;
            for (int n = 0; n < 16; n++) {
                const int64_t row = nb * 16 + n;
                for (int k = 0; k < 32; k++) {
                    const int64_t col = kb * 32 + k;
                    const float v = row < N && col < K ? w[row * ldw + col] : 0.f;
                    const int64_t at = (k / 2) * 32 + 2 * n + k % 2;
                    if (lo != NULL)
                        split(v, th + at, tl + at);
                    else
                        th[at] = bf16_round(v);  /* a weight exact in bf16: hi alone */
                }
            }
        }
    }
    return 0;
}

/* y (M, N) contiguous = x (M, K; rows ldx apart) times the packed W^T, plus bias (N,) unless NULL;
   xh: room for the split x, 2 * ceil(M / 32) * 2 * KB tiles */
int swiftkv_amx_linear(const float *x, int64_t ldx, int64_t M, int64_t N, int64_t K, int64_t KB,
                       const uint16_t *hi, const uint16_t *lo, const float *bias, float *y, uint16_t *xh,
                       int num_threads) {
    const int64_t MB = (M + 31) / 32 * 2, NP = (N + 31) / 32;
    const int64_t items_m = (M + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    /* lo NULL: W is exact in bf16 (hi alone), x splits in three (hi, mid in xl, lo in xl2), every
       product x_part w exact: fp32 arithmetic; else bf16x3 */
    const int exact = lo == NULL;
    uint16_t *xl = xh + MB * KB * TILE, *xl2 = xl + MB * KB * TILE;
    #pragma omp parallel num_threads(num_threads)
    {
        /* x -> (MB, KB, 16, 32) hi and lo tiles, zeros past M and K */
        const int64_t full = K / 32;  /* blocks of 32 features inside K: split without a test per value */
        #pragma omp for schedule(static)
        for (int64_t r = 0; r < MB * 16; r++) {
            uint16_t *rh = xh + (r / 16) * KB * TILE + (r % 16) * 32;
            uint16_t *rl = xl + (rh - xh), *rl2 = xl2 + (rh - xh);
            if (r >= M) {
                for (int64_t kb = 0; kb < KB; kb++) {
                    memset(rh + kb * TILE, 0, 64);
                    memset(rl + kb * TILE, 0, 64);
                    if (exact) memset(rl2 + kb * TILE, 0, 64);
                }
                continue;
            }
            const float *xr = x + r * ldx;
            for (int64_t kb = 0; kb < KB; kb++) {
                for (int k = 0; k < 32; k++) {
                    const int64_t col = kb * 32 + k, at = kb * TILE + k;
                    const float v = kb < full || col < K ? xr[col] : 0.f;
                    if (exact)
                        split3(v, rh + at, rl + at, rl2 + at);
                    else
                        split(v, rh + at, rl + at);
                }
            }
        }
        amx_tile_config(8);
        float sums[32 * 32];  /* a block's four accumulator tiles, as (32 rows, 32 columns) */
        #pragma omp for schedule(static) collapse(2)
        for (int64_t item = 0; item < items_m; item++) {
            for (int64_t np = 0; np < NP; np++) {
                const uint16_t *bh0 = hi + 2 * np * KB * TILE, *bh1 = bh0 + KB * TILE;
                const uint16_t *bl0 = lo + 2 * np * KB * TILE, *bl1 = bl0 + KB * TILE;
                const int64_t m_end = (item + 1) * ROWS_PER_ITEM < M ? (item + 1) * ROWS_PER_ITEM : M;
                for (int64_t m = item * ROWS_PER_ITEM; m < m_end; m += 32) {
                    const uint16_t *ah0 = xh + (m / 16) * KB * TILE, *ah1 = ah0 + KB * TILE;
                    const uint16_t *al0 = xl + (m / 16) * KB * TILE, *al1 = al0 + KB * TILE;
                    const uint16_t *am0 = xl2 + (m / 16) * KB * TILE, *am1 = am0 + KB * TILE;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int64_t kb = 0; kb < KB; kb++) {
                        const int64_t o = kb * TILE;
                        _tile_loadd(4, ah0 + o, 64);
                        _tile_loadd(5, ah1 + o, 64);
                        _tile_loadd(6, bh0 + o, 64);
                        _tile_loadd(7, bh1 + o, 64);
                        BLOCK_PRODUCTS();  /* x_hi w_hi */
                        _tile_loadd(4, al0 + o, 64);
                        _tile_loadd(5, al1 + o, 64);
                        BLOCK_PRODUCTS();  /* x_lo w_hi (exact: x_mid w) */
                        if (exact) {
                            _tile_loadd(4, am0 + o, 64);
                            _tile_loadd(5, am1 + o, 64);
                            BLOCK_PRODUCTS();  /* x_lo w */
                            continue;
                        }
                        _tile_loadd(4, ah0 + o, 64);
                        _tile_loadd(5, ah1 + o, 64);
                        _tile_loadd(6, bl0 + o, 64);
                        _tile_loadd(7, bl1 + o, 64);
                        BLOCK_PRODUCTS();  /* x_hi w_lo */
                    }
                    _tile_stored(0, sums, 128);
                    _tile_stored(1, sums + 16, 128);
                    _tile_stored(2, sums + 512, 128);
                    _tile_stored(3, sums + 528, 128);
                    const int64_t cols = N - np * 32 < 32 ? N - np * 32 : 32;
                    for (int64_t r = 0; r < 32 && m + r < M; r++) {
                        float *yr = y + (m + r) * N + np * 32;
                        const float *acc = sums + r * 32;
                        for (int64_t c = 0; c < cols; c++) yr[c] = acc[c] + (bias ? bias[np * 32 + c] : 0.f);
                    }
                }
            }
        }
        _tile_release();
    }
    return 0;
}
#else
int swiftkv_amx_enable(void) { return SWIFTKV_NO_AMX; }  /* the compiler does not target AMX here */
int swiftkv_amx_pack(const float *w, int64_t ldw, int64_t N, int64_t K, int64_t NB, int64_t KB,
                     uint16_t *hi, uint16_t *lo, int num_threads) { return SWIFTKV_NO_AMX; }
int swiftkv_amx_linear(const float *x, int64_t ldx, int64_t M, int64_t N, int64_t K, int64_t KB,
                       const uint16_t *hi, const uint16_t *lo, const float *bias, float *y, uint16_t *xh,
                       int num_threads) {
    return SWIFTKV_NO_AMX;
}
#endif
