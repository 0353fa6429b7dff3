"""The shared pool of KV cache blocks: allocation, reference counts, prefix-cache map."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvcache.block import KVCacheBlock
from kvcache.free_queue import FreeKVCacheBlockQueue
from kvcache.hashing import BlockHash


class BlockPool:
    """Owns every block, the LRU free queue and the hash -> cached block maps.

    Block 0 is the *null block*: a placeholder for positions a sliding window no
    longer needs. It is never allocated, cached, freed or ref-counted.

    The cache map is keyed by (block hash, group id): one dict per KV cache group,
    since two groups over the same tokens hold different layers' KV. Several
    physical blocks may carry the same hash (two requests computed the same prefix
    at once); a lookup returns the first cached one. A cached block stays findable
    while it is free and is evicted lazily, when the free queue hands it out again.

    Freeing (``free_blocks``): a block whose count drops to 0 goes to the back of
    the queue if it is cached (LRU) and to the front if it is not (vLLM 0.33: an
    unhashed block holds nothing reusable, so it is reused first). Within one call
    the order of the given blocks is kept on both ends.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, num_groups: int = 1) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int):
            raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}")
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is the null block), got {num_blocks}")
        if num_groups < 1:
            raise ValueError(f"num_groups must be >= 1, got {num_groups}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        #: Every block created so far, indexed by id (the rest are created lazily).
        self.blocks: list[KVCacheBlock] = []
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks, num_blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        #: One map per group: block hash -> block, or {block_id: block} when several.
        self.cached_block_hash_to_block: list[dict[BlockHash, KVCacheBlock | dict[int, KVCacheBlock]]] = [
            {} for _ in range(num_groups)
        ]

    # -- prefix cache -------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        """The cached block with this hash in this group, or None."""
        hit = self.cached_block_hash_to_block[group_id].get(block_hash)
        if hit is None or type(hit) is KVCacheBlock:
            return hit  # type: ignore[return-value]
        return next(iter(hit.values()))  # type: ignore[union-attr]

    def cache_full_blocks(
        self,
        block_hashes: Sequence[BlockHash],
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` under ``block_hashes``.

        Null blocks are skipped. Caching a block that already has a hash is a bug.
        """
        cache = self.cached_block_hash_to_block[group_id]
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            if block.block_hash is not None:
                raise RuntimeError(f"{block} is already cached")
            block_hash = block_hashes[i]
            block.block_hash = block_hash
            block.group_id = group_id
            prev = cache.get(block_hash)
            if prev is None:
                cache[block_hash] = block
            elif type(prev) is KVCacheBlock:
                cache[block_hash] = {prev.block_id: prev, block.block_id: block}
            else:
                prev[block.block_id] = block  # type: ignore[index]

    def uncache(self, block: KVCacheBlock) -> None:
        """Remove a cached block from the prefix cache (its data is not what its hash says)."""
        if block.block_hash is None:
            raise RuntimeError(f"{block} is not cached")
        self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        cache = self.cached_block_hash_to_block[block.group_id]
        block_hash = block.block_hash
        entry = cache[block_hash]  # type: ignore[index]
        if entry is block:
            del cache[block_hash]  # type: ignore[arg-type]
        else:
            del entry[block.block_id]  # type: ignore[union-attr]
            if len(entry) == 1:  # type: ignore[arg-type]
                cache[block_hash] = next(iter(entry.values()))  # type: ignore[union-attr,index]
        block.reset_hash()

    # -- allocation ---------------------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` from the front of the free queue (evicting cached ones)."""
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on hit blocks (a free one leaves the free queue). Nulls are skipped."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in order (callers pass tables reversed)."""
        hashed: list[KVCacheBlock] = []
        unhashed: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (unhashed if block.block_hash is None else hashed).append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"double free of {block}")
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
        if hashed:
            self.free_block_queue.append_n(hashed)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is held. Returns success."""
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        for cache in self.cached_block_hash_to_block:
            cache.clear()
        for block in self.blocks:
            if block.block_hash is not None:
                block.reset_hash()
        return True

    # -- accounting ---------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable blocks (all but the null block) held by requests."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)
