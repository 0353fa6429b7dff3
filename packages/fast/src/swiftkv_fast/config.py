"""Engine configuration: one validated dataclass (nano-vllm style); `LLM(**kwargs)` fills it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swiftkv_fast.attention import BACKENDS
from swiftkv_fast.attention.flash_backend import FlashAttnBackend

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint directory; None: the embedded SmolLM2-135M-Instruct
    num_key_value_layers: int | None = None  # SwiftKV L; on a plain checkpoint: convert on the fly
    key_value_group_size: int | None = None  # AcrossKV G
    dtype: str | torch.dtype = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    device: str = "auto"  # auto: cuda when available
    block_size: int = 16
    num_kv_blocks: int | None = None  # KV cache size in blocks (wins over kv_cache_memory)
    kv_cache_memory: int | None = None  # KV cache size in bytes
    max_num_seqs: int = 256  # running requests per step
    max_num_batched_tokens: int = 4096  # token budget per step (chunked prefill splits longer prompts)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"
    seed: int = 0  # seeds the per-request generators of requests without their own seed
    enforce_eager: bool = False  # True: no CUDA graphs for the second half (CPU is always eager)
    return_logits: bool = False  # keep the fp32 logits row of every sampled token on the output

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in (
            "num_kv_blocks",
            "kv_cache_memory",
            "max_model_len",
            "num_key_value_layers",
            "key_value_group_size",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (block 0 is the null block), got {self.num_kv_blocks}"
            )
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.attention_backend == "flash_attn":  # before any loading or allocation
            FlashAttnBackend.validate_block_size(self.block_size)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        torch.device(self.device)  # raises on a bad name
        if isinstance(self.dtype, str):
            if self.dtype == "auto":
                self.dtype = torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
            elif self.dtype in DTYPES:
                self.dtype = DTYPES[self.dtype]
            else:
                raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.model is not None:
            self.model = str(self.model)
