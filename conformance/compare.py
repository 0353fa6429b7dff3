"""Comparison helpers (vLLM's `check_outputs_equal` / `check_logprobs_close`, nanochat-style closeness).

Every helper takes `context`: the text that reproduces the case alone (see `cases.Case.describe`),
appended to the assertion message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .adapters.base import Output

# the tiny models' logits are |x| < 5 (measured: max 4.7), so 1e-4 is ~200 fp32 ulps of them, above
# swiftkv_reference.testing.fp32_atol (4e-5) and 30x the largest difference seen on the CI machines (3e-6);
# a window mask off by one or a wrong RoPE offset moves logits by O(0.1-1).
FP32_LOGITS_ATOL = 1e-4
TOP_K_RULE = 5


@dataclass
class Closeness:
    max_abs: float
    mean_abs: float
    where: tuple[int, ...]  # index of the max error
    numel: int

    def __str__(self) -> str:
        return (
            f"max abs err {self.max_abs:.3e} at {self.where}, "
            f"mean abs err {self.mean_abs:.3e} over {self.numel}"
        )


def closeness(actual: torch.Tensor, expected: torch.Tensor) -> Closeness:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    if a.shape != e.shape:
        raise AssertionError(f"shape mismatch: {tuple(a.shape)} vs {tuple(e.shape)}")
    if a.numel() == 0:
        return Closeness(0.0, 0.0, (), 0)
    err = (a - e).abs()
    err = torch.where(torch.isnan(err), torch.full_like(err, float("inf")), err)
    flat = int(err.argmax())
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), err.shape))
    return Closeness(float(err.max()), float(err.mean()), where, a.numel())


def assert_close(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, what: str, context: str = ""
) -> Closeness:
    c = closeness(actual, expected)
    if not c.max_abs <= atol:
        raise AssertionError(f"{what}: {c} > atol {atol:g}\n{context}")
    return c


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def check_outputs_equal(
    outputs_a: Sequence[Output],
    outputs_b: Sequence[Output],
    *,
    name_a: str,
    name_b: str,
    prompts: Sequence[Sequence[int]] | None = None,
    context: str = "",
) -> None:
    """Greedy sequences are identical, request by request."""
    assert len(outputs_a) == len(outputs_b), (
        f"{name_a} gave {len(outputs_a)} outputs, {name_b} {len(outputs_b)}"
    )
    bad = []
    for i, (a, b) in enumerate(zip(outputs_a, outputs_b)):
        d = _first_divergence(a.token_ids, b.token_ids)
        if d is not None:
            plen = f" (prompt length {len(prompts[i])})" if prompts is not None else ""
            bad.append(
                f"  request {i}{plen}: first divergence at generated token {d}\n"
                f"    {name_a}: {a.token_ids}\n    {name_b}: {b.token_ids}"
            )
    if bad:
        raise AssertionError(
            f"greedy tokens differ ({name_a} vs {name_b}):\n" + "\n".join(bad) + f"\n{context}"
        )


def check_logprobs_close(
    outputs_a: Sequence[Output],
    outputs_b: Sequence[Output],
    *,
    name_a: str,
    name_b: str,
    k: int = TOP_K_RULE,
    context: str = "",
) -> None:
    """vLLM's low-precision rule: the sequences are equal, or at the first divergence each side's token is
    within the other's top-k logprobs (and the comparison of that request stops there)."""
    assert len(outputs_a) == len(outputs_b), (
        f"{name_a} gave {len(outputs_a)} outputs, {name_b} {len(outputs_b)}"
    )
    bad = []
    for i, (a, b) in enumerate(zip(outputs_a, outputs_b)):
        d = _first_divergence(a.token_ids, b.token_ids)
        if d is None or d >= min(len(a.token_ids), len(b.token_ids)):
            if d is not None:
                bad.append(f"  request {i}: lengths differ ({len(a.token_ids)} vs {len(b.token_ids)})")
            continue
        if a.top_logprobs is None or b.top_logprobs is None:
            bad.append(f"  request {i}: diverges at {d} and top-{k} logprobs are missing")
            continue
        top_a = sorted(a.top_logprobs[d], key=a.top_logprobs[d].get, reverse=True)[:k]
        top_b = sorted(b.top_logprobs[d], key=b.top_logprobs[d].get, reverse=True)[:k]
        ta, tb = a.token_ids[d], b.token_ids[d]
        if ta not in top_b or tb not in top_a:
            bad.append(
                f"  request {i}: at generated token {d} {name_a} chose {ta}, {name_b} chose {tb};\n"
                f"    {name_a} top-{k}: {a.top_logprobs[d]}\n    {name_b} top-{k}: {b.top_logprobs[d]}"
            )
    if bad:
        raise AssertionError(
            f"low-precision rule failed ({name_a} vs {name_b}):\n" + "\n".join(bad) + f"\n{context}"
        )


def check_logits_close(
    outputs_a: Sequence[Output],
    outputs_b: Sequence[Output],
    *,
    name_a: str,
    name_b: str,
    atol: float = FP32_LOGITS_ATOL,
    context: str = "",
) -> list[Closeness]:
    """fp32 logits rows at every sampled position within `atol` (requires equal tokens first)."""
    result = []
    for i, (a, b) in enumerate(zip(outputs_a, outputs_b)):
        if a.logits is None or b.logits is None:
            missing = name_a if a.logits is None else name_b
            raise AssertionError(f"{missing} returned no logits rows for request {i}\n{context}")
        result.append(
            assert_close(
                a.logits,
                b.logits,
                atol=atol,
                what=f"request {i}: logits {name_a} vs {name_b}",
                context=context,
            )
        )
    return result


def summarize(closes: Sequence[Closeness]) -> str:
    if not closes:
        return "no logits compared"
    worst = max(c.max_abs for c in closes)
    mean = sum(c.mean_abs * c.numel for c in closes) / max(1, sum(c.numel for c in closes))
    return f"logits: max abs err {worst:.2e}, mean abs err {mean:.2e}"
