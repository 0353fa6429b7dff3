"""The KV cache layout of one engine, built once from the model config: the kvcache groups, the
group and physical KV slot of every cache layer, bytes per block and the KV tensor's shape.

AcrossKV groups share a cache layer (config.cache_layer). Hybrid models go one step further, as
vLLM v1 does: their kvcache groups (one per attention type) draw block ids from ONE shared pool, and
a block id belongs to at most one group at a time, so one cache layer of each group can live in the
same physical storage without the groups ever touching each other's blocks. The i-th cache layer of
every group goes to physical KV slot i (`kv_slot`), so the tensor has max(group size) slots instead
of num_cache_layers, and a block costs `bytes_per_block` over those slots only. With one group
(every non-hybrid model) slot == cache layer.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from kvcache import FullAttentionSpec, KVCacheSpec, SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheLayout:
    specs: tuple[KVCacheSpec, ...]  # one kvcache group per attention type, in order of appearance
    group_of_cache_layer: tuple[int, ...]  # kvcache group of each cache layer
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    kv_slot: tuple[int, ...] = field(init=False)  # physical KV slot of each cache layer
    num_kv_slots: int = field(init=False)  # the size of the largest group

    def __post_init__(self) -> None:
        object.__setattr__(self, "specs", tuple(self.specs))
        object.__setattr__(self, "group_of_cache_layer", tuple(self.group_of_cache_layer))
        if not self.specs or not self.group_of_cache_layer:
            raise ValueError("a KV cache layout needs at least one kvcache group and one cache layer")
        if len({s.block_size for s in self.specs}) != 1:
            raise ValueError(f"the kvcache groups must share one block_size, got {self.specs}")
        if set(self.group_of_cache_layer) != set(range(len(self.specs))):
            raise ValueError(
                f"group_of_cache_layer {self.group_of_cache_layer} must use each of the "
                f"{len(self.specs)} kvcache groups"
            )
        # the i-th cache layer (in order) of each group goes to slot i
        seen: Counter[int] = Counter()
        slots = []
        for g in self.group_of_cache_layer:
            slots.append(seen[g])
            seen[g] += 1
        object.__setattr__(self, "kv_slot", tuple(slots))
        object.__setattr__(self, "num_kv_slots", max(slots) + 1)

    @classmethod
    def from_config(
        cls, config, block_size: int, dtype: torch.dtype, num_kv_heads: int | None = None
    ) -> KVCacheLayout:
        """One kvcache group per attention type (window) among the cache layers, in order of appearance.
        `num_kv_heads`: the K/V heads one rank holds under tensor parallelism (default: the model's)."""
        windows = [config.cache_window(c) for c in range(config.num_cache_layers)]
        keys = list(dict.fromkeys(windows))
        full = FullAttentionSpec(block_size)
        specs = [full if w is None else SlidingWindowSpec(block_size, w) for w in keys]
        return cls(
            specs=tuple(specs),
            group_of_cache_layer=tuple(keys.index(w) for w in windows),
            num_kv_heads=num_kv_heads if num_kv_heads is not None else config.num_key_value_heads,
            head_dim=config.head_dim,
            dtype=dtype,
        )

    @property
    def block_size(self) -> int:
        return self.specs[0].block_size

    @property
    def num_groups(self) -> int:
        return len(self.specs)

    @property
    def num_cache_layers(self) -> int:
        return len(self.group_of_cache_layer)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block id over every physical KV slot (K and V)."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_kv_slots * 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """(num_kv_slots, 2, num_blocks, block_size, num_kv_heads, head_dim)."""
        return (self.num_kv_slots, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def max_num_held_blocks(self, max_model_len: int, max_num_batched_tokens: int) -> int:
        """Blocks one request of max_model_len tokens holds at most, over every group."""
        return sum(s.max_num_held_blocks(max_model_len, max_num_batched_tokens) for s in self.specs)

    def slot_runs(self, first_cache_layer: int) -> list[tuple[int, int, int]]:
        """Runs (a, b, group) of the cache layers from `first_cache_layer` on: cache layers [a, b) of
        one group whose slots are consecutive too, i.e. the plain slice kv_cache[kv_slot[a] : kv_slot[a]
        + b - a] (one write_kv per run)."""
        runs: list[tuple[int, int, int]] = []
        for c in range(first_cache_layer, self.num_cache_layers):
            g = self.group_of_cache_layer[c]
            if runs:
                a, b, last = runs[-1]
                if last == g and self.kv_slot[c] == self.kv_slot[a] + (b - a):
                    runs[-1] = (a, c + 1, g)
                    continue
            runs.append((c, c + 1, g))
        return runs
