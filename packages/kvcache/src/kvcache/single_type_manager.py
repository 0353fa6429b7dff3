"""Per-attention-type block managers.

Each attention type is one small class with exactly two policies:

- ``remove_skipped_blocks(blocks, num_computed_tokens)``: which table entries no
  future query can see; they are replaced by the null block in place and returned
  in eviction order (the caller frees them);
- ``find_longest_cache_hit(block_hashes, max_length, group_id, block_pool, spec)``:
  the longest block-aligned prefix ``<= max_length`` tokens whose needed blocks are
  all cached, as a block list (null where a block is not needed).

Everything else (tables, allocation, caching, freeing) is generic and lives in
``SingleTypeKVCacheManager``. ``spec_manager_map`` (vLLM's name) maps each spec
type to its class, so adding an attention type (say chunked-local attention) means
one spec, one class and one entry there: no other class changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvcache.block import KVCacheBlock
from kvcache.block_pool import BlockPool
from kvcache.hashing import BlockHash
from kvcache.request import Request
from kvcache.specs import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec, cdiv


class SingleTypeKVCacheManager:
    """Block tables of one KV cache group (one attention type) over the shared pool."""

    #: False only for types whose ``remove_skipped_blocks`` never removes anything
    #: (full attention); ``KVCacheManager`` then skips the per-step call. A subclass
    #: that defines its own ``remove_skipped_blocks`` is reset to True.
    can_skip_blocks: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if "remove_skipped_blocks" in cls.__dict__ and "can_skip_blocks" not in cls.__dict__:
            cls.can_skip_blocks = True

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.block_pool = block_pool
        self.group_id = group_id
        self.null_block = block_pool.null_block
        #: request id -> block table (null block where skipped)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        #: request id -> number of leading table entries already registered in the cache
        self.num_cached_block: dict[str, int] = {}

    # -- the two policies ------------------------------------------------------------------

    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        """Null out the entries of ``blocks`` no query can see; return them in eviction order."""
        raise NotImplementedError

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_id: int,
        block_pool: BlockPool,
        spec: KVCacheSpec,
    ) -> list[KVCacheBlock]:
        """Blocks of the longest acceptable cached prefix of at most ``max_length`` tokens."""
        raise NotImplementedError

    # -- generic bookkeeping -----------------------------------------------------------------

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock] = ()
    ) -> int:
        """Free-queue blocks this step consumes: new blocks plus hit blocks that are free now."""
        table = self.req_to_blocks.get(request_id)
        held = len(new_computed_blocks) + (len(table) if table is not None else 0)
        num_new = cdiv(num_tokens, self.block_size) - held
        num_evictable = 0
        for block in new_computed_blocks:
            if block.ref_cnt == 0 and not block.is_null:
                num_evictable += 1
        return max(num_new, 0) + num_evictable

    def add_request(self, request_id: str, hit_blocks: Sequence[KVCacheBlock]) -> None:
        """Start a table for a new request from its (already null-padded) hit blocks."""
        self.block_pool.touch(hit_blocks)
        self.req_to_blocks[request_id] = list(hit_blocks)
        self.num_cached_block[request_id] = len(hit_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow the table to cover ``num_tokens`` tokens; return the new blocks."""
        table = self.req_to_blocks[request_id]
        num_new = cdiv(num_tokens, self.block_size) - len(table)
        if num_new <= 0:
            return []
        new = self.block_pool.get_new_blocks(num_new)
        table.extend(new)
        return new

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register every full block among the first ``num_tokens`` tokens."""
        rid = request.request_id
        num_full = num_tokens // self.block_size
        num_cached = self.num_cached_block[rid]
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(
                request.block_hashes, self.req_to_blocks[rid], num_cached, num_full, self.group_id
            )
            self.num_cached_block[rid] = num_full

    def uncache_blocks_from(self, request_id: str, first_block: int) -> int:
        """Uncache the request's registered table entries from index ``first_block`` on
        (their K/V was never written); return how many blocks were uncached."""
        num_cached = self.num_cached_block[request_id]
        if first_block >= num_cached:
            return 0
        table = self.req_to_blocks[request_id]
        num_uncached = 0
        for block in table[first_block:num_cached]:
            if not block.is_null and block.block_hash is not None:
                self.block_pool.uncache(block)
                num_uncached += 1
        self.num_cached_block[request_id] = first_block
        return num_uncached

    def free(self, request_id: str) -> None:
        """Release the request's blocks, last block first (tails are evicted before parents)."""
        table = self.req_to_blocks.pop(request_id)
        self.num_cached_block.pop(request_id, None)
        self.block_pool.free_blocks(reversed(table))


class FullAttentionManager(SingleTypeKVCacheManager):
    """Full attention: nothing is ever skipped; a hit is the cached prefix, left to right."""

    can_skip_blocks = False

    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        return []

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_id: int,
        block_pool: BlockPool,
        spec: KVCacheSpec,
    ) -> list[KVCacheBlock]:
        """Chained hashes: the first miss ends the hit (no later block can match)."""
        out: list[KVCacheBlock] = []
        for i in range(min(max_length // spec.block_size, len(block_hashes))):
            block = block_pool.get_cached_block(block_hashes[i], group_id)
            if block is None:
                break
            out.append(block)
        return out


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window ``W``: the query at position ``n`` sees positions ``n-W+1 .. n``.

    Skip. With ``c`` computed tokens the next query is at ``c`` or later, so tokens
    ``[0, c - W + 1)`` are dead: ``skipped = max(0, c - W + 1)``, and blocks
    ``[0, skipped // B)`` become null, freed from the highest index down, stopping
    at the first block already null. Example (W=4, B=2, 11-token prompt in chunks
    4, 4, 3 then a decode step): tables ``[1,2]`` -> ``[1,2,3,4]`` -> (8 computed:
    skip 5 tokens = 2 blocks, freed in order 2, 1) ``[0,0,3,4,5,6]`` -> (11
    computed: skip 8 tokens = 4 blocks, freed 4, 3) ``[0,0,0,0,5,6]``.

    Hit. A hit of ``h`` tokens needs the ``W - 1`` tokens before position ``h``,
    i.e. ``cdiv(W - 1, B)`` consecutive cached blocks ending at block ``h // B``.
    Scan right to left from ``max_length // B``; the first run that long wins and
    everything left of it is null. If none is long enough, the hit is the cached
    run starting at block 0 (a short prefix, nothing skipped). Example (W=2, B=1,
    prompt ABCDE, only D and E cached): max length 4, need 1 block, D at index 3
    is cached -> ``[null, null, null, D]``, 4 tokens. With ``W == 1`` the need is 0
    but, as in vLLM, only a cached block ends a hit, so an all-miss gives 0.
    """

    def __init__(self, spec: KVCacheSpec, block_pool: BlockPool, group_id: int) -> None:
        super().__init__(spec, block_pool, group_id)
        self.window: int = spec.window  # type: ignore[attr-defined]

    def remove_skipped_blocks(
        self, blocks: list[KVCacheBlock], num_computed_tokens: int
    ) -> list[KVCacheBlock]:
        num_skipped_blocks = (num_computed_tokens - self.window + 1) // self.block_size
        if num_skipped_blocks > len(blocks):
            num_skipped_blocks = len(blocks)
        null = self.null_block
        if num_skipped_blocks <= 0 or blocks[num_skipped_blocks - 1] is null:
            return []  # nothing out of the window yet, or (most decode steps) nothing new
        removed: list[KVCacheBlock] = []
        for i in range(num_skipped_blocks - 1, -1, -1):
            block = blocks[i]
            if block is null:
                break
            removed.append(block)
            blocks[i] = null
        return removed

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        group_id: int,
        block_pool: BlockPool,
        spec: KVCacheSpec,
    ) -> list[KVCacheBlock]:
        block_size = spec.block_size
        need = cdiv(spec.window - 1, block_size)  # type: ignore[attr-defined]
        run: list[KVCacheBlock] = []  # cached blocks right to left, ending at the current candidate
        for i in range(min(max_length // block_size, len(block_hashes)) - 1, -1, -1):
            block = block_pool.get_cached_block(block_hashes[i], group_id)
            if block is None:
                run.clear()
                continue
            run.append(block)
            if len(run) >= need:
                run.reverse()
                return [block_pool.null_block] * i + run
        run.reverse()  # the run that reached block 0, if any
        return run


#: The manager class of each spec type (a spec subclass without an entry gets its base's manager).
spec_manager_map: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
}


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    """The manager class for ``spec`` (most specific spec type wins); TypeError when none serves it."""
    for klass in type(spec).__mro__:
        cls = spec_manager_map.get(klass)  # type: ignore[arg-type]
        if cls is not None:
            return cls
    raise TypeError(f"no KV cache manager registered for {type(spec).__name__}")
