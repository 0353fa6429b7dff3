"""KV cache sizing and allocation: one tensor
(num_cache_layers, 2, num_blocks, block_size, num_kv_heads, head_dim); AcrossKV groups share a layer."""

from __future__ import annotations

import torch

from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

DEFAULT_CPU_KV_BYTES = 1 << 30
GPU_MEMORY_FRACTION = 0.85


def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return config.num_cache_layers * 2 * block_size * config.num_key_value_heads * config.head_dim * elem


def num_blocks_for(
    config, block_size, dtype, device, num_kv_blocks, kv_cache_memory, max_blocks_useful
) -> int:
    """num_kv_blocks, else kv_cache_memory bytes, else 1 GiB on CPU / 85% of free memory on CUDA,
    capped at what max_num_seqs requests of max_model_len tokens could use."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    per_block = bytes_per_block(config, block_size, dtype)
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


def allocate_kv_cache(config, num_blocks: int, block_size: int, dtype, device) -> torch.Tensor:
    # zeros: the null block and stale blocks must hold finite values (they are masked, not skipped)
    return torch.zeros(
        config.num_cache_layers,
        2,
        num_blocks,
        block_size,
        config.num_key_value_heads,
        config.head_dim,
        dtype=dtype,
        device=device,
    )


def log_kv_cache(config, num_blocks, block_size, dtype, max_model_len, blocks_per_request) -> None:
    total = bytes_per_block(config, block_size, dtype) * num_blocks
    logger.info(
        "KV cache: %d blocks of %d tokens (%.1f MiB, %d cache layers for %d model layers: %.0f%% of the full "
        "model's KV memory); maximum concurrency for %d-token requests: %.2fx",
        num_blocks,
        block_size,
        total / 2**20,
        config.num_cache_layers,
        config.num_hidden_layers,
        100 * config.num_cache_layers / config.num_hidden_layers,
        max_model_len,
        (num_blocks - 1) / blocks_per_request,
    )
