"""The GEMM floor of a generation workload: only the fp32 linear layers the engine must run for it.

Same weights (the engine's own `Linear`s, lm_head included), same kernels (each one's choice by the
engine's LinearKernelChooser: the fastest of F.linear, matmul on W^T and oneDNN's prepacked linear
measured on this machine), same shapes, same chunking as the engine's schedule, random activations;
no attention, norms, RoPE, sampling or scheduling. No engine using these kernels can finish the
workload faster, so `baseline seconds / floor seconds` is the highest speedup over the baseline that
is reachable here.

Worked example (the issue-4 mix: 16 prompts x 256 tokens -> 64 tokens, L = N = 30,
max_num_batched_tokens = 4096):

    prefill   one chunk of 4,096 tokens through the 4 linears of all 30 layers
    first token   16 rows through lm_head (the second half is empty when L = N)
    decode    63 steps of 16 rows through the 4 linears of all 30 layers and lm_head

With L = 15 the prefill chunk runs 15 layers plus the fused K/V projection of layers 15-29, and the
16 sampled rows run q_proj_swiftkv, o, gate_up and down of layers 15-29.

Is the floor the hardware's, or one library's? `workload_flops` counts the floor's multiply-adds
(2 * rows * in * out per call) and `peak_gflops` measures this machine's best fp32 GEMM rate: one
large square product through every linear kernel the engine can choose from. The floor's own rate
(flops / seconds) as a share of that peak says how much faster any fp32 GEMM could make it here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bench.engine import BatchResult, step_token_budget, swiftkv_model


def prompt_chunks(prompt_lens: list[int], budget: int) -> list[int]:
    """Token counts of the prefill steps when prompts are packed into steps of `budget` tokens
    (chunked prefill, every prompt admitted at once: the token budget is the only limit)."""
    total = sum(prompt_lens)
    return [min(budget, total - start) for start in range(0, total, budget)]


class _Rows:
    """Random activations of every width the linears take, for a given row count (reused)."""

    def __init__(self) -> None:
        self.cache: dict[tuple[int, int], torch.Tensor] = {}

    def __call__(self, rows: int, width: int, like: torch.Tensor) -> torch.Tensor:
        key = (rows, width)
        if key not in self.cache:
            self.cache[key] = torch.randn(rows, width, dtype=like.dtype, device=like.device)
        return self.cache[key]


def _replay(llm, prompts: list[list[int]], output_len: int, call: Callable[[object, int], None]) -> None:
    """call(linear, rows) for every linear-layer call of the workload, in the engine's order."""
    model = swiftkv_model(llm)
    w, L = model.w, model.L

    def all_rows(m: int) -> None:  # layers < L and the fused K/V projection of layers >= L, m tokens
        for layer in w.layers[:L]:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                call(lin, m)
        if w.kv_swiftkv is not None:
            call(w.kv_swiftkv, m)

    def sampled_rows(m: int) -> None:  # the second half and lm_head for m sampled tokens
        for layer in w.layers[L:]:
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
                call(lin, m)
        call(w.lm_head, m)

    for m in prompt_chunks([len(p) for p in prompts], step_token_budget(llm)):
        all_rows(m)
    sampled_rows(len(prompts))  # every request's first token
    for _ in range(output_len - 1):
        all_rows(len(prompts))
        sampled_rows(len(prompts))


@torch.inference_mode()
def run(llm, prompts: list[list[int]], output_len: int) -> BatchResult:
    """Run the workload's linear layers once; returns the token counts of the workload it stands for."""
    rows = _Rows()
    embed = swiftkv_model(llm).w.embed
    _replay(llm, prompts, output_len, lambda lin, m: lin(rows(m, lin.in_features, embed)))
    return BatchResult(sum(map(len, prompts)), output_len * len(prompts))


def workload_flops(llm, prompts: list[list[int]], output_len: int) -> int:
    """Floating-point operations of `run`: 2 * rows * in_features * out_features per linear call."""
    total = 0

    def count(lin, m: int) -> None:
        nonlocal total
        total += 2 * m * lin.in_features * lin.out_features

    _replay(llm, prompts, output_len, count)
    return total


@torch.inference_mode()
def peak_gflops(size: int = 2048, repeats: int = 3) -> dict[str, float]:
    """This machine's fp32 GEMM rate (GFLOP/s) on one (size x size) @ (size x size) product, best of
    `repeats` calls, through each linear kernel the engine chooses from that runs here."""
    from swiftkv_fast.model.linear_kernels import KERNELS

    x, weight = torch.randn(size, size), torch.randn(size, size)
    rates = {}
    for name, kernel in KERNELS.items():
        try:
            layout = kernel.pack(weight)
            kernel.run(x, layout, None)
        except Exception:  # a private op this torch lacks: not a kernel of this machine
            continue
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            kernel.run(x, layout, None)
            best = min(best, time.perf_counter() - start)
        rates[name] = 2 * size**3 / best / 1e9
    return rates
