"""Attention backends behind one interface, chosen by name: `torch` (portable), `triton`, `flash_attn`."""

from __future__ import annotations

import torch

from swiftkv_fast.attention.base import AttentionBackend, AttentionMetadata
from swiftkv_fast.attention.torch_backend import TorchBackend

BACKENDS = ("auto", "torch", "triton", "flash_attn")

__all__ = ["AttentionBackend", "AttentionMetadata", "TorchBackend", "BACKENDS", "get_attention_backend"]


def get_attention_backend(
    name: str, device: torch.device | str, block_size: int, plan=None
) -> AttentionBackend:
    """`auto` is `torch` on CPU and `triton` on CUDA when it imports (else `torch`). `block_size`: of
    the KV cache (flash_attn needs a multiple of 256). `plan`: the engine's kernel plan
    (kernels/plan.py), whose C kernels the torch backend runs; None: torch alone."""
    device = torch.device(device)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        if device.type != "cuda":
            return get_attention_backend("torch", device, block_size, plan)
        try:
            return get_attention_backend("triton", device, block_size)
        except (ImportError, RuntimeError):
            return get_attention_backend("torch", device, block_size, plan)
    if name == "torch":
        return TorchBackend() if plan is None else TorchBackend.for_plan(plan)
    if name == "triton":
        try:
            from swiftkv_fast.attention.triton_backend import TritonBackend
        except ImportError as e:
            raise ImportError(
                f"attention_backend='triton' needs the `triton` package and our kernels ({e}); "
                "on CPU set TRITON_INTERPRET=1 before importing swiftkv_fast, or use 'torch'"
            ) from e
        return TritonBackend()
    if device.type != "cuda":
        raise RuntimeError("attention_backend='flash_attn' needs a CUDA device; use 'torch' or 'triton'")
    try:
        from swiftkv_fast.attention.flash_backend import FlashAttnBackend
    except ImportError as e:
        raise ImportError(f"attention_backend='flash_attn' needs the `flash_attn` package ({e})") from e
    return FlashAttnBackend(block_size)
