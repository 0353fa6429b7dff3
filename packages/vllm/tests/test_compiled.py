"""vLLM's default compiled mode (one Dynamo trace through Inductor on CPU) gives the reference's tokens.

A K/V write whose result nobody reads is dead code to the compiler: without the side-effecting write op
(`swiftkv_vllm.kv_write`) these engines serve from all-zero caches, with no error. Compilation costs
tens of seconds per engine, so two engines cover both graphs: the whole model (fast prefill off) and
the two halves (fast prefill on, with chunking and a prefix hit, on the hybrid Qwen2 model)."""

from __future__ import annotations

from helpers import MODELS, fast_prefill_twice, matches_reference_once, write_checkpoint


def test_compiled_whole_model_equals_the_reference(tmp_path):
    matches_reference_once(*write_checkpoint(tmp_path, **MODELS["llama-L2-G2"]), enforce_eager=False)


def test_compiled_halves_with_fast_prefill_equal_the_reference(tmp_path):
    path, config, state = write_checkpoint(tmp_path, **MODELS["qwen2-hybrid-G2"])
    fast_prefill_twice(path, config, state, enforce_eager=False)
