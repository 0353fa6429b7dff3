"""KV cache sizing and allocation: one tensor
(num_kv_slots, 2, num_blocks, block_size, num_kv_heads, head_dim).

AcrossKV groups share a cache layer (config.cache_layer). Hybrid models go one step further, as
vLLM v1 does: their kvcache groups (one per attention type) draw block ids from ONE shared pool, and
a block id belongs to at most one group at a time, so one cache layer of each group can live in the
same physical storage without the groups ever touching each other's blocks. The i-th cache layer of
every group goes to physical KV slot i (`kv_slots`), so the tensor has max(group size) slots instead
of num_cache_layers, and a block costs `bytes_per_block` over those slots only. With one group
(every non-hybrid model) slot == cache layer."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
GPU_MEMORY_FRACTION = 0.85


def kv_slots(group_of_cache_layer: Sequence[int]) -> list[int]:
    """The physical KV slot of every cache layer: the i-th cache layer (in order) of each kvcache
    group goes to slot i. The one definition of the layout; everything indexing the KV tensor by
    cache layer goes through it."""
    seen: Counter[int] = Counter()
    slots = []
    for g in group_of_cache_layer:
        slots.append(seen[g])
        seen[g] += 1
    return slots


def num_kv_slots(group_of_cache_layer: Sequence[int]) -> int:
    """Physical KV slots of the tensor: the size of the largest kvcache group."""
    return max(kv_slots(group_of_cache_layer)) + 1


def bytes_per_block(config, block_size: int, dtype: torch.dtype, group_of_cache_layer: Sequence[int]) -> int:
    """Bytes of one block id over every physical KV slot (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_slot = 2 * block_size * config.num_key_value_heads * config.head_dim * elem
    return num_kv_slots(group_of_cache_layer) * per_slot


def num_blocks_for(
    config,
    block_size,
    dtype,
    device,
    num_kv_blocks,
    kv_cache_memory,
    max_blocks_useful,
    group_of_cache_layer: Sequence[int],
) -> int:
    """num_kv_blocks, else kv_cache_memory bytes, else 1 GiB on CPU / 85% of free memory on CUDA,
    capped at what max_num_seqs requests of max_model_len tokens could use. A block costs
    `bytes_per_block` (the physical KV slots, not the cache layers)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = bytes_per_block(config, block_size, dtype, group_of_cache_layer)
    if kv_cache_memory is None:
        if torch.device(device).type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            kv_cache_memory = int(free * GPU_MEMORY_FRACTION)
        else:
            kv_cache_memory = DEFAULT_CPU_KV_BYTES
        num = min(kv_cache_memory // per_block, max_blocks_useful)
    else:
        num = kv_cache_memory // per_block
    if num < 2:
        raise ValueError(
            f"kv_cache_memory={kv_cache_memory} bytes holds fewer than 2 blocks of {per_block} bytes"
        )
    return int(num)


def allocate_kv_cache(
    config, num_blocks: int, block_size: int, dtype, device, group_of_cache_layer: Sequence[int]
) -> torch.Tensor:
    """(num_kv_slots, 2, num_blocks, block_size, kv_heads, head_dim); cache layer c lives at
    ``kv_slots(group_of_cache_layer)[c]``."""
    # zeros: the null block and stale blocks (possibly another group's, in a shared slot) must hold
    # finite values (they are masked, not skipped)
    return torch.zeros(
        num_kv_slots(group_of_cache_layer),
        2,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
        dtype=dtype,
        device=device,
    )


def log_kv_cache(
    config, num_blocks, block_size, dtype, max_model_len, blocks_per_request, group_of_cache_layer
) -> None:
    total = bytes_per_block(config, block_size, dtype, group_of_cache_layer) * num_blocks
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB), %d cache layers for %d model layers (%.0f%% of the "
        "full model's KV per token), %d physical KV slot(s) for %d kvcache group(s); maximum concurrency "
        "for %d-token requests: %.2fx",
        num_blocks,
        block_size,
        total / 2**20,
        config.num_cache_layers,
        config.num_hidden_layers,
        100 * config.num_cache_layers / config.num_hidden_layers,
        num_kv_slots(group_of_cache_layer),
        len(set(group_of_cache_layer)),
        max_model_len,
        (num_blocks - 1) / blocks_per_request,
    )
