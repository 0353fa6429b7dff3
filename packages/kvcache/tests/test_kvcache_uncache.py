"""`uncache_unwritten_blocks`: after a failed step, no lookup can hit a block that step registered."""

import pytest
from kvcache import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec


def step(mgr, req, n, hit=None):
    assert mgr.allocate_slots(req, n, hit=hit) is not None
    req.num_computed_tokens += (hit.num_tokens if hit else 0) + n


def hit_tokens(mgr, tokens, rid="probe"):
    return mgr.get_computed_blocks(Request(rid, tokens)).num_tokens


def test_docstring_example_uncaches_the_failed_steps_blocks_only():
    mgr = KVCacheManager([FullAttentionSpec(block_size=4)], num_blocks=16, max_model_len=64)
    tokens = list(range(20))
    req = Request("r", tokens)
    step(mgr, req, 6)  # block 0 (tokens 0..3) is full and registered; block 1 holds 4..5
    step(mgr, req, 8)  # the failing step: blocks 1, 2 (tokens 4..11) registered
    assert hit_tokens(mgr, tokens) == 12
    assert mgr.uncache_unwritten_blocks(req, 6) == 2
    assert hit_tokens(mgr, tokens) == 4  # only block 0, written by the completed step
    free_before = mgr.num_free_blocks
    mgr.free(req)
    assert mgr.num_free_blocks == free_before + 4
    # the uncached blocks are unhashed: reused first (front of the queue), block 0 stays cached
    queue = mgr.block_pool.free_block_queue.get_all_free_block_ids()
    table = [1, 2, 3, 4]
    assert queue[:3] == [table[3], table[2], table[1]] and queue[-1] == table[0]
    assert hit_tokens(mgr, tokens) == 4


def test_a_block_another_request_hit_in_the_same_step_is_uncached():
    mgr = KVCacheManager([FullAttentionSpec(block_size=4)], num_blocks=16, max_model_len=64)
    a, b = Request("a", list(range(13))), Request("b", list(range(12)) + [99])
    step(mgr, a, 12)  # registers blocks 0..2, then (same step) b hits all three
    hit = mgr.get_computed_blocks(b)
    assert hit.num_tokens == 12
    step(mgr, b, 1, hit)
    for req, written in ((a, 0), (b, 12)):  # b's hit came from the failed step: a's call uncaches it
        mgr.uncache_unwritten_blocks(req, written)
    mgr.free(a)
    mgr.free(b)
    assert hit_tokens(mgr, list(range(13))) == 0
    assert mgr.num_free_blocks == mgr.num_blocks - 1


def test_sliding_window_and_hybrid_groups():
    specs = [SlidingWindowSpec(block_size=2, window=3), FullAttentionSpec(block_size=2)]
    mgr = KVCacheManager(specs, num_blocks=40, max_model_len=64)
    tokens = list(range(15))
    req = Request("r", tokens)
    step(mgr, req, 8)
    step(mgr, req, 6)  # the failing step: blocks 4..6 of both groups registered
    assert mgr.uncache_unwritten_blocks(req, 8) == 6
    mgr.free(req)
    assert hit_tokens(mgr, tokens) == 8
    assert mgr.num_free_blocks == mgr.num_blocks - 1


def test_nothing_to_uncache_and_bad_input():
    mgr = KVCacheManager([FullAttentionSpec(block_size=4)], num_blocks=16, max_model_len=64)
    req = Request("r", list(range(10)))
    with pytest.raises(KeyError, match="'r'"):
        mgr.uncache_unwritten_blocks(req, 0)
    step(mgr, req, 9)
    with pytest.raises(ValueError, match="num_written_tokens"):
        mgr.uncache_unwritten_blocks(req, -1)
    with pytest.raises(ValueError, match="duplicate request id"):
        mgr.uncache_unwritten_blocks(Request("r", [1]), 0)
    assert mgr.uncache_unwritten_blocks(req, 9) == 0  # everything registered was written
    assert hit_tokens(mgr, list(range(10))) == 8
    off = KVCacheManager([FullAttentionSpec(4)], num_blocks=16, max_model_len=64, enable_caching=False)
    other = Request("o", list(range(10)))
    step(off, other, 9)
    assert off.uncache_unwritten_blocks(other, 0) == 0
