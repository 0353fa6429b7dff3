"""Helpers shared by the kernels' launchers (no triton import)."""

from __future__ import annotations

import torch

from swiftkv_fast import envs


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter."""
    return envs.TRITON_INTERPRET


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """Input precision of ``tl.dot`` on operands converted to fp32 after load.

    fp32 inputs use exact ("ieee") products. bf16/fp16 values are exactly
    representable in tf32, so tf32 loses nothing on q/k/v there (only the
    probabilities are rounded, to 10 mantissa bits).
    """
    return "ieee" if dtype == torch.float32 else "tf32"


def check_cache(
    k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, head_dim: int
) -> tuple[int, int]:
    """Validate (num_blocks, block_size, kv_heads, head_dim) caches; return (block_size, kv_heads)."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"k_cache/v_cache must both be (num_blocks, block_size, kv_heads, head_dim), "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    _, block_size, kv_heads, hd = k_cache.shape
    if hd != head_dim:
        raise ValueError(f"head_dim mismatch: q has {head_dim}, cache has {hd}")
    if num_heads % kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of kv_heads={kv_heads}")
    return block_size, kv_heads


def check_device(t: torch.Tensor, interpreted: bool) -> None:
    """Triton decides at kernel-definition (import) time whether it interprets: fail clearly when a
    kernel module imported for the GPU is handed CPU tensors, or the reverse."""
    if interpreted and t.is_cuda:
        raise RuntimeError(
            "swiftkv_fast.kernels were imported with TRITON_INTERPRET=1: they run on CPU "
            "tensors only in this process"
        )
    if not interpreted and not t.is_cuda:
        raise RuntimeError(
            "swiftkv_fast.kernels need CUDA tensors; on CPU set TRITON_INTERPRET=1 before "
            "the kernels are first imported (Triton's interpreter, for tests)"
        )


def dense_rows(x: torch.Tensor, width: int, kernel: str) -> torch.Tensor:
    """x (..., width) fp32 on CPU as (rows, width) with unit column stride (a view where it can be), for
    the compiled linear kernels; a ValueError naming `kernel` otherwise."""
    if x.dtype != torch.float32 or not x.is_cpu or x.shape[-1] != width:
        raise ValueError(f"the {kernel} takes fp32 CPU rows of {width}, got {x.dtype} {tuple(x.shape)}")
    x2 = x.reshape(-1, width)
    return x2 if x2.stride(1) == 1 else x2.contiguous()
