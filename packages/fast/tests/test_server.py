"""`swiftkv serve` as a real subprocess on a free loopback port (one per module), a tiny random model
with the embedded model's byte-level tokenizer, driven by the official `openai` client and raw
HTTP: greedy outputs equal `LLM.generate` token for token, seeded sampling is reproducible, usage
is right, streams end with [DONE], 32 concurrent streams each get their own text, disconnected
clients are aborted and free their blocks, /metrics parses and counts, --api-key guards /v1."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_process import kv_cache_idle, metric, save_tiny_checkpoint, start_server
from swiftkv_fast import LLM, SamplingParams

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENGINE = dict(max_model_len=256, kv_cache_memory=8 << 20)
FLAGS = [
    "--max-model-len",
    "256",
    "--kv-cache-memory",
    str(8 << 20),
    "--served-model-name",
    "tiny",
    "tiny-alias",
]
TIMEOUT = 120  # seconds; only reached if the test is broken
PROMPTS = ["Hello, my name is", "The capital of France is", "naïve café: 世界 🙂", "1, 2, 3,"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "tiny")


@pytest.fixture(scope="module")
def server(request, ckpt):
    return start_server(request, [str(ckpt), *FLAGS, "--api-key", KEY])


@pytest.fixture(scope="module")
def offline(ckpt):
    return LLM(str(ckpt), **ENGINE)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT)


def token_ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def scrape(server) -> str:
    r = httpx.get(f"{server.url}/metrics", timeout=TIMEOUT)
    assert r.status_code == 200
    return r.text


def test_completions_greedy_equal_llm_generate(client, offline):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    want = offline.generate(PROMPTS, params, use_tqdm=False)
    resp = client.completions.create(
        model="tiny",
        prompt=PROMPTS,
        max_tokens=24,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    assert resp.object == "text_completion" and resp.id.startswith("cmpl-") and resp.model == "tiny"
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    for c, w in zip(resp.choices, want):
        out = w.outputs[0]
        assert c.text == out.text and c.finish_reason == "length"
        assert token_ids(c.logprobs.tokens) == out.token_ids
        want_lps = [lps[t] for lps, t in zip(out.logprobs, out.token_ids)]
        # the server is another process. Once in about ten fresh-clone runs its logprobs came out up to
        # 8.1e-4 from these (a relative error near 6e-5 in the logits, 300x what forcing each linear kernel
        # in turn moves them), the tokens the same; not reproduced since (not by buffer alignment, hash
        # seeds, CPU pinning or busy cores), so compared at 2e-3: the runner-up token is 0.08 or more below
        # at every step, so a logprob of the wrong token still fails. The conformance engine matrix runs
        # a failing case again, to tell such a transient from a bug.
        assert c.logprobs.token_logprobs == pytest.approx(want_lps, abs=2e-3)
        assert all(len(top) == 1 for top in c.logprobs.top_logprobs)
    prompt_tokens = sum(len(w.prompt_token_ids) for w in want)
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (prompt_tokens, 4 * 24)
    assert resp.usage.total_tokens == prompt_tokens + 4 * 24


def test_token_id_prompt(client, offline):
    ids = offline.tokenizer("Token ids in, text out")["input_ids"]
    want = offline.generate([ids], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
    resp = client.completions.create(model="tiny", prompt=ids, max_tokens=10, temperature=0)
    assert resp.choices[0].text == want.outputs[0].text
    assert resp.usage.prompt_tokens == len(ids)


def test_chat_greedy_equal_llm_chat_streaming_or_not(client, offline):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    want = offline.chat(messages, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2))[
        0
    ]
    kw = dict(model="tiny-alias", messages=messages, temperature=0, max_completion_tokens=20)
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    resp = client.chat.completions.create(**kw, logprobs=True, top_logprobs=2, extra_body=extra)
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-") and resp.model == "tiny-alias"
    c = resp.choices[0]
    assert c.message.role == "assistant" and c.message.content == want.outputs[0].text
    assert c.finish_reason == "length"
    assert token_ids([e.token for e in c.logprobs.content]) == want.outputs[0].token_ids
    assert all(len(e.top_logprobs) == 2 for e in c.logprobs.content)
    assert resp.usage.prompt_tokens == len(want.prompt_token_ids) and resp.usage.completion_tokens == 20

    chunks = list(
        client.chat.completions.create(
            **kw, stream=True, stream_options={"include_usage": True}, extra_body=extra
        )
    )
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == want.outputs[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == resp.usage.prompt_tokens
    assert all(ch.usage is None for ch in chunks[:-1])


def test_stream_wire_format_ends_with_done(server, offline):
    body = {
        "model": "tiny",
        "prompt": "Server-sent events",
        "max_tokens": 12,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(ch["object"] == "text_completion" and ch["model"] == "tiny" for ch in chunks)
    assert all(ch["usage"] is None for ch in chunks[:-1])
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == [] and set(usage) >= {
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
    }
    assert "cached_tokens" in usage["prompt_tokens_details"]
    want = offline.generate(body["prompt"], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert "".join(ch["choices"][0]["text"] for ch in chunks[:-1]) == want.outputs[0].text
    assert usage["completion_tokens"] == len(want.outputs[0].token_ids)


def test_seeded_sampling_is_reproducible_and_choices_differ(client, offline):
    prompt = "Once upon a time"
    kw = dict(model="tiny", prompt=prompt, max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, n=3)
    extra = {"ignore_eos": True, "top_k": 50}
    first = [c.text for c in client.completions.create(**kw, extra_body=extra).choices]
    again = client.completions.create(**kw, extra_body=extra)
    assert [c.text for c in again.choices] == first and len(set(first)) > 1
    want = [
        offline.generate(
            prompt,
            SamplingParams(
                temperature=1.0, top_p=0.9, top_k=50, seed=1234 + j, max_tokens=16, ignore_eos=True
            ),
            use_tqdm=False,
        )[0]
        for j in range(3)
    ]
    assert first == [w.outputs[0].text for w in want]  # choice j samples with seed + j (vLLM's rule)
    assert again.usage.prompt_tokens == len(want[0].prompt_token_ids) and again.usage.completion_tokens == 48


def test_stop_string_and_cached_prompt_tokens(client, offline):
    prompt = "A prompt long enough to fill a few blocks of the KV cache, so a second request hits them: " * 2
    greedy = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)[0]
    stop = greedy.outputs[0].text[6:9]
    want = offline.generate(
        prompt, SamplingParams(temperature=0, max_tokens=16, stop=[stop]), use_tqdm=False
    )[0]
    first = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=stop)
    c = first.choices[0]
    assert (
        c.text == want.outputs[0].text and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    )
    again = client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0, stop=stop)
    assert again.choices[0].text == c.text
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens  # whole blocks, never the last token


def test_32_concurrent_streams_each_get_their_own_text(server, offline):
    prompts = [f"Request {i}: count to {i * 7} and then" for i in range(32)]
    max_tokens = [6 + i % 9 for i in range(32)]
    want = offline.generate(
        prompts,
        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in max_tokens],
        use_tqdm=False,
    )

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.completions.create(
            model="tiny",
            prompt=prompts[i],
            max_tokens=max_tokens[i],
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text, finish = "", None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.text
                finish = c.finish_reason or finish
        return text, finish

    async def main():
        async with openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=TIMEOUT
        ) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(32))), TIMEOUT)

    for i, (text, finish) in enumerate(asyncio.run(main())):
        assert (text, finish) == (want[i].outputs[0].text, "length"), i


def test_disconnected_clients_are_aborted_and_free_their_blocks(server):
    before = scrape(server)

    async def leave_after_first_token(client: httpx.AsyncClient, i: int) -> None:
        body = {
            "prompt": f"Story {i}:",
            "max_tokens": 240,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return  # closes the connection mid-stream

    async def complete(client: httpx.AsyncClient, i: int) -> None:
        r = await client.post(
            "/v1/completions", json={"prompt": f"Stay {i}", "max_tokens": 20, "temperature": 0}
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0

    async def main():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=TIMEOUT) as client:
            jobs = [leave_after_first_token(client, i) for i in range(4)] + [
                complete(client, i) for i in range(2)
            ]
            await asyncio.wait_for(asyncio.gather(*jobs), TIMEOUT)

    asyncio.run(main())
    for _ in range(TIMEOUT * 20):  # the server notices the disconnects asynchronously
        after = scrape(server)
        if (
            metric(after, "swiftkv:num_requests_running") == 0
            and metric(after, "swiftkv:kv_cache_usage_perc") == 0
        ):
            break
        asyncio.run(asyncio.sleep(0.05))
    assert (
        metric(after, "swiftkv:num_requests_running") == 0
        and metric(after, "swiftkv:num_requests_waiting") == 0
    )
    assert metric(after, "swiftkv:kv_cache_usage_perc") == 0
    aborted = "swiftkv:request_success_total"
    assert (
        metric(after, aborted, finished_reason="abort") - metric(before, aborted, finished_reason="abort")
        == 4
    )


def test_metrics_parse_and_count_what_was_served(server, client):
    before = scrape(server)
    resp = client.completions.create(
        model="tiny", prompt="Count me in", max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape(server)

    def moved(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert moved("swiftkv:prompt_tokens_total") == resp.usage.prompt_tokens
    assert moved("swiftkv:generation_tokens_total") == 7
    assert moved("swiftkv:request_success_total", finished_reason="length") == 1
    assert moved("swiftkv:prefix_cache_queries_total") == resp.usage.prompt_tokens
    for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        assert moved(f"swiftkv:{histogram}_count") == 1
    assert moved("swiftkv:request_time_per_output_token_seconds_count") == 1
    assert moved("swiftkv:inter_token_latency_seconds_count") == 6
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert f"swiftkv:{gauge}{{" in after
    assert 'model_name="tiny"' in after and "swiftkv:num_preemptions_total" in after


def test_api_key_guards_v1_routes_only(server, client):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=TIMEOUT)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    for route in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{server.url}{route}", timeout=TIMEOUT).status_code == 200, route
    version = httpx.get(f"{server.url}/version", timeout=TIMEOUT).json()
    assert version["version"] and version["kernel_plan"]["device"] == "cpu"  # the engine's kernel plan
    assert "decode attention" in version["kernel_plan"]["ops"]


def test_two_authorization_headers_are_refused(server):
    """An ambiguous credential ("wrong, right" after merging) is a 401, whichever header is right."""
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    for headers in (
        [("Authorization", "Bearer wrong"), ("Authorization", f"Bearer {KEY}")],
        [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")],
    ):
        r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=TIMEOUT)
        assert r.status_code == 401 and "2 Authorization headers" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=TIMEOUT)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert kv_cache_idle(server.url, TIMEOUT)
