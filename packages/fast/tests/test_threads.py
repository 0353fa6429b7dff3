"""One call at a time per LLM: a second generate/chat while one runs (another thread, or re-entered
from inside it) raises RuntimeError at once and changes nothing; the first call is unaffected.

The first call is held inside its first engine step by an Event (no sleeps), so the second call
deterministically arrives while the first one owns the engine."""

from __future__ import annotations

import threading

import pytest
from char_tokenizer import CharTokenizer
from conftest import random_prompts
from swiftkv_fast import LLM, SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
TIMEOUT = 120  # seconds; only reached if the test is broken


@pytest.fixture
def make_llm(tiny):
    cfg, state, _ = tiny(num_hidden_layers=2)

    def make():
        return LLM.from_state_dict(
            cfg, state, tokenizer=CharTokenizer(), block_size=8, max_model_len=128, num_kv_blocks=64
        )

    return make


def _tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _engine_state(llm) -> tuple:
    sched = llm.llm_engine.scheduler
    return (
        [r.request_id for r in sched.waiting],
        [(r.request_id, r.num_computed_tokens, r.num_output_tokens) for r in sched.running],
        llm.llm_engine.kv_manager.num_free_blocks,
    )


def test_second_thread_is_refused_and_first_call_unaffected(make_llm, monkeypatch):
    prompts = random_prompts(2, 128, [13, 6], seed=1)
    solo = _tokens(make_llm().generate(prompts, PARAMS, use_tqdm=False))
    llm = make_llm()
    engine = llm.llm_engine
    entered, release = threading.Event(), threading.Event()
    real_step = engine.step

    def held_step():
        if not entered.is_set():
            entered.set()
            assert release.wait(TIMEOUT)
        return real_step()

    monkeypatch.setattr(engine, "step", held_step)
    result: dict = {}

    def first():
        try:
            result["outs"] = llm.generate(prompts, PARAMS, use_tqdm=False)
        except BaseException as e:  # reported by the main thread
            result["error"] = e

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert entered.wait(TIMEOUT)
        before = _engine_state(llm)
        assert len(before[0]) == 2  # the first call's requests, not yet scheduled
        with pytest.raises(RuntimeError, match="already running a generate/chat call"):
            llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
        with pytest.raises(RuntimeError, match="already running"):
            llm.chat("hello", PARAMS, use_tqdm=False)
        with pytest.raises(RuntimeError, match="already running"):  # refused before its bad input is seen
            llm.generate([["bad"]], PARAMS, use_tqdm=False)
        assert _engine_state(llm) == before
    finally:
        release.set()
        thread.join(TIMEOUT)
    assert not thread.is_alive() and "error" not in result, result.get("error")
    assert _tokens(result["outs"]) == solo
    assert all(o.finished for o in result["outs"])
    # the engine is free again
    assert _tokens(llm.generate(prompts, PARAMS, use_tqdm=False)) == solo


def test_reentrant_call_is_refused_and_outer_call_unaffected(make_llm, monkeypatch):
    prompts = random_prompts(2, 128, [9, 17], seed=2)
    solo = _tokens(make_llm().generate(prompts, PARAMS, use_tqdm=False))
    llm = make_llm()
    real_step = llm.llm_engine.step
    refused = []

    def reentering_step():
        if not refused:
            with pytest.raises(RuntimeError, match="re-entered from inside one") as info:
                llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)
            refused.append(info.value)
        return real_step()

    monkeypatch.setattr(llm.llm_engine, "step", reentering_step)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert len(refused) == 1 and _tokens(outs) == solo


def test_a_failed_call_releases_the_engine(make_llm):
    llm = make_llm()
    with pytest.raises(ValueError):
        llm.generate([[]], PARAMS, use_tqdm=False)
    with pytest.raises(ValueError):
        llm.chat([{"role": "user"}], PARAMS, use_tqdm=False)
    assert len(llm.generate([[1, 2, 3]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 8
