"""The attention-backend interface (docs/interfaces.md).

KV cache: one tensor per engine, `(num_kv_slots, 2, num_blocks, block_size, num_kv_heads, head_dim)`;
cache layer `c` reads `kv_cache[s, 0]` (K) and `kv_cache[s, 1]` (V) with `s` its physical KV slot
(model/kv_cache_layout.py `KVCacheLayout.kv_slot`; the kvcache groups of a hybrid model share slots,
never block ids).
The slot of position `p` of a request is `block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Varlen metadata of one flat batch (one attention group's block tables)."""

    cu_seqlens_q: torch.Tensor  # (num_reqs + 1,) int32: query start offsets in the flat batch
    seq_lens: torch.Tensor  # (num_reqs,) int32: context length after this step
    block_tables: torch.Tensor  # (num_reqs, max_blocks) int32, padded with the null block 0
    max_query_len: int
    max_seq_len: int
    # per-step values a backend derives from the fields above and shares across the layers of the
    # group (e.g. the torch backend's decode gather indices); built lazily, ignored by other backends
    backend_cache: dict = field(default_factory=dict)


def ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """cat(arange(starts[i], starts[i] + lens[i])) without a Python loop."""
    offsets = torch.cumsum(lens, 0) - lens
    idx = torch.arange(int(lens.sum()), device=lens.device)
    return idx - torch.repeat_interleave(offsets - starts, lens)


class AttentionBackend:
    """Query j of request r sits at position `seq_lens[r] - q_len[r] + j`; attention is causal and,
    with a window W, sees positions `> pos - W`. GQA: query head h reads KV head
    `h // (num_heads // num_kv_heads)`."""

    name: str = "base"
    # True when decode() can be captured in a CUDA graph: no host syncs, launch shapes from tensor
    # shapes only, padding rows (seq_lens == 0) tolerated. The second half is replayed from graphs
    # only with such a backend.
    supports_cuda_graph: bool = False

    def write_kv(
        self, kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """kv_cache: (n_layers, 2, num_blocks, block_size, kv_heads, head_dim), a slice of the engine's;
        k, v: (num_tokens, n_layers, kv_heads, head_dim); slot_mapping: (num_tokens,) int64, -1 = skip."""
        raise NotImplementedError

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        """q: (num_tokens, num_heads, head_dim) -> (num_tokens, num_heads, head_dim)."""
        raise NotImplementedError

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
        window: int | None,
        scale: float,
    ) -> torch.Tensor:
        """q: (num_reqs, num_heads, head_dim), one query per request at position seq_lens[r] - 1."""
        raise NotImplementedError
