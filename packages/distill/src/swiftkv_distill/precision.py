"""The distillation's arithmetic: fp32, or bf16 autocast over fp32 weights, chosen by measurement.

Where bf16 matrix products are native (AVX512-BF16 or AMX on x86, tensor cores on CUDA) they are several
times as fast as fp32 ones, and a distillation step is mostly matrix products; a CPU without them (AVX2
only) converts bf16 in software, where it is not expected to pay. So precision="auto" runs bf16 autocast
on CUDA, and on CPU times one of the model's decoder layers, forward and backward, both ways, and takes
bf16 only when it is at least BF16_MIN_SPEEDUP times as fast (the casts of the frozen weights and a
slower bf16 attention eat part of the products' gain). No CPU names or flags are consulted; the choice is
remembered per process for the model's shapes, so two runs in one process take the same one. bf16 steps
reach the same held-out agreement as fp32 ones (docs/performance.md).

    precision = resolve_precision("auto", model, torch.device("cpu"))   # "fp32" or "bf16"
    with autocast(precision, device):
        loss = ...
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from swiftkv_reference.model import SwiftKVForCausalLM

from .forward import training_forward

logger = logging.getLogger(__name__)

PRECISIONS = ("auto", "fp32", "bf16")
BF16_MIN_SPEEDUP = 1.2
_MEASURE_FLOPS = 2e10  # the timed layer's products, forward and backward (~0.2 s in fp32 on 2 cores)
_MEASURE_ROWS = (64, 1024)  # its tokens, within these bounds, in sequences of up to _MEASURE_SEQUENCE
_MEASURE_SEQUENCE = 256
_MEASURE_REPEATS = 3
_chosen: dict[tuple, str] = {}  # measured choices of this process, by the shapes and thread count


def check_precision(precision: str, where: str = "precision") -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"{where} must be one of {', '.join(PRECISIONS)}, got {precision!r}")


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The context the forwards run in: bf16 autocast on the device's type, or nothing for fp32."""
    if precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if precision == "fp32":
        return contextlib.nullcontext()
    raise ValueError(f"autocast needs a resolved precision (fp32 or bf16), got {precision!r}")


@contextlib.contextmanager
def frozen_weights_in_bf16(model: SwiftKVForCausalLM, precision: str, device: torch.device):
    """Under bf16 autocast on CPU: for the duration, every frozen nn.Linear weight and bias of `model` is
    its bf16 copy, and the context yields a bf16 copy of the output projection (model.lm_weight(), for
    final_logits; None otherwise). The arithmetic is bit for bit autocast's, which casts those fp32
    tensors on every use (its cache keeps only tensors that require grad), once per micro-batch and
    forward (`python -m bench distill-step` times both). The copies cost half the frozen weights'
    bytes (logged), so CUDA (where the casts are cheap next to a step and memory is the limit) keeps
    autocast's casts. The original fp32 Parameters are put back on exit, whatever happens.

        with frozen_weights_in_bf16(model, "bf16", device) as lm_weight:
            logits = final_logits(model, h, lm_weight)
    """
    if precision != "bf16" or device.type != "cpu":
        yield None
        return
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Parameter]] = []
    try:
        for module in model.modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            for name in ("weight", "bias"):
                param = module._parameters.get(name)
                if param is not None and not param.requires_grad and param.dtype == torch.float32:
                    swapped.append((module, name, param))
                    copy = param.detach().bfloat16()
                    module._parameters[name] = torch.nn.Parameter(copy, requires_grad=False)
        copies = [module._parameters[name] for module, name, _ in swapped]
        lm_weight = model.lm_weight().detach()
        if lm_weight.dtype != torch.bfloat16:  # tied to the fp32 embedding: a copy of its own
            lm_weight = lm_weight.bfloat16()
            copies.append(lm_weight)
        nbytes = sum(t.numel() * t.element_size() for t in copies)
        logger.info(
            "bf16 copies of %d frozen weights for the distillation: %.0f MiB", len(copies), nbytes / 2**20
        )
        yield lm_weight
    finally:
        for module, name, param in reversed(swapped):
            module._parameters[name] = param


def resolve_precision(precision: str, model: SwiftKVForCausalLM, device: torch.device) -> str:
    """ "fp32" or "bf16" for `precision` ("auto" is measured on CPU and bf16 on CUDA; see the module
    docstring). The model must be on `device` in fp32; nothing of it changes, nor the RNG state."""
    check_precision(precision)
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16"
    c = model.config
    key = (
        device.type,
        c.hidden_size,
        c.intermediate_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        torch.get_num_threads(),
    )
    if key not in _chosen:
        fp32, bf16 = _time_layer(model, device)
        choice = "bf16" if fp32 >= BF16_MIN_SPEEDUP * bf16 else "fp32"
        logger.info(
            "distillation precision: %s (a decoder layer's forward + backward takes %.1f ms in fp32, "
            "%.1f ms in bf16 autocast on this %s: %.2fx; bf16 needs %.1fx)",
            choice,
            fp32 * 1e3,
            bf16 * 1e3,
            device.type,
            fp32 / bf16,
            BF16_MIN_SPEEDUP,
        )
        _chosen[key] = choice
    return _chosen[key]


def _time_layer(model: SwiftKVForCausalLM, device: torch.device) -> tuple[float, float]:
    """Best-of-_MEASURE_REPEATS seconds of the last decoder layer's forward and backward (to its
    input) on random tokens, fp32 and bf16 autocast, interleaved (CPU: no device to synchronize)."""
    c = model.config
    per_token = 2 * sum(p.numel() for p in model.model.layers[-1].parameters())  # FLOPs per token, forward
    rows = int(min(max(_MEASURE_FLOPS / (3 * per_token), _MEASURE_ROWS[0]), _MEASURE_ROWS[1]))
    length = min(rows, _MEASURE_SEQUENCE)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, c.vocab_size, (max(rows // length, 1), length), generator=g).to(device)
    last = c.num_hidden_layers - 1
    with torch.no_grad():
        start = model.model.embed_tokens(ids).float()  # (B, T, hidden)

    def run(precision: str) -> float:
        h = start.detach().requires_grad_(True)
        t = time.perf_counter()
        with autocast(precision, device):
            out = training_forward(model, ids, swiftkv=False, compute_logits=False, start=(last, h))
        torch.autograd.grad(out.hidden.float().sum(), h)
        return time.perf_counter() - t

    best = {"fp32": float("inf"), "bf16": float("inf")}
    for repeat in range(_MEASURE_REPEATS + 1):
        for precision in best:
            seconds = run(precision)
            if repeat:  # the first round warms up
                best[precision] = min(best[precision], seconds)
    return best["fp32"], best["bf16"]
