"""Small functional layers: RMSNorm, RoPE (cos/sin table), SiLU-and-mul."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # x: (T, hidden)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: (T, 2 * intermediate) -> (T, intermediate)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class RotaryTable:
    """cos/sin of every position up to max_positions, looked up by position (rotate-half layout)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, device: torch.device):
        angles = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat([angles, angles], dim=-1)  # (max_positions, head_dim)
        self.cos = emb.cos().to(device)
        self.sin = emb.sin().to(device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions: (T,) -> cos, sin: (T, 1, head_dim) fp32
        return self.cos[positions][:, None], self.sin[positions][:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (T, heads, head_dim); cos/sin: (T, 1, head_dim)
    half = x.shape[-1] // 2
    xf = x.float()
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)
