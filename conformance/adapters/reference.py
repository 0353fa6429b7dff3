"""`reference`: the pure-PyTorch oracle (`swiftkv_reference`), fp32 on CPU.

As an implementation under test it runs all prompts of a case in ONE `generate` call, while the
oracle side of every comparison runs each prompt alone: the reference is held to batch-composition
invariance, and the harness itself is exercised end to end (like array-api-tests' meta tests).
Engine options (block size, chunking, caching) do not exist in the reference.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any

import torch

from .base import (
    CharTokenizer,
    EngineOptions,
    Implementation,
    Output,
    Runner,
    Sampling,
    dataclass_kwargs,
    top_logprobs_from_logits,
)


def _settings_class() -> Any:
    from swiftkv_reference import generate as gen_mod
    from swiftkv_reference import sampling as sampling_mod

    for mod in (sampling_mod, gen_mod):
        for name in ("SamplingSettings", "SamplingParams"):
            if hasattr(mod, name):
                return getattr(mod, name)
    raise ImportError("swiftkv_reference has no SamplingSettings (looked in .sampling and .generate)")


def to_settings(s: Sampling) -> Any:
    cls = _settings_class()
    return cls(
        **dataclass_kwargs(
            cls,
            {
                "max_tokens": s.max_tokens,
                "temperature": s.temperature,
                "top_p": s.top_p,
                "top_k": s.top_k,
                "seed": s.seed,
                "ignore_eos": s.ignore_eos,
                "logprobs": s.logprobs,
            },
        )
    )


def build_reference_model(
    config: Any, state_dict: dict[str, torch.Tensor], dtype=torch.float32
) -> torch.nn.Module:
    from swiftkv_reference.model import SwiftKVForCausalLM

    model = SwiftKVForCausalLM(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    # tied embeddings may legitimately leave lm_head out of the state dict
    missing = [
        m for m in missing if not (m == "lm_head.weight" and getattr(config, "tie_word_embeddings", False))
    ]
    if missing or unexpected:
        raise ValueError(f"reference model: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()


def reference_generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    sampling: list[Sampling],
    prefill_chunk: int | None = None,
) -> list[Output]:
    """`swiftkv_reference.generate`, plus vLLM's `min_tokens` and stop strings (which it does not
    have) for greedy requests: see `_generate_with_stop_rules`."""
    if any(s.min_tokens or s.stop for s in sampling):
        return [_generate_with_stop_rules(model, p, s, prefill_chunk) for p, s in zip(prompts, sampling)]
    return _generate(model, prompts, sampling, prefill_chunk)


def _generate(
    model: torch.nn.Module, prompts: list[list[int]], sampling: list[Sampling], prefill_chunk: int | None
) -> list[Output]:
    from swiftkv_reference.generate import generate

    kwargs = {"prefill_chunk": prefill_chunk} if prefill_chunk is not None else {}
    with torch.inference_mode():
        gens = generate(model, [list(p) for p in prompts], [to_settings(s) for s in sampling], **kwargs)
    outs = []
    for g, s in zip(gens, sampling):
        logits = getattr(g, "logits", None)
        if logits is not None:
            logits = torch.stack(list(logits)) if isinstance(logits, (list, tuple)) else logits
            logits = logits.detach().float().cpu().reshape(len(g.token_ids), -1)
        outs.append(
            Output(
                token_ids=list(g.token_ids),
                logprobs=[float(x) for x in (getattr(g, "logprobs", None) or [])],
                top_logprobs=top_logprobs_from_logits(logits, s.top_n) if logits is not None else None,
                logits=logits,
                text=CharTokenizer.for_config(model.config).decode(list(g.token_ids)),
                finish_reason=getattr(g, "finish_reason", None),
            )
        )
    return outs


def _generate_with_stop_rules(
    model: torch.nn.Module, prompt: list[int], s: Sampling, prefill_chunk: int | None
) -> Output:
    """Greedy generation with vLLM's rules on top of the reference's generator:

    - min_tokens: an EOS chosen as output i < min_tokens is replaced by the best other token (the
      row's EOS logits masked), and generation resumes from the prompt plus the outputs so far;
    - stop strings (in `CharTokenizer` text of the outputs only, never the prompt): the output ends
      with the first token whose text completes one (ending after the text of the first min_tokens
      outputs), every token kept; the text is cut before the earliest such stop string.
    Logits and logprobs rows are those of the raw model (the mask only changes the choice)."""
    if s.temperature != 0:
        raise ValueError(f"the reference serves min_tokens and stop strings for greedy requests only: {s}")
    eos = set(model.config.eos_token_id)
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    while True:
        rest = dataclasses.replace(s, max_tokens=s.max_tokens - len(tokens), min_tokens=0, stop=())
        out = _generate(model, [prompt + tokens], [rest], prefill_chunk)[0]
        new = out.token_ids
        rows.append(out.logits)
        last = len(tokens) + len(new) - 1
        if s.ignore_eos or new[-1] not in eos or last >= s.min_tokens:
            tokens += new
            break
        masked = out.logits[-1].clone()
        masked[sorted(eos)] = float("-inf")
        tokens += new[:-1] + [int(masked.argmax())]
        if len(tokens) == s.max_tokens:
            break
    logits = torch.cat(rows)
    finish = "stop" if not s.ignore_eos and tokens[-1] in eos else "length"
    tokenizer = CharTokenizer.for_config(model.config)
    text = tokenizer.decode(tokens)
    if s.stop:
        boundary = len(tokenizer.decode(tokens[: s.min_tokens]))
        for t in range(s.min_tokens, len(tokens)):
            text = tokenizer.decode(tokens[: t + 1])
            hits = [(text.find(x, max(0, boundary - len(x) + 1)), x) for x in s.stop]
            hits = [h for h in hits if h[0] >= 0]
            if hits:
                tokens, logits, text, finish = tokens[: t + 1], logits[: t + 1], text[: min(hits)[0]], "stop"
                break
    logprobs = torch.log_softmax(logits, dim=-1)
    return Output(
        token_ids=tokens,
        logprobs=[float(logprobs[i, t]) for i, t in enumerate(tokens)],
        top_logprobs=top_logprobs_from_logits(logits, s.top_n),
        logits=logits,
        text=text,
        finish_reason=finish,
    )


class ReferenceRunner(Runner):
    """The reference as an implementation under test: the whole batch in one call, prompts prefilled in
    chunks of PREFILL_CHUNK tokens through its naive cache (the oracle side prefills each prompt at once)."""

    PREFILL_CHUNK = 7

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[Output]:
        return reference_generate(self.model, prompts, sampling, prefill_chunk=self.PREFILL_CHUNK)


class Reference(Implementation):
    name = "reference"
    has_engine = False

    def __init__(self, dtype: torch.dtype):
        super().__init__(torch.float32)  # the oracle always runs fp32 on CPU, whatever --dtype says

    @classmethod
    def available(cls) -> tuple[bool, str]:
        try:
            import swiftkv_reference.generate  # noqa: F401
            import swiftkv_reference.model  # noqa: F401
        except ImportError as exc:
            return False, f"swiftkv_reference not importable: {exc}"
        return True, ""

    @classmethod
    def version(cls) -> str:
        try:
            return importlib.metadata.version("swiftkv-reference")
        except importlib.metadata.PackageNotFoundError:
            return "?"

    def unsupported(self, engine: EngineOptions) -> str | None:
        if engine != self.default_engine():
            return "engine options (block size, chunking, caching, pool size) do not apply to the reference"
        return None

    def build(self, config: Any, state_dict: dict[str, torch.Tensor], engine: EngineOptions) -> Runner:
        return ReferenceRunner(build_reference_model(config, state_dict, torch.float32))
