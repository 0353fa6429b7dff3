"""KV cache specs: what one group of layers needs from the cache (frozen, self-validating)."""

from __future__ import annotations

from dataclasses import dataclass


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


@dataclass(frozen=True)
class KVCacheSpec:
    """Base spec: ``block_size`` tokens per block."""

    block_size: int

    def __post_init__(self) -> None:
        _check_positive_int("block_size", self.block_size)

    def max_num_held_blocks(self, max_model_len: int, max_tokens_per_step: int) -> int:
        """Upper bound on the blocks one request holds at once (admission control)."""
        return cdiv(max_model_len, self.block_size)


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """Every token attends to every earlier token: nothing is ever skipped."""


@dataclass(frozen=True)
class SlidingWindowSpec(KVCacheSpec):
    """The query at position ``n`` attends to positions ``n - window + 1 .. n``."""

    window: int

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_positive_int("window", self.window)

    def max_num_held_blocks(self, max_model_len: int, max_tokens_per_step: int) -> int:
        """``cdiv(min(window - 1 + max_tokens_per_step, max_model_len), block_size) + 1``
        (vLLM 0.33's admission cap), never above the full-attention bound."""
        tokens = min(self.window - 1 + max_tokens_per_step, max_model_len)
        return min(cdiv(tokens, self.block_size) + 1, cdiv(max_model_len, self.block_size))
