"""Bad input to `swiftkv serve` gets OpenAI's error schema with its status and a message naming the
field, never a 500, and disturbs nothing: the server then answers a good request with its KV cache
empty after, and a stream in flight meanwhile is unaffected. Hostile bodies too: nested past the
recursion limit, a 5,000-digit integer, a lone surrogate, a fan-out of 51,200 sequences, a body over
the size limit (413), a content type other than JSON (415). Backpressure (--max-waiting: 503 +
Retry-After), /health on a dead engine, /health while a maximal body is tokenized, CORS and a bug's
500 are checked in-process, where the engine or the tokenizer can be held deterministically."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading

import httpx
import openai
import pytest
from conftest import wait_until
from server_process import kv_cache_idle, save_tiny_checkpoint, serve_in_thread, start_server
from swiftkv_fast import LLM
from swiftkv_fast.cli import main

TIMEOUT = 120  # seconds; only reached if the test is broken
MAX_MODEL_LEN = 64
LONG = "word " * 100  # more than MAX_MODEL_LEN tokens
USER = [{"role": "user", "content": "hi"}]

# (route, JSON body or raw text, status, the error's param, a fragment of its message)
BAD_REQUESTS = [
    ("completions", "{bad json", 400, None, "not valid JSON"),
    ("completions", "[1, 2]", 400, None, "must be a JSON object"),
    ("completions", {}, 400, "prompt", "prompt: this field is required"),
    ("completions", {"prompt": 5}, 400, "prompt", "prompt: must be a string"),
    ("completions", {"prompt": ""}, 400, "prompt", "prompt is empty"),
    ("completions", {"prompt": ["ok", ""]}, 400, "prompt", "prompt[1]: prompt is empty"),
    ("completions", {"prompt": [1, 2, 10**9]}, 400, "prompt", "outside the vocabulary"),
    ("completions", {"prompt": LONG}, 400, "prompt", f"more than max_model_len={MAX_MODEL_LEN}"),
    ("completions", {"prompt": "hi", "model": "nope"}, 404, "model", "The model `nope` does not exist"),
    ("completions", {"prompt": "hi", "max_tokens": 100}, 400, "max_tokens", "maximum context length is 64"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be"),
    ("completions", {"prompt": "hi", "max_tokens": True}, 400, "max_tokens", "valid integer"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, 400, "temperature", "valid number"),
    ("completions", {"prompt": "hi", "temperature": -1}, 400, "temperature", "temperature must be >= 0"),
    ("completions", {"prompt": "hi", "top_p": 0}, 400, "top_p", "top_p must be in (0, 1]"),
    ("completions", {"prompt": "hi", "top_k": -5}, 400, "top_k", "top_k must be"),
    ("completions", {"prompt": "hi", "n": 0}, 400, "n", "n must be in [1, 128]"),
    ("completions", {"prompt": "hi", "n": 129}, 400, "n", "n must be in [1, 128]"),
    ("completions", {"prompt": "hi", "logprobs": 21}, 400, "logprobs", "logprobs must be in [0, 20]"),
    ("completions", {"prompt": "hi", "seed": 2**70}, 400, "seed", "seed must be in"),
    (
        "completions",
        {"prompt": "hi", "max_tokens": 5, "min_tokens": 9},
        400,
        "min_tokens",
        "min_tokens must be",
    ),
    ("completions", {"prompt": "hi", "stop": [""]}, 400, "stop", "stop[0] must not be empty"),
    ("completions", {"prompt": "hi", "stop": 3}, 400, "stop", "stop: Input should be"),
    (
        "completions",
        {"prompt": "hi", "stop_token_ids": [10**9]},
        400,
        "stop_token_ids",
        "outside the vocabulary",
    ),
    ("completions", {"prompt": "hi", "ignore_eos": "yes"}, 400, "ignore_eos", "valid boolean"),
    (
        "completions",
        {"prompt": "hi", "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "stream",
    ),
    ("completions", {"prompt": "hi", "frequency_penalty": 0.5}, 400, "frequency_penalty", "not supported"),
    ("completions", {"prompt": "hi", "echo": True}, 400, "echo", "not supported"),
    ("chat/completions", {"messages": []}, 400, "messages", "messages must not be empty"),
    ("chat/completions", {"messages": "hi"}, 400, "messages", "valid list"),
    ("chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages", "messages[0].role: this field"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages",
        "messages[0].content[0]: only text content parts",
    ),
    ("chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages", "max_model_len"),
    ("chat/completions", {"messages": USER, "top_logprobs": 2}, 400, "top_logprobs", "needs logprobs"),
    (
        "chat/completions",
        {"messages": USER, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "[0, 20]",
    ),
    (
        "chat/completions",
        {"messages": USER, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
        "must be",
    ),
    ("chat/completions", {"messages": USER, "max_tokens": 1000}, 400, "max_tokens", "maximum context length"),
    ("chat/completions", {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools", "not supported"),
    ("chat/completions", {"messages": USER, "model": "nope"}, 404, "model", "does not exist"),
    # hostile bodies: every one a 400, none a 500
    ("completions", "[" * 5000 + "]" * 5000, 400, None, "nested too deeply"),
    ("completions", '{"prompt": "hi", "max_tokens": 1' + "0" * 5000 + "}", 400, None, "not valid JSON"),
    ("completions", '{"prompt": "a\\ud800b"}', 400, "prompt", "prompt: the text is not valid Unicode"),
    (
        "chat/completions",
        '{"messages": [{"role": "user", "content": "\\udfff"}]}',
        400,
        "messages",
        "messages[0].content: the text is not valid Unicode: a lone surrogate U+DFFF at character 0",
    ),
    ("completions", {"prompt": ["x"] * 400, "n": 128}, 400, "n", "51200 sequences (400 prompts x n=128)"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("serve_errors") / "tiny")


@pytest.fixture(scope="module")
def server(request, ckpt):
    return start_server(
        request,
        [
            str(ckpt),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--kv-cache-memory",
            "4000000",
            "--linear-kernel",
            "linear",
        ],
    )


def post(server, route: str, body) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps(body)
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server.url}/v1/{route}", content=content, headers=headers, timeout=TIMEOUT)


def assert_good_request_answered(server) -> None:
    r = post(server, "completions", {"prompt": "still here", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert kv_cache_idle(server.url, TIMEOUT)


@pytest.mark.parametrize("route,body,status,param,message", BAD_REQUESTS)
def test_bad_request_gets_its_status_and_names_the_field(server, route, body, status, param, message):
    r = post(server, route, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"], error["message"]
    assert_good_request_answered(server)


def test_a_body_over_the_limit_is_413_before_it_is_read_whole(server):
    """The default limit for max_model_len 64 is the 1 MiB floor; a body that says it is larger is
    refused by its Content-Length, one sent in chunks (no length) once the bytes pass the limit."""
    too_big = json.dumps({"prompt": "x" * (1 << 20)})
    for content in (too_big, (too_big[i : i + 65536].encode() for i in range(0, len(too_big), 65536))):
        r = httpx.post(
            f"{server.url}/v1/completions",
            content=content,
            headers={"Content-Type": "application/json"},
            timeout=TIMEOUT,
        )
        assert r.status_code == 413, r.text
        assert "--max-request-body-bytes" in r.json()["error"]["message"]
        assert_good_request_answered(server)


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_only_json_bodies_are_accepted(server, content_type):
    """A page on any site can make a browser POST text/plain to localhost without a CORS preflight."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = json.dumps({"prompt": "hi", "max_tokens": 3})
    r = httpx.post(f"{server.url}/v1/completions", content=body, headers=headers, timeout=TIMEOUT)
    assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
    assert_good_request_answered(server)


def test_unknown_route_and_method_use_the_error_schema(server):
    r = httpx.get(f"{server.url}/v1/nothing", timeout=TIMEOUT)
    assert r.status_code == 404 and "GET /v1/nothing" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_typed_errors(server, ckpt):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=TIMEOUT)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=str(ckpt), messages=USER, top_p=5)


def test_bad_requests_do_not_disturb_a_stream_in_flight(server):
    body = {"prompt": "An undisturbed stream", "max_tokens": 55, "temperature": 0, "ignore_eos": True}
    want = post(server, "completions", body).json()["choices"][0]["text"]
    text = ""
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=TIMEOUT
    ) as r:
        for i, line in enumerate(r.iter_lines()):
            if i < 5:  # bad requests while this one is streaming
                route, bad, status, _, _ = BAD_REQUESTS[i * 7]
                assert post(server, route, bad).status_code == status
            if line.startswith("data: {"):
                text += json.loads(line.removeprefix("data: "))["choices"][0]["text"]
    assert text == want


def test_serve_flag_errors_are_one_line(capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2  # refused before the model loads
    err = capsys.readouterr().err
    assert err.startswith("swiftkv: error: ") and f"cannot listen on 127.0.0.1:{port}" in err
    assert main(["serve", "--port", "70000"]) == 2 and "--port" in capsys.readouterr().err
    assert main(["serve", "--max-waiting", "0"]) == 2 and "max_waiting" in capsys.readouterr().err
    assert main(["serve", "--max-sequences-per-request", "0"]) == 2
    assert "max_sequences_per_request" in capsys.readouterr().err


# ---- in-process: the app over an engine whose steps the test holds ---------------------------------


@pytest.fixture
def app_engine(tiny):
    """(build(**ServerConfig fields) -> httpx.AsyncClient over the app, the AsyncLLM), engine stopped at
    the end; `build.app(**fields)` is the app alone."""
    from char_tokenizer import CharTokenizer
    from swiftkv_fast.engine.async_llm import AsyncLLM
    from swiftkv_fast.entrypoints.api_server import build_app
    from swiftkv_fast.entrypoints.serving_engine import ServerConfig

    cfg, state, _ = tiny(num_hidden_layers=2)
    llm = LLM.from_state_dict(
        cfg,
        state,
        tokenizer=CharTokenizer(),
        block_size=8,
        max_model_len=128,
        num_kv_blocks=64,
        linear_kernel="linear",  # no kernel timing: these tests are about the server
    )
    engine = AsyncLLM(llm.llm_engine)

    def app(**config):
        return build_app(engine, ServerConfig(["tiny"], **config))

    def client(**config) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app(**config)), base_url="http://app", timeout=TIMEOUT
        )

    client.app = app
    yield client, engine
    engine.shutdown(timeout=TIMEOUT)


def hold_steps(engine, monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Every engine step waits inside the runner until `release` is set; `entered` says one has begun."""
    entered, release = threading.Event(), threading.Event()
    runner = engine.engine.runner
    real_execute = runner.execute

    def held_execute(out):
        entered.set()
        assert release.wait(TIMEOUT)
        return real_execute(out)

    monkeypatch.setattr(runner, "execute", held_execute)
    return entered, release


def test_max_waiting_refuses_with_503_and_retry_after(app_engine, monkeypatch):
    """The engine is held inside the first request's step: the next two wait; with --max-waiting 2
    the fourth is refused at once, then all three are served and new requests are accepted again."""
    make_client, engine = app_engine
    entered, release = hold_steps(engine, monkeypatch)
    body = {"prompt": "abc", "max_tokens": 4, "temperature": 0}

    async def main():
        async with make_client(max_waiting=2) as client:
            first = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await wait_until(TIMEOUT, entered.is_set)
            queued = [asyncio.ensure_future(client.post("/v1/completions", json=body)) for _ in range(2)]
            await wait_until(TIMEOUT, lambda: engine.num_waiting == 2)
            refused = await client.post("/v1/completions", json=body)
            release.set()
            served = await asyncio.gather(first, *queued)
            after = await client.post("/v1/completions", json=body)
            return refused, served, after

    refused, served, after = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert (
        refused.json()["error"]["code"] == "overloaded"
        and "--max-waiting 2" in refused.json()["error"]["message"]
    )
    assert [r.status_code for r in served] == [200, 200, 200] and after.status_code == 200
    texts = {r.json()["choices"][0]["text"] for r in served}
    assert len(texts) == 1 and after.json()["choices"][0]["text"] in texts


def test_health_is_503_once_the_engine_is_dead(app_engine, monkeypatch):
    make_client, engine = app_engine

    def broken():
        raise SystemExit("the engine loop breaks")

    async def main():
        async with make_client() as client:
            assert (await client.get("/health")).status_code == 200
            monkeypatch.setattr(engine.engine, "has_unfinished_requests", broken)
            failed = await client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4})
            return (
                failed,
                await client.get("/health"),
                await client.post("/v1/completions", json={"prompt": "x"}),
            )

    failed, health, refused = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert failed.status_code == 503 and failed.json()["error"]["code"] == "engine_dead"
    assert health.status_code == 503 and engine.errored
    assert refused.status_code == 503 and "not running" in refused.json()["error"]["message"]


def assert_idle(engine) -> None:
    """No request left in the engine and its KV cache empty (the answers came after their blocks were
    freed)."""
    assert engine.num_unfinished == 0 and engine.engine.kv_manager.usage == 0


def test_max_waiting_counts_sequences(app_engine, monkeypatch):
    """One request runs (held in its step) and one waits; with --max-waiting 3 a request of n=3 would
    make 4 waiting sequences: refused; one of n=2 makes 3: served."""
    make_client, engine = app_engine
    entered, release = hold_steps(engine, monkeypatch)
    body = {"prompt": "abc", "max_tokens": 4, "temperature": 0}

    async def main():
        async with make_client(max_waiting=3) as client:
            first = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await wait_until(TIMEOUT, entered.is_set)
            queued = asyncio.ensure_future(client.post("/v1/completions", json=body))
            await wait_until(TIMEOUT, lambda: engine.num_waiting == 1)
            refused = await client.post("/v1/completions", json=body | {"n": 3})
            admitted = asyncio.ensure_future(client.post("/v1/completions", json=body | {"n": 2}))
            await wait_until(TIMEOUT, lambda: engine.num_waiting == 3)
            release.set()
            return refused, await asyncio.gather(first, queued, admitted)

    refused, served = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert refused.status_code == 503 and "1 sequence(s) waiting" in refused.json()["error"]["message"]
    assert [r.status_code for r in served] == [200, 200, 200] and len(served[2].json()["choices"]) == 2
    assert_idle(engine)


class HeldTokenizer:
    """The test's tokenizer, which holds a long text until released (or TIMEOUT: a server that
    tokenizes on its event loop cannot answer anything meanwhile)."""

    def __init__(self, tokenizer, min_len: int):
        self.tokenizer, self.min_len = tokenizer, min_len
        self.entered, self.release = threading.Event(), threading.Event()

    def __call__(self, text: str) -> dict:
        if len(text) >= self.min_len:
            self.entered.set()
            self.release.wait(TIMEOUT)
        return self.tokenizer(text)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_health_is_answered_while_a_maximal_body_is_tokenized(app_engine, monkeypatch):
    """A body at the size limit is tokenized off the event loop: /health is answered while the
    tokenizer holds it, so its answer arrives before the big request's (its 400: longer than
    max_model_len). Then a good request is served and the engine is idle."""
    make_client, engine = app_engine
    limit = 1 << 20
    held = HeldTokenizer(engine.engine.tokenizer, min_len=limit // 2)
    monkeypatch.setattr(engine.engine, "tokenizer", held)
    big = json.dumps({"prompt": "a" * (limit - 100), "max_tokens": 1})
    assert len(big) <= limit
    order = []

    def post_big(url):
        r = httpx.post(
            f"{url}/v1/completions",
            content=big,
            headers={"Content-Type": "application/json"},
            timeout=TIMEOUT,
        )
        order.append(("big", r.status_code))

    with serve_in_thread(make_client.app(max_request_body_bytes=limit)) as url:
        sender = threading.Thread(target=post_big, args=(url,))
        sender.start()
        assert held.entered.wait(TIMEOUT)
        order.append(("health", httpx.get(f"{url}/health", timeout=TIMEOUT).status_code))
        held.release.set()
        sender.join(TIMEOUT)
        good = httpx.post(f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=TIMEOUT)
    assert order == [("health", 200), ("big", 400)]
    assert good.status_code == 200
    assert_idle(engine)


def test_a_bug_is_a_500_with_an_id_and_no_exception_text(app_engine, monkeypatch):
    """A bug in the server's code and one in an engine step: each a 500 naming an id, without the
    exception's text; the log has the traceback under that id."""
    from swiftkv_fast.entrypoints.serving_completion import OpenAIServingCompletion

    make_client, engine = app_engine
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("swiftkv_fast").addHandler(handler)

    def broken(*args):
        raise RuntimeError("a secret path /etc/shadow")

    answers = []
    try:
        with serve_in_thread(make_client.app()) as url:
            for target, name in ((OpenAIServingCompletion, "prepare"), (engine.engine.runner, "execute")):
                with monkeypatch.context() as patch:
                    patch.setattr(target, name, broken)
                    answers.append(
                        httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=TIMEOUT)
                    )
            good = httpx.post(
                f"{url}/v1/completions", json={"prompt": "ok", "max_tokens": 2}, timeout=TIMEOUT
            )
    finally:
        logging.getLogger("swiftkv_fast").removeHandler(handler)
    for r in answers:
        assert r.status_code == 500 and "secret" not in r.text
        error = r.json()["error"]
        assert error["type"] == "server_error" and error["message"].startswith("internal server error (id ")
        error_id = error["message"].split()[4].rstrip(":")
        (logged,) = [rec for rec in records if error_id in rec.getMessage()]
        assert logged.exc_info[0] is RuntimeError  # the traceback is in the log, under the same id
    assert good.status_code == 200
    assert_idle(engine)


def test_cors_headers_only_for_allowed_origins(app_engine):
    make_client, _ = app_engine
    preflight = {"Origin": "https://ok.example", "Access-Control-Request-Method": "POST"}
    with serve_in_thread(make_client.app()) as url:
        off = httpx.options(f"{url}/v1/completions", headers=preflight, timeout=TIMEOUT)
    with serve_in_thread(make_client.app(allowed_origins=["https://ok.example"])) as url:
        on = httpx.options(f"{url}/v1/completions", headers=preflight, timeout=TIMEOUT)
        other = httpx.options(
            f"{url}/v1/completions", headers=preflight | {"Origin": "https://evil.example"}, timeout=TIMEOUT
        )
    assert "access-control-allow-origin" not in off.headers
    assert on.status_code == 200 and on.headers["access-control-allow-origin"] == "https://ok.example"
    assert "access-control-allow-origin" not in other.headers
