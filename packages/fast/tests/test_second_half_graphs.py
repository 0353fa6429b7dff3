"""The second half behind CUDA graphs, wired into the engine: emulated replays through the real model
on CPU (bucketing, padding, fallback, per-group block tables), counters, enforce_eager, when graphs are
used; capture and replay on CUDA (skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS, random_prompts
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.attention import TorchBackend
from swiftkv_fast.worker.cuda_graph import graphs_disabled_reason
from swiftkv_reference.testing import fp32_atol

# two kvcache groups (full + sliding window), AcrossKV, L < N
HYBRID = TINY_MODELS["hybrid_swiftkv"]
ENGINE = dict(
    block_size=4,
    max_model_len=128,
    num_kv_blocks=200,
    max_num_seqs=6,
    max_num_batched_tokens=48,
    return_logits=True,
)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _generate(llm, prompts):
    return llm.generate(prompts, GREEDY, use_tqdm=False)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_emulated_replay_equals_eager_through_the_real_model(tiny, dtype):
    """bf16 too: the graphs' hidden buffer holds the fp32 residual stream as it is, not rounded."""
    cfg, state, _ = tiny(**HYBRID)
    prompts = random_prompts(6, cfg.vocab_size, [3, 40, 9, 1, 25, 60], seed=3)
    eager = LLM.from_state_dict(cfg, state, dtype=dtype, **ENGINE)
    graphs = LLM.from_state_dict(cfg, state, dtype=dtype, **ENGINE)
    runner = graphs.llm_engine.runner
    # buckets 1, 2, 4: steps with 5 or 6 sampled tokens fall back to eager
    runner.graphs = runner.make_graphs(emulate=True, sizes=[1, 2, 4])
    expected, actual = _generate(eager, prompts), _generate(graphs, prompts)
    for e, a in zip(expected, actual):
        assert a.outputs[0].token_ids == e.outputs[0].token_ids
        assert torch.equal(a.outputs[0].logits, e.outputs[0].logits)  # exact
    stats, eager_stats = graphs.get_stats(), eager.get_stats()
    assert stats["cuda_graph_enabled"] and stats["cuda_graph_capture_s"] is not None
    assert stats["cuda_graph_replays"] > 0 and stats["eager_second_half_steps"] > 0  # both paths taken
    assert not eager_stats["cuda_graph_enabled"] and eager_stats["cuda_graph_replays"] == 0
    total = eager_stats["eager_second_half_steps"]
    assert total > 0 and stats["cuda_graph_replays"] + stats["eager_second_half_steps"] == total


def test_emulated_padding_rows_do_not_change_real_rows(tiny):
    """second_half through the graph runner on a bucket larger than the step, against a direct call."""
    cfg, state, _ = tiny(**HYBRID)
    llm = LLM.from_state_dict(cfg, state, **ENGINE)
    runner = llm.llm_engine.runner
    _generate(llm, random_prompts(3, cfg.vocab_size, [30, 5, 50], seed=1))  # fill some blocks
    graphs = runner.make_graphs(emulate=True, sizes=[8])
    g = torch.Generator().manual_seed(0)
    n = 3
    h = torch.randn(n, cfg.hidden_size, generator=g)
    seq_lens = torch.tensor([30, 5, 50], dtype=torch.int32)
    tables = tuple(torch.randint(1, 200, (n, 13), generator=g, dtype=torch.int32) for _ in range(2))
    out = graphs.run(h, seq_lens.long() - 1, seq_lens, tables)
    assert out.shape == (n, cfg.vocab_size) and graphs.stats()["cuda_graph_replays"] == 1
    # the same rows padded by hand to the bucket (zeros, position 0, seq_len 0, null blocks, width 32)
    pad = 8 - n
    padded = runner.model.second_half(
        torch.cat([h, h.new_zeros(pad, h.shape[1])]),
        torch.cat([seq_lens.long() - 1, torch.zeros(pad, dtype=torch.long)]),
        torch.cat([seq_lens, torch.zeros(pad, dtype=torch.int32)]),
        tuple(torch.nn.functional.pad(t, (0, 32 - 13, 0, pad)) for t in tables),
        runner.kv_cache,
    )
    assert torch.equal(out, padded[:n])
    # unpadded: CPU BLAS picks kernels by row count (gemv for 1-2 rows), so only ulp-close in general
    direct = runner.model.second_half(h, seq_lens.long() - 1, seq_lens, tables, runner.kv_cache)
    torch.testing.assert_close(out, direct, rtol=0, atol=fp32_atol(direct, cfg.num_hidden_layers))


def test_cpu_and_enforce_eager_are_eager(tiny):
    cfg, state, _ = tiny(**HYBRID)
    llm = LLM.from_state_dict(cfg, state, **ENGINE)  # CPU: always eager
    stats = llm.get_stats()
    assert set(stats) >= {
        "cuda_graph_replays",
        "eager_second_half_steps",
        "cuda_graph_enabled",
        "cuda_graph_capture_s",
        "num_preemptions",
    }
    assert not stats["cuda_graph_enabled"]
    _generate(llm, [[5, 6, 7]])
    assert llm.get_stats()["eager_second_half_steps"] == GREEDY.max_tokens
    off = LLM.from_state_dict(cfg, state, enforce_eager=True, **ENGINE)
    runner = off.llm_engine.runner
    runner.graphs = runner.make_graphs(emulate=True)  # even emulated, enforce_eager wins
    assert runner.graphs.disabled_reason == "enforce_eager=True"
    _generate(off, [[5, 6, 7]])
    assert off.get_stats()["cuda_graph_replays"] == 0
    assert off.get_stats()["eager_second_half_steps"] == GREEDY.max_tokens


class _Capturable:
    name, supports_cuda_graph = "triton", True


def test_when_graphs_are_used():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert graphs_disabled_reason(cuda, False, _Capturable()) is None
    assert "enforce_eager" in graphs_disabled_reason(cuda, True, _Capturable())
    assert "CUDA" in graphs_disabled_reason(cpu, False, _Capturable())
    assert "'torch'" in graphs_disabled_reason(cuda, False, TorchBackend())
    # emulated replays need neither CUDA nor a capturable backend; enforce_eager still wins
    assert graphs_disabled_reason(cpu, False, TorchBackend(), emulate=True) is None
    assert graphs_disabled_reason(cpu, True, TorchBackend(), emulate=True) == "enforce_eager=True"


@pytest.mark.parametrize(
    "make",
    [
        lambda: LLM(attention_backend="flash_attn", block_size=16),
        lambda: LLM.from_state_dict(None, None, attention_backend="flash_attn", block_size=128),
    ],
)
def test_flash_block_size_is_a_clear_error_at_construction(make):
    with pytest.raises(ValueError, match=r"flash_attn.*multiple of 256.*got (16|128)"):
        make()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["triton", "flash_attn"])
def test_cuda_graph_replay_matches_eager(tiny, backend):
    if backend == "flash_attn":
        from swiftkv_fast.attention.flash_backend import flash_attn_available

        if not flash_attn_available():
            pytest.skip("flash-attn is not installed")
    cfg, state, _ = tiny(**HYBRID)
    kw = dict(ENGINE, device="cuda", dtype="float32", attention_backend=backend)
    if backend == "flash_attn":
        kw.update(block_size=256, max_model_len=512, num_kv_blocks=40)
    prompts = random_prompts(6, cfg.vocab_size, [3, 40, 9, 1, 25, 60], seed=3)
    eager = LLM.from_state_dict(cfg, state, enforce_eager=True, **kw)
    graphs = LLM.from_state_dict(cfg, state, **kw)
    expected, actual = _generate(eager, prompts), _generate(graphs, prompts)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a.outputs[0].logits, e.outputs[0].logits, rtol=1e-4, atol=1e-4)
    stats = graphs.get_stats()
    assert stats["cuda_graph_enabled"] and stats["cuda_graph_replays"] > 0
    assert stats["eager_second_half_steps"] == 0
    assert eager.get_stats()["cuda_graph_replays"] == 0


def test_capture_failure_falls_back_to_eager(tiny):
    cfg, state, _ = tiny(**HYBRID)
    llm = LLM.from_state_dict(cfg, state, **ENGINE)
    runner = llm.llm_engine.runner
    runner.graphs = runner.make_graphs(emulate=True, sizes=[1, 2])

    def broken():
        raise RuntimeError("capture broke")

    runner.graphs._capture_graphs = broken
    out = _generate(llm, [[5, 6, 7]])
    assert len(out[0].outputs[0].token_ids) == GREEDY.max_tokens
    stats = llm.get_stats()
    assert not stats["cuda_graph_enabled"] and stats["cuda_graph_replays"] == 0
    assert stats["eager_second_half_steps"] == GREEDY.max_tokens
    assert "capture broke" in runner.graphs.disabled_reason
