"""A brute-force model of the paged KV cache rules, independent of the `kvcache` package.

Used by the conformance suite to check `kvcache` against the obvious definitions:

- A running request with `n` computed tokens must still hold positions `needed_positions(n, W)`:
  all of 0..n-1 for full attention; for a sliding window W, the skipped tokens are
  `max(0, n - W + 1)` (the next query, at position n, sees n-W+1..n), so it holds skipped..n-1.
- A block j (positions j*B .. (j+1)*B - 1) is "cached" when the block with this exact full token prefix
  (all tokens from position 0 through the end of block j) is cached.
- A prefix hit of h tokens (a multiple of B, at most len(prompt) - 1) is valid when every block the
  hit must keep is cached: all blocks 0..h/B-1 for full attention; for a window W the last
  cdiv(W - 1, B) blocks before h (all blocks from 0 when h is shorter than that). The hit is the
  longest valid h (0 always is). Hybrid models: the longest h valid for every group.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

CachedBlocks = Callable[[tuple[int, ...]], bool] | Iterable[tuple[int, ...]]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_skipped_tokens(num_computed_tokens: int, window: int | None) -> int:
    """Tokens a request no longer needs: 0 for full attention, max(0, n - W + 1) for a window W."""
    if num_computed_tokens < 0:
        raise ValueError(f"negative token count {num_computed_tokens}")
    if window is None:
        return 0
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return max(0, num_computed_tokens - window + 1)


def needed_positions(num_computed_tokens: int, window: int | None) -> range:
    """Positions a running request with `num_computed_tokens` computed tokens must still hold."""
    return range(num_skipped_tokens(num_computed_tokens, window), num_computed_tokens)


def needed_block_indices(num_computed_tokens: int, block_size: int, window: int | None) -> range:
    """Blocks (of `block_size`) holding a needed position; blocks before it may be freed (null)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    skipped = num_skipped_tokens(num_computed_tokens, window)
    return range(skipped // block_size, cdiv(num_computed_tokens, block_size))


def _is_cached_fn(cached_blocks: CachedBlocks) -> Callable[[tuple[int, ...]], bool]:
    if callable(cached_blocks):
        return cached_blocks
    blocks = {tuple(b) for b in cached_blocks}
    return blocks.__contains__


def blocks_required_for_hit(hit_tokens: int, block_size: int, window: int | None) -> range:
    """Block indices a hit of `hit_tokens` (a multiple of block_size) must find cached."""
    num_blocks = hit_tokens // block_size
    if window is None:
        return range(num_blocks)
    return range(max(0, num_blocks - cdiv(window - 1, block_size)), num_blocks)


def hit_is_valid(
    prompt_token_ids: Sequence[int], cached_blocks: CachedBlocks, block_size: int, window: int | None, h: int
) -> bool:
    """Whether a prefix hit of h tokens is valid for one attention group."""
    is_cached = _is_cached_fn(cached_blocks)
    prompt = tuple(prompt_token_ids)
    return all(
        is_cached(prompt[: (j + 1) * block_size]) for j in blocks_required_for_hit(h, block_size, window)
    )


def _candidates(num_prompt_tokens: int, block_size: int) -> range:
    """Hit lengths from the longest (a multiple of block_size, <= len - 1) down to 0."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    longest = (max(num_prompt_tokens - 1, 0) // block_size) * block_size
    return range(longest, -1, -block_size)


def longest_prefix_hit(
    prompt_token_ids: Sequence[int], cached_blocks: CachedBlocks, block_size: int, window: int | None
) -> int:
    """The number of prompt tokens a prefix-cache hit covers for one attention group.

    cached_blocks: a set of token-tuple prefixes (each the full prefix through the end of a cached
    block), or a callable taking such a tuple."""
    is_cached = _is_cached_fn(cached_blocks)
    for h in _candidates(len(prompt_token_ids), block_size):
        if hit_is_valid(prompt_token_ids, is_cached, block_size, window, h):
            return h
    return 0


def longest_hybrid_prefix_hit(
    prompt_token_ids: Sequence[int],
    cached_blocks: Sequence[CachedBlocks],
    block_size: int,
    windows: Sequence[int | None],
) -> int:
    """The longest hit valid for every group (one cached-block set and one window per group)."""
    if len(cached_blocks) != len(windows):
        raise ValueError(f"{len(cached_blocks)} cached-block sets for {len(windows)} groups")
    fns = [_is_cached_fn(c) for c in cached_blocks]
    for h in _candidates(len(prompt_token_ids), block_size):
        if all(hit_is_valid(prompt_token_ids, f, block_size, w, h) for f, w in zip(fns, windows)):
            return h
    return 0


def cached_prefixes(token_ids: Sequence[int], block_size: int) -> set[tuple[int, ...]]:
    """The cached-block keys of every full block of a sequence (what caching it fully would store)."""
    tokens = tuple(token_ids)
    return {tokens[: (j + 1) * block_size] for j in range(len(tokens) // block_size)}
