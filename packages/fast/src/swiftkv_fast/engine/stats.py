"""What the engine reports to stat loggers (vLLM v1's `SchedulerStats`, `IterationStats`,
`FinishedRequestStats`): the serving layer turns them into Prometheus metrics."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvcache import PrefixCacheStats


@dataclass
class SchedulerStats:
    """The scheduler's state now; the counters are since the previous `LLMEngine.make_scheduler_stats`."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0  # in the scheduler's queue (AsyncLLM adds the requests not yet handed over)
    kv_cache_usage: float = 0.0  # held fraction of the usable KV blocks, in [0, 1]
    num_preemptions: int = 0
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    e2e_latency: float  # seconds from arrival to the end
    num_prompt_tokens: int
    num_generation_tokens: int
    mean_time_per_output_token: float | None  # None with fewer than two output tokens


@dataclass
class IterationStats:
    """One engine iteration (a step, or the aborts handled between two steps)."""

    num_prompt_tokens: int = 0  # prompts whose first token came in this iteration
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished_requests: list[FinishedRequestStats] = field(default_factory=list)
