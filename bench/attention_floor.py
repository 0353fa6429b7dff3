"""What attention must cost a generation workload on this machine, beyond the GEMM floor: the floor
plus attention's irreducible work at this machine's rates.

The GEMM floor (bench/gemm_floor.py) leaves attention out. Two parts of it no kernel can avoid:

- every decode step reads the K and V of every context position of every cache layer once (a window
  caps a layer's positions): `kv_read_bytes`, timed at this machine's sequential read rate
  (`read_gbps`: a sum over a large fp32 array on torch's threads, the fastest pattern memory has);
- every prompt position's query meets the keys before it (causal) in every layer a prompt token runs
  (L layers with SwiftKV, all N without): 4 * head_dim * heads FLOPs per (query, key) pair for Q K^T
  and P V (`prompt_attention_flops`), timed at the fp32 FMA peak (gemm_floor.fma_peak_gflops).

Decode attention's FLOPs (a few per byte read) and prompt attention's reads (each K/V row read by the
tile of queries that needs it, from cache) are left out: the bound stays below what any engine can
reach. Worked example, issue-4's mix (16 prompts x 256 tokens -> 64 tokens) on the embedded model
(30 cache layers, 3 KV heads of 64, fp32: 46,080 bytes per cached token): decode step j (1..63) reads
16 x (256 + j) positions x 46,080 bytes = 189-235 MB, 13.3 GB in all; at 20 GB/s that is 0.67 s, where
the GEMM floor of L = 15 is about 4 s.
"""

from __future__ import annotations

import time

import torch

from bench.engine import swiftkv_model


def kv_read_bytes(llm, prompts: list[list[int]], output_len: int, element_bytes: int) -> int:
    """Bytes of K and V the decode steps read: after every request's first token (sampled at the end
    of its prompt) come output_len - 1 steps, step j attending prompt_len + j positions in every
    cache layer, a windowed layer only its last `window`."""
    config = llm.config
    per_position = 2 * config.num_key_value_heads * config.head_dim * element_bytes
    windows = [config.cache_window(c) for c in range(config.num_cache_layers)]
    total = 0
    for prompt in prompts:
        for j in range(1, output_len):
            context = len(prompt) + j
            total += sum(context if w is None else min(context, w) for w in windows) * per_position
    return total


def prompt_attention_flops(llm, prompts: list[list[int]]) -> int:
    """FLOPs of causal prompt attention: the query at position p of a prompt meets p + 1 keys (a window
    caps them) in each of the L layers prompt tokens run, 4 * head_dim per (query, key, head)."""
    config, L = llm.config, swiftkv_model(llm).L
    per_pair = 4 * config.head_dim * config.num_attention_heads
    total = 0
    for layer in range(L):
        window = config.window(layer)
        for prompt in prompts:
            n = len(prompt)
            if window is None or window >= n:
                total += n * (n + 1) // 2 * per_pair
            else:  # positions past the window see `window` keys
                total += (window * (window + 1) // 2 + (n - window) * window) * per_pair
    return total


@torch.inference_mode()
def read_gbps(nbytes: int = 512 << 20, repeats: int = 5) -> float:
    """GB/s of a sequential read on torch's threads: the best of `repeats` sums over `nbytes` of fp32."""
    x = torch.ones(nbytes // 4)
    x.sum()  # faulted in, and the threads started
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def floor_seconds(
    gemm_seconds: float,
    llm,
    prompts: list[list[int]],
    output_len: int,
    *,
    element_bytes: int,
    gbps: float,
    fma_gflops: float,
) -> dict[str, float]:
    """The GEMM floor's seconds plus attention's irreducible work at these rates, and its parts."""
    kv = kv_read_bytes(llm, prompts, output_len, element_bytes)
    flops = prompt_attention_flops(llm, prompts)
    kv_seconds, prompt_seconds = kv / gbps / 1e9, flops / fma_gflops / 1e9
    return {
        "kv_read_bytes": kv,
        "kv_read_seconds": kv_seconds,
        "prompt_attention_flops": flops,
        "prompt_attention_seconds": prompt_seconds,
        "seconds": gemm_seconds + kv_seconds + prompt_seconds,
    }
