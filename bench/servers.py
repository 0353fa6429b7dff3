"""The servers `python -m bench serve` starts: `swiftkv serve` and `transformers serve`, each a
subprocess of this Python on 127.0.0.1 port 0 (the OS picks a free port; the server logs the bound
address), ready once GET /health answers 200, and stopped with SIGTERM, then SIGKILL, within bounded
waits. `ServerSpec.extra_body` is what each server needs in a request to ignore EOS, so that both
generate exactly `max_tokens` tokens per request."""

from __future__ import annotations

import collections
import importlib.util
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ADDRESS = re.compile(r" on (http://127\.0\.0\.1:\d+)")  # swiftkv's and uvicorn's start-up line
READY_TIMEOUT = 300.0
STOP_TIMEOUT = 15.0
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# what `transformers serve` needs beyond transformers (its [serving] extra); accelerate for device_map
HF_SERVE_PACKAGES = ["fastapi", "uvicorn", "pydantic", "openai", "accelerate"]


class ServerError(RuntimeError):
    """A server that exited or never got ready; the message ends with its last output lines."""


@dataclass(frozen=True)
class ServerSpec:
    name: str
    argv: list[str]
    extra_body: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


def swiftkv_spec(name: str, num_key_value_layers: int | None = None, model: str | None = None) -> ServerSpec:
    """`swiftkv serve` on the embedded model (or `model`), fp32, prefix caching off (as every benchmark
    here: repeated prompts do real work)."""
    argv = [sys.executable, "-m", "swiftkv_fast.cli", "serve", *([model] if model else [])]
    argv += ["--host", "127.0.0.1", "--port", "0", "--dtype", "float32", "--no-prefix-caching"]
    argv += ["--uvicorn-log-level", "warning"]
    if num_key_value_layers is not None:
        argv += ["--num-key-value-layers", str(num_key_value_layers)]
    env = {"SWIFTKV_LOGGING_LEVEL": "INFO", "SWIFTKV_API_KEY": ""}  # INFO: the address line
    extra = {"ignore_eos": True, "stream_options": {"include_usage": True}}
    return ServerSpec(name, argv, extra, env)


def transformers_spec(name: str, model_dir: str | Path, num_blocks: int, max_batch_tokens: int) -> ServerSpec:
    """`transformers serve MODEL_DIR --continuous-batching`, fp32, with a paged cache of `num_blocks`
    pages of 256 tokens (its automatic size is meant for GPU memory, and on CPU it delays the first
    request by tens of seconds). It refuses vLLM's `ignore_eos` (422); a request's `generation_config` with
    no EOS token does the same. Its streams always end with the usage (and no [DONE])."""
    argv = [sys.executable, "-m", "transformers.cli.transformers", "serve", str(model_dir)]
    argv += ["--continuous-batching", "--host", "127.0.0.1", "--port", "0", "--dtype", "float32"]
    argv += ["--cb-block-size", "256", "--cb-num-blocks", str(num_blocks)]
    argv += ["--cb-max-batch-tokens", str(max_batch_tokens), "--log-level", "warning"]
    extra = {"generation_config": json.dumps({"eos_token_id": -1, "do_sample": False})}
    return ServerSpec(name, argv, extra)


def transformers_serve_unavailable() -> str | None:
    """Why `transformers serve` cannot run in this environment, or None."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed"
    if importlib.util.find_spec("transformers.cli.serve") is None:
        import transformers

        return f"transformers {transformers.__version__} has no `transformers serve` (transformers.cli.serve)"
    missing = [p for p in HF_SERVE_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        return (
            f"it needs {', '.join(missing)}, not installed here "
            "(pip install 'transformers[serving]'; accelerate: it loads the model with a device_map)"
        )
    return None


class ServerProcess:
    """One running server; a context manager that always stops it."""

    def __init__(self, spec: ServerSpec):
        self.spec = spec
        self.proc = subprocess.Popen(
            spec.argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            bufsize=1,
            env={**os.environ, **OFFLINE_ENV, **spec.env},
        )
        self.lines: collections.deque[str] = collections.deque(maxlen=200)
        self.url: str | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            if self.url is None and (match := ADDRESS.search(line)):
                self.url = match.group(1)
            self.lines.append(line)

    def tail(self, n: int = 30) -> str:
        return "".join(list(self.lines)[-n:])

    def wait_ready(self, timeout: float = READY_TIMEOUT) -> str:
        """The base URL once /health answers 200."""
        import httpx  # only the serve benchmark needs it

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(
                    f"{self.spec.name} exited with status {self.proc.returncode} before it was ready; "
                    f"its last output:\n{self.tail()}"
                )
            if self.url is not None:
                try:
                    if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                        return self.url
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        raise ServerError(
            f"{self.spec.name} was not ready after {timeout:g} s; its last output:\n{self.tail()}"
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT)
        self._reader.join(STOP_TIMEOUT)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
