"""y = x W^T (+ b) on CPU with Intel AMX tiles (csrc/amx_gemm.c): the `bf16x3` candidate of
kernels/linear_kernels.py, offered only when EngineConfig.matmul_precision is "high", and `bf16-amx`.

bf16x3: every fp32 value is split into two bf16 values hi + lo, and a product is a_hi b_hi + a_hi b_lo
+ a_lo b_hi in fp32 sums (the a_lo b_lo term, about 2^-16 of it, is dropped): what
torch.set_float32_matmul_precision("high") permits. `exact` (a weight whose values are exact in bf16):
x is split in three parts that sum to it exactly, so every product is exact and the sums fp32, fp32
arithmetic at the "highest" precision, with W in half the bytes.

Needs a compiler that targets AMX-BF16 (-march=native on a CPU with it) and Linux's permission for the
tile state (arch_prctl, Linux 5.16+). Where either is missing, or with `amx` in SWIFTKV_DISABLED_KERNELS,
`Bf16x3Weight` raises RuntimeError and the chooser drops the candidate with one log line.
"""

from __future__ import annotations

import threading
from functools import cache

import torch

from swiftkv_fast import envs
from swiftkv_fast.kernels import build, native
from swiftkv_fast.kernels._common import dense_rows
from swiftkv_fast.kernels.weight_forms import FormMismatch, bf16_exact

KERNEL = "amx"  # its name in SWIFTKV_DISABLED_KERNELS (envs.py)
# torch.set_float32_matmul_precision's levels the engine knows (EngineConfig.matmul_precision), most
# precise first: "highest" is fp32 throughout, "high" also permits this kernel's bf16x3
MATMUL_PRECISIONS = ("highest", "high")
TILE_K = 32  # input features per tile (32 bf16: one 64-byte tile row)
BLOCK = 32  # rows and columns of the 2 x 2 accumulator tiles of one register block

_scratch = threading.local()  # per thread, the split copy of x, grown to the largest call: a fresh
# buffer per call would fault in its pages every time


def enabled() -> bool:
    return envs.kernel_enabled(KERNEL)


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here, or None when it can."""
    if not enabled():
        return envs.disabled_reason(KERNEL)
    if _functions() is None:
        return "no C compiler"
    status = _tile_permission(build.max_isa())
    if status == native.NO_AMX:
        return "the C compiler does not target AMX-BF16 on this CPU"
    if status:
        return "Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16+)"
    return None


def _functions():
    return native.load("amx-gemm")


@cache
def _tile_permission(isa: str) -> int:
    """swiftkv_amx_enable's answer for the kernels built for `isa` (build.max_isa: native.NO_AMX where
    that build has no AMX), asked once per process and build (Linux keeps the permission for the
    process)."""
    return _functions().amx_enable()


class Bf16x3Weight:
    """W (out, in) fp32 split into bf16 hi and lo tiles for `linear`; `out_features` / `in_features` as
    W's. Raises RuntimeError where the kernel cannot run (see `unavailable_reason`).

    `exact`: W's values are exact in bf16 (a bf16 checkpoint loaded as fp32; else FormMismatch), so W is
    its hi tiles alone (half the bytes) and x is split in three parts that sum to it exactly: every
    product is exact and the sums fp32, fp32 arithmetic at the "highest" precision (the `bf16-amx`
    candidate), for the same three tile products per block as bf16x3."""

    def __init__(self, weight: torch.Tensor, exact: bool = False):
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"the AMX bf16x3 kernel is unavailable here ({reason})")
        if weight.dtype != torch.float32 or not weight.is_cpu or weight.dim() != 2:
            raise ValueError(f"the AMX kernel takes a 2-d fp32 CPU weight, got {weight.dtype} {weight.shape}")
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        self._k_blocks = -(-self.in_features // TILE_K)
        n_blocks = -(-self.out_features // BLOCK) * 2  # 16-column tiles, in pairs
        if exact and not bf16_exact(weight):
            raise FormMismatch(f"a {tuple(weight.shape)} weight whose values are not all exact in bf16")
        self.exact = exact
        self.hi = torch.empty(n_blocks, self._k_blocks, 16, TILE_K, dtype=torch.int16)  # bf16 bits
        self.lo = None if exact else torch.empty_like(self.hi)
        self._functions = _functions()
        self._functions.amx_pack(
            weight.data_ptr(),
            weight.stride(0),
            self.out_features,
            self.in_features,
            n_blocks,
            self._k_blocks,
            self.hi.data_ptr(),
            None if self.lo is None else self.lo.data_ptr(),
            torch.get_num_threads(),
        )

    @property
    def nbytes(self) -> int:
        return (1 if self.lo is None else 2) * self.hi.numel() * self.hi.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) fp32 -> (..., out)."""
        x2 = dense_rows(x, self.in_features, "AMX kernel")
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        rows = x2.shape[0]
        y = torch.empty(rows, self.out_features)
        parts = 3 if self.exact else 2  # x split in three (exact) or two (bf16x3)
        if rows:
            self._functions.amx_linear(
                x2.data_ptr(),
                x2.stride(0),
                rows,
                self.out_features,
                self.in_features,
                self._k_blocks,
                self.hi.data_ptr(),
                None if self.lo is None else self.lo.data_ptr(),
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                _split_buffer(parts * -(-rows // BLOCK) * 2 * self._k_blocks * 16 * TILE_K).data_ptr(),
                torch.get_num_threads(),
            )
        return y.view(*x.shape[:-1], self.out_features)


def _split_buffer(values: int) -> torch.Tensor:
    """This thread's scratch of at least `values` bf16 values, kept for the next call."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < values:
        buffer = _scratch.buffer = torch.empty(values, dtype=torch.int16)
    return buffer
