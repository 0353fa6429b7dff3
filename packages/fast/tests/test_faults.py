"""Fault injection: an exception or a Ctrl-C at any point of a step never poisons the engine.

Blocks are registered in the prefix cache when scheduled, before the model writes their K/V. A step
that fails at any point (scheduling, the first half, the fused SwiftKV K/V write, the second half,
sampling, output processing) must leave no cached block whose K/V it did not write: prompts that
share prefixes with the failed ones then give exactly a fresh engine's tokens. After each fault the
kvcache invariants hold: every block is the null block, free or held, its reference count is the
number of tables that hold it, and nothing leaks.
"""

from __future__ import annotations

import collections
import os
import signal

import pytest
from conftest import TINY_MODELS, random_prompts
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.engine import scheduler as scheduler_module
from swiftkv_fast.worker import model_runner as model_runner_module

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
MODELS = ["swiftkv_g1", "mistral_swiftkv_g2", "hybrid_swiftkv"]  # full, sliding window, hybrid
FAULT_STEP = 2  # the first step completes (its blocks are valid), the second fails
ENGINE = dict(block_size=4, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=96)


def check_kv_invariants(kv) -> None:
    """Every block but the null one is free (ref 0, in the free queue) or held (ref = tables holding
    it); the free count matches; every cached block is findable under its own hash."""
    pool = kv.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = [b.block_id for b in free]
    assert len(free_ids) == len(set(free_ids)) == kv.num_free_blocks
    assert 0 not in free_ids, "the null block is in the free queue"
    holders = collections.Counter(
        b.block_id for m in kv.managers for table in m.req_to_blocks.values() for b in table if not b.is_null
    )
    assert not set(holders) & set(free_ids), "a held block is in the free queue"
    assert kv.num_free_blocks == kv.num_blocks - 1 - len(holders), "a block is neither free nor held"
    for block in pool.blocks[1:]:
        assert block.ref_cnt == holders.get(block.block_id, 0), block
        if block.block_hash is not None:
            entry = pool.cached_block_hash_to_block[block.group_id][block.block_hash]
            assert entry is block or (isinstance(entry, dict) and entry.get(block.block_id) is block)


def _prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    """Three prompts sharing a 20-token prefix (chunked over several steps at 16 tokens a step), and
    follow-ups: the same prompts, and new ones sharing their prefixes."""
    prefix, *suffixes = random_prompts(5, vocab, [20, 10, 7, 9, 12], seed=3)
    failed = [prefix + s for s in suffixes[:3]]
    follow = failed + [prefix + suffixes[3], prefix[:12] + suffixes[0], failed[0] + suffixes[1]]
    return failed, follow


class Fault:
    """Raises `exc` at the `nth` call of a wrapped function during engine step `step`: after the
    call ran (an allocation or a write half done, as a real failure leaves it), or `before` it."""

    def __init__(self, exc: type[BaseException], step: int = FAULT_STEP, nth: int = 1, before=False):
        self.exc, self.step, self.nth, self.before = exc, step, nth, before
        self.steps = self.calls = 0
        self.fired = False

    def count_steps(self, schedule):
        def wrapper():
            self.steps += 1
            return schedule()

        return wrapper

    def wrap(self, fn):
        def wrapper(*args, **kwargs):
            if self.before:
                self._maybe_fire()
            result = fn(*args, **kwargs)
            if not self.before:
                self._maybe_fire()
            return result

        return wrapper

    def _maybe_fire(self) -> None:
        if self.steps == self.step and not self.fired:
            self.calls += 1
            if self.calls == self.nth:
                self.fired = True
                raise self.exc(f"injected fault at step {self.step}")


def inject(monkeypatch, llm: LLM, point: str, fault: Fault) -> None:
    engine = llm.llm_engine
    backend = engine.runner.backend
    monkeypatch.setattr(engine.scheduler, "schedule", fault.count_steps(engine.scheduler.schedule))
    num_first_half_writes = engine.config.num_key_value_layers
    if point == "scheduling":  # the second allocation of the step has registered its blocks
        fault.nth = 2
        monkeypatch.setattr(engine.kv_manager, "allocate_slots", fault.wrap(engine.kv_manager.allocate_slots))
    elif point == "first_half":  # after layer 0's attention (its K/V written), before layer 1
        monkeypatch.setattr(backend, "prefill", fault.wrap(backend.prefill))
    elif point == "swiftkv_kv_write":  # layers < L wrote their K/V; the fused K/V write of L.. fails
        fault.nth, fault.before = num_first_half_writes + 1, True
        monkeypatch.setattr(backend, "write_kv", fault.wrap(backend.write_kv))
    elif point == "second_half":  # its per-op attention, or the decode stack where that runs
        monkeypatch.setattr(backend, "decode", fault.wrap(backend.decode))
        stack = engine.runner.model.stacks[1]
        if stack is not None:
            monkeypatch.setattr(stack, "run", fault.wrap(stack.run))
    elif point == "sampling":
        monkeypatch.setattr(model_runner_module, "sample", fault.wrap(model_runner_module.sample))
    elif point == "output_processing":  # the first sampled request got its token, then it fails
        monkeypatch.setattr(scheduler_module, "check_stop", fault.wrap(scheduler_module.check_stop))
    else:
        raise AssertionError(point)


_fresh_cache: dict[str, list[list[int]]] = {}


def fresh_tokens(tiny, model: str, prompts) -> list[list[int]]:
    if model not in _fresh_cache:
        cfg, state, _ = tiny(**TINY_MODELS[model])
        llm = LLM.from_state_dict(cfg, state, **ENGINE)
        _fresh_cache[model] = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    return _fresh_cache[model]


POINTS = ["scheduling", "first_half", "swiftkv_kv_write", "second_half", "sampling", "output_processing"]


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("model", MODELS)
def test_fault_leaves_no_poisoned_cache(tiny, monkeypatch, model, point, exc):
    cfg, state, _ = tiny(**TINY_MODELS[model])
    failed, follow = _prompts(cfg.vocab_size)
    llm = LLM.from_state_dict(cfg, state, **ENGINE)
    fault = Fault(exc)
    inject(monkeypatch, llm, point, fault)
    with pytest.raises(exc, match="injected fault"):
        llm.generate(failed, GREEDY, use_tqdm=False)
    assert fault.fired
    engine = llm.llm_engine
    assert not engine.has_unfinished_requests()
    check_kv_invariants(engine.kv_manager)
    assert engine.kv_manager.num_requests == 0
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks - 1

    monkeypatch.undo()
    outs = llm.generate(follow, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == fresh_tokens(tiny, model, follow)
    assert outs[0].num_cached_tokens > 0  # the blocks of the completed first step are still hit
    check_kv_invariants(engine.kv_manager)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks - 1


def test_failed_step_aborts_its_requests_only(tiny, monkeypatch):
    """At the engine level: the requests a failed step scheduled are aborted, the others run on."""
    cfg, state, _ = tiny(**TINY_MODELS["swiftkv_g1"])
    llm = LLM.from_state_dict(cfg, state, **{**ENGINE, "max_num_seqs": 1})
    engine = llm.llm_engine
    first, second = random_prompts(2, cfg.vocab_size, [9, 11], seed=5)
    a = engine.add_request(first, GREEDY)
    b = engine.add_request(second, GREEDY)  # waits: one running request at a time
    fault = Fault(RuntimeError, step=1)
    monkeypatch.setattr(engine.runner.backend, "prefill", fault.wrap(engine.runner.backend.prefill))
    monkeypatch.setattr(engine.scheduler, "schedule", fault.count_steps(engine.scheduler.schedule))
    with pytest.raises(RuntimeError, match="injected fault"):
        engine.step()
    assert a.is_finished and a.finish_reason == "abort" and a.request_id not in engine.kv_manager
    assert not b.is_finished and list(engine.scheduler.waiting) == [b]
    check_kv_invariants(engine.kv_manager)
    monkeypatch.undo()
    while engine.has_unfinished_requests():
        engine.step()
    solo = LLM.from_state_dict(cfg, state, **ENGINE).generate([second], GREEDY, use_tqdm=False)
    assert b.output_token_ids == solo[0].outputs[0].token_ids


def test_real_sigint_during_scheduling_is_held_until_the_step_can_be_undone(tiny, monkeypatch, sigint_raises):
    """A SIGINT that arrives inside the scheduler's bookkeeping is delivered when it ends, and the
    step it interrupts is undone like any other failure."""
    cfg, state, _ = tiny(**TINY_MODELS["mistral_swiftkv_g2"])
    failed, follow = _prompts(cfg.vocab_size)
    llm = LLM.from_state_dict(cfg, state, **ENGINE)
    engine = llm.llm_engine
    calls = []
    allocate = engine.kv_manager.allocate_slots

    def allocate_then_sigint(*args, **kwargs):
        result = allocate(*args, **kwargs)
        calls.append(result)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # lands in the middle of schedule()
        return result

    monkeypatch.setattr(engine.kv_manager, "allocate_slots", allocate_then_sigint)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(failed, GREEDY, use_tqdm=False)
    assert len(calls) >= 3
    check_kv_invariants(engine.kv_manager)
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks - 1
    monkeypatch.undo()
    outs = llm.generate(follow, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == fresh_tokens(tiny, "mistral_swiftkv_g2", follow)
