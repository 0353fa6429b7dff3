"""kv_cache_dtype="bfloat16" on CPU: an fp32 model with a bf16 KV cache. It resolves and refuses as a
config field should, doubles the blocks a KV memory budget holds, and answers like the reference within
what rounding K and V to bf16 moves (the kernels' own exactness against the widened values is tested
in test_cpu_decode.py, test_cpu_prefill.py, test_cpu_ops.py and test_cpu_decode_stack.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS, random_prompts, reference_greedy
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.config import EngineConfig
from swiftkv_reference.testing import fp32_atol

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def test_resolves_to_a_torch_dtype():
    assert EngineConfig(device="cpu").kv_cache_dtype == torch.float32  # auto: the model's dtype
    assert EngineConfig(device="cpu", dtype="bf16").kv_cache_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", kv_cache_dtype="bf16").kv_cache_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", kv_cache_dtype=torch.bfloat16).kv_cache_dtype == torch.bfloat16
    assert EngineConfig(device="cpu", dtype="bf16", kv_cache_dtype="float32").kv_cache_dtype == torch.float32


@pytest.mark.parametrize("value", ["fp8", "float16", torch.float16, 16, None])
def test_bad_values_name_the_field(value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'bf16', 'bfloat16'"):
        LLM(model="/nonexistent/checkpoint", kv_cache_dtype=value)  # before any loading


def test_another_dtype_than_the_models_needs_the_torch_backend(monkeypatch):
    import swiftkv_fast.config as config

    monkeypatch.setattr(config, "interpreting", lambda: True)  # triton on CPU passes its own check
    with pytest.raises(ValueError, match=r"kv_cache_dtype='bfloat16' differs from dtype='float32'.*torch"):
        EngineConfig(device="cpu", attention_backend="triton", kv_cache_dtype="bfloat16")
    # the model's own dtype is no change: any backend
    assert EngineConfig(device="cpu", attention_backend="triton", kv_cache_dtype="float32").kv_cache_dtype


def test_same_memory_holds_twice_the_blocks(tiny):
    cfg, state, _ = tiny(**TINY_MODELS["swiftkv_g1"])
    runners = [
        LLM.from_state_dict(cfg, state, kv_cache_memory=1 << 20, block_size=16, kv_cache_dtype=d).llm_engine
        for d in ("auto", "bfloat16")
    ]
    fp32, bf16 = (e.runner.kv_cache for e in runners)
    assert (fp32.dtype, bf16.dtype) == (torch.float32, torch.bfloat16)
    assert bf16.shape[2] == 2 * fp32.shape[2] == runners[1].kv_manager.num_blocks
    assert bf16.nbytes == fp32.nbytes <= 1 << 20


@pytest.mark.parametrize("name", ["full", "swiftkv_g2", "hybrid_swiftkv"])
def test_answers_like_the_reference_within_bf16_rounding(tiny, name):
    cfg, state, model = tiny(**TINY_MODELS[name])
    llm = LLM.from_state_dict(
        cfg, state, return_logits=True, block_size=4, max_num_batched_tokens=64, kv_cache_dtype="bfloat16"
    )
    prompts = random_prompts(5, cfg.vocab_size, [1, 70, 17, 130, 33], seed=4)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    _check(model, prompts, outs, cfg.num_hidden_layers)
    # the same prompts again: their blocks, rounded once, are prefix hits
    again = [prompts[3], prompts[1]]
    outs = llm.generate(again, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in outs)
    _check(model, again, outs, cfg.num_hidden_layers)


def _check(model, prompts, outs, num_layers):
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        tokens, logits = reference_greedy(model, prompt, GREEDY.max_tokens)
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {i}"
        err = (got.logits - logits).abs().max().item()
        # K and V carry 8 significant bits (relative error <= 2^-9): the logits (spread ~1 here) move by
        # 5e-3 to 1.3e-2, a hundred times fp32's reassociation (fp32_atol)
        assert fp32_atol(logits, num_layers) < err <= 0.05, f"prompt {i}: max |logits diff| {err}"
