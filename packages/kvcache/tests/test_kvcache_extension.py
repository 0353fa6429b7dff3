"""A new attention type plugs in with one spec, one manager class and one `spec_manager_map` entry,
touching nothing else."""

from dataclasses import dataclass

import pytest
from kvcache import (
    FullAttentionSpec,
    KVCacheManager,
    KVCacheSpec,
    Request,
    SingleTypeKVCacheManager,
    spec_manager_map,
)
from kvcache.single_type_manager import FullAttentionManager


@dataclass(frozen=True)
class ChunkedLocalSpec(KVCacheSpec):
    """Attention within aligned chunks of ``chunk`` tokens (Llama 4 style)."""

    chunk: int


class ChunkedLocalManager(SingleTypeKVCacheManager):
    def remove_skipped_blocks(self, blocks, num_computed_tokens):
        first_needed = (num_computed_tokens // self.spec.chunk * self.spec.chunk) // self.block_size
        removed = []
        for i in range(min(first_needed, len(blocks)) - 1, -1, -1):
            if blocks[i] is self.null_block:
                break
            removed.append(blocks[i])
            blocks[i] = self.null_block
        return removed

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, group_id, block_pool, spec):
        # conservative: a full-attention prefix is always valid
        find = FullAttentionManager.find_longest_cache_hit
        return find(block_hashes, max_length, group_id, block_pool, spec)


def test_chunked_local_plugs_in(monkeypatch):
    with pytest.raises(TypeError, match="no KV cache manager registered for ChunkedLocalSpec"):
        KVCacheManager([ChunkedLocalSpec(2, 4)], num_blocks=40, max_model_len=64)
    monkeypatch.setitem(spec_manager_map, ChunkedLocalSpec, ChunkedLocalManager)
    mgr = KVCacheManager([FullAttentionSpec(2), ChunkedLocalSpec(2, 4)], num_blocks=40, max_model_len=64)
    req = Request("r", list(range(10)))
    assert mgr.allocate_slots(req, 6, hit=mgr.get_computed_blocks(req)) == ([1, 2, 3], [4, 5, 6])
    req.num_computed_tokens = 6
    assert mgr.allocate_slots(req, 4) == ([7, 8], [9, 10])
    assert mgr.get_block_ids("r") == ([1, 2, 3, 7, 8], [0, 0, 6, 9, 10])
    mgr.free(req)
    assert mgr.num_free_blocks == 39
