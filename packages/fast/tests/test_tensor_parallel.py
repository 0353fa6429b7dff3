"""Tensor parallelism on CPU (gloo, 2 processes): the same tokens and logits as one rank, sharding
refusals, clean shutdown, and a worker that dies.

Each engine runs chunked prefill (16 tokens a step), prefix caching over shared prefixes in two waves,
and a pool small enough to force preemption, so one engine per model covers the scheduler's paths.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import TINY_MODELS, random_prompts
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.executor.executor import WorkerDiedError
from swiftkv_fast.model.tp_sharding import TensorParallelShard, check_tensor_parallel

ENGINE = dict(block_size=4, max_num_batched_tokens=16, max_model_len=80, num_kv_blocks=24, max_num_seqs=4)
# pools small enough to force preemption: a sliding window holds few blocks, a hybrid model two tables
NUM_KV_BLOCKS = {"mistral_window": 14, "hybrid": 32}
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TP_MODELS = {
    "full_replicated_kv": TINY_MODELS["full"],  # 2 heads, 1 K/V head: each rank holds a copy of it
    "swiftkv_g1_split_kv": dict(TINY_MODELS["swiftkv_g1"], num_key_value_heads=2),
    "swiftkv_g2": TINY_MODELS["swiftkv_g2"],
    "mistral_window": TINY_MODELS["mistral_window"],
    "hybrid": TINY_MODELS["hybrid"],
}


def _waves(vocab: int) -> list[list[list[int]]]:
    prefix, *rest = random_prompts(6, vocab, [24, 9, 30, 5, 13, 40], seed=7)
    first = [prefix + rest[0], rest[1], prefix + rest[2]]
    second = [prefix + rest[3], prefix[:10] + rest[4], first[2] + rest[0]]
    return [first, second]


def _run(llm: LLM, waves, params=GREEDY):
    outs = []
    for prompts in waves:
        outs += [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    return outs


@pytest.mark.parametrize("name", list(TP_MODELS))
def test_two_ranks_give_one_rank_tokens_and_logits(tiny, name):
    cfg, state, _ = tiny(**TP_MODELS[name])
    waves = _waves(cfg.vocab_size)
    engine = dict(ENGINE, num_kv_blocks=NUM_KV_BLOCKS.get(name, ENGINE["num_kv_blocks"]))
    one = LLM.from_state_dict(cfg, state, return_logits=True, **engine)
    two = LLM.from_state_dict(cfg, state, return_logits=True, tensor_parallel_size=2, **engine)
    try:
        expected, actual = _run(one, waves), _run(two, waves)
        for e, a in zip(expected, actual):
            assert a.token_ids == e.token_ids
            torch.testing.assert_close(a.logits, e.logits, atol=1e-4, rtol=0)
        assert two.get_stats()["num_preemptions"] > 0, "the small pool forced no preemption"
        # the second wave hit the first one's prefixes
        cached = [o.num_cached_tokens for o in two.generate(waves[1], GREEDY, use_tqdm=False)]
        assert sum(cached) > 0
        # each rank holds half the K/V heads (or a copy of the single one)
        kvh = cfg.num_key_value_heads
        assert two.llm_engine.runner.kv_cache.shape[-2] == max(1, kvh // 2)
        assert two.llm_engine.runner.num_blocks == one.llm_engine.runner.num_blocks
    finally:
        two.shutdown()


def test_seeded_sampling_matches_one_rank(tiny):
    cfg, state, _ = tiny(**TP_MODELS["swiftkv_g1_split_kv"])
    waves = _waves(cfg.vocab_size)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=11, max_tokens=12, ignore_eos=True)
    expected = _run(LLM.from_state_dict(cfg, state, **ENGINE), waves, params)
    two = LLM.from_state_dict(cfg, state, tensor_parallel_size=2, **ENGINE)
    try:
        assert [o.token_ids for o in _run(two, waves, params)] == [o.token_ids for o in expected]
    finally:
        two.shutdown()


def test_indivisible_dimensions_are_refused_naming_them(tiny):
    cfg, state, _ = tiny(**TINY_MODELS["full"])  # 2 heads, 1 K/V head, intermediate 96, vocab 128
    with pytest.raises(ValueError, match=r"num_attention_heads=2.*vocab_size=128"):
        LLM.from_state_dict(cfg, state, tensor_parallel_size=3, **ENGINE)
    odd, _, _ = tiny(**TINY_MODELS["full"], intermediate_size=97, num_key_value_heads=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide .* intermediate_size=97:"):
        check_tensor_parallel(odd, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM.from_state_dict(cfg, state, tensor_parallel_size=0, **ENGINE)
    with pytest.raises(ValueError, match="distributed_init_method"):
        LLM.from_state_dict(
            cfg, state, tensor_parallel_size=2, distributed_init_method="localhost:1", **ENGINE
        )


def test_shards_cover_every_head_once():
    """9 heads / 3 K/V heads (the embedded model) at N = 3: each rank its own; at N = 9 (fewer K/V heads
    than ranks) each K/V head is replicated on the 3 ranks whose query heads read it."""
    from swiftkv_reference.testing import tiny_config

    cfg = tiny_config(
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=8,
        hidden_size=72,
        intermediate_size=18,
        vocab_size=36,
    )
    three = [TensorParallelShard.of(cfg, r, 3) for r in range(3)]
    assert [(s.num_heads, s.num_kv_heads, s.kv_head_start, s.vocab_start) for s in three] == [
        (3, 1, 0, 0),
        (3, 1, 1, 12),
        (3, 1, 2, 24),
    ]
    nine = [TensorParallelShard.of(cfg, r, 9) for r in range(9)]
    # rank r has query head r, which reads K/V head r // 3
    assert [s.kv_head_start for s in nine] == [r // 3 for r in range(9)]


def test_del_leaves_no_worker_process(tiny):
    cfg, state, _ = tiny(**TINY_MODELS["full"])
    llm = LLM.from_state_dict(cfg, state, tensor_parallel_size=2, **ENGINE)
    procs = list(llm.llm_engine.executor.procs)
    assert [p.is_alive() for p in procs] == [True]
    llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
    del llm
    gc.collect()
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def test_a_killed_worker_fails_the_engine_within_seconds(tiny):
    cfg, state, _ = tiny(**TINY_MODELS["swiftkv_g1"])
    llm = LLM.from_state_dict(cfg, state, tensor_parallel_size=2, **ENGINE)
    engine = llm.llm_engine
    (worker,) = engine.executor.procs
    runner = engine.runner
    prepare = runner.prepare_step
    steps = []

    def kill_at_the_third_step(out):
        steps.append(out)
        if len(steps) == 3:  # the step's broadcast and collectives now meet a dead peer
            os.kill(worker.pid, signal.SIGKILL)
            worker.join(10)
        return prepare(out)

    runner.prepare_step = kill_at_the_third_step
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match=r"rank 1 \(pid \d+\) died \(killed by SIGKILL\)"):
        llm.generate(random_prompts(3, cfg.vocab_size, [20, 30, 9]), GREEDY, use_tqdm=False)
    assert time.monotonic() - start < 30
    assert len(steps) == 3
    assert worker.exitcode == -signal.SIGKILL
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_blocks - 1  # the step was undone
    assert not engine.has_unfinished_requests()
    with pytest.raises(WorkerDiedError, match="rank 1"):  # every later call says why, without hanging
        llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)


def test_a_worker_error_is_reported_with_its_message(tiny, monkeypatch):
    """A worker that fails at start-up: rank 0 raises an error that carries the worker's own message."""
    cfg, state, _ = tiny(**TINY_MODELS["full"])
    from swiftkv_fast.executor import multiproc_executor

    real_source = multiproc_executor.MultiprocExecutor._source

    def broken_source(*args):
        source = real_source(*args)
        del source.shard_state_dict["model.layers.0.mlp.down_proj.weight"]
        return source

    monkeypatch.setattr(multiproc_executor.MultiprocExecutor, "_source", staticmethod(broken_source))
    with pytest.raises(WorkerDiedError, match=r"worker rank 1 .*KeyError.*down_proj"):
        LLM.from_state_dict(cfg, state, tensor_parallel_size=2, **ENGINE)


def test_sigint_during_a_step_is_held_until_every_rank_finished_it(tiny, sigint_raises):
    """Ctrl-C reaches rank 0 in the middle of the model: the ranks finish the step together, then the
    interrupt undoes it, and the engine gives one rank's tokens on the next call."""
    cfg, state, _ = tiny(**TINY_MODELS["hybrid"])
    waves = _waves(cfg.vocab_size)
    engine = dict(ENGINE, num_kv_blocks=NUM_KV_BLOCKS["hybrid"])
    llm = LLM.from_state_dict(cfg, state, tensor_parallel_size=2, **engine)
    try:
        runner = llm.llm_engine.runner
        execute_model = runner.execute_model
        calls = []

        def sigint_inside(step):
            calls.append(step)
            if len(calls) == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return execute_model(step)

        runner.execute_model = sigint_inside
        with pytest.raises(KeyboardInterrupt):
            llm.generate(waves[0], GREEDY, use_tqdm=False)
        runner.execute_model = execute_model
        assert llm.llm_engine.dead_error is None
        expected = _run(LLM.from_state_dict(cfg, state, **engine), waves)
        assert [o.token_ids for o in _run(llm, waves)] == [o.token_ids for o in expected]
    finally:
        llm.shutdown()


RANK0_SCRIPT = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal, even if started with it ignored
sys.path.insert(0, sys.argv[1])
from conftest import TINY_MODELS
from swiftkv_reference.testing import random_state_dict, tiny_config
from swiftkv_fast import LLM, SamplingParams

if __name__ == "__main__":
    cfg = tiny_config(**TINY_MODELS["full"])
    llm = LLM.from_state_dict(
        cfg, random_state_dict(cfg), tensor_parallel_size=2, num_kv_blocks=16, max_model_len=64
    )
    params = SamplingParams(max_tokens=2)
    llm.generate([[5, 6, 7]], params, use_tqdm=False)
    print(*[p.pid for p in llm.llm_engine.executor.procs], flush=True)
    if sys.argv[2] == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    for _ in range(100_000):  # until the test's Ctrl-C
        llm.generate([[5, 6, 7]], params, use_tqdm=False)
"""


@pytest.mark.parametrize("how", ["sigkill", "ctrl-c"])
def test_no_worker_outlives_rank_0(tmp_path, how):
    """Rank 0 killed without any cleanup (SIGKILL): its workers notice the closed connection and exit.
    Ctrl-C to the whole process group (as a terminal sends it) while generating: the workers ignore it,
    rank 0 raises KeyboardInterrupt and stops them on its way out."""
    path = tmp_path / "rank0.py"
    path.write_text(RANK0_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, str(path), os.path.dirname(__file__), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, which the Ctrl-C goes to
    )
    try:
        (pid,) = map(int, proc.stdout.readline().split())
        if how == "ctrl-c":
            time.sleep(0.5)
            os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    stderr = proc.stderr.read()
    if how == "sigkill":
        assert proc.returncode == -signal.SIGKILL, stderr[-2000:]
    else:
        assert proc.returncode != 0 and "KeyboardInterrupt" in stderr, stderr[-2000:]
    deadline = time.monotonic() + 30
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(pid), f"worker {pid} outlived its rank 0 ({how})"


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for a reaper the container may not have)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
