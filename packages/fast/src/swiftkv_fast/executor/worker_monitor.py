"""Watches tensor-parallel worker processes all the time, not only during a step (vLLM's
`MultiprocExecutor.start_worker_monitor`): a thread blocks on the workers' process sentinels and
calls `on_death(dead)` (the processes that exited) as soon as one does, so a worker that dies while
the engine is idle is seen at once rather than by the next step. Closing the connection it returns
ends the watch: the executor closes it before it stops the workers itself, so a planned exit is not
a death."""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait


def start_worker_monitor(
    procs: Sequence[multiprocessing.Process], on_death: Callable[[list], None]
) -> Connection:
    stop_reader, stop_writer = multiprocessing.Pipe(duplex=False)
    sentinels = [p.sentinel for p in procs]

    def watch() -> None:
        try:
            ready = wait([*sentinels, stop_reader])
            if stop_reader not in ready:
                on_death([p for p in procs if p.sentinel in ready])
        finally:
            stop_reader.close()

    threading.Thread(target=watch, name="swiftkv-tp-monitor", daemon=True).start()
    return stop_writer
