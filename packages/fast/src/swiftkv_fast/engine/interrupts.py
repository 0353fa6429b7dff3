"""Ctrl-C never lands inside the engine's bookkeeping.

A `KeyboardInterrupt` can be raised between any two Python bytecodes. Inside the scheduler or the
cache manager that could leave a block allocated but in no table, or a request counted twice. The
engine's bookkeeping (scheduling, appending sampled tokens, undoing a failed step) runs inside
`deferred_interrupts()`: a SIGINT that arrives there is held and raised when the block ends, so an
interrupt only ever lands in the model's forward pass, which a failed step undoes
(`Scheduler.fail_step`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT for the duration of the block, then deliver it. Only the main thread receives
    signals in Python, so elsewhere (or when someone replaced the default handler) this is a no-op."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous is not signal.default_int_handler:
        yield
        return
    received: list[tuple] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append((signum, frame)))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received:
            previous(*received[0])
