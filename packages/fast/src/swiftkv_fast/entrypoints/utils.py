"""Async helpers of the server: merging the streams of one HTTP request's engine requests, and
cancelling a handler whose client went away (vLLM's `merge_async_iterators`, `with_cancellation`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.requests import Request

T = TypeVar("T")


async def merge_async_iterators(*iterators: AsyncIterator[T]) -> AsyncIterator[tuple[int, T]]:
    """(index of the iterator, item) in the order items arrive. When it is closed or cancelled early,
    every iterator is cancelled and closed (an engine request's `generate` then aborts it)."""
    pending = {asyncio.ensure_future(it.__anext__()): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(iterators[i].__anext__())] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in iterators:
            await it.aclose()


async def listen_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the request body must have been read)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_unless_disconnected(request: Request, handler: Awaitable[T]) -> T | None:
    """`handler`'s result, or None when the client disconnected first (the handler is cancelled:
    its engine requests are aborted)."""
    work = asyncio.ensure_future(handler)
    listener = asyncio.ensure_future(listen_for_disconnect(request))
    try:
        await asyncio.wait({work, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, listener):
            task.cancel()
    if work.done() and not work.cancelled():
        return work.result()
    await asyncio.gather(work, return_exceptions=True)
    return None
