"""`bench serve`'s machinery without a model: vLLM's serving metrics from synthetic timestamps, the load
generator against a stdlib SSE server in this process (concurrency, failures, both servers' stream
endings), the server launcher on a stand-in server, the request set, the ratios and the goal line.
No timing is asserted: the only waits are bounded rendezvous."""

from __future__ import annotations

import json
import re
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from bench import load, serve, servers
from bench.harness import Sample, Stats


def test_request_metrics_from_timestamps():
    r = load.RequestResult(start=10.0, chunk_times=[10.5, 10.7, 11.0], end=11.2, output_tokens=5)
    assert r.success
    assert r.ttft == pytest.approx(0.5)
    assert r.latency == pytest.approx(1.2)
    assert r.tpot == pytest.approx((1.2 - 0.5) / 4)  # (latency - TTFT) / (output tokens - 1)
    assert r.itl == pytest.approx([0.2, 0.3])
    one = load.RequestResult(start=0.0, chunk_times=[0.1], end=0.1, output_tokens=1)
    assert one.tpot is None and one.itl == []
    assert load.RequestResult(start=0.0).ttft is None


def test_load_metrics_follow_benchmark_serving():
    ok = [
        load.RequestResult(0.0, [1.0, 1.5], end=2.0, prompt_tokens=10, output_tokens=3),
        load.RequestResult(0.0, [3.0, 3.1, 3.3], end=4.0, prompt_tokens=20, output_tokens=3),
    ]
    bad = load.RequestResult(0.0, error="HTTP 503: busy")
    m = load.metrics(load.LoadResult(ok + [bad], duration=4.0, concurrency=2))
    assert (m["completed"], m["failed"], m["errors"]) == (2, 1, ["HTTP 503: busy"])
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 6)
    assert m["request_throughput"] == pytest.approx(0.5)
    assert m["output_throughput"] == pytest.approx(1.5)
    assert m["total_token_throughput"] == pytest.approx(9.0)
    assert (m["mean_ttft_ms"], m["median_ttft_ms"], m["p99_ttft_ms"]) == pytest.approx((2000, 2000, 3000))
    assert m["mean_tpot_ms"] == pytest.approx((500 + 500) / 2)
    assert m["median_itl_ms"] == pytest.approx(200) and m["p99_itl_ms"] == pytest.approx(500)
    assert m["mean_e2el_ms"] == pytest.approx(3000)


class _FakeOpenAI(BaseHTTPRequestHandler):
    """Streams `max_tokens` one-character chunks of a chat completion. The first two requests wait
    for each other (so they are only answered if the client keeps both in flight); a message with
    FAIL gets a 503, HANG waits for the test to end, HF ends like `transformers serve` (no [DONE])."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def do_POST(self):
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        content = body["messages"][0]["content"]
        with state["lock"]:
            state["bodies"].append(body)
            state["in_flight"] += 1
            state["max_in_flight"] = max(state["max_in_flight"], state["in_flight"])
            arrival = len(state["bodies"])
        try:
            if arrival <= 2:
                state["pair"].wait()
            if "HANG" in content:
                state["release"].wait(10)
            if "FAIL" in content:
                self._send(503, b'{"error": {"message": "overloaded"}}', "application/json")
                return
            self._stream(body, content)
        finally:
            with state["lock"]:
                state["in_flight"] -= 1

    def _send(self, status, data, kind):
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _stream(self, body, content):
        n = body["max_tokens"]
        events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
        for i in range(n):
            last = "length" if i == n - 1 else None
            events.append({"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": last}]})
        events.append({"choices": [], "usage": {"prompt_tokens": len(content), "completion_tokens": n}})
        data = "".join(f"data: {json.dumps(e)}\n\n" for e in events)
        data += "" if "HF" in content else "data: [DONE]\n\n"
        self._send(200, data.encode(), "text/event-stream")


@pytest.fixture
def fake_server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _FakeOpenAI)
    httpd.daemon_threads = True
    httpd.state = dict(
        lock=threading.Lock(),
        bodies=[],
        in_flight=0,
        max_in_flight=0,
        pair=threading.Barrier(2, timeout=10),
        release=threading.Event(),
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd.state
    httpd.state["release"].set()
    httpd.shutdown()
    httpd.server_close()
    thread.join(10)


def _chat(text: str, max_tokens: int = 3) -> load.ChatRequest:
    return load.ChatRequest([{"role": "user", "content": text}], max_tokens)


def test_load_generator_keeps_concurrency_and_counts_failures(fake_server):
    url, state = fake_server
    requests = [_chat("a"), _chat("b"), _chat("c FAIL"), _chat("d", 5), _chat("e HF", 4)]
    result = load.run(url, requests, 2, extra_body={"ignore_eos": True}, request_timeout=20)
    assert state["max_in_flight"] == 2  # the first two met at the server's rendezvous; never a third
    assert len(state["bodies"]) == 5
    assert all(b["ignore_eos"] and b["stream"] and b["temperature"] == 0 for b in state["bodies"])
    by_text = {r["messages"][0]["content"]: r for r in state["bodies"]}
    assert by_text["d"]["max_tokens"] == 5
    ok = [r for r in result.results if r.success]
    assert [r.output_tokens for r in ok] == [3, 3, 5, 4]
    assert [r.text for r in ok] == ["xxx", "xxx", "xxxxx", "xxxx"]  # HF: no [DONE], still complete
    assert all(len(r.chunk_times) == r.output_tokens and r.end >= r.chunk_times[-1] for r in ok)
    failed = result.results[2]
    assert failed.error.startswith("HTTP 503") and "overloaded" in failed.error
    m = load.metrics(result)
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 1, 15)


def test_load_generator_fails_requests_past_the_deadline_or_timeout(fake_server):
    url, state = fake_server
    requests = [_chat("a"), _chat("b"), _chat("c HANG"), _chat("d")]
    result = load.run(url, requests, 2, request_timeout=20, deadline=1.0)
    errors = [r.error for r in result.results]
    assert errors[:2] == [None, None]
    assert "deadline" in errors[2]
    assert errors[3] is None or "deadline" in errors[3]  # the other client may or may not have sent it
    (late,) = load.run(url, [_chat("e HANG")], 1, request_timeout=0.5).results
    assert re.search(r"over 0.5 s|Timeout", late.error)
    with pytest.raises(ValueError, match="concurrency"):
        load.run(url, requests, 0)


def test_server_process_reads_the_address_and_stops(tmp_path):
    script = tmp_path / "stand_in.py"
    script.write_text(
        "from http.server import BaseHTTPRequestHandler, HTTPServer\n"
        "class H(BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        self.send_response(200 if self.path == '/health' else 404); self.end_headers()\n"
        "    def log_message(self, *a): pass\n"
        "s = HTTPServer(('127.0.0.1', 0), H)\n"
        "print(f'serving stand-in on http://127.0.0.1:{s.server_address[1]}', flush=True)\n"
        "s.serve_forever()\n"
    )
    with servers.ServerProcess(servers.ServerSpec("stand-in", [sys.executable, str(script)])) as server:
        url = server.wait_ready(timeout=30)
        assert url.startswith("http://127.0.0.1:") and url != "http://127.0.0.1:0"
    assert server.proc.returncode is not None
    dead = servers.ServerSpec("dead", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"])
    with servers.ServerProcess(dead) as server, pytest.raises(servers.ServerError, match="no model here"):
        server.wait_ready(timeout=30)


def test_transformers_serve_unavailable_names_what_is_missing(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "accelerate" else real(n))
    if real("transformers") is None or real("transformers.cli.serve") is None:
        pytest.skip("transformers serve is not in this transformers")
    assert "accelerate" in servers.transformers_serve_unavailable()


def test_chat_requests_are_fixed_and_distinct():
    pytest.importorskip("swiftkv_distill")
    a = serve.chat_requests(4, 3, 8, "Set 4")
    assert a == serve.chat_requests(4, 3, 8, "Set 4")
    contents = [r.messages[0]["content"] for r in a]
    assert len(set(contents)) == 4 and all(c.startswith("Set 4: ") for c in contents)
    assert all(c.count("\n") == 3 and r.max_tokens == 8 for c, r in zip(contents, a))
    other = serve.chat_requests(4, 3, 8, "Set 16")
    bodies = [c.split(":", 1)[1] for c in contents]
    assert [r.messages[0]["content"].split(":", 1)[1] for r in other] == bodies  # same questions


def _round(tps: float, p99_ttft: float, failed: int = 0) -> Sample:
    level = load.metrics(load.LoadResult([], duration=1.0, concurrency=16))
    level.update(output_throughput=tps, request_throughput=tps / 10, total_token_throughput=tps * 2)
    level.update(failed=failed, ttft_s=[p99_ttft / 1000])
    return Sample(1.0, {"levels": {16: level}})


def test_ratios_are_paired_by_round_and_the_goal_is_judged():
    samples = {
        "swiftkv-off": [_round(100, 200), _round(40, 300)],
        "hf-serve": [_round(50, 900), _round(10, 800)],
    }
    rows = serve.summarize_all(samples, [16])
    off = next(r for r in rows if r["system"] == "swiftkv-off")
    assert off["output_tps_vs_hf-serve"].median == pytest.approx(3.0)  # rounds 2x and 4x
    assert off["output_throughput"] == Stats.of([100, 40])
    (line,) = serve.goal_lines(rows, [16], None)
    assert line.endswith("-> MET") and "3.00x" in line
    samples["hf-serve"][1] = _round(10, 800, failed=1)
    (line,) = serve.goal_lines(serve.summarize_all(samples, [16]), [16], None)
    assert line.endswith("-> NOT MET") and "failed requests 0 / 1 (goal: 0): no" in line
    offline = {"swiftkv-off": samples["swiftkv-off"], "offline": [_round(110, 100), _round(50, 100)]}
    (line,) = serve.goal_lines(serve.summarize_all(offline, [4, 16]), [4, 16], "no accelerate")
    assert "could not run (no accelerate)" in line and line.endswith("-> MET")  # 91% and 80%: median 85%


def test_bad_settings_are_refused_before_any_server_starts(monkeypatch):
    from bench.__main__ import build_parser

    monkeypatch.setattr(serve, "ServerProcess", None)  # starting a server would fail
    args = build_parser().parse_args(["serve", "--max-tokens", "0"])
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        serve.run(args)
    with pytest.raises(SystemExit, match="unknown systems"):
        serve.run(build_parser().parse_args(["serve", "--systems", "swiftkv-off,vllm"]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--concurrency", "4,0"])


def test_bench_cli_builds_without_httpx():
    """`python -m bench demo`, the main job, lists every benchmark but must not need serve's httpx."""
    import subprocess
    import sys
    from pathlib import Path

    code = "import sys; sys.modules['httpx'] = None; from bench.__main__ import build_parser; build_parser()"
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, timeout=120)
