"""What completions and chat completions share (vLLM's `OpenAIServing`): the server's settings, the
model check, backpressure, sampling parameters from a request, prompt checks, the engine requests of
one HTTP request (n choices per prompt) and what their outputs add up to.

Every check runs before the first engine request is added: a bad HTTP request changes nothing.
Admission counts sequences (engine requests: prompts x n), not HTTP requests: one request may ask for
at most `max_sequences_per_request`, and `max_waiting` bounds the sequences waiting. Preparing a
request (tokenization, the chat template) runs on one tokenizer thread (`run_blocking`, vLLM's
tokenizer executor: HF tokenizers must not be called from two threads at once), so a large prompt
never holds up the event loop, /health or other clients' streams.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Executor
from contextlib import aclosing
from dataclasses import dataclass, field

from swiftkv_fast.engine.async_llm import AsyncLLM, EngineDeadError, RequestFailedError
from swiftkv_fast.entrypoints.errors import APIError, bad_request, from_input_error, internal_error
from swiftkv_fast.entrypoints.limits import MAX_N, MAX_SEQUENCES_PER_REQUEST
from swiftkv_fast.entrypoints.protocol import PromptTokensDetails, SamplingRequest, UsageInfo
from swiftkv_fast.entrypoints.utils import merge_async_iterators
from swiftkv_fast.executor.executor import WorkerDiedError
from swiftkv_fast.logger import init_logger
from swiftkv_fast.outputs import RequestOutput
from swiftkv_fast.sampling_params import SamplingParams

logger = init_logger(__name__)

MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's chat limit, vLLM's default max_logprobs)
RETRY_AFTER_S = 1  # the Retry-After of an overloaded server's 503
MIN_LOGPROB = -9999.0  # JSON has no -inf (vLLM's clamp)
# parameters the engine does not implement: accepted at their neutral value only
NEUTRAL = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}


@dataclass
class ServerConfig:
    served_model_names: list[str]  # the first is the one responses report when a request names none
    model_root: str | None = None  # the checkpoint, as /v1/models reports it
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on every /v1 route
    max_waiting: int | None = None  # refuse (503) while this many sequences wait; None: never
    max_sequences_per_request: int = MAX_SEQUENCES_PER_REQUEST  # prompts x n of one request
    max_request_body_bytes: int | None = None  # 413 above; None: default_max_request_body_bytes
    allowed_origins: list[str] = field(default_factory=list)  # CORS; empty: no CORS headers at all

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ValueError(f"served_model_names must be non-empty strings, got {self.served_model_names!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or None")
        if self.max_waiting is not None and not _is_positive_int(self.max_waiting):
            raise ValueError(f"max_waiting must be None or an int >= 1, got {self.max_waiting!r}")
        if not _is_positive_int(self.max_sequences_per_request):
            raise ValueError(
                f"max_sequences_per_request must be an int >= 1, got {self.max_sequences_per_request!r}"
            )
        if self.max_request_body_bytes is not None and not _is_positive_int(self.max_request_body_bytes):
            raise ValueError(
                f"max_request_body_bytes must be None or an int >= 1, got {self.max_request_body_bytes!r}"
            )
        if not all(isinstance(o, str) and o for o in self.allowed_origins):
            raise ValueError(f"allowed_origins must be non-empty strings, got {self.allowed_origins!r}")


def _is_positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass
class Choice:
    """What one engine request's deltas add up to."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        c = out.outputs[0]
        self.text += c.text
        self.token_ids += c.token_ids
        self.logprobs += c.logprobs or []
        self.finish_reason, self.stop_reason = c.finish_reason, c.stop_reason
        self.num_prompt_tokens, self.num_cached_tokens = len(out.prompt_token_ids), out.num_cached_tokens


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, config: ServerConfig, tokenizer_executor: Executor | None = None):
        self.engine = engine
        self.config = config
        self.tokenizer_executor = tokenizer_executor  # None: the event loop's default executor
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._token_text)

    async def run_blocking(self, fn: Callable, *args):
        """fn(*args) on the tokenizer thread, the event loop serving others meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_executor, fn, *args)

    # ---- checks (all before any engine request) -----------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The model name the response reports; 404 for a name this server does not serve."""
        if model is None:
            return self.config.served_model_names[0]
        if model not in self.config.served_model_names:
            raise APIError(
                f"The model `{model}` does not exist. This server serves: "
                f"{', '.join(self.config.served_model_names)}",
                404,
                param="model",
                code="model_not_found",
            )
        return model

    def check_request(self, request: SamplingRequest) -> None:
        """The fields both endpoints check the same way."""
        if request.model_extra:
            logger.warning("ignored unknown request fields: %s", ", ".join(sorted(request.model_extra)))
        for name, neutral in NEUTRAL.items():
            value = getattr(request, name)
            if value is not None and value != neutral:
                raise bad_request(f"{name} is not supported by this server (only {neutral})", name)
        if request.logit_bias:
            raise bad_request("logit_bias is not supported by this server", "logit_bias")
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if not 1 <= request.n <= MAX_N:
            raise bad_request(f"n must be in [1, {MAX_N}], got {request.n}", "n")

    def check_num_sequences(self, num_prompts: int, n: int) -> None:
        """400 when one request asks for more sequences (prompts x n) than --max-sequences-per-request."""
        limit = self.config.max_sequences_per_request
        if num_prompts * n > limit:
            raise bad_request(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompts x n={n}), "
                f"more than the {limit} this server allows in one request (--max-sequences-per-request)",
                "n",
            )

    def check_capacity(self, num_sequences: int) -> None:
        """503 when the engine is dead, or when the sequences waiting plus this request's would pass
        --max-waiting (a request is admitted when nothing waits, so every allowed request can run)."""
        if not self.engine.is_healthy:
            raise APIError(f"the engine is not running: {self.engine.dead_error}", 503, code="engine_dead")
        limit = self.config.max_waiting
        if limit is not None:
            waiting = self.engine.num_waiting
            if waiting and waiting + num_sequences > limit:
                raise APIError(
                    f"the server is overloaded: {waiting} sequence(s) waiting, and this request adds "
                    f"{num_sequences} (--max-waiting {limit}); retry after {RETRY_AFTER_S} s",
                    503,
                    code="overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )

    def sampling_params(
        self, request: SamplingRequest, max_tokens: int, logprobs: int | None
    ) -> SamplingParams:
        try:
            return SamplingParams(
                temperature=1.0 if request.temperature is None else request.temperature,
                top_p=1.0 if request.top_p is None else request.top_p,
                top_k=-1 if request.top_k is None else request.top_k,
                seed=request.seed,
                max_tokens=max_tokens,
                min_tokens=request.min_tokens,
                stop=request.stop,
                stop_token_ids=request.stop_token_ids,
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
            )
        except (TypeError, ValueError) as e:
            raise from_input_error(e) from None

    def check_prompt(
        self, prompt, params: SamplingParams, param: str, where: str
    ) -> tuple[str | None, list[int]]:
        """(text, token ids) of a prompt checked against the model (length, vocabulary, tokenizer)."""
        try:
            return self.engine.process_inputs(prompt, params)
        except (TypeError, ValueError) as e:
            raise from_input_error(e, param, where) from None

    def check_length(self, num_prompt_tokens: int, max_tokens: int, max_tokens_field: str) -> None:
        limit = self.engine.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the prompt, {max_tokens} "
                "for the completion). Please reduce the length of the prompt or the completion.",
                max_tokens_field,
                where=max_tokens_field,
            )

    def child_params(self, params: SamplingParams, n: int) -> list[SamplingParams]:
        """The params of choice j: with a seed, seed + j (vLLM's rule), so the choices differ."""
        try:
            return [
                params if j == 0 or params.seed is None else dataclasses.replace(params, seed=params.seed + j)
                for j in range(n)
            ]
        except ValueError as e:
            raise bad_request(f"seed + n - 1 is out of range: {e}", "seed") from None

    # ---- engine requests ----------------------------------------------------------------------------

    def generate(
        self, request_id: str, prompts: list[tuple[str | None, list[int]]], params: list[SamplingParams]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) of every prompt x choice, as they come; choice index = prompt * n + j.
        Requests are added when iteration starts; closing the iterator aborts the unfinished ones."""
        gens = [
            self.engine.generate({"prompt": text, "prompt_token_ids": ids}, p, f"{request_id}-{i}-{j}")
            for i, (text, ids) in enumerate(prompts)
            for j, p in enumerate(params)
        ]
        return merge_async_iterators(*gens)

    async def collect(
        self, request_id: str, outputs: AsyncIterator[tuple[int, RequestOutput]], num_choices: int
    ) -> list[Choice]:
        choices = [Choice() for _ in range(num_choices)]
        try:
            async for i, out in outputs:
                choices[i].add(out)
        except (RequestFailedError, EngineDeadError) as e:
            raise engine_error(request_id, e) from None
        return choices

    async def stream(
        self,
        request_id: str,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        num_choices: int,
        n: int,
        chunk: Callable[[int, RequestOutput, int], object],
        usage_chunk: Callable[[UsageInfo], object] | None,
        first: Sequence[object] = (),
        keep_empty: bool = False,
    ) -> AsyncIterator[str]:
        """The SSE events of one request: `first`, then chunk(choice index, output, the choice's text
        length before it) for each output that has text or finishes (every output with keep_empty),
        then usage_chunk(usage) if given, then [DONE]. An engine failure (or a bug: a 500 with an id)
        ends it with an error event and [DONE]; closing it closes `outputs` (which aborts the
        unfinished requests)."""
        choices = [Choice() for _ in range(num_choices)]
        try:
            async with aclosing(outputs):
                for event in first:
                    yield sse(event)
                async for i, out in outputs:
                    offset = len(choices[i].text)
                    choices[i].add(out)
                    if out.outputs[0].text or out.finished or keep_empty:
                        yield sse(chunk(i, out, offset))
            if usage_chunk is not None:
                yield sse(usage_chunk(self.usage(choices, n)))
        except (RequestFailedError, EngineDeadError) as e:
            yield sse_error(engine_error(request_id, e))
        except Exception as e:
            yield sse_error(internal_error(e, f"the stream of {request_id}"))
        yield SSE_DONE

    def usage(self, choices: list[Choice], n: int) -> UsageInfo:
        """Prompt tokens once per prompt (choice 0 of each: its cached tokens), completion tokens of all."""
        firsts = choices[::n]
        prompt = sum(c.num_prompt_tokens for c in firsts)
        completion = sum(len(c.token_ids) for c in choices)
        return UsageInfo(
            prompt_tokens=prompt,
            completion_tokens=completion,
            total_tokens=prompt + completion,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(c.num_cached_tokens for c in firsts)),
        )

    def token_str(self, token_id: int, as_id: bool) -> str:
        """A token as logprobs name it: its text, or "token_id:<id>" (vLLM's return_tokens_as_token_ids,
        and always without a tokenizer)."""
        return f"token_id:{token_id}" if as_id or self.engine.tokenizer is None else self.token_text(token_id)

    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def top_logprobs(self, entry: dict[int, float], n: int) -> list[tuple[int, float]]:
        """The n most likely (token id, logprob) of an engine logprobs entry (the chosen token first,
        then the top-n), most likely first, clamped for JSON."""
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:n]
        return [(t, max(lp, MIN_LOGPROB)) for t, lp in ranked]


def engine_error(request_id: str, e: Exception) -> APIError:
    """The answer to a request the engine could not finish: 503 when the engine stopped or a
    tensor-parallel rank died under it (logged: one line per request), else a 500 that names an id,
    not the exception (errors.internal_error logs the step's traceback under it)."""
    if isinstance(e, EngineDeadError) or isinstance(e.__cause__, WorkerDiedError):
        logger.warning("request %s aborted: %s", request_id, e)
        return APIError(str(e), 503, code="engine_dead")
    return internal_error(e.__cause__ or e, f"the engine step that ran {request_id}")


def sse(chunk) -> str:
    """One server-sent event: a response model (fields the server did not set left out)."""
    return f"data: {chunk.model_dump_json(exclude_unset=True)}\n\n"


def sse_error(error: APIError) -> str:
    return f"data: {error.response().body.decode()}\n\n"


SSE_DONE = "data: [DONE]\n\n"
