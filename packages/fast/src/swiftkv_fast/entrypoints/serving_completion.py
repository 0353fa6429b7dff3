"""POST /v1/completions (vLLM's `OpenAIServingCompletion`): a prompt (text, token ids, or a batch of
either) -> n completions per prompt, as one JSON response or a stream of server-sent events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from swiftkv_fast.entrypoints.errors import bad_request
from swiftkv_fast.entrypoints.protocol import (
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from swiftkv_fast.entrypoints.serving_engine import (
    MAX_LOGPROBS,
    MIN_LOGPROB,
    OpenAIServing,
)
from swiftkv_fast.outputs import RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    def prepare(self, request: CompletionRequest):
        """Every check; -> (model name, prompts as (text, ids), params per choice)."""
        model = self.check_model(request.model)
        self.check_request(request)
        if request.echo:
            raise bad_request("echo is not supported by this server", "echo")
        if request.suffix is not None:
            raise bad_request("suffix is not supported by this server", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise bad_request(
                f"best_of must equal n ({request.n}) on this server, got {request.best_of}", "best_of"
            )
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LOGPROBS:
            raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {request.logprobs}", "logprobs")
        max_tokens = 16 if request.max_tokens is None else request.max_tokens
        params = self.sampling_params(request, max_tokens, request.logprobs)
        prompts = _prompt_list(request.prompt)
        self.check_num_sequences(len(prompts), request.n)
        checked = []
        for i, prompt in enumerate(prompts):
            where = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
            text, ids = self.check_prompt(prompt, params, "prompt", where)
            self.check_length(len(ids), params.max_tokens, "max_tokens")
            checked.append((text, ids))
        return model, checked, self.child_params(params, request.n)

    async def create_completion(self, request: CompletionRequest):
        """A CompletionResponse, or an async iterator of SSE strings when `request.stream`. Prepared
        (tokenized) on the tokenizer thread."""
        model, prompts, params = await self.run_blocking(self.prepare, request)
        self.check_capacity(len(prompts) * len(params))
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        as_ids = bool(request.return_tokens_as_token_ids)
        outputs = self.generate(request_id, prompts, params)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            num_choices = len(prompts) * len(params)
            return self._stream(
                outputs,
                request_id,
                created,
                model,
                num_choices,
                len(params),
                request.logprobs,
                as_ids,
                include_usage,
            )
        choices = await self.collect(request_id, outputs, len(prompts) * len(params))
        return CompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=[
                CompletionResponseChoice(
                    index=i,
                    text=c.text,
                    logprobs=self._logprobs(c.token_ids, c.logprobs, request.logprobs, 0, as_ids),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for i, c in enumerate(choices)
            ],
            usage=self.usage(choices, len(params)),
        )

    def _stream(
        self,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
        request_id: str,
        created: int,
        model: str,
        num_choices: int,
        n: int,
        num_logprobs: int | None,
        as_ids: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}

        def chunk(i: int, out: RequestOutput, offset: int) -> CompletionStreamResponse:
            c = out.outputs[0]
            choice = CompletionResponseChoice(
                index=i,
                text=c.text,
                logprobs=self._logprobs(c.token_ids, c.logprobs, num_logprobs, offset, as_ids),
                finish_reason=c.finish_reason if out.finished else None,
            )
            if out.finished:
                choice.stop_reason = c.stop_reason
            return CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice], **extra
            )

        def usage_chunk(usage: UsageInfo) -> CompletionStreamResponse:
            return CompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[], usage=usage
            )

        return self.stream(
            request_id,
            outputs,
            num_choices,
            n,
            chunk,
            usage_chunk if include_usage else None,
            keep_empty=num_logprobs is not None,
        )

    def _logprobs(
        self,
        token_ids: list[int],
        entries: list[dict[int, float]] | None,
        n: int | None,
        text_offset: int,
        as_ids: bool,
    ) -> CompletionLogProbs | None:
        """OpenAI's legacy logprobs of `token_ids`; text offsets start at `text_offset`."""
        if n is None:
            return None
        out = CompletionLogProbs()
        for t, entry in zip(token_ids, entries or []):
            token = self.token_str(t, as_ids)
            out.tokens.append(token)
            out.token_logprobs.append(max(entry[t], MIN_LOGPROB))
            out.top_logprobs.append(
                {self.token_str(k, as_ids): lp for k, lp in self.top_logprobs(entry, n)} or None
            )
            out.text_offset.append(text_offset)
            text_offset += len(self.token_str(t, False))
        return out


def _prompt_list(prompt) -> list:
    """OpenAI's prompt field as a list of prompts (text or token ids)."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)
