"""Continuous batching over the paged cache (vLLM v1's scheduler, minimal).

Every step has a token budget. Running requests come first, in admission order (decodes, then the
rest of a chunked prompt); then waiting requests are admitted while budget, blocks and max_num_seqs
allow. Chunked prefill is always on: a prompt longer than the remaining budget gets a chunk. When
`allocate_slots` returns None the most recently admitted running request is preempted (its blocks are
freed; it is recomputed later from its prompt and outputs), so no request is ever dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvcache import KVCacheManager

from swiftkv_fast.engine.request import Request, RequestStatus
from swiftkv_fast.engine.stop import check_stop
from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)


@dataclass
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens before this step (prefix hit included)
    num_tokens: int  # tokens scheduled this step
    block_ids: tuple[list[int], ...]  # block table per kvcache group (after allocation)
    sampled: bool  # this step computes the request's last known token: a new token is sampled


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        eos_token_ids: list[int],
        detokenize: Callable[[list[int]], str] | None = None,
    ):
        self.kv = kv_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_token_ids = set(eos_token_ids)
        self.detokenize = detokenize
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0

    def add_request(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.debug("preempted %s (%d tokens, recomputed later)", req.request_id, req.num_tokens)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int, int]] = []
        # running requests, admission order; the victim (the tail) is never already scheduled
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                break
            scheduled.append((req, req.num_computed_tokens, n))
            budget -= n
            i += 1
        # waiting requests (none admitted in a step that had to preempt)
        now = time.time()
        while not out.preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - hit.num_tokens, budget)
            if self.kv.allocate_slots(req, n, hit=hit) is None:
                break
            self.waiting.popleft()
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit.num_tokens
                req.metrics.first_scheduled_time = now
            req.num_computed_tokens = hit.num_tokens
            scheduled.append((req, hit.num_tokens, n))
            budget -= n
        for req, start, n in scheduled:
            req.num_computed_tokens = start + n
            sampled = start + n == req.num_tokens
            out.scheduled.append(
                ScheduledRequest(req, start, n, self.kv.get_block_ids(req.request_id), sampled)
            )
        return out

    def update_from_output(self, out: SchedulerOutput, sampled_tokens: dict[str, int]) -> list[Request]:
        """Append each sampled token, apply stop rules, free finished requests. Returns the finished."""
        finished = []
        for s in out.scheduled:
            req = s.request
            token = sampled_tokens.get(req.request_id)
            if token is None:
                continue
            req.append_output_token_ids(token)
            if check_stop(req, token, self.eos_token_ids, self.max_model_len, self.detokenize):
                self.finish(req)
                finished.append(req)
        return finished

    def finish(self, req: Request) -> None:
        req.status = RequestStatus.FINISHED
        self.running.remove(req)
        self.kv.free(req)
        req.metrics.finished_time = time.time()

    def abort_all(self) -> list[Request]:
        """Free every request (used when a step fails); returns them."""
        reqs = list(self.running) + list(self.waiting)
        for req in self.running:
            self.kv.free(req)
        self.running.clear()
        self.waiting.clear()
        return reqs
