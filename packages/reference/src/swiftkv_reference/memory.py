"""How much memory a device has: what the calibration's statistics (swiftkv_distill) are checked
against before they are allocated. swiftkv_fast.config keeps the same function for its KV cache check:
inside swiftkv_fast only the model loader imports this package (swiftkv_fast's test_layering)."""

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
