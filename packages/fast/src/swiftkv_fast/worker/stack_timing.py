"""Whether each half's decode stack (model/decode_stack.py) or the per-op path serves a decode batch,
decided by timing both on this machine at every decode row bucket, once, at start-up.

The linear-kernel chooser (kernels/linear_kernels.py) times each linear alone, so it cannot see what
the stack saves: one C call for a half's layers instead of a dozen torch calls per layer, and each
linear's input packed while its norm or SiLU runs. On a 2-core Intel Xeon (AVX-512) MKL's matmul beat
the panel GEMM by 1.1-1.3x for qkv, o and down timed one by one, so the stack (which needs the panel
GEMM for every linear) never ran, yet forcing it made a 16-row decode step 1.45x as fast (42 against
61 ms). So every decoder-layer linear keeps a spare panel layout (model/loader.py) until the halves
are timed here:

    first half   model.first_half over `rows` decode tokens (K/V writes skipped: slot -1)
    second half  model.second_half over `rows` sampled rows (its lm_head included either way)

each with its stack and without, interleaved, best of a few calls, the caches evicted first where
the weights exceed them (as in a real step), on a context of one block (the null block: the same
attention either way). The stack runs at the buckets where it was faster; a half whose stack runs
nowhere (or does not apply: tensor parallelism, another attention backend) drops its spare layouts.
Timings are cached with the linear kernels' (the same file, key `decode-stack ...`) and, like them,
timed again and not cached when another process kept the threads waiting for a core.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from swiftkv_fast.attention.base import AttentionMetadata
from swiftkv_fast.kernels import build
from swiftkv_fast.kernels.cpu_contention import ContentionMeter, waited_seconds
from swiftkv_fast.kernels.linear_kernels import (
    BUSY_SHARE,
    MAX_SAMPLES,
    MAX_TRIES,
    MIN_SAMPLES,
    evict_caches,
    load_times,
    save_times,
    wall_time,
)
from swiftkv_fast.logger import init_logger
from swiftkv_fast.model.decode_stack import DecodeStack, layer_linears, stack_panel
from swiftkv_fast.model.model_input import GroupBatch, ModelInput

logger = init_logger(__name__)

PATHS = ("ops", "stack")
CASE_BUDGET_S = 0.1  # more samples while one bucket has taken less than this (both paths together)
HALVES = ("first", "second")


def stack_key(stack: DecodeStack, half: str, cold: bool) -> str:
    """The cache key of one half's timings: what they depend on beyond the machine (the layers' shapes,
    their panel layouts' formats, heads, the KV cache's dtype, the stack kernel's source)."""
    lw = stack.layers[0]
    shapes = "/".join(f"{lin.out_features}x{lin.in_features}" for lin in layer_linears(lw))
    windows = ",".join(sorted({str(x.window or 0) for x in stack.layers}))
    source = build.source_digest()[:12]
    heads = f"{stack.num_heads}/{stack.num_kv_heads}x{stack.head_dim}"
    panels = {getattr(stack_panel(lin), "format", "-") for x in stack.layers for lin in layer_linears(x)}
    return (
        f"decode-stack {half} {len(stack.layers)} layers {shapes} panels {','.join(sorted(panels))} "
        f"heads {heads} windows {windows} "
        f"groups {stack.num_groups} kv {str(stack.kv_dtype).removeprefix('torch.')} src {source}"
        f"{' cold' if cold else ''}"
    )


def _decode_batch(model, rows: int, num_groups: int, block_size: int, max_blocks: int) -> ModelInput:
    """`rows` decode tokens, each the last of a one-block context in the null block, writing nowhere."""
    gen = torch.Generator().manual_seed(rows)
    seq_lens = torch.full((rows,), block_size, dtype=torch.int32)
    tables = torch.zeros(rows, max_blocks, dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.arange(rows + 1, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=tables,
        max_query_len=1,
        max_seq_len=block_size,
    )
    groups = [GroupBatch(meta, torch.full((rows,), -1, dtype=torch.int64), tables) for _ in range(num_groups)]
    return ModelInput(
        input_ids=torch.randint(0, model.w.embed.shape[0], (rows,), generator=gen),
        positions=seq_lens.long() - 1,
        groups=groups,
        logits_indices=torch.zeros(0, dtype=torch.int64),
        sampled_seq_lens=seq_lens,
        sampled_positions=seq_lens.long() - 1,
    )


def _calls(model, half: int, rows: int, kv_cache: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The half over `rows` decode rows without its stack ('ops') and with it ('stack')."""
    num_groups = 1 + max(lw.group for lw in model.w.layers)
    inp = _decode_batch(model, rows, num_groups, kv_cache.shape[3], 1)
    h = torch.randn(rows, model.w.embed.shape[1], generator=torch.Generator().manual_seed(rows))
    tables = inp.sampled_block_tables
    stacks = model.stacks

    def run(with_stack: bool):
        chosen = stacks[half] if with_stack else None
        model.stacks = (chosen, stacks[1]) if half == 0 else (stacks[0], chosen)
        try:
            if half == 0:
                return model.first_half(inp, kv_cache)
            return model.second_half(h, inp.positions, inp.sampled_seq_lens, tables, kv_cache)
        finally:
            model.stacks = stacks

    return {"ops": lambda: run(False), "stack": lambda: run(True)}


def time_interleaved(
    calls: dict[str, Callable[[], object]],
    rows: int,
    cold: bool,
    timer=wall_time,
    waited: Callable[[], float | None] = waited_seconds,
    budget_s: float = CASE_BUDGET_S,
    min_samples: int = MIN_SAMPLES,
) -> tuple[dict[str, float], float]:
    """({name: best seconds}, run-queue share) of `calls` after one warm-up call each, interleaved, best
    of `min_samples` to MAX_SAMPLES rounds (more while under `budget_s`), the caches evicted first
    where `cold`. A try whose threads waited more than BUSY_SHARE of the time for a core is taken again,
    up to MAX_TRIES; the least disturbed one is returned with its share. Also the weight forms' timer
    (worker/form_timing.py)."""
    threads = torch.get_num_threads()
    with torch.inference_mode():
        for call in calls.values():
            call()  # warm-up: the per-op path's first call of a row count builds its plans
    best_timed, best_share = {}, math.inf
    for _ in range(MAX_TRIES):
        meter = ContentionMeter(waited)
        with torch.inference_mode():
            timed = _best_of(calls, rows, cold, timer, budget_s, min_samples)
        share = meter.share(threads)
        share = 0.0 if share is None else share  # unknown (not Linux): taken as undisturbed
        if share < best_share:
            best_share, best_timed = share, timed
        if share <= BUSY_SHARE:
            break
    return best_timed, best_share


def _best_of(calls, rows: int, cold: bool, timer, budget_s: float, min_samples: int) -> dict[str, float]:
    best = dict.fromkeys(calls, math.inf)
    spent, samples = 0.0, 0
    while samples < min_samples or (samples < MAX_SAMPLES and spent < budget_s):
        for name, call in calls.items():
            if cold:
                evict_caches()
            seconds = timer(name, rows, call)
            best[name] = min(best[name], seconds)
            spent += seconds
        samples += 1
    return best


def _time_half(model, half, rows_list, kv_cache, cold, timer, waited) -> tuple[dict, float]:
    """{rows: {path: best seconds}} and the worst run-queue share of the least disturbed tries."""
    times, worst = {}, 0.0
    for rows in rows_list:
        times[rows], share = time_interleaved(_calls(model, half, rows, kv_cache), rows, cold, timer, waited)
        worst = max(worst, share)
    return times, worst


def choose_decode_stacks(
    model,
    kv_cache: torch.Tensor,
    row_buckets: Sequence[int],
    *,
    cache_path: Path | None,
    cold: bool,
    timer: Callable[[str, int, Callable[[], object]], float] = wall_time,
    waited: Callable[[], float | None] = waited_seconds,
) -> dict[str, str]:
    """Times each half's stack against its per-op path at `row_buckets` (the decode batch sizes), tells
    each stack where it runs (DecodeStack.decide) and drops the spare panel layouts of a half whose
    stack runs nowhere. Returns {half: description} (also logged)."""
    cached = load_times(cache_path) if cache_path is not None else {}
    new: dict[str, dict] = {}
    described: dict[str, str] = {}
    freed = 0
    start = time.perf_counter()
    halves = (model.w.layers[: model.L], model.w.layers[model.L :])
    for half, (name, layers) in enumerate(zip(HALVES, halves)):
        if not layers:
            continue
        stack = model.stacks[half]
        runs: dict[int, bool] = {}
        if stack is not None and stack.ready():
            key = stack_key(stack, name, cold)
            times = cached.get(key, {})
            missing = [b for b in row_buckets if set(times.get(b, {})) != set(PATHS)]
            if missing:
                stack.decide(dict.fromkeys(missing, True))  # while timed, it runs wherever it is asked to
                timed, share = _time_half(model, half, missing, kv_cache, cold, timer, waited)
                times = {**times, **timed}
                if share <= BUSY_SHARE:
                    new[key] = times
                else:
                    logger.warning(
                        "the CPU was busy while the %s half's decode stack was timed (threads waited %.0f%% "
                        "of the time for a core): its choice holds for this process only",
                        name,
                        100 * share,
                    )
            runs = {b: times[b]["stack"] < times[b]["ops"] for b in row_buckets}
            stack.decide(runs)
            described[name] = _describe(len(layers), runs, times)
        else:
            if stack is not None:
                stack.decide({})
            described[name] = f"{len(layers)} layers: per-op (the stack does not apply here)"
        if not any(runs.values()):
            freed += sum(lin.drop_spare_layouts() for lw in layers for lin in layer_linears(lw))
    if new and cache_path is not None:
        save_times(cache_path, {**load_times(cache_path), **new})
    how = f"timed in {time.perf_counter() - start:.1f} s" if new else "timings cached"
    logger.debug(
        "decode stack (%s): %s; spare panel layouts dropped: %.1f MiB",
        how,
        "; ".join(f"{k} half {v}" for k, v in described.items()),
        freed / 2**20,
    )
    return described


def _describe(num_layers: int, runs: dict[int, bool], times: dict) -> str:
    """'15 layers: stack at <= 64 rows (1.45x the per-op path at 16)'."""
    on = [b for b, r in sorted(runs.items()) if r]
    if not on:
        return f"{num_layers} layers: per-op at every decode row count"
    b = max((x for x in on if x <= 16), default=on[0])
    ratio = times[b]["ops"] / max(times[b]["stack"], 1e-12)
    where = "every decode row count" if len(on) == len(runs) else "rows " + ", ".join(map(str, on))
    return f"{num_layers} layers: stack at {where} ({ratio:.2f}x the per-op path at {b} rows)"
