"""The Hugging Face transformers baseline: `generate` (static batch, left padding) and, where the
installed version has it, `generate_batch` (continuous batching). Greedy (or sampled at a temperature),
fp32, EOS ignored, the same token-id prompts and the same weights as the engine."""

from __future__ import annotations

import inspect
import logging
import time
from pathlib import Path

import torch

from bench.engine import BatchResult

log = logging.getLogger(__name__)


def load_model(model_dir: str | Path, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    log.info("loading %s with transformers (%s)", model_dir, dtype)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    return model.eval()


def has_generate_batch(model) -> bool:
    return callable(getattr(model, "generate_batch", None))


class _StepClock:
    """A stopping criterion that never stops and records when each new token was produced."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def sampling_kwargs(temperature: float) -> dict:
    """generate's sampling settings: greedy at 0, else plain sampling at `temperature` (top-k and top-p
    off, whatever the checkpoint's generation_config says), as bench/engine.py's `sampled`."""
    if temperature == 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


def generate(
    model, prompts: list[list[int]], max_new_tokens: int, pad_token_id: int = 0, temperature: float = 0.0
) -> BatchResult:
    """One `model.generate` call on the whole batch, left-padded. Every request's first token comes
    after the batch's prefill, so TTFT is that time for all; TPOT is the mean step time after it."""
    from transformers import StoppingCriteriaList

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    clock = _StepClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            pad_token_id=pad_token_id,
            stopping_criteria=StoppingCriteriaList([clock]),
            **sampling_kwargs(temperature),
        )
    new_tokens = out.shape[1] - width
    ttft = clock.times[0] - start
    tpot = (clock.times[-1] - clock.times[0]) / (len(clock.times) - 1) if len(clock.times) > 1 else None
    result = BatchResult(sum(len(p) for p in prompts), new_tokens * len(prompts))
    result.ttft_s = [ttft] * len(prompts)
    result.tpot_s = [tpot] * len(prompts) if tpot is not None else []
    return result


def generate_batch(
    model, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0
) -> BatchResult:
    """transformers' continuous batching (`generate_batch`), with per-token timestamps."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig

    # a cache sized for this batch: the automatic size takes most of RAM and costs seconds to allocate
    page = 256
    blocks = sum(-(-(len(p) + max_new_tokens) // page) for p in prompts) + 1
    cb_config = ContinuousBatchingConfig(page_size=page, num_blocks=blocks, allow_block_sharing=False)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, eos_token_id=-1, pad_token_id=0, **sampling_kwargs(temperature)
    )
    extra = {}
    if "warmup" in inspect.signature(model.generate_batch).parameters:
        extra["warmup"] = False  # it captures CUDA graphs; nothing to capture on CPU, ~10 s lost
    cb_logger = logging.getLogger("ContinuousBatchingLogger")
    level, cb_logger.level = cb_logger.level, logging.CRITICAL  # CPU-only psutil warnings, every call
    try:
        with torch.inference_mode():
            outs = model.generate_batch(
                prompts,
                generation_config=config,
                continuous_batching_config=cb_config,
                record_timestamps=True,
                progress_bar=False,
                **extra,
            )
    finally:
        cb_logger.setLevel(level)
    result = BatchResult(0, 0)
    for out in outs.values():
        if out.error:
            raise RuntimeError(f"generate_batch request {out.request_id} failed: {out.error}")
        result.prompt_tokens += len(out.prompt_ids)
        result.output_tokens += len(out.generated_tokens)
        stamps = out.timestamps or []
        if stamps:
            result.ttft_s.append(stamps[0] - out.created_time)
        if len(stamps) > 1:
            result.tpot_s.append((stamps[-1] - stamps[0]) / (len(stamps) - 1))
    return result
