"""Sampling: the one algorithm both packages implement, token for token on CPU.

For one request and one step, `logits` is the fp32 row (vocab,) of the model output:

1. `logprobs = log_softmax(logits)` of the raw logits: what is reported (see `generate`).
2. `temperature == 0`: the token is `argmax(logits)` (lowest index on ties). Done; no random draw.
3. `x = logits / temperature`.
4. top-k (`top_k > 0`; 0 or -1 disable it): `x[x < topk(x, k).values[-1]] = -inf`
   (k is clamped to the vocab size; ties with the k-th value are kept).
5. top-p (`top_p < 1`): `p = softmax(x)`; sort `p` descending with a stable sort; `cum = cumsum(sorted)`;
   drop the sorted entries whose `cum - p_sorted >= top_p` (the first is always kept); set the dropped
   entries of `x` to `-inf`.
6. `probs = softmax(x)`; `q = torch.empty_like(probs).exponential_(generator=g)`;
   token = `argmax(probs / q)` (the exponential-race form of sampling from `probs`).

`g` is a per-request CPU `torch.Generator` seeded once with the request's seed and used for nothing
else: one `exponential_` draw of `vocab_size` fp32 values per sampled token; greedy steps draw nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingSettings:
    """Per-request sampling and stopping (names follow vLLM's SamplingParams)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # > 0 enables top-k; 0 or -1 disable it
    top_p: float = 1.0  # < 1 enables top-p (nucleus)
    seed: int | None = None  # None: a nondeterministic seed
    max_tokens: int = 16
    stop_token_ids: list[int] = field(default_factory=list)  # stop on these (kept in the output)
    ignore_eos: bool = False  # True: do not stop on the model's eos_token_id

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disable it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {self.max_tokens!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator:
        """The request's CPU generator, seeded once."""
        g = torch.Generator(device="cpu")
        if self.seed is None:
            g.seed()
        else:
            g.manual_seed(self.seed)
        return g


def apply_top_k_top_p(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Steps 4-5 on temperature-scaled logits x (vocab,): a copy with dropped entries set to -inf."""
    x = x.clone()
    if top_k > 0:
        k = min(top_k, x.shape[-1])
        x[x < torch.topk(x, k).values[-1]] = float("-inf")
    if top_p < 1:
        p = torch.softmax(x, dim=-1)
        p_sorted, order = torch.sort(p, descending=True, stable=True)
        cum = torch.cumsum(p_sorted, dim=-1)
        drop = (cum - p_sorted) >= top_p
        drop[0] = False
        x[order[drop]] = float("-inf")
    return x


def sample(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None) -> int:
    """The token for one fp32 logits row (vocab,), per the module docstring."""
    logits = logits.float()
    if settings.greedy:
        return int(torch.argmax(logits))
    if generator is None:
        raise ValueError("a generator is required when temperature > 0")
    x = apply_top_k_top_p(logits / settings.temperature, settings.top_k, settings.top_p)
    probs = torch.softmax(x, dim=-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return int(torch.argmax(probs / q))
