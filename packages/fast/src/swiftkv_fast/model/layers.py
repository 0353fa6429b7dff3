"""Small layers: Linear (its kernel chosen per row count, model/linear_kernels.py), RMSNorm, RoPE
(cos/sin table), SiLU-and-mul."""

from __future__ import annotations

from bisect import bisect_left

import torch
import torch.nn.functional as F

from swiftkv_fast.model.linear_kernels import KERNELS, KernelChoice


class Linear:
    """y = x W^T + b for a checkpoint weight W (out_features, in_features).

    `choice` holds W in the layouts its kernels need and which kernel runs which row counts (on CPU
    LinearKernelChooser picks them by measurement); without one, F.linear on W as it is.
    """

    __slots__ = ("in_features", "out_features", "bias", "layouts", "plan", "_bounds", "_runs")

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None = None, choice: KernelChoice | None = None
    ):
        choice = choice or KernelChoice.single("linear", weight)
        self.out_features, self.in_features = weight.shape
        self.bias = bias
        self.layouts, self.plan = choice.layouts, choice.plan
        self._bounds = [rows for rows, _ in choice.plan[:-1]]
        self._runs = [(KERNELS[k].run, choice.layouts[k]) for _, k in choice.plan]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, in_features) -> (T, out_features)
        run, layout = self._runs[bisect_left(self._bounds, x.shape[0])]
        return run(x, layout, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: (T, hidden)
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)  # one fused pass; same math in fp32
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: (T, 2 * intermediate) -> (T, intermediate)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


class RotaryTable:
    """cos/sin of every position up to max_positions (rotate-half layout: both halves are equal, so only
    one half is kept), looked up by position."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, device: torch.device):
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        self.cos = angles.cos().to(device)  # (max_positions, head_dim // 2)
        self.sin = angles.sin().to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (T,) -> cos, sin: (T, 1, head_dim // 2) fp32
        return self.cos[positions][:, None], self.sin[positions][:, None]


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
