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

from kvcache import KVCacheManager

from swiftkv_fast.engine.interrupts import deferred_interrupts
from swiftkv_fast.engine.request import Request, RequestStatus
from swiftkv_fast.engine.stop import check_stop, min_tokens_banned_ids
from swiftkv_fast.logger import init_logger
from swiftkv_fast.scheduler_output import ScheduledRequest, SchedulerOutput

logger = init_logger(__name__)


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
        """The next step's batch. If it raises, the requests it had already allocated for are
        failed (`fail_step`); the others keep their state, except that blocks a sliding window no
        longer needs may have been freed (a refused `allocate_slots` frees them, as vLLM's does).
        A Ctrl-C that arrives meanwhile is raised when the bookkeeping is done."""
        touched: list[tuple[Request, int]] = []
        try:
            with deferred_interrupts():  # a Ctrl-C held there is raised on exit: caught below
                return self._schedule(touched)
        except BaseException:
            with deferred_interrupts():
                self._fail(touched)
            raise

    def _schedule(self, touched: list[tuple[Request, int]]) -> SchedulerOutput:
        """`touched` gets (request, computed tokens before this step) before each allocation."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int, int]] = []
        # running requests, admission order; the victim (the tail) is never already scheduled
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            touched.append((req, req.num_computed_tokens))
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
            touched.append((req, hit.num_tokens))
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
            # the token sampled now is output number req.num_output_tokens (appended after the step)
            banned = min_tokens_banned_ids(req, self.eos_token_ids) if sampled else []
            out.scheduled.append(
                ScheduledRequest(req, start, n, self.kv.get_block_ids(req.request_id), sampled, banned)
            )
        return out

    def update_from_output(self, out: SchedulerOutput, sampled_tokens: dict[str, int]) -> list[Request]:
        """Append each sampled token, apply stop rules, free finished requests. Returns the finished."""
        with deferred_interrupts():
            return self._update_from_output(out, sampled_tokens)

    def _update_from_output(self, out: SchedulerOutput, sampled_tokens: dict[str, int]) -> list[Request]:
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

    def fail_step(self, out: SchedulerOutput) -> list[Request]:
        """Undo a step that raised after `schedule` returned it (in the model, the sampler or the
        output processing): every request it scheduled is aborted, and the prefix-cache entries of
        the blocks the step registered, whose K/V it may not have written, are forgotten first, so
        no later request can hit them. Other requests and every block written by an earlier step
        stay as they are. Returns the aborted requests."""
        with deferred_interrupts():
            return self._fail([(s.request, s.start) for s in out.scheduled])

    def _fail(self, touched: list[tuple[Request, int]]) -> list[Request]:
        """Abort every request of `touched` that holds blocks, after uncaching its blocks past the
        tokens it had computed before the step. The others (finished, preempted, refused) stay."""
        failed = {id(req): req for req, _ in touched if req.request_id in self.kv}
        for req, start in touched:
            if id(req) in failed:
                self.kv.uncache_unwritten_blocks(req, start)
        for req in failed.values():
            self._abort(req)
        return list(failed.values())

    def _abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)  # a no-op for a request that holds no blocks
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"
        req.metrics.finished_time = time.time()

    def abort_request(self, request_id: str) -> Request | None:
        """Abort one unfinished request between steps: it leaves the queues and its blocks are freed
        (they were all written by completed steps, so they stay in the prefix cache). Returns it, or
        None when no unfinished request has this id (it finished already, or never existed)."""
        with deferred_interrupts():
            req = next((r for r in (*self.running, *self.waiting) if r.request_id == request_id), None)
            if req is not None:
                self._abort(req)
            return req

    def abort_all(self) -> list[Request]:
        """Abort every unfinished request (their blocks, all written, stay cached); returns them."""
        with deferred_interrupts():
            reqs = list(self.running) + list(self.waiting)
            for req in reqs:
                self._abort(req)
            return reqs
