"""What `LLM.generate` and `LLM.chat` accept, checked before any request reaches the engine.

A prompt is a text (`str`), token ids (a list of int, or a 1-D integer tensor), or a dict with
`prompt` (text) and/or `prompt_token_ids` (vLLM's TextPrompt / TokensPrompt; with both, the ids are
used and the text is reported). A chat conversation is a list of {"role": str, "content": str}
messages; a plain `str` is one conversation of one user message. Errors are TypeError (wrong type)
or ValueError (wrong value) and name the request (or conversation and message) and the field.
"""

from __future__ import annotations

from collections.abc import Iterable
from numbers import Integral, Number

import torch

from swiftkv_fast.sampling_params import SamplingParams, describe

PromptType = str | list[int] | torch.Tensor | dict

_PROMPT_KINDS = (
    "a str, a list of token ids (int), a 1-D integer tensor or a dict with 'prompt' or 'prompt_token_ids'"
)


def is_single_prompt(prompts) -> bool:
    """True when `generate`'s first argument is one prompt rather than a list of them."""
    if prompts is None or isinstance(prompts, (str, dict)):
        return True
    if hasattr(prompts, "ndim"):  # a tensor or array: 1-D is one prompt, 2-D a batch of rows
        return prompts.ndim <= 1
    if isinstance(prompts, (list, tuple)):
        return bool(prompts) and isinstance(prompts[0], Number)
    return not isinstance(prompts, Iterable)


def parse_prompt(i: int, prompt, tokenizer) -> tuple[str | None, list[int]]:
    """-> (text or None, token ids) of request `i`; the ids are not range-checked yet."""
    if isinstance(prompt, dict):
        unknown = sorted(repr(k) for k in prompt if k not in ("prompt", "prompt_token_ids"))
        if unknown:
            raise ValueError(
                f"request {i}: unknown prompt keys {', '.join(unknown)}; a dict prompt has 'prompt' "
                "and/or 'prompt_token_ids'"
            )
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise TypeError(f"request {i}: prompt must be a str, got {describe(text)}")
        if "prompt_token_ids" in prompt:
            return text, _token_ids(i, prompt["prompt_token_ids"])
        if text is None:
            raise ValueError(f"request {i}: a dict prompt needs 'prompt' or 'prompt_token_ids'")
        prompt = text
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"request {i}: prompt is empty")
        if tokenizer is None:
            raise ValueError(f"request {i}: a text prompt needs a tokenizer; pass token ids instead")
        return prompt, [int(t) for t in tokenizer(prompt)["input_ids"]]
    if prompt is None or isinstance(prompt, (bytes, Number)) or not isinstance(prompt, Iterable):
        raise TypeError(f"request {i}: prompt must be {_PROMPT_KINDS}, got {describe(prompt)}")
    return None, _token_ids(i, prompt)


def _token_ids(i: int, ids) -> list[int]:
    if isinstance(ids, torch.Tensor):
        if ids.ndim != 1:
            raise ValueError(
                f"request {i}: prompt_token_ids must be a 1-D tensor, got shape {tuple(ids.shape)}"
            )
        if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"request {i}: prompt_token_ids must be an integer tensor, got {ids.dtype}")
        return ids.tolist()
    if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Iterable):
        raise TypeError(
            f"request {i}: prompt_token_ids must be a list of int or a 1-D integer tensor, "
            f"got {describe(ids)}"
        )
    ids = list(ids)
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, Integral):
            raise TypeError(f"request {i}: prompt_token_ids[{j}] must be an int, got {describe(t)}")
    return [int(t) for t in ids]


def validate_request(
    i: int, ids: list[int], params, vocab_size: int, max_model_len: int, has_tokenizer: bool
) -> None:
    """Request `i` against the model: prompt length and ids, and its sampling parameters."""
    if not ids:
        raise ValueError(f"request {i}: prompt is empty (0 tokens)")
    if len(ids) > max_model_len:
        raise ValueError(
            f"request {i}: prompt has {len(ids)} tokens, more than max_model_len={max_model_len}"
        )
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"request {i}: prompt_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
        )
    if not isinstance(params, SamplingParams):
        raise TypeError(f"request {i}: sampling_params must be a SamplingParams, got {describe(params)}")
    try:
        params.validate()
    except (TypeError, ValueError) as e:
        raise type(e)(f"request {i}: sampling_params.{e}") from None
    bad = [t for t in params.stop_token_ids if t >= vocab_size]
    if bad:
        raise ValueError(
            f"request {i}: sampling_params.stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"
        )
    if params.logprobs is not None and params.logprobs > vocab_size:
        raise ValueError(
            f"request {i}: sampling_params.logprobs: requested sample logprobs of {params.logprobs}, which "
            f"is greater than max allowed: {vocab_size} (the vocabulary size)"
        )
    if params.stop and not has_tokenizer:
        raise ValueError(
            f"request {i}: sampling_params.stop needs a tokenizer (stop strings are matched in the "
            "detokenized text); use stop_token_ids"
        )


def parse_conversations(messages) -> list[list[dict]]:
    """`LLM.chat`'s first argument as a list of checked conversations: a str is one user message; a
    list of message dicts is one conversation; a list of conversations (or of str) is a batch."""
    if isinstance(messages, str):
        messages = [messages]
    if not isinstance(messages, (list, tuple)):
        raise TypeError(
            "chat messages must be a str, a list of {'role', 'content'} dicts (one conversation) or a "
            f"list of conversations, got {describe(messages)}"
        )
    conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
    return [_conversation(i, conv) for i, conv in enumerate(conversations)]


def _conversation(i: int, conv) -> list[dict]:
    if isinstance(conv, str):
        return [{"role": "user", "content": conv}]
    if not isinstance(conv, (list, tuple)):
        raise TypeError(f"conversation {i} must be a str or a list of message dicts, got {describe(conv)}")
    if not conv:
        raise ValueError(f"conversation {i} is empty")
    for j, m in enumerate(conv):
        if not isinstance(m, dict):
            raise TypeError(
                f"conversation {i}, message {j} must be a dict with 'role' and 'content', got {describe(m)}"
            )
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"conversation {i}, message {j} has no {key!r}")
            if not isinstance(m[key], str):
                raise TypeError(f"conversation {i}, message {j}: {key} must be a str, got {describe(m[key])}")
    return list(conv)
