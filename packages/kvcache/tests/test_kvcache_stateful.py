"""Random add/lookup/allocate/append/preempt/free/reset sequences against invariants.

Ground truth: for every block that has held a full block of tokens, the test
records which group it belongs to and the exact token prefix (plus salt) it ends;
a prefix hit must return blocks whose recorded prefix equals the request's.
"""

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from kvcache import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec

CONFIGS = [
    [FullAttentionSpec(2)],
    [FullAttentionSpec(1)],
    [SlidingWindowSpec(block_size=1, window=3)],
    [SlidingWindowSpec(block_size=2, window=5)],
    [SlidingWindowSpec(block_size=2, window=1)],
    [FullAttentionSpec(2), SlidingWindowSpec(block_size=2, window=3)],
    [SlidingWindowSpec(2, 4), FullAttentionSpec(2), SlidingWindowSpec(2, 7)],
]
PREFIXES = [(), (1, 2, 3, 1, 2, 3), (1, 2, 3, 1, 0, 0, 1, 1), (3, 3, 3, 3, 3, 3, 3, 3, 3, 3)]
MAX_MODEL_LEN = 40


def snapshot(mgr):
    pool = mgr.block_pool
    return (
        pool.free_block_queue.get_all_free_block_ids(),
        [(b.block_id, b.ref_cnt, b.block_hash, b.group_id) for b in pool.blocks],
        [dict(m) for m in pool.cached_block_hash_to_block],
        [{k: [b.block_id for b in v] for k, v in m.req_to_blocks.items()} for m in mgr.managers],
        [dict(m.num_cached_block) for m in mgr.managers],
        sorted(mgr._requests),
    )


class KVCacheMachine(RuleBasedStateMachine):
    @initialize(
        config=st.sampled_from(range(len(CONFIGS))),
        num_blocks=st.integers(2, 40),
        caching=st.sampled_from([True, True, True, False]),
    )
    def setup(self, config, num_blocks, caching):
        self.groups = CONFIGS[config]
        self.bs = self.groups[0].block_size
        self.mgr = KVCacheManager(self.groups, num_blocks, MAX_MODEL_LEN, enable_caching=caching)
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.truth: dict[int, tuple] = {}  # block id -> (group, token prefix, salt)
        self.counter = 0

    # -- helpers ---------------------------------------------------------------------------

    def _record_truth(self, req, new_ids, start_tokens):
        """After a successful allocation: new blocks forget their past; every full
        computed block gets (or must match) its recorded content."""
        for ids in new_ids:
            for b in ids:
                self.truth.pop(b, None)
        done = req.num_computed_tokens
        for g, table in enumerate(self.mgr.get_block_ids(req.request_id)):
            spec = self.groups[g]
            for i in range(done // self.bs):
                b = table[i]
                if b == 0:
                    continue
                content = (g, tuple(req.all_token_ids[: (i + 1) * self.bs]), req.cache_salt)
                assert self.truth.setdefault(b, content) == content
            # no position a query of this step can see is null
            if isinstance(spec, SlidingWindowSpec):
                first = max(0, start_tokens - spec.window + 1) // self.bs
                assert all(b != 0 for b in table[first:]), (table, start_tokens, spec)
            else:
                assert all(b != 0 for b in table)

    def _check_hit(self, req, hit):
        assert hit.num_tokens % self.bs == 0 and hit.num_tokens < req.num_tokens
        for g, ids in enumerate(hit.block_ids):
            assert len(ids) == hit.num_tokens // self.bs
            for i, b in enumerate(ids):
                if b:
                    assert self.truth[b] == (g, tuple(req.all_token_ids[: (i + 1) * self.bs]), req.cache_salt)
            spec = self.groups[g]
            if isinstance(spec, SlidingWindowSpec) and hit.num_tokens:
                first = max(0, hit.num_tokens - spec.window + 1) // self.bs
                assert all(ids[first:]), (ids, spec)

    def _after_refusal(self, req, before):
        """``before`` as a refused ``allocate_slots`` must leave it (vLLM): a running request's
        sliding groups null the entries out of the window (from the highest index down to the
        first null) and free them, unhashed ones to the front of the queue, cached ones to the
        back; nothing else changes. A new request's refusal changes nothing at all."""
        free, blocks, caches, tables, num_cached, requests = before
        if req.request_id not in tables[0]:
            return before
        blocks = list(blocks)
        tables = [dict(t) for t in tables]
        for g, spec in enumerate(self.groups):
            if not isinstance(spec, SlidingWindowSpec):
                continue
            table = list(tables[g][req.request_id])
            skipped = max(0, req.num_computed_tokens - spec.window + 1) // self.bs
            unhashed, hashed = [], []
            for i in range(min(skipped, len(table)) - 1, -1, -1):
                if table[i] == 0:
                    break
                b, ref, block_hash, group = blocks[table[i]]
                blocks[b] = (b, ref - 1, block_hash, group)
                if ref == 1:
                    (unhashed if block_hash is None else hashed).append(b)
                table[i] = 0
            tables[g][req.request_id] = table
            free = unhashed + free + hashed
        return free, blocks, caches, tables, num_cached, requests

    def _allocate(self, req, n, hit=None):
        before = snapshot(self.mgr)
        start = req.num_computed_tokens + (hit.num_tokens if hit else 0)
        new = self.mgr.allocate_slots(req, n, hit=hit)
        if new is None:
            assert snapshot(self.mgr) == self._after_refusal(req, before)
            return False
        assert len(new) == len(self.groups)
        req.num_computed_tokens = start + n
        self._record_truth(req, new, start)
        return True

    # -- rules -----------------------------------------------------------------------------

    @rule(
        prefix=st.sampled_from(PREFIXES),
        suffix=st.lists(st.integers(0, 3), min_size=0, max_size=12),
        salt=st.sampled_from([None, None, None, "s"]),
    )
    def add_request(self, prefix, suffix, salt):
        tokens = list(prefix) + suffix
        if not tokens:
            tokens = [0]
        self.counter += 1
        self.waiting.append(Request(f"r{self.counter}", tokens[: MAX_MODEL_LEN - 4], cache_salt=salt))

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def lookup(self, data):
        req = data.draw(st.sampled_from(self.waiting))
        before = snapshot(self.mgr)
        hit = self.mgr.get_computed_blocks(req)
        assert snapshot(self.mgr) == before
        self._check_hit(req, hit)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data(), chunk=st.integers(1, 12), use_hit=st.booleans())
    def admit(self, data, chunk, use_hit):
        req = data.draw(st.sampled_from(self.waiting))
        hit = self.mgr.get_computed_blocks(req) if use_hit else None
        if hit is not None:
            self._check_hit(req, hit)
        n = min(chunk, req.num_tokens - (hit.num_tokens if hit else 0))
        if self._allocate(req, n, hit):
            self.waiting.remove(req)
            self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), chunk=st.integers(1, 12), token=st.integers(0, 3))
    def step(self, data, chunk, token):
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens == req.num_tokens:
            if req.num_tokens >= MAX_MODEL_LEN:
                self.running.remove(req)
                self.mgr.free(req)
                return
            req.append_output_token_ids([token])
        self._allocate(req, min(chunk, req.num_tokens - req.num_computed_tokens))

    @precondition(lambda self: self.running)
    @rule()
    def fill_pool(self):
        """Admit a request (no lookup) that takes every free block: the next step of a running
        request is refused, with its window's dead blocks still to free."""
        n = min(self.mgr.num_free_blocks // len(self.groups) * self.bs, MAX_MODEL_LEN - 4)
        if n < 1:
            return
        self.counter += 1
        req = Request(f"r{self.counter}", [3] * n)
        assert self._allocate(req, n)
        self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        req = data.draw(st.sampled_from(self.running))
        self.mgr.free(req)
        req.num_computed_tokens = 0
        self.running.remove(req)
        self.waiting.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.running))
        self.mgr.free(req)
        self.running.remove(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        """vLLM: freeing a request that holds no blocks is a no-op."""
        req = data.draw(st.sampled_from(self.waiting))
        before = snapshot(self.mgr)
        self.mgr.free(req)
        assert snapshot(self.mgr) == before
        self.waiting.remove(req)

    @rule()
    def reset(self):
        idle = self.mgr.num_free_blocks == self.mgr.num_blocks - 1
        assert self.mgr.reset_prefix_cache() is idle
        if idle:
            assert all(not m for m in self.mgr.block_pool.cached_block_hash_to_block)

    @rule(kind=st.integers(0, 4))
    def bad_input(self, kind):
        before = snapshot(self.mgr)
        try:
            if kind == 0 and self.running:
                r = self.running[0]
                self.mgr.allocate_slots(Request(r.request_id, [1]), 1)
            elif kind == 1 and self.running:
                r = self.running[0]
                self.mgr.allocate_slots(r, r.num_tokens - r.num_computed_tokens + 1)
            elif kind == 2 and self.running:
                r = self.running[0]
                self.mgr.free(Request(r.request_id, [1]))
            elif kind == 3 and self.running:
                self.mgr.allocate_slots(self.running[0], 0)
            elif kind == 4 and self.running:
                self.mgr.get_computed_blocks(self.running[0])
            else:
                return
        except (ValueError, KeyError, TypeError):
            pass
        else:
            raise AssertionError("bad input accepted")
        assert snapshot(self.mgr) == before

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def blocks_null_free_or_held(self):
        mgr = getattr(self, "mgr", None)
        if mgr is None:
            return
        pool = mgr.block_pool
        free = pool.free_block_queue.get_all_free_block_ids()
        assert len(free) == len(set(free)) == mgr.num_free_blocks
        assert 0 not in free
        holders: dict[int, int] = {}
        for req in self.running:
            for table in mgr.get_block_ids(req.request_id):
                real = [b for b in table if b]
                assert len(real) == len(set(real))
                for b in real:
                    holders[b] = holders.get(b, 0) + 1
        assert not set(free) & set(holders)
        assert set(free) | set(holders) | {0} == set(range(mgr.num_blocks))
        for block in pool.blocks[1:]:
            assert block.ref_cnt == holders.get(block.block_id, 0)
        for g, cache in enumerate(pool.cached_block_hash_to_block):
            for h, entry in cache.items():
                for b in entry.values() if isinstance(entry, dict) else [entry]:
                    assert b.block_hash == h and b.group_id == g
        hashed = sum(1 for b in pool.blocks if b.block_hash is not None)
        assert hashed == sum(
            len(e) if isinstance(e, dict) else 1 for c in pool.cached_block_hash_to_block for e in c.values()
        )
        assert mgr.num_requests == len(self.running)

    def teardown(self):
        mgr = getattr(self, "mgr", None)
        if mgr is None:
            return
        for req in list(self.running):
            mgr.free(req)
        assert mgr.num_free_blocks == mgr.num_blocks - 1
        assert mgr.usage == 0.0
        assert mgr.reset_prefix_cache()


KVCacheMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheStateful = KVCacheMachine.TestCase
