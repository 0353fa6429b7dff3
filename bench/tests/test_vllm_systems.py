"""`throughput`'s vllm-* systems and the worker they share with `bench vllm` (bench/vllm_worker.py):
skipped with their reason without a vLLM venv, the worker's environment, its calls scheduled and read
back into the rows our systems get, the greedy-token check. Without vLLM; the end-to-end check at the
end runs only where a vLLM venv is (`.nox/vllm`, or the Python named by BENCH_VLLM_PYTHON)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest

from bench import throughput, vllm_peer, vllm_worker
from bench.engine import BatchResult
from bench.harness import Sample

PLANS = {"a": ([[5, 6, 7], [8, 9]], 3), "b": ([[1] * 20], 2)}


def test_skipped_with_its_reason_where_the_vllm_python_is_missing(tmp_path):
    missing = tmp_path / "no-venv" / "bin" / "python"
    peers, skipped = throughput.vllm_runs(["fast-off", "vllm-fp32", "vllm-bf16"], missing, PLANS, 1, 1, 0.0)
    assert peers == {} and set(skipped) == {"vllm-fp32", "vllm-bf16"}
    assert str(missing) in skipped["vllm-fp32"] and "--vllm-python" in skipped["vllm-fp32"]
    assert throughput.vllm_runs(["fast-off"], missing, PLANS, 1, 1, 0.0) == ({}, {})


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


def test_a_worker_result_becomes_the_rows_our_systems_get():
    rounds = {m: ([throughput.stand_in(p)], [(p, n)]) for m, (p, n) in PLANS.items()}
    calls = vllm_worker.schedule(rounds, warmup=1, repeat=2)
    assert calls[0] == ([[5, 6, 7][:16], [8, 9]], 2) and calls[1] == calls[2] == PLANS["a"]
    assert len(calls) == 6 and calls[4] == calls[5] == PLANS["b"]
    samples = throughput.vllm_samples(_fake_result(calls), rounds, warmup=1, repeat=2)
    assert [s.seconds for s in samples["a"]] == [2.0, 3.0] and [s.seconds for s in samples["b"]] == [5.0, 6.0]
    row = throughput.summarize("a", "vllm-fp32", samples["a"])
    ours = [Sample(1.0, BatchResult(5, 6, [0.01, 0.01], [0.002, 0.002]).metrics())]
    assert set(row) == set(throughput.summarize("a", "fast-off", ours))
    assert row["num_requests"] == 2 and row["total_output_tokens"] == 6
    assert row["output_tokens_per_second"].median == pytest.approx((6 / 2 + 6 / 3) / 2)  # rounds of 2 s, 3 s

    peers = {"vllm-fp32": _fake_result(calls) | {"samples": samples}}
    fast = [Sample(1.0, {"token_ids": [[2, 0], [9, 9]]})]  # request 0 as vLLM's last round, request 1 not
    rows = [row, throughput.summarize("a", "fast-off", ours)]
    throughput._peer_rows(rows, peers, {"fast-off": fast, "vllm-fp32": samples["a"]}, greedy=True)
    assert row["tokens_identical_to_fast_off"] == 0.5 and (row["startup_s"], row["compile_s"]) == (30.0, 12.0)
    assert "tokens_identical_to_fast_off" not in rows[1]
    table = throughput._table("a", (2, 3, 3, 0.0), rows, 2, {}, None).render()
    assert "start-up 30 s, compilation 12 s of it, not counted" in table and "50% of requests" in table


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

    plans = {"tiny": (engine.random_prompts(2, 24, 49152, seed=1), 4)}
    peers, skipped = throughput.vllm_runs(["vllm-fp32"], _vllm_python(), plans, 1, 0, 0.0)
    assert skipped == {}
    peer = peers["vllm-fp32"]
    assert 0 < peer["compile_s"] < peer["startup_s"] and peer["threads"] == len(vllm_worker.torch_cores())
    [sample] = peer["samples"]["tiny"]
    assert sample.metrics["output_tokens"] == 8 and len(sample.metrics["ttft_s"]) == 2
    ours = engine.run_batch(engine.build_llm(None), *plans["tiny"])
    assert sample.metrics["token_ids"] == ours.token_ids
