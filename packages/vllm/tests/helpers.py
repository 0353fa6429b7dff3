"""Tiny SwiftKV checkpoints written by the reference, engines built on them, and the comparison.

path, config, state = write_checkpoint(tmp_path, model_type="llama_swiftkv", num_key_value_layers=2)
with engine(path, kv_sharing_fast_prefill=True) as llm:
    assert_matches_reference(config, state, generate(llm, PROMPTS, 6), PROMPTS, 6)
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from pathlib import Path

import torch
from swiftkv_reference import SamplingSettings, SwiftKVForCausalLM
from swiftkv_reference.checkpoint import save_checkpoint
from swiftkv_reference.generate import generate as reference_generate
from swiftkv_reference.testing import random_state_dict, tiny_config

# fp32 logprobs of the same math in another summation order differ by ~1e-6; a wrong mask, RoPE offset or
# cache by O(0.1). The conformance suite's fp32 rule for logits.
LOGPROB_ATOL = 1e-4
# longer than the sliding windows below and several blocks of 16, so windows, chunking and hits all apply
PROMPTS = [
    [(7 * i + 3) % 120 + 3 for i in range(45)],
    [5, 6, 7],
    [(11 * i + 1) % 100 + 3 for i in range(20)],
]


MAX_TOKENS = 6
# one of each SwiftKV shape the plugin serves (head_dim 32 from tiny_config)
MODELS = {
    "llama-L2-G1": dict(model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2),
    "llama-L2-G2": dict(
        model_type="llama_swiftkv", num_hidden_layers=6, num_key_value_layers=2, key_value_group_size=2
    ),
    "llama-L1-G2": dict(
        model_type="llama_swiftkv", num_hidden_layers=3, num_key_value_layers=1, key_value_group_size=2
    ),
    "mistral-window-G2": dict(
        model_type="mistral_swiftkv",
        num_hidden_layers=4,
        num_key_value_layers=2,
        key_value_group_size=2,
        sliding_window=8,
    ),
    # full layers 0-1, sliding layers 2-3 (one AcrossKV group), q/k/v biases
    "qwen2-hybrid-G2": dict(
        model_type="qwen2_swiftkv",
        num_hidden_layers=4,
        num_key_value_layers=2,
        key_value_group_size=2,
        sliding_window=8,
        layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2,
    ),
    "llama-L-equals-N": dict(model_type="llama_swiftkv", num_hidden_layers=3),
}


def write_checkpoint(directory: Path, seed: int = 0, **overrides):
    """A tiny random model (head_dim 32: vLLM's CPU attention needs >= 32) as a checkpoint directory."""
    config = tiny_config(**overrides)
    state = random_state_dict(config, seed=seed)
    save_checkpoint(directory, config, state)
    return directory, config, state


@contextmanager
def engine(path: Path, **kwargs):
    """`vllm.LLM` on a checkpoint in fp32, eager unless `enforce_eager=False`; freed on exit."""
    from vllm import LLM
    from vllm.distributed import cleanup_dist_env_and_memory

    options = dict(skip_tokenizer_init=True, dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    llm = LLM(str(path), **(options | kwargs))
    try:
        yield llm
    finally:
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def generate(llm, prompts: list[list[int]], max_tokens: int):
    """Greedy, fixed lengths: [(token ids, logprob of each chosen token, cached prompt tokens)]."""
    from vllm import SamplingParams

    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=1, detokenize=False
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    results = []
    for out in outs:
        comp = out.outputs[0]
        ids = list(comp.token_ids)
        results.append(
            (ids, [lp[t].logprob for lp, t in zip(comp.logprobs, ids)], out.num_cached_tokens or 0)
        )
    return results


def reference(config, state, prompts: list[list[int]], max_tokens: int):
    model = SwiftKVForCausalLM(config)
    model.load_state_dict(state, strict=True)
    settings = SamplingSettings(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return reference_generate(model.eval(), prompts, settings)


def assert_matches_reference(config, state, got, prompts: list[list[int]], max_tokens: int) -> None:
    """The reference's greedy tokens, and its logprobs within the fp32 tolerance."""
    for i, (want, (ids, logprobs, _)) in enumerate(zip(reference(config, state, prompts, max_tokens), got)):
        assert ids == want.token_ids, f"prompt {i}: vLLM {ids} != reference {want.token_ids}"
        diff = (torch.tensor(logprobs) - torch.tensor(want.logprobs)).abs().max().item()
        assert diff <= LOGPROB_ATOL, f"prompt {i}: logprobs differ by {diff:.2e} (> {LOGPROB_ATOL})"


def matches_reference_once(path: Path, config, state, **kwargs) -> None:
    """One round of PROMPTS on an engine built with `kwargs`, held to the reference."""
    with engine(path, **kwargs) as llm:
        got = generate(llm, PROMPTS, MAX_TOKENS)
    assert_matches_reference(config, state, got, PROMPTS, MAX_TOKENS)


def fast_prefill_twice(path: Path, config, state, **kwargs):
    """Fast prefill on, 16-token steps (the 45-token prompt is chunked), prefix caching with 32-token
    blocks (vLLM's CPU attention takes multiples of 32): two rounds of PROMPTS, both held to the
    reference. Returns the second round, whose long prompt hits the cache."""
    options = dict(
        kv_sharing_fast_prefill=True, max_num_batched_tokens=16, enable_prefix_caching=True, block_size=32
    )
    with engine(path, **(options | kwargs)) as llm:
        first = generate(llm, PROMPTS, MAX_TOKENS)
        second = generate(llm, PROMPTS, MAX_TOKENS)
    assert_matches_reference(config, state, first, PROMPTS, MAX_TOKENS)
    assert_matches_reference(config, state, second, PROMPTS, MAX_TOKENS)
    return second
