"""The shortcuts of the hot paths give exactly what the general code gives."""

import hashlib
import random
from array import array

import pytest
from kvcache import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec
from kvcache.hashing import NONE_HASH, hash_block_tokens
from kvcache.single_type_manager import FullAttentionManager, SlidingWindowManager


def test_only_types_that_can_skip_run_the_skip_policy():
    assert not FullAttentionManager.can_skip_blocks
    assert SlidingWindowManager.can_skip_blocks

    class SkippingFull(FullAttentionManager):  # overrides the policy: must not be skipped
        def remove_skipped_blocks(self, blocks, num_computed_tokens):
            return []

    assert SkippingFull.can_skip_blocks
    mgr = KVCacheManager([FullAttentionSpec(2), SlidingWindowSpec(2, 4)], num_blocks=20, max_model_len=64)
    assert [m.group_id for m in mgr._skipping_managers] == [1]


def test_sliding_skip_is_idempotent_between_block_boundaries():
    mgr = KVCacheManager([SlidingWindowSpec(2, 4)], num_blocks=20, max_model_len=64)
    m = mgr.managers[0]
    null = mgr.block_pool.null_block
    assert m.remove_skipped_blocks([], 100) == []
    table = mgr.block_pool.get_new_blocks(6)
    ids = [b.block_id for b in table]
    assert m.remove_skipped_blocks(table, 4) == []  # 1 token out of the window: no whole block
    assert [b.block_id for b in m.remove_skipped_blocks(table, 8)] == [ids[1], ids[0]]
    assert m.remove_skipped_blocks(table, 8) == []  # same boundary again: nothing new
    assert [b.block_id for b in m.remove_skipped_blocks(table, 9)] == [ids[2]]
    assert m.remove_skipped_blocks(table, 10) == []
    assert [b.block_id for b in m.remove_skipped_blocks(table, 11)] == [ids[3]]
    # far past the end: clamped to the table, stops at the first null
    assert [b.block_id for b in m.remove_skipped_blocks(table, 1000)] == [ids[5], ids[4]]
    assert all(b is null for b in table)


@pytest.mark.parametrize("lora_id, salt", [(None, None), (7, None), (None, "s")])
def test_token_encoding_is_int64_little_endian(lora_id, salt):
    tokens = [random.Random(1).randrange(-(2**63), 2**63) for _ in range(8)]
    req = Request("r", tokens + [1], cache_salt=salt, lora_id=lora_id)
    req.bind_hasher(4, None)
    data = array("q", tokens).tobytes()
    assert data == b"".join(t.to_bytes(8, "little", signed=True) for t in tokens)
    first = hash_block_tokens(None, tokens[:4], (("lora", lora_id),) if lora_id is not None else None)
    if salt is None:
        assert req.block_hashes[0] == first
    assert req.block_hashes[1] == hash_block_tokens(
        req.block_hashes[0], tokens[4:], (("lora", lora_id),) if lora_id is not None else None
    )
    if lora_id is None and salt is None:
        assert first == hashlib.sha256(NONE_HASH + data[:32]).digest()


def test_bad_tokens_raise_the_array_errors():
    with pytest.raises(OverflowError):
        Request("r", [2**63] * 5).bind_hasher(4, None)
    with pytest.raises(TypeError):
        Request("r", [1.5] * 5).bind_hasher(4, None)


@pytest.mark.parametrize("spec", [FullAttentionSpec(2), SlidingWindowSpec(2, 5)])
def test_single_group_lookup_is_its_policy_hit(spec):
    rng = random.Random(0)
    mgr = KVCacheManager([spec], num_blocks=200, max_model_len=256)
    prefix = [rng.randrange(50) for _ in range(40)]
    first = Request("a", prefix + [1, 2, 3])
    mgr.allocate_slots(first, first.num_tokens, hit=mgr.get_computed_blocks(first))
    first.num_computed_tokens = first.num_tokens
    mgr.free(first)
    for n in (1, 7, 20, 39, 40, 41):
        req = Request("b", prefix[:n] + [99])
        req.bind_hasher(2, None)
        m = mgr.managers[0]
        blocks = m.find_longest_cache_hit(
            req.block_hashes, (req.num_tokens - 1) // 2 * 2, 0, mgr.block_pool, spec
        )
        hit = mgr.get_computed_blocks(req)
        assert hit.num_tokens == len(blocks) * 2
        assert hit.blocks == (blocks,)


@pytest.mark.parametrize("spec", [FullAttentionSpec(2), SlidingWindowSpec(2, 5)])
def test_hit_lookups_go_through_the_pool(spec, monkeypatch):
    """Both policies read the prefix cache only through BlockPool.get_cached_block."""
    mgr = KVCacheManager([spec], num_blocks=50, max_model_len=64)
    first = Request("a", list(range(20)))
    mgr.allocate_slots(first, first.num_tokens, hit=mgr.get_computed_blocks(first))
    first.num_computed_tokens = first.num_tokens
    mgr.free(first)
    pool, looked_up = mgr.block_pool, []
    real = pool.get_cached_block

    def get_cached_block(block_hash, group_id=0):
        looked_up.append(block_hash)
        return real(block_hash, group_id)

    monkeypatch.setattr(pool, "get_cached_block", get_cached_block)
    hit = mgr.get_computed_blocks(Request("b", list(range(20)) + [7]))
    assert hit.num_tokens == 20 and looked_up
