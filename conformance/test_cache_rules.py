"""Cache rules: random request traces (hypothesis) through `kvcache` against the reference's
brute-force model (`swiftkv_reference.cache_model`) and a model of the block pool.

A shadow of the physical blocks records, for every slot written, the cache salt and the full token
prefix its KV was computed under (KV at position p depends on tokens[0..p]). Right after every
successful `allocate_slots`, the positions the step's *first* query attends to before its own
(`cache_model.needed_positions` at the step's start) must sit in non-null blocks whose slots hold KV
computed under exactly this request's salt and prefix; so no hit, share, eviction, early window skip
or preemption ever hands a request wrong or overwritten KV, and requests with different salts never
share a block. After every step, for every running request and every group:
  * the same holds for the positions the next query needs;
  * nothing beyond the window's bound is held: blocks wholly before the positions needed at the
    last allocation are the null block (blocks leave the table one step late, as in vLLM);
  * `num_free_blocks == num_blocks - 1 - |distinct non-null blocks held|` (no block leaks).

`PoolModel` replays the trace on vLLM 0.33's pool rules (LRU free queue, tail blocks freed first,
the window's dead blocks freed at the start of every call, even a refused one) and predicts the
null pattern of every table and which cached blocks survive, hence every prefix hit, exactly, in
a tiny pool too; with a pool too large to evict, hits must also equal the brute-force longest valid
hit over every full block ever scheduled (`cache_model.longest_hybrid_prefix_hit`).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

kvcache = pytest.importorskip("kvcache", reason="kvcache is not importable")

NULL = 0
BIG_POOL = 4000
SALTS = [None, None, "a", "b"]
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cache_model():
    try:
        from swiftkv_reference import cache_model
    except ImportError as exc:
        pytest.skip(f"swiftkv_reference.cache_model is not importable yet: {exc}")
    names = ("needed_positions", "num_skipped_tokens", "longest_hybrid_prefix_hit", "blocks_required_for_hit")
    for name in names:
        if not hasattr(cache_model, name):
            pytest.skip(f"swiftkv_reference.cache_model has no {name}")
    return cache_model


def needed(cm, num_computed: int, window: int | None) -> set[int]:
    return set(cm.needed_positions(num_computed, window))


@st.composite
def layouts(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    window = draw(st.integers(2, 10))
    kind = draw(st.sampled_from(["full", "sliding", "hybrid"]))
    windows = {"full": [None], "sliding": [window], "hybrid": [None, window]}[kind]
    return block_size, windows


class Shadow:
    """What each physical block slot holds: (cache salt, token prefix its KV was computed under)."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], tuple] = {}

    def write(self, tables, salt, tokens: list[int], start: int, end: int, bs: int, context: str) -> None:
        for g, table in enumerate(tables):
            for p in range(start, end):
                block = table[p // bs]
                assert block != NULL, f"group {g}: position {p} is scheduled into the null block\n{context}"
                self.slots[(block, p % bs)] = (salt, tuple(tokens[: p + 1]))

    def check(self, tables, salt, tokens: list[int], need_by_group, bs: int, context: str) -> None:
        for g, (table, need) in enumerate(zip(tables, need_by_group)):
            for p in sorted(need):
                assert p // bs < len(table), (
                    f"group {g}: position {p} needed, table has {len(table)} blocks\n{context}"
                )
                block = table[p // bs]
                assert block != NULL, (
                    f"group {g}: position {p} needed but its block is the null block\n{context}"
                )
                held = self.slots.get((block, p % bs))
                if held is None:
                    what = "never written"
                elif held[0] != salt:
                    what = f"KV of another cache salt ({held[0]!r}, not {salt!r})"
                else:
                    what = f"KV of a prefix of length {len(held[1])}"
                assert held == (salt, tuple(tokens[: p + 1])), (
                    f"group {g}: position {p} in block {block} holds {what}\n{context}"
                )


class _Block:
    __slots__ = ("key", "group", "ref")

    def __init__(self) -> None:
        self.key: tuple | None = None  # (salt, token prefix through this block) once cached
        self.group = -1  # the group that cached it
        self.ref = 0


class PoolModel:
    """vLLM 0.33's block pool at the level of contents, written from its rules alone.

    The free queue's front is reused first: a block whose last reference goes is prepended when
    uncached and appended when cached (LRU; one free call keeps its own order at both ends); a
    table is freed last block first, group by group; a running request's window-dead blocks are
    freed (highest index first, stopping at a null) at the start of every allocation, even a
    refused one. Taking a cached block from the queue evicts it. A hit takes the blocks the hit
    needs (`cache_model.blocks_required_for_hit`); among equal cached copies, the oldest.
    """

    def __init__(self, cm, num_blocks: int, block_size: int, windows: list[int | None]) -> None:
        self.cm, self.bs, self.windows = cm, block_size, windows
        self.free: list[_Block] = [_Block() for _ in range(num_blocks - 1)]
        self.cached: list[dict[tuple, list[_Block]]] = [{} for _ in windows]  # per group, oldest first
        self.tables: dict[str, list[list[_Block | None]]] = {}

    def _key(self, req, j: int) -> tuple:
        return (req.cache_salt, tuple(req.all_token_ids[: (j + 1) * self.bs]))

    def predicted_hit(self, req) -> int:
        salt = req.cache_salt
        groups = [lambda p, c=c: (salt, p) in c for c in self.cached]
        return self.cm.longest_hybrid_prefix_hit(req.all_token_ids, groups, self.bs, self.windows)

    def null_pattern(self, rid: str) -> list[list[bool]]:
        return [[b is None for b in table] for table in self.tables[rid]]

    def _free(self, blocks) -> None:
        uncached, cached = [], []
        for b in blocks:
            b.ref -= 1
            if b.ref == 0:
                (uncached if b.key is None else cached).append(b)
        self.free[:0] = uncached
        self.free.extend(cached)

    def _take(self, n: int) -> list[_Block]:
        assert n <= len(self.free), (
            f"the pool model has {len(self.free)} free blocks, {n} taken: the manager kept other "
            "cached blocks than LRU eviction (tail blocks first, oldest copy hit) would"
        )
        taken, self.free[:n] = self.free[:n], []
        for b in taken:
            if b.key is not None:
                copies = self.cached[b.group][b.key]
                copies.remove(b)
                if not copies:
                    del self.cached[b.group][b.key]
                b.key = None
            b.ref = 1
        return taken

    def _grow_and_cache(self, req, total: int) -> None:
        for g, table in enumerate(self.tables[req.request_id]):
            table.extend(self._take(-(-total // self.bs) - len(table)))
            for j in range(total // self.bs):
                b = table[j]
                if b is not None and b.key is None:
                    b.key, b.group = self._key(req, j), g
                    self.cached[g].setdefault(b.key, []).append(b)

    def admit(self, req, hit_tokens: int, num_new: int) -> None:
        tables = []
        for g, window in enumerate(self.windows):
            table: list[_Block | None] = [None] * (hit_tokens // self.bs)
            for j in self.cm.blocks_required_for_hit(hit_tokens, self.bs, window):
                b = self.cached[g][self._key(req, j)][0]
                if b.ref == 0:
                    self.free.remove(b)
                b.ref += 1
                table[j] = b
            tables.append(table)
        self.tables[req.request_id] = tables
        self._grow_and_cache(req, hit_tokens + num_new)

    def skip(self, req) -> None:
        """The start of a running request's `allocate_slots` (refused or not)."""
        for table, window in zip(self.tables[req.request_id], self.windows):
            if window is None:
                continue
            skipped = self.cm.num_skipped_tokens(req.num_computed_tokens, window) // self.bs
            removed = []
            for i in range(min(skipped, len(table)) - 1, -1, -1):
                if table[i] is None:
                    break
                removed.append(table[i])
                table[i] = None
            self._free(removed)

    def step(self, req, num_new: int) -> None:
        self._grow_and_cache(req, req.num_computed_tokens + num_new)

    def release(self, req) -> None:
        for table in self.tables.pop(req.request_id):
            self._free([b for b in reversed(table) if b is not None])


def run_trace(data, cm, block_size: int, windows: list[int | None], num_blocks: int, big_pool: bool) -> None:
    from kvcache import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec

    specs = [
        FullAttentionSpec(block_size=block_size)
        if w is None
        else SlidingWindowSpec(block_size=block_size, window=w)
        for w in windows
    ]
    mgr = KVCacheManager(groups=specs, num_blocks=num_blocks, max_model_len=256, enable_caching=True)
    shadow = Shadow()
    pool = PoolModel(cm, num_blocks, block_size, windows)
    cached: set[tuple] = set()  # brute force: (salt, prefix) of every full block ever scheduled
    log: list[str] = [f"KVCacheManager(groups={specs}, num_blocks={num_blocks}, max_model_len=256)"]
    salted = data.draw(st.booleans(), label="random cache salts")
    prompts: list[tuple[list[int], str | None]] = []
    waiting: list = []
    running: list = []
    last_alloc: dict[str, int] = {}  # num_computed basis of the last allocation (skip basis)
    counter = 0

    def context() -> str:
        return "trace:\n  " + "\n  ".join(log[-40:])

    def note_alloc(req, start: int, end: int) -> None:
        """Right after a successful allocation: the step's first query sees its past, then the
        step's positions are written."""
        tables = mgr.get_block_ids(req.request_id)
        need = [needed(cm, start, w) for w in windows]
        shadow.check(tables, req.cache_salt, req.all_token_ids, need, block_size, f"(first query){context()}")
        shadow.write(tables, req.cache_salt, req.all_token_ids, start, end, block_size, context())
        for k in range(1, end // block_size + 1):
            cached.add((req.cache_salt, tuple(req.all_token_ids[: k * block_size])))

    def preempt_or_free(victim, why: str) -> None:
        mgr.free(victim)
        pool.release(victim)
        log.append(f"{why} {victim.request_id}")

    for _ in range(data.draw(st.integers(4, 18), label="steps")):
        if data.draw(st.booleans(), label="new request") or not (waiting or running):
            salt = data.draw(st.sampled_from(SALTS), label="salt") if salted else None
            if prompts and data.draw(st.booleans(), label="share a prefix"):
                base, base_salt = data.draw(st.sampled_from(prompts), label="base prompt")
                if salted and data.draw(st.booleans(), label="same salt as the base"):
                    salt = base_salt
                cut = data.draw(st.integers(0, len(base)), label="prefix length")
                prompt = base[:cut] + data.draw(
                    st.lists(st.integers(1, 3), min_size=0 if cut else 1, max_size=8)
                )
            else:
                prompt = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=20), label="prompt")
            prompts.append((prompt, salt))
            counter += 1
            waiting.append(Request(f"r{counter}", prompt, cache_salt=salt))
            log.append(f"add r{counter} prompt={prompt} salt={salt!r}")
        # admit at most one waiting request
        admitted_now = None
        if waiting:
            req = waiting[0]
            hit = mgr.get_computed_blocks(req)
            want = pool.predicted_hit(req)
            assert hit.num_tokens == want, (
                f"{req.request_id}: prefix hit {hit.num_tokens} tokens, the pool model predicts {want} "
                f"(the blocks of this salt and prefix that LRU eviction keeps)\n{context()}"
            )
            if big_pool:
                brute = cm.longest_hybrid_prefix_hit(
                    req.all_token_ids,
                    [lambda p, s=req.cache_salt: (s, p) in cached] * len(windows),
                    block_size,
                    windows,
                )
                assert hit.num_tokens == brute, (
                    f"{req.request_id}: prefix hit {hit.num_tokens} tokens, brute force {brute}\n{context()}"
                )
            n = data.draw(st.integers(1, req.num_tokens - hit.num_tokens), label="first chunk")
            if mgr.allocate_slots(req, n, hit=hit) is not None:
                waiting.pop(0)
                log.append(
                    f"admit {req.request_id}: hit {hit.num_tokens}, chunk {n}, "
                    f"tables {mgr.get_block_ids(req.request_id)}"
                )
                pool.admit(req, hit.num_tokens, n)
                last_alloc[req.request_id] = hit.num_tokens
                note_alloc(req, hit.num_tokens, hit.num_tokens + n)
                req.num_computed_tokens += hit.num_tokens + n
                running.append(req)
                admitted_now = req.request_id
            else:
                log.append(f"admit {req.request_id}: no room (hit {hit.num_tokens}, chunk {n})")
        # one step for the others (decode or the next prefill chunk); preempt the newest on None
        for req in list(running):
            if req not in running or req.request_id == admitted_now:
                continue
            if req.num_computed_tokens == req.num_tokens:
                if len(req.output_token_ids) >= 6:
                    continue
                req.append_output_token_ids(data.draw(st.integers(1, 3), label="sampled token"))
                n = 1
            else:
                n = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens), label="chunk")
            start = req.num_computed_tokens
            while True:
                new = mgr.allocate_slots(req, n)
                pool.skip(req)
                if new is not None:
                    break
                victim = running.pop()  # the most recently admitted
                preempt_or_free(victim, "preempt")
                victim.num_computed_tokens = 0
                waiting.insert(0, victim)
                if victim is req:
                    break
            if new is not None:
                log.append(
                    f"step {req.request_id}: {n} tokens from {start}, "
                    f"tables {mgr.get_block_ids(req.request_id)}"
                )
                pool.step(req, n)
                last_alloc[req.request_id] = start
                note_alloc(req, start, start + n)
                req.num_computed_tokens += n
        # finish one at random
        if running and data.draw(st.booleans(), label="finish one"):
            req = running.pop(data.draw(st.integers(0, len(running) - 1), label="which"))
            preempt_or_free(req, "finish")
        # invariants for every running request
        held: dict[int, str | None] = {}  # block -> the cache salt of its holders
        for req in running:
            tables = mgr.get_block_ids(req.request_id)
            c = req.num_computed_tokens
            need = [needed(cm, c, w) for w in windows]
            shadow.check(tables, req.cache_salt, req.all_token_ids, need, block_size, context())
            assert [[b == NULL for b in t] for t in tables] == pool.null_pattern(req.request_id), (
                f"{req.request_id}: null entries {tables}, the pool model's skip gives "
                f"{pool.null_pattern(req.request_id)}\n{context()}"
            )
            basis = last_alloc[req.request_id]
            for g, (table, w) in enumerate(zip(tables, windows)):
                for b in table:
                    if b != NULL:
                        salt = held.setdefault(b, req.cache_salt)
                        assert salt == req.cache_salt, (
                            f"block {b} is shared by requests with cache salts {salt!r} and "
                            f"{req.cache_salt!r}\n{context()}"
                        )
                keep = needed(cm, basis, w)
                lo = min(keep) if keep else basis
                for j in range(min(lo // block_size, len(table))):
                    assert table[j] == NULL, (
                        f"{req.request_id} group {g}: block {j} "
                        f"(positions {j * block_size}..{(j + 1) * block_size - 1}) "
                        f"is held but everything before position {lo} is outside the window {w} "
                        f"(computed {basis} at the last allocation): {table}\n{context()}"
                    )
        assert mgr.num_free_blocks == num_blocks - 1 - len(held), (
            f"{mgr.num_free_blocks} free blocks, but {len(held)} of {num_blocks - 1} are held: "
            f"a block leaked or was freed twice\n{context()}"
        )


@SETTINGS
@given(data=st.data(), layout=layouts())
def test_cache_rules_big_pool_exact_hits(data, layout):
    """No eviction possible: hits must also equal the brute-force longest valid hit."""
    cm = _cache_model()
    block_size, windows = layout
    run_trace(data, cm, block_size, windows, BIG_POOL, big_pool=True)


@SETTINGS
@given(data=st.data(), layout=layouts(), num_blocks=st.integers(8, 24))
def test_cache_rules_tiny_pool(data, layout, num_blocks):
    """Eviction and preemption: every needed position still holds this request's KV, and every
    hit is the one the LRU pool model predicts."""
    cm = _cache_model()
    block_size, windows = layout
    run_trace(data, cm, block_size, windows, num_blocks, big_pool=False)
