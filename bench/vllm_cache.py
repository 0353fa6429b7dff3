"""vLLM's `KVCacheManager` behind the small interface `kvcache_bench.replay` drives, so the same
trace and the same scheduler run through both managers. Written against vLLM 0.33 (pure-Python
cache manager; `pip install --no-deps vllm` and its light dependencies, no GPU needed).

`available()` says whether `vllm.v1.core.kv_cache_manager` imports here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def available() -> tuple[bool, str]:
    try:
        import vllm.v1.core.kv_cache_manager  # noqa: F401
    except Exception as e:  # ImportError, or a missing light dependency deeper down
        return False, f"{type(e).__name__}: {e}"
    import vllm

    return True, vllm.__version__


@dataclass
class _Hit:
    num_tokens: int
    blocks: Any


@dataclass
class _Stats:
    queries: int
    hits: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class VllmManager:
    """The subset of `kvcache.KVCacheManager` the replay uses, over vLLM's manager.

    Requests are mirrored: a `kvcache.Request` id maps to a `vllm.v1.request.Request` with the same
    tokens; its computed-token count and output tokens are synced before every call. A request freed
    and admitted again (preemption) is mirrored afresh from all its tokens, as vLLM would resume it.
    """

    managers: list = []  # no per-type sliding statistics for vLLM

    def __init__(self, block_size: int, num_blocks: int, max_model_len: int, window: int | None = None):
        import torch
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            SlidingWindowSpec,
        )

        shape = dict(block_size=block_size, num_kv_heads=1, head_size=64, dtype=torch.float32)
        spec = (
            FullAttentionSpec(**shape)
            if window is None
            else SlidingWindowSpec(**shape, sliding_window=window)
        )
        config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)]
        )
        hash_fn = get_hash_fn_by_name("sha256")
        init_none_hash(hash_fn)
        self._hasher = get_request_block_hasher(block_size, hash_fn)
        self._mgr = KVCacheManager(
            config,
            max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=True,
            log_stats=True,
        )
        self.block_pool = self._mgr.block_pool
        self.num_blocks = num_blocks
        self.max_model_len = max_model_len
        self._reqs: dict[str, Any] = {}
        self._queries = self._hits = 0
        self._admitted: set[str] = set()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def _mirror(self, req) -> Any:
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        vreq = self._reqs.get(req.request_id)
        if vreq is None:
            vreq = Request(
                req.request_id,
                list(req.all_token_ids),
                SamplingParams(max_tokens=1 << 20),
                None,
                block_hasher=self._hasher,
            )
            self._reqs[req.request_id] = vreq
        extra = req.all_token_ids[vreq.num_tokens :]
        if extra:
            vreq.append_output_token_ids(list(extra))
        vreq.num_computed_tokens = req.num_computed_tokens
        return vreq

    def get_computed_blocks(self, req) -> _Hit:
        blocks, num_tokens, *_ = self._mgr.get_computed_blocks(self._mirror(req))
        return _Hit(num_tokens, blocks)

    def allocate_slots(self, req, num_new_tokens: int, hit: _Hit | None = None):
        vreq = self._mirror(req)
        if hit is None:
            return self._mgr.allocate_slots(vreq, num_new_tokens)
        new = self._mgr.allocate_slots(
            vreq, num_new_tokens, num_new_computed_tokens=hit.num_tokens, new_computed_blocks=hit.blocks
        )
        if new is not None and req.request_id not in self._admitted:  # first admissions, as kvcache counts
            self._admitted.add(req.request_id)
            self._queries += req.num_tokens
            self._hits += hit.num_tokens
        return new

    def free(self, req) -> None:
        vreq = self._reqs.pop(req.request_id)
        self._mgr.free(vreq)

    def make_prefix_cache_stats(self) -> _Stats:
        return _Stats(self._queries, self._hits)
