"""The comparison an implementation must pass, chosen by its dtype."""

from __future__ import annotations

from collections.abc import Callable

from .adapters.base import Implementation, Output
from .cases import Case
from .compare import check_logits_close, check_logprobs_close, check_outputs_equal, closeness, summarize


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


def against_reference_twice(
    impl: Implementation,
    actual: list[Output],
    expected: list[Output],
    case: Case,
    rerun: Callable[[], tuple[list[Output], list[Output]]],
) -> str:
    """`against_reference`; when it fails, the case runs once more (a fresh engine, the reference
    recomputed) and the failure says whether it came back and which side moved, so that a failure seen
    once (in CI, say) tells a deterministic bug from a transient one. It fails either way."""
    try:
        return against_reference(impl, actual, expected, case)
    except AssertionError as first:
        lines = ["---- the same case once more in this process ----"]
        pairs = []
        try:
            again, recomputed = rerun()
            pairs = [
                (f"{impl.name} rerun vs its first run", again, actual),
                ("reference recomputed vs its first run", recomputed, expected),
                (f"{impl.name} rerun vs reference recomputed", again, recomputed),
            ]
        except Exception as e:  # the first failure stays the one reported
            lines.append(f"the rerun raised {type(e).__name__}: {e}")
        for name, a, b in pairs:
            if [o.token_ids for o in a] != [o.token_ids for o in b]:
                lines.append(f"{name}: other tokens")
            elif all(o.logits is not None for o in (*a, *b)):
                worst = max((closeness(x.logits, y.logits) for x, y in zip(a, b)), key=lambda c: c.max_abs)
                lines.append(f"{name}: {worst}")
        lines.append(f"machine: {cpu_summary()}")
        raise AssertionError(f"{first}\n" + "\n".join(lines)) from None


def cpu_summary() -> str:
    """The CPU's model name and microcode revision (/proc/cpuinfo; each distinct value over the logical
    CPUs), for telling a machine's fault from ours; "unknown" where there is no /proc/cpuinfo."""
    fields: dict[str, list[str]] = {"model name": [], "microcode": []}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in fields:
                    fields[key.strip()].append(value.strip())
    except OSError:
        return "unknown"
    return "; ".join(f"{k} {' / '.join(dict.fromkeys(v)) or '?'}" for k, v in fields.items())


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
