"""vLLM with the plugin gives the reference's greedy tokens and logprobs on every SwiftKV model shape,
with fast prefill off and on; with it on, also under chunked prefill and on prefix-cache hits."""

from __future__ import annotations

import pytest
from helpers import PROMPTS, assert_matches_reference, engine, generate, write_checkpoint

MAX_TOKENS = 6

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


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_and_logprobs_equal_the_reference_without_fast_prefill(tmp_path, name):
    path, config, state = write_checkpoint(tmp_path, **MODELS[name])
    with engine(path) as llm:
        got = generate(llm, PROMPTS, MAX_TOKENS)
    assert_matches_reference(config, state, got, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("name", list(MODELS))
def test_fast_prefill_chunked_and_prefix_hits_equal_the_reference(tmp_path, name):
    """16-token steps split the 45-token prompt; the second round hits its first 32-token block (vLLM's
    CPU attention takes blocks of multiples of 32)."""
    path, config, state = write_checkpoint(tmp_path, **MODELS[name])
    with engine(
        path,
        kv_sharing_fast_prefill=True,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        block_size=32,
    ) as llm:
        first = generate(llm, PROMPTS, MAX_TOKENS)
        second = generate(llm, PROMPTS, MAX_TOKENS)
    assert_matches_reference(config, state, first, PROMPTS, MAX_TOKENS)
    assert_matches_reference(config, state, second, PROMPTS, MAX_TOKENS)
    assert second[0][2] >= 32, f"the 45-token prompt's second run hit only {second[0][2]} cached tokens"
