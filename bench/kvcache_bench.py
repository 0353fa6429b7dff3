"""Replay a synthetic serving trace through ``kvcache.KVCacheManager``.

Usage: ``python bench/kvcache_bench.py [--num-requests N] [--json PATH]`` (``--help``).

The trace: requests arrive all at once (offline batch); prompts of 100-8,000
tokens, most starting with one of a few shared prefixes; outputs of 10-1,000
tokens. A small vLLM-style scheduler runs inside the bench: a token budget per
step (2,048 by default), running requests first (decode or the next prefill
chunk), then admission of waiting requests with a prefix lookup, preemption by
recompute of the newest running request when the pool runs out. Model work is
not simulated: the numbers are the cache manager's bookkeeping cost.

Two configurations: full attention and a 4,096-token sliding window, block size
16. For the sliding window the measured maximum of blocks held by one running
request is printed beside the bound ``cdiv(window - 1 + chunk, block_size) + 1``.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from collections import deque
from collections.abc import Iterator

from kvcache import FullAttentionSpec, KVCacheManager, Request, SlidingWindowSpec
from kvcache.specs import cdiv

logger = logging.getLogger("kvcache_bench")


def make_trace(
    num_requests: int,
    seed: int,
    num_prefixes: int = 32,
    shared_fraction: float = 0.8,
    prompt_range: tuple[int, int] = (100, 8000),
    output_range: tuple[int, int] = (10, 1000),
) -> Iterator[tuple[list[int], int]]:
    """Yield ``(prompt_token_ids, num_output_tokens)`` lazily (token ids < 256)."""
    rng = random.Random(seed)
    prefixes = [list(rng.randbytes(rng.randint(100, 3000))) for _ in range(num_prefixes)]
    for _ in range(num_requests):
        length = rng.randint(*prompt_range)
        prompt: list[int] = []
        if rng.random() < shared_fraction:
            prompt = prefixes[rng.randrange(num_prefixes)][:length]
        prompt = prompt + list(rng.randbytes(length - len(prompt)))
        yield prompt, rng.randint(*output_range)


def replay(
    mgr: KVCacheManager,
    num_requests: int,
    seed: int,
    token_budget: int = 2048,
    max_num_seqs: int = 128,
) -> dict:
    """Run the trace to completion through ``mgr``; return the measurements."""
    trace = make_trace(num_requests, seed)
    rng = random.Random(seed + 1)
    waiting: deque[Request] = deque()
    running: list[Request] = []
    targets: dict[str, int] = {}
    next_id = 0
    sliding = [m for m in mgr.managers if isinstance(m.spec, SlidingWindowSpec)]
    null = mgr.block_pool.null_block
    num_usable = mgr.num_blocks - 1
    steps = alloc_calls = lookups = preemptions = finished = 0
    alloc_time = lookup_time = 0.0
    peak_held = 0
    max_sliding_held = 0
    perf = time.perf_counter
    start = perf()

    def preempt_last() -> Request:
        nonlocal preemptions
        victim = running.pop()
        mgr.free(victim)
        victim.num_computed_tokens = 0
        waiting.appendleft(victim)
        preemptions += 1
        return victim

    while True:
        if not waiting and len(running) < max_num_seqs:
            for prompt, out_len in trace:
                req = Request(f"r{next_id}", prompt)
                targets[req.request_id] = out_len
                next_id += 1
                waiting.append(req)
                if len(waiting) >= max_num_seqs:
                    break
        if not waiting and not running:
            break
        steps += 1
        budget = token_budget
        preempted_before = preemptions
        scheduled: list[tuple[Request, int]] = []
        # 1. running requests, oldest first
        i = 0
        while i < len(running) and budget:
            req = running[i]
            n = min(len(req.all_token_ids) - req.num_computed_tokens, budget)
            while True:
                t0 = perf()
                new = mgr.allocate_slots(req, n)
                alloc_time += perf() - t0
                alloc_calls += 1
                if new is not None:
                    break
                if preempt_last() is req:
                    break
            if new is None:
                break
            scheduled.append((req, n))
            budget -= n
            i += 1
        # 2. admission (as vLLM: none in a step that had to preempt)
        while waiting and budget and len(running) < max_num_seqs and preemptions == preempted_before:
            req = waiting[0]
            t0 = perf()
            hit = mgr.get_computed_blocks(req)
            lookup_time += perf() - t0
            lookups += 1
            n = min(req.num_tokens - hit.num_tokens, budget)
            t0 = perf()
            new = mgr.allocate_slots(req, n, hit=hit)
            alloc_time += perf() - t0
            alloc_calls += 1
            if new is None:
                break
            waiting.popleft()
            req.num_computed_tokens += hit.num_tokens
            running.append(req)
            scheduled.append((req, n))
            budget -= n
        held = num_usable - mgr.num_free_blocks
        if held > peak_held:
            peak_held = held
        # 3. "forward": advance, sample, finish
        done: list[Request] = []
        for req, n in scheduled:
            req.num_computed_tokens += n
            if sliding:
                for m in sliding:
                    k = held_blocks(m.req_to_blocks[req.request_id], null)
                    if k > max_sliding_held:
                        max_sliding_held = k
            if req.num_computed_tokens == len(req.all_token_ids):
                out_done = len(req.output_token_ids) + 1 >= targets[req.request_id]
                if out_done or req.num_tokens >= mgr.max_model_len:
                    done.append(req)
                else:
                    req.append_output_token_ids(rng.getrandbits(8))
        for req in done:
            mgr.free(req)
            running.remove(req)
            del targets[req.request_id]
            finished += 1
    elapsed = perf() - start
    stats = mgr.make_prefix_cache_stats()
    return {
        "requests": finished,
        "steps": steps,
        "elapsed_s": elapsed,
        "steps_per_s": steps / elapsed,
        "allocate_slots_calls": alloc_calls,
        "allocate_slots_per_s": alloc_calls / alloc_time if alloc_time else 0.0,
        "get_computed_blocks_calls": lookups,
        "get_computed_blocks_per_s": lookups / lookup_time if lookup_time else 0.0,
        "peak_blocks_held": peak_held,
        "num_blocks": mgr.num_blocks,
        "preemptions": preemptions,
        "hit_rate": stats.hit_rate,
        "prompt_tokens": stats.queries,
        "hit_tokens": stats.hits,
        "max_sliding_blocks_per_request": max_sliding_held if sliding else None,
    }


def held_blocks(table: list, null: object) -> int:
    """Non-null entries of a sliding-window table (its nulls are a prefix): binary search."""
    lo, hi = 0, len(table)
    while lo < hi:
        mid = (lo + hi) // 2
        if table[mid] is null:
            lo = mid + 1
        else:
            hi = mid
    return len(table) - lo


def time_init(num_blocks: int = 1_000_000, repeat: int = 3) -> float:
    """Best-of-``repeat`` seconds to build a manager over ``num_blocks`` blocks (hybrid)."""
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        KVCacheManager(
            [FullAttentionSpec(16), SlidingWindowSpec(16, 4096)], num_blocks=num_blocks, max_model_len=131072
        )
        best = min(best, time.perf_counter() - t0)
    return best


def run(
    num_requests: int = 10_000,
    seed: int = 0,
    block_size: int = 16,
    window: int = 4096,
    chunk: int = 2048,
    num_blocks: int = 40_000,
    max_num_seqs: int = 128,
    max_model_len: int = 16384,
) -> dict:
    """Replay the trace for full attention and for a sliding window; return all results."""
    configs = {
        "full": [FullAttentionSpec(block_size)],
        f"sliding{window}": [SlidingWindowSpec(block_size, window)],
    }
    results: dict = {
        "params": {
            "num_requests": num_requests,
            "seed": seed,
            "block_size": block_size,
            "window": window,
            "chunk": chunk,
            "num_blocks": num_blocks,
            "max_num_seqs": max_num_seqs,
        },
        "sliding_bound_blocks": cdiv(window - 1 + chunk, block_size) + 1,
        "init_1m_blocks_s": time_init(),
        "configs": {},
    }
    for name, groups in configs.items():
        logger.info("replaying %d requests with %s", num_requests, name)
        mgr = KVCacheManager(groups, num_blocks=num_blocks, max_model_len=max_model_len)
        res = replay(mgr, num_requests, seed, token_budget=chunk, max_num_seqs=max_num_seqs)
        logger.info("%s done in %.1f s", name, res["elapsed_s"])
        results["configs"][name] = res
    return results


def format_table(results: dict) -> str:
    bound = results["sliding_bound_blocks"]
    head = (
        f"{'config':<14}{'requests':>9}{'steps':>8}{'steps/s':>10}{'alloc/s':>11}{'lookup/s':>10}"
        f"{'peak held':>11}{'preempt':>9}{'hit rate':>10}{'max blk/req':>13}{'bound':>7}"
    )
    lines = [head, "-" * len(head)]
    for name, r in results["configs"].items():
        mx = r["max_sliding_blocks_per_request"]
        lines.append(
            f"{name:<14}{r['requests']:>9}{r['steps']:>8}{r['steps_per_s']:>10.0f}"
            f"{r['allocate_slots_per_s']:>11.0f}{r['get_computed_blocks_per_s']:>10.0f}"
            f"{r['peak_blocks_held']:>11}{r['preemptions']:>9}{r['hit_rate']:>10.3f}"
            f"{'-' if mx is None else mx:>13}{'-' if mx is None else bound:>7}"
        )
    lines.append(f"1,000,000-block manager init: {results['init_1m_blocks_s'] * 1e3:.2f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=4096)
    parser.add_argument("--chunk", type=int, default=2048, help="token budget per step")
    parser.add_argument("--num-blocks", type=int, default=40_000)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--json", type=str, default=None, help="write the results here")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results = run(
        num_requests=args.num_requests,
        seed=args.seed,
        block_size=args.block_size,
        window=args.window,
        chunk=args.chunk,
        num_blocks=args.num_blocks,
        max_num_seqs=args.max_num_seqs,
    )
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        logger.info("wrote %s", args.json)
    return results


if __name__ == "__main__":
    main()
