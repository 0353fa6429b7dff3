"""Greedy tokens and fp32 logits at sampled positions equal the reference's, under every scheduling
choice: block sizes 1/16, chunk budgets smaller than a prompt, prefix hits, preemption."""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_MODELS, random_prompts, reference_greedy
from swiftkv_fast import LLM, SamplingParams
from swiftkv_reference.testing import fp32_atol

MAX_TOKENS = 5
LENGTHS = [1, 300, 17, 64, 129, 2, 250]

# (model, engine kwargs)
CASES = [
    ("full", dict(block_size=16)),
    ("full", dict(block_size=1, max_num_batched_tokens=64)),
    ("swiftkv_g1", dict(block_size=16, max_num_batched_tokens=100)),
    ("swiftkv_g2", dict(block_size=1, max_num_batched_tokens=37)),
    ("swiftkv_g2", dict(block_size=16, max_num_batched_tokens=4096)),
    ("mistral_window", dict(block_size=16, max_num_batched_tokens=50)),
    ("mistral_swiftkv_g2", dict(block_size=1, max_num_batched_tokens=90)),
    ("hybrid", dict(block_size=16, max_num_batched_tokens=70)),
    ("hybrid_swiftkv", dict(block_size=4, max_num_batched_tokens=128)),
    # forced preemption: a cache that holds about two long requests
    ("swiftkv_g2", dict(block_size=4, num_kv_blocks=120, max_model_len=320, max_num_batched_tokens=64)),
    ("hybrid_swiftkv", dict(block_size=4, num_kv_blocks=125, max_model_len=320, max_num_batched_tokens=80)),
    # every linear layer through the compiled panel GEMM (kernels/cpu_gemm.py), whatever the timings say
    ("swiftkv_g2", dict(block_size=16, max_num_batched_tokens=100, linear_kernel="panel")),
]


def _check(llm, model, prompts, outs):
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        tokens, logits = reference_greedy(model, prompt, MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == tokens, f"prompt {i} (len {len(prompt)})"
        err = (got.logits - logits).abs().max().item()
        atol = fp32_atol(logits, model.config.num_hidden_layers)
        assert err <= atol, f"prompt {i} (len {len(prompt)}): max |logits diff| {err} > {atol}"


@pytest.mark.parametrize("name,engine_kwargs", CASES, ids=[f"{m}-{i}" for i, (m, _) in enumerate(CASES)])
def test_greedy_matches_reference(tiny, name, engine_kwargs):
    cfg, state, model = tiny(**TINY_MODELS[name])
    llm = LLM.from_state_dict(cfg, state, return_logits=True, **engine_kwargs)
    prompts = random_prompts(6, cfg.vocab_size, LENGTHS, seed=sum(map(ord, name)))
    prompts.append(list(prompts[1]))  # a repeated prompt in the same batch
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    _check(llm, model, prompts, outs)
    if "num_kv_blocks" in engine_kwargs:
        assert llm.llm_engine.scheduler.num_preemptions > 0, "the case should preempt"
    # the same prompts again: prefix hits from the first call
    again = [prompts[1], prompts[4]]
    outs2 = llm.generate(again, params, use_tqdm=False)
    _check(llm, model, again, outs2)
    assert outs2[0].num_cached_tokens > 0
    assert llm.llm_engine.kv_manager.num_requests == 0


def test_teacher_path_of_swiftkv_checkpoint(tiny):
    """num_key_value_layers=N on a SwiftKV checkpoint runs the original layers (== plain model)."""
    cfg, state, _ = tiny(**TINY_MODELS["swiftkv_g1"])
    plain_cfg = cfg.replace(model_type="llama", num_key_value_layers=4, key_value_group_size=1)
    plain_state = {k: v for k, v in state.items() if "swiftkv" not in k}
    prompts = random_prompts(3, cfg.vocab_size, [5, 40, 90])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    a = LLM.from_state_dict(cfg, state, num_key_value_layers=4).generate(prompts, params, use_tqdm=False)
    b = LLM.from_state_dict(plain_cfg, plain_state).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_training_switch_off_still_serves_swiftkv(tiny):
    """Snowflake's trainer saves `swiftkv: false` (its runtime switch); serving runs SwiftKV anyway."""
    cfg, state, model = tiny(**TINY_MODELS["swiftkv_g1"])
    prompts = random_prompts(2, cfg.vocab_size, [9, 60])
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm = LLM.from_state_dict(cfg.replace(swiftkv=False), state)
    assert llm.config.num_key_value_layers == 2 and llm.config.swiftkv
    for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        assert o.outputs[0].token_ids == reference_greedy(model, p, 4)[0]


def test_on_the_fly_conversion_matches_converted_reference(tiny):
    from swiftkv_reference.checkpoint import swiftkv_init
    from swiftkv_reference.model import SwiftKVForCausalLM

    cfg, state, _ = tiny(**TINY_MODELS["full"])
    new_cfg, new_state = swiftkv_init(cfg, state, 2, 2)
    ref = SwiftKVForCausalLM(new_cfg)
    ref.load_state_dict(new_state)
    ref.eval()
    llm = LLM.from_state_dict(cfg, state, num_key_value_layers=2, key_value_group_size=2)
    assert llm.config.num_cache_layers == 3
    prompts = random_prompts(2, cfg.vocab_size, [33, 70])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference_greedy(ref, p, 4)[0]


def test_kv_memory_acrosskv(tiny):
    cfg, state, _ = tiny(**TINY_MODELS["swiftkv_g2"])
    llm = LLM.from_state_dict(cfg, state, num_kv_blocks=10, block_size=16, max_model_len=128)
    kv = llm.llm_engine.runner.kv_cache
    assert tuple(kv.shape) == (3, 2, 10, 16, cfg.num_key_value_heads, cfg.head_dim)
    torch.testing.assert_close(kv, torch.zeros_like(kv))


@pytest.mark.parametrize("name", ["swiftkv_g2", "hybrid_swiftkv"])
def test_portable_ops_match_reference(tiny, name):
    """The torch code of every op the C kernels replace on CPU (the path CUDA and compiler-less
    machines run): RMSNorm + residual, SiLU-and-mul, RoPE, the KV write, decode and prompt attention,
    and the linear layers without the panel GEMM."""
    cfg, state, model = tiny(**TINY_MODELS[name])
    llm = LLM.from_state_dict(
        cfg,
        state,
        return_logits=True,
        block_size=4,
        max_num_batched_tokens=90,
        disabled_kernels="ops,decode,prefill,gemm",
    )
    ops = llm.get_kernel_plan()["ops"]
    for op in ("row ops", "decode attention", "prefill attention"):
        assert not ops[op]["implementation"].startswith("C"), (op, ops[op])
    assert ops["decode stack"]["implementation"].startswith("none")
    prompts = random_prompts(4, cfg.vocab_size, LENGTHS[:4], seed=7)
    outs = llm.generate(
        prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True), use_tqdm=False
    )
    _check(llm, model, prompts, outs)
