"""y = x W^T (+ b) on CPU in fp32 as a C kernel over W packed in panels of 16 output columns
(csrc/panel_gemm.c): the `panel` and `panel-amx` candidates of kernels/linear_kernels.py.

Why: a decode GEMM of a few rows reads its weight from memory every step (the model's weights do not
fit in cache), and the libraries' kernels, tuned for large products, do not overlap those reads with
their FMAs; this kernel prefetches the weight stream while it computes. From cache, or at thousands of
rows, the libraries are as fast or faster: the chooser times this kernel beside them per shape and row
count and keeps the faster.

W is packed once. Where it is exactly of a compact form (kernels/weight_forms.py: 4-bit blocks, 8-bit
blocks, values exact in bf16) the panels keep that form ("q4", "q8", "bf16": fewer bytes to stream,
results bit-identical to the fp32 panels'), unless `gemm-4bit` is in SWIFTKV_DISABLED_KERNELS.
`amx=True` multiplies the 4- or 8-bit panels on AMX tiles with exact products ("q4-amx", "q8-amx").
The packing of x may apply the op in front of the layer (`linear_after_norm`,
`linear_after_silu_and_mul`), so that it costs neither a call nor a pass of its own.

Built by kernels/build.py; without a compiler, or with `gemm` in SWIFTKV_DISABLED_KERNELS,
`PanelWeight` raises RuntimeError and the chooser drops the candidate with one log line.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from swiftkv_fast import envs
from swiftkv_fast.kernels import cpu_amx, native
from swiftkv_fast.kernels._common import dense_rows
from swiftkv_fast.kernels.weight_forms import FormMismatch, bf16_panels, q4_panels, q8_panels

KERNEL = "gemm"  # its name in SWIFTKV_DISABLED_KERNELS (envs.py)
COMPACT_KERNEL = "gemm-4bit"  # disabled: every panel in fp32 (for comparisons)
PANEL = 16  # output columns per panel


def enabled() -> bool:
    return envs.kernel_enabled(KERNEL)


def four_bit_enabled() -> bool:
    return envs.kernel_enabled(COMPACT_KERNEL)


def _functions(avx512: bool) -> SimpleNamespace | None:
    if not enabled():
        return None
    return native.load("panel-gemm", SWIFTKV_NO_AVX512=int(not avx512))


def unavailable_reason(avx512: bool = True) -> str | None:
    """Why the panel GEMM cannot run here, or None when it can."""
    if not enabled():
        return envs.disabled_reason(KERNEL)
    return None if _functions(avx512) is not None else "no C compiler, or its build failed"


def amx_unavailable_reason(avx512: bool = True) -> str | None:
    """Why the panels cannot be multiplied on AMX tiles here (`PanelWeight(amx=True)`), or None."""
    reason = unavailable_reason(avx512) or cpu_amx.unavailable_reason()
    if reason is None and not _functions(avx512).gemm_has_amx():
        reason = "the panel GEMM was built without AMX-BF16 and AVX512-BF16"
    return reason


class PanelWeight:
    """W (out, in) packed in 16-column panels for `linear`; `out_features` / `in_features` as W's.
    `avx512=False` builds the 8-lane register blocks even where the compiler targets AVX-512 (so tests
    check both paths on an AVX-512 machine); `rows_per_block` says which one runs (16 or 6 rows).
    `compact`: where W is exactly a 4-bit block-quantized weight (kernels/weight_forms.py), keep it in the
    4-bit layout (`format` "q4"), else where it is exactly 8-bit blocks (d q) in the 8-bit layout
    ("q8"), else where every value is exact in bf16 in the bf16 layout ("bf16"): the results are
    bit-identical to the fp32 layout's (`format` "fp32"); None: unless `gemm-4bit` is disabled.
    `amx`: multiply the panels on AMX tiles, 4-bit (`format` "q4-amx": exact products, fp32 sums; the
    same bytes) or 8-bit ("q8-amx", for a weight exactly 8-bit blocks); raises FormMismatch where W has
    neither form, RuntimeError where AMX cannot run here."""

    def __init__(
        self, weight: torch.Tensor, avx512: bool = True, compact: bool | None = None, amx: bool = False
    ):
        reason = unavailable_reason(avx512)
        if reason is not None:
            raise RuntimeError(f"the panel GEMM kernel is unavailable here ({reason})")
        functions = _functions(avx512)
        if weight.dtype != torch.float32 or not weight.is_cpu or weight.dim() != 2:
            raise ValueError(f"the panel GEMM takes a 2-d fp32 CPU weight, got {weight.dtype} {weight.shape}")
        if weight.stride(1) != 1:
            weight = weight.contiguous()
        self.out_features, self.in_features = weight.shape
        if compact is None:
            compact = four_bit_enabled()
        if amx:
            reason = amx_unavailable_reason(avx512)
            if reason is not None:
                raise RuntimeError(f"the 4-bit panels cannot run on AMX here ({reason})")
        blocks = q4_panels(weight, PANEL) if compact or amx else None  # (panels, in / 32, 384) bytes
        self.format = "q4-amx" if amx else "q4"
        if amx and blocks is None:
            blocks, self.format = q8_panels(weight, PANEL), "q8-amx"  # (panels, in / 32, 640) bytes
            if blocks is None:
                raise FormMismatch(f"a {tuple(weight.shape)} weight that is not exactly 4- or 8-bit blocks")
        if blocks is None and compact:
            blocks, self.format = q8_panels(weight, PANEL), "q8"  # (panels, in / 32, 640) bytes
        if blocks is None and compact:
            blocks, self.format = bf16_panels(weight, PANEL), "bf16"  # (panels, in, 16) bf16
        if blocks is not None:
            self.packed = blocks
        else:
            self.format = "fp32"
            panels = -(-self.out_features // PANEL)
            self.packed = torch.empty(panels, self.in_features, PANEL)  # (panels, in, 16)
            functions.gemm_pack(
                weight.data_ptr(),
                weight.stride(0),
                self.out_features,
                self.in_features,
                self.packed.data_ptr(),
                torch.get_num_threads(),
            )
        self._gemm = functions.gemm
        self.rows_per_block = functions.gemm_rows_per_block()

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size()

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., in) fp32 -> (..., out)."""
        x2 = dense_rows(x, self.in_features, "panel GEMM")
        return self._run(x2, bias, _NONE).view(*x.shape[:-1], self.out_features)

    def linear_after_norm(
        self,
        h: torch.Tensor,
        delta: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """self.linear(add_rms_norm(h, delta, norm_weight, eps)) in one pass over h (model/layers.py's
        add_rms_norm: h += delta in place, delta None: no add). h, delta: (T, in) fp32 with dense rows,
        norm_weight (in,) -> (T, out)."""
        _check_rows("h", h, self.in_features)
        if delta is not None:
            _check_rows("delta", delta, self.in_features)
            if delta.shape[0] != h.shape[0]:
                raise ValueError(f"delta has {delta.shape[0]} rows, h {h.shape[0]}")
        if norm_weight.shape != (self.in_features,) or norm_weight.dtype != torch.float32:
            got = f"{norm_weight.dtype} {tuple(norm_weight.shape)}"
            raise ValueError(f"norm_weight must be fp32 ({self.in_features},), got {got}")
        return self._run(h, bias, _RMS_NORM, delta, norm_weight.contiguous(), eps)

    def linear_after_silu_and_mul(
        self, gate_up: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """self.linear(silu(gate) * up) for gate_up = [gate | up] (T, 2 in) fp32 with dense rows, in one
        pass over gate_up (no intermediate tensor) -> (T, out)."""
        _check_rows("gate_up", gate_up, 2 * self.in_features)
        return self._run(gate_up, bias, _SILU_MUL)

    def _run(self, x, bias, prologue, delta=None, norm_weight=None, eps=0.0) -> torch.Tensor:
        # x: (rows, in) (or (rows, 2 in) for _SILU_MUL) with unit column stride
        if bias is not None:
            bias = bias.to(torch.float32).contiguous()
        rows = x.shape[0]
        y = torch.empty(rows, self.out_features)
        if rows:
            self._gemm(
                x.data_ptr(),
                x.stride(0),
                self.packed.data_ptr(),
                FORMATS[self.format],
                None if bias is None else bias.data_ptr(),
                y.data_ptr(),
                rows,
                self.out_features,
                self.in_features,
                torch.get_num_threads(),
                prologue,
                None if delta is None else delta.data_ptr(),
                0 if delta is None else delta.stride(0),
                None if norm_weight is None else norm_weight.data_ptr(),
                eps,
            )
        return y


_NONE, _RMS_NORM, _SILU_MUL = 0, 1, 2  # csrc/panel_gemm.c's PROLOGUE_* values
FORMATS = {"fp32": 0, "q4": 1, "q4-amx": 2, "q8-amx": 3, "bf16": 4, "q8": 5}  # its PANEL_* values


def _check_rows(name: str, t: torch.Tensor, width: int) -> None:
    if t.dtype != torch.float32 or not t.is_cpu or t.dim() != 2 or t.shape[1] != width:
        raise ValueError(
            f"the panel GEMM takes {name} as fp32 CPU rows of {width}, got {t.dtype} {tuple(t.shape)}"
        )
    if t.stride(1) != 1:
        raise ValueError(
            f"the panel GEMM needs {name}'s rows dense (unit column stride), got strides {t.stride()}"
        )
