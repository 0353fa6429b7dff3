"""`reference`: the pure-PyTorch oracle (`swiftkv_reference`), fp32 on CPU.

As an implementation under test it runs all prompts of a case in ONE `generate` call, while the
oracle side of every comparison runs each prompt alone: the reference is held to batch-composition
invariance, and the harness itself is exercised end to end (like array-api-tests' meta tests).
Engine options (block size, chunking, caching) do not exist in the reference.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

import torch

from .base import (
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
                top_logprobs=top_logprobs_from_logits(logits, s.logprobs) if logits is not None else None,
                logits=logits,
            )
        )
    return outs


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
