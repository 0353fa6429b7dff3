"""Whether the compact weight forms (4-bit, 8-bit or bf16 panels of weights exactly in those forms,
kernels/weight_forms.py) or plain fp32 layouts serve the engine, judged by whole steps on this machine.

The linear-kernel chooser times each GEMM alone, where reading 5x fewer weight bytes wins; a whole step
adds what that misses (unpacking the codes inside the decode stack, caches shared with attention), and
on some CPUs the plain layouts made every mix faster end to end. So where a model has weights in a
compact form, the worker builds it both ways and times, interleaved, best of a few:

    decode    one step of `decode_rows` requests, one token each after DECODE_CONTEXT tokens (both
              halves, lm_head included)
    prefill   one step over a fresh prompt of `prefill_rows` tokens (both halves)

Each form's score is the sum of its two times, each over the faster of the two (so 2.0 is best at both);
the compact forms are kept unless the plain layouts score lower by more than NOISE, since they take
less memory. The decision is cached beside the linear kernels' timings, keyed by the model's shapes;
like theirs, timings taken while another process kept the threads waiting for a core are taken again
(up to MAX_TRIES) and, if every try was disturbed, used for this process only.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from swiftkv_fast.kernels.cpu_contention import waited_seconds
from swiftkv_fast.kernels.linear_kernels import MIN_SAMPLES, load_times, save_times, wall_time
from swiftkv_fast.worker.input_batch import StepInput, build_model_input
from swiftkv_fast.worker.stack_timing import time_interleaved

FORMS = ("compact", "fp32")
PHASES = ("decode", "prefill")
NOISE = 0.03  # the plain layouts must score this much better to be kept instead
CASE_BUDGET_S = 1.0  # more samples while one phase has taken less than this (both forms together)
DECODE_CONTEXT = 256  # tokens up to each decode row (at most max_model_len; the null block's)


def forms_key(weights_shapes: str, decode_rows: int, prefill_rows: int, cold: bool) -> str:
    cold_key = " cold" if cold else ""
    return (
        f"weight-forms {weights_shapes} decode {decode_rows} after {DECODE_CONTEXT} "
        f"prefill {prefill_rows}{cold_key}"
    )


def step_call(
    model, kv_cache: torch.Tensor, num_groups: int, rows: int, query_len: int
) -> Callable[[], object]:
    """One whole step: `rows` requests of `query_len` fresh tokens (prefill) or of one token after
    DECODE_CONTEXT tokens (decode, query_len 1), over the null block, writing nothing."""
    block_size = kv_cache.shape[3]
    context = min(DECODE_CONTEXT, model.rotary.cos.shape[0])  # within max_model_len (the RoPE table)
    start = context - 1 if query_len == 1 else 0
    blocks = [0] * -(-(start + query_len) // block_size)
    gen = torch.Generator().manual_seed(rows * query_len)
    tokens = torch.randint(0, model.w.embed.shape[0], (rows * query_len,), generator=gen).tolist()
    step = StepInput(
        tokens, [start] * rows, [query_len] * rows, [True] * rows, [[blocks] * rows] * num_groups
    )
    inp = build_model_input(step, block_size, kv_cache.device)
    for group in inp.groups:
        group.slot_mapping.fill_(-1)  # K/V writes skipped: the cache stays as it was

    def call():
        h = model.first_half(inp, kv_cache)
        return model.second_half(
            h, inp.sampled_positions, inp.sampled_seq_lens, inp.sampled_block_tables, kv_cache
        )

    return call


def time_forms(
    models: dict[str, object],
    kv_cache: torch.Tensor,
    num_groups: int,
    decode_rows: int,
    prefill_rows: int,
    cold: bool,
    timer=wall_time,
    waited=waited_seconds,
) -> tuple[dict[str, dict[str, float]], float]:
    """({form: {phase: best seconds}}, the worst run-queue share of the least disturbed tries) for the
    models of each form, interleaved."""
    times: dict[str, dict[str, float]] = {form: {} for form in models}
    worst = 0.0
    for phase, rows, query_len in (("decode", decode_rows, 1), ("prefill", 1, prefill_rows)):
        calls = {form: step_call(m, kv_cache, num_groups, rows, query_len) for form, m in models.items()}
        best, share = time_interleaved(
            calls, rows * query_len, cold, timer, waited, CASE_BUDGET_S, MIN_SAMPLES + 1
        )
        for form in models:
            times[form][phase] = best[form]
        worst = max(worst, share)
    return times, worst


def choose(times: dict[str, dict[str, float]]) -> tuple[str, str]:
    """The form to keep and why, from `time_forms`' result."""
    fastest = {p: max(min(t[p] for t in times.values()), 1e-12) for p in PHASES}
    score = {form: sum(t[p] / fastest[p] for p in PHASES) for form, t in times.items()}
    keep = "fp32" if score["fp32"] < score["compact"] * (1 - NOISE) else "compact"
    ratios = ", ".join(f"{p} {times['fp32'][p] / max(times['compact'][p], 1e-12):.2f}x" for p in PHASES)
    return keep, f"whole steps, fp32 time over compact: {ratios}"


def cached_times(cache_path, key: str, rows: dict[str, int]) -> dict[str, dict[str, float]] | None:
    """The cached {form: {phase: seconds}} of `key` (stored as one linear-kernel-cache entry per phase,
    `{key} {phase}`: {rows: {form: seconds}}), None where any is missing."""
    if cache_path is None:
        return None
    cached = load_times(cache_path)
    times: dict[str, dict[str, float]] = {form: {} for form in FORMS}
    for phase in PHASES:
        entry = cached.get(f"{key} {phase}", {}).get(rows[phase], {})
        if set(entry) != set(FORMS):
            return None
        for form in FORMS:
            times[form][phase] = entry[form]
    return times


def save_times_of(cache_path, key: str, rows: dict[str, int], times: dict[str, dict[str, float]]) -> None:
    if cache_path is not None:
        new = {f"{key} {p}": {rows[p]: {form: times[form][p] for form in FORMS}} for p in PHASES}
        save_times(cache_path, {**load_times(cache_path), **new})
