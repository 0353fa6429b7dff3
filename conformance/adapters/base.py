"""The one interface an implementation provides to the conformance suite.

A new backend joins the suite by adding a subclass of `Implementation` (and listing it in
`adapters/__init__.py`); no test changes. The tests only ever see:

    impl.available()                      -> (ok, reason)     can it run on this machine?
    impl.unsupported(engine, dtype)       -> reason or None   a case this implementation cannot serve
    impl.build(config, state_dict, engine, dtype) -> Runner   one engine on tiny random weights
    runner.generate(prompts, sampling)    -> list[Output]     token ids, logprobs, fp32 logits rows
"""

from __future__ import annotations

import dataclasses
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

ENV_VARS = (
    "TRITON_INTERPRET",
    "CUDA_VISIBLE_DEVICES",
    "CUDA_LAUNCH_BLOCKING",
    "TORCH_COMPILE_DISABLE",
    "PYTORCH_CUDA_ALLOC_CONF",
    "SWIFTKV_IMPL",
    "HF_HUB_OFFLINE",
    "OMP_NUM_THREADS",
)


@dataclass(frozen=True)
class EngineOptions:
    """Scheduling / cache knobs of an engine. `None` means the implementation's default."""

    block_size: int = 16
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = False
    max_model_len: int | None = None

    def replace(self, **changes: Any) -> EngineOptions:
        return dataclasses.replace(self, **changes)

    def short(self) -> str:
        parts = [f"bs{self.block_size}"]
        if self.max_num_batched_tokens is not None:
            parts.append(f"chunk{self.max_num_batched_tokens}")
        if self.max_num_seqs is not None:
            parts.append(f"seqs{self.max_num_seqs}")
        if self.num_kv_blocks is not None:
            parts.append(f"blocks{self.num_kv_blocks}")
        if self.max_model_len is not None:
            parts.append(f"len{self.max_model_len}")
        parts.append("pc" if self.enable_prefix_caching else "nopc")
        return "-".join(parts)


@dataclass(frozen=True)
class Sampling:
    """One request's sampling settings, in the names both packages share (vLLM's)."""

    max_tokens: int = 4
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    logprobs: int | None = 5  # top-n logprobs, needed by the low-precision rule (None: none asked for)
    ignore_eos: bool = True  # fixed lengths: tiny random models emit EOS by chance
    min_tokens: int = 0  # before this many outputs, EOS is never produced (its logit is masked)
    stop: tuple[str, ...] = ()  # stop strings, searched in the output text (`CharTokenizer`)

    @property
    def top_n(self) -> int:
        """How many top logprobs per position the comparison takes: `logprobs`, or the low-precision
        rule's 5 where the request asks for none (then from the returned logits rows)."""
        return self.logprobs if self.logprobs is not None else 5


@dataclass
class Output:
    """One request's generation. Row i of every field belongs to generated token i."""

    token_ids: list[int]
    logprobs: list[float] = field(default_factory=list)  # log-prob of each chosen token
    top_logprobs: list[dict[int, float]] | None = None  # top-n {token: logprob} at each position
    logits: torch.Tensor | None = None  # (len(token_ids), vocab) fp32 logits at the sampled positions
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    text: str | None = None  # the output text (`CharTokenizer`), cut before a stop string
    finish_reason: str | None = None  # "stop" or "length"


class Runner(ABC):
    """A built engine (or model) on one set of weights."""

    @abstractmethod
    def generate(self, prompts: list[list[int]], sampling: list[Sampling]) -> list[Output]:
        """Outputs in input order."""

    def counters(self) -> dict[str, int]:
        """Engine counters the suite can check (e.g. "num_preemptions"); {} when not exposed."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release memory (GPU engines)."""


class Implementation(ABC):
    """A stateless description of one implementation under test."""

    name: ClassVar[str]  # the test id
    gpu: ClassVar[bool] = False  # part of `--impl gpu`
    interpreted: ClassVar[bool] = False  # slow (Triton interpreter): only the small cases run
    has_engine: ClassVar[bool] = True  # scheduling knobs exist (tests marked `engine` apply)
    lossy_kv_cache: ClassVar[bool] = False  # K/V stored rounded (a bf16 cache under an fp32 model)
    # the tiny models' weights it runs on, the reference oracle too: "random", "four-bit" (a dequantized
    # Q4_1 checkpoint's values) or "bf16" (rounded to bf16), for kernels that apply only to those
    weights: ClassVar[str] = "random"
    # features whose cases it cannot take part in: "seeded-sampling" (its sampler draws other tokens for a
    # seed than the reference's), "stop-strings" (no detokenizer for the tiny models' ids)
    lacks: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype

    @property
    def exact(self) -> bool:
        """Held to the fp32 rule (the reference's greedy tokens, logits within 1e-4): fp32 throughout,
        the KV cache included. Otherwise vLLM's low-precision rule (top-5) applies."""
        return self.dtype == torch.float32 and not self.lossy_kv_cache

    @classmethod
    @abstractmethod
    def available(cls) -> tuple[bool, str]:
        """(True, "") or (False, why it cannot run on this machine)."""

    @classmethod
    def version(cls) -> str:
        return "?"

    @classmethod
    def device(cls) -> str:
        return "cpu"

    def default_engine(self) -> EngineOptions:
        return EngineOptions()

    def require(self, feature: str) -> None:
        """Skip the calling test when this implementation lacks `feature` (see `lacks`)."""
        if feature in self.lacks:
            import pytest

            pytest.skip(f"{self.name} does not take part in {feature} cases")

    def unsupported(self, engine: EngineOptions) -> str | None:
        """A reason this implementation cannot serve `engine` (the case is skipped), or None."""
        return None

    @abstractmethod
    def build(self, config: Any, state_dict: dict[str, torch.Tensor], engine: EngineOptions) -> Runner: ...

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        weights = "" if self.weights == "random" else f" weights={self.weights}"
        return f"{self.name} {self.version()} device={self.device()} dtype={dtype}{weights}"


class CharTokenizer:
    """The suite's tokenizer for tiny random models: token id i is the one character
    chr(0x100 + i), so a stop string is a run of token ids. Special ids are skipped when
    decoding (as Hugging Face's `skip_special_tokens=True`)."""

    FIRST = 0x100

    def __init__(self, special_ids: set[int] | frozenset[int] = frozenset()):
        self.special_ids = frozenset(special_ids)

    @classmethod
    def for_config(cls, config: Any) -> CharTokenizer:
        """Skips the model's EOS and BOS ids."""
        return cls({*config.eos_token_id, *([] if config.bos_token_id is None else [config.bos_token_id])})

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        skip = self.special_ids if skip_special_tokens else frozenset()
        return "".join(chr(self.FIRST + t) for t in token_ids if t not in skip)

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) - self.FIRST for c in text]}


def env_snapshot() -> dict[str, str]:
    return {k: os.environ[k] for k in ENV_VARS if k in os.environ}


def top_logprobs_from_logits(logits: torch.Tensor, k: int) -> list[dict[int, float]]:
    """Top-k {token: logprob} per row, computed from fp32 logits rows (log_softmax of the raw row)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, indices = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [dict(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]


def dataclass_kwargs(cls: Any, wanted: dict[str, Any]) -> dict[str, Any]:
    """The entries of `wanted` that `cls` (a dataclass or a class with keyword init) accepts."""
    if dataclasses.is_dataclass(cls):
        names = {f.name for f in dataclasses.fields(cls)}
    else:
        import inspect

        params = inspect.signature(cls).parameters
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            return dict(wanted)
        names = set(params)
    return {k: v for k, v in wanted.items() if k in names}
