"""The serving benchmark's load generator: a fixed list of chat requests sent to an OpenAI-compatible
server, `concurrency` at a time (as vLLM's `benchmark_serving --max-concurrency`), each streamed
(server-sent events) and timed chunk by chunk on the client; then vLLM's serving metrics.

Per request (all from client-side timestamps):
    TTFT = arrival of the first chunk that carries text - send (a chat stream's role-only first chunk
           comes before any token, so it does not count)
    ITL  = the gaps between successive text chunks
    TPOT = (latency - TTFT) / (output tokens - 1), the output tokens from the stream's `usage`
    E2EL = latency: the end of the stream (`data: [DONE]`, or the response's end: `transformers serve`
           sends no [DONE]) - send
A request fails on a non-200 status, an error event, a stream that ends without a finish_reason or
without usage, or when it takes longer than `request_timeout` from send to the end of its stream.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: `python -m bench demo` lists this module without httpx
    import httpx


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    max_tokens: int

    def __post_init__(self) -> None:
        if not self.messages:
            raise ValueError("ChatRequest.messages must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"ChatRequest.max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class RequestResult:
    """One request as the client saw it (time.perf_counter() seconds)."""

    start: float
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    end: float | None = None  # the end of the stream
    finish_reason: str | None = None
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    text: str = ""
    error: str | None = None

    @property
    def success(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.latency is None or not self.output_tokens or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    @property
    def itl(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


@dataclass
class LoadResult:
    results: list[RequestResult]
    duration: float  # first send to last answer (vLLM's benchmark_duration)
    concurrency: int


async def send_chat(
    client: httpx.AsyncClient, url: str, request: ChatRequest, extra_body: dict[str, Any]
) -> RequestResult:
    """POST one streamed chat completion to `url` (.../v1/chat/completions) and time its chunks."""
    import httpx

    body = {
        "messages": request.messages,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "stream": True,
        **extra_body,
    }
    result = RequestResult(start=time.perf_counter())
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                result.error = f"HTTP {resp.status_code}: {text[:300]}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    break
                _read_chunk(result, json.loads(payload), time.perf_counter())
                if result.error is not None:
                    return result
            result.end = time.perf_counter()
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    if result.finish_reason is None:
        result.error = "the stream ended without a finish_reason"
    elif result.output_tokens is None:
        result.error = "the stream carried no usage (completion_tokens)"
    return result


def _read_chunk(result: RequestResult, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        result.error = f"error event: {json.dumps(chunk['error'])[:300]}"
        return
    for choice in chunk.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            result.chunk_times.append(now)
            result.text += content
        result.finish_reason = choice.get("finish_reason") or result.finish_reason
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.output_tokens = usage.get("completion_tokens")


async def run_load(
    base_url: str,
    requests: Sequence[ChatRequest],
    concurrency: int,
    extra_body: dict[str, Any] | None = None,
    request_timeout: float = 300.0,
    deadline: float = 900.0,
) -> LoadResult:
    """Every request once, `concurrency` in flight at a time (each client sends its next request as
    soon as its previous one ends). Requests still running or unsent after `deadline` seconds fail."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    url = f"{base_url.rstrip('/')}/v1/chat/completions"
    results: list[RequestResult | None] = [None] * len(requests)
    pending = iter(range(len(requests)))
    import httpx

    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(request_timeout)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:

        async def client_loop() -> None:
            for i in pending:
                try:
                    send = send_chat(client, url, requests[i], extra_body or {})
                    results[i] = await asyncio.wait_for(send, request_timeout)
                except asyncio.TimeoutError:
                    results[i] = RequestResult(time.perf_counter(), error=f"over {request_timeout:g} s")

        start = time.perf_counter()
        tasks = [asyncio.create_task(client_loop()) for _ in range(min(concurrency, len(requests)))]
        _, late = await asyncio.wait(tasks, timeout=deadline)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
    end = time.perf_counter()
    done = [r for r in results if r is not None]
    last = max((r.end for r in done if r.end is not None), default=end)
    for i, r in enumerate(results):
        if r is None:
            results[i] = RequestResult(start=end, error=f"not finished within the {deadline:g} s deadline")
    return LoadResult(results, max(last - start, 1e-9), concurrency)


def run(base_url: str, requests: Sequence[ChatRequest], concurrency: int, **kw: Any) -> LoadResult:
    """`run_load` from synchronous code."""
    return asyncio.run(run_load(base_url, requests, concurrency, **kw))


def metrics(load: LoadResult) -> dict[str, Any]:
    """vLLM `benchmark_serving`'s result keys (throughputs over the successful requests; latencies
    in ms: mean, median, p99), plus the per-request values in seconds for pooling across rounds."""
    from bench.throughput import _percentiles

    ok = [r for r in load.results if r.success]
    out_tokens = sum(r.output_tokens or 0 for r in ok)
    in_tokens = sum(r.prompt_tokens or 0 for r in ok)
    per_request = {
        "ttft_s": [r.ttft for r in ok if r.ttft is not None],
        "tpot_s": [r.tpot for r in ok if r.tpot is not None],
        "itl_s": [gap for r in ok for gap in r.itl],
        "e2el_s": [r.latency for r in ok if r.latency is not None],
        "output_lens": [r.output_tokens for r in ok],
    }
    row: dict[str, Any] = {
        "concurrency": load.concurrency,
        "completed": len(ok),
        "failed": len(load.results) - len(ok),
        "errors": sorted({r.error for r in load.results if r.error is not None})[:5],
        "duration": load.duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / load.duration,
        "output_throughput": out_tokens / load.duration,
        "total_token_throughput": (in_tokens + out_tokens) / load.duration,
    }
    for key in ("ttft", "tpot", "itl", "e2el"):
        row.update(_percentiles(per_request[f"{key}_s"], key))
    row.update(per_request)
    return row
