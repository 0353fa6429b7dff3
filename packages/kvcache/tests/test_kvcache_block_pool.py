import pytest
from kvcache import NONE_HASH, BlockPool, Request, hash_block_tokens, sha256_hash
from kvcache.hashing import block_extra_keys, extend_block_hashes


def free_ids(pool):
    return pool.free_block_queue.get_all_free_block_ids()


def test_null_block_is_block_zero_and_never_free():
    pool = BlockPool(4)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert free_ids(pool) == [1, 2, 3]
    pool.touch([pool.null_block])
    pool.free_blocks([pool.null_block])
    assert pool.null_block.ref_cnt == 0 and free_ids(pool) == [1, 2, 3]
    assert pool.get_usage() == 0.0


@pytest.mark.parametrize("n", [0, 1, -3])
def test_num_blocks_too_small(n):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(n)


def test_num_blocks_type():
    with pytest.raises(TypeError):
        BlockPool(3.0)


def test_usage_excludes_null_block():
    pool = BlockPool(5)
    pool.get_new_blocks(2)
    assert pool.get_usage() == 0.5


def test_hashed_blocks_appended_unhashed_prepended():
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(4)  # 1..4
    hashes = [bytes([i]) * 32 for i in range(4)]
    pool.cache_full_blocks(hashes, blocks, 0, 2)  # 1, 2 cached; 3, 4 not
    pool.free_blocks(reversed(blocks))
    # unhashed 4, 3 go to the front in that order; hashed 2, 1 to the back.
    assert free_ids(pool) == [4, 3, 5, 6, 7, 2, 1]
    assert pool.get_cached_block(hashes[0]) is blocks[0]


def test_lazy_eviction_on_reuse():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(2)
    h = [b"a" * 32, b"b" * 32]
    pool.cache_full_blocks(h, blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [2, 1]
    assert pool.get_cached_block(h[1]) is blocks[1]  # still cached while free
    (b,) = pool.get_new_blocks(1)
    assert b.block_id == 2 and b.block_hash is None and b.ref_cnt == 1
    assert pool.get_cached_block(h[1]) is None and pool.get_cached_block(h[0]) is blocks[0]


def test_touch_removes_free_cached_block_from_queue():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks([b"x" * 32, b"y" * 32], blocks, 0, 2)
    pool.free_blocks(reversed(blocks))
    assert free_ids(pool) == [3, 4, 2, 1]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and free_ids(pool) == [3, 4, 2]
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 2
    pool.free_blocks([blocks[0]])
    assert free_ids(pool) == [3, 4, 2]
    pool.free_blocks([blocks[0]])
    assert free_ids(pool) == [3, 4, 2, 1]


def test_duplicate_hash_blocks_and_group_keys():
    pool = BlockPool(6, num_groups=2)
    a, b, c = pool.get_new_blocks(3)
    h = [b"z" * 32]
    pool.cache_full_blocks(h, [a], 0, 1, group_id=0)
    pool.cache_full_blocks(h, [b], 0, 1, group_id=0)
    pool.cache_full_blocks(h, [c], 0, 1, group_id=1)
    assert pool.get_cached_block(h[0], 0) is a
    assert pool.get_cached_block(h[0], 1) is c
    pool.free_blocks([a])
    pool.get_new_blocks(3)  # 4, 5 then evicts a
    assert pool.get_cached_block(h[0], 0) is b
    with pytest.raises(RuntimeError, match="already cached"):
        pool.cache_full_blocks(h, [b], 0, 1)


def test_reset_prefix_cache_only_when_nothing_held():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks([b"q" * 32], blocks, 0, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"q" * 32) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(b"q" * 32) is None and blocks[0].block_hash is None


def test_double_free_detected():
    pool = BlockPool(3)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])


# -- hashing -------------------------------------------------------------------------------


def test_hash_chain_and_extra_keys():
    toks = list(range(10))
    hashes = []
    extend_block_hashes(hashes, toks, 4)
    assert len(hashes) == 2
    h0 = hash_block_tokens(None, toks[:4])
    assert hashes[0] == h0 != hash_block_tokens(None, toks[:4], (("lora", 1),))
    assert hashes[1] == hash_block_tokens(h0, toks[4:8])
    # a custom hash_fn gets vLLM's tuple
    custom = []
    extend_block_hashes(custom, toks, 4, hash_fn=sha256_hash)
    assert custom[0] == sha256_hash((NONE_HASH, (0, 1, 2, 3), None)) != h0
    assert custom[1] == hash_block_tokens(custom[0], toks[4:8], hash_fn=sha256_hash)
    assert block_extra_keys(0, None, None) is None
    assert block_extra_keys(0, 7, "s") == (("lora", 7), ("cache_salt", "s"))
    assert block_extra_keys(1, 7, "s") == (("lora", 7),)
    assert block_extra_keys(1, None, "s") is None


def test_request_hashes_salt_lora_and_append():
    plain = Request("a", list(range(8)))
    salted = Request("b", list(range(8)), cache_salt="s")
    lora = Request("c", list(range(8)), lora_id=3)
    for r in (plain, salted, lora):
        r.bind_hasher(4)
    assert len({plain.block_hashes[0], salted.block_hashes[0], lora.block_hashes[0]}) == 3
    # the salt is only on block 0, but the chain carries it
    assert salted.block_hashes[0] == hash_block_tokens(None, range(4), (("cache_salt", "s"),))
    assert salted.block_hashes[1] == hash_block_tokens(salted.block_hashes[0], range(4, 8))
    assert lora.block_hashes[1] == hash_block_tokens(lora.block_hashes[0], range(4, 8), (("lora", 3),))
    plain.append_output_token_ids([8, 9, 10])
    assert len(plain.block_hashes) == 2
    plain.append_output_token_ids(11)
    assert len(plain.block_hashes) == 3 and plain.num_tokens == 12
    assert plain.output_token_ids == [8, 9, 10, 11]
    with pytest.raises(ValueError, match="already hashed"):
        plain.bind_hasher(8)


def test_request_validation():
    with pytest.raises(ValueError, match="empty"):
        Request("a", [])
    with pytest.raises(TypeError):
        Request(3, [1])
