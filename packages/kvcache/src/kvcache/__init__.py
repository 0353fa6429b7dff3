"""Paged KV cache manager: prefix caching, sliding-window block freeing, hybrid groups.

Pure Python, no dependencies; semantics follow vLLM v1 (0.33). See ``KVCacheManager``.
"""

from kvcache.block import KVCacheBlock
from kvcache.block_pool import BlockPool
from kvcache.free_queue import FreeKVCacheBlockQueue
from kvcache.hashing import NONE_HASH, hash_block_tokens, sha256_hash
from kvcache.kv_cache_manager import CacheHit, KVCacheManager
from kvcache.request import Request
from kvcache.single_type_manager import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    SlidingWindowManager,
    spec_manager_map,
)
from kvcache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv
from kvcache.stats import PrefixCacheStats

__all__ = [
    "NONE_HASH",
    "BlockPool",
    "CacheHit",
    "FreeKVCacheBlockQueue",
    "FullAttentionManager",
    "FullAttentionSpec",
    "KVCacheBlock",
    "KVCacheManager",
    "KVCacheSpec",
    "PrefixCacheStats",
    "Request",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "SlidingWindowSpec",
    "cdiv",
    "hash_block_tokens",
    "sha256_hash",
    "spec_manager_map",
]
