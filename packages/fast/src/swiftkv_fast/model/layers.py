"""Small layers: Linear (its kernel chosen per row count, kernels/linear_kernels.py; `after_norm` and
`after_silu_and_mul` also run the op in front of it, fused into the panel GEMM where that kernel
runs), RMSNorm (and the residual add fused in front of it), RoPE (cos/sin table, applied in place),
SiLU-and-mul. The torch code here is their specification and the portable path; `RowOps` runs the C
kernels of kernels/cpu_ops.py instead where the engine's kernel plan chose them."""

from __future__ import annotations

from bisect import bisect_left
from functools import partial
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from swiftkv_fast.kernels import cpu_ops
from swiftkv_fast.kernels.cpu_gemm import PanelWeight
from swiftkv_fast.kernels.linear_kernels import KERNELS, KernelChoice, nbytes


class RowOps:
    """RMSNorm with the residual add, SiLU-and-mul and in-place RoPE as one engine runs them: the C
    kernels of `lib` (kernels/cpu_ops.py, the plan's `row_ops`), or the torch functions of this module
    when `lib` is None."""

    def __init__(self, lib: SimpleNamespace | None = None):
        self.lib = lib
        if lib is None:
            self.add_rms_norm, self.silu_and_mul = add_rms_norm, silu_and_mul
        else:
            self.add_rms_norm = partial(cpu_ops.add_rms_norm, lib)
            self.silu_and_mul = partial(cpu_ops.silu_and_mul, lib)


class Linear:
    """y = x W^T + b for a checkpoint weight W (out_features, in_features).

    `choice` holds W in the layouts its kernels need and which kernel runs which row counts (on CPU
    LinearKernelChooser picks them by measurement); without one, F.linear on W as it is.
    """

    __slots__ = (
        "in_features",
        "out_features",
        "bias",
        "layouts",
        "plan",
        "ops",
        "_bounds",
        "_runs",
        "_panels",
    )

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        choice: KernelChoice | None = None,
        ops: RowOps | None = None,
    ):
        choice = choice or KernelChoice.single("linear", weight)
        self.ops = ops or TORCH_OPS  # the norm / SiLU in front of it (after_norm, after_silu_and_mul)
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.layouts, self.plan = choice.layouts, choice.plan
        self._bounds = [rows for rows, _ in choice.plan[:-1]]
        self._runs = [(KERNELS[k].run, choice.layouts[k]) for _, k in choice.plan]
        # per plan entry, the PanelWeight when the panel GEMM runs it: it fuses the op before it
        self._panels = [layout if isinstance(layout, PanelWeight) else None for _, layout in self._runs]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, in_features) -> (T, out_features)
        run, layout = self._runs[bisect_left(self._bounds, x.shape[0])]
        return run(x, layout, self.bias)

    def drop_spare_layouts(self) -> int:
        """Frees the layouts no row count's kernel runs (a spare kept for the decode stack, which reads
        `layouts["panel"]`); returns the bytes freed."""
        used = {k for _, k in self.plan}
        spare = [k for k in self.layouts if k not in used]
        freed = sum(nbytes(self.layouts[k]) for k in spare)
        self.layouts = {k: w for k, w in self.layouts.items() if k in used}
        return freed

    def panel_at(self, rows: int) -> PanelWeight | None:
        """The panel GEMM's layout where it runs calls of `rows` rows, else None."""
        return self._panels[bisect_left(self._bounds, rows)]

    def after_norm(
        self, h: torch.Tensor, delta: torch.Tensor | None, norm_weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """self(add_rms_norm(h, delta, norm_weight, eps)): h += delta in place, then this layer on the
        normed rows. Where the row count's kernel is the panel GEMM, the add and the norm happen while
        it packs its input (one call, no normed copy); elsewhere they are add_rms_norm's own pass."""
        panel = self._panels[bisect_left(self._bounds, h.shape[0])]
        if panel is not None:
            return panel.linear_after_norm(h, delta, norm_weight, eps, self.bias)
        return self(self.ops.add_rms_norm(h, delta, norm_weight, eps))

    def after_silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """self(silu_and_mul(gate_up)), fused into the panel GEMM's packing where it runs (as after_norm).
        gate_up: (T, 2 * in_features)."""
        panel = self._panels[bisect_left(self._bounds, gate_up.shape[0])]
        if panel is not None:
            return panel.linear_after_silu_and_mul(gate_up, self.bias)
        return self(self.ops.silu_and_mul(gate_up))


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """A residual add, then the next norm: h += delta in place (no add when delta is None), returns
    RMSNorm(h) * weight as a new tensor in the weight's dtype. h, delta: (T, hidden). A bf16 model keeps
    its residual stream h in fp32 (model/swiftkv_model.py): the norm reads it whole and rounds once,
    where the linear after it reads bf16."""
    x = h if delta is None else h.add_(delta)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused pass; same math in fp32
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(weight.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: (T, 2 * intermediate) -> (T, intermediate)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


class RotaryTable:
    """cos/sin of every position up to max_positions (rotate-half layout: both halves are equal, so only
    one half is kept), looked up by position."""

    def __init__(
        self, inv_freq: torch.Tensor, max_positions: int, device: torch.device, ops: RowOps | None = None
    ):
        self.ops = ops or TORCH_OPS  # the C RoPE where ops.lib is set
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        self.cos = angles.cos().to(device)  # (max_positions, head_dim // 2)
        self.sin = angles.sin().to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (T,) -> cos, sin: (T, 1, head_dim // 2) fp32
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def at(self, positions: torch.Tensor) -> Rotation:
        """RoPE at one batch's positions (T,) int64, for every layer of a step."""
        return Rotation(self, positions)


class Rotation:
    """RoPE at one batch's positions: `apply_(x)` rotates x (T, heads, head_dim) in place (a view whose
    heads are dense within a token, e.g. the q and k columns of a fused qkv output). The C kernel reads
    the tables by position; the torch path looks cos/sin up once and reuses them for every layer."""

    __slots__ = ("table", "positions", "_cos_sin")

    def __init__(self, table: RotaryTable, positions: torch.Tensor):
        self.table, self.positions = table, positions
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def apply_(self, x: torch.Tensor) -> torch.Tensor:
        lib = self.table.ops.lib
        if lib is not None:
            return cpu_ops.rope_(lib, x, self.positions, self.table.cos, self.table.sin)
        if self._cos_sin is None:
            self._cos_sin = self.table.lookup(self.positions)
        return x.copy_(apply_rope(x, *self._cos_sin))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: out = [x1 c - x2 s, x2 c + x1 s]. x: (T, heads, head_dim) (may be a strided
    view); cos/sin: (T, 1, head_dim // 2). Returns a new contiguous tensor."""
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    out = torch.empty(xf.shape, dtype=torch.float32, device=x.device)
    o1, o2 = out[..., :half], out[..., half:]
    torch.mul(x1, cos, out=o1)
    o1.addcmul_(x2, sin, value=-1)
    torch.mul(x2, cos, out=o2)
    o2.addcmul_(x1, sin)
    return out.to(x.dtype)


TORCH_OPS = RowOps()
