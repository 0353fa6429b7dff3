import pytest
from kvcache import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec
from kvcache.specs import cdiv


def free_ids(mgr):
    return mgr.block_pool.free_block_queue.get_all_free_block_ids()


def snapshot(mgr):
    """Everything observable about the manager's state."""
    pool = mgr.block_pool
    return (
        free_ids(mgr),
        [(b.block_id, b.ref_cnt, b.block_hash, b.group_id) for b in pool.blocks],
        [dict(m) for m in pool.cached_block_hash_to_block],
        [{k: [b.block_id for b in v] for k, v in m.req_to_blocks.items()} for m in mgr.managers],
        [dict(m.num_cached_block) for m in mgr.managers],
        sorted(mgr._requests),
        repr(mgr._stats),
    )


def step(mgr, req, n, hit=None):
    new = mgr.allocate_slots(req, n, hit=hit)
    assert new is not None
    req.num_computed_tokens += (hit.num_tokens if hit else 0) + n
    return new


# -- the three worked examples of the issue ---------------------------------------------------


def test_example1_window1000_chunk2000_prompt4000():
    mgr = KVCacheManager([SlidingWindowSpec(block_size=1, window=1000)], num_blocks=5000, max_model_len=8000)
    req = Request("r", [i % 97 for i in range(4000)])
    hit = mgr.get_computed_blocks(req)
    assert hit.num_tokens == 0
    (new,) = step(mgr, req, 2000, hit)
    assert new == list(range(1, 2001)) and mgr.get_block_ids("r") == (list(range(1, 2001)),)
    (new,) = step(mgr, req, 2000)
    (table,) = mgr.get_block_ids("r")
    assert table[:1001] == [0] * 1001 and table[1001:2000] == list(range(1002, 2001))
    assert len(table) == 4000 and table.count(0) == 1001
    # freed from the highest index down: blocks 1001..1 (hashed, so appended), then reused? No:
    # 2000 fresh blocks remain ahead of them in the queue.
    assert new == list(range(2001, 4001))
    assert free_ids(mgr)[-1001:] == list(range(1001, 0, -1))
    req.append_output_token_ids([5])
    (new,) = step(mgr, req, 1)
    (table,) = mgr.get_block_ids("r")
    assert table.count(0) == 3001 and table[:3001] == [0] * 3001 and len(table) == 4001
    assert table[3001:4000] == list(range(3002, 4001))
    assert new == [4001]
    assert mgr.num_free_blocks == 4999 - 1000


def test_example2_abcde_window2_only_d_e_cached():
    A, B, C, D, E, X, Y, Z = range(10, 18)
    mgr = KVCacheManager([SlidingWindowSpec(block_size=1, window=2)], num_blocks=6, max_model_len=64)
    r1 = Request("r1", [A, B, C, D, E])
    step(mgr, r1, 4, mgr.get_computed_blocks(r1))  # blocks 1..4 = A B C D
    step(mgr, r1, 1)  # 4 computed: skip 3 -> frees C(3), B(2), A(1); E gets block 5
    assert mgr.get_block_ids("r1") == ([0, 0, 0, 4, 5],)
    assert free_ids(mgr) == [3, 2, 1]
    r2 = Request("r2", [X, Y, Z])
    step(mgr, r2, 3, mgr.get_computed_blocks(r2))  # evicts C, B, A
    mgr.free(r2)
    mgr.free(r1)
    r3 = Request("r3", [A, B, C, D, E])
    hit = mgr.get_computed_blocks(r3)
    assert hit.num_tokens == 4 and hit.block_ids == ([0, 0, 0, 4],)
    before = free_ids(mgr)
    assert 4 in before
    (new,) = step(mgr, r3, 1, hit)
    assert mgr.get_block_ids("r3") == ([0, 0, 0, 4, new[0]],)
    assert mgr.block_pool.blocks[4].ref_cnt == 1


def test_example3_window4_block2_chunks_4_4_3_then_decode():
    mgr = KVCacheManager([SlidingWindowSpec(block_size=2, window=4)], num_blocks=20, max_model_len=64)
    req = Request("r", list(range(100, 111)))
    step(mgr, req, 4, mgr.get_computed_blocks(req))
    assert mgr.get_block_ids("r") == ([1, 2],)
    step(mgr, req, 4)
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4],)
    step(mgr, req, 3)
    assert mgr.get_block_ids("r") == ([0, 0, 3, 4, 5, 6],)
    assert free_ids(mgr)[-2:] == [2, 1]  # freed in order 2, 1
    req.append_output_token_ids([7])
    step(mgr, req, 1)
    assert mgr.get_block_ids("r") == ([0, 0, 0, 0, 5, 6],)
    assert free_ids(mgr)[-4:] == [2, 1, 4, 3]
    # follow-up: 13 tokens sharing the first 12 hits 12 tokens
    r2 = Request("r2", req.all_token_ids + [9])
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_tokens == 12 and hit.block_ids == ([0, 0, 0, 0, 5, 6],)
    (new,) = step(mgr, r2, 1, hit)
    assert mgr.get_block_ids("r2") == ([0, 0, 0, 0, 5, 6] + new,)
    assert mgr.block_pool.blocks[5].ref_cnt == 2


# -- full attention rules ---------------------------------------------------------------------


def test_full_attention_prefix_hit_and_last_block_recomputed():
    mgr = KVCacheManager([FullAttentionSpec(4)], num_blocks=16, max_model_len=64)
    r1 = Request("r1", list(range(12)))
    assert step(mgr, r1, 12, mgr.get_computed_blocks(r1)) == ([1, 2, 3],)
    # same 12-token prompt: exact block multiple, the last block is lost
    r2 = Request("r2", list(range(12)))
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_tokens == 8 and hit.block_ids == ([1, 2],)
    assert step(mgr, r2, 4, hit) == ([4],)
    assert mgr.get_block_ids("r2") == ([1, 2, 4],)
    # one more token: all 3 blocks hit
    r3 = Request("r3", list(range(13)))
    hit = mgr.get_computed_blocks(r3)
    assert hit.num_tokens == 12 and hit.block_ids == ([1, 2, 3],)
    # a different middle block stops the prefix
    r4 = Request("r4", [0, 1, 2, 3, 9, 9, 9, 9, 8, 9, 10, 11, 12])
    assert mgr.get_computed_blocks(r4).num_tokens == 4


def test_blocks_cached_when_scheduled_and_partial_block_later():
    mgr = KVCacheManager([FullAttentionSpec(4)], num_blocks=16, max_model_len=64)
    r1 = Request("r1", list(range(10)))
    step(mgr, r1, 6, mgr.get_computed_blocks(r1))  # block 1 full -> cached now; block 2 partial
    r2 = Request("r2", list(range(10)))
    assert mgr.get_computed_blocks(r2).block_ids == ([1],)
    step(mgr, r1, 4)  # block 2 now full -> cached
    assert mgr.get_computed_blocks(r2).block_ids == ([1, 2],)
    r1.append_output_token_ids([10, 11])  # completes block 3 once computed
    step(mgr, r1, 1)
    step(mgr, r1, 1)
    r3 = Request("r3", list(range(12)) + [0])
    assert mgr.get_computed_blocks(r3).block_ids == ([1, 2, 3],)


def test_free_reverse_order_and_eviction_order():
    mgr = KVCacheManager([FullAttentionSpec(2)], num_blocks=6, max_model_len=64)
    r1 = Request("r1", list(range(5)))
    step(mgr, r1, 5, mgr.get_computed_blocks(r1))  # blocks 1, 2 cached; 3 partial
    mgr.free(r1)
    # unhashed 3 goes first, hashed 2, 1 after the untouched 4, 5
    assert free_ids(mgr) == [3, 4, 5, 2, 1]
    r2 = Request("r2", [50, 51, 52, 53, 54, 55, 56])
    assert step(mgr, r2, 7, mgr.get_computed_blocks(r2)) == ([3, 4, 5, 2],)
    # block 2 (tail of r1's prefix) was evicted, its parent 1 was not
    r3 = Request("r3", list(range(5)))
    assert mgr.get_computed_blocks(r3).block_ids == ([1],)


def test_disabled_caching():
    mgr = KVCacheManager([FullAttentionSpec(2)], num_blocks=6, max_model_len=64, enable_caching=False)
    r1 = Request("r1", list(range(5)))
    step(mgr, r1, 5, mgr.get_computed_blocks(r1))
    mgr.free(r1)
    assert free_ids(mgr) == [3, 2, 1, 4, 5]
    r2 = Request("r2", list(range(5)))
    assert mgr.get_computed_blocks(r2).num_tokens == 0
    assert mgr.make_prefix_cache_stats().queries == 0


def test_cache_salt_and_lora_isolate():
    mgr = KVCacheManager([FullAttentionSpec(2)], num_blocks=20, max_model_len=64)
    r1 = Request("r1", list(range(7)), cache_salt="a")
    step(mgr, r1, 7, mgr.get_computed_blocks(r1))
    assert mgr.get_computed_blocks(Request("x", list(range(7)))).num_tokens == 0
    assert mgr.get_computed_blocks(Request("y", list(range(7)), cache_salt="b")).num_tokens == 0
    assert mgr.get_computed_blocks(Request("z", list(range(7)), cache_salt="a")).num_tokens == 6
    assert mgr.get_computed_blocks(Request("w", list(range(7)), cache_salt="a", lora_id=1)).num_tokens == 0


def test_lookahead_allocates_but_does_not_cache():
    mgr = KVCacheManager([FullAttentionSpec(2)], num_blocks=20, max_model_len=64)
    r1 = Request("r1", list(range(3)))
    new = mgr.allocate_slots(r1, 3, hit=mgr.get_computed_blocks(r1), num_lookahead_tokens=3)
    assert new == ([1, 2, 3],)
    assert mgr.block_pool.blocks[1].block_hash is not None and mgr.block_pool.blocks[2].block_hash is None


# -- sliding window rules ------------------------------------------------------------------------


def test_sliding_skip_stops_at_first_null_and_frees_descending():
    mgr = KVCacheManager([SlidingWindowSpec(block_size=1, window=3)], num_blocks=30, max_model_len=64)
    req = Request("r", list(range(20)))
    step(mgr, req, 5, mgr.get_computed_blocks(req))  # blocks 1..5
    step(mgr, req, 2)  # 5 computed: skip 3 -> free 3, 2, 1
    assert mgr.get_block_ids("r") == ([0, 0, 0, 4, 5, 6, 7],)
    assert free_ids(mgr)[-3:] == [3, 2, 1]
    step(mgr, req, 1)  # 7 computed: skip 5 -> free 5, 4 (stops at null index 2)
    assert mgr.get_block_ids("r")[0][:6] == [0] * 5 + [6]
    assert free_ids(mgr)[-5:] == [3, 2, 1, 5, 4]


def test_sliding_hit_fallback_run_from_block_zero():
    # window 9, block 2: a hit needs cdiv(8, 2) = 4 blocks; a 3-block prefix is still valid
    mgr = KVCacheManager([SlidingWindowSpec(block_size=2, window=9)], num_blocks=30, max_model_len=64)
    r1 = Request("r1", list(range(7)))
    step(mgr, r1, 7, mgr.get_computed_blocks(r1))
    r2 = Request("r2", list(range(7)) + [50] * 10)
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_tokens == 6 and hit.block_ids == ([1, 2, 3],)


def test_sliding_hit_rightmost_run_wins():
    mgr = KVCacheManager([SlidingWindowSpec(block_size=2, window=4)], num_blocks=40, max_model_len=64)
    r1 = Request("r1", list(range(16)) + [99])
    step(mgr, r1, 17, mgr.get_computed_blocks(r1))  # blocks 1..8 cached, 9 partial
    r2 = Request("r2", list(range(16)) + [1, 2, 3])
    hit = mgr.get_computed_blocks(r2)  # need 2 blocks: 7, 8 end at token 16
    assert hit.num_tokens == 16 and hit.block_ids == ([0] * 6 + [7, 8],)
    new = step(mgr, r2, 3, hit)
    assert mgr.get_block_ids("r2") == ([0] * 6 + [7, 8] + new[0],)
    blocks = mgr.block_pool.blocks
    assert blocks[1].ref_cnt == 1 and blocks[7].ref_cnt == 2  # block 1 untouched: outside the window


def test_window_one_quirk_all_miss_is_zero():
    mgr = KVCacheManager([SlidingWindowSpec(block_size=1, window=1)], num_blocks=10, max_model_len=64)
    assert mgr.get_computed_blocks(Request("r", [1, 2, 3])).num_tokens == 0


# -- hybrid --------------------------------------------------------------------------------------


def test_hybrid_hit_is_longest_prefix_all_groups_accept():
    groups = [FullAttentionSpec(2), SlidingWindowSpec(block_size=2, window=4)]
    mgr = KVCacheManager(groups, num_blocks=60, max_model_len=64)
    r1 = Request("r1", list(range(12)) + [99])
    new = step(mgr, r1, 13, mgr.get_computed_blocks(r1))
    assert new == ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14])
    r2 = Request("r2", list(range(12)) + [5])
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_tokens == 12
    assert hit.block_ids == ([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 12, 13])
    mgr.free(r1)
    # evict the sliding group's block 13 only (tokens 10-11): the sliding group can then
    # end a hit at 10 tokens (blocks 11, 12), the full group accepts 10: hit = 10
    pool = mgr.block_pool
    pool._evict(pool.blocks[13])  # as if reused and freed again
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_tokens == 10
    assert hit.block_ids == ([1, 2, 3, 4, 5], [0, 0, 0, 11, 12])
    # evict the full group's block 2 (tokens 2-3): full accepts 2 tokens, sliding then
    # needs its run from block 0 (block 8): hit = 2
    pool._evict(pool.blocks[2])
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_tokens == 2 and hit.block_ids == ([1], [8])
    step(mgr, r2, 11, hit)
    assert mgr.get_block_ids("r2")[1][0] == 8


def test_hybrid_cache_keys_include_group_id():
    groups = [FullAttentionSpec(2), FullAttentionSpec(2)]
    mgr = KVCacheManager(groups, num_blocks=30, max_model_len=64)
    r1 = Request("r1", list(range(5)))
    step(mgr, r1, 5, mgr.get_computed_blocks(r1))
    pool = mgr.block_pool
    h0 = r1.block_hashes[0]
    assert pool.get_cached_block(h0, 0).block_id == 1 and pool.get_cached_block(h0, 1).block_id == 4


def test_mixed_block_sizes_rejected():
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager([FullAttentionSpec(2), SlidingWindowSpec(4, 8)], num_blocks=10, max_model_len=64)


# -- out of blocks: None changes nothing but the sliding-window skip ------------------------------


def test_allocate_none_changes_nothing_new_request_with_hit():
    mgr = KVCacheManager([FullAttentionSpec(2)], num_blocks=6, max_model_len=64)
    r1 = Request("r1", list(range(5)))
    step(mgr, r1, 5, mgr.get_computed_blocks(r1))
    mgr.free(r1)
    hog = Request("hog", [9] * 4)
    step(mgr, hog, 4, mgr.get_computed_blocks(hog))  # takes 3 (unhashed, front) and 4
    r2 = Request("r2", list(range(5)) + [1] * 6)
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_tokens == 4
    before = snapshot(mgr)
    assert mgr.allocate_slots(r2, 7, hit=hit) is None
    assert snapshot(mgr) == before
    assert mgr.allocate_slots(r2, 1, hit=hit) == ([5],)


def test_refused_allocation_still_frees_what_the_window_no_longer_needs():
    """vLLM: the skip is applied (and its blocks freed) before the capacity check, so it
    stays done when the call returns None."""
    mgr = KVCacheManager([SlidingWindowSpec(block_size=2, window=5)], num_blocks=8, max_model_len=64)
    req = Request("r", list(range(30)))
    step(mgr, req, 10, mgr.get_computed_blocks(req))  # blocks 1..5 for tokens 0..9, 2 free
    assert mgr.get_block_ids("r") == ([1, 2, 3, 4, 5],) and mgr.num_free_blocks == 2
    hashes = [dict(c) for c in mgr.block_pool.cached_block_hash_to_block]
    # 10 computed: the next query (position 10) sees 6..10, so tokens 0..5 (blocks 0..2) are dead;
    # 10 more tokens need 5 new blocks, 2 + 3 freed = 5 free: exactly one short with 12 more
    assert mgr.allocate_slots(req, 12) is None
    assert mgr.num_free_blocks == 2 + 3
    assert mgr.get_block_ids("r") == ([0, 0, 0, 4, 5],)
    assert free_ids(mgr) == [6, 7, 3, 2, 1]  # freed last block first, cached ones at the back
    assert [dict(c) for c in mgr.block_pool.cached_block_hash_to_block] == hashes  # still hit-able
    assert mgr.block_pool.blocks[1].ref_cnt == 0
    # a second refusal (the scheduler retries after each preemption) frees nothing more
    before = snapshot(mgr)
    assert mgr.allocate_slots(req, 12) is None
    assert snapshot(mgr) == before
    # 10 tokens fit now: the 2 never-used blocks first, then the LRU cached ones
    assert step(mgr, req, 10) == ([6, 7, 3, 2, 1],)
    assert mgr.num_free_blocks == 0


def test_refused_allocation_skip_hybrid_and_shared_blocks():
    """Only the sliding group drops blocks; a dropped block another request still holds is
    nulled in this table but stays out of the free queue."""
    groups = [FullAttentionSpec(2), SlidingWindowSpec(block_size=2, window=5)]
    mgr = KVCacheManager(groups, num_blocks=18, max_model_len=64)
    r1 = Request("r1", list(range(9)))
    step(mgr, r1, 9, mgr.get_computed_blocks(r1))  # full 1..5, sliding 6..10
    r2 = Request("r2", list(range(7)) + [99] * 8)
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_tokens == 6 and hit.block_ids == ([1, 2, 3], [0, 7, 8])
    step(mgr, r2, 6, hit)  # 12 computed; 3 new blocks per group: one left free
    assert mgr.get_block_ids("r2") == ([1, 2, 3, 11, 12, 13], [0, 7, 8, 14, 15, 16])
    assert free_ids(mgr) == [17]
    # r2: 12 computed, window 5: tokens 0..7 dead = sliding blocks 0..3; 7 and 8 are r1's too
    assert mgr.allocate_slots(r2, 3) is None  # needs 2 + 2 new blocks, 1 + 1 free
    assert mgr.get_block_ids("r2") == ([1, 2, 3, 11, 12, 13], [0, 0, 0, 0, 15, 16])
    assert free_ids(mgr) == [17, 14]
    assert [mgr.block_pool.blocks[b].ref_cnt for b in (7, 8, 14)] == [1, 1, 0]
    mgr.free(r1)
    r2_blocks = {b for table in mgr.get_block_ids("r2") for b in table if b}
    assert mgr.num_free_blocks == mgr.num_blocks - 1 - len(r2_blocks) == 9


def test_refused_admission_changes_nothing_sliding():
    """A new request holds no blocks: nothing to skip, a refused admission changes nothing."""
    mgr = KVCacheManager([SlidingWindowSpec(block_size=1, window=2)], num_blocks=4, max_model_len=64)
    req = Request("r", list(range(20)))
    before = snapshot(mgr)
    assert mgr.allocate_slots(req, 4, hit=mgr.get_computed_blocks(req)) is None
    assert snapshot(mgr) == before and "r" not in mgr


def test_free_of_a_request_holding_no_blocks_is_a_no_op():
    """vLLM: aborting a waiting request frees nothing and raises nothing."""
    mgr = KVCacheManager([FullAttentionSpec(2)], num_blocks=10, max_model_len=64)
    r1 = Request("r1", [1, 2, 3])
    step(mgr, r1, 3, mgr.get_computed_blocks(r1))
    before = snapshot(mgr)
    mgr.free(Request("waiting", [1, 2, 3]))
    mgr.free("never-seen")
    assert snapshot(mgr) == before
    mgr.free(r1)
    assert mgr.num_free_blocks == 9
    mgr.free(r1)  # twice: the second is a no-op too
    assert mgr.num_free_blocks == 9 and "r1" not in mgr


# -- bad input ----------------------------------------------------------------------------------


@pytest.fixture
def busy():
    mgr = KVCacheManager([FullAttentionSpec(2), SlidingWindowSpec(2, 4)], num_blocks=40, max_model_len=16)
    r1 = Request("r1", list(range(9)))
    step(mgr, r1, 4, mgr.get_computed_blocks(r1))
    return mgr, r1


@pytest.mark.parametrize(
    "call, exc",
    [
        (lambda m, r: m.allocate_slots(Request("r1", [1, 2, 3]), 1), ValueError),  # duplicate id
        (lambda m, r: m.get_computed_blocks(r), ValueError),  # running request
        (lambda m, r: m.allocate_slots(r, 0), ValueError),
        (lambda m, r: m.allocate_slots(r, -1), ValueError),
        (lambda m, r: m.allocate_slots(r, 1.0), TypeError),
        (lambda m, r: m.allocate_slots(r, 1, num_lookahead_tokens=-1), ValueError),
        (lambda m, r: m.allocate_slots(r, 6), ValueError),  # more tokens than the request has
        (lambda m, r: m.allocate_slots(r, 5, num_lookahead_tokens=8), ValueError),  # > max_model_len
        (lambda m, r: m.allocate_slots(Request("big", list(range(20))), 17), ValueError),
        (lambda m, r: m.free(Request("r1", [1])), ValueError),
        (lambda m, r: m.get_block_ids("nobody"), KeyError),
        (lambda m, r: m.allocate_slots(r, 1, hit=m.get_computed_blocks(Request("o", [1, 2, 3]))), ValueError),
        (lambda m, r: m.allocate_slots("r1", 1), TypeError),
    ],
)
def test_bad_input_raises_and_changes_nothing(busy, call, exc):
    mgr, r1 = busy
    before = snapshot(mgr)
    with pytest.raises(exc):
        call(mgr, r1)
    assert snapshot(mgr) == before


def test_new_request_with_stale_computed_tokens_rejected():
    mgr = KVCacheManager([FullAttentionSpec(2)], num_blocks=10, max_model_len=64)
    r = Request("r", [1, 2, 3])
    r.num_computed_tokens = 2
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="num_computed_tokens"):
        mgr.allocate_slots(r, 1)
    assert snapshot(mgr) == before


def test_stale_hit_rejected():
    mgr = KVCacheManager([FullAttentionSpec(1)], num_blocks=4, max_model_len=64)
    r1 = Request("r1", [1, 2, 3])
    step(mgr, r1, 3, mgr.get_computed_blocks(r1))
    mgr.free(r1)
    r2 = Request("r2", [1, 2, 3])
    hit = mgr.get_computed_blocks(r2)
    assert hit.num_tokens == 2
    other = Request("o", [7, 8, 9])
    step(mgr, other, 3, mgr.get_computed_blocks(other))  # evicts them all
    before = snapshot(mgr)
    with pytest.raises(ValueError, match="stale"):
        mgr.allocate_slots(r2, 1, hit=hit)
    assert snapshot(mgr) == before


@pytest.mark.parametrize(
    "make",
    [
        lambda: SlidingWindowSpec(block_size=2, window=0),
        lambda: SlidingWindowSpec(block_size=0, window=4),
        lambda: FullAttentionSpec(0),
        lambda: KVCacheManager([FullAttentionSpec(2)], num_blocks=1, max_model_len=8),
        lambda: KVCacheManager([], num_blocks=10, max_model_len=8),
        lambda: KVCacheManager([FullAttentionSpec(2)], num_blocks=10, max_model_len=0),
    ],
)
def test_bad_construction(make):
    with pytest.raises(ValueError):
        make()


def test_bad_types_in_construction():
    with pytest.raises(TypeError):
        FullAttentionSpec(True)
    with pytest.raises(TypeError):
        KVCacheManager(["full"], num_blocks=10, max_model_len=8)


# -- stats, reset, accounting ---------------------------------------------------------------


def test_stats_in_tokens_and_preempted_split():
    mgr = KVCacheManager([FullAttentionSpec(2)], num_blocks=20, max_model_len=64)
    r1 = Request("r1", list(range(7)))
    step(mgr, r1, 7, mgr.get_computed_blocks(r1))
    r2 = Request("r2", list(range(7)))
    step(mgr, r2, 1, mgr.get_computed_blocks(r2))
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 14, 6)
    assert stats.hit_rate == 6 / 14
    mgr.free(r2)
    r2.num_computed_tokens = 0  # preempted
    step(mgr, r2, 1, mgr.get_computed_blocks(r2))
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.preempted_requests, stats.preempted_hits) == (0, 1, 6)


def test_reset_prefix_cache_and_usage():
    mgr = KVCacheManager([FullAttentionSpec(2)], num_blocks=5, max_model_len=64)
    r1 = Request("r1", list(range(5)))
    step(mgr, r1, 5, mgr.get_computed_blocks(r1))
    assert mgr.usage == 0.75 and mgr.num_free_blocks == 1
    assert mgr.reset_prefix_cache() is False
    mgr.free(r1)
    assert mgr.usage == 0.0
    assert mgr.reset_prefix_cache() is True
    assert mgr.make_prefix_cache_stats().reset is True
    assert mgr.get_computed_blocks(Request("r2", list(range(5)))).num_tokens == 0


def test_max_blocks_helpers():
    groups = [FullAttentionSpec(16), SlidingWindowSpec(16, 4096)]
    mgr = KVCacheManager(groups, num_blocks=10, max_model_len=32768)
    assert mgr.max_num_blocks_per_request == 2048
    assert mgr.max_num_held_blocks(2048) == 2048 + cdiv(4095 + 2048, 16) + 1
    assert mgr.num_blocks == 10
