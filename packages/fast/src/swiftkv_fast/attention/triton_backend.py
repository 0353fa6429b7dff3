"""The ``triton`` attention backend: our paged kernels (swiftkv_fast.kernels).

Runs on CUDA, or on CPU under Triton's interpreter (``TRITON_INTERPRET=1``
set before the kernels are imported; tests only: it is slow).
"""

from __future__ import annotations

import torch

from swiftkv_fast.attention.base import AttentionBackend
from swiftkv_fast.kernels._common import interpreting


class TritonBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graph = True  # launch configuration from shapes only; seq_lens == 0 rows -> zeros

    def __init__(self, num_splits: int | None = None):
        """num_splits: decode split count (None: chosen from shapes, see paged_decode)."""
        if not torch.cuda.is_available() and not interpreting():
            raise RuntimeError(
                "attention_backend='triton' needs a CUDA device, or TRITON_INTERPRET=1 set before "
                "importing swiftkv_fast (CPU interpreter, for tests)"
            )
        from swiftkv_fast.kernels import paged_decode, paged_prefill, write_kv  # imports triton

        self._write_kv = write_kv.write_kv
        self._prefill = paged_prefill.paged_prefill
        self._decode = paged_decode.paged_decode
        self.num_splits = num_splits

    def write_kv(self, kv_cache, k, v, slot_mapping) -> None:
        self._write_kv(kv_cache, k, v, slot_mapping)

    def prefill(self, q, k_cache, v_cache, meta, window, scale) -> torch.Tensor:
        return self._prefill(
            q,
            k_cache,
            v_cache,
            meta.cu_seqlens_q,
            meta.seq_lens,
            meta.block_tables,
            int(meta.max_query_len),
            window,
            scale,
        )

    def decode(self, q, k_cache, v_cache, seq_lens, block_tables, window, scale) -> torch.Tensor:
        return self._decode(
            q, k_cache, v_cache, seq_lens, block_tables, window, scale, num_splits=self.num_splits
        )
