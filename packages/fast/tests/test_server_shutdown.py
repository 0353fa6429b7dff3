"""How `swiftkv serve` ends (entrypoints/launcher.py), on real subprocesses on free loopback ports.

- SIGINT or SIGTERM with a stream and a whole response in flight: the stream ends with an error
  event and [DONE], the other request gets a JSON 503, the server logs one line per aborted request
  and no traceback, exits 0 and releases its port.
- A tensor-parallel rank killed while the server is idle: /health turns 503 naming the rank and its
  pid (with --keep-alive-on-engine-death the server stays up to say so), or the server exits with
  ENGINE_DEAD_EXIT_CODE for a supervisor to restart it.

Every wait is bounded and no assertion is about time: the tests wait for states (requests running,
/health answering 503, the process exiting).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest
from server_process import STOP_TIMEOUT, metric, save_tiny_checkpoint, start_server
from swiftkv_fast.entrypoints.api_server import bind_socket
from swiftkv_fast.entrypoints.launcher import ENGINE_DEAD_EXIT_CODE

TIMEOUT = 120  # seconds; only reached if the test is broken
LONG = 8192  # positions: a request of this many tokens is still running when the signal lands
# a prompt that leaves room for long generations: each request runs until it is stopped
BODY = {"prompt": "Keep going", "max_tokens": LONG - 100, "temperature": 0, "ignore_eos": True}
FAST_START = ["--linear-kernel", "linear", "--kv-cache-memory", str(4 << 20), "--max-model-len", "256"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("serve_shutdown") / "tiny", max_position_embeddings=LONG
    )


async def wait_running(client: httpx.AsyncClient, n: int) -> None:
    for _ in range(TIMEOUT * 20):
        if metric((await client.get("/metrics")).text, "swiftkv:num_requests_running") == n:
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"{n} requests never ran together")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_answers_every_request_in_flight_and_exits_0(request, ckpt, sig):
    flags = ["--linear-kernel", "linear", "--max-model-len", str(LONG), "--kv-cache-memory", str(24 << 20)]
    server = start_server(request, [str(ckpt), *flags])

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=TIMEOUT) as client:
            whole = asyncio.ensure_future(client.post("/v1/completions", json=BODY))
            async with client.stream("POST", "/v1/completions", json=BODY | {"stream": True}) as r:
                lines = r.aiter_lines()
                first = await anext(lines)
                await wait_running(client, 2)
                server.proc.send_signal(sig)
                rest = [line async for line in lines if line]
            return first, rest, await whole

    first, rest, whole = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert first.startswith("data: {") and rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_dead" and "shutting down" in error["message"]
    assert whole.status_code == 503 and "shutting down" in whole.json()["error"]["message"]
    assert server.proc.wait(STOP_TIMEOUT) == 0, server.output
    server.stop()  # joins the output reader
    assert len(re.findall(r"request cmpl-\w+ aborted: the server is shutting down", server.output)) == 2
    assert "Traceback" not in server.output, server.output
    port = int(server.url.rsplit(":", 1)[1])
    bind_socket("127.0.0.1", port).close()  # the port is free again


def worker_pid(server) -> int:
    match = re.search(r"worker pids \[(\d+)\]", server.output)
    assert match, server.output
    return int(match.group(1))


def test_an_idle_rank_death_turns_health_503_naming_it(request, ckpt):
    server = start_server(request, [str(ckpt), *FAST_START, "-tp", "2", "--keep-alive-on-engine-death"])
    pid = worker_pid(server)
    assert (
        httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=TIMEOUT).status_code == 200
    )
    os.kill(pid, signal.SIGKILL)
    for _ in range(TIMEOUT * 20):  # no request comes: only the rank watch can notice
        health = httpx.get(f"{server.url}/health", timeout=TIMEOUT)
        if health.status_code != 200:
            break
        time.sleep(0.05)
    assert health.status_code == 503
    assert f"worker rank 1 (pid {pid}) died (killed by SIGKILL)" in health.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=TIMEOUT)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


def test_an_idle_rank_death_makes_the_server_exit_for_its_supervisor(request, ckpt):
    server = start_server(request, [str(ckpt), *FAST_START, "-tp", "2"])
    pid = worker_pid(server)
    os.kill(pid, signal.SIGKILL)
    assert server.proc.wait(TIMEOUT) == ENGINE_DEAD_EXIT_CODE, server.output
    server.stop()
    assert f"worker rank 1 (pid {pid}) died" in server.output
    assert f"exits with status {ENGINE_DEAD_EXIT_CODE}" in server.output
