"""OpenAI's request and response schemas (vLLM's `protocol.py`, the subset we serve).

Requests: JSON types are strict (`"0.5"` is not a number, `1` is not a bool), values are checked by
`SamplingParams` and the serving classes, each error names its field. Fields we do not know are
ignored with a warning, as vLLM does (clients send vendor extras). vLLM's extra sampling fields
(`top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids`) come in the body (the openai client's
`extra_body`). Responses: OpenAI's field names and nulls; stream chunks are serialized with
`exclude_unset`, so a field appears exactly when the server set it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    field_validator,
)

# ---- requests -----------------------------------------------------------------------------------


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: StrictBool | None = False


class SamplingRequest(OpenAIBaseModel):
    """The fields completions and chat completions share."""

    model: StrictStr | None = None  # None: the first served model name (vLLM)
    n: StrictInt = 1
    temperature: StrictFloat | None = None  # None: 1.0
    top_p: StrictFloat | None = None  # None: 1.0
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    user: StrictStr | None = None
    # accepted at their neutral value only (the engine does not implement them)
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    # vLLM's extra sampling parameters
    top_k: StrictInt | None = None  # None, 0 or -1: off
    min_tokens: StrictInt = 0
    ignore_eos: StrictBool = False
    stop_token_ids: list[StrictInt] | None = None
    repetition_penalty: StrictFloat | None = None
    min_p: StrictFloat | None = None
    return_tokens_as_token_ids: StrictBool | None = None  # logprobs name tokens "token_id:<id>"


TOKEN_PROMPT_KINDS = "a string, a list of strings, a list of token ids or a list of lists of token ids"


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: StrictInt | None = 16
    logprobs: StrictInt | None = None
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_kind(cls, v: Any) -> Any:
        def is_ids(x) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or is_ids(v):
            return v
        if isinstance(v, list) and v and (all(isinstance(p, str) for p in v) or all(is_ids(p) for p in v)):
            return v
        raise ValueError(f"must be {TOKEN_PROMPT_KINDS}")


class ContentPart(OpenAIBaseModel):
    type: StrictStr
    text: StrictStr | None = None


class ChatMessage(OpenAIBaseModel):
    role: StrictStr
    content: StrictStr | list[ContentPart] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: StrictInt | None = None  # None (both): up to max_model_len
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    add_generation_prompt: StrictBool = True  # vLLM's extra


# ---- responses ----------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or string that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class StreamResponse(BaseModel):
    """A stream chunk: serialized with exclude_unset, `object` included."""

    def model_post_init(self, context: Any) -> None:
        self.model_fields_set.add("object")


class CompletionStreamResponse(StreamResponse):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None
    refusal: list[ChatCompletionLogProbsContent] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(StreamResponse):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "swiftkv"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
