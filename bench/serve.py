"""The OpenAI-compatible servers under concurrent chat clients, as vLLM's `benchmark_serving` measures
them: request throughput, output tokens/s, TTFT / TPOT / ITL (mean, median, p99) and failed requests.

Systems, each started and stopped by the benchmark, one at a time, on a free 127.0.0.1 port:

  swiftkv-off   `swiftkv serve` on the embedded model, L = N (SwiftKV off)
  swiftkv-on    `swiftkv serve --num-key-value-layers N/2` (converted on the fly: speed, not quality)
  hf-serve      `transformers serve --continuous-batching` (Hugging Face's own server), same weights
  offline       `LLM.generate` in this process on the same requests, max_num_seqs = the largest
                concurrency (only at that level): what a server can at best keep

Every system runs in each round (rounds interleave the systems: A, B, C, A, B, C), on a fresh server:
start, `--warmup` bursts of short requests (default 1; discarded), then each concurrency level in
turn; fp32, prefix caching off.
Load: at each level, `--num-requests` chat requests (default one per client, at least 2), each a user
message listing `--questions` of the distill package's built-in prompts (a different window per
request, and a header naming the level, so no two requests of a server share more than the system
prompt), greedy, exactly `--max-tokens` output tokens (EOS ignored). Each client sends its next
request when the previous one ends. Throughputs: median [min-max] over rounds; latencies pooled over
rounds (bench/load.py defines them); "x hf-serve" is the output tok/s ratio round by round.
If `transformers serve` cannot run here, the benchmark says why and compares with `offline` instead.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import engine, load, report
from bench.harness import Sample, Stats, paired_ratio, run_interleaved
from bench.servers import ServerError, ServerProcess, swiftkv_spec, transformers_serve_unavailable
from bench.servers import transformers_spec as hf_spec

log = logging.getLogger(__name__)

HELP = "swiftkv serve (SwiftKV off/on) vs transformers serve under 1-16 concurrent chat clients"
SYSTEMS = ["swiftkv-off", "swiftkv-on", "hf-serve", "offline"]
DEFAULT_SYSTEMS = ["swiftkv-off", "swiftkv-on", "hf-serve"]
GOAL_CLIENTS = 16
GOAL_SPEEDUP = 1.5  # swiftkv-off output tok/s over hf-serve's
GOAL_OFFLINE_SHARE = 0.85  # swiftkv-off output tok/s over offline LLM.generate's
HF_PAGE = 256
MAX_BATCH_TOKENS = 4096  # swiftkv's default max_num_batched_tokens, given to transformers too
WARMUP_TOKENS = 4


def _ints(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--concurrency", type=_ints, help="client counts (default 1,4,16; quick 1,4)")
    parser.add_argument(
        "--num-requests", type=int, help="requests per level (default one per client, at least 2)"
    )
    parser.add_argument(
        "--questions", type=int, help="built-in prompts in each request's message (default 12; quick 4)"
    )
    parser.add_argument("--max-tokens", type=int, help="output tokens per request (default 32; quick 16)")
    parser.add_argument("--systems", type=lambda s: s.split(","), help=f"comma-separated, from {SYSTEMS}")
    parser.add_argument(
        "--request-timeout", type=float, default=300.0, help="seconds one request may take (default 300)"
    )
    parser.add_argument(
        "--level-timeout",
        type=float,
        default=600.0,
        help="seconds one concurrency level may take; requests unfinished then fail (default 600)",
    )


@dataclass(frozen=True)
class Workload:
    concurrency: list[int]
    num_requests: dict[int, int]
    questions: int
    max_tokens: int

    def __post_init__(self) -> None:
        if self.questions < 1 or self.max_tokens < 1:
            raise ValueError(f"questions, max_tokens must be >= 1, got {self.questions}, {self.max_tokens}")
        if min(self.num_requests.values()) < 1:
            raise ValueError(f"every level needs at least one request, got {self.num_requests}")

    def requests(self, clients: int) -> list[load.ChatRequest]:
        return chat_requests(self.num_requests[clients], self.questions, self.max_tokens, f"Set {clients}")

    def warmup_requests(self) -> list[load.ChatRequest]:
        return chat_requests(max(self.concurrency), self.questions, WARMUP_TOKENS, "Warm-up")


def chat_requests(num: int, questions: int, max_tokens: int, tag: str) -> list[load.ChatRequest]:
    """`num` user messages, message i listing built-in prompts i*questions ... (wrapping around)."""
    from swiftkv_distill.data import builtin_prompts

    pool = builtin_prompts()
    out = []
    for i in range(num):
        lines = [f"{j + 1}. {pool[(i * questions + j) % len(pool)]}" for j in range(questions)]
        content = f"{tag}: answer each question in one short sentence.\n" + "\n".join(lines)
        out.append(load.ChatRequest([{"role": "user", "content": content}], max_tokens))
    return out


def run(args: argparse.Namespace) -> int:
    workload = _workload(args)
    systems = args.systems or DEFAULT_SYSTEMS
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    repeat = args.repeat or (1 if args.quick else 2)
    warmup = 1 if args.warmup is None else args.warmup
    from swiftkv_reference.checkpoint import load_config
    from swiftkv_reference.default_model import default_model_dir

    model_dir = default_model_dir()
    on_layers = load_config(model_dir).num_hidden_layers // 2
    hf_reason = transformers_serve_unavailable() if "hf-serve" in systems else None
    if hf_reason:
        print(f"transformers serve cannot run here: {hf_reason}\n  -> comparing with offline LLM.generate")
        systems = [s for s in systems if s != "hf-serve"] + (["offline"] if "offline" not in systems else [])
    specs = {
        "swiftkv-off": swiftkv_spec("swiftkv-off"),
        "swiftkv-on": swiftkv_spec("swiftkv-on", on_layers),
        "hf-serve": hf_spec("hf-serve", model_dir, _hf_blocks(workload, model_dir), MAX_BATCH_TOKENS),
    }
    if args.threads:  # the servers' torch threads too
        specs = {s: replace(v, env={**v.env, "OMP_NUM_THREADS": str(args.threads)}) for s, v in specs.items()}
    start_errors: dict[str, str] = {}
    cases = {
        s: _offline_case(workload)
        if s == "offline"
        else _server_case(specs[s], workload, warmup, args, start_errors)
        for s in systems
    }
    print(
        f"serving benchmark: {len(systems)} systems x {repeat} round(s); clients {workload.concurrency}, "
        f"requests {[workload.num_requests[c] for c in workload.concurrency]}, "
        f"{workload.questions} questions per message, {workload.max_tokens} output tokens each"
    )
    samples = run_interleaved(cases, repeat=repeat, warmup=0, progress=True)
    if "hf-serve" in start_errors:
        hf_reason = f"its server did not start or answer: {start_errors['hf-serve']}"
        print(f"transformers serve cannot run here: {hf_reason}\n  -> comparing with offline LLM.generate")
        if "offline" not in samples:
            samples["offline"] = run_interleaved(
                {"offline": _offline_case(workload)}, repeat=repeat, warmup=0
            )["offline"]
    rows = summarize_all(samples, workload.concurrency)
    lines = goal_lines(rows, workload.concurrency, hf_reason)
    table = _table(rows, workload, repeat, on_layers)
    table.notes += lines
    settings = {
        "concurrency": workload.concurrency,
        "num_requests": workload.num_requests,
        "questions": workload.questions,
        "max_tokens": workload.max_tokens,
        "systems": list(samples),
        "commands": {s: specs[s].argv[1:] for s in samples if s in specs},
        "repeat": repeat,
        "warmup_bursts": warmup,
        "num_key_value_layers_on": on_layers,
        "dtype": "float32",
        "transformers_serve_unavailable": hf_reason,
        "start_errors": start_errors,
    }
    rounds = {s: [x.metrics for x in samples[s]] for s in samples}
    json_path = report.write_json(args.out, "serve", settings, rows, goal=lines, rounds=rounds)
    png_path = plot(rows, list(samples), workload.concurrency, args.out)
    report.finish([table], [json_path, png_path])
    return 0


def _workload(args: argparse.Namespace) -> Workload:
    concurrency = args.concurrency or ([1, 4] if args.quick else [1, 4, GOAL_CLIENTS])
    if args.num_requests is not None:
        num = {c: args.num_requests for c in concurrency}
    else:
        num = {c: max(2, c) for c in concurrency}
    questions = (4 if args.quick else 12) if args.questions is None else args.questions
    max_tokens = (16 if args.quick else 32) if args.max_tokens is None else args.max_tokens
    return Workload(concurrency, num, questions, max_tokens)


def _hf_blocks(workload: Workload, model_dir: Path) -> int:
    """Pages of 256 tokens for the longest requests of the largest level, all in flight, plus one."""
    from swiftkv_reference.tokenizer import chat_token_ids, load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    clients = max(workload.concurrency)
    longest = max(len(chat_token_ids(tokenizer, r.messages)) for r in workload.requests(clients))
    return clients * math.ceil((longest + workload.max_tokens) / HF_PAGE) + 1


def _server_case(spec, workload: Workload, warmup: int, args, start_errors: dict[str, str]) -> Callable:
    """A fresh server per call: start, warm up, every level, stop. A server that fails to start is
    recorded in `start_errors` and not started again."""

    def call() -> dict[str, Any]:
        if spec.name in start_errors:
            return {"start_error": start_errors[spec.name]}
        try:
            with ServerProcess(spec) as server:
                url = server.wait_ready()
                for _ in range(warmup):
                    warm_requests = workload.warmup_requests()
                    warm = load.run(url, warm_requests, len(warm_requests), **_load_kw(spec, args))
                    errors = [r.error for r in warm.results if r.error]
                    if len(errors) == len(warm.results):
                        raise ServerError(f"{spec.name}: every warm-up request failed: {errors[0]}")
                levels = {}
                for clients in workload.concurrency:
                    result = load.run(url, workload.requests(clients), clients, **_load_kw(spec, args))
                    levels[clients] = load.metrics(result)
                    log.info(
                        "%s, %d clients: %.1f output tok/s, %d failed",
                        spec.name,
                        clients,
                        levels[clients]["output_throughput"],
                        levels[clients]["failed"],
                    )
                return {"levels": levels}
        except ServerError as e:
            start_errors[spec.name] = str(e)
            log.error("%s", e)
            return {"start_error": str(e)}

    return call


def _load_kw(spec, args) -> dict[str, Any]:
    return dict(extra_body=spec.extra_body, request_timeout=args.request_timeout, deadline=args.level_timeout)


def _offline_case(workload: Workload) -> Callable:
    """`LLM.generate` on the largest level's requests (the chat template's token ids), all submitted
    at once to an engine running at most that many at a time; built and warmed up on the first call."""
    clients = max(workload.concurrency)
    state: dict[str, Any] = {}

    def call() -> dict[str, Any]:
        import time

        from swiftkv_reference.tokenizer import chat_token_ids

        if not state:
            llm = engine.build_llm(None, max_num_seqs=clients)
            warm = [chat_token_ids(llm.tokenizer, r.messages) for r in workload.warmup_requests()]
            engine.run_batch(llm, warm, WARMUP_TOKENS)
            state["llm"] = llm
        llm = state["llm"]
        prompts = [chat_token_ids(llm.tokenizer, r.messages) for r in workload.requests(clients)]
        start = time.perf_counter()
        batch = engine.run_batch(llm, prompts, workload.max_tokens)
        seconds = time.perf_counter() - start
        return {"levels": {clients: offline_metrics(batch, len(prompts), seconds, clients)}}

    return call


def offline_metrics(batch: engine.BatchResult, num: int, seconds: float, clients: int) -> dict[str, Any]:
    """An offline batch in the load generator's keys (no ITL: the engine reports TTFT and TPOT)."""
    from bench.throughput import _percentiles

    row = {
        "concurrency": clients,
        "completed": num,
        "failed": 0,
        "errors": [],
        "duration": seconds,
        "total_input_tokens": batch.prompt_tokens,
        "total_output_tokens": batch.output_tokens,
        "request_throughput": num / seconds,
        "output_throughput": batch.output_tokens / seconds,
        "total_token_throughput": (batch.prompt_tokens + batch.output_tokens) / seconds,
        "ttft_s": batch.ttft_s,
        "tpot_s": batch.tpot_s,
        "itl_s": [],
        "e2el_s": [],
    }
    for key in ("ttft", "tpot", "itl", "e2el"):
        row.update(_percentiles(row[f"{key}_s"], key))
    return row


def summarize_all(samples: dict[str, list[Sample]], concurrency: list[int]) -> list[dict]:
    """One row per (level, system) that ran; output tok/s ratios to hf-serve and offline, round by round."""
    rows = []
    for clients in concurrency:
        level = {s: summarize(s, clients, samples[s]) for s in samples}
        level = {s: r for s, r in level.items() if r is not None}
        for ref in ("hf-serve", "offline"):
            if ref not in level:
                continue
            for system, row in level.items():
                pairs = [
                    (a.metrics["levels"][clients], b.metrics["levels"][clients])
                    for a, b in zip(samples[system], samples[ref])
                    if clients in a.metrics.get("levels", {}) and clients in b.metrics.get("levels", {})
                ]
                if pairs and system != ref:
                    row[f"output_tps_vs_{ref}"] = paired_ratio(
                        [a["output_throughput"] for a, _ in pairs], [b["output_throughput"] for _, b in pairs]
                    )
        rows += level.values()
    return rows


def summarize(system: str, clients: int, samples: list[Sample]) -> dict | None:
    """vLLM's keys for one system at one level: throughputs over rounds, latencies pooled."""
    from bench.throughput import _percentiles

    rounds = [s.metrics["levels"][clients] for s in samples if clients in s.metrics.get("levels", {})]
    if not rounds:
        return None
    row: dict[str, Any] = {
        "system": system,
        "concurrency": clients,
        "num_requests": rounds[0]["completed"] + rounds[0]["failed"],
        "rounds": len(rounds),
        "completed": sum(r["completed"] for r in rounds),
        "failed": sum(r["failed"] for r in rounds),
        "errors": sorted({e for r in rounds for e in r["errors"]})[:5],
        "total_input_tokens": rounds[0]["total_input_tokens"],
        "total_output_tokens": rounds[0]["total_output_tokens"],
    }
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        row[key] = Stats.of([r[key] for r in rounds])
    for key in ("ttft", "tpot", "itl", "e2el"):
        row.update(_percentiles([v for r in rounds for v in r[f"{key}_s"]], key))
    return row


def goal_lines(rows: list[dict], concurrency: list[int], hf_reason: str | None) -> list[str]:
    """Issue 13's goal at the largest level: swiftkv-off >= 1.5x hf-serve's output tok/s, a lower p99
    TTFT, no failed request in either; without hf-serve, >= 85% of offline LLM.generate's output tok/s."""
    clients = max(concurrency)
    at = {r["system"]: r for r in rows if r["concurrency"] == clients}
    where = f"{clients} clients"
    if clients != GOAL_CLIENTS:
        where += f" (the goal is stated at {GOAL_CLIENTS})"
    off = at.get("swiftkv-off")
    if off is None:
        return [f"goal: not evaluated (swiftkv-off did not run at {clients} clients)"]
    if "hf-serve" in at:
        hf = at["hf-serve"]
        ratio = off["output_tps_vs_hf-serve"].median
        checks = [
            (
                f"output tok/s {ratio:.2f}x transformers serve's (goal >= {GOAL_SPEEDUP}x)",
                ratio >= GOAL_SPEEDUP,
            ),
            (
                f"p99 TTFT {_ms(off['p99_ttft_ms'])} vs {_ms(hf['p99_ttft_ms'])} (goal: lower)",
                off["p99_ttft_ms"] is not None
                and (hf["p99_ttft_ms"] is None or off["p99_ttft_ms"] < hf["p99_ttft_ms"]),
            ),
            (
                f"failed requests {off['failed']} / {hf['failed']} (goal: 0)",
                off["failed"] + hf["failed"] == 0,
            ),
        ]
    elif "offline" in at:
        share = off["output_tps_vs_offline"].median
        why = f"transformers serve could not run ({hf_reason}); " if hf_reason else ""
        checks = [
            (
                f"{why}output tok/s {share:.0%} of offline LLM.generate's (goal >= {GOAL_OFFLINE_SHARE:.0%})",
                share >= GOAL_OFFLINE_SHARE,
            ),
            (f"failed requests {off['failed']} (goal: 0)", off["failed"] == 0),
        ]
    else:
        return [f"goal: not evaluated (neither hf-serve nor offline ran at {clients} clients)"]
    verdict = "MET" if all(ok for _, ok in checks) else "NOT MET"
    parts = "; ".join(f"{text}: {'yes' if ok else 'no'}" for text, ok in checks)
    return [f"goal at {where}, swiftkv-off: {parts} -> {verdict}"]


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f} ms"


def _table(rows: list[dict], workload: Workload, repeat: int, on_layers: int) -> report.Table:
    from bench.throughput import _lat

    ref = next((r for r in ("hf-serve", "offline") if any(x["system"] == r for x in rows)), None)
    t = report.Table(
        f"Serving: chat requests of {workload.questions} questions -> {workload.max_tokens} output tokens, "
        f"fp32, {repeat} round(s)",
        ["clients", "system", "req/s", "output tok/s", f"x {ref}" if ref else "x -",
         "TTFT ms mean/med/p99", "TPOT ms mean/med/p99", "ITL ms mean/med/p99", "failed"],
    )  # fmt: skip
    for r in rows:
        ratio = r.get(f"output_tps_vs_{ref}")
        t.add(
            r["concurrency"],
            r["system"],
            r["request_throughput"].median,
            r["output_throughput"],
            f"{ratio.median:.2f}x" if ratio else None,
            _lat(r, "ttft"),
            _lat(r, "tpot"),
            _lat(r, "itl"),
            f"{r['failed']}/{r['num_requests'] * r['rounds']}",
        )
    t.notes.append(
        f"swiftkv-on: L = {on_layers}, converted on the fly (speed, not quality). Requests per level: "
        + ", ".join(f"{c} clients {n}" for c, n in workload.num_requests.items())
        + ". TTFT to the first text chunk; ITL between text chunks; offline: one LLM.generate, no ITL."
    )
    for r in rows:
        if r["errors"]:
            t.notes.append(f"{r['system']} at {r['concurrency']} clients failed: {r['errors'][0][:200]}")
    return t


@report.optional_plot
def plot(rows: list[dict], systems: list[str], concurrency: list[int], out: Path) -> Path:
    fig, (tps, ttft) = report.new_figure(ncols=2, width=5.0)
    for system in systems:
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r["concurrency"])
        if not mine:
            continue
        xs = [r["concurrency"] for r in mine]
        report.errorbar(tps, xs, [r["output_throughput"] for r in mine], label=system)
        ttft.plot(xs, [r["p99_ttft_ms"] for r in mine], marker="o", label=system)
    for ax, label in ((tps, "output tokens/s"), (ttft, "p99 TTFT (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concurrency, [str(c) for c in concurrency])
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle("OpenAI-compatible servers under load (SmolLM2-135M-Instruct, fp32)")
    return report.save_figure(fig, out, "serve")
