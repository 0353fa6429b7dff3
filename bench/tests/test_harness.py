"""Fast checks of the benchmark machinery: statistics, pairing, output format, FLOP and memory formulas.
No timing assertions: nothing here depends on how fast the machine is."""

from __future__ import annotations

import json

import pytest

from bench import flops, harness, report
from bench.memory import formula_bytes_per_token, splits
from bench.throughput import MIXES, _percentiles, mix_prompts

SMOLLM2 = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    vocab_size=49152,
    num_hidden_layers=30,
)


def test_stats_median_spread_and_quartiles():
    s = harness.Stats.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.median, s.min, s.max, s.n) == (3.0, 1.0, 5.0, 5)
    assert (s.q1, s.q3, s.iqr) == (2.0, 4.0, 2.0)
    one = harness.Stats.of([7.0])
    assert (one.median, one.min, one.max, one.q1, one.q3) == (7.0,) * 5
    assert one.fmt() == "7.0" and s.fmt() == "3.0 [1.0-5.0]"
    with pytest.raises(ValueError):
        harness.Stats.of([])


def test_paired_ratio_divides_round_by_round():
    # a drifting machine: B is always 2x A in its own round, although the medians alone would say 2.5x
    a = [10.0, 20.0, 40.0]
    b = [20.0, 40.0, 80.0]
    r = harness.paired_ratio(b, a)
    assert (r.median, r.min, r.max) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError):
        harness.paired_ratio([1.0], [1.0, 2.0])


def test_run_interleaved_order_warmup_and_metrics():
    calls = []
    cases = {name: (lambda n=name: calls.append(n) or {"x": len(calls)}) for name in "AB"}
    warm = {"A": lambda: calls.append("a")}
    samples = harness.run_interleaved(cases, repeat=3, warmup=1, warmup_cases=warm)
    assert calls == ["a", "B", "A", "B", "A", "B", "A", "B"]
    assert [len(v) for v in samples.values()] == [3, 3]
    assert harness.metric(samples["A"], "x") == [3, 5, 7]
    assert all(s.seconds >= 0 for s in samples["B"])
    with pytest.raises(ValueError):
        harness.run_interleaved(cases, repeat=0)


def test_json_has_settings_machine_and_results(tmp_path):
    stats = harness.Stats.of([1.0, 2.0, 3.0])
    path = report.write_json(tmp_path, "unit", {"n": 1}, [{"tps": stats, "nan": float("nan")}], extra=[1])
    data = json.loads(path.read_text())
    assert set(data) == {"benchmark", "settings", "machine", "results", "extra"}
    assert data["benchmark"] == "unit" and data["settings"] == {"n": 1}
    for key in ("cpu_count", "torch", "device", "date", "torch_threads"):
        assert key in data["machine"]
    assert data["results"][0]["tps"]["median"] == 2.0 and data["results"][0]["nan"] is None


def test_table_renders_aligned_rows():
    t = report.Table("title", ["a", "bb"])
    t.add("x", harness.Stats.of([1.0, 3.0]))
    t.add(12345, 0.5)
    text = t.render()
    assert "2.0 [1.0-3.0]" in text and "12,345" in text
    lines = text.splitlines()
    assert len({len(line) for line in lines[1:-1]}) == 1
    with pytest.raises(ValueError):
        t.add("only one cell")


def test_flop_limit_full_is_one_and_half_is_about_1_9():
    assert flops.speedup_limit(SMOLLM2, 2048, 30) == 1.0
    half = flops.speedup_limit(SMOLLM2, 2048, 15)
    assert 1.85 < half < 1.95
    # fewer first-half layers, higher limit; AcrossKV saves a little more K/V projection work
    assert flops.speedup_limit(SMOLLM2, 2048, 22) < half < flops.speedup_limit(SMOLLM2, 2048, 10)
    assert flops.speedup_limit(SMOLLM2, 2048, 15, key_value_group_size=3) > half
    with pytest.raises(ValueError):
        flops.prefill_flops(SMOLLM2, 16, 15, key_value_group_size=4)


def test_flop_count_by_hand_for_one_token_one_layer():
    cfg = dict(
        hidden_size=2,
        intermediate_size=3,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=2,
        vocab_size=5,
        num_hidden_layers=1,
    )
    # q, k, v, o: 4 * 2*2*2 = 32; MLP 3 * 2*2*3 = 36; attention 4*1*2*1 = 8; lm_head 2*2*5 = 20
    assert flops.prefill_flops(cfg, 1) == 32 + 36 + 8 + 20


def test_memory_formula_and_splits():
    assert formula_bytes_per_token(30, 30, 1, 3, 64, 4) == 46080
    assert formula_bytes_per_token(30, 15, 3, 3, 64, 4) == 30720
    for L, G in splits(30, quick=False):
        assert (30 - L) % G == 0


def test_throughput_mixes_and_percentiles():
    prompts, out_len = mix_prompts(MIXES["prefill-heavy"], 1000, seed=0)
    assert len(prompts) == 16 and out_len == 64
    assert all(480 <= len(p) <= 800 for p in prompts)
    assert len({tuple(p[:8]) for p in prompts}) == 16  # distinct: no prefix-cache sharing
    assert mix_prompts(MIXES["issue4"], 1000, seed=0)[0][0].__len__() == 256
    p = _percentiles([0.001 * i for i in range(1, 101)], "ttft")
    assert p["median_ttft_ms"] == pytest.approx(50.5) and p["p99_ttft_ms"] == pytest.approx(99.0)
    assert _percentiles([], "tpot")["mean_tpot_ms"] is None


def test_cli_parses_every_benchmark():
    from bench.__main__ import BENCHMARKS, build_parser

    parser = build_parser()
    for name in [*BENCHMARKS, "all"]:
        args = parser.parse_args([name, "--quick"])
        assert args.name == name and args.quick


def test_gpu_benchmark_runs_on_cpu_with_tiny_shapes():
    """The CUDA benchmark's case logic, on CPU with a tiny random model (no timing checked)."""
    import argparse

    pytest.importorskip("swiftkv_fast")
    from bench import gpu

    shapes = dict(
        gpu.LLAMA8B_SHAPES,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    )
    args = argparse.Namespace(device="cpu", shapes=shapes, layers=2, kv_cache_gib=0.01, seed=0)
    rows = gpu._model("llama8b-shaped", args, prefill=(2, 16), decode=(2, 4, 3), repeat=1, warmup=0)
    assert [r["case"] for r in rows] == [
        "prefill off",
        "prefill on",
        "decode off",
        "decode on",
        "decode on-eager",
    ]
    assert [r["num_key_value_layers"] for r in rows] == [2, 1, 2, 1, 1]
    assert rows[1]["ratio"].n == 1 and rows[3]["ratio"].n == 1
