"""KVCacheManager: the scheduler's interface to the paged KV cache (one or more groups)."""

from __future__ import annotations

from collections.abc import Sequence

from kvcache.block import KVCacheBlock
from kvcache.block_pool import BlockPool
from kvcache.hashing import HashFn
from kvcache.request import Request
from kvcache.single_type_manager import SingleTypeKVCacheManager, manager_class_for
from kvcache.specs import KVCacheSpec, cdiv
from kvcache.stats import PrefixCacheStats


def _check_count(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


class CacheHit:
    """Result of ``get_computed_blocks``: a prefix of ``num_tokens`` tokens already cached.

    ``blocks`` holds one block list per group (null block where a group does not
    need the block); ``block_ids`` is the same as ids. Pass it unchanged to
    ``allocate_slots`` for the same request.
    """

    __slots__ = ("request_id", "num_tokens", "blocks")

    def __init__(self, request_id: str, num_tokens: int, blocks: tuple[list[KVCacheBlock], ...]) -> None:
        self.request_id = request_id
        self.num_tokens = num_tokens
        self.blocks = blocks

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in group] for group in self.blocks)

    def __repr__(self) -> str:
        return f"CacheHit({self.request_id!r}, num_tokens={self.num_tokens}, block_ids={self.block_ids})"


class KVCacheManager:
    """Paged KV cache for one model: one KV cache group per spec, one shared block pool.

    Protocol per step (the scheduler's side):

    1. a new (or preempted, ``num_computed_tokens == 0``) request:
       ``hit = get_computed_blocks(req)``, then
       ``allocate_slots(req, n, hit=hit)`` with ``1 <= n <= req.num_tokens - hit.num_tokens``;
    2. a running request: ``allocate_slots(req, n)``;
    3. on success advance ``req.num_computed_tokens += hit_tokens + n``; append
       sampled tokens with ``req.append_output_token_ids``;
    4. ``free(req)`` on finish or preemption (then reset ``num_computed_tokens`` to 0).

    ``allocate_slots`` returns the newly allocated block ids per group, or None when
    the pool cannot serve the step. As in vLLM, a running request's call first
    frees what its sliding windows no longer need (on the basis of its computed
    tokens), and that stays done even when the call then returns None: a request
    waiting for memory holds no block it will never read again. Apart from that
    skip, None changes nothing: no block taken, no hit block touched, nothing
    cached (a new request's refused admission changes nothing at all).
    ``free`` of a request that holds no blocks (a waiting request that is aborted)
    does nothing.

    Groups: every group must have the same ``block_size`` (one hash chain per
    request serves all groups; mixed sizes raise ``ValueError``). A hit in a hybrid
    model is the longest prefix every group accepts (fixed point: each group
    returns its longest acceptable hit within the current candidate, the candidate
    shrinks to the minimum until all agree); with one group its own hit is final,
    as in vLLM's unitary coordinator. Cache keys include the group id.

    Bad input raises (``ValueError``/``TypeError``/``KeyError``) before anything changes.
    """

    def __init__(
        self,
        groups: Sequence[KVCacheSpec],
        num_blocks: int,
        max_model_len: int,
        enable_caching: bool = True,
        hash_fn: HashFn | None = None,
    ) -> None:
        groups = list(groups)
        if not groups:
            raise ValueError("groups must hold at least one KVCacheSpec")
        for spec in groups:
            if not isinstance(spec, KVCacheSpec):
                raise TypeError(f"groups must hold KVCacheSpec objects, got {type(spec).__name__}")
            manager_class_for(spec)
        block_sizes = {spec.block_size for spec in groups}
        if len(block_sizes) != 1:
            raise ValueError(f"all groups must share one block_size, got {sorted(block_sizes)}")
        _check_count("max_model_len", max_model_len, 1)
        self.groups = tuple(groups)
        self.block_size = groups[0].block_size
        self.max_model_len = max_model_len
        self.enable_caching = bool(enable_caching)
        self.hash_fn = hash_fn
        self.block_pool = BlockPool(num_blocks, self.enable_caching, num_groups=len(groups))
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            manager_class_for(spec)(spec, self.block_pool, gid) for gid, spec in enumerate(groups)
        )
        #: The managers whose attention type can ever drop blocks (not full attention):
        #: only these run the skip policy on every step.
        self._skipping_managers = tuple(m for m in self.managers if m.can_skip_blocks)
        self._requests: dict[str, Request] = {}
        self._stats = PrefixCacheStats()

    # -- properties ----------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool, the null block included."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Held fraction of the usable blocks: ``1 - free / (num_blocks - 1)``."""
        return self.block_pool.get_usage()

    @property
    def num_requests(self) -> int:
        """Requests currently holding blocks."""
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    @property
    def max_num_blocks_per_request(self) -> int:
        """Width of a block table (per group): ``cdiv(max_model_len, block_size)``."""
        return cdiv(self.max_model_len, self.block_size)

    def max_num_held_blocks(self, max_tokens_per_step: int) -> int:
        """Most blocks one request can hold at once, all groups together, when at most
        ``max_tokens_per_step`` tokens are scheduled for it per step (sliding groups
        hold ``cdiv(window - 1 + max_tokens_per_step, block_size) + 1`` at most)."""
        _check_count("max_tokens_per_step", max_tokens_per_step, 1)
        return sum(spec.max_num_held_blocks(self.max_model_len, max_tokens_per_step) for spec in self.groups)

    # -- lookup --------------------------------------------------------------------------

    def _bind(self, request: Request) -> None:
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")
        request.bind_hasher(self.block_size, self.hash_fn)

    def get_computed_blocks(self, request: Request) -> CacheHit:
        """Longest cached prefix of a request that holds no blocks (a lookup: nothing changes).

        The hit is block aligned and at most ``num_tokens - 1`` tokens (the last
        token is always recomputed for its logits), so a prompt whose length is a
        multiple of the block size cannot hit its last block.
        """
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")
        if request.request_id in self._requests:
            raise ValueError(f"request {request.request_id!r} holds blocks: look up new ones only")
        empty = tuple([] for _ in self.managers)
        if not self.enable_caching:
            return CacheHit(request.request_id, 0, empty)
        self._bind(request)
        bs = self.block_size
        hashes = request.block_hashes
        pool = self.block_pool
        candidate = (request.num_tokens - 1) // bs * bs
        if len(self.managers) == 1:  # one group (vLLM's unitary coordinator): its hit is final
            (manager,) = self.managers
            blocks = manager.find_longest_cache_hit(hashes, candidate, manager.group_id, pool, manager.spec)
            return CacheHit(request.request_id, len(blocks) * bs, (blocks,))
        while True:
            hits = []
            shortest = candidate
            for manager in self.managers:
                blocks = manager.find_longest_cache_hit(
                    hashes, candidate, manager.group_id, pool, manager.spec
                )
                hits.append(blocks)
                shortest = min(shortest, len(blocks) * bs)
                if shortest == 0:
                    return CacheHit(request.request_id, 0, empty)
            if shortest == candidate:
                return CacheHit(request.request_id, candidate, tuple(hits))
            candidate = shortest

    # -- allocation ----------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> tuple[list[int], ...] | None:
        """Make room for ``num_new_tokens`` tokens after the computed ones (and the hit).

        Order (vLLM): drop and free the blocks the sliding window no longer needs
        (on the basis of ``request.num_computed_tokens`` before this step), take the
        hit blocks, allocate the missing blocks, then register every full block being
        computed in the prefix cache (blocks are cached when scheduled).

        Returns the new block ids per group, or None if the pool is too small now:
        then the skipped blocks stay freed and nothing else changed.
        """
        if not isinstance(request, Request):
            raise TypeError(f"expected a Request, got {type(request).__name__}")
        if type(num_new_tokens) is not int or num_new_tokens < 1:
            _check_count("num_new_tokens", num_new_tokens, 1)
        if type(num_lookahead_tokens) is not int or num_lookahead_tokens < 0:
            _check_count("num_lookahead_tokens", num_lookahead_tokens, 0)
        rid = request.request_id
        held = self._requests.get(rid)
        if held is None or hit is not None:
            return self._admit(request, held, num_new_tokens, hit, num_lookahead_tokens)
        if held is not request:
            raise ValueError(f"duplicate request id {rid!r}: another request with this id holds blocks")
        # A running request (the hot path: every decode step).
        num_computed = request.num_computed_tokens
        total_computed = num_computed + num_new_tokens
        total = total_computed + num_lookahead_tokens
        if total_computed > len(request.all_token_ids) or total > self.max_model_len:
            self._check_lengths(request, num_computed, 0, num_new_tokens, num_lookahead_tokens)
        managers = self.managers
        if num_computed:
            for m in self._skipping_managers:
                removed = m.remove_skipped_blocks(m.req_to_blocks[rid], num_computed)
                if removed:
                    self.block_pool.free_blocks(removed)
        need = 0
        for m in managers:
            n = -(-total // m.block_size) - len(m.req_to_blocks[rid])
            if n > 0:
                need += n
        if need > self.block_pool.free_block_queue.num_free_blocks:
            return None
        if need:
            new_ids = tuple([b.block_id for b in m.allocate_new_blocks(rid, total)] for m in managers)
        elif len(managers) == 1:
            new_ids = ([],)
        else:
            new_ids = tuple([] for _ in managers)
        if self.enable_caching:
            for m in managers:
                if total_computed // m.block_size > m.num_cached_block[rid]:
                    m.cache_blocks(request, total_computed)
        return new_ids

    def _check_lengths(
        self, request: Request, num_computed: int, hit_tokens: int, num_new: int, num_lookahead: int
    ) -> None:
        total_computed = num_computed + hit_tokens + num_new
        if total_computed > len(request.all_token_ids):
            raise ValueError(
                f"request {request.request_id!r}: {num_computed} computed + {hit_tokens} hit + {num_new} "
                f"new tokens exceed its {request.num_tokens} tokens"
            )
        if total_computed + num_lookahead > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} would need {total_computed + num_lookahead} tokens "
                f"> max_model_len={self.max_model_len}"
            )

    def _admit(
        self,
        request: Request,
        held: Request | None,
        num_new_tokens: int,
        hit: CacheHit | None,
        num_lookahead_tokens: int,
    ) -> tuple[list[int], ...] | None:
        """``allocate_slots`` for a request that holds no blocks yet (with or without a hit)."""
        rid = request.request_id
        if hit is not None:
            if not isinstance(hit, CacheHit):
                raise TypeError(f"hit must come from get_computed_blocks, got {type(hit).__name__}")
            if hit.request_id != rid:
                raise ValueError(f"hit belongs to request {hit.request_id!r}, not {rid!r}")
        if held is not None:
            if held is not request:
                raise ValueError(f"duplicate request id {rid!r}: another request with this id holds blocks")
            if hit is not None and hit.num_tokens:
                raise ValueError(f"request {rid!r} is running: a hit only applies to a new request")
            return self.allocate_slots(request, num_new_tokens, None, num_lookahead_tokens)
        if request.num_computed_tokens != 0:
            raise ValueError(
                f"request {rid!r} holds no blocks but num_computed_tokens={request.num_computed_tokens} "
                "(reset it to 0 on preemption)"
            )
        hit_tokens = 0 if hit is None else hit.num_tokens
        self._check_lengths(request, 0, hit_tokens, num_new_tokens, num_lookahead_tokens)
        self._bind(request)
        managers = self.managers
        if hit_tokens:
            hit_blocks = self._checked_hit_blocks(request, hit)  # type: ignore[arg-type]
        else:
            hit_blocks = tuple(() for _ in managers)
        total_computed = hit_tokens + num_new_tokens
        total = total_computed + num_lookahead_tokens
        need = sum(m.get_num_blocks_to_allocate(rid, total, hb) for m, hb in zip(managers, hit_blocks))
        if need > self.block_pool.free_block_queue.num_free_blocks:
            return None
        self._requests[rid] = request
        request._num_admissions += 1
        for m, hb in zip(managers, hit_blocks):
            m.add_request(rid, hb)
        if self.enable_caching:
            self._stats.record(request.num_tokens, hit_tokens, request._num_admissions > 1)
        new_ids = tuple([b.block_id for b in m.allocate_new_blocks(rid, total)] for m in managers)
        if self.enable_caching:
            for m in managers:
                m.cache_blocks(request, total_computed)
        return new_ids

    def _checked_hit_blocks(self, request: Request, hit: CacheHit) -> tuple[list[KVCacheBlock], ...]:
        """Copies of the hit's block lists, checked against the cache, with out-of-window
        entries nulled (each group's own skip policy at ``hit.num_tokens``)."""
        if len(hit.blocks) != len(self.managers):
            raise ValueError("hit does not match this manager's groups")
        num_hit_blocks = hit.num_tokens // self.block_size
        if hit.num_tokens % self.block_size or hit.num_tokens >= request.num_tokens:
            raise ValueError(f"invalid hit of {hit.num_tokens} tokens for request {request.request_id!r}")
        hashes = request.block_hashes
        out = []
        for m, blocks in zip(self.managers, hit.blocks):
            if len(blocks) != num_hit_blocks:
                raise ValueError("hit blocks do not cover the hit tokens")
            for i, block in enumerate(blocks):
                if not block.is_null and (block.block_hash != hashes[i] or block.group_id != m.group_id):
                    raise ValueError(
                        f"stale hit for request {request.request_id!r}: block {block.block_id} was evicted "
                        "since get_computed_blocks; look up again"
                    )
            blocks = list(blocks)
            m.remove_skipped_blocks(blocks, hit.num_tokens)
            out.append(blocks)
        return tuple(out)

    # -- queries and release ---------------------------------------------------------------

    def get_blocks(self, request_id: str) -> tuple[list[KVCacheBlock], ...]:
        """The request's block tables (live lists: do not modify)."""
        if request_id not in self._requests:
            raise KeyError(f"unknown request id {request_id!r}")
        return tuple(m.req_to_blocks[request_id] for m in self.managers)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block tables as ids, one list per group; null block = 0."""
        return tuple([b.block_id for b in table] for table in self.get_blocks(request_id))

    def free(self, request: Request | str) -> None:
        """Release every block of a finished or preempted request (tables in reverse).

        A request that holds no blocks (never admitted, or already freed) is a no-op, as
        in vLLM; a different ``Request`` whose id another request holds raises."""
        rid = request if isinstance(request, str) else request.request_id
        held = self._requests.get(rid)
        if held is None:
            return
        if not isinstance(request, str) and held is not request:
            raise ValueError(f"duplicate request id {rid!r}: another request with this id holds blocks")
        del self._requests[rid]
        for m in self.managers:
            m.free(rid)

    def uncache_unwritten_blocks(self, request: Request, num_written_tokens: int) -> int:
        """Forget the prefix-cache entries of the request's blocks past its first
        ``num_written_tokens`` tokens; returns how many blocks were uncached.

        Blocks are cached when scheduled, before the model writes their K/V. When the
        step fails (an exception, an interrupt), the blocks it registered hold no valid
        K/V and must never be hit: call this with the request's computed tokens before
        that step, for every request of the step, before ``free``. Example (block size
        4): a running request with 6 computed tokens is scheduled 8 more; its blocks 1
        and 2 (tokens 4..11) are registered; the step fails; with
        ``num_written_tokens=6`` both are uncached (block 1 holds tokens 4..5, written
        by an earlier step, but also 6..7, which were not). A block another request of
        the same step hit is uncached too: that request failed with the step.
        """
        if type(num_written_tokens) is not int or num_written_tokens < 0:
            _check_count("num_written_tokens", num_written_tokens, 0)
        rid = request.request_id
        held = self._requests.get(rid)
        if held is None:
            raise KeyError(f"unknown request id {rid!r}: it holds no blocks")
        if held is not request:
            raise ValueError(f"duplicate request id {rid!r}: another request with this id holds blocks")
        num_uncached = 0
        for m in self.managers:
            num_uncached += m.uncache_blocks_from(rid, num_written_tokens // m.block_size)
        return num_uncached

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; fails (False) while any request holds blocks."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self._stats.reset = True
        return True

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the previous call (then reset)."""
        stats, self._stats = self._stats, PrefixCacheStats()
        return stats
