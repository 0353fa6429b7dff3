"""The implementations under test, by test id. A new backend joins by adding its adapter here."""

from __future__ import annotations

from .base import EngineOptions, Implementation, Output, Runner, Sampling
from .fast import (
    FastCpu4Bit,
    FastCpuBf16,
    FastCpuBf16Amx,
    FastCpuBf16x3,
    FastCpuKvBf16,
    FastCpuPanelAmx,
    FastCpuQ4Amx,
    FastCpuStack,
    FastCudaGraph,
    FastFlash,
    FastTorch,
    FastTP2,
    FastTriton,
)
from .reference import Reference
from .vllm import VLLMPlugin

IMPLEMENTATIONS: dict[str, type[Implementation]] = {
    cls.name: cls
    for cls in (
        Reference,
        FastTorch,
        FastCpuStack,
        FastCpuBf16x3,
        FastCpuKvBf16,
        FastCpu4Bit,
        FastCpuBf16,
        FastCpuQ4Amx,
        FastCpuPanelAmx,
        FastCpuBf16Amx,
        FastTriton,
        FastFlash,
        FastCudaGraph,
        FastTP2,
        VLLMPlugin,
    )
}
GPU_IMPLEMENTATIONS = [name for name, cls in IMPLEMENTATIONS.items() if cls.gpu]

__all__ = [
    "EngineOptions",
    "Implementation",
    "Output",
    "Runner",
    "Sampling",
    "IMPLEMENTATIONS",
    "GPU_IMPLEMENTATIONS",
]
