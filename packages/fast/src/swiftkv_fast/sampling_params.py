"""Per-request sampling settings (vLLM's names). `temperature == 0` is greedy.

Validated on construction and again by `LLM.generate` (the fields can be reassigned): a wrong type
is a TypeError, a wrong value a ValueError, and the message starts with the field's name.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral, Real

# what torch.Generator.manual_seed accepts (a negative seed s is used as s + 2**64)
SEED_RANGE = (-(2**63), 2**64)
# a positive temperature: the sampler divides fp32 logits by it, which overflow (or all become 0) outside
TEMPERATURE_RANGE = (1e-30, 1e30)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None  # per-request generator seed in [-2**63, 2**64); None: from the engine's seed
    max_tokens: int = 16
    # before this many outputs, EOS (unless ignore_eos) and stop_token_ids are never sampled (their
    # logits are masked to -inf, as vLLM) and stop strings do not stop the request: a stop string
    # counts only if it ends in the text of output token min_tokens + 1 or later (engine.stop)
    min_tokens: int = 0
    stop: str | list[str] | None = None  # one string or a list; stored as a list
    stop_token_ids: list[int] | None = None  # stored as a list
    ignore_eos: bool = False
    logprobs: int | None = None  # report the chosen token's log-prob and the top-n (0: chosen only)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Stores the fields as Python types (`stop` and `stop_token_ids` as lists, numpy or other
        integral / real numbers as int / float), raising TypeError (wrong type) or ValueError (wrong
        value) with a message that starts with the field's name."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None or isinstance(self.stop, tuple):
            self.stop = list(self.stop or [])
        if self.stop_token_ids is None or isinstance(self.stop_token_ids, tuple):
            self.stop_token_ids = list(self.stop_token_ids or [])
        self.temperature = _real("temperature", self.temperature)
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        lo, hi = TEMPERATURE_RANGE
        if self.temperature != 0 and not lo <= self.temperature <= hi:
            raise ValueError(f"temperature must be 0 (greedy) or in [{lo:g}, {hi:g}], got {self.temperature}")
        self.top_p = _real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.top_k = _int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive int, got {self.top_k}")
        self.max_tokens = _int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens}")
        self.min_tokens = _int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.seed is not None:
            self.seed = _int("seed", self.seed, "an int or None")
            if not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
                raise ValueError(f"seed must be in [-2**63, 2**64) or None, got {self.seed}")
        if self.logprobs is not None:
            self.logprobs = _int("logprobs", self.logprobs, "an int or None")
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be None or an int >= 0, got {self.logprobs}")
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {describe(self.ignore_eos)}")
        if not isinstance(self.stop, list):
            raise TypeError(f"stop must be a str or a list of str, got {describe(self.stop)}")
        for j, s in enumerate(self.stop):
            if not isinstance(s, str):
                raise TypeError(f"stop[{j}] must be a str, got {describe(s)}")
            if not s:
                raise ValueError(f"stop[{j}] must not be empty")
        if not isinstance(self.stop_token_ids, list):
            raise TypeError(f"stop_token_ids must be a list of int, got {describe(self.stop_token_ids)}")
        for j, t in enumerate(self.stop_token_ids):
            self.stop_token_ids[j] = _int(f"stop_token_ids[{j}]", t)
            if t < 0:
                raise ValueError(f"stop_token_ids[{j}] must be >= 0, got {t}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def describe(value) -> str:
    """`str '0.5'`: a value's type and (shortened) repr, for error messages about bad input."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


def _real(name: str, value) -> float | int:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a real number, got {describe(value)}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        finite = False
    if not finite:
        raise ValueError(f"{name} must be finite, got {value}")
    return value if isinstance(value, (int, float)) else float(value)


def _int(name: str, value, what: str = "an int") -> int:
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be {what}, got {describe(value)}")
    return int(value)
