"""The run-queue meter (kernels/cpu_contention.py) against a real busy process on our core."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time

import pytest
from swiftkv_fast.kernels.cpu_contention import ContentionMeter, waited_seconds

linux_schedstat = pytest.mark.skipif(
    waited_seconds() is None or not hasattr(os, "sched_setaffinity"), reason="needs Linux schedstats"
)


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@linux_schedstat
def test_a_busy_process_on_our_core_shows_as_waiting():
    """Pinned to one core beside a process spinning there, this thread waits for the core about half the
    time; the meter's threshold for 'busy' (linear_kernels.BUSY_SHARE) is 0.1. Spinning there while the
    child is stopped it waits less (for whatever else runs there): a meter reading the thread's time on
    the core instead of its wait for it would read more. The child is stopped and resumed (SIGSTOP /
    SIGCONT) in alternating rounds and the medians compared, so that other work on the machine (another
    test process beside this one) weighs on both sides alike."""
    original = os.sched_getaffinity(0)
    core = min(original)
    os.sched_setaffinity(0, {core})  # this thread, and the child it starts, on one core
    spinner = None
    alone, busy = [], []
    try:
        spin_10s = "import time\nt = time.time()\nwhile time.time() - t < 10: pass"
        spinner = subprocess.Popen([sys.executable, "-c", spin_10s])
        _spin(0.2)  # the child is running
        for _ in range(4):
            for running, shares in ((False, alone), (True, busy)):
                os.kill(spinner.pid, signal.SIGCONT if running else signal.SIGSTOP)
                _spin(0.05)  # the child has stopped or resumed
                meter = ContentionMeter()
                _spin(0.25)
                shares.append(meter.share(1))
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait(timeout=10)
        os.sched_setaffinity(0, original)
    assert None not in alone and None not in busy
    assert statistics.median(busy) > 0.2 and statistics.median(busy) > statistics.median(alone)


def test_the_share_is_the_wait_over_the_wall_time_of_the_threads():
    waits = iter([1.0, 1.5])
    meter = ContentionMeter(lambda: next(waits))
    time.sleep(0.05)
    share = meter.share(2)  # 0.5 s waited over at least 2 x 0.05 s
    assert 0 < share <= 0.5 / (2 * 0.05)
    assert ContentionMeter(lambda: None).share(2) is None  # unknown where Linux does not say
