"""Prometheus metrics for GET /metrics: vLLM's metric names under our own `swiftkv:` prefix (a
dashboard built for vLLM works after replacing `vllm:` by `swiftkv:`; the prefix says which engine
produced a series when both are scraped), each labelled with `model_name`.

    swiftkv:num_requests_running             gauge      requests in the running batch
    swiftkv:num_requests_waiting             gauge      requests queued (not admitted, or preempted)
    swiftkv:kv_cache_usage_perc              gauge      held fraction of the KV cache blocks, 0..1
    swiftkv:num_preemptions_total            counter    preemptions (recompute) since start
    swiftkv:prefix_cache_queries_total       counter    prompt tokens looked up in the prefix cache
    swiftkv:prefix_cache_hits_total          counter    of those, tokens served from it (hit rate =
                                                        rate(hits) / rate(queries))
    swiftkv:prompt_tokens_total              counter    prompt tokens of requests that produced a token
    swiftkv:generation_tokens_total          counter    generated tokens
    swiftkv:request_success_total            counter    finished requests, label finished_reason
                                                        (stop, length, abort, error)
    swiftkv:time_to_first_token_seconds      histogram  arrival -> first token
    swiftkv:inter_token_latency_seconds      histogram  between two tokens of a request
    swiftkv:request_time_per_output_token_seconds  histogram  a request's mean TPOT
    swiftkv:e2e_request_latency_seconds      histogram  arrival -> finish
    swiftkv:request_prompt_tokens            histogram  prompt length of finished requests
    swiftkv:request_generation_tokens        histogram  output length of finished requests

Every metric lives in the registry given to the logger, so several servers (or tests) in one
process do not collide.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.process_collector import ProcessCollector

from swiftkv_fast.engine.stats import IterationStats, SchedulerStats

PREFIX = "swiftkv:"
LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


def make_registry() -> CollectorRegistry:
    """A registry with the process metrics (CPU, memory, open files) of this server."""
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    return registry


class PrometheusStatLogger:
    """An AsyncLLM stat logger: updates the metrics after every engine iteration (engine thread;
    prometheus_client is thread-safe)."""

    def __init__(self, model_name: str, registry: CollectorRegistry):
        def metric(cls, name: str, doc: str, labels: tuple[str, ...] = (), **kwargs):
            m = cls(PREFIX + name, doc, ("model_name", *labels), registry=registry, **kwargs)
            return m if labels else m.labels(model_name)

        self.model_name = model_name
        self.running = metric(Gauge, "num_requests_running", "Requests in the running batch.")
        self.waiting = metric(Gauge, "num_requests_waiting", "Requests waiting to be admitted.")
        self.kv_usage = metric(Gauge, "kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent.")
        self.preemptions = metric(Counter, "num_preemptions", "Preemptions (recompute).")
        self.prefix_queries = metric(
            Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache."
        )
        self.prefix_hits = metric(Counter, "prefix_cache_hits", "Prompt tokens served from the prefix cache.")
        self.prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = metric(Counter, "generation_tokens", "Generated tokens.")
        self.request_success = metric(
            Counter, "request_success", "Finished requests by finish reason.", ("finished_reason",)
        )
        self.ttft = metric(
            Histogram, "time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS
        )
        self.itl = metric(
            Histogram, "inter_token_latency_seconds", "Inter-token latency.", buckets=LATENCY_BUCKETS
        )
        self.tpot = metric(
            Histogram,
            "request_time_per_output_token_seconds",
            "Mean time per output token of each request.",
            buckets=LATENCY_BUCKETS,
        )
        self.e2e = metric(
            Histogram, "e2e_request_latency_seconds", "End-to-end request latency.", buckets=LATENCY_BUCKETS
        )
        self.request_prompt_tokens = metric(
            Histogram, "request_prompt_tokens", "Prompt tokens of finished requests.", buckets=TOKEN_BUCKETS
        )
        self.request_generation_tokens = metric(
            Histogram,
            "request_generation_tokens",
            "Generated tokens of finished requests.",
            buckets=TOKEN_BUCKETS,
        )

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        s, it = scheduler_stats, iteration_stats
        self.running.set(s.num_running_reqs)
        self.waiting.set(s.num_waiting_reqs)
        self.kv_usage.set(s.kv_cache_usage)
        self.preemptions.inc(s.num_preemptions)
        self.prefix_queries.inc(s.prefix_cache_stats.queries)
        self.prefix_hits.inc(s.prefix_cache_stats.hits)
        self.prompt_tokens.inc(it.num_prompt_tokens)
        self.generation_tokens.inc(it.num_generation_tokens)
        for value in it.time_to_first_tokens:
            self.ttft.observe(value)
        for value in it.inter_token_latencies:
            self.itl.observe(value)
        for f in it.finished_requests:
            self.request_success.labels(self.model_name, f.finish_reason).inc()
            self.e2e.observe(f.e2e_latency)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)
            if f.mean_time_per_output_token is not None:
                self.tpot.observe(f.mean_time_per_output_token)
