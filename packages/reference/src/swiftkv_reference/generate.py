"""A plain, step-by-step generator over a naive per-request contiguous cache.

Requests run one at a time: the prompt is prefilled (whole, or in chunks of `prefill_chunk` tokens;
only the prompt's last token runs layers >= L), then one token per step. Each generated token's
fp32 logits row, and the log-prob of the chosen token under log_softmax of the raw logits, are kept.
A request stops after `max_tokens`, or on a stop token / eos (the stop token is part of the output).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from .model import SwiftKVForCausalLM
from .sampling import SamplingSettings, sample

logger = logging.getLogger(__name__)


@dataclass
class Generation:
    """The output of one request."""

    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # log-prob of each chosen token
    logits: list[torch.Tensor] = field(default_factory=list)  # fp32 (vocab,) row at each sampled position
    finish_reason: str | None = None  # "stop" or "length"


@torch.no_grad()
def generate(
    model: SwiftKVForCausalLM,
    prompts: list[list[int]],
    params: SamplingSettings | list[SamplingSettings],
    prefill_chunk: int | None = None,
    swiftkv: bool | None = None,
) -> list[Generation]:
    """Generate for each prompt (in order) with its settings (one SamplingSettings applies to all)."""
    if isinstance(params, SamplingSettings):
        params = [params] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling settings")
    return [_generate_one(model, list(p), s, prefill_chunk, swiftkv) for p, s in zip(prompts, params)]


def _generate_one(model, prompt: list[int], settings: SamplingSettings, prefill_chunk, swiftkv) -> Generation:
    config = model.config
    if not prompt:
        raise ValueError("empty prompt")
    if any(not 0 <= t < config.vocab_size for t in prompt):
        raise ValueError(f"prompt token ids must be in [0, {config.vocab_size})")
    if prefill_chunk is not None and prefill_chunk < 1:
        raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
    stop = set(settings.stop_token_ids) | (set() if settings.ignore_eos else set(config.eos_token_id))
    generator = settings.make_generator()
    cache = model.new_cache(swiftkv)
    out = Generation(prompt_token_ids=prompt)

    chunk = prefill_chunk or len(prompt)
    for start in range(0, len(prompt), chunk):
        ids = torch.tensor(prompt[start : start + chunk])
        positions = torch.arange(start, start + len(ids))
        last = start + len(ids) == len(prompt)
        logits = model.step(ids, positions, cache, [len(ids) - 1] if last else [])

    while True:
        row = logits[-1]  # (vocab,) fp32
        token = sample(row, settings, generator)
        out.token_ids.append(token)
        out.logprobs.append(float(torch.log_softmax(row, dim=-1)[token]))
        out.logits.append(row.clone())
        if token in stop:
            out.finish_reason = "stop"
            break
        if len(out.token_ids) >= settings.max_tokens:
            out.finish_reason = "length"
            break
        position = len(prompt) + len(out.token_ids) - 1
        logits = model.step(torch.tensor([token]), torch.tensor([position]), cache, [0])
    logger.debug("generated %d tokens (%s)", len(out.token_ids), out.finish_reason)
    return out
