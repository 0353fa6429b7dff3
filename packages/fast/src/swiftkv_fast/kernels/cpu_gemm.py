"""y = x W^T (+ b) on CPU in fp32 as a compiled C kernel over W packed in panels of 16 output columns:
the `panel` candidate of model/linear_kernels.py.

W (out, in) is packed once into (ceil(out / 16), in, 16): panel p holds output columns [16 p, 16 p + 16)
with each input index's 16 weights side by side (zeros past `out`). A register block of up to 6 rows
of x times one panel accumulates 6 x 16 outputs in 12 vector registers, one broadcast x value times
two 8-wide weight vectors per FMA pair, in passes of IN_BLOCK input features whose slice of the panel
stays in L1 while every row block of the item passes over it: a decode batch reads each weight once
from memory.
Work items are (block of ROWS_PER_ITEM rows, panel), split over torch's OpenMP threads in contiguous
runs, so that each thread keeps its rows in cache across the panels it takes.

Why it exists: measured on a 2-core AMD EPYC (AVX2), a 16-row product with weights coming from
memory ran at 29-45 GFLOP/s through MKL (F.linear) and 44-55 through oneDNN, against 66-74 through this
kernel, while the machine's FMA peak is up to 195 GFLOP/s and its memory bandwidth ~20 GB/s; decode
steps of the embedded model spent ~60% of their time in these products. The chooser times this kernel
beside the libraries' and keeps whichever is faster per shape and row count, so a machine where a
library wins keeps the library.

Built at first use by kernels/cpu_compile.py (-O3 -march=native, OpenMP where torch uses it). Without a
compiler, or with SWIFTKV_CPU_GEMM_KERNEL=0, `PanelWeight` raises RuntimeError and the chooser drops
the candidate with one log line.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable

import torch

from swiftkv_fast.kernels import cpu_compile

ENV_SWITCH = "SWIFTKV_CPU_GEMM_KERNEL"
PANEL = 16  # output columns per panel

SOURCE = r"""
#include <stdint.h>
#include <string.h>

#define ROWS_PER_ITEM 96  /* rows of x an item keeps in cache across its panel */
#define IN_BLOCK 256      /* input features per pass: 16 KB of panel and 6 rows of x stay in L1 */
typedef float v8 __attribute__((vector_size(32), aligned(4)));

/* y[R][16] (rows ldy apart) = x[R][K] (rows ldx apart) . panel[K][16], plus y's own values when
   `add` (the partial sums of the preceding K block) */
#define MICRO(R)                                                                                  \
static void micro##R(const float *x, int64_t ldx, const float *panel, int64_t K, float *y,          \
                     int64_t ldy, int add) {                                                      \
    v8 acc[R][2];                                                                                 \
    for (int r = 0; r < R; r++) {                                                                 \
        if (add) {                                                                                \
            acc[r][0] = *(const v8 *)(y + r * ldy);                                               \
            acc[r][1] = *(const v8 *)(y + r * ldy + 8);                                           \
        } else {                                                                                  \
            acc[r][0] = acc[r][1] = (v8){0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};                 \
        }                                                                                         \
    }                                                                                             \
    for (int64_t k = 0; k < K; k++) {                                                             \
        const v8 w0 = *(const v8 *)(panel + 16 * k), w1 = *(const v8 *)(panel + 16 * k + 8);      \
        for (int r = 0; r < R; r++) {                                                             \
            const float xv = x[r * ldx + k];                                                      \
            acc[r][0] += xv * w0;                                                                 \
            acc[r][1] += xv * w1;                                                                 \
        }                                                                                         \
    }                                                                                             \
    for (int r = 0; r < R; r++) {                                                                 \
        *(v8 *)(y + r * ldy) = acc[r][0];                                                         \
        *(v8 *)(y + r * ldy + 8) = acc[r][1];                                                     \
    }                                                                                             \
}
MICRO(1) MICRO(2) MICRO(3) MICRO(4) MICRO(5) MICRO(6)

static void micro(int rows, const float *x, int64_t ldx, const float *panel, int64_t K, float *y,
                  int64_t ldy, int add) {
    switch (rows) {
        case 1: micro1(x, ldx, panel, K, y, ldy, add); break;
        case 2: micro2(x, ldx, panel, K, y, ldy, add); break;
        case 3: micro3(x, ldx, panel, K, y, ldy, add); break;
        case 4: micro4(x, ldx, panel, K, y, ldy, add); break;
        case 5: micro5(x, ldx, panel, K, y, ldy, add); break;
        default: micro6(x, ldx, panel, K, y, ldy, add); break;
    }
}

/* w: (N, K) rows ldw apart -> packed: (ceil(N / 16), K, 16), zero past N. */
int swiftkv_gemm_pack(const float *w, int64_t ldw, int64_t N, int64_t K, float *packed, int num_threads) {
    const int64_t panels = (N + 15) / 16;
    #pragma omp parallel for num_threads(num_threads)
    for (int64_t p = 0; p < panels; p++) {
        float *dst = packed + p * K * 16;
        for (int64_t k = 0; k < K; k++)
            for (int c = 0; c < 16; c++) {
                const int64_t n = 16 * p + c;
                dst[16 * k + c] = n < N ? w[n * ldw + k] : 0.f;
            }
    }
    return 0;
}

/* y (M, N) contiguous = x (M, K), rows ldx apart, times the packed W^T, plus bias (N,) unless NULL. */
int swiftkv_gemm(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t M,
                 int64_t N, int64_t K, int num_threads) {
    const int64_t panels = (N + 15) / 16, row_blocks = (M + ROWS_PER_ITEM - 1) / ROWS_PER_ITEM;
    #pragma omp parallel for schedule(static) num_threads(num_threads) if (row_blocks * panels > 1)
    for (int64_t item = 0; item < row_blocks * panels; item++) {
        const int64_t m0 = (item / panels) * ROWS_PER_ITEM, p = item % panels;
        const int64_t m1 = m0 + ROWS_PER_ITEM < M ? m0 + ROWS_PER_ITEM : M, n0 = 16 * p;
        const float *panel = packed + p * K * 16;
        const int full = n0 + 16 <= N;
        float tmp[ROWS_PER_ITEM * 16];  /* a panel past N: its outputs before the copy */
        float *out = full ? y + m0 * N + n0 : tmp;
        const int64_t ldo = full ? N : 16;
        for (int64_t k0 = 0; k0 < K; k0 += IN_BLOCK) {
            const int64_t kc = K - k0 < IN_BLOCK ? K - k0 : IN_BLOCK;
            for (int64_t m = m0; m < m1; m += 6) {
                const int rows = m1 - m < 6 ? (int)(m1 - m) : 6;
                micro(rows, x + m * ldx + k0, ldx, panel + 16 * k0, kc, out + (m - m0) * ldo, ldo, k0 > 0);
            }
        }
        const int64_t width = full ? 16 : N - n0;
        for (int64_t m = m0; m < m1; m++) {
            float *dst = y + m * N + n0;
            if (!full) memcpy(dst, tmp + (m - m0) * 16, sizeof(float) * width);
            if (bias != NULL)
                for (int64_t c = 0; c < width; c++) dst[c] += bias[n0 + c];
        }
    }
    return 0;
}
"""

_PACK_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
_PACK_ARGTYPES += [ctypes.c_int]
_GEMM_ARGTYPES = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
_GEMM_ARGTYPES += [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def _functions() -> dict[str, Callable] | None:
    if not enabled():
        return None
    return cpu_compile.load(
        "panel-gemm", SOURCE, {}, {"swiftkv_gemm_pack": _PACK_ARGTYPES, "swiftkv_gemm": _GEMM_ARGTYPES}
    )


class PanelWeight:
    """W (out, in) packed in 16-column panels for `linear`; `out_features` / `in_features` as W's."""

    def __init__(self, weight: torch.Tensor):
        functions = _functions()
        if functions is None:
            raise RuntimeError(
                f"the panel GEMM kernel is unavailable here (no C compiler, or {ENV_SWITCH}=0)"
            )
        if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"the panel GEMM takes a 2-d fp32 CPU weight, got {weight.dtype} {weight.shape}")
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        panels = -(-self.out_features // PANEL)
        self.packed = torch.empty(panels, self.in_features, PANEL)  # (panels, in, 16)
        functions["swiftkv_gemm_pack"](
            weight.data_ptr(),
            weight.stride(0),
            self.out_features,
            self.in_features,
            self.packed.data_ptr(),
            torch.get_num_threads(),
        )
        self._gemm = functions["swiftkv_gemm"]

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) fp32 -> (..., out)."""
        if x.dtype != torch.float32 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"the panel GEMM takes fp32 rows of {self.in_features}, got {x.dtype} {tuple(x.shape)}"
            )
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.stride(1) != 1:
            x2 = x2.contiguous()
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features)
        if rows:
            self._gemm(
                x2.data_ptr(),
                x2.stride(0),
                self.packed.data_ptr(),
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                rows,
                self.out_features,
                self.in_features,
                torch.get_num_threads(),
            )
        return y.view(*lead, self.out_features)
