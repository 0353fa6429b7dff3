"""y = x W^T (+ b) on CPU with Intel AMX tiles for a weight that is exactly 4-bit blocks
(kernels/weight_forms.py: W = d q + m per 32 inputs of an output row, codes q in [0, 16)), in fp32
arithmetic (csrc/amx_q4_gemm.c): the `q4-amx` candidate of kernels/linear_kernels.py, permitted at the
"highest" float32 matmul precision.

Every product is exact (the codes are exact in bf16, and each fp32 input is split into three bf16
parts that sum to it exactly), so y is the fp32 dot product of x and the fp32 weights, summed in
another order than a sequential FMA chain, as any GEMM library's blocking does. The weight is held as
bf16 code tiles and fp32 d, m: 2.25 bytes per weight where fp32 takes 4.

Needs what kernels/cpu_amx.py needs; `amx` in SWIFTKV_DISABLED_KERNELS turns both off.
"""

from __future__ import annotations

import threading

import torch

from swiftkv_fast.kernels import cpu_amx, native
from swiftkv_fast.kernels._common import dense_rows
from swiftkv_fast.kernels.weight_forms import Q4_BLOCK, FormMismatch, q4_blocks

TILE_K = 32  # inputs per tile: one block of the 4-bit form
BLOCK = 32  # rows and columns of a register block

_scratch = threading.local()  # per thread, the split x and its block sums, grown to the largest call


class Q4AmxWeight:
    """W (out, in) fp32 with an exact 4-bit form, as bf16 code tiles and fp32 d, m for `linear`.
    Raises FormMismatch for a weight without one, RuntimeError where AMX cannot run here."""

    def __init__(self, weight: torch.Tensor):
        reason = cpu_amx.unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the AMX kernels are unavailable here ({reason})")
        found = q4_blocks(weight)
        if found is None:
            raise FormMismatch(f"a {tuple(weight.shape)} weight that is not exactly 4-bit blocks")
        d, m, q = found
        self.out_features, self.in_features = weight.shape
        self._k_blocks = self.in_features // Q4_BLOCK
        n_blocks = -(-self.out_features // BLOCK) * 2
        pad = n_blocks * 16 - self.out_features
        q = torch.nn.functional.pad(q, (0, 0, 0, pad)).to(torch.bfloat16)  # exact: integers below 16
        pairs = q.view(n_blocks, 16, self._k_blocks, TILE_K // 2, 2)
        # (n_blocks, k_blocks, 16 pairs, 16 columns, 2): tile row k / 2 holds (k, k + 1) of every column
        self.codes = pairs.permute(0, 2, 3, 1, 4).contiguous().view(torch.int16)
        self.d, self.m = (
            torch.nn.functional.pad(t, (0, 0, 0, pad))
            .view(n_blocks, 16, self._k_blocks)
            .transpose(1, 2)
            .contiguous()
            for t in (d, m)
        )
        self._run = native.load("amx-q4-gemm").amx_q4_linear

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.m))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) fp32 -> (..., out)."""
        x2 = dense_rows(x, self.in_features, "AMX 4-bit kernel")
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features)
        if rows:
            padded = -(-rows // BLOCK) * BLOCK
            split, sums = _scratch_buffers(3 * padded * self._k_blocks * TILE_K, padded * self._k_blocks)
            self._run(
                x2.data_ptr(),
                x2.stride(0),
                rows,
                self.out_features,
                self._k_blocks,
                self.codes.data_ptr(),
                self.d.data_ptr(),
                self.m.data_ptr(),
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                split.data_ptr(),
                sums.data_ptr(),
                torch.get_num_threads(),
            )
        return y.view(*x.shape[:-1], self.out_features)


def _scratch_buffers(split_values: int, sum_values: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's scratch for the split x (bf16 bits) and its block sums, kept for the next call."""
    split, sums = getattr(_scratch, "buffers", (None, None))
    if split is None or split.numel() < split_values or sums.numel() < sum_values:
        split = torch.empty(max(split_values, 0 if split is None else split.numel()), dtype=torch.int16)
        sums = torch.empty(max(sum_values, 0 if sums is None else sums.numel()))
        _scratch.buffers = (split, sums)
    return split, sums
