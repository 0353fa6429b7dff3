"""Prefill throughput of the embedded model at SwiftKV L = N (off), 3N/4 and N/2, for prompt lengths
256-4,096: tokens/s, the ratio to L = N (round by round), and the FLOP-count limit of that ratio
(`bench.flops`). Each case is one batch of prompts of one length, generate(max_tokens=1), in fp32 or
(`--dtype bfloat16`) in bf16 (on a CPU without bf16 units, bf16 weights and KV cache multiplied in
fp32: EngineConfig.compute_dtype)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from bench import engine, flops, report
from bench.harness import Stats, paired_ratio, run_interleaved

log = logging.getLogger(__name__)

HELP = "prefill tokens/s vs prompt length at L = N, 3N/4, N/2, beside the FLOP limit"
LENGTHS = [256, 512, 1024, 2048, 4096]
QUICK_LENGTHS = [128, 512]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--lengths",
        type=lambda s: [int(x) for x in s.split(",")],
        help=f"prompt lengths, comma-separated (default {LENGTHS}; quick {QUICK_LENGTHS})",
    )
    parser.add_argument(
        "--layers",
        type=lambda s: [int(x) for x in s.split(",")],
        help="SwiftKV L values, comma-separated (default N, 3N/4, N/2)",
    )
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the engines' dtype (EngineConfig.dtype: weights and KV cache; default float32)",
    )
    parser.add_argument(
        "--tokens-per-batch",
        type=int,
        help="prompt tokens per timed batch: len // this many prompts (default 8192; quick 1024)",
    )


def run(args: argparse.Namespace) -> int:
    lengths = args.lengths or (QUICK_LENGTHS if args.quick else LENGTHS)
    per_batch = args.tokens_per_batch or (1024 if args.quick else 8192)
    repeat = args.repeat or 3
    warmup = (0 if args.quick else 1) if args.warmup is None else args.warmup

    base = engine.build_llm(None, dtype=args.dtype)
    cfg = base.config
    n_layers = cfg.num_hidden_layers
    layers = args.layers or sorted({n_layers, 3 * n_layers // 4, n_layers // 2}, reverse=True)
    llms = {L: base if L == n_layers else engine.build_llm(L, dtype=args.dtype) for L in layers}
    log.info("warming up the engines")
    for llm in llms.values():
        engine.run_batch(llm, engine.random_prompts(1, 64, cfg.vocab_size, seed=args.seed), 1)

    rows = []
    for length in lengths:
        prompts = engine.random_prompts(max(1, per_batch // length), length, cfg.vocab_size, seed=args.seed)
        cases = {L: _case(llm, prompts) for L, llm in llms.items()}
        print(f"prompt length {length}: {len(prompts)} prompts, L in {layers}")
        samples = run_interleaved(cases, repeat=repeat, warmup=warmup, progress=True)
        tps = {L: [s.metrics["prompt_tokens"] / s.seconds for s in samples[L]] for L in layers}
        for L in layers:
            rows.append(
                {
                    "prompt_len": length,
                    "num_prompts": len(prompts),
                    "num_key_value_layers": L,
                    "prefill_tokens_per_second": Stats.of(tps[L]),
                    "ratio_to_full": paired_ratio(tps[L], tps[layers[0]]),
                    "flop_limit": flops.speedup_limit(cfg, length, L)
                    / flops.speedup_limit(cfg, length, layers[0]),
                    "seconds": [s.seconds for s in samples[L]],
                }
            )

    table = report.Table(
        f"Prefill, SmolLM2-135M-Instruct {_short(args.dtype)} (N={n_layers}), ~{per_batch} prompt tokens "
        f"per batch, {repeat} round(s)",
        ["prompt len", "prompts", "L", "prefill tok/s", f"x L={layers[0]}", "FLOP limit", "of limit"],
    )
    for r in rows:
        ratio = r["ratio_to_full"]
        table.add(
            r["prompt_len"],
            r["num_prompts"],
            r["num_key_value_layers"],
            r["prefill_tokens_per_second"],
            f"{ratio.median:.2f}x",
            f"{r['flop_limit']:.2f}x",
            f"{100 * ratio.median / r['flop_limit']:.0f}%",
        )
    table.notes.append("FLOP limit: matmul FLOPs of L = N over those of L (formula in bench/flops.py).")
    settings = {
        "lengths": lengths,
        "layers": layers,
        "tokens_per_batch": per_batch,
        "repeat": repeat,
        "warmup": warmup,
        "num_hidden_layers": n_layers,
        "dtype": args.dtype,
        "seed": args.seed,
    }
    json_path = report.write_json(args.out, "prefill", settings, rows)
    png_path = plot(rows, layers, args.out, _short(args.dtype))
    report.finish([table], [json_path, png_path])
    return 0


def _short(dtype: str) -> str:
    return {"float32": "fp32", "bfloat16": "bf16"}[dtype]


def _case(llm, prompts):
    def call():
        return engine.run_batch(llm, prompts, 1).metrics()

    return call


@report.optional_plot
def plot(rows: list[dict], layers: list[int], out: Path, dtype: str = "fp32") -> Path:
    fig, (ax_tps, ax_ratio) = report.new_figure(ncols=2)
    for i, L in enumerate(layers):
        mine = [r for r in rows if r["num_key_value_layers"] == L]
        xs = [r["prompt_len"] for r in mine]
        report.errorbar(ax_tps, xs, [r["prefill_tokens_per_second"] for r in mine], f"L={L}", color=f"C{i}")
        report.errorbar(ax_ratio, xs, [r["ratio_to_full"] for r in mine], f"L={L} measured", color=f"C{i}")
        ax_ratio.plot(xs, [r["flop_limit"] for r in mine], "--", color=f"C{i}", label=f"L={L} FLOP limit")
    for ax in (ax_tps, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (tokens)")
        ax.legend(fontsize=8)
    ax_tps.set_ylabel("prefill tokens/s")
    ax_ratio.set_ylabel(f"speedup over L={layers[0]}")
    fig.suptitle(f"SwiftKV prefill throughput (SmolLM2-135M-Instruct, {dtype})")
    return report.save_figure(fig, out, "prefill")
