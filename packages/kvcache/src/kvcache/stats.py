"""Prefix-cache statistics, in tokens (vLLM 0.10+ units; recorded at admission as in 0.33)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    """Counts since the last ``make_prefix_cache_stats()``.

    ``queries`` are prompt tokens looked up and ``hits`` the tokens served from the
    cache, for requests admitted for the first time; re-admissions after a
    preemption are counted apart in ``preempted_*``. ``reset`` is True when the
    prefix cache was reset in the interval.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    @property
    def hit_rate(self) -> float:
        """hits / queries of first admissions (0.0 when nothing was queried)."""
        return self.hits / self.queries if self.queries else 0.0
