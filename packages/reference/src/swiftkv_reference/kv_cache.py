"""A naive per-request contiguous KV cache: one (K, V, positions) list per cache layer.

SwiftKV path: layer i reads cache `config.cache_layer(i)` (AcrossKV groups share one; the cache count
is L + (N - L) // G). Teacher path (swiftkv=False): one cache per layer. Sliding cache layers keep
only the last `window` tokens after each step (`trim`), and assert it.
"""

from __future__ import annotations

import torch

from .config import SwiftKVConfig


class NaiveKVCache:
    """Contiguous K/V per cache layer for one request. K is stored after RoPE."""

    def __init__(self, config: SwiftKVConfig, swiftkv: bool = True):
        self.config = config
        self.swiftkv = swiftkv and config.is_swiftkv
        n = config.num_cache_layers if self.swiftkv else config.num_hidden_layers
        self.windows = [config.cache_window(c) if self.swiftkv else config.window(c) for c in range(n)]
        shape = (0, config.num_key_value_heads, config.head_dim)
        self.k = [torch.empty(shape) for _ in range(n)]  # each (num_cached, num_kv_heads, head_dim)
        self.v = [torch.empty(shape) for _ in range(n)]
        self.positions = [torch.empty(0, dtype=torch.long) for _ in range(n)]  # each (num_cached,)

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def layer_index(self, i: int) -> int:
        """The cache that model layer i reads and writes."""
        return self.config.cache_layer(i) if self.swiftkv else i

    def append(self, c: int, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """Add the K/V of new tokens to cache layer c (no trimming until `trim`)."""
        if self.k[c].dtype != k.dtype:
            self.k[c], self.v[c] = self.k[c].to(k.dtype), self.v[c].to(v.dtype)
        self.k[c] = torch.cat([self.k[c], k])
        self.v[c] = torch.cat([self.v[c], v])
        self.positions[c] = torch.cat([self.positions[c], positions.to(torch.long)])

    def get(self, c: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K, V, positions) of cache layer c."""
        return self.k[c], self.v[c], self.positions[c]

    def trim(self) -> None:
        """Drop what sliding layers no longer need: keep the last `window` tokens."""
        for c, window in enumerate(self.windows):
            if window is not None and len(self.positions[c]) > window:
                self.k[c] = self.k[c][-window:]
                self.v[c] = self.v[c][-window:]
                self.positions[c] = self.positions[c][-window:]
            assert window is None or len(self.positions[c]) <= window, (
                "sliding cache holds more than W tokens"
            )

    def num_tokens(self, c: int) -> int:
        return len(self.positions[c])
