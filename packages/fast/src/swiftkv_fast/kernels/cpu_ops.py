"""The model's small ops on CPU in fp32 as compiled C kernels: RMSNorm (with the residual add fused in
front), SiLU-and-mul and in-place RoPE (model/layers.py calls them; the torch ops stay the portable
path and the specification), the KV cache write by slot (the torch attention backend's write_kv),
and the greedy sampler's argmax (and logsumexp) over each row of logits (sampler.py).

Each reads its input once and writes its output once, where the torch ops make two to four passes
over the rows, and allocate a fresh output per op. A step of 16 decode rows spends most of those ops'
time in dispatch (about 60 torch calls a layer); a 4,096-token prefill step spends it in memory passes
(silu_and_mul's output, for one, is a strided view that the next GEMM copies again). Rows are split
over torch's OpenMP threads when a call has at least PARALLEL_MIN elements, else run on one.

Built at first use by kernels/cpu_compile.py; without a compiler, or with SWIFTKV_CPU_OPS_KERNEL=0
(read once, at the process's first op), every wrapper returns None and model/layers.py runs the
torch ops.
"""

from __future__ import annotations

import ctypes
import os

import torch

from swiftkv_fast.kernels import cpu_compile

ENV_SWITCH = "SWIFTKV_CPU_OPS_KERNEL"
PARALLEL_MIN = 1 << 16  # elements below which a call runs on one thread (a parallel region costs ~us)

SOURCE = (
    cpu_compile.EXPF
    + cpu_compile.ROW_OPS
    + cpu_compile.KV_TYPES
    + r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* h: (T, H), rows h_stride apart; d: NULL, or (T, H) rows d_stride apart that are added to h first
   (in place: h += d); w: (H,); out: (T, H) contiguous = h * rsqrt(mean(h^2) + eps) * w. */
int swiftkv_add_rms_norm(float *h, int64_t h_stride, const float *d, int64_t d_stride, const float *w,
                         float *out, int64_t T, int64_t H, float eps, int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (T * H >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        float *ht = h + t * h_stride, *ot = out + t * H;
        const float r = swiftkv_add_rms_scale(ht, d != NULL ? d + t * d_stride : NULL, H, eps);
        for (int64_t i = 0; i < H; i++) ot[i] = (ht[i] * r) * w[i];
    }
    return 0;
}

/* gu: (T, 2 I) rows gu_stride apart, [gate | up]; out: (T, I) contiguous = silu(gate) * up. */
int swiftkv_silu_and_mul(const float *gu, int64_t gu_stride, float *out, int64_t T, int64_t I,
                         int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (T * I >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        const float *g = gu + t * gu_stride, *u = g + I;
        float *o = out + t * I;
        swiftkv_silu_mul_row(g, u, o, I);
    }
    return 0;
}

typedef float v8f __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

/* The largest number of r[0..V), NaNs left out (a blend on 8 lanes: the compiler keeps a scalar
   `a > b ? a : b` loop scalar, as it cannot assume there is no NaN). */
static float row_max(const float *r, int64_t V) {
    float m = r[0];
    int64_t i = 0;
    if (V >= 8) {
        v8f vm = *(const v8f *)r;
        for (; i + 8 <= V; i += 8) {
            const v8f v = *(const v8f *)(r + i);
            const v8i gt = v > vm;
            vm = (v8f)(((v8i)v & gt) | ((v8i)vm & ~gt));
        }
        for (int l = 0; l < 8; l++) m = vm[l] > m ? vm[l] : m;
    }
    for (; i < V; i++) m = r[i] > m ? r[i] : m;
    return m;
}

/* out[b] = the index of the largest value of row b of x (B, V), rows x_stride apart: its first
   occurrence, a NaN counting as larger than any number, as torch.argmax. Vectorized passes find the
   maximum and whether there is a NaN, a scan finds where the winner first occurs. stats: NULL, or
   (B, 2): the row's maximum m and sum(exp(x - m)) from the same passes (so that logsumexp = m +
   log(sum)), both NaN when the row holds a NaN or its maximum is not finite (where torch's
   log_softmax is NaN too). */
int swiftkv_argmax_rows(const float *x, int64_t x_stride, int64_t B, int64_t V, int64_t *out, float *stats,
                        int num_threads) {
    #pragma omp parallel for num_threads(num_threads) if (B * V >= PARALLEL_MIN)
    for (int64_t b = 0; b < B; b++) {
        const float *r = x + b * x_stride;
        int nan = 0;
        for (int64_t i = 0; i < V; i++) nan |= r[i] != r[i];
        int64_t at = 0;
        float m = NAN, sum = NAN;
        if (nan) {
            while (r[at] == r[at]) at++;
        } else {
            m = row_max(r, V);
            while (r[at] != m) at++;
            if (stats != NULL && isfinite(m)) {
                sum = 0.f;
                for (int64_t i = 0; i < V; i++) sum += swiftkv_expf(r[i] - m);
            }
        }
        out[b] = at;
        if (stats != NULL) {
            stats[2 * b] = isfinite(m) ? m : NAN;
            stats[2 * b + 1] = sum;
        }
    }
    return 0;
}

/* Rotate-half RoPE in place: x holds T tokens, rows x_stride apart, each `heads` heads of D contiguous
   values; cos, sin: (max_pos, D / 2); token t uses row positions[t]: a = x[:D/2], b = x[D/2:] become
   a cos - b sin, b cos + a sin. Returns 1 (nothing written) when a position is outside [0, max_pos). */
int swiftkv_rope(float *x, int64_t x_stride, int64_t T, int64_t heads, int64_t D, const int64_t *positions,
                 const float *cos_table, const float *sin_table, int64_t max_pos, int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return 1;
    const int64_t half = D / 2;
    #pragma omp parallel for num_threads(num_threads) if (T * heads * D >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++)
        swiftkv_rope_row(x + t * x_stride, heads, D, cos_table + positions[t] * half,
                         sin_table + positions[t] * half);
    return 0;
}

/* The K/V rows of T tokens for n_layers cache layers written to their slots. cache: layer l's K row of
   slot s at cache + l * layer_stride + s * row, its V row kv_stride further; k, v: token t's row of
   layer l at k + t * k_ts + l * k_ls (same for v), each `row` values dense; slots: (T,) int64, a
   negative slot is skipped. Returns 1 (nothing written) when a slot is >= num_slots. */
static int write_kv_rows(void *cache, int bf16, int64_t layer_stride, int64_t kv_stride, int64_t num_slots,
                         int64_t row, const float *k, int64_t k_ts, int64_t k_ls, const float *v,
                         int64_t v_ts, int64_t v_ls, const int64_t *slots, int64_t T, int64_t n_layers,
                         int num_threads) {
    for (int64_t t = 0; t < T; t++)
        if (slots[t] >= num_slots) return 1;
    #pragma omp parallel for num_threads(num_threads) if (T * n_layers * row >= PARALLEL_MIN)
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] < 0) continue;
        for (int64_t l = 0; l < n_layers; l++) {
            const int64_t at = l * layer_stride + slots[t] * row;
            const float *ks = k + t * k_ts + l * k_ls, *vs = v + t * v_ts + l * v_ls;
            if (bf16) {
                uint16_t *kc = (uint16_t *)cache + at;
                swiftkv_bf16_store(kc, ks, row);
                swiftkv_bf16_store(kc + kv_stride, vs, row);
            } else {
                float *kc = (float *)cache + at, *vc = kc + kv_stride;
                memcpy(kc, ks, sizeof(float) * row);
                memcpy(vc, vs, sizeof(float) * row);
            }
        }
    }
    return 0;
}

/* into an fp32 cache, and into a bf16 one (rounded to nearest even, as torch rounds) */
int swiftkv_write_kv(float *cache, int64_t layer_stride, int64_t kv_stride, int64_t num_slots, int64_t row,
                     const float *k, int64_t k_ts, int64_t k_ls, const float *v, int64_t v_ts, int64_t v_ls,
                     const int64_t *slots, int64_t T, int64_t n_layers, int num_threads) {
    return write_kv_rows(cache, 0, layer_stride, kv_stride, num_slots, row, k, k_ts, k_ls, v, v_ts, v_ls,
                         slots, T, n_layers, num_threads);
}

int swiftkv_write_kv_bf16(uint16_t *cache, int64_t layer_stride, int64_t kv_stride, int64_t num_slots,
                          int64_t row, const float *k, int64_t k_ts, int64_t k_ls, const float *v,
                          int64_t v_ts, int64_t v_ls, const int64_t *slots, int64_t T, int64_t n_layers,
                          int num_threads) {
    return write_kv_rows(cache, 1, layer_stride, kv_stride, num_slots, row, k, k_ts, k_ls, v, v_ts, v_ls,
                         slots, T, n_layers, num_threads);
}
"""
)

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
SYMBOLS = {
    # h, h_stride, d, d_stride, w, out, T, H, eps, num_threads
    "swiftkv_add_rms_norm": [_P, _I64, _P, _I64, _P, _P, _I64, _I64, _F, _INT],
    # gu, gu_stride, out, T, I, num_threads
    "swiftkv_silu_and_mul": [_P, _I64, _P, _I64, _I64, _INT],
    # x, x_stride, B, V, out, stats, num_threads
    "swiftkv_argmax_rows": [_P, _I64, _I64, _I64, _P, _P, _INT],
    # x, x_stride, T, heads, D, positions, cos, sin, max_pos, num_threads
    "swiftkv_rope": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _I64, _INT],
    # cache, layer_stride, kv_stride, num_slots, row, k, k_ts, k_ls, v, v_ts, v_ls, slots, T, layers, threads
    "swiftkv_write_kv": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _INT],
    "swiftkv_write_kv_bf16": [_P, _I64, _I64, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64, _P, _I64, _I64]
    + [_INT],
}


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1") != "0"


_resolved: list = []  # [the kernels or None], once per process: every op of every step asks


def _kernels() -> dict | None:
    if not _resolved:
        on = enabled()
        _resolved.append(
            cpu_compile.load("cpu-ops", SOURCE, {"PARALLEL_MIN": PARALLEL_MIN}, SYMBOLS) if on else None
        )
    return _resolved[0]


def _rows(t: torch.Tensor) -> bool:
    """A CPU fp32 (T, n) tensor whose rows are dense (any row stride)."""
    return t.is_cpu and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """h += delta (in place, when given), then RMSNorm(h) * weight as a new (T, H) tensor; None when the
    kernel does not apply (not fp32 CPU rows) or is unavailable, with h untouched."""
    if not (_rows(h) and (delta is None or (_rows(delta) and delta.shape == h.shape))):
        return None
    if weight.dtype != torch.float32 or not weight.is_cpu or not weight.is_contiguous():
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    out = torch.empty(h.shape, dtype=torch.float32)
    kernels["swiftkv_add_rms_norm"](
        h.data_ptr(),
        h.stride(0),
        None if delta is None else delta.data_ptr(),
        0 if delta is None else delta.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        h.shape[0],
        h.shape[1],
        eps,
        torch.get_num_threads(),
    )
    return out


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """(T, 2 I) [gate | up] -> silu(gate) * up, a new contiguous (T, I); None when it does not apply."""
    if not _rows(gate_up) or gate_up.shape[1] % 2:
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=torch.float32)
    kernels["swiftkv_silu_and_mul"](
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, torch.get_num_threads()
    )
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x.argmax(dim=-1) for fp32 rows x (B, V), V >= 1 (int64 (B,)), or None when the kernel does not
    apply (torch's CPU argmax over a 49,152-token vocabulary takes ~0.5 ms for 16 rows, this ~0.1)."""
    result = _argmax(x, False)
    return None if result is None else result[0]


def argmax_logsumexp_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x.argmax(dim=-1), x.logsumexp(dim=-1)) for fp32 rows x (B, V) from one kernel's passes over each
    row (int64 (B,), fp32 (B,)), or None when the kernel does not apply; a row with a NaN, or whose
    maximum is infinite, gets a NaN logsumexp (its log_softmax is NaN in torch too). The greedy
    sampler's chosen logprob is then x[b, token] - logsumexp[b], without torch's log_softmax, which
    writes a whole (B, V) tensor: the greedy sampler over 16 x 49,152 logits took 0.31 instead of
    0.46 ms (2-core AMD EPYC Zen 4, interleaved)."""
    return _argmax(x, True)


def _argmax(x: torch.Tensor, logsumexp: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if not _rows(x) or x.shape[1] == 0:
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    stats = torch.empty(x.shape[0], 2, dtype=torch.float32) if logsumexp else None
    kernels["swiftkv_argmax_rows"](
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        x.shape[1],
        out.data_ptr(),
        None if stats is None else stats.data_ptr(),
        torch.get_num_threads(),
    )
    if stats is None:
        return out, None
    return out, stats[:, 0] + stats[:, 1].log()


def rope_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotates x (T, heads, D) in place, heads dense within a token (any token stride), with the rows
    `positions` (T,) of the tables cos, sin (max_pos, D / 2). False (x untouched) when it does not apply;
    ValueError for a position outside the tables."""
    if not x.is_cpu or x.dtype != torch.float32 or x.dim() != 3 or x.shape[2] % 2:
        return False
    if x.stride(2) != 1 or x.stride(1) != x.shape[2] or positions.dtype != torch.int64:
        return False
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.dtype == sin.dtype == torch.float32):
        return False
    if cos.shape[1] * 2 != x.shape[2] or sin.shape != cos.shape:
        return False
    kernels = _kernels()
    if kernels is None:
        return False
    positions = positions.contiguous()
    status = kernels["swiftkv_rope"](
        x.data_ptr(),
        x.stride(0),
        x.shape[0],
        x.shape[1],
        x.shape[2],
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        torch.get_num_threads(),
    )
    if status == 1:
        raise ValueError(
            f"RoPE: a position (max {int(positions.max())}) is outside the table of {cos.shape[0]}"
        )
    return True


def _dense_rows(t: torch.Tensor) -> bool:
    """(T, n_layers, kv_heads, head_dim) with each (token, layer) row of kv_heads * head_dim dense."""
    return t.dim() == 4 and t.stride(3) == 1 and t.stride(2) == t.shape[3]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> bool:
    """The backend's write_kv (attention/base.py): kv_cache (n_layers, 2, num_blocks, block_size, kv_heads,
    head_dim) fp32 or bf16 (rounded as torch's .to rounds), k, v (T, n_layers, kv_heads, head_dim) fp32,
    slot_mapping (T,), -1 = skip. False (nothing written) when it does not apply; ValueError for a slot
    outside the cache."""
    n_layers, _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    row = kv_heads * head_dim
    if not kv_cache.is_cpu or not k.dtype == v.dtype == torch.float32:
        return False
    name = {torch.float32: "swiftkv_write_kv", torch.bfloat16: "swiftkv_write_kv_bf16"}.get(kv_cache.dtype)
    if name is None:
        return False
    if kv_cache.stride()[2:] != (block_size * row, row, head_dim, 1) or not (
        _dense_rows(k) and _dense_rows(v)
    ):
        return False
    if (
        k.shape != v.shape
        or k.shape[1:] != (n_layers, kv_heads, head_dim)
        or k.shape[0] != slot_mapping.shape[0]
    ):
        return False
    kernels = _kernels()
    if kernels is None:
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    status = kernels[name](
        kv_cache.data_ptr(),
        kv_cache.stride(0),
        kv_cache.stride(1),
        num_blocks * block_size,
        row,
        k.data_ptr(),
        k.stride(0),
        k.stride(1),
        v.data_ptr(),
        v.stride(0),
        v.stride(1),
        slots.data_ptr(),
        k.shape[0],
        n_layers,
        torch.get_num_threads(),
    )
    if status == 1:
        raise ValueError(
            f"write_kv: a slot (max {int(slots.max())}) is outside the cache of {num_blocks * block_size}"
        )
    return True
