"""The model's small ops on CPU in fp32 as C kernels (csrc/row_ops.c): RMSNorm with the residual add
fused in front, SiLU-and-mul and in-place RoPE (model/layers.py; the torch ops stay the portable path
and the specification), the KV cache write by slot (the torch attention backend's write_kv), and the
greedy sampler's argmax (and logsumexp) over each row of logits (sampler.py).

Why: each reads its input once and writes its output once, where the torch ops make two to four passes
over the rows and allocate a fresh output per op, and a decode step's ops are mostly dispatch.

The kernel plan (kernels/plan.py) loads them once per engine (`load`) where the model runs in fp32 on
CPU; each wrapper takes that library and fp32 CPU tensors (a ValueError otherwise) and copies an input
whose rows are not dense. Bad positions or slots raise ValueError with nothing written.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from swiftkv_fast.kernels import native

KERNEL = "ops"  # its name in SWIFTKV_DISABLED_KERNELS (envs.py)
PARALLEL_MIN = 1 << 16  # elements below which a call runs on one thread (a parallel region costs ~us)


def load() -> SimpleNamespace | None:
    """The built library (cached on disk and per process); None where it cannot be built here."""
    return native.load("row-ops", PARALLEL_MIN=PARALLEL_MIN)


def _rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """t as fp32 CPU (T, n) rows with unit column stride (any row stride): a copy only where needed."""
    if not t.is_cpu or t.dtype != torch.float32 or t.dim() != 2:
        raise ValueError(f"{what}: the C row ops take fp32 CPU (T, n) rows, got {t.dtype} {tuple(t.shape)}")
    return t if t.stride(1) == 1 else t.contiguous()


def add_rms_norm(
    lib: SimpleNamespace, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h += delta (in place, when given), then RMSNorm(h) * weight as a new (T, H) tensor. h must have
    dense rows (it is updated in place)."""
    if _rows(h, "add_rms_norm h") is not h:
        raise ValueError("add_rms_norm: h is updated in place and needs dense rows")
    if delta is not None:
        delta = _rows(delta, "add_rms_norm delta")
        if delta.shape != h.shape:
            raise ValueError(f"add_rms_norm: delta {tuple(delta.shape)} is not h's {tuple(h.shape)}")
    weight = weight.to(torch.float32).contiguous()
    out = torch.empty(h.shape, dtype=torch.float32)
    lib.add_rms_norm(
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


def silu_and_mul(lib: SimpleNamespace, gate_up: torch.Tensor) -> torch.Tensor:
    """(T, 2 I) [gate | up] -> silu(gate) * up, a new contiguous (T, I)."""
    gate_up = _rows(gate_up, "silu_and_mul")
    if gate_up.shape[1] % 2:
        raise ValueError(f"silu_and_mul: an odd width {gate_up.shape[1]}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=torch.float32)
    lib.silu_and_mul(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, inter, torch.get_num_threads()
    )
    return out


def argmax_rows(lib: SimpleNamespace, x: torch.Tensor) -> torch.Tensor:
    """x.argmax(dim=-1) for fp32 rows x (B, V), V >= 1: int64 (B,)."""
    return _argmax(lib, x, False)[0]


def argmax_logsumexp_rows(lib: SimpleNamespace, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x.argmax(dim=-1), x.logsumexp(dim=-1)) for fp32 rows x (B, V) from one kernel's passes over each
    row (int64 (B,), fp32 (B,)); a row with a NaN, or whose maximum is infinite, gets a NaN logsumexp
    (its log_softmax is NaN in torch too). The greedy sampler's chosen logprob is then
    x[b, token] - logsumexp[b], without torch's log_softmax, which writes a whole (B, V) tensor."""
    return _argmax(lib, x, True)


def _argmax(
    lib: SimpleNamespace, x: torch.Tensor, logsumexp: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x = _rows(x, "argmax")
    if x.shape[1] == 0:
        raise ValueError("argmax over an empty vocabulary")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    stats = torch.empty(x.shape[0], 2, dtype=torch.float32) if logsumexp else None
    lib.argmax_rows(
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


def rope_(
    lib: SimpleNamespace, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """Rotates x (T, heads, D) in place with the rows `positions` (T,) of the tables cos, sin
    (max_pos, D / 2) fp32, and returns x; heads dense within a token (any token stride), else the
    rotation runs on a copy written back. ValueError for a position outside the tables."""
    if not x.is_cpu or x.dtype != torch.float32 or x.dim() != 3 or x.shape[2] % 2:
        raise ValueError(f"rope: fp32 CPU (T, heads, even head_dim) only, got {x.dtype} {tuple(x.shape)}")
    if cos.shape[1] * 2 != x.shape[2] or sin.shape != cos.shape:
        raise ValueError(f"rope: tables {tuple(cos.shape)} do not fit head_dim {x.shape[2]}")
    dense = x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()
    cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
    positions = positions.to(torch.int64).contiguous()
    lib.rope(
        dense.data_ptr(),
        dense.stride(0),
        dense.shape[0],
        dense.shape[1],
        dense.shape[2],
        positions.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.shape[0],
        torch.get_num_threads(),
    )
    return x if dense is x else x.copy_(dense)


def _dense_rows(t: torch.Tensor) -> torch.Tensor:
    """(T, n_layers, kv_heads, head_dim) with each (token, layer) row of kv_heads * head_dim dense."""
    return t if t.stride(3) == 1 and t.stride(2) == t.shape[3] else t.contiguous()


def write_kv(
    lib: SimpleNamespace, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The backend's write_kv (attention/base.py): kv_cache (n_layers, 2, num_blocks, block_size, kv_heads,
    head_dim) fp32 or bf16 (rounded as torch's .to rounds) with dense blocks, k, v (T, n_layers,
    kv_heads, head_dim) fp32, slot_mapping (T,), -1 = skip. ValueError for a slot outside the cache."""
    n_layers, _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    row = kv_heads * head_dim
    name = {torch.float32: "write_kv", torch.bfloat16: "write_kv_bf16"}.get(kv_cache.dtype)
    if not kv_cache.is_cpu or name is None or not k.dtype == v.dtype == torch.float32:
        raise ValueError(
            f"write_kv: fp32 K/V into an fp32 or bf16 CPU cache, got {k.dtype} into {kv_cache.dtype}"
        )
    if kv_cache.stride()[2:] != (block_size * row, row, head_dim, 1):
        raise ValueError("write_kv: the cache's blocks are not dense")
    if (
        k.shape != v.shape
        or k.shape[1:] != (n_layers, kv_heads, head_dim)
        or k.shape[0] != slot_mapping.shape[0]
    ):
        raise ValueError(f"write_kv: K {tuple(k.shape)}, V {tuple(v.shape)}, {slot_mapping.shape[0]} slots")
    k, v = _dense_rows(k), _dense_rows(v)
    slots = slot_mapping.to(torch.int64).contiguous()
    getattr(lib, name)(
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
