"""y = x W^T (+ b) on CPU with Intel AMX tiles at PyTorch's "high" float32 matmul precision (bf16x3):
the `bf16x3` candidate of model/linear_kernels.py, offered only when EngineConfig.matmul_precision is
"high".

Every fp32 value v is split into two bf16 values, hi = bf16(v) and lo = bf16(v - hi), which together
hold about 16 of its 24 significant bits; a product is then a_hi b_hi + a_hi b_lo + a_lo b_hi (a_lo b_lo,
about 2^-16 of it, is dropped), each term a bf16 x bf16 product accumulated in fp32 by TDPBF16PS. That
is what torch.set_float32_matmul_precision("high") permits ("treat each float32 number as the sum of
two bfloat16 numbers"). Measured on N(0, 1) data, K = 576: max abs error 6e-4 against fp64, where
MKL's fp32 sgemm has 9e-5 (and TF32 would have ~1e-2).

W (out, in) is packed once into hi and lo, each (ceil(out / 32) * 2, ceil(in / 32), 16, 32) bf16: one
1-KB tile per 16 output columns and 32 input features, in the VNNI order TDPBF16PS reads (tile row
k / 2 holds the pairs (k, k + 1) of the 16 columns), zeros past `out` and `in`; together they take the
bytes of one fp32 copy. Each call splits x the same way into (ceil(rows / 32) * 2, ceil(in / 32), 16,
32) tiles. A block of 32 rows x 32 columns keeps its four fp32 accumulator tiles in tile registers over
the whole of K, with two A and two B tiles as operands: per 32 input features, hi-hi, lo-hi, hi-lo, 12
tile products and 10 tile loads. Work items are (256 rows, 32 columns), split over torch's OpenMP
threads in contiguous runs, so a thread's rows stay in its L2 across the columns.

Measured on a 2-core Intel Xeon with AMX (family 6 model 167, torch 2.13; one process, interleaved,
median GFLOP/s of fp32 work, MKL's F.linear / oneDNN / this kernel), the embedded model's shapes:
4,096 rows: qkv 256 / 273 / 567, o 316 / 313 / 601, gate_up 281 / 321 / 773, down 335 / 330 / 607;
256 rows: 265-288 / 273-288 / 539-659. At 16 decode rows the weights come from memory and take the
bytes of fp32 here too, so the chooser keeps MKL or the panel GEMM there. Keeping a column pair's
slices in L1 by chunking K measured 5-15% slower than running the whole of K per block.

Built at first use by kernels/cpu_compile.py; it compiles to a stub where the compiler does not target
AMX (-march=native on a CPU without it), and needs Linux's permission for the tile state (arch_prctl
ARCH_REQ_XCOMP_PERM, Linux 5.16+). Where either is missing, or with SWIFTKV_CPU_AMX_KERNEL=0,
`Bf16x3Weight` raises RuntimeError and the chooser drops the candidate with one log line.
"""

from __future__ import annotations

import ctypes
import os
import threading
from functools import cache

import torch

from swiftkv_fast.kernels import cpu_compile
from swiftkv_fast.kernels._common import dense_rows
from swiftkv_fast.kernels.weight_forms import FormMismatch, bf16_exact

ENV_SWITCH = "SWIFTKV_CPU_AMX_KERNEL"
# torch.set_float32_matmul_precision's levels the engine knows (EngineConfig.matmul_precision), most
# precise first: "highest" is fp32 throughout, "high" also permits this kernel's bf16x3
MATMUL_PRECISIONS = ("highest", "high")
TILE_K = 32  # input features per tile (32 bf16: one 64-byte tile row)
BLOCK = 32  # rows and columns of the 2 x 2 accumulator tiles of one register block

# C helpers shared by the AMX kernels (here, kernels/cpu_amx_q4.py, kernels/cpu_gemm.py); each source
# includes them inside its own #if on AMX-TILE and AMX-BF16
AMX_HELPERS = r"""
#ifndef SWIFTKV_AMX_HELPERS
#define SWIFTKV_AMX_HELPERS
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

static inline uint16_t bf16_round(float f) {  /* round to nearest even (inputs are finite) */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* v = hi + mid + lo exactly: each difference is exact in fp32, the last one has at most 8 bits */
static inline void split3(float v, uint16_t *hi, uint16_t *mid, uint16_t *lo) {
    const uint16_t h = bf16_round(v);
    const float r = v - bf16_value(h);
    const uint16_t m = bf16_round(r);
    *hi = h;
    *mid = m;
    *lo = bf16_round(r - bf16_value(m));
}

struct tile_config {
    uint8_t palette, start_row, reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* this thread's tiles 0 .. n - 1 as 16 rows of 64 bytes */
static inline void amx_tile_config(int n) {
    struct tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int t = 0; t < n; t++) {
        config.bytes_per_row[t] = 64;
        config.rows[t] = 16;
    }
    _tile_loadconfig(&config);
}

/* the 2 x 2 accumulators (tiles 0-3) += the two x tiles (4, 5) times the two weight tiles (6, 7) */
#define BLOCK_PRODUCTS()         \
    do {                         \
        _tile_dpbf16ps(0, 4, 6); \
        _tile_dpbf16ps(1, 4, 7); \
        _tile_dpbf16ps(2, 5, 6); \
        _tile_dpbf16ps(3, 5, 7); \
    } while (0)
#endif
"""

SOURCE = (
    r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
"""
    + AMX_HELPERS
    + r"""#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define TILE 512   /* bf16 values in one tile: 16 rows of 32 */
#define ROWS_PER_ITEM 256

/* 0 when this process may use the AMX tile state (asked once; Linux keeps it for the process) */
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
int swiftkv_amx_enable(void) { return 2; }  /* the compiler does not target AMX on this CPU */
int swiftkv_amx_pack(const float *w, int64_t ldw, int64_t N, int64_t K, int64_t NB, int64_t KB,
                     uint16_t *hi, uint16_t *lo, int num_threads) { return 2; }
int swiftkv_amx_linear(const float *x, int64_t ldx, int64_t M, int64_t N, int64_t K, int64_t KB,
                       const uint16_t *hi, const uint16_t *lo, const float *bias, float *y, uint16_t *xh,
                       int num_threads) {
    return 2;
}
#endif
"""
)

_P, _I, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SYMBOLS = {
    "swiftkv_amx_enable": [],
    "swiftkv_amx_pack": [_P, _I, _I, _I, _I, _I, _P, _P, _INT],
    "swiftkv_amx_linear": [_P, _I, _I, _I, _I, _I, _P, _P, _P, _P, _P, _INT],
}
_scratch = threading.local()  # per thread, the split copy of x, grown to the largest call: a fresh
# buffer per call would fault in its pages every time (4,096 x 576 rows: 9 MB, ~20% of the call)


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    if not enabled():
        return f"{ENV_SWITCH}=0"
    if _functions() is None:
        return "no C compiler"
    status = _tile_permission(cpu_compile.max_isa())
    if status == 2:
        return "the C compiler does not target AMX-BF16 on this CPU"
    if status:
        return "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16+)"
    return None


def _functions():
    return cpu_compile.load("amx-gemm", SOURCE, {}, _SYMBOLS)


@cache
def _tile_permission(isa: str) -> int:
    """swiftkv_amx_enable's answer for the kernels built for `isa` (cpu_compile.max_isa: 2 where that
    build has no AMX), asked once per process and build (Linux keeps the permission for the process)."""
    return _functions()["swiftkv_amx_enable"]()


class Bf16x3Weight:
    """W (out, in) fp32 split into bf16 hi and lo tiles for `linear`; `out_features` / `in_features` as
    W's. Raises RuntimeError where the kernel cannot run (see `unavailable_reason`).

    `exact`: W's values are exact in bf16 (a bf16 checkpoint loaded as fp32; else FormMismatch), so W is
    its hi tiles alone (half the bytes) and x is split in three parts that sum to it exactly: every
    product is exact and the sums fp32, fp32 arithmetic at the "highest" precision (the `bf16-amx`
    candidate), for the same three tile products per block as bf16x3."""

    def __init__(self, weight: torch.Tensor, exact: bool = False):
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the AMX bf16x3 kernel is unavailable here ({reason})")
        if weight.dtype != torch.float32 or not weight.is_cpu or weight.dim() != 2:
            raise ValueError(f"the AMX kernel takes a 2-d fp32 CPU weight, got {weight.dtype} {weight.shape}")
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self._k_blocks = -(-self.in_features // TILE_K)
        n_blocks = -(-self.out_features // BLOCK) * 2  # 16-column tiles, in pairs
        if exact and not bf16_exact(weight):
            raise FormMismatch(f"a {tuple(weight.shape)} weight whose values are not all exact in bf16")
        self.exact = exact
        self.hi = torch.empty(n_blocks, self._k_blocks, 16, TILE_K, dtype=torch.int16)  # bf16 bits
        self.lo = None if exact else torch.empty_like(self.hi)
        self._functions = _functions()
        self._functions["swiftkv_amx_pack"](
            weight.data_ptr(),
            weight.stride(0),
            self.out_features,
            self.in_features,
            n_blocks,
            self._k_blocks,
            self.hi.data_ptr(),
            None if self.lo is None else self.lo.data_ptr(),
            torch.get_num_threads(),
        )

    @property
    def nbytes(self) -> int:
        return (1 if self.lo is None else 2) * self.hi.numel() * self.hi.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) fp32 -> (..., out)."""
        x2 = dense_rows(x, self.in_features, "AMX kernel")
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features)
        parts = 3 if self.exact else 2  # x split in three (exact) or two (bf16x3)
        if rows:
            self._functions["swiftkv_amx_linear"](
                x2.data_ptr(),
                x2.stride(0),
                rows,
                self.out_features,
                self.in_features,
                self._k_blocks,
                self.hi.data_ptr(),
                None if self.lo is None else self.lo.data_ptr(),
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                _split_buffer(parts * -(-rows // BLOCK) * 2 * self._k_blocks * 16 * TILE_K).data_ptr(),
                torch.get_num_threads(),
            )
        return y.view(*x.shape[:-1], self.out_features)


def _split_buffer(values: int) -> torch.Tensor:
    """This thread's scratch of at least `values` bf16 values, kept for the next call."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < values:
        buffer = _scratch.buffer = torch.empty(values, dtype=torch.int16)
    return buffer
