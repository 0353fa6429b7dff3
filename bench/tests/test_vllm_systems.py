"""`throughput`'s vllm-* systems and the worker they share with `bench vllm` (bench/vllm_worker.py):
skipped with their reason without a vLLM venv, the worker's environment, its pipe protocol (on our own
engine in a worker process of this venv), its rounds interleaved with ours and read into the rows our
systems get, the ratio over vLLM and the greedy-token check. Without vLLM; the end-to-end check at the
end runs only where a vLLM venv is (`.nox/vllm`, or the Python named by BENCH_VLLM_PYTHON)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from pathlib import Path

import pytest

from bench import throughput, vllm_peer, vllm_worker
from bench.engine import BatchResult
from bench.harness import Sample

PLANS = {"a": ([[5, 6, 7], [8, 9]], 3), "b": ([[1] * 20], 2)}


def test_skipped_with_its_reason_where_the_vllm_python_is_missing(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    with contextlib.ExitStack() as stack:
        wanted = ["fast-off", "vllm-fp32", "vllm-bf16"]
        peers, skipped = throughput.vllm_workers(wanted, missing, 0.0, stack)
        assert peers == {} and set(skipped) == {"vllm-fp32", "vllm-bf16"}
        assert str(missing) in skipped["vllm-fp32"] and "--vllm-python" in skipped["vllm-fp32"]
        assert throughput.vllm_workers(["fast-off"], missing, 0.0, stack) == ({}, {})


def test_worker_env_pins_vllm_threads_to_the_given_cores(tmp_path):
    python = tmp_path / "venv" / "bin" / "python"
    env = vllm_worker.worker_env(python, "vllm", [0, 1])
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1" and env["OMP_NUM_THREADS"] == "2"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["VLLM_CPU_KVCACHE_SPACE"] and (env["OMP_PLACES"], env["OMP_PROC_BIND"]) == ("{0,1}", "true")
    (tmp_path / "venv" / "lib").mkdir(parents=True)
    (tmp_path / "venv" / "lib" / "libiomp5.so").touch()
    env = vllm_worker.worker_env(python, "vllm", [3])
    assert "libiomp5.so" in env["LD_PRELOAD"] and "proclist=[3]" in env["KMP_AFFINITY"]
    assert env["OMP_NUM_THREADS"] == "1" and "OMP_PLACES" not in env
    ours = vllm_worker.worker_env(python, "ours-off", [0, 1])
    assert ours["OMP_NUM_THREADS"] == "2" and "KMP_AFFINITY" not in ours and "LD_PRELOAD" not in ours


def test_torch_cores_are_as_many_as_torch_threads():
    import torch

    cores = vllm_worker.torch_cores()
    assert len(cores) == min(torch.get_num_threads(), len(os.sched_getaffinity(0)))
    assert set(cores) <= os.sched_getaffinity(0)


def _fake_result(calls: list) -> dict:
    """What a worker writes for `calls`: call i takes i + 1 seconds, request j's tokens are [i, j]."""
    out = []
    for i, (prompts, n) in enumerate(calls):
        batch = BatchResult(
            sum(map(len, prompts)), n * len(prompts), [0.01] * len(prompts), [0.002] * len(prompts)
        )
        batch.token_ids = [[i, j] for j in range(len(prompts))]
        out.append({"seconds": i + 1.0, **batch.metrics()})
    return dict(
        system="vllm", dtype="float32", startup_s=30.0, compile_s=12.0, threads=2, vllm="0.x", calls=out
    )


def test_the_worker_answers_each_call_on_its_own_clock_until_closed():
    """The pipe protocol end to end on our engine (`ours-off`, this venv's Python): built once, then
    calls answered in order, each timed in the worker; its tokens are the in-process engine's."""
    from bench import engine

    prompts, n = engine.random_prompts(2, 12, 49152, seed=3), 3
    with vllm_worker.Worker(Path(sys.executable), "ours-off", "float32", vllm_worker.torch_cores()) as worker:
        assert worker.info["system"] == "ours-off" and worker.info["startup_s"] > 0
        assert worker.info["compile_s"] is None and worker.info["vllm"] is None
        start = time.perf_counter()
        first = worker.call(prompts, n)
        wall = time.perf_counter() - start
        second = worker.call(prompts[:1], 2)
    assert 0 < first.seconds < wall and first.metrics["output_tokens"] == 6
    assert second.metrics["output_tokens"] == 2 and len(second.metrics["token_ids"]) == 1
    assert worker.close() == 0  # closed once already: the status again
    assert first.metrics["token_ids"] == engine.run_batch(engine.build_llm(None), prompts, n).token_ids


def test_a_worker_that_fails_is_an_error_naming_it_and_its_status():
    with pytest.raises(vllm_worker.WorkerError, match=r"ours-off worker exited with status [1-9]"):
        vllm_worker.Worker(Path(sys.executable), "ours-off", "float7", vllm_worker.torch_cores())
    with pytest.raises(ValueError, match="unknown worker system 'vllm-fp32'"):
        vllm_worker.Worker(Path(sys.executable), "vllm-fp32", "float32", [0])


class _StandInWorker:
    """A vLLM worker's stand-in for throughput.run: call i takes i + 1 seconds by its clock, its tokens
    are fast-off's; every call is logged in `order`."""

    order: list[str] = []

    def __init__(self, python, system, dtype, cores, temperature=0.0):
        self.dtype, self.calls = dtype, 0
        self.info = dict(system=system, dtype=dtype, startup_s=30.0, compile_s=12.0, threads=2, vllm="0.x")

    def call(self, prompts, max_tokens):
        from bench import engine

        self.calls += 1
        self.order.append(f"vllm-{self.dtype}")
        batch = engine.BatchResult(sum(map(len, prompts)), max_tokens * len(prompts))
        batch.token_ids = _StandInWorker.tokens
        return Sample(float(self.calls), batch.metrics())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_vllm_rounds_interleave_with_ours_and_give_the_ratio_over_vllm(monkeypatch, tmp_path, capsys):
    from bench import engine
    from bench.__main__ import build_parser

    run_batch = engine.run_batch

    def logged(llm, prompts, n, **kw):
        result = run_batch(llm, prompts, n, **kw)
        _StandInWorker.order.append("fast-off")
        _StandInWorker.tokens = result.token_ids
        return result

    monkeypatch.setattr(engine, "run_batch", logged)
    monkeypatch.setattr(vllm_worker, "Worker", _StandInWorker)
    _StandInWorker.order = []
    python = tmp_path / "python"
    python.touch()
    argv = ["throughput", "--quick", "--mixes", "issue4", "--systems", "fast-off,vllm-fp32"]
    argv += ["--vllm-python", str(python), "--repeat", "2", "--warmup", "1", "--out", str(tmp_path)]
    assert throughput.run(build_parser().parse_args(argv)) == 0
    # warm-ups, then rounds A, B, A, B
    assert _StandInWorker.order == ["fast-off", "vllm-float32"] * 3
    rows = {r["system"]: r for r in json.loads((tmp_path / "throughput.json").read_text())["results"]}
    vllm, ours = rows["vllm-fp32"], rows["fast-off"]
    assert vllm["elapsed_time"]["median"] == pytest.approx(2.5)  # its own clock: calls 2 and 3 (1 warm-up)
    assert vllm["startup_s"] == 30.0 and vllm["tokens_identical_to_fast_off"] == 1.0
    assert ours["vllm_peer"] == "vllm-fp32" and "output_tps_vs_vllm" not in vllm
    # round i: (32 tokens / ours_i) / (32 tokens / vllm_i), vLLM's rounds 2 s and 3 s
    fastest, slowest = ours["elapsed_time"]["min"], ours["elapsed_time"]["max"]
    assert 2 / slowest <= ours["output_tps_vs_vllm"]["median"] <= 3 / fastest
    out = capsys.readouterr().out
    assert "x vLLM" in out and "x fp32" in out and "interleaved with the others'" in out


def test_each_engine_system_is_held_to_vllm_at_its_precision():
    assert throughput.vllm_peer_of("fast-off") == throughput.vllm_peer_of("fast-on-kv-bf16") == "vllm-fp32"
    assert throughput.vllm_peer_of("fast-on-bf16") == "vllm-bf16"
    assert throughput.vllm_peer_of("hf-generate") is None and throughput.vllm_peer_of("vllm-fp32") is None
    assert throughput.vllm_peer_of("gemm-floor-off") is None


def test_worker_facts_and_the_token_check_go_into_the_rows():
    ours = [Sample(1.0, BatchResult(5, 6, [0.01, 0.01], [0.002, 0.002]).metrics())]
    theirs = [Sample(2.0, BatchResult(5, 6, [0.01, 0.01], [0.002, 0.002]).metrics())]
    theirs[0].metrics["token_ids"] = [[2, 0], [1, 1]]
    row = throughput.summarize("a", "vllm-fp32", theirs)
    assert set(row) == set(throughput.summarize("a", "fast-off", ours))
    assert row["num_requests"] == 2 and row["output_tokens_per_second"].median == pytest.approx(3.0)
    info = dict(system="vllm", dtype="float32", startup_s=30.0, compile_s=12.0, threads=2, vllm="0.x")
    fast = [Sample(1.0, {"token_ids": [[2, 0], [9, 9]]})]  # request 0 as vLLM's, request 1 not
    rows = [row, throughput.summarize("a", "fast-off", ours)]
    throughput._peer_rows(rows, {"vllm-fp32": info}, {"fast-off": fast, "vllm-fp32": theirs}, greedy=True)
    assert row["tokens_identical_to_fast_off"] == 0.5 and (row["startup_s"], row["compile_s"]) == (30.0, 12.0)
    assert "tokens_identical_to_fast_off" not in rows[1]
    throughput._vs_vllm(rows, {"fast-off": ours, "vllm-fp32": theirs})
    assert rows[1]["output_tps_vs_vllm"].median == pytest.approx(2.0)
    table = throughput._table("a", (2, 3, 3, 0.0), rows, 1, {}, None).render()
    assert "start-up 30 s, compilation 12 s of it, not counted" in table and "50% of requests" in table
    assert "2.00x fp32" in table


def test_greedy_tokens_that_differ_warn_and_do_not_fail(caplog):
    peers = {"vllm-fp32": {k: None for k in throughput.VLLM_ROW_KEYS}}
    row = {"system": "vllm-fp32"}
    samples = {
        "fast-off": [Sample(1.0, {"token_ids": [[1], [2]]})],
        "vllm-fp32": [Sample(1.0, {"token_ids": [[1], [3]]})],
    }
    with caplog.at_level(logging.WARNING, logger="bench.throughput"):
        throughput._peer_rows([row], peers, samples, greedy=True)
    assert row["tokens_identical_to_fast_off"] == 0.5 and "1 of 2 requests" in caplog.text
    sampled = {"system": "vllm-fp32"}
    throughput._peer_rows([sampled], peers, samples, greedy=False)
    assert "tokens_identical_to_fast_off" not in sampled


def test_bench_vllm_reads_its_rounds_from_the_same_worker_result():
    rounds = {m: ([(p, 1), (p, n)], [(p, 1), (p, n)]) for m, (p, n) in PLANS.items()}
    calls = vllm_worker.schedule(rounds, warmup=1, repeat=1)
    got = vllm_peer.rounds_of(_fake_result(calls), rounds, warmup=1, repeat=1)
    assert got["startup_s"] == 30.0 and len(got["mixes"]["a"]) == 1
    first = got["mixes"]["a"][0]  # calls 2 (prefill, 3 s) and 3 (full, 4 s)
    assert first["prefill_tok_s"] == pytest.approx(5 / 3) and first["output_tok_s"] == pytest.approx(6 / 4)


def test_bench_vllm_runs_on_a_stand_in_worker(monkeypatch, tmp_path, capsys):
    from bench.__main__ import build_parser

    def spawn(python, system, dtype, calls, cores, temperature=0.0):
        assert cores == vllm_worker.torch_cores() and len(calls) == 2 * (1 + 1)  # quick: 1 warm-up, 1 round
        return _fake_result(calls) | {"system": system, "dtype": dtype}

    monkeypatch.setattr(vllm_worker, "spawn", spawn)
    argv = ["vllm", "--quick", "--mixes", "issue4", "--systems", "vllm", "--dtypes", "float32"]
    args = build_parser().parse_args([*argv, "--repeat", "1", "--warmup", "1", "--out", str(tmp_path)])
    assert vllm_peer.run(args) == 0
    result = json.loads((tmp_path / "vllm.json").read_text())
    assert result["startup"] == [{"system": "vllm", "dtype": "float32", "startup_s": 30.0, "compile_s": 12.0}]
    assert result["results"][0]["output_x_vllm"] == 1.0 and "issue4" in capsys.readouterr().out


def _vllm_python() -> Path | None:
    python = Path(os.environ.get("BENCH_VLLM_PYTHON", vllm_worker.DEFAULT_PYTHON))
    return python if python.exists() else None


@pytest.mark.skipif(_vllm_python() is None, reason="no vLLM venv (.nox/vllm, or BENCH_VLLM_PYTHON)")
def test_vllm_fp32_end_to_end_gives_fast_offs_greedy_tokens():
    """The one check that starts vLLM: a compiled start-up, two to three minutes on 2 cores."""
    from bench import engine

    prompts, n = engine.random_prompts(2, 24, 49152, seed=1), 4
    with vllm_worker.Worker(_vllm_python(), "vllm", "float32", vllm_worker.torch_cores()) as worker:
        info = worker.info
        sample = worker.call(prompts, n)
    assert 0 < info["compile_s"] < info["startup_s"] and info["threads"] == len(vllm_worker.torch_cores())
    assert sample.metrics["output_tokens"] == 8 and len(sample.metrics["ttft_s"]) == 2
    ours = engine.run_batch(engine.build_llm(None), prompts, n)
    assert sample.metrics["token_ids"] == ours.token_ids
