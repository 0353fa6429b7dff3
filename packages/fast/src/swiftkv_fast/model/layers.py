"""Small layers: Linear (weight stored in the layout the device's GEMM is fastest with), RMSNorm, RoPE
(cos/sin table), SiLU-and-mul."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """y = x W^T + b for a checkpoint weight W (out_features, in_features).

    On CPU the weight is kept transposed, (in_features, out_features) contiguous: MKL's sgemm over a few
    rows (decode-shaped batches) is 1.2-3x faster without the transpose flag, and as fast for thousands
    of rows (prefill). Other devices keep W as it is (cuBLAS's preferred layout).
    """

    __slots__ = ("weight", "bias", "transposed")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.transposed = weight.device.type == "cpu"
        self.weight = weight.t().contiguous() if self.transposed else weight
        self.bias = bias

    @property
    def in_features(self) -> int:
        return self.weight.shape[0] if self.transposed else self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1] if self.transposed else self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: (T, in_features) -> (T, out_features)
        if not self.transposed:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            return torch.mm(x, self.weight)
        return torch.addmm(self.bias, x, self.weight)


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
