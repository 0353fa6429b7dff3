"""The model's small ops on CPU in fp32 as C kernels (csrc/row_ops.c): RMSNorm with the residual add
fused in front, SiLU-and-mul and in-place RoPE (model/layers.py; the torch ops stay the portable path
and the specification), the KV cache write by slot (the torch attention backend's write_kv), and the
greedy sampler's argmax (and logsumexp) over each row of logits (sampler.py).

Why: each reads its input once and writes its output once, where the torch ops make two to four passes
over the rows and allocate a fresh output per op, and a decode step's ops are mostly dispatch.

Each wrapper returns None (False for the in-place ones) when its kernel does not apply (not fp32 CPU
rows of the layout it reads) or is unavailable: no compiler, or `ops` in SWIFTKV_DISABLED_KERNELS
(read once, at the process's first op). Bad positions or slots raise ValueError with nothing written.
"""

from __future__ import annotations

import torch

from swiftkv_fast import envs
from swiftkv_fast.kernels import native

KERNEL = "ops"  # its name in SWIFTKV_DISABLED_KERNELS (envs.py)
PARALLEL_MIN = 1 << 16  # elements below which a call runs on one thread (a parallel region costs ~us)


def enabled() -> bool:
    return envs.kernel_enabled(KERNEL)


_resolved: list = []  # [the kernels or None], once per process: every op of every step asks


def _kernels():
    if not _resolved:
        _resolved.append(native.load("row-ops", PARALLEL_MIN=PARALLEL_MIN) if enabled() else None)
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
    kernels.add_rms_norm(
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
    kernels.silu_and_mul(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, torch.get_num_threads()
    )
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x.argmax(dim=-1) for fp32 rows x (B, V), V >= 1 (int64 (B,)), or None when the kernel does not
    apply."""
    result = _argmax(x, False)
    return None if result is None else result[0]


def argmax_logsumexp_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x.argmax(dim=-1), x.logsumexp(dim=-1)) for fp32 rows x (B, V) from one kernel's passes over each
    row (int64 (B,), fp32 (B,)), or None when the kernel does not apply; a row with a NaN, or whose
    maximum is infinite, gets a NaN logsumexp (its log_softmax is NaN in torch too). The greedy
    sampler's chosen logprob is then x[b, token] - logsumexp[b], without torch's log_softmax, which
    writes a whole (B, V) tensor."""
    return _argmax(x, True)


def _argmax(x: torch.Tensor, logsumexp: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    if not _rows(x) or x.shape[1] == 0:
        return None
    kernels = _kernels()
    if kernels is None:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    stats = torch.empty(x.shape[0], 2, dtype=torch.float32) if logsumexp else None
    kernels.argmax_rows(
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
    kernels.rope(
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
    name = {torch.float32: "write_kv", torch.bfloat16: "write_kv_bf16"}.get(kv_cache.dtype)
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
    getattr(kernels, name)(
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
    return True
