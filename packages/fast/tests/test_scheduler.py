"""Scheduler unit tests with a fake model (no torch model): budget, chunking, decode priority,
preemption and resume, stop rules and finish reasons."""

from __future__ import annotations

from kvcache import FullAttentionSpec, KVCacheManager
from swiftkv_fast.engine.request import Request, RequestStatus
from swiftkv_fast.engine.scheduler import Scheduler
from swiftkv_fast.sampling_params import SamplingParams

EOS = 2


def fake_next_token(req: Request) -> int:
    """A deterministic 'model': the next token depends on every token so far."""
    return 3 + sum(t * (i + 1) for i, t in enumerate(req.all_token_ids)) % 50


def make(num_blocks=100, block_size=4, budget=16, max_num_seqs=8, max_model_len=256, detokenize=None):
    mgr = KVCacheManager([FullAttentionSpec(block_size)], num_blocks=num_blocks, max_model_len=max_model_len)
    return Scheduler(mgr, max_num_seqs, budget, max_model_len, [EOS], detokenize)


def add(sched, rid, n, first=None, **params):
    """A request with a prompt of n distinct tokens (no prefix hits unless `first` repeats)."""
    params.setdefault("ignore_eos", True)
    first = first if first is not None else 10 + 1000 * len(sched.waiting) + 1000 * len(sched.running)
    req = Request(rid, list(range(first, first + n)), SamplingParams(temperature=0, **params), None)
    sched.add_request(req)
    return req


def step(sched, token_fn=fake_next_token):
    out = sched.schedule()
    tokens = {s.request.request_id: token_fn(s.request) for s in out.scheduled if s.sampled}
    finished = sched.update_from_output(out, tokens)
    return out, finished


def run_all(sched, max_steps=1000):
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return
        step(sched)
    raise AssertionError("did not finish")


def test_budget_and_chunked_prefill():
    sched = make(budget=16)
    a, b, c = add(sched, "a", 10), add(sched, "b", 10), add(sched, "c", 10)
    out, _ = step(sched)
    assert [(s.request.request_id, s.start, s.num_tokens) for s in out.scheduled] == [
        ("a", 0, 10),
        ("b", 0, 6),
    ]
    assert [s.sampled for s in out.scheduled] == [True, False]
    assert sum(s.num_tokens for s in out.scheduled) == 16 and c.status == RequestStatus.WAITING
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0


def test_long_prompt_is_chunked_and_sampled_once():
    sched = make(budget=16)
    r = add(sched, "r", 40, max_tokens=1)
    chunks = []
    while sched.has_unfinished():
        out, _ = step(sched)
        chunks += [(s.start, s.num_tokens, s.sampled) for s in out.scheduled]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True)]
    assert r.finish_reason == "length" and r.num_output_tokens == 1


def test_decodes_come_before_new_prefill_chunks():
    sched = make(budget=8)
    add(sched, "a", 6)
    step(sched)  # a: prefill (6), b not yet added
    add(sched, "b", 20)
    out, _ = step(sched)
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]


def test_prefix_hit_in_the_same_step():
    sched = make(budget=64)
    add(sched, "a", 10, first=5)
    b = add(sched, "b", 10, first=5)
    out, _ = step(sched)
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(0, 10), (8, 2)]
    assert b.num_cached_tokens == 8


def test_max_num_seqs():
    sched = make(budget=100, max_num_seqs=2)
    for i in range(4):
        add(sched, str(i), 5)
    out, _ = step(sched)
    assert len(out.scheduled) == 2 and len(sched.waiting) == 2


def test_preemption_resumes_with_identical_outputs():
    def outputs(num_blocks):
        sched = make(num_blocks=num_blocks, block_size=4, budget=32, max_model_len=64)
        reqs = [add(sched, str(i), 20, max_tokens=24) for i in range(4)]
        run_all(sched)
        assert sched.kv.num_requests == 0
        return [r.output_token_ids for r in reqs], sched.num_preemptions, reqs

    want, n0, _ = outputs(200)
    got, n1, reqs = outputs(20)  # 4 requests of 44 tokens need 44 blocks: must preempt
    assert n0 == 0 and n1 > 0
    assert got == want
    assert all(r.finish_reason == "length" and r.num_output_tokens == 24 for r in reqs)


def test_preempts_most_recently_admitted():
    sched = make(num_blocks=9, block_size=4, budget=64, max_model_len=32)
    a, b = add(sched, "a", 12, max_tokens=20), add(sched, "b", 12, max_tokens=20)
    step(sched)  # a, b: 3 blocks each of 8 usable
    preempted = []
    for _ in range(6):
        out, _ = step(sched)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "b"
    assert b.num_preemptions >= 1 and a.num_preemptions == 0


def test_stop_token_eos_and_length():
    sched = make()
    r_stop = add(sched, "s", 4, stop_token_ids=[7], max_tokens=10)
    r_eos = add(sched, "e", 4, ignore_eos=False, max_tokens=10)
    r_ign = add(sched, "i", 4, ignore_eos=True, max_tokens=3)
    r_min = add(sched, "m", 4, ignore_eos=False, min_tokens=3, max_tokens=10)
    scripted = {"s": [5, 7, 9], "e": [5, EOS], "i": [EOS, EOS, EOS], "m": [EOS, EOS, EOS, 4]}
    while sched.has_unfinished():
        step(sched, lambda req: scripted[req.request_id][req.num_output_tokens])
    assert (r_stop.output_token_ids, r_stop.finish_reason, r_stop.stop_reason) == ([5, 7], "stop", 7)
    assert (r_eos.output_token_ids, r_eos.finish_reason, r_eos.stop_reason) == ([5, EOS], "stop", None)
    assert (r_ign.output_token_ids, r_ign.finish_reason) == ([EOS] * 3, "length")
    assert (r_min.output_token_ids, r_min.finish_reason) == ([EOS] * 3, "stop")  # min_tokens=3


def test_stop_string_cuts_text():
    sched = make(detokenize=lambda ids: "".join(chr(ord("a") + t % 26) for t in ids))
    r = add(sched, "r", 3, stop=["cd"], max_tokens=10)
    script = [0, 1, 2, 3, 4]  # "abcde"
    while sched.has_unfinished():
        step(sched, lambda req: script[req.num_output_tokens])
    assert (r.finish_reason, r.stop_reason, r.output_text) == ("stop", "cd", "ab")
    assert r.output_token_ids == [0, 1, 2, 3]


def test_max_model_len_caps_output():
    sched = make(max_model_len=12)
    r = add(sched, "r", 10, max_tokens=100)
    run_all(sched)
    assert r.finish_reason == "length" and r.num_tokens == 12


def test_min_tokens_banned_ids_travel_on_the_scheduled_request():
    """Before min_tokens outputs a sampled request carries its EOS and stop token ids (the runner masks
    them); a chunk that samples nothing, ignore_eos and the steps after min_tokens carry none of EOS."""
    sched = make(budget=16)
    add(sched, "a", 6, min_tokens=2, ignore_eos=False, stop_token_ids=[7])
    add(sched, "b", 20, min_tokens=2, ignore_eos=False)
    add(sched, "c", 3, min_tokens=1, ignore_eos=True, stop_token_ids=[9])
    banned = []
    for _ in range(4):
        out, _ = step(sched, token_fn=lambda req: 60)
        banned.append({s.request.request_id: s.banned_token_ids for s in out.scheduled})
    assert banned[0] == {"a": [EOS, 7], "b": []}  # b's first chunk samples nothing
    assert banned[1] == {"a": [EOS, 7], "b": [EOS], "c": [9]}
    assert banned[2] == {"a": [], "b": [EOS], "c": []}
    assert banned[3] == {"a": [], "b": [], "c": []}
