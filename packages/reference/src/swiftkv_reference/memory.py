"""How much memory a device has: what the engine's KV cache (swiftkv_fast.config) and the calibration's
statistics (swiftkv_distill) are checked against before they are allocated. No model math: every
swiftkv_fast module may import it (swiftkv_fast's test_layering)."""

from __future__ import annotations

import os

import torch


def device_memory_bytes(device: str | torch.device) -> int | None:
    """Total memory of a CUDA device, or the machine's physical RAM for the CPU; None when unknown."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[1]
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None
