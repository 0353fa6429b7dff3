"""The GEMM floor replays exactly the engine's linear layers for a workload (no timing here)."""

from __future__ import annotations

import pytest

from bench import engine, gemm_floor


def test_prompt_chunks_pack_prompts_into_the_token_budget():
    assert gemm_floor.prompt_chunks([256] * 16, 4096) == [4096]
    assert gemm_floor.prompt_chunks([5, 7], 8) == [8, 4]
    assert gemm_floor.prompt_chunks([3], 8) == [3]


@pytest.mark.parametrize("num_key_value_layers", [None, 2])
def test_floor_runs_the_engine_linears_of_the_schedule(monkeypatch, num_key_value_layers):
    from swiftkv_fast.model.layers import Linear
    from swiftkv_reference.testing import random_state_dict, tiny_config

    config = tiny_config()  # 4 layers
    llm = engine.build_llm(
        num_key_value_layers,
        config=config,
        state_dict=random_state_dict(config),
        max_num_batched_tokens=8,
    )
    calls = []
    original = Linear.__call__
    monkeypatch.setattr(Linear, "__call__", lambda self, x: calls.append(x.shape[0]) or original(self, x))
    result = gemm_floor.run(llm, [[3] * 5, [4] * 7], output_len=3)
    assert (result.prompt_tokens, result.output_tokens) == (12, 6)
    n, L = 4, num_key_value_layers or 4
    swiftkv = [] if L == n else [None]  # the fused K/V projection of layers >= L
    expected = []
    for m in (8, 4):  # prefill chunks: layers < L and the fused K/V projection
        expected += [m] * (4 * L + len(swiftkv))
    expected += [2] * (4 * (n - L) + 1)  # the first token: second half and lm_head, 2 sampled rows
    for _ in range(2):  # decode steps
        expected += [2] * (4 * L + len(swiftkv) + 4 * (n - L) + 1)
    assert calls == expected
    assert gemm_floor.workload_flops(llm, [[3] * 5, [4] * 7], output_len=3) > 0
    assert len(calls) == len(expected)  # counting runs no linear


@pytest.mark.parametrize("num_key_value_layers", [None, 2])
def test_workload_flops_are_two_per_multiply_add_of_every_replayed_call(num_key_value_layers):
    from swiftkv_reference.testing import random_state_dict, tiny_config

    config = tiny_config()
    llm = engine.build_llm(
        num_key_value_layers, config=config, state_dict=random_state_dict(config), max_num_batched_tokens=8
    )
    shapes = []
    record = lambda lin, m: shapes.append((m, lin.in_features, lin.out_features))  # noqa: E731
    gemm_floor._replay(llm, [[3] * 5, [4] * 7], 3, record)
    assert gemm_floor.workload_flops(llm, [[3] * 5, [4] * 7], 3) == sum(2 * m * i * o for m, i, o in shapes)
    h, inter, v = config.hidden_size, config.intermediate_size, config.vocab_size
    assert (2, h, v) in shapes  # lm_head on the sampled rows
    assert (8, h, 2 * inter) in shapes  # gate_up on a prefill chunk


def test_peak_gflops_measures_every_kernel_that_runs_here():
    from swiftkv_fast.kernels.linear_kernels import KERNELS

    rates = gemm_floor.peak_gflops(size=64, repeats=1)
    assert rates and set(rates) <= set(KERNELS) and "linear" in rates
    assert all(r > 0 for r in rates.values())


def test_peak_and_engine_follow_torch_matmul_precision(monkeypatch):
    """bf16x3 (a stand-in, so this runs on any CPU) counts in the peak only at "high", the precision the
    engines of this process are built at too."""
    import torch
    import torch.nn.functional as F
    from swiftkv_fast.kernels import linear_kernels as lk

    monkeypatch.setitem(lk.KERNELS, "bf16x3", lk.LinearKernel("bf16x3", lambda w: w, F.linear, "high"))
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")  # not the engine's: strict fp32 there
        assert engine.matmul_precision() == "highest"
        torch.set_float32_matmul_precision("highest")
        assert engine.matmul_precision() == "highest"
        assert "bf16x3" not in gemm_floor.peak_gflops(size=32, repeats=1)
        torch.set_float32_matmul_precision("high")
        assert engine.matmul_precision() == "high"
        assert "bf16x3" in gemm_floor.peak_gflops(size=32, repeats=1)
    finally:
        torch.set_float32_matmul_precision(before)


def test_fma_peak_is_a_rate_and_none_without_a_compiler(monkeypatch):
    from swiftkv_fast.kernels import build

    if build.compiler() is None:
        pytest.skip("no C compiler")
    assert gemm_floor.fma_peak_gflops(seconds=0.01, repeats=1) > 0
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setenv("CC", "false")
    assert gemm_floor.fma_peak_gflops(seconds=0.01, repeats=1) is None
