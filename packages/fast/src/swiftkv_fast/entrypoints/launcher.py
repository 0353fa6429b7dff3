"""Runs the app under uvicorn (vLLM's entrypoints/launcher.py): how `swiftkv serve` ends.

- SIGINT / SIGTERM: uvicorn stops accepting connections, and the engine is stopped at once
  (`AsyncLLM.stop`), so every request in flight ends now: a stream with an error event and
  `[DONE]`, a whole response with a JSON 503, one log line each. uvicorn waits for those answers to
  be sent, the socket is closed and the process exits 0: uvicorn re-raises the signal after its
  graceful shutdown, which `exit_signals_consumed` turns into nothing (the shutdown was its effect).
- The engine dies (a bug in its loop, a tensor-parallel rank gone, even while idle): its requests
  get their 503s, then the server shuts down the same way and `serve_http` returns
  ENGINE_DEAD_EXIT_CODE, so that a supervisor restarts it. With keep_alive_on_engine_death it stays
  up answering 503 (vLLM's VLLM_KEEP_ALIVE_ON_ENGINE_DEATH), /health included.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import threading

import uvicorn

from swiftkv_fast.engine.async_llm import AsyncLLM
from swiftkv_fast.logger import init_logger

logger = init_logger(__name__)

ENGINE_DEAD_EXIT_CODE = 3  # the engine died: restart the server
WATCHDOG_INTERVAL_S = 0.1
GRACEFUL_SHUTDOWN_S = 5  # for answers already cut short by the stopped engine to be sent
SHUTDOWN_REASON = "the server is shutting down"
EXIT_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _Server(uvicorn.Server):
    """uvicorn's server, which also stops the engine on the first signal that asks it to exit."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM):
        super().__init__(config)
        self.engine = engine
        self.loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        if first and self.loop is not None:  # a signal handler: leave the work to the loop
            self.loop.call_soon_threadsafe(self._stop_engine, signal.Signals(sig).name)

    def _stop_engine(self, signal_name: str) -> None:
        logger.info("%s: stopping; requests in flight are answered with an error", signal_name)
        self.engine.stop(SHUTDOWN_REASON)


async def watchdog_loop(server: uvicorn.Server, engine: AsyncLLM, keep_alive: bool) -> bool:
    """Ends the server once the engine has died of an error (not when it was stopped), unless
    `keep_alive`; -> whether it did."""
    while not server.should_exit and not engine.errored:
        await asyncio.sleep(WATCHDOG_INTERVAL_S)
    if not engine.errored:
        return False
    if keep_alive:
        logger.error("the engine died (%s); the server stays up answering 503", engine.dead_error)
        return False
    logger.error(
        "the engine died (%s); the server exits with status %d for a supervisor to restart it "
        "(--keep-alive-on-engine-death keeps it up)",
        engine.dead_error,
        ENGINE_DEAD_EXIT_CODE,
    )
    server.should_exit = True
    return True


async def serve_http(
    app, sock: socket.socket, engine: AsyncLLM, log_level: str, keep_alive_on_engine_death: bool = False
) -> int:
    """Serve `app` on `sock` until a signal (-> 0) or the engine's death (-> ENGINE_DEAD_EXIT_CODE)."""
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = _Server(config, engine)
    watchdog = asyncio.ensure_future(watchdog_loop(server, engine, keep_alive_on_engine_death))
    try:
        await server.serve(sockets=[sock])
    finally:
        watchdog.cancel()
        await asyncio.gather(watchdog, return_exceptions=True)
    died = watchdog.done() and not watchdog.cancelled() and watchdog.result()
    return ENGINE_DEAD_EXIT_CODE if died else 0


@contextlib.contextmanager
def exit_signals_consumed():
    """SIGINT and SIGTERM do nothing but what uvicorn makes of them (on the main thread only):
    uvicorn restores these handlers after its graceful shutdown, then raises the signal again."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in EXIT_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
