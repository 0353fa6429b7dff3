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
