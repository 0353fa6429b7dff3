"""Exact compact forms of an fp32 weight: 4-bit blocks, 8-bit blocks, values exact in bf16.

A checkpoint quantized by a min / max rule to 4 bits with a scale and an offset per block of 32 inputs
(GGUF's Q4_1, the embedded SmolLM2 model among them) holds, once dequantized to fp32, weights that are
exactly `d * q + m` for each output row's run of Q4_BLOCK inputs, with one (d, m) per run and integer
codes q in [0, 16), the block's smallest value at code 0 and its largest at 15 (other int4 schemes,
such as GPTQ's groups of 128, are not recognized and stay fp32). Kept that way the weight is 6 bits
per value (the codes and an fp32 d and m per 32) instead of 32, and a decode-sized GEMM, which reads
every weight from memory once per step, reads 5.3x fewer bytes. The values are the same fp32 numbers,
so nothing about the model's math changes: `q4_blocks` returns the structure only when rebuilding
every value from it gives the weight back bit for bit, and only when every product d * q is exact in
fp32 (so the kernel's d * q + m rounds once, FMA-contracted or not, as it does here).

Worked example, one row of a block of 4 inputs (Q4_BLOCK is 32): [0.5, 0.75, 0.5, 1.25] has
m = 0.5 (the smallest), d = (1.25 - 0.5) / 15 = 0.05 rounded to fp16 (0.04998779...) and codes
round((w - m) / d) = [0, 5, 0, 15]; 0.04998779 * 15 + 0.5 = 1.2498169 != 1.25, so with the fp16 scale
the block does not rebuild, and the fp32 scale 0.05 is tried: 0.05 * 5 + 0.5 = 0.75 but 0.05 * 15 is
0.75000006 in fp32 (not exact), so this row has no exact 4-bit form and the weight stays fp32.
Dequantized Q4_1 rows rebuild with the fp16 scale they were written with.

`q8_blocks` finds the symmetric 8-bit form the same way (d q per block, codes in [-127, 127], GGUF's
Q8_0, which the embedded model's embedding and tied lm_head are): the panel GEMM keeps it as 8-bit
panels, on FMAs or AMX tiles. `bf16_exact` tells a bf16 checkpoint loaded as fp32 (every value exact
in bf16): the panel GEMM keeps it as bf16 panels (`bf16_panels`), and the bf16-amx kernel takes it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from functools import wraps

import torch

Q4_BLOCK = 32  # inputs per (d, m) pair: the C kernel's Q4_BLOCK
LEVELS = 15  # codes are 0..15
ROWS_PER_CHUNK = 4096  # rows examined at once (bounds the temporaries; stops at the first misfit)


_memo = threading.local()  # the forms found for one weight while `remembered` holds it


@contextmanager
def remembered(weight: torch.Tensor) -> Iterator[None]:
    """Within the block, q4_blocks / q8_blocks of this very tensor are computed once (the kernel chooser
    asks for a weight's form, then each layout it packs asks again)."""
    _memo.weight, _memo.found = weight, {}
    try:
        yield
    finally:
        _memo.weight, _memo.found = None, {}


def _remember(find):
    @wraps(find)
    def cached(weight: torch.Tensor):
        if getattr(_memo, "weight", None) is not weight:
            return find(weight)
        if find.__name__ not in _memo.found:
            _memo.found[find.__name__] = find(weight)
        return _memo.found[find.__name__]

    return cached


class FormMismatch(ValueError):
    """A weight is not of the exact form a kernel takes (4- or 8-bit blocks, bf16 values): the kernel
    does not apply to it (other weights may)."""


def bf16_exact(weight: torch.Tensor) -> bool:
    """Every value of the fp32 weight is exact in bf16 (its low 16 bits zero) and finite: a bf16
    checkpoint loaded as fp32."""
    if weight.dtype != torch.float32 or weight.numel() == 0:
        return False
    bits = weight.contiguous().view(torch.int32)
    return bool((bits & 0xFFFF).eq(0).all() and weight.isfinite().all())


def _fit(
    b: torch.Tensor, lo: torch.Tensor, d: torch.Tensor, check_product: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes for blocks b (rows, blocks, Q4_BLOCK) with offsets lo and scales d (rows, blocks), and which
    blocks they rebuild exactly (rows, blocks). `check_product`: also require d * q exact in fp32 (it
    is for an fp16 d: 11 significant bits times 4)."""
    d_, lo_ = d.unsqueeze(-1), lo.unsqueeze(-1)
    positive = d_ > 0
    q = torch.where(positive, ((b - lo_) / torch.where(positive, d_, 1.0)).round(), 0.0).clamp(0, LEVELS)
    product = d_ * q
    rebuilt = product + lo_ == b
    if check_product:
        rebuilt &= product.double() == d_.double() * q.double()
    return q, rebuilt.all(-1) & d.isfinite() & lo.isfinite()


@_remember
def q4_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """weight (N, K) fp32 -> (d, m, q): scales and offsets (N, K / Q4_BLOCK) fp32 and codes (N, K) uint8
    with weight == d * q + m exactly for every block, or None where some block has no such form (or K
    is not a multiple of Q4_BLOCK). Scales are tried rounded to fp16 first (what 4-bit checkpoints
    store), then as fp32, per block."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % Q4_BLOCK:
        return None
    n, k = weight.shape
    d_all = torch.empty(n, k // Q4_BLOCK)
    m_all = torch.empty(n, k // Q4_BLOCK)
    q_all = torch.empty(n, k, dtype=torch.uint8)
    for start in range(0, n, ROWS_PER_CHUNK):
        b = weight[start : start + ROWS_PER_CHUNK].reshape(-1, k // Q4_BLOCK, Q4_BLOCK)
        lo, hi = b.amin(-1), b.amax(-1)
        span = (hi - lo) / LEVELS
        half = span.to(torch.float16).float()
        q, ok = _fit(b, lo, half, check_product=False)
        d = half
        if not ok.all():
            d = torch.where(ok, half, span)
            q, ok = _fit(b, lo, d, check_product=True)
            if not ok.all():
                return None
        rows = slice(start, start + b.shape[0])
        d_all[rows], m_all[rows], q_all[rows] = d, lo, q.reshape(-1, k).to(torch.uint8)
    return d_all, m_all, q_all


def q4_panels(weight: torch.Tensor, panel: int = 16) -> torch.Tensor | None:
    """weight (N, K) fp32 in the panel GEMM's 4-bit layout, (ceil(N / panel), K / Q4_BLOCK, bytes) uint8:
    per panel of `panel` output columns and block of Q4_BLOCK inputs, the columns' d (fp32), their m,
    then per pair of inputs one byte per column (the first input's code in the low nibble). Columns
    past N hold d = m = 0 (weights 0). None where the weight has no exact 4-bit form (`q4_blocks`)."""
    found = q4_blocks(weight)
    if found is None:
        return None
    d, m, q = found
    panels, blocks = -(-q.shape[0] // panel), q.shape[1] // Q4_BLOCK
    pairs = _padded(q, panels * panel).view(panels, panel, blocks, Q4_BLOCK // 2, 2)
    codes = pairs[..., 0] | (pairs[..., 1] << 4)  # (panels, panel, blocks, pairs)
    codes = codes.permute(0, 2, 3, 1).reshape(panels, blocks, Q4_BLOCK // 2 * panel)
    return torch.cat([_scales(d, panel), _scales(m, panel), codes], dim=-1).contiguous()


def bf16_panels(weight: torch.Tensor, panel: int = 16) -> torch.Tensor | None:
    """weight (N, K) fp32 in the panel GEMM's bf16 layout, (ceil(N / panel), K, panel) bf16: the fp32
    panels' values, each exact in bf16 (zeros past N). None where a value is not (`bf16_exact`)."""
    if not bf16_exact(weight):
        return None
    panels = -(-weight.shape[0] // panel)
    padded = _padded(weight.to(torch.bfloat16), panels * panel)
    return padded.view(panels, panel, -1).transpose(1, 2).contiguous()


def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t (N, ...) with zero rows appended up to `rows` (columns past N of the last panel)."""
    return torch.nn.functional.pad(t, (0, 0, 0, rows - t.shape[0]))


def _scales(t: torch.Tensor, panel: int) -> torch.Tensor:
    """Per-block values (N, blocks) fp32 as the panels hold them: (panels, blocks, 4 panel) bytes."""
    panels = -(-t.shape[0] // panel)
    return _padded(t, panels * panel).view(panels, panel, -1).transpose(1, 2).contiguous().view(torch.uint8)


@_remember
def q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """weight (N, K) fp32 -> (d, q): scales (N, K / Q4_BLOCK) fp32 and codes (N, K) int8 in [-127, 127]
    with weight == d * q exactly for every block (GGUF's Q8_0: d = max |w| / 127 in fp16), or None. The
    products are exact: an fp16 d has 11 significant bits, a code 7."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.shape[1] % Q4_BLOCK:
        return None
    n, k = weight.shape
    d_all, q_all = torch.empty(n, k // Q4_BLOCK), torch.empty(n, k, dtype=torch.int8)
    for start in range(0, n, ROWS_PER_CHUNK):
        b = weight[start : start + ROWS_PER_CHUNK].reshape(-1, k // Q4_BLOCK, Q4_BLOCK)
        d = (b.abs().amax(-1) / 127).to(torch.float16).float()
        d_ = d.unsqueeze(-1)
        q = torch.where(d_ > 0, b / torch.where(d_ > 0, d_, 1.0), 0.0).round().clamp(-127, 127)
        if not ((d_ * q == b).all() and d.isfinite().all()):
            return None
        rows = slice(start, start + b.shape[0])
        d_all[rows], q_all[rows] = d, q.reshape(-1, k).to(torch.int8)
    return d_all, q_all


def q8_panels(weight: torch.Tensor, panel: int = 16) -> torch.Tensor | None:
    """weight (N, K) fp32 in the panel GEMM's 8-bit layout, (ceil(N / panel), K / Q4_BLOCK, bytes) uint8:
    per panel and block of Q4_BLOCK inputs, the columns' d (fp32), zeros where the 4-bit layout has m,
    then per pair of inputs the columns' two codes side by side (int8; the order a bf16 tile of
    TDPBF16PS reads). None where the weight has no exact 8-bit form (`q8_blocks`)."""
    found = q8_blocks(weight)
    if found is None:
        return None
    d, q = found
    panels, blocks = -(-q.shape[0] // panel), q.shape[1] // Q4_BLOCK
    pairs = _padded(q, panels * panel).view(panels, panel, blocks, Q4_BLOCK // 2, 2)
    codes = pairs.permute(0, 2, 3, 1, 4).reshape(panels, blocks, Q4_BLOCK * panel).view(torch.uint8)
    scales = _scales(d, panel)
    return torch.cat([scales, torch.zeros_like(scales), codes], dim=-1).contiguous()
