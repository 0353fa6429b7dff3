"""What the scheduler hands the model runner each step (vLLM's SchedulerOutput): the engine -> worker
contract. The runner reads the requests' token ids, sampling parameters and generators through it and
imports nothing of the engine."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swiftkv_fast.engine.request import Request


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step (prefix hit included)
    num_tokens: int  # tokens scheduled this step
    block_ids: tuple[list[int], ...]  # block table per kvcache group (after allocation)
    sampled: bool  # this step computes the request's last known token: a new token is sampled
    # token ids the sampled token must not be (min_tokens: engine/stop.py min_tokens_banned_ids)
    banned_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
