"""`AsyncLLM`: the engine for a server (vLLM's name). One background thread steps the `LLMEngine`;
each request gets an async stream of what is new (token ids, text, logprobs) after every step.

    engine = AsyncLLM(LLM(...).llm_engine)
    async for out in engine.generate("Hello", SamplingParams(max_tokens=32), request_id="r1"):
        print(out.outputs[0].text, end="")         # the new text only (a delta)

- Only the engine thread touches the `LLMEngine`. `add_request` and `abort` (any thread with a running
  asyncio loop) hand their work over through an inbox that the thread empties between two steps, so
  an abort takes effect before the next step: the request leaves the scheduler and its KV blocks are
  freed, and the other requests are untouched. A `generate` that is closed or cancelled before its
  request finished (a client that disconnected) aborts it.
- The thread sleeps on a condition when there is no work, and wakes up on the next add or abort, or
  when a tensor-parallel worker dies (the executor's monitor calls back): an idle engine whose rank
  died turns unhealthy at once.
- Outputs reach each request's asyncio loop with `loop.call_soon_threadsafe`, one call per loop per
  step. Text is detokenized incrementally on the engine thread (engine.detokenizer): never half a
  UTF-8 character, never a prefix of a stop string; the deltas add up to `LLM.generate`'s text.
- A step that raises aborts exactly the requests it ran (`LLMEngine.step`): their streams raise
  `RequestFailedError` and the engine goes on with the others. Anything else that stops the thread
  marks the engine dead: `errored` / `is_healthy` say so, every stream raises `EngineDeadError`, and
  new requests are refused with it. `stop(reason)` (a server shutting down) ends it the same way,
  with `reason` as the error and `errored` False.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from swiftkv_fast.engine.detokenizer import IncrementalDetokenizer
from swiftkv_fast.engine.llm_engine import LLMEngine
from swiftkv_fast.engine.request import Request, RequestStatus
from swiftkv_fast.engine.stats import FinishedRequestStats, IterationStats, SchedulerStats
from swiftkv_fast.inputs import parse_prompt, validate_request
from swiftkv_fast.logger import init_logger
from swiftkv_fast.outputs import CompletionOutput, RequestOutput
from swiftkv_fast.sampling_params import SamplingParams, describe

logger = init_logger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a bug, or `shutdown`): no request can be served any more."""


class RequestFailedError(RuntimeError):
    """The engine step that ran this request raised; the request was aborted, the engine goes on."""


class StatLogger(Protocol):
    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        """Called on the engine thread after every iteration."""


@dataclass(eq=False)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    detokenizer: IncrementalDetokenizer | None
    arrival_time: float
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    request: Request | None = None  # set by the engine thread when handed to the engine
    num_sent_tokens: int = 0
    last_token_time: float = 0.0


class RequestOutputStream:
    """The outputs of one request, as an async iterator of deltas; it ends after the output with
    `finished` True, or raises `RequestFailedError` / `EngineDeadError`."""

    def __init__(self, state: _RequestState):
        self._state = state
        self.finished = False

    @property
    def request_id(self) -> str:
        return self._state.request_id

    def __aiter__(self) -> RequestOutputStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._state.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item


class AsyncLLM:
    def __init__(self, engine: LLMEngine, stat_loggers: Sequence[StatLogger] = ()):
        self.engine = engine
        self.stat_loggers = list(stat_loggers)
        self.errored = False  # the engine thread died of an error
        self.dead_error: BaseException | None = None
        self.num_steps = 0  # engine steps run (a failed step included)
        self.num_iterations = 0  # times the thread woke up to work
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []  # ("add", state) | ("abort", request_id, (loop, future) | None)
        self._states: dict[str, _RequestState] = {}  # unfinished requests
        self._shutdown = False
        self._stop_reason = "the engine was shut down"
        self._logger_failed = False
        self._thread = threading.Thread(target=self._run_engine_loop, name="swiftkv-engine", daemon=True)
        self._thread.start()
        engine.register_failure_callback(self._wake)

    # ---- what the server reads -------------------------------------------------------------------

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def config(self):
        return self.engine.config

    @property
    def max_model_len(self) -> int:
        return self.engine.econf.max_model_len

    @property
    def is_healthy(self) -> bool:
        return self.dead_error is None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        with self._cond:
            return len(self._states)

    @property
    def num_waiting(self) -> int:
        """Requests not running now: not yet handed to the engine, waiting, or preempted."""
        with self._cond:
            return sum(
                s.request is None or s.request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                for s in self._states.values()
            )

    # ---- requests ----------------------------------------------------------------------------------

    def process_inputs(self, prompt, params: SamplingParams, index: int = 0) -> tuple[str | None, list[int]]:
        """`prompt` parsed and checked with `params` against the model (swiftkv_fast.inputs): ->
        (text or None, token ids). Raises TypeError / ValueError naming request `index` and the field."""
        text, ids = parse_prompt(index, prompt, self.tokenizer)
        validate_request(
            index, ids, params, self.config.vocab_size, self.max_model_len, self.tokenizer is not None
        )
        return text, ids

    def add_request(
        self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None
    ) -> RequestOutputStream:
        """Check the request and queue it for the engine thread; call it from a running asyncio loop,
        which receives the outputs. Nothing is queued when it raises."""
        if not isinstance(request_id, str) or not request_id:
            raise TypeError(f"request_id must be a non-empty str, got {describe(request_id)}")
        text, ids = self.process_inputs(prompt, params)
        detokenizer = None
        if self.tokenizer is not None:
            detokenizer = IncrementalDetokenizer(self.engine.detokenize, params.stop)
        state = _RequestState(
            request_id,
            text,
            ids,
            params,
            asyncio.get_running_loop(),
            detokenizer,
            arrival_time if arrival_time is not None else time.time(),
        )
        with self._cond:
            self._check_alive()
            if request_id in self._states:
                raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
            self._states[request_id] = state
            self._inbox.append(("add", state))
            self._cond.notify()
        return RequestOutputStream(state)

    async def generate(
        self, prompt, sampling_params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """The request's outputs (deltas) until it finishes. Closing or cancelling the iterator first
        aborts the request."""
        stream = self.add_request(request_id, prompt, sampling_params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self._enqueue_abort(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort an unfinished request; returns once the engine thread has removed it (and freed its
        blocks). Its stream ends with an output whose finish_reason is "abort". Unknown or finished
        ids are ignored."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        if self._enqueue_abort(request_id, (loop, done)):
            await done

    def _enqueue_abort(self, request_id: str, waiter) -> bool:
        with self._cond:
            if self.dead_error is not None:
                return False
            self._inbox.append(("abort", request_id, waiter))
            self._cond.notify()
            return True

    def _check_alive(self) -> None:
        if self.dead_error is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_error}") from self.dead_error
        if self._shutdown:
            raise EngineDeadError("the engine is shutting down")

    def stop(self, reason: str = "the engine was shut down") -> None:
        """Ask the engine thread to stop after its current step and return at once; every unfinished
        request's stream then raises EngineDeadError(reason)."""
        with self._cond:
            if not self._shutdown:
                self._shutdown, self._stop_reason = True, reason
            self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine thread after its current step (unfinished requests get EngineDeadError),
        wait for it, and stop the engine's workers."""
        self.stop()
        self._thread.join(timeout)
        self.engine.shutdown()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify()

    # ---- the engine thread -------------------------------------------------------------------------

    def _run_engine_loop(self) -> None:
        try:
            while True:
                with self._cond:
                    while not (
                        self._inbox
                        or self._shutdown
                        or self.engine.has_unfinished_requests()
                        or self.engine.dead_error is not None
                    ):
                        self._cond.wait()
                    if self._shutdown:
                        break
                    ops, self._inbox = self._inbox, []
                self.num_iterations += 1  # before any output is delivered: a reader sees it counted
                iteration = IterationStats()
                outputs = self._handle_ops(ops, iteration)
                if self.engine.has_unfinished_requests():
                    outputs += self._step(iteration)
                self._record(iteration)  # first: a client that got its output sees it in the metrics
                self._deliver(outputs)
                if self.engine.dead_error is not None:  # a tensor-parallel rank died: no step can run
                    raise self.engine.dead_error
        except BaseException as e:  # a rank died, or a bug in the loop itself: the engine cannot go on
            if e is self.engine.dead_error:  # the executor logged why
                logger.error("the engine loop stops: %s", e)
            else:
                logger.exception("the engine loop died")
            self._die(e, errored=True)
            return
        self._die(EngineDeadError(self._stop_reason), errored=False)

    def _handle_ops(self, ops: list[tuple], iteration: IterationStats) -> list:
        outputs = []
        for op in ops:
            if op[0] == "add":
                s = op[1]
                s.request = self.engine.add_request(
                    s.prompt_token_ids, s.params, s.prompt, s.request_id, s.arrival_time
                )
                continue
            _, request_id, waiter = op
            s = self._states.get(request_id)
            if s is not None and self.engine.abort_request(request_id) is not None:
                logger.debug("aborted request %s", request_id)
                outputs.append((s, self._output(s, iteration)))
            if waiter is not None:
                outputs.append((waiter, None))
        return outputs

    def _step(self, iteration: IterationStats) -> list:
        error = None
        try:
            self.engine.step()
        except Exception as e:
            logger.exception("an engine step failed; its requests are aborted, the others go on")
            error = e
        self.num_steps += 1
        failed = []
        outputs = []
        for s in self._snapshot():
            req = s.request
            if req is None:
                continue
            if req.finish_reason == "abort":  # only a failed step aborts here (aborts are ops)
                failed.append(s)
            elif req.num_output_tokens > s.num_sent_tokens or req.is_finished:
                outputs.append((s, self._output(s, iteration)))
        if error is not None and not failed:  # nothing was scheduled: every request would fail again
            self.engine.abort_all()
            failed = [s for s in self._snapshot() if s.request is not None]
        for s in failed:
            failure = RequestFailedError(f"request {s.request_id}: the engine step failed: {error}")
            failure.__cause__ = error  # the server logs its traceback under the id it answers with
            outputs.append((s, failure))
            self._forget(s, "error", iteration)
        return outputs

    def _output(self, s: _RequestState, iteration: IterationStats) -> RequestOutput:
        """The request's delta since the previous output; records its token and latency stats."""
        req = s.request
        now = time.time()
        new_ids = req.output_token_ids[s.num_sent_tokens :]
        if new_ids:
            if s.num_sent_tokens == 0:
                iteration.num_prompt_tokens += req.num_prompt_tokens
                iteration.time_to_first_tokens.append(now - s.arrival_time)
            else:
                iteration.inter_token_latencies.append(now - s.last_token_time)
            iteration.num_generation_tokens += len(new_ids)
            s.last_token_time = now
        text = ""
        if s.detokenizer is not None:
            if req.finish_reason in ("stop", "length"):  # the engine's final text (cut before a stop string)
                text = s.detokenizer.finish(req.output_text)
            elif new_ids:
                text = s.detokenizer.update(req.output_token_ids)
        logprobs = req.logprobs[s.num_sent_tokens :] if req.logprobs is not None else None
        s.num_sent_tokens = req.num_output_tokens
        completion = CompletionOutput(
            index=0,
            text=text,
            token_ids=new_ids,
            cumulative_logprob=req.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        if req.is_finished:
            self._forget(s, req.finish_reason, iteration)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[completion],
            finished=req.is_finished,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            metrics=req.metrics,
        )

    def _forget(self, s: _RequestState, finish_reason: str, iteration: IterationStats) -> None:
        with self._cond:
            self._states.pop(s.request_id, None)
        m = s.request.metrics
        iteration.finished_requests.append(
            FinishedRequestStats(
                finish_reason=finish_reason,
                e2e_latency=time.time() - s.arrival_time,
                num_prompt_tokens=s.request.num_prompt_tokens,
                num_generation_tokens=s.request.num_output_tokens,
                mean_time_per_output_token=m.tpot,
            )
        )

    def _snapshot(self) -> list[_RequestState]:
        with self._cond:
            return list(self._states.values())

    def _deliver(self, outputs: list) -> None:
        """Hand (state, output or exception) and (abort waiter, None) pairs to their loops, one
        call_soon_threadsafe per loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for target, item in outputs:
            loop = target.loop if isinstance(target, _RequestState) else target[0]
            by_loop.setdefault(loop, []).append((target, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the loop is closed: nobody reads these outputs any more
                for target, _ in items:
                    if isinstance(target, _RequestState) and target.request_id in self._states:
                        self._enqueue_abort(target.request_id, None)

    def _record(self, iteration: IterationStats) -> None:
        if not self.stat_loggers:
            return
        stats = self.engine.make_scheduler_stats()
        with self._cond:  # requests not handed over yet are waiting too
            stats.num_waiting_reqs += sum(op[0] == "add" for op in self._inbox)
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats, iteration)
            except Exception:  # metrics must not stop the serving; say it once
                if not self._logger_failed:
                    logger.exception("stat logger %r failed (reported once)", stat_logger)
                    self._logger_failed = True

    def _die(self, error: BaseException, errored: bool) -> None:
        with self._cond:
            self.dead_error, self.errored = error, errored
            states, self._states = list(self._states.values()), {}
            ops, self._inbox = self._inbox, []
        message = f"the engine loop died: {error!r}" if errored else str(error)
        outputs = [(s, EngineDeadError(message)) for s in states]
        outputs += [(op[2], None) for op in ops if op[0] == "abort" and op[2] is not None]
        self._deliver(outputs)


def _put_all(items: list) -> None:
    for target, item in items:
        if isinstance(target, _RequestState):
            target.queue.put_nowait(item)
        elif not target[1].done():  # an abort waiter: (loop, future)
            target[1].set_result(None)
