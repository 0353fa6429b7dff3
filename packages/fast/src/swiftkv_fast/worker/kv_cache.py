"""KV cache sizing and allocation: one tensor of `KVCacheLayout.kv_cache_shape(num_blocks)`
(model/kv_cache_layout.py: the kvcache groups, the physical KV slot of each cache layer)."""

from __future__ import annotations

import torch

from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout

logger = init_logger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
GPU_MEMORY_FRACTION = 0.85


def num_blocks_for(
    layout: KVCacheLayout, device, num_kv_blocks, kv_cache_memory, max_blocks_useful: int
) -> int:
    """num_kv_blocks, else kv_cache_memory bytes, else 1 GiB on CPU / 85% of free memory on CUDA,
    capped at what max_num_seqs requests of max_model_len tokens could use. A block costs
    `layout.bytes_per_block` (the physical KV slots, not the cache layers)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = layout.bytes_per_block
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


def allocate_kv_cache(layout: KVCacheLayout, num_blocks: int, device) -> torch.Tensor:
    """(num_kv_slots, 2, num_blocks, block_size, kv_heads, head_dim); cache layer c lives at
    ``layout.kv_slot[c]``."""
    # zeros: the null block and stale blocks (possibly another group's, in a shared slot) must hold
    # finite values (they are masked, not skipped)
    return torch.zeros(layout.kv_cache_shape(num_blocks), dtype=layout.dtype, device=device)


def log_kv_cache(
    config, layout: KVCacheLayout, num_blocks, max_model_len, blocks_per_request, tensor_parallel_size=1
) -> None:
    """`layout` is one rank's: under tensor parallelism each rank holds its K/V heads' share."""
    if tensor_parallel_size > 1:
        logger.info(
            "KV cache per rank: %d of the model's %d K/V heads (%.0f%% of its KV bytes) on each of %d ranks",
            layout.num_kv_heads,
            config.num_key_value_heads,
            100 * layout.num_kv_heads / config.num_key_value_heads,
            tensor_parallel_size,
        )
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB, %s), %d cache layers for %d model layers (%.0f%% of the "
        "full model's KV per token), %d physical KV slot(s) for %d kvcache group(s); maximum concurrency "
        "for %d-token requests: %.2fx",
        num_blocks,
        layout.block_size,
        layout.bytes_per_block * num_blocks / 2**20,
        str(layout.dtype).removeprefix("torch."),
        config.num_cache_layers,
        config.num_hidden_layers,
        100 * config.num_cache_layers / config.num_hidden_layers,
        layout.num_kv_slots,
        layout.num_groups,
        max_model_len,
        (num_blocks - 1) / blocks_per_request,
    )
