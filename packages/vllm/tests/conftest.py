"""vLLM's CPU build in this process: no engine-core subprocess, a small fixed KV cache space, quiet logs.

Set before vLLM is imported; compiled graphs are never reused from vLLM's or Inductor's caches. Every
engine is built through `helpers.engine()`, which frees it afterwards, so one pytest process can build
many in a row.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, the same for every engine of a test
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# compiled-mode tests compile for real: a cached graph from an earlier build could hide a dropped K/V write
os.environ.setdefault("VLLM_DISABLE_COMPILE_CACHE", "1")
os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")  # Inductor's own cache keys the graph before
os.environ.setdefault("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")  # its dead-code pass: it would hide one too

import pytest  # noqa: E402

pytest.importorskip("vllm", reason="vLLM is not installed (the `vllm` nox session installs its CPU build)")
