"""glibc malloc settings for CPU inference: freed activations stay in the heap for the next step.

glibc serves an allocation above its mmap threshold (128 KiB, rising by itself to at most 32 MiB)
with a fresh mmap and unmaps it again on free, and returns the top of the heap to the kernel past a
trim threshold. A CPU step allocates and frees the same large activations every layer (a 4,096-token
prefill's gate_up output alone is 50 MB), so each is first touched page by page again: page
faults can cost more than the arithmetic on such a tensor.

`tune_for_inference()` raises both thresholds with mallopt (once per process, before the engine
allocates its buffers): memory the process freed is then kept and reused instead of being given back
to the kernel, so its resident size stays near its peak. The setting is process-wide: every library
in the process (a transformers model beside the engine, say) gets it too. SWIFTKV_TUNE_MALLOC=0
leaves malloc as it is; on a C library that is not glibc nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform

from swiftkv_fast import envs
from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

THRESHOLD = 1 << 30  # bytes: allocations below it come from the heap, and a free heap top below it stays
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers (malloc.h)
_applied: bool | None = None


def tune_for_inference() -> bool:
    """Raise glibc's mmap and trim thresholds to THRESHOLD, once per process; True when they are set."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if not envs.SWIFTKV_TUNE_MALLOC:
        logger.info("host allocator: left as it is (SWIFTKV_TUNE_MALLOC=0)")
        return False
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = (
            libc.mallopt(_M_MMAP_THRESHOLD, THRESHOLD) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, THRESHOLD) == 1
        )
    except (OSError, AttributeError) as e:
        logger.warning("host allocator: mallopt is not available (%s); malloc left as it is", e)
        return False
    if not ok:
        logger.warning("host allocator: glibc refused the mallopt thresholds; malloc left as it is")
        return False
    _applied = True
    logger.info(
        "host allocator: glibc keeps freed memory for reuse (mmap and trim thresholds %d MiB; "
        "SWIFTKV_TUNE_MALLOC=0 to leave malloc alone)",
        THRESHOLD >> 20,
    )
    return True


def tuned() -> bool:
    """Whether this process's malloc was tuned (by an engine started here)."""
    return bool(_applied)
