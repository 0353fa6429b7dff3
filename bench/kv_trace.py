"""The kvcache trace benchmark (`bench/kvcache_bench.py`: a synthetic serving trace replayed through a
small vLLM-style scheduler; only the cache manager's bookkeeping is timed), for full attention and a
sliding window, interleaved round by round with the same trace through vLLM's `KVCacheManager` when
`import vllm.v1.core.kv_cache_manager` works (see `bench/vllm_cache.py`). The plot shows the blocks
held as the trace runs, full attention vs sliding window."""

from __future__ import annotations

import argparse
import inspect
import logging
from pathlib import Path

from kvcache import FullAttentionSpec, KVCacheManager, SlidingWindowSpec

from bench import kvcache_bench, report, vllm_cache
from bench.harness import Stats, paired_ratio, run_interleaved

log = logging.getLogger(__name__)

HELP = "kvcache trace replay (full vs sliding window), vs vLLM's KVCacheManager when importable"
DEFAULTS = {k: p.default for k, p in inspect.signature(kvcache_bench.run).parameters.items()}
MAX_POINTS = 2000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--num-requests", type=int, help="requests in the timed trace (default 1000; quick 100)"
    )
    parser.add_argument(
        "--series-requests",
        type=int,
        help="requests in the trace behind the blocks-held plot (default 300; quick 50)",
    )
    parser.add_argument("--window", type=int, default=DEFAULTS["window"], help="sliding window in tokens")
    parser.add_argument("--num-blocks", type=int, default=DEFAULTS["num_blocks"], help="blocks in the pool")
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM comparison")


class _Recording(KVCacheManager):
    """A KVCacheManager that records (tokens scheduled so far, blocks held) after each allocation."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.tokens = 0
        self.series: list[tuple[int, int]] = []

    def allocate_slots(self, request, num_new_tokens, *a, **kw):
        new = super().allocate_slots(request, num_new_tokens, *a, **kw)
        if new is not None:
            self.tokens += num_new_tokens
            self.series.append((self.tokens, self.num_blocks - 1 - self.num_free_blocks))
        return new


def run(args: argparse.Namespace) -> int:
    num_requests = args.num_requests or (100 if args.quick else 1000)
    series_requests = args.series_requests or (50 if args.quick else 300)
    repeat = args.repeat or 3
    warmup = (0 if args.quick else 1) if args.warmup is None else args.warmup
    block, chunk, seqs, max_len = (
        DEFAULTS[k] for k in ("block_size", "chunk", "max_num_seqs", "max_model_len")
    )
    configs = {"full": None, f"sliding{args.window}": args.window}
    has_vllm, vllm_note = (False, "--no-vllm") if args.no_vllm else vllm_cache.available()
    print(f"vLLM comparison: {'vLLM ' + vllm_note if has_vllm else 'skipped (' + vllm_note + ')'}")

    def replay_case(factory):
        def call():
            return kvcache_bench.replay(
                factory(), num_requests, args.seed, token_budget=chunk, max_num_seqs=seqs
            )

        return call

    rows = []
    for name, window in configs.items():
        spec = FullAttentionSpec(block) if window is None else SlidingWindowSpec(block, window)
        cases = {
            "kvcache": replay_case(
                lambda s=spec: KVCacheManager([s], num_blocks=args.num_blocks, max_model_len=max_len)
            )
        }
        if has_vllm:
            cases["vllm"] = replay_case(
                lambda w=window: vllm_cache.VllmManager(block, args.num_blocks, max_len, w)
            )
        print(f"{name}: {num_requests} requests, {len(cases)} manager(s)")
        samples = run_interleaved(cases, repeat=repeat, warmup=warmup, progress=True)
        for manager, ss in samples.items():
            last = ss[-1].metrics
            row = {
                "config": name,
                "manager": manager,
                **{k: v for k, v in last.items() if not k.endswith("_s")},
                "elapsed_s": Stats.of([s.seconds for s in ss]),
                "steps_per_s": Stats.of([s.metrics["steps_per_s"] for s in ss]),
                "allocate_slots_per_s": Stats.of([s.metrics["allocate_slots_per_s"] for s in ss]),
                "get_computed_blocks_per_s": Stats.of([s.metrics["get_computed_blocks_per_s"] for s in ss]),
            }
            if manager != "kvcache":
                ours = samples["kvcache"]
                row["time_vs_kvcache"] = paired_ratio([s.seconds for s in ss], [s.seconds for s in ours])
                keys = ("steps", "preemptions", "hit_tokens", "peak_blocks_held")
                row["same_schedule"] = all(last[k] == ours[-1].metrics[k] for k in keys)
            rows.append(row)

    series = {
        name: _series(name, window, block, args, series_requests, chunk, seqs, max_len)
        for name, window in configs.items()
    }
    table = _table(rows, num_requests, repeat)
    bound = kvcache_bench.cdiv(args.window - 1 + chunk, block) + 1
    table.notes.append(
        f"sliding-window bound on blocks per request: {bound}; "
        f"1,000,000-block manager init: {kvcache_bench.time_init() * 1e3:.2f} ms"
    )
    settings = {
        "num_requests": num_requests,
        "series_requests": series_requests,
        "block_size": block,
        "chunk": chunk,
        "max_num_seqs": seqs,
        "max_model_len": max_len,
        "window": args.window,
        "num_blocks": args.num_blocks,
        "repeat": repeat,
        "warmup": warmup,
        "seed": args.seed,
        "vllm": vllm_note if has_vllm else None,
    }
    json_path = report.write_json(args.out, "kvcache", settings, rows, blocks_held_series=series)
    png_path = plot(series, args.num_blocks, args.out)
    report.finish([table], [json_path, png_path])
    return 0


def _series(name, window, block, args, num_requests, chunk, seqs, max_len) -> dict:
    spec = FullAttentionSpec(block) if window is None else SlidingWindowSpec(block, window)
    mgr = _Recording([spec], num_blocks=args.num_blocks, max_model_len=max_len)
    kvcache_bench.replay(mgr, num_requests, args.seed, token_budget=chunk, max_num_seqs=seqs)
    pts = mgr.series[:: max(1, len(mgr.series) // MAX_POINTS)]
    return {"tokens_scheduled": [p[0] for p in pts], "blocks_held": [p[1] for p in pts]}


def _table(rows: list[dict], num_requests: int, repeat: int) -> report.Table:
    t = report.Table(
        f"kvcache trace replay: {num_requests} requests, {repeat} round(s); bookkeeping only, no model",
        [
            "config",
            "manager",
            "steps",
            "steps/s",
            "allocate_slots/s",
            "lookups/s",
            "peak held",
            "preempt",
            "hit rate",
            "time / kvcache",
            "same schedule",
        ],
    )
    for r in rows:
        ratio = r.get("time_vs_kvcache")
        t.add(
            r["config"],
            r["manager"],
            r["steps"],
            r["steps_per_s"].median,
            r["allocate_slots_per_s"].median,
            r["get_computed_blocks_per_s"].median,
            r["peak_blocks_held"],
            r["preemptions"],
            f"{r['hit_rate']:.3f}",
            f"{ratio.median:.2f}x" if ratio else None,
            {True: "yes", False: "NO"}.get(r.get("same_schedule")),
        )
    return t


@report.optional_plot
def plot(series: dict, num_blocks: int, out: Path) -> Path:
    fig, (ax,) = report.new_figure(width=7)
    for i, (name, s) in enumerate(series.items()):
        ax.plot(s["tokens_scheduled"], s["blocks_held"], label=name, color=f"C{i}", lw=1)
    ax.axhline(num_blocks - 1, color="grey", ls=":", label="pool size")
    ax.set_xlabel("tokens scheduled (time ->)")
    ax.set_ylabel("blocks held")
    ax.legend()
    ax.set_title("KV blocks held while replaying the trace: full attention vs sliding window")
    return report.save_figure(fig, out, "kvcache")
