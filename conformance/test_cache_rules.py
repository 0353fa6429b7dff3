"""Cache rules: random request traces (hypothesis) through `kvcache` against the reference's
brute-force model (`swiftkv_reference.cache_model`).

A shadow of the physical blocks records, for every slot written, the full token prefix its KV was
computed under (KV at position p depends on tokens[0..p]). After every step, for every running
request and every group:
  * each position the request still needs (`cache_model.needed_positions`) sits in a non-null block
    whose slot holds KV computed under exactly this request's prefix (so no hit, share, eviction or
    preemption ever hands a request wrong or overwritten KV);
  * nothing beyond the window's bound is held: blocks wholly before the positions needed at the
    last allocation are the null block (blocks leave the table one step late, as in vLLM);
and every prefix hit equals the brute-force longest valid hit (`cache_model.longest_prefix_hit`)
when the pool is large enough that nothing is evicted (with a tiny pool, hits are only checked valid).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

kvcache = pytest.importorskip("kvcache", reason="kvcache is not importable")

NULL = 0
BIG_POOL = 4000
SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _cache_model():
    try:
        from swiftkv_reference import cache_model
    except ImportError as exc:
        pytest.skip(f"swiftkv_reference.cache_model is not importable yet: {exc}")
    for name in ("needed_positions", "longest_hybrid_prefix_hit"):
        if not hasattr(cache_model, name):
            pytest.skip(f"swiftkv_reference.cache_model has no {name}")
    return cache_model


def needed(cm, num_computed: int, window: int | None) -> set[int]:
    return set(cm.needed_positions(num_computed, window))


def expected_hit(
    cm, tokens: list[int], cached: set[tuple[int, ...]], block_size: int, windows: list[int | None]
) -> int:
    """The brute-force longest hit valid for every group (every group cached the same blocks)."""
    return cm.longest_hybrid_prefix_hit(tokens, [cached] * len(windows), block_size, windows)


@st.composite
def layouts(draw):
    block_size = draw(st.sampled_from([1, 2, 3, 4]))
    window = draw(st.integers(2, 10))
    kind = draw(st.sampled_from(["full", "sliding", "hybrid"]))
    windows = {"full": [None], "sliding": [window], "hybrid": [None, window]}[kind]
    return block_size, windows


class Shadow:
    """What each physical block slot holds: the token prefix its KV was computed under."""

    def __init__(self) -> None:
        self.slots: dict[tuple[int, int], tuple[int, ...]] = {}

    def write(self, tables, tokens: list[int], start: int, end: int, bs: int, context: str) -> None:
        for g, table in enumerate(tables):
            for p in range(start, end):
                block = table[p // bs]
                assert block != NULL, f"group {g}: position {p} is scheduled into the null block\n{context}"
                self.slots[(block, p % bs)] = tuple(tokens[: p + 1])

    def check(self, tables, tokens: list[int], need_by_group, bs: int, context: str) -> None:
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
                assert held == tuple(tokens[: p + 1]), (
                    f"group {g}: position {p} in block {block} holds KV of another prefix "
                    f"({'never written' if held is None else f'a prefix of length {len(held)}'})\n{context}"
                )


def run_trace(
    data, cm, block_size: int, windows: list[int | None], num_blocks: int, exact_hits: bool
) -> None:
    from kvcache import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec

    specs = [
        FullAttentionSpec(block_size=block_size)
        if w is None
        else SlidingWindowSpec(block_size=block_size, window=w)
        for w in windows
    ]
    mgr = KVCacheManager(groups=specs, num_blocks=num_blocks, max_model_len=256, enable_caching=True)
    shadow = Shadow()
    cached: set[tuple[int, ...]] = set()  # brute force: every full block ever scheduled (no eviction)
    log: list[str] = [f"KVCacheManager(groups={specs}, num_blocks={num_blocks}, max_model_len=256)"]
    prompts: list[list[int]] = []
    waiting: list = []
    running: list = []
    last_alloc: dict[str, int] = {}  # num_computed basis of the last allocation (skip basis)
    counter = 0

    def context() -> str:
        return "trace:\n  " + "\n  ".join(log[-40:])

    def note_alloc(req, start: int, end: int) -> None:
        tables = mgr.get_block_ids(req.request_id)
        shadow.write(tables, req.all_token_ids, start, end, block_size, context())
        for k in range(1, end // block_size + 1):
            cached.add(tuple(req.all_token_ids[: k * block_size]))

    for _ in range(data.draw(st.integers(4, 18), label="steps")):
        if data.draw(st.booleans(), label="new request") or not (waiting or running):
            if prompts and data.draw(st.booleans(), label="share a prefix"):
                base = data.draw(st.sampled_from(prompts), label="base prompt")
                cut = data.draw(st.integers(0, len(base)), label="prefix length")
                prompt = base[:cut] + data.draw(
                    st.lists(st.integers(1, 3), min_size=0 if cut else 1, max_size=8)
                )
            else:
                prompt = data.draw(st.lists(st.integers(1, 3), min_size=1, max_size=20), label="prompt")
            prompts.append(prompt)
            counter += 1
            waiting.append(Request(f"r{counter}", prompt))
            log.append(f"add r{counter} prompt={prompt}")
        # admit at most one waiting request
        admitted_now = None
        if waiting:
            req = waiting[0]
            hit = mgr.get_computed_blocks(req)
            if exact_hits:
                want = expected_hit(cm, req.all_token_ids, cached, block_size, windows)
                assert hit.num_tokens == want, (
                    f"{req.request_id}: prefix hit {hit.num_tokens} tokens, brute force {want}\n{context()}"
                )
            n = data.draw(st.integers(1, req.num_tokens - hit.num_tokens), label="first chunk")
            if mgr.allocate_slots(req, n, hit=hit) is not None:
                waiting.pop(0)
                log.append(
                    f"admit {req.request_id}: hit {hit.num_tokens}, chunk {n}, "
                    f"tables {mgr.get_block_ids(req.request_id)}"
                )
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
            while mgr.allocate_slots(req, n) is None:
                victim = running.pop()  # the most recently admitted
                mgr.free(victim)
                victim.num_computed_tokens = 0
                waiting.insert(0, victim)
                log.append(f"preempt {victim.request_id}")
                if victim is req:
                    break
            else:
                log.append(
                    f"step {req.request_id}: {n} tokens from {start}, "
                    f"tables {mgr.get_block_ids(req.request_id)}"
                )
                last_alloc[req.request_id] = start
                note_alloc(req, start, start + n)
                req.num_computed_tokens += n
        # finish one at random
        if running and data.draw(st.booleans(), label="finish one"):
            req = running.pop(data.draw(st.integers(0, len(running) - 1), label="which"))
            mgr.free(req)
            log.append(f"finish {req.request_id}")
        # invariants for every running request
        for req in running:
            tables = mgr.get_block_ids(req.request_id)
            c = req.num_computed_tokens
            need = [needed(cm, c, w) for w in windows]
            shadow.check(tables, req.all_token_ids, need, block_size, context())
            basis = last_alloc[req.request_id]
            for g, (table, w) in enumerate(zip(tables, windows)):
                keep = needed(cm, basis, w)
                lo = min(keep) if keep else basis
                for j in range(min(lo // block_size, len(table))):
                    assert table[j] == NULL, (
                        f"{req.request_id} group {g}: block {j} "
                        f"(positions {j * block_size}..{(j + 1) * block_size - 1}) "
                        f"is held but everything before position {lo} is outside the window {w} "
                        f"(computed {basis} at the last allocation): {table}\n{context()}"
                    )


@SETTINGS
@given(data=st.data(), layout=layouts())
def test_cache_rules_big_pool_exact_hits(data, layout):
    """No eviction possible: hits must equal the brute-force longest valid hit."""
    cm = _cache_model()
    block_size, windows = layout
    run_trace(data, cm, block_size, windows, BIG_POOL, exact_hits=True)


@SETTINGS
@given(data=st.data(), layout=layouts(), num_blocks=st.integers(8, 24))
def test_cache_rules_tiny_pool(data, layout, num_blocks):
    """Eviction and preemption: every needed position still holds this request's KV."""
    cm = _cache_model()
    block_size, windows = layout
    run_trace(data, cm, block_size, windows, num_blocks, exact_hits=False)
