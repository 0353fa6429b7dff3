"""POST /v1/chat/completions (vLLM's `OpenAIServingChat`): messages through the tokenizer's chat
template -> n assistant messages, as one JSON response or a stream of server-sent events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from swiftkv_fast.entrypoints.errors import APIError, bad_request
from swiftkv_fast.entrypoints.protocol import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatResponseMessage,
    DeltaMessage,
    UsageInfo,
)
from swiftkv_fast.entrypoints.serving_engine import (
    MAX_LOGPROBS,
    MIN_LOGPROB,
    OpenAIServing,
)
from swiftkv_fast.outputs import RequestOutput


class OpenAIServingChat(OpenAIServing):
    def prepare(self, request: ChatCompletionRequest):
        """Every check; -> (model name, [(None, prompt ids)], params per choice, top logprobs or None)."""
        model = self.check_model(request.model)
        self.check_request(request)
        self.check_num_sequences(1, request.n)
        if request.tools:
            raise bad_request("tools are not supported by this server", "tools")
        if request.tool_choice not in (None, "none"):
            raise bad_request("tool_choice is not supported by this server", "tool_choice")
        if request.response_format not in (None, {"type": "text"}):
            raise bad_request(
                'only response_format {"type": "text"} is supported by this server', "response_format"
            )
        num_logprobs = None
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
            if not 0 <= request.top_logprobs <= MAX_LOGPROBS:
                raise bad_request(
                    f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {request.top_logprobs}", "top_logprobs"
                )
        if request.logprobs:
            num_logprobs = request.top_logprobs or 0
        ids = self._chat_token_ids(request)
        max_tokens = request.max_completion_tokens
        field = "max_completion_tokens"
        if max_tokens is None and request.max_tokens is not None:
            max_tokens, field = request.max_tokens, "max_tokens"
        if max_tokens is None:  # as much as the context allows (OpenAI's and vLLM's default)
            max_tokens, field = max(1, self.engine.max_model_len - len(ids)), "messages"
        try:
            params = self.sampling_params(request, max_tokens, num_logprobs)
        except APIError as e:  # max_tokens: name the field the request used
            if e.param == "max_tokens":
                e.param, e.message = field, e.message.replace("max_tokens", field, 1)
            raise
        self.check_prompt({"prompt_token_ids": ids}, params, "messages", "messages")
        self.check_length(len(ids), params.max_tokens, field)
        return model, [(None, ids)], self.child_params(params, request.n), num_logprobs

    def _chat_token_ids(self, request: ChatCompletionRequest) -> list[int]:
        if not request.messages:
            raise bad_request("messages must not be empty", "messages")
        messages = []
        for i, m in enumerate(request.messages):
            content = m.content
            if isinstance(content, list):
                for j, part in enumerate(content):
                    if part.type != "text" or part.text is None:
                        raise bad_request(
                            f"only text content parts are supported, got type {part.type!r}",
                            "messages",
                            where=f"messages[{i}].content[{j}]",
                        )
                content = "".join(part.text for part in content)
            messages.append({"role": m.role, "content": content or ""})
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise bad_request("chat needs a tokenizer, and this model has none", "messages")
        from swiftkv_fast.model.loader import chat_token_ids

        try:
            return chat_token_ids(tokenizer, messages, add_generation_prompt=request.add_generation_prompt)
        except Exception as e:  # the template's own checks (roles, order)
            raise bad_request(f"applying the chat template failed: {e}", "messages") from None

    async def create_chat_completion(self, request: ChatCompletionRequest):
        """A ChatCompletionResponse, or an async iterator of SSE strings when `request.stream`. Prepared
        (templated, tokenized) on the tokenizer thread."""
        model, prompts, params, num_logprobs = await self.run_blocking(self.prepare, request)
        self.check_capacity(len(params))
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        as_ids = bool(request.return_tokens_as_token_ids)
        outputs = self.generate(request_id, prompts, params)
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return self._stream(
                outputs, request_id, created, model, len(params), num_logprobs, as_ids, include_usage
            )
        choices = await self.collect(request_id, outputs, len(params))
        return ChatCompletionResponse(
            id=request_id,
            created=created,
            model=model,
            choices=[
                ChatCompletionResponseChoice(
                    index=i,
                    message=ChatResponseMessage(content=c.text),
                    logprobs=self._logprobs(c.token_ids, c.logprobs, num_logprobs, as_ids),
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
        n: int,
        num_logprobs: int | None,
        as_ids: bool,
        include_usage: bool,
    ) -> AsyncIterator[str]:
        extra = {"usage": None} if include_usage else {}

        def response(choice: ChatCompletionResponseStreamChoice) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[choice], **extra
            )

        def chunk(i: int, out: RequestOutput, offset: int) -> ChatCompletionStreamResponse:
            c = out.outputs[0]
            choice = ChatCompletionResponseStreamChoice(
                index=i,
                delta=DeltaMessage(content=c.text) if c.text else DeltaMessage(),
                logprobs=self._logprobs(c.token_ids, c.logprobs, num_logprobs, as_ids),
                finish_reason=c.finish_reason if out.finished else None,
            )
            if out.finished:
                choice.stop_reason = c.stop_reason
            return response(choice)

        def usage_chunk(usage: UsageInfo) -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(
                id=request_id, created=created, model=model, choices=[], usage=usage
            )

        roles = [  # OpenAI's first chunk of each choice: the role
            response(
                ChatCompletionResponseStreamChoice(
                    index=i,
                    delta=DeltaMessage(role="assistant", content=""),
                    logprobs=None,
                    finish_reason=None,
                )
            )
            for i in range(n)
        ]
        return self.stream(
            request_id,
            outputs,
            n,
            n,
            chunk,
            usage_chunk if include_usage else None,
            first=roles,
            keep_empty=num_logprobs is not None,
        )

    def _logprobs(
        self, token_ids: list[int], entries: list[dict[int, float]] | None, n: int | None, as_ids: bool
    ) -> ChatCompletionLogProbs | None:
        if n is None:
            return None
        content = []
        for t, entry in zip(token_ids, entries or []):
            token = self.token_str(t, as_ids)
            content.append(
                ChatCompletionLogProbsContent(
                    token=token,
                    logprob=max(entry[t], MIN_LOGPROB),
                    bytes=list(token.encode()),
                    top_logprobs=[
                        ChatCompletionLogProb(
                            token=(s := self.token_str(k, as_ids)), logprob=lp, bytes=list(s.encode())
                        )
                        for k, lp in self.top_logprobs(entry, n)
                    ],
                )
            )
        return ChatCompletionLogProbs(content=content)
