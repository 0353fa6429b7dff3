"""Engine configuration: one validated dataclass (nano-vllm style); `LLM(**kwargs)` fills it."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from swiftkv_reference.memory import device_memory_bytes

from swiftkv_fast import envs
from swiftkv_fast.attention import BACKENDS
from swiftkv_fast.attention.flash_backend import validate_block_size
from swiftkv_fast.distributed.parallel_state import parse_init_method
from swiftkv_fast.kernels._common import interpreting
from swiftkv_fast.kernels.cpu_amx import MATMUL_PRECISIONS
from swiftkv_fast.kernels.plan import cpu_bf16_units

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}
# what the KV cache may hold besides the model's dtype ("auto"): bf16 halves its bytes, and so the memory
# decode attention reads (the torch backend's C kernels read it as fp32)
KV_CACHE_DTYPES = {"auto": None, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32}
# CPU linear kernels (kernels/linear_kernels.py): auto = chosen by measurement, or one forced everywhere
LINEAR_KERNELS = (
    "auto",
    "linear",
    "matmul",
    "mkldnn",
    "panel",
    "widen",
    "bf16x3",
    "q4-amx",
    "panel-amx",
    "bf16-amx",
)


@dataclass
class EngineConfig:
    model: str | None = None  # checkpoint directory; None: the embedded SmolLM2-135M-Instruct
    num_key_value_layers: int | None = None  # SwiftKV L; on a plain checkpoint: convert on the fly
    key_value_group_size: int | None = None  # AcrossKV G
    # the weights' dtype; auto: the checkpoint's (`follow_checkpoint`): on CPU fp32 stays fp32 and bf16 /
    # fp16 run in bf16; on CUDA bf16. The activations' is `compute_dtype`.
    dtype: str | torch.dtype = "auto"
    kv_cache_dtype: str | torch.dtype = "auto"  # KV_CACHE_DTYPES; auto: the model's dtype (resolved in place)
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
    linear_kernel: str = "auto"  # CPU GEMM kernel (LINEAR_KERNELS): auto is timed once per machine, cached
    matmul_precision: str = "highest"  # MATMUL_PRECISIONS: "high" permits the bf16x3 kernel (CPU, AMX)
    # C kernels this engine does not run (envs.KERNELS names, comma-separated or a sequence); None:
    # SWIFTKV_DISABLED_KERNELS. Resolved to a frozenset.
    disabled_kernels: str | Sequence[str] | frozenset[str] | None = None
    tensor_parallel_size: int = 1  # ranks the model is split over (rank 0 here, the others spawned)
    distributed_init_method: str | None = None  # tcp://HOST:PORT rank 0 serves; None: a free local port

    def __post_init__(self) -> None:
        """Every check that needs no checkpoint: a bad value is a ValueError (a wrong type a TypeError)
        naming the field, before any weight is read or memory allocated."""
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        for name in (
            "num_kv_blocks",
            "kv_cache_memory",
            "max_model_len",
            "num_key_value_layers",
            "key_value_group_size",
        ):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be None or a positive int, got {value!r}")
        for name in ("enable_prefix_caching", "enforce_eager", "return_logits"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not _is_int(self.seed):
            raise TypeError(f"seed must be an int, got {self.seed!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(
                f"num_kv_blocks must be >= 2 (block 0 is the null block), got {self.num_kv_blocks}"
            )
        if self.attention_backend not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {BACKENDS}, got {self.attention_backend!r}")
        if self.attention_backend == "flash_attn":  # before any loading or allocation
            validate_block_size(self.block_size)
        self._check_device()
        self.dtype_is_auto = isinstance(self.dtype, str) and self.dtype == "auto"
        self.kv_cache_dtype_is_auto = isinstance(self.kv_cache_dtype, str) and self.kv_cache_dtype == "auto"
        self._check_dtype()
        self._check_backend()
        self._check_kv_cache_dtype()
        self._check_linear_kernel()
        self._check_disabled_kernels()
        self._check_tensor_parallel()
        if self.kv_cache_memory is not None:
            self.check_kv_cache_fits(self.kv_cache_memory, "kv_cache_memory")
        if self.model is not None:
            if not isinstance(self.model, (str, os.PathLike)):
                raise TypeError(f"model must be a checkpoint directory path or None, got {self.model!r}")
            self.model = os.fspath(self.model)

    def _check_device(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not isinstance(self.device, (str, torch.device)):
            raise TypeError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        try:
            dev = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}") from e
        if dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if count == 0 or (dev.index is not None and dev.index >= count):
                have = f"{count} CUDA device(s)" if count else "no CUDA (torch.cuda.is_available() is False)"
                raise ValueError(f"device={str(self.device)!r}, but this machine has {have}; use 'cpu'")
        elif dev.type != "cpu":
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        self.device = str(dev)

    def _check_dtype(self) -> None:
        if isinstance(self.dtype, str):
            if self.dtype == "auto":
                self.dtype = torch.bfloat16 if torch.device(self.device).type == "cuda" else torch.float32
            elif self.dtype in DTYPES:
                self.dtype = DTYPES[self.dtype]
            else:
                raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {self.dtype!r}")
        elif not isinstance(self.dtype, torch.dtype) or self.dtype not in DTYPES.values():
            raise ValueError(
                f"dtype must be 'auto', one of {sorted(DTYPES)} or torch.float32 / bfloat16 / float16, "
                f"got {self.dtype!r}"
            )

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the activations and the arithmetic: `dtype`, except bf16 on a CPU without bf16 units
        (AVX512-BF16, AMX-BF16). There the libraries emulate bf16 products several times slower than
        fp32 ones, so the bf16 weights are widened exactly as they are multiplied and everything else runs
        in fp32: the memory of bf16 weights and KV cache, the speed of fp32 arithmetic."""
        if self.dtype == torch.bfloat16 and torch.device(self.device).type == "cpu" and not cpu_bf16_units():
            return torch.float32
        return self.dtype

    def follow_checkpoint(self, stored: torch.dtype) -> str | None:
        """Resolves dtype="auto" (and kv_cache_dtype="auto" with it) by the dtype the checkpoint's weights
        are stored in, as vLLM's "auto" does: fp32 stays fp32, bf16 and fp16 run in bf16. Returns a line
        to log where the choice needs a word (a CPU without bf16 units computes in fp32, `compute_dtype`),
        else None."""
        if not self.dtype_is_auto or torch.device(self.device).type != "cpu":
            return None
        self.dtype = torch.bfloat16 if stored in (torch.bfloat16, torch.float16) else torch.float32
        if self.kv_cache_dtype_is_auto:
            self.kv_cache_dtype = self.dtype
        if self.compute_dtype == self.dtype:
            return None
        stored_name = str(stored).removeprefix("torch.")
        return (
            f"the checkpoint is {stored_name} and this CPU has no bf16 units (AVX512-BF16, AMX-BF16): "
            "bf16 weights and KV cache, multiplied in float32 (bf16 products are emulated here)"
        )

    def _check_backend(self) -> None:
        on_cuda = torch.device(self.device).type == "cuda"
        if self.attention_backend == "flash_attn" and not on_cuda:
            raise ValueError(
                f"attention_backend='flash_attn' needs a CUDA device, got device={self.device!r}; "
                "use 'torch' or 'triton'"
            )
        if self.attention_backend == "triton" and not on_cuda and not interpreting():
            raise ValueError(
                "attention_backend='triton' on CPU needs TRITON_INTERPRET=1 set before importing "
                "swiftkv_fast (the interpreter, for tests); use 'torch'"
            )

    def _check_kv_cache_dtype(self) -> None:
        """Resolves kv_cache_dtype to a torch.dtype. Another dtype than the model's needs the torch attention
        backend on CPU: flash-attn and the Triton kernels read the cache as the queries' dtype."""
        value = self.kv_cache_dtype
        if isinstance(value, torch.dtype) and value in KV_CACHE_DTYPES.values():
            resolved = value
        elif isinstance(value, str) and value in KV_CACHE_DTYPES:
            resolved = KV_CACHE_DTYPES[value] or self.dtype
        else:
            raise ValueError(
                f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)} or torch.bfloat16 / float32, "
                f"got {value!r}"
            )
        if resolved != self.dtype:
            if torch.device(self.device).type != "cpu" or self.attention_backend not in ("auto", "torch"):
                model_dtype = str(self.dtype).removeprefix("torch.")
                raise ValueError(
                    f"kv_cache_dtype={value!r} differs from dtype={model_dtype!r}: "
                    f"that needs device='cpu' and the torch attention backend (got device={self.device!r}, "
                    f"attention_backend={self.attention_backend!r})"
                )
        self.kv_cache_dtype = resolved

    def _check_linear_kernel(self) -> None:
        if self.linear_kernel not in LINEAR_KERNELS:
            raise ValueError(f"linear_kernel must be one of {LINEAR_KERNELS}, got {self.linear_kernel!r}")
        if self.matmul_precision not in MATMUL_PRECISIONS:
            raise ValueError(
                f"matmul_precision must be one of {MATMUL_PRECISIONS}, got {self.matmul_precision!r}"
            )
        if self.linear_kernel == "bf16x3" and self.matmul_precision == "highest":
            raise ValueError(
                "linear_kernel='bf16x3' computes fp32 products as sums of bf16 ones: it needs "
                "matmul_precision='high' (got 'highest')"
            )
        if torch.device(self.device).type != "cpu" and self.linear_kernel not in ("auto", "linear"):
            raise ValueError(
                f"linear_kernel={self.linear_kernel!r} is a CPU kernel; on device={self.device!r} every "
                "linear layer runs F.linear: use 'auto' or 'linear'"
            )

    def _check_disabled_kernels(self) -> None:
        value = self.disabled_kernels
        if value is None or isinstance(value, str):
            self.disabled_kernels = envs.disabled_kernels(value)
            return
        if not all(isinstance(v, str) for v in value):
            raise TypeError(
                f"disabled_kernels must be a comma-separated str or a sequence of str, got {value!r}"
            )
        unknown = set(value) - envs.KERNELS.keys()
        if unknown:
            raise ValueError(
                f"disabled_kernels: unknown {sorted(unknown)}; expected names from {sorted(envs.KERNELS)}"
            )
        self.disabled_kernels = frozenset(value)

    def _check_tensor_parallel(self) -> None:
        if self.distributed_init_method is not None:
            if not isinstance(self.distributed_init_method, str):
                got = self.distributed_init_method
                raise TypeError(f"distributed_init_method must be 'tcp://HOST:PORT' or None, got {got!r}")
            parse_init_method(self.distributed_init_method)
        dev = torch.device(self.device)
        if self.tensor_parallel_size > 1 and dev.type == "cuda":
            count = torch.cuda.device_count()
            if self.tensor_parallel_size > count:
                raise ValueError(
                    f"tensor_parallel_size={self.tensor_parallel_size} needs that many CUDA devices (one per "
                    f"rank), this machine has {count}"
                )
            if dev.index not in (None, 0):
                raise ValueError(
                    "with tensor_parallel_size > 1, rank r runs on cuda:r: use device='cuda', "
                    f"got {self.device!r}"
                )

    def check_kv_cache_fits(self, num_bytes: int, what: str) -> None:
        """ValueError unless `num_bytes` of KV cache fit in the device's memory (CUDA: its total memory,
        CPU: physical RAM). `what` names the setting in the message."""
        total = device_memory_bytes(self.device)
        if total is not None and num_bytes > total:
            raise ValueError(
                f"{what} needs {num_bytes} bytes ({num_bytes / 2**30:.1f} GiB) of KV cache, more than the "
                f"{total / 2**30:.1f} GiB of {self.device} memory"
            )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
