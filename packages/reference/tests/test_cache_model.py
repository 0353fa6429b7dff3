"""The brute-force cache rules."""

import pytest
from swiftkv_reference.cache_model import (
    cached_prefixes,
    longest_hybrid_prefix_hit,
    longest_prefix_hit,
    needed_block_indices,
    needed_positions,
    num_skipped_tokens,
)


def test_needed_positions():
    assert needed_positions(10, None) == range(0, 10)
    assert needed_positions(10, 4) == range(7, 10)  # the next query (position 10) sees 7..10
    assert needed_positions(3, 4) == range(0, 3)
    assert needed_positions(0, 4) == range(0, 0)
    assert num_skipped_tokens(10, 1) == 10
    assert needed_block_indices(10, 4, 4) == range(1, 3)
    assert needed_block_indices(10, 4, None) == range(0, 3)
    with pytest.raises(ValueError):
        needed_positions(-1, None)
    with pytest.raises(ValueError):
        needed_positions(3, 0)


def test_full_attention_hit():
    prompt = list(range(20))
    cached = cached_prefixes(prompt, 4)  # all 5 full blocks
    assert longest_prefix_hit(prompt, cached, 4, None) == 16  # capped at len - 1 = 19 -> 16
    assert longest_prefix_hit(prompt[:17], cached, 4, None) == 16
    assert longest_prefix_hit(prompt[:16], cached, 4, None) == 12  # never the whole prompt
    missing_second = cached - {tuple(prompt[:8])}
    assert longest_prefix_hit(prompt, missing_second, 4, None) == 4
    # a different earlier token means a different prefix: no hit
    other = [99] + prompt[1:]
    assert longest_prefix_hit(other, cached, 4, None) == 0
    assert longest_prefix_hit(prompt, lambda p: len(p) <= 8, 4, None) == 8


def test_sliding_window_hit_needs_only_the_last_blocks():
    prompt = list(range(30))
    b, w = 4, 6  # cdiv(w - 1, b) = 2 blocks before the hit
    only_late = {tuple(prompt[: (j + 1) * b]) for j in (4, 5)}  # blocks 4, 5 (positions 16..23)
    assert longest_prefix_hit(prompt, only_late, b, w) == 24
    assert longest_prefix_hit(prompt, only_late, b, None) == 0
    assert longest_prefix_hit(prompt, {tuple(prompt[:20])}, b, w) == 0  # one block is not enough
    # a short hit needs all blocks from 0
    assert longest_prefix_hit(prompt, {tuple(prompt[:4])}, b, w) == 4
    assert longest_prefix_hit(prompt, {tuple(prompt[:8])}, b, w) == 0  # block 0 missing
    # window 1 needs nothing: any multiple of b below len works
    assert longest_prefix_hit(prompt, set(), b, 1) == 28


def test_hybrid_hit_is_the_longest_valid_for_all_groups():
    prompt = list(range(30))
    b = 4
    full_cached = cached_prefixes(prompt[:12], b)  # blocks 0..2
    sliding_cached = {tuple(prompt[: (j + 1) * b]) for j in (1, 2, 5, 6)}
    assert longest_prefix_hit(prompt, sliding_cached, b, 6) == 28
    assert longest_hybrid_prefix_hit(prompt, [full_cached, sliding_cached], b, [None, 6]) == 12
    assert longest_hybrid_prefix_hit(prompt, [full_cached, set()], b, [None, 6]) == 0
    with pytest.raises(ValueError):
        longest_hybrid_prefix_hit(prompt, [full_cached], b, [None, 6])
