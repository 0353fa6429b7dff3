"""An engine request: the cache manager's `kvcache.Request` plus sampling state and outputs."""

from __future__ import annotations

import enum
import time

import kvcache
import torch

from swiftkv_fast.outputs import RequestMetrics
from swiftkv_fast.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()


class Request(kvcache.Request):
    """Counters (`num_computed_tokens`, `num_tokens`, `all_token_ids`) are the cache manager's."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        generator: torch.Generator | None,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ):
        super().__init__(request_id, prompt_token_ids)
        self.prompt = prompt
        self.sampling_params = sampling_params
        self.generator = generator  # per-request CPU generator (non-greedy requests)
        self.status = RequestStatus.WAITING
        self.num_cached_tokens = -1  # prompt tokens hit in the prefix cache at first admission
        self.num_preemptions = 0
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.logits: list[torch.Tensor] = []
        self.output_text = ""
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.metrics = RequestMetrics(arrival_time=arrival_time if arrival_time is not None else time.time())

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
