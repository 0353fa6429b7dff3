"""What `LLM.generate` returns (vLLM's `RequestOutput` / `CompletionOutput`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_generated_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Mean seconds per generated token after the first."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return None
        return (self.finished_time - self.first_token_time) / (self.num_generated_tokens - 1)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float
    logprobs: list[dict[int, float]] | None  # per token: chosen token and the top-n (SamplingParams.logprobs)
    finish_reason: str | None  # "stop" | "length" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logits: torch.Tensor | None = None  # (num_tokens, vocab) fp32, only with LLM(return_logits=True)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    metrics: RequestMetrics | None = field(default=None, repr=False)
