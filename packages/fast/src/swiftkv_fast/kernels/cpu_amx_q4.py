"""y = x W^T (+ b) on CPU with Intel AMX tiles for a weight that is exactly 4-bit blocks
(kernels/weight_forms.py: W = d q + m per 32 inputs of an output row, codes q in [0, 16)), in fp32
arithmetic: the `q4-amx` candidate of model/linear_kernels.py, permitted at the "highest" float32 matmul
precision.

Every product is exact. A code q is an integer below 16, exact in bf16. Every fp32 input v is split into
three bf16 values, hi = bf16(v), mid = bf16(v - hi), lo = v - hi - mid (exact in bf16: hi and mid take
8 significant bits each, lo holds the last 8), so v = hi + mid + lo exactly, and each bf16 x bf16 product
(at most 16 significant bits) is exact in the fp32 accumulators of TDPBF16PS. Per block of 32 inputs the
tiles give S = sum_k x_k q_k (three tile products per operand pair, accumulated in fp32), and then
y += d S + m X with X = sum_k x_k, the block's row sum, in fp32 vector FMAs. So y is the fp32 dot product
of x and the fp32 weights, summed in another order than a sequential FMA chain (as any GEMM library's
blocking does): the bf16x3 kernel of kernels/cpu_amx.py drops the lo x lo terms of arbitrary fp32
weights, which is why it needs the "high" precision level; here no term is dropped.

Layout: codes as bf16 tiles, (ceil(out / 32) * 2, in / 32, 16, 32), tile row k / 2 holding the pairs
(k, k + 1) of 16 columns (the VNNI order TDPBF16PS reads), zeros past `out`; d and m as (ceil(out / 32) *
2, in / 32, 16) fp32: 2.25 bytes per weight where the fp32 weight takes 4. A register block is 32 rows x
32 columns (four accumulator tiles), zeroed per block of inputs; work items are (256 rows, 32 columns)
over torch's OpenMP threads, as in kernels/cpu_amx.py.

Built at first use by kernels/cpu_compile.py; needs what kernels/cpu_amx.py needs (a compiler targeting
AMX-BF16, Linux's permission for the tile state), and SWIFTKV_CPU_AMX_KERNEL=0 turns both off.
"""

from __future__ import annotations

import ctypes
import threading

import torch

from swiftkv_fast.kernels import cpu_amx, cpu_compile
from swiftkv_fast.kernels._common import dense_rows
from swiftkv_fast.kernels.weight_forms import Q4_BLOCK, FormMismatch, q4_blocks

TILE_K = 32  # inputs per tile: one block of the 4-bit form
BLOCK = 32  # rows and columns of a register block

SOURCE = (
    r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
"""
    + cpu_amx.AMX_HELPERS
    + r"""
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
    return 2;
}
#endif
"""
)

_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SYMBOLS = {"swiftkv_amx_q4_linear": [_P, _I, _I, _I, _I, _P, _P, _P, _P, _P, _P, _P, _INT]}
_scratch = threading.local()  # per thread, the split x and its block sums, grown to the largest call


class Q4AmxWeight:
    """W (out, in) fp32 with an exact 4-bit form, as bf16 code tiles and fp32 d, m for `linear`.
    Raises FormMismatch for a weight without one, RuntimeError where AMX cannot run here."""

    def __init__(self, weight: torch.Tensor):
        reason = cpu_amx.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the AMX kernels are unavailable here ({reason})")
        found = q4_blocks(weight)
        if found is None:
            raise FormMismatch(f"a {tuple(weight.shape)} weight that is not exactly 4-bit blocks")
        d, m, q = found
        self.out_features, self.in_features = weight.shape
        self._k_blocks = self.in_features // Q4_BLOCK
        n_blocks = -(-self.out_features // BLOCK) * 2
        pad = n_blocks * 16 - self.out_features
        q = torch.nn.functional.pad(q, (0, 0, 0, pad)).to(torch.bfloat16)  # exact: integers below 16
        pairs = q.view(n_blocks, 16, self._k_blocks, TILE_K // 2, 2)
        # (n_blocks, k_blocks, 16 pairs, 16 columns, 2): tile row k / 2 holds (k, k + 1) of every column
        self.codes = pairs.permute(0, 2, 3, 1, 4).contiguous().view(torch.int16)
        self.d, self.m = (
            torch.nn.functional.pad(t, (0, 0, 0, pad))
            .view(n_blocks, 16, self._k_blocks)
            .transpose(1, 2)
            .contiguous()
            for t in (d, m)
        )
        self._run = cpu_compile.load("amx-q4-gemm", SOURCE, {}, _SYMBOLS)["swiftkv_amx_q4_linear"]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) fp32 -> (..., out)."""
        x2 = dense_rows(x, self.in_features, "AMX 4-bit kernel")
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features)
        if rows:
            padded = -(-rows // BLOCK) * BLOCK
            split, sums = _scratch_buffers(3 * padded * self._k_blocks * TILE_K, padded * self._k_blocks)
            status = self._run(
                x2.data_ptr(),
                x2.stride(0),
                rows,
                self.out_features,
                self._k_blocks,
                self.codes.data_ptr(),
                self.d.data_ptr(),
                self.m.data_ptr(),
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                split.data_ptr(),
                sums.data_ptr(),
                torch.get_num_threads(),
            )
            if status:
                raise RuntimeError("the AMX 4-bit kernel was built without AMX")
        return y.view(*x.shape[:-1], self.out_features)


def _scratch_buffers(split_values: int, sum_values: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's scratch for the split x (bf16 bits) and its block sums, kept for the next call."""
    split, sums = getattr(_scratch, "buffers", (None, None))
    if split is None or split.numel() < split_values or sums.numel() < sum_values:
        split = torch.empty(max(split_values, 0 if split is None else split.numel()), dtype=torch.int16)
        sums = torch.empty(max(sum_values, 0 if sums is None else sums.numel()))
        _scratch.buffers = (split, sums)
    return split, sums
