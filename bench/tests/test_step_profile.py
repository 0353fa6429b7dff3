"""`bench throughput --profile`: each step's time split into linear layers, attention, KV writes and the
rest, by timers that exist only inside the profiled run (no timing assertions here)."""

from __future__ import annotations

import json

import pytest
import torch

from bench import engine, step_profile
from bench.__main__ import main


def tiny_llm(num_key_value_layers=None, build=engine.build_llm, **kw):
    from swiftkv_reference.testing import random_state_dict, tiny_config

    config = tiny_config()  # 4 layers
    return build(
        num_key_value_layers,
        config=config,
        state_dict=random_state_dict(config),
        kv_cache_memory=1 << 20,
        **kw,
    )


def assert_shares(summary: dict, steps: int) -> None:
    assert summary["steps"] == steps and summary["step_ms"] > 0
    shares = [summary[f"{c}_share"] for c in step_profile.CATEGORIES]
    assert sum(shares) == pytest.approx(1.0) and all(s >= 0 for s in shares)
    # attention runs in the per-op layers, or inside the decode stack where it was measured faster
    assert summary["linear_share"] > 0 and summary["attention_share"] + summary["stack_share"] > 0


def test_profiled_steps_split_into_linear_attention_and_rest():
    from swiftkv_fast.model.layers import Linear

    # SwiftKV on: first-half attention, second-half decode, the fused K/V projection; a forced kernel
    # other than the panel GEMM keeps every decode step on the per-op path (no decode stack)
    llm = tiny_llm(2, linear_kernel="matmul")
    prompts = engine.random_prompts(3, 12, llm.config.vocab_size)
    plain = engine.run_batch(llm, prompts, 4).texts
    runner, model = engine.model_runner(llm), engine.swiftkv_model(llm)
    backend = model.backend
    with step_profile.profiled(llm) as prof:
        profiled = engine.run_batch(llm, prompts, 4).texts
    summary = prof.summary(wall_seconds=1e9)
    assert_shares(summary["all"], 4)  # one prefill step, then 3 decode steps
    assert_shares(summary["decode"], 3)
    assert 0 < summary["runner_share"] < 1
    # restored: the same engine objects, no timer left behind, and the same tokens
    assert profiled == plain
    assert model.backend is backend and "execute" not in vars(runner)
    for holder in [model.w, *model.w.layers]:
        assert not any(type(v).__name__ == "_TimedLinear" for v in vars(holder).values())
    assert isinstance(model.w.layers[0].qkv, Linear) and isinstance(model.w.kv_swiftkv, Linear)


def test_decode_stack_phases_count_in_linear_attention_and_kv_write():
    llm = tiny_llm(2, linear_kernel="panel")  # every linear the panel GEMM: decode rows run the stacks
    model = engine.swiftkv_model(llm)
    stacks = model.stacks
    prompts = engine.random_prompts(3, 12, llm.config.vocab_size)
    with step_profile.profiled(llm) as prof:
        engine.run_batch(llm, prompts, 4)
    decode = prof.summary()["decode"]
    if stacks[0] is None or not stacks[0].runs_at(3):
        pytest.skip("no decode stack here (no C compiler)")
    assert decode["steps"] == 3 and decode["stack_share"] >= 0
    # every layer of a decode step ran inside the stacks, which timed their phases
    assert decode["attention_share"] > 0 and decode["linear_share"] > 0 and decode["kv_write_share"] > 0
    assert model.stacks is stacks and stacks[0].calls == 3
    assert stacks[0].timings is None and stacks[1].timings is None  # handed back
    assert stacks[1].calls == 4  # and the prompt step's second half


def test_the_engine_is_restored_when_the_run_fails():
    llm = tiny_llm()
    model = engine.swiftkv_model(llm)
    backend, qkv = model.backend, model.w.layers[0].qkv
    with pytest.raises(RuntimeError, match="boom"), step_profile.profiled(llm):
        raise RuntimeError("boom")
    assert model.backend is backend and model.w.layers[0].qkv is qkv
    assert "execute" not in vars(engine.model_runner(llm))


def test_throughput_quick_profile_reports_shares(monkeypatch, tmp_path, capsys):
    from bench import throughput

    build = engine.build_llm
    monkeypatch.setattr(engine, "build_llm", lambda L=None, **kw: tiny_llm(L, build=build))
    monkeypatch.setattr(throughput, "plot", lambda rows, mixes, systems, out: out / "throughput.png")
    argv = ["throughput", "--quick", "--profile", "--systems", "fast-off,fast-on", "--mixes", "issue4"]
    assert main([*argv, "--warmup", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Step profile, mix issue4" in out and "fast-on (decode steps)" in out
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert data["settings"]["profile"] is True
    rows = {r["system"]: r for r in data["results"]}
    for system in ("fast-off", "fast-on"):
        prof = rows[system]["step_profile"]
        assert_shares(prof["all"], 8)  # quick issue4: 4 x 64 prompt tokens -> 8 tokens each
        assert_shares(prof["decode"], 7)


def test_throughput_kv_bf16_systems(monkeypatch, tmp_path, capsys):
    """fast-*-kv-bf16: the engine built with kv_cache_dtype='bfloat16', measured and profiled beside the
    fp32 one, and named as such in the table."""
    from bench import throughput

    build = engine.build_llm
    built = []

    def build_tiny(L=None, **kw):
        built.append((L, kw.get("kv_cache_dtype"), tiny_llm(L, build=build, **kw)))
        return built[-1][2]

    monkeypatch.setattr(engine, "build_llm", build_tiny)
    monkeypatch.setattr(throughput, "plot", lambda rows, mixes, systems, out: out / "throughput.png")
    systems = "fast-off,fast-on-kv-bf16"
    argv = ["throughput", "--quick", "--profile", "--systems", systems, "--mixes", "issue4"]
    assert main([*argv, "--warmup", "0", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "kv_cache_dtype='bfloat16'" in out and "fast-on-kv-bf16 (decode steps)" in out
    caches = {(L, dtype): llm.llm_engine.runner.kv_cache.dtype for L, dtype, llm in built}
    assert caches == {(None, None): torch.float32, (2, "bfloat16"): torch.bfloat16}
    rows = {r["system"]: r for r in json.loads((tmp_path / "throughput.json").read_text())["results"]}
    assert set(rows) == {"fast-off", "fast-on-kv-bf16"}
    assert_shares(rows["fast-on-kv-bf16"]["step_profile"]["decode"], 7)


def test_throughput_fp32_weights_systems(monkeypatch, tmp_path, capsys):
    """fast-*-fp32-weights: the engine built with SWIFTKV_DISABLED_KERNELS=gemm-4bit (no 4-bit layouts),
    measured beside the default one; the variable is restored after the build."""
    import os

    from bench import throughput

    build = engine.build_llm
    built = []

    def build_tiny(L=None, **kw):
        built.append((L, os.environ.get("SWIFTKV_DISABLED_KERNELS")))
        return tiny_llm(L, build=build, **kw)

    monkeypatch.delenv("SWIFTKV_DISABLED_KERNELS", raising=False)
    monkeypatch.setattr(engine, "build_llm", build_tiny)
    monkeypatch.setattr(throughput, "plot", lambda rows, mixes, systems, out: out / "throughput.png")
    argv = ["throughput", "--quick", "--systems", "fast-off,fast-on-fp32-weights", "--mixes", "issue4"]
    assert main([*argv, "--warmup", "0", "--out", str(tmp_path)]) == 0
    assert "*-fp32-weights" in capsys.readouterr().out
    assert sorted(built, key=str) == sorted([(None, None), (2, "gemm-4bit")], key=str)
    assert "SWIFTKV_DISABLED_KERNELS" not in os.environ
    rows = {r["system"]: r for r in json.loads((tmp_path / "throughput.json").read_text())["results"]}
    assert set(rows) == {"fast-off", "fast-on-fp32-weights"}


def test_throughput_quick_sampled(monkeypatch, tmp_path, capsys):
    """--temperature: the engine samples (seeded per request, so every round makes the same tokens),
    transformers gets do_sample at the same temperature with top-k / top-p off; a bad value is refused."""
    from bench import hf_baseline, throughput

    build = engine.build_llm
    llms = []

    def build_tiny(L=None, **kw):
        llms.append(tiny_llm(L, build=build))
        return llms[-1]

    monkeypatch.setattr(engine, "build_llm", build_tiny)
    monkeypatch.setattr(throughput, "plot", lambda rows, mixes, systems, out: out / "throughput.png")
    argv = ["throughput", "--quick", "--temperature", "0.7", "--systems", "fast-off", "--mixes", "issue4"]
    assert main([*argv, "--warmup", "0", "--out", str(tmp_path)]) == 0
    assert "sampled at temperature 0.7" in capsys.readouterr().out
    data = json.loads((tmp_path / "throughput.json").read_text())
    assert data["settings"]["temperature"] == 0.7
    llm, seen = llms[0], []
    generate = llm.generate
    monkeypatch.setattr(
        llm, "generate", lambda prompts, params, **kw: seen.append(params) or generate(prompts, params, **kw)
    )
    prompts = engine.random_prompts(4, 12, llm.config.vocab_size)
    engine.run_batch(llm, prompts, 6, temperature=5.0)
    assert [(p.temperature, p.seed, p.max_tokens, p.ignore_eos) for p in seen[-1]] == [
        (5.0, i, 6, True) for i in range(4)
    ]
    tokens = [[o.outputs[0].token_ids for o in generate(prompts, params)] for params in (seen[-1], seen[-1])]
    assert tokens[0] == tokens[1]  # seeded: the same tokens every round
    assert tokens[0] != [o.outputs[0].token_ids for o in generate(prompts, engine.greedy(6))]
    assert [p.seed for p in engine.sampled(3, 5, 0.7)] == [0, 1, 2]
    assert hf_baseline.sampling_kwargs(0.0) == {"do_sample": False}
    sampling = {"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}
    assert hf_baseline.sampling_kwargs(0.7) == sampling
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            main(["throughput", "--quick", "--temperature", bad, "--out", str(tmp_path)])


def test_exact_amx_kernels_are_told_from_the_others(monkeypatch):
    """The FMA-peak ceiling is left out where any exact-form AMX kernel runs (q4-amx, panel-amx,
    bf16-amx), kept where only FMA kernels (or bf16x3 at "high") do."""
    from bench import throughput

    def plans(*described):
        monkeypatch.setattr(engine, "linear_kernels", lambda: {"linear_kernels": dict(enumerate(described))})

    plans("matmul <= 8, panel <= 64, mkldnn above", "bf16x3")
    assert not throughput._exact_amx()
    for kernel in ("q4-amx", "panel-amx", "bf16-amx"):
        plans("matmul", f"panel <= 16, {kernel} above")
        assert throughput._exact_amx()
