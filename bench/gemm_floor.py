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
`fma_peak_gflops` goes below every library: independent vector FMAs on registers on every thread
(no loads, no stores), the rate no fp32 code can exceed on this machine. The floor's FLOPs at that
rate give the hardware's ceiling, which no GEMM library, however tuned, can raise.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from bench.engine import BatchResult, matmul_precision, step_token_budget, swiftkv_model


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


# 12 independent FMA chains of the widest vectors this machine has per thread: enough to keep two FMA
# units of 4-cycle latency busy, few enough to stay in registers
FMA_SOURCE = r"""
#include <stdint.h>
#ifdef __AVX512F__
#define W 16
#else
#define W 8
#endif
typedef float vec __attribute__((vector_size(4 * W)));

int swiftkv_fma_peak(int64_t iters, float *sink, int num_threads) {
    #pragma omp parallel num_threads(num_threads)
    {
        vec a[12];
        const vec b = (vec){0} + 0.9999999f, c = (vec){0} + 1e-7f;
        for (int k = 0; k < 12; k++) a[k] = (vec){0} + (float)(k + 1);
        for (int64_t i = 0; i < iters; i++)
            for (int k = 0; k < 12; k++) a[k] = a[k] * b + c;
        float total = 0.f;
        for (int k = 0; k < 12; k++)
            for (int j = 0; j < W; j++) total += a[k][j];
        #pragma omp atomic
        sink[0] += total;
    }
    return W;
}
"""


def fma_peak_gflops(seconds: float = 0.2, repeats: int = 5) -> float | None:
    """fp32 GFLOP/s of vector FMAs on registers on all of torch's threads (best of `repeats` runs of
    about `seconds`); None without a C compiler."""
    import ctypes

    from swiftkv_fast.kernels import build

    lib = build.library_from_text("fma-peak", FMA_SOURCE)
    if lib is None:
        return None
    fn = lib.swiftkv_fma_peak
    fn.argtypes, fn.restype = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    threads, sink = torch.get_num_threads(), torch.zeros(1)

    def rate(iters: int) -> tuple[float, float]:
        start = time.perf_counter()
        width = fn(iters, sink.data_ptr(), threads)
        elapsed = time.perf_counter() - start
        return elapsed, 2 * 12 * width * iters * threads / elapsed / 1e9

    iters = 1 << 16
    while rate(iters)[0] < seconds / 4:
        iters *= 2
    iters = int(iters * seconds / rate(iters)[0])
    return max(rate(iters)[1] for _ in range(repeats))


@torch.inference_mode()
def peak_gflops(size: int = 2048, repeats: int = 3) -> dict[str, float]:
    """This machine's fp32 GEMM rate (GFLOP/s) on one (size x size) @ (size x size) product, best of
    `repeats` calls, through each linear kernel the engine chooses from that runs here at torch's float32
    matmul precision (bf16x3 only at "high")."""
    from swiftkv_fast.kernels.linear_kernels import KERNELS

    precision = matmul_precision()
    x, weight = torch.randn(size, size), torch.randn(size, size)
    rates = {}
    for name, kernel in KERNELS.items():
        if not kernel.permitted(precision):
            continue
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
