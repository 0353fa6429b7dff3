"""The decode stack chosen by measurement (worker/stack_timing.py): each half's stack runs at the decode
row buckets where it was timed faster than the per-op path; a half whose stack runs nowhere drops its
spare panel layouts; timings are cached per machine, and not cached when the CPU was busy."""

from __future__ import annotations

import json
import logging

import pytest
from conftest import TINY_MODELS, random_prompts
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.kernels import build, cpu_decode_stack
from swiftkv_fast.kernels.linear_kernels import cache_file
from swiftkv_fast.worker import kernel_plan, stack_timing

pytestmark = pytest.mark.skipif(
    build.compiler() is None or cpu_decode_stack.kernel(16, 2) is None,
    reason="no C compiler here (the decode stack is a compiled kernel)",
)

BUCKETS = (1, 2, 4)
GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture
def untimed(monkeypatch):
    """Engines built without the start-up timing: each test times with its own timer."""
    monkeypatch.setattr(kernel_plan, "choose_decode_stacks", lambda *a, **kw: {})


def _engine(tiny, name="swiftkv_g1"):
    cfg, state, _ = tiny(**TINY_MODELS[name])
    llm = LLM.from_state_dict(cfg, state, block_size=4, max_model_len=64, num_kv_blocks=64, max_num_seqs=4)
    runner = llm.llm_engine.runner
    return cfg, llm, runner


def _timer(stack_wins_at, seen):
    """Runs the call and reports 1 s, or 0.5 s for the stack at the rows in `stack_wins_at`."""

    def timer(path, rows, call):
        call()
        seen.append((path, rows))
        return 0.5 if path == "stack" and rows in stack_wins_at else 1.0

    return timer


def _linears(layers):
    return [lin for lw in layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)]


def test_the_stack_runs_where_it_was_timed_faster(tiny, untimed, tmp_path):
    cfg, llm, runner = _engine(tiny)
    model = runner.model
    assert all("panel" in lin.layouts for lin in _linears(model.w.layers))  # spares kept until timed
    seen: list = []
    stack_timing.choose_decode_stacks(
        model,
        runner.kv_cache,
        BUCKETS,
        cache_path=cache_file(tmp_path),
        cold=False,
        timer=_timer({1, 2}, seen),
    )
    assert {rows for _, rows in seen} == set(BUCKETS) and {p for p, _ in seen} == {"ops", "stack"}
    for stack in model.stacks:
        assert [stack.runs_at(r) for r in (1, 2, 3, 4, 5)] == [True, True, False, False, False]
    # the timings ran both paths for real: the stack only in its own timings
    calls = [s.calls for s in model.stacks]
    assert all(c > 0 for c in calls)
    prompts = random_prompts(4, cfg.vocab_size, [6, 9, 5, 7], seed=3)
    llm.generate(prompts[:2], GREEDY, use_tqdm=False)  # two rows per decode step: the stacks
    after_two = [s.calls for s in model.stacks]
    assert all(a > c for a, c in zip(after_two, calls))
    llm.generate(prompts, GREEDY, use_tqdm=False)  # four rows: the per-op path (and the prompt's step)
    assert model.stacks[0].calls == after_two[0]


def test_a_stack_that_never_wins_drops_its_spare_layouts(tiny, untimed, tmp_path):
    cfg, llm, runner = _engine(tiny)
    model = runner.model
    prompts = random_prompts(3, cfg.vocab_size, [6, 9, 5], seed=4)
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    described = stack_timing.choose_decode_stacks(
        model, runner.kv_cache, BUCKETS, cache_path=cache_file(tmp_path), cold=False, timer=_timer(set(), [])
    )
    assert all("per-op at every decode row count" in d for d in described.values())
    for lin in _linears(model.w.layers):
        assert set(lin.layouts) == {k for _, k in lin.plan}  # nothing kept that no row count runs
    assert not any(s.runs_at(r) for s in model.stacks for r in (1, 2, 3))
    calls = [s.calls for s in model.stacks]
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert [s.calls for s in model.stacks] == calls
    assert after == before  # the per-op path's tokens, as before any decision


def test_timings_are_cached_and_a_busy_cpu_is_not(tiny, untimed, tmp_path, caplog):
    caplog.set_level(logging.DEBUG, logger=stack_timing.logger.name)  # "timings cached" is a debug line
    _, _, runner = _engine(tiny)
    path = cache_file(tmp_path)
    seen: list = []
    # every try disturbed: threads waited 100 s per second of wall time for a core
    waits = iter(float(100 * i) for i in range(1000))
    stack_timing.choose_decode_stacks(
        runner.model,
        runner.kv_cache,
        BUCKETS,
        cache_path=path,
        cold=False,
        timer=_timer({1}, seen),
        waited=lambda: next(waits),
    )
    assert "the CPU was busy" in caplog.text and not path.exists()
    assert runner.model.stacks[0].runs_at(1) and not runner.model.stacks[0].runs_at(2)

    seen.clear()
    _, _, runner = _engine(tiny)
    quiet = lambda: 0.0  # noqa: E731 - an idle machine, whatever else runs beside this test
    stack_timing.choose_decode_stacks(
        runner.model,
        runner.kv_cache,
        BUCKETS,
        cache_path=path,
        cold=False,
        timer=_timer({1, 2}, seen),
        waited=quiet,
    )
    assert seen and path.exists()
    keys = [k for k in json.loads(path.read_text())["times"] if k.startswith("decode-stack")]
    assert sorted(k.split()[1] for k in keys) == ["first", "second"]

    seen.clear()
    _, _, runner = _engine(tiny)
    stack_timing.choose_decode_stacks(
        runner.model,
        runner.kv_cache,
        BUCKETS,
        cache_path=path,
        cold=False,
        timer=_timer(set(), seen),
        waited=quiet,
    )
    assert not seen  # from the cache: the stacks run where the cached timings said
    assert all(s.runs_at(2) and not s.runs_at(4) for s in runner.model.stacks)
    assert "timings cached" in caplog.text


def test_engine_start_up_times_the_stacks_once_per_machine(tiny, monkeypatch, tmp_path):
    """Built with the kernels chosen by measurement, the engine times the stacks at its decode buckets
    (cached in the user's cache dir); a forced kernel skips the timing."""
    monkeypatch.setenv("SWIFTKV_CACHE", str(tmp_path))
    timed: list = []
    real = stack_timing.choose_decode_stacks

    def spy(*args, **kw):
        timed.append(args[2])
        return real(*args, **kw, waited=lambda: None)  # a busy test machine still caches here

    monkeypatch.setattr(kernel_plan, "choose_decode_stacks", spy)
    cfg, llm, runner = _engine(tiny)
    assert timed == [[1, 2, 4]]  # max_num_seqs 4
    cached = json.loads(next(tmp_path.rglob("linear_kernels-*.json")).read_text())["times"]
    assert any(k.startswith("decode-stack") for k in cached)
    cfg, state, _ = tiny(**TINY_MODELS["swiftkv_g1"])
    LLM.from_state_dict(cfg, state, block_size=4, max_model_len=64, num_kv_blocks=64, linear_kernel="matmul")
    assert len(timed) == 1
    out = llm.generate(random_prompts(2, cfg.vocab_size, [5, 8], seed=1), GREEDY, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in out)
