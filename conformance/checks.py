"""The comparison an implementation must pass, chosen by its dtype."""

from __future__ import annotations

from .adapters.base import Implementation, Output
from .cases import Case
from .compare import check_logits_close, check_logprobs_close, check_outputs_equal, summarize


def against_reference(impl: Implementation, actual: list[Output], expected: list[Output], case: Case) -> str:
    """fp32: identical greedy tokens and logits within 1e-4; bf16/fp16 (or a bf16 KV cache): vLLM's top-5
    rule."""
    context = case.describe()
    if impl.exact:
        check_outputs_equal(
            actual, expected, name_a=impl.name, name_b="reference", prompts=case.prompts, context=context
        )
        return summarize(
            check_logits_close(actual, expected, name_a=impl.name, name_b="reference", context=context)
        )
    check_logprobs_close(actual, expected, name_a=impl.name, name_b="reference", context=context)
    return "low-precision rule held"


def invariant(
    impl: Implementation, actual: list[Output], baseline: list[Output], case: Case, what: str
) -> None:
    """The same implementation under different scheduling gives the same greedy tokens (fp32: exactly;
    bf16/fp16: by the top-5 rule, since low-precision kernels may round differently with batch shape)."""
    context = f"{what}\n{case.describe()}"
    if impl.exact:
        check_outputs_equal(
            actual,
            baseline,
            name_a=f"{impl.name}[{what}]",
            name_b=f"{impl.name}[default engine]",
            prompts=case.prompts,
            context=context,
        )
    else:
        check_logprobs_close(
            actual,
            baseline,
            name_a=f"{impl.name}[{what}]",
            name_b=f"{impl.name}[default engine]",
            context=context,
        )
