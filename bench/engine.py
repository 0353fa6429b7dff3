"""The benchmarks' one door into `swiftkv_fast`: build an engine, run a batch, read its cache.

Everything that depends on the engine's API sits here, so a renamed field is a one-line fix.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import Any

import torch

log = logging.getLogger(__name__)

# Special and byte tokens sit at the start of Llama-family vocabularies; random prompts avoid them.
FIRST_PLAIN_TOKEN = 256


def random_prompts(num_prompts: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Distinct random token-id prompts (no shared prefix, so no prefix-cache hits between them)."""
    rng = random.Random(seed)
    low = min(FIRST_PLAIN_TOKEN, vocab_size // 2)
    return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(num_prompts)]


def build_llm(
    num_key_value_layers: int | None = None,
    key_value_group_size: int | None = None,
    *,
    dtype: str = "float32",
    device: str = "cpu",
    state_dict: dict | None = None,
    config: Any = None,
    model: str | None = None,
    **kw: Any,
):
    """The embedded model (or the checkpoint directory `model`, or `config` + `state_dict`), prefix
    caching off so repeats do real work, at torch's float32 matmul precision (`--matmul-precision`), as
    the baselines in this process run."""
    from swiftkv_fast import LLM

    kw.setdefault("enable_prefix_caching", False)
    kw.setdefault("matmul_precision", matmul_precision())
    common = dict(dtype=dtype, device=device, **kw)
    if state_dict is not None:
        log.info("building engine from a state dict, L=%s G=%s", num_key_value_layers, key_value_group_size)
        return LLM.from_state_dict(
            config,
            state_dict,
            num_key_value_layers=num_key_value_layers,
            key_value_group_size=key_value_group_size,
            **common,
        )
    log.info(
        "building engine on %s, L=%s G=%s",
        model or "the embedded model",
        num_key_value_layers,
        key_value_group_size,
    )
    return LLM(
        model=model,
        num_key_value_layers=num_key_value_layers,
        key_value_group_size=key_value_group_size,
        **common,
    )


def matmul_precision() -> str:
    """The engine's matmul_precision matching torch's float32 matmul precision in this process (what
    `--matmul-precision` set): "high" permits bf16x3, anything else is "highest"."""
    return "high" if torch.get_float32_matmul_precision() == "high" else "highest"


def greedy(max_tokens: int, ignore_eos: bool = True):
    """Greedy sampling; benchmarks ignore EOS so every request makes exactly `max_tokens` tokens."""
    from swiftkv_fast import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


@dataclass
class BatchResult:
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    tpot_s: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)  # each request's output tokens, in order

    def metrics(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "token_ids": self.token_ids,
        }


def sampled(num: int, max_tokens: int, temperature: float) -> list:
    """Sampling at `temperature` (no top-k / top-p), request i seeded with i (vLLM's per-request seed),
    EOS ignored: every request makes exactly `max_tokens` tokens, the same ones every round."""
    from swiftkv_fast import SamplingParams

    return [
        SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True, seed=i)
        for i in range(num)
    ]


def run_batch(
    llm, prompts: list[list[int]], max_tokens: int, use_tqdm: bool = False, temperature: float = 0.0
) -> BatchResult:
    """Exactly `max_tokens` tokens per prompt (EOS ignored): greedy, or `sampled` at temperature > 0."""
    params = greedy(max_tokens) if temperature == 0 else sampled(len(prompts), max_tokens, temperature)
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    result = BatchResult(
        sum(len(o.prompt_token_ids) for o in outs), sum(len(o.outputs[0].token_ids) for o in outs)
    )
    for out in outs:
        result.texts.append(out.outputs[0].text)
        result.token_ids.append(list(out.outputs[0].token_ids))
        m = out.metrics
        if m is not None and m.ttft is not None:
            result.ttft_s.append(m.ttft)
        if m is not None and m.tpot is not None:
            result.tpot_s.append(m.tpot)
    return result


def model_runner(llm):
    """The engine's model runner: `execute(scheduler_output)` runs one step (bench/step_profile.py)."""
    return llm.llm_engine.runner


def swiftkv_model(llm):
    """The engine's model (weights, L): what bench/gemm_floor.py replays the linear layers of."""
    return model_runner(llm).model


def linear_kernels() -> dict[str, Any]:
    """The CPU model and the engine's linear-kernel plan of every layer shape built in this process
    ({"qkv (960x576)": "matmul <= 1, mkldnn above", ...}; empty before any engine is built)."""
    from swiftkv_fast.kernels.linear_kernels import cpu_model, kernel_choices

    return {"cpu_model": cpu_model(), "linear_kernels": kernel_choices()}


def step_token_budget(llm) -> int:
    """Tokens the engine schedules per step at most (max_num_batched_tokens)."""
    return llm.llm_engine.econf.max_num_batched_tokens


def kv_cache_tensor(llm) -> torch.Tensor:
    """The engine's paged KV cache: (num_kv_slots, 2, num_blocks, block_size, kv_heads, head_dim);
    num_kv_slots == num_cache_layers unless the model is hybrid (its kvcache groups share slots)."""
    return llm.llm_engine.runner.kv_cache


def kv_allocation(llm) -> dict[str, int]:
    """Bytes per cached token and block counts, read from the real allocation."""
    cache = kv_cache_tensor(llm)
    layers, _, num_blocks, block_size, kv_heads, head_dim = cache.shape
    return {
        "cache_layers": layers,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "element_bytes": cache.element_size(),
        "nbytes": cache.nbytes,
        "bytes_per_token": cache.nbytes // (num_blocks * block_size),
    }
