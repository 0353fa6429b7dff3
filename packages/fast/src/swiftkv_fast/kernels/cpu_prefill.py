"""Prompt attention on CPU over the paged KV cache as one C kernel (csrc/prefill_attention.c): fp32
queries over an fp32 or bf16 cache, the `torch` backend's prefill path for prompt rows.

Request r's queries sit at the last positions of its seq_lens[r] (a fresh prompt, a chunk that
continues one, or a SwiftKV early-exit batch) and see the positions up to their own (within the
window, if any). Keys and values are read from the cache blocks through the block table, with no
padding between requests and no mask tensor, flash-style in tiles: a causal prompt of n tokens costs
about n^2 / 2 scores, where an SDPA call on CPU computes whole key splits.

Built per (head_dim, group, cache dtype) by kernels/build.py; the kernel plan (kernels/plan.py) picks it
once per engine where it applies (`supports_shape`, fp32 queries on CPU) and is not switched off
(`prefill` in disabled_kernels). Every request's lengths and block ids are checked before any row is
read; a bad one raises ValueError and nothing is written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swiftkv_fast import envs
from swiftkv_fast.kernels import build, cpu_decode, native

KERNEL = "prefill"  # its name in SWIFTKV_DISABLED_KERNELS (envs.py)


def enabled() -> bool:
    return envs.kernel_enabled(KERNEL)


def supports_shape(head_dim: int, group: int) -> bool:
    """Where the decode kernel is built (cpu_decode.supports_shape) and head_dim is a multiple of 16
    (whole output-column blocks of the P V product)."""
    return cpu_decode.supports_shape(head_dim, group) and head_dim % 16 == 0


def kernel(
    head_dim: int, group: int, avx512: bool = True, kv_dtype: torch.dtype = torch.float32
) -> Callable | None:
    """The built kernel for this (head_dim, group) and a cache of `kv_dtype` (fp32 or bf16); None when it
    cannot be built or loaded here (logged once) or is switched off. `avx512=False` builds the 8-lane
    register blocks even where the compiler targets AVX-512 (tests check both paths)."""
    if not enabled():
        return None
    functions = native.load(
        "prefill-attention",
        HEAD_DIM=head_dim,
        GROUP=group,
        SWIFTKV_NO_AVX512=int(not avx512),
        KV_BF16=build.kv_bf16(kv_dtype),
    )
    return None if functions is None else functions.prefill_attention


def prefill_attention(
    fn: Callable,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """q: (T, H, D) fp32, request r's queries rows [cu_seqlens_q[r], cu_seqlens_q[r + 1]) at the last
    positions of its seq_lens[r]; k_cache, v_cache: (num_blocks, block_size, kv_heads, D); block_tables
    (R, max_blocks) int -> (T, H, D). `fn`: `kernel(D, H / kv_heads, kv_dtype=cache dtype)`."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, block_size, kv_heads, _ = k_cache.shape
    q, seq_lens, block_tables = cpu_decode.paged_inputs(q, k_cache, v_cache, seq_lens, block_tables)
    cu = cu_seqlens_q.to(torch.int32).contiguous()
    num_reqs = seq_lens.shape[0]
    if cu.shape[0] != num_reqs + 1 or int(cu[-1]) != num_tokens or int(cu[0]) != 0:
        raise ValueError(
            f"prefill attention: cu_seqlens_q {cu.tolist()} does not split {num_tokens} query rows "
            f"over {num_reqs} requests"
        )
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype)
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
        cu.data_ptr(),
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
