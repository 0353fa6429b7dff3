"""Rotary position embeddings: the one definition of the frequencies, and rotate-half RoPE.

inv_freq[j] = theta ** (-2j / head_dim), j = 0..head_dim/2 - 1, then (for rope_type "llama3") the
Llama 3.1 rescaling: with wavelength w = 2*pi / inv_freq and the original context C,
    w > C / low_freq_factor   -> inv_freq / factor                    (low frequencies: scaled)
    w < C / high_freq_factor  -> inv_freq                             (high frequencies: kept)
    otherwise                 -> (1 - s) * inv_freq / factor + s * inv_freq,
                                 s = (C / w - low_freq_factor) / (high_freq_factor - low_freq_factor)
The angle of position p is p * inv_freq; cos/sin are repeated over both halves (rotate-half layout).
"""

from __future__ import annotations

import math

import torch

from .config import SwiftKVConfig


def rope_inv_freq(config: SwiftKVConfig) -> torch.Tensor:
    """Inverse frequencies, fp32, shape (head_dim // 2,), with llama3 scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    context = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape (num_tokens, head_dim), fp32, for integer positions (num_tokens,)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # (num_tokens, head_dim // 2)
    emb = torch.cat([angles, angles], dim=-1)  # (num_tokens, head_dim)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: (num_tokens, num_heads, head_dim); cos/sin: (num_tokens, head_dim)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    out = x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]
    return out.to(x.dtype)
