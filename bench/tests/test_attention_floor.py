"""Attention's irreducible work of a workload (bench/attention_floor.py), counted against brute force;
and the throughput table's floor with it, on a tiny model."""

from __future__ import annotations

import json

import pytest
from swiftkv_reference.testing import random_state_dict, tiny_config

from bench import attention_floor, engine


def _llm(L=None, **overrides):
    config = tiny_config(**overrides)
    return engine.build_llm(L, config=config, state_dict=random_state_dict(config), kv_cache_memory=1 << 20)


def _brute(llm, prompts, output_len, element_bytes):
    """Every decode step, every request, every cache layer, every position it reads; every prompt
    query against every key it sees, in every layer prompt tokens run."""
    c, L = llm.config, engine.swiftkv_model(llm).L
    kv = flops = 0
    for prompt in prompts:
        for j in range(1, output_len):
            for layer in range(c.num_cache_layers):
                w = c.cache_window(layer)
                kv += sum(1 for p in range(len(prompt) + j) if w is None or p >= len(prompt) + j - w)
        for layer in range(L):
            w = c.window(layer)
            for q in range(len(prompt)):
                flops += sum(1 for k in range(q + 1) if w is None or k > q - w)
    kv *= 2 * c.num_key_value_heads * c.head_dim * element_bytes
    return kv, flops * 4 * c.head_dim * c.num_attention_heads


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        dict(model_type="llama_swiftkv", num_key_value_layers=2, key_value_group_size=2),
        dict(model_type="mistral_swiftkv", sliding_window=6, num_key_value_layers=2),
    ],
    ids=["full", "acrosskv", "window"],
)
def test_counts_equal_brute_force(overrides):
    llm = _llm(None, num_hidden_layers=4, **overrides)
    prompts, output_len = [[3] * 5, [4] * 11, [5]], 4
    for element_bytes in (4, 2):
        kv, flops = _brute(llm, prompts, output_len, element_bytes)
        assert attention_floor.kv_read_bytes(llm, prompts, output_len, element_bytes) == kv
        assert attention_floor.prompt_attention_flops(llm, prompts) == flops
    # at rates that make each part one second (kv and flops: the last loop's, 2 bytes a value)
    floor = attention_floor.floor_seconds(
        2.0, llm, prompts, output_len, element_bytes=2, gbps=kv / 1e9, fma_gflops=flops / 1e9
    )
    assert floor["kv_read_seconds"] == pytest.approx(1.0)
    assert floor["prompt_attention_seconds"] == pytest.approx(1.0)
    assert floor["seconds"] == pytest.approx(4.0)


def test_read_rate_is_a_rate():
    assert 0.1 < attention_floor.read_gbps(nbytes=16 << 20, repeats=2) < 10_000


def test_throughput_table_adds_attention_to_the_floor(monkeypatch, tmp_path, capsys):
    from bench import gemm_floor, hf_baseline, throughput
    from bench.__main__ import main

    build = engine.build_llm
    monkeypatch.setattr(engine, "build_llm", lambda L=None, **kw: _llm(L) if not kw else build(L, **kw))
    monkeypatch.setattr(throughput, "plot", lambda rows, mixes, systems, out: out / "throughput.png")
    monkeypatch.setattr(hf_baseline, "load_model", lambda path: None)
    monkeypatch.setattr(
        hf_baseline, "generate", lambda model, p, n, temperature=0.0: gemm_floor.run(_llm(), p, n)
    )
    monkeypatch.setattr(gemm_floor, "fma_peak_gflops", lambda: 100.0)
    monkeypatch.setattr(attention_floor, "read_gbps", lambda: 10.0)
    argv = ["throughput", "--quick", "--systems", "fast-off,hf-generate,gemm-floor-off", "--mixes", "issue4"]
    assert main([*argv, "--repeat", "1", "--warmup", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "gemm-floor-off + attention's irreducible work" in out and "fast-off at" in out
    rows = {r["system"]: r for r in json.loads((tmp_path / "throughput.json").read_text())["results"]}
    floor = rows["gemm-floor-off"]["attention_floor"]
    assert (floor["read_gbps"], floor["fma_peak_gflops"]) == (10.0, 100.0)
    assert floor["bf16"]["kv_read_bytes"] * 2 == floor["fp32"]["kv_read_bytes"] > 0
    assert floor["fp32"]["seconds"] > floor["bf16"]["seconds"] > floor["fp32"]["prompt_attention_seconds"]
    gemm_seconds = rows["gemm-floor-off"]["elapsed_time"]["median"]  # one round: the floor's own time
    for kv in ("fp32", "bf16"):
        bound = floor[kv]["most_of_gemm_floor"]
        assert bound == pytest.approx(gemm_seconds / floor[kv]["seconds"]) and 0 < bound < 1
        assert f"no engine passes {100 * bound:.0f}% of gemm-floor-off" in out
