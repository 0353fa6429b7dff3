"""Decode attention on CPU over the paged KV cache as one C kernel (csrc/decode_attention.c): fp32
queries over an fp32 or bf16 cache, the `torch` backend's decode path.

One query per request against its context, read straight from the cache blocks through the block
table: every K and V row is read once, with no gathered copy, and the query heads of one KV head share
each row read. The kernel is bound by those reads, so a bf16 cache (kv_cache_dtype="bfloat16") makes
it faster. Larger blocks read faster too (`LLM(block_size=128)` suits long contexts); the default stays
16 because prefix-cache hits and sliding-window frees come in whole blocks.

Built per (head_dim, group, cache dtype) by kernels/build.py; the kernel plan (kernels/plan.py) picks
it once per engine where it applies (`supports_shape`, fp32 queries on CPU) and is not switched off
(`decode` in disabled_kernels). A seq_len beyond its block table or a block id outside the cache raises
ValueError before that request's rows are read.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swiftkv_fast import envs
from swiftkv_fast.kernels import build, native

KERNEL = "decode"  # its name in SWIFTKV_DISABLED_KERNELS (envs.py)
MAX_GROUP = 16  # query heads per KV head the kernel keeps in registers / on the stack


def enabled() -> bool:
    return envs.kernel_enabled(KERNEL)


def supports_shape(head_dim: int, group: int) -> bool:
    """The kernel is built for this head shape: head_dim a multiple of 8 (at most 256), group <= MAX_GROUP."""
    return head_dim % 8 == 0 and head_dim <= 256 and 1 <= group <= MAX_GROUP


def kernel(head_dim: int, group: int, kv_dtype: torch.dtype = torch.float32) -> Callable | None:
    """The built kernel for this (head_dim, group) and a cache of `kv_dtype` (fp32 or bf16); None when it
    cannot be built or loaded here (logged once) or is switched off."""
    if not enabled():
        return None
    functions = native.load(
        "decode-attention", HEAD_DIM=head_dim, GROUP=group, KV_BF16=build.kv_bf16(kv_dtype)
    )
    return None if functions is None else functions.decode_attention


def paged_inputs(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the paged C kernels (this one and kernels/cpu_prefill.py) read: q (..., H, D) fp32 with dense
    heads, seq_lens int32 contiguous, block_tables int32 with unit column stride. ValueError for what
    the engine never passes: another dtype, cache blocks whose rows are not dense."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if q.dtype != torch.float32 or not q.is_cpu or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"paged attention kernels: fp32 CPU queries, got {q.dtype} on {q.device}")
    if k_cache.stride()[1:] != (kv_heads * head_dim, head_dim, 1) or v_cache.stride() != k_cache.stride():
        raise ValueError("paged attention kernels: the cache blocks' rows are not dense")
    if q.stride()[-2:] != (head_dim, 1):
        q = q.contiguous()
    block_tables = block_tables.to(torch.int32)
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    return q, seq_lens.to(torch.int32).contiguous(), block_tables


def decode_attention(
    fn: Callable,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """q: (R, H, D) fp32; k_cache, v_cache: (num_blocks, block_size, kv_heads, D) fp32 or bf16; seq_lens
    (R,) int; block_tables (R, max_blocks) int -> (R, H, D). `fn`: `kernel(D, H / kv_heads, cache dtype)`."""
    num_reqs, num_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    q, seq_lens, block_tables = paged_inputs(q, k_cache, v_cache, seq_lens, block_tables)
    out = torch.empty((num_reqs, num_heads, head_dim), dtype=q.dtype)
    fn(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        k_cache.stride(0),
        num_blocks,
        block_tables.data_ptr(),
        block_tables.stride(0),
        block_tables.shape[1],
        seq_lens.data_ptr(),
        out.data_ptr(),
        num_reqs,
        kv_heads,
        block_size,
        window or 0,
        scale,
        torch.get_num_threads(),
    )
    return out
