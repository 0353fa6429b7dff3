"""vLLM's default compiled mode (one Dynamo trace through Inductor on CPU) gives the reference's tokens.

A K/V write whose result nobody reads is dead code to the compiler: without the side-effecting write op
(`swiftkv_vllm.kv_write`) these engines serve from all-zero caches, with no error. Compilation costs
tens of seconds per engine, so two engines cover both graphs: the whole model (fast prefill off) and
the two halves (fast prefill on, with chunking and a prefix hit, on the hybrid Qwen2 model)."""

from __future__ import annotations

from helpers import PROMPTS, assert_matches_reference, engine, generate, write_checkpoint

MAX_TOKENS = 6


def test_compiled_whole_model_equals_the_reference(tmp_path):
    path, config, state = write_checkpoint(
        tmp_path,
        model_type="llama_swiftkv",
        num_hidden_layers=6,
        num_key_value_layers=2,
        key_value_group_size=2,
    )
    with engine(path, enforce_eager=False) as llm:
        got = generate(llm, PROMPTS, MAX_TOKENS)
    assert_matches_reference(config, state, got, PROMPTS, MAX_TOKENS)


def test_compiled_halves_with_fast_prefill_equal_the_reference(tmp_path):
    path, config, state = write_checkpoint(
        tmp_path,
        model_type="qwen2_swiftkv",
        num_hidden_layers=4,
        num_key_value_layers=2,
        key_value_group_size=2,
        sliding_window=8,
        layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2,
    )
    with engine(
        path,
        enforce_eager=False,
        kv_sharing_fast_prefill=True,
        max_num_batched_tokens=16,
        enable_prefix_caching=True,
        block_size=32,
    ) as llm:
        first = generate(llm, PROMPTS, MAX_TOKENS)
        second = generate(llm, PROMPTS, MAX_TOKENS)
    assert_matches_reference(config, state, first, PROMPTS, MAX_TOKENS)
    assert_matches_reference(config, state, second, PROMPTS, MAX_TOKENS)
