"""Whether this process had the CPU to itself while it timed something: the time its threads spent
runnable but waiting for a core (Linux's run-queue delay, /proc/self/task/*/schedstat, second field).

A kernel timed while another process competes for the cores measures the other process as much as
the kernel: on a 2-core AMD EPYC, torch matmuls on 2 threads waited 0.3% of their time for a core
alone, 38% beside one busy process and 49% beside two. The linear-kernel chooser
(kernels/linear_kernels.py) times again what it timed on a busy machine, and does not cache it.

    meter = ContentionMeter()
    ...                    # the timed work, on `threads` threads
    meter.share(threads)   # 0.003 alone, 0.38 beside a busy process; None where Linux does not say
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def waited_seconds() -> float | None:
    """Seconds this process's threads have spent waiting for a core, summed; None where unknown."""
    total, read = 0, False
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
            read = True
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile, or no schedstats
            continue
    return total / 1e9 if read else None


class ContentionMeter:
    """Started at construction; `share(threads)` is the run-queue delay since then over the wall time
    times `threads` (the threads that wanted a core all along): 0 alone, ~0.5 beside as many busy
    threads as ours. `waited` is injectable for tests."""

    def __init__(self, waited: Callable[[], float | None] = waited_seconds):
        self._waited = waited
        self._start_wait = waited()
        self._start = time.perf_counter()

    def share(self, threads: int) -> float | None:
        now_wait = self._waited()
        if now_wait is None or self._start_wait is None:
            return None
        wall = max(time.perf_counter() - self._start, 1e-9)
        return max(now_wait - self._start_wait, 0.0) / (wall * max(threads, 1))
