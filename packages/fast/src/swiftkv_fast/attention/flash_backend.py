"""The ``flash_attn`` attention backend: a thin adapter over flash-attn 2's paged kernels.

- prefill (the first half, many queries per request): ``flash_attn_varlen_func``
  with ``block_table`` and ``cu_seqlens_k`` built from ``seq_lens``;
- decode (the second half, one query per request): ``flash_attn_with_kvcache``
  with ``cache_seqlens`` and ``block_table``;
- sliding window W: ``window_size=(W - 1, 0)`` (flash-attn aligns causal masks
  bottom-right, so query j of a request sits at position ``seq_len - q_len + j``
  exactly as our interface says); no window: ``(-1, -1)``.
- write_kv: the Triton scatter kernel when triton imports, else torch indexing.

flash-attn's paged mode needs a KV block size that is a multiple of 256: the
constructor checks it once (EngineConfig checks it before anything is loaded).
flash_attn is imported lazily, in the constructor: importing this module never
fails.
"""

from __future__ import annotations

import torch

from swiftkv_fast.attention.base import AttentionBackend

FLASH_BLOCK_MULTIPLE = 256


def validate_block_size(block_size: int) -> int:
    """Return ``block_size`` or raise ValueError unless it is a positive multiple of 256."""
    if not isinstance(block_size, int) or block_size <= 0 or block_size % FLASH_BLOCK_MULTIPLE:
        raise ValueError(
            f"attention_backend='flash_attn' needs block_size to be a multiple of {FLASH_BLOCK_MULTIPLE} "
            f"(flash-attn's paged KV cache), got {block_size!r}; use block_size=256 or another backend "
            "('triton' or 'torch')"
        )
    return block_size


def flash_attn_available() -> bool:
    """True when flash_attn imports and CUDA is available (what the constructor needs)."""
    try:
        _import_flash_attn()
    except ImportError:
        return False
    return torch.cuda.is_available()


def _import_flash_attn():
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
    except ImportError as e:
        raise ImportError(
            "attention_backend='flash_attn' needs the `flash-attn` package (>= 2.6, for paged KV), "
            f"which is not installed or does not import here ({e}); use 'triton' or 'torch'"
        ) from e
    return flash_attn_varlen_func, flash_attn_with_kvcache


def torch_write_kv(
    kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """write_kv with torch indexing (any device). Slots < 0 are skipped."""
    n_layers, _, num_blocks, block_size = kv_cache.shape[:4]
    flat = kv_cache.view(n_layers, 2, num_blocks * block_size, *kv_cache.shape[4:])
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    flat[:, 0, slots] = k[keep].transpose(0, 1).to(kv_cache.dtype)
    flat[:, 1, slots] = v[keep].transpose(0, 1).to(kv_cache.dtype)


def _window_size(window: int | None) -> tuple[int, int]:
    return (-1, -1) if window is None else (int(window) - 1, 0)


class FlashAttnBackend(AttentionBackend):
    name = "flash_attn"
    supports_cuda_graph = True  # flash_attn_with_kvcache is what vLLM captures for decode

    def __init__(self, block_size: int):
        validate_block_size(block_size)
        self._varlen, self._with_kvcache = _import_flash_attn()
        if not torch.cuda.is_available():
            raise RuntimeError("attention_backend='flash_attn' needs a CUDA device; use 'torch' or 'triton'")
        self._triton_write = None  # resolved on the first CUDA write (keeps triton out of CPU imports)

    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        if not kv_cache.is_cuda:
            return torch_write_kv(kv_cache, k, v, slot_mapping)
        if self._triton_write is None:
            try:
                from swiftkv_fast.kernels.write_kv import write_kv as triton_write_kv
            except ImportError:
                triton_write_kv = torch_write_kv
            self._triton_write = triton_write_kv
        self._triton_write(kv_cache, k, v, slot_mapping)

    def prefill(self, q, k_cache, v_cache, meta, window, scale) -> torch.Tensor:
        seq_lens = meta.seq_lens
        cu_seqlens_k = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        cu_seqlens_k[1:] = seq_lens.cumsum(0, dtype=torch.int32)
        return self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=int(meta.max_query_len),
            max_seqlen_k=int(meta.max_seq_len),
            softmax_scale=scale,
            causal=True,
            window_size=_window_size(window),
            block_table=meta.block_tables,
        )

    def decode(self, q, k_cache, v_cache, seq_lens, block_tables, window, scale) -> torch.Tensor:
        out = self._with_kvcache(
            q.unsqueeze(1),
            k_cache,
            v_cache,
            cache_seqlens=seq_lens,
            block_table=block_tables,
            softmax_scale=scale,
            causal=True,
            window_size=_window_size(window),
        )
        return out.squeeze(1)
