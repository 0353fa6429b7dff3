"""Attention written the obvious way: scores, a causal + sliding-window mask, softmax, weighted sum."""

from __future__ import annotations

import torch


def attention_mask(q_positions: torch.Tensor, k_positions: torch.Tensor, window: int | None) -> torch.Tensor:
    """Boolean (num_q, num_k): query at position i sees keys i-W+1..i (all keys <= i when W is None)."""
    q = q_positions[:, None]
    k = k_positions[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= k > q - window
    return allowed


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention.

    q: (num_q, num_heads, head_dim); k, v: (num_k, num_kv_heads, head_dim); positions are absolute token
    positions (num_q,), (num_k,). Query head h reads KV head h // (num_heads // num_kv_heads).
    Returns (num_q, num_heads, head_dim). Softmax in fp32.
    """
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)  # (num_k, num_heads, head_dim)
    v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # (num_heads, num_q, num_k)
    mask = attention_mask(q_positions, k_positions, window)  # (num_q, num_k)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v.float())  # (num_q, num_heads, head_dim)
    return out.to(q.dtype)
