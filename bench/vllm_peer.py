"""vLLM's own engine with and without the SwiftKV plugin, beside our engine, on the embedded model.

Systems, each in a process of its own, in fp32 and bf16:

  vllm              plain vLLM on the embedded SmolLM2-135M-Instruct (L = N = 30), compiled (its default)
  vllm-swiftkv      vLLM with `swiftkv_vllm` on the demo's calibrated student (L = 15),
                    `kv_sharing_fast_prefill` on (layers >= L run only the sampled tokens)
  ours-off, ours-on our engine on the same two checkpoints

On each of `bench throughput`'s mixes: prefill tokens/s (every request with max_tokens = 1), output
tokens/s and mean TTFT of the whole mix (greedy, EOS ignored), median over the rounds after a warm-up;
start-up (and vLLM's compilation) is reported apart, not counted. The processes are bench/vllm_worker.py's,
with its CPU settings: vLLM's KV space fixed, no reserved core, the engine core in the worker's process,
Intel's OpenMP (and tcmalloc) preloaded where present, one OpenMP thread bound to each core torch uses
here (`--threads`). They need vLLM's CPU build: by default the interpreter of the `vllm` nox session's
venv, else this one (`--vllm-python`).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from pathlib import Path
from typing import Any

from bench import report, vllm_worker
from bench.throughput import MIXES, QUICK_MIXES, mix_prompts

log = logging.getLogger(__name__)

HELP = "vLLM's engine with / without the SwiftKV plugin vs ours: prefill and output tok/s, TTFT"
SYSTEMS = ("vllm", "vllm-swiftkv", "ours-off", "ours-on")
DTYPES = ("float32", "bfloat16")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    split = lambda s: s.split(",")  # noqa: E731
    parser.add_argument("--systems", type=split, default=list(SYSTEMS), help=f"from {SYSTEMS}")
    parser.add_argument("--dtypes", type=split, default=list(DTYPES), help=f"comma-separated, from {DTYPES}")
    parser.add_argument("--mixes", type=split, help=f"comma-separated, from {list(MIXES)}")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=vllm_worker.DEFAULT_PYTHON,
        help="a Python with vLLM's CPU build and swiftkv-vllm (default: the `vllm` nox session's venv)",
    )


def run(args: argparse.Namespace) -> int:
    table_of = QUICK_MIXES if args.quick else MIXES
    mixes = args.mixes or list(table_of)
    repeat = args.repeat or 3
    warmup = 1 if args.warmup is None else args.warmup
    python = args.vllm_python if args.vllm_python.exists() else Path(sys.executable)
    cores = vllm_worker.torch_cores()
    vocab_size = _vocab_size()
    plans = {m: mix_prompts(table_of[m], vocab_size, args.seed) for m in mixes}
    # every round (and warm-up) of a mix: all its requests with max_tokens = 1, then the whole mix
    rounds = {m: ([(p, 1), (p, n)], [(p, 1), (p, n)]) for m, (p, n) in plans.items()}
    results = []
    for dtype in args.dtypes:
        for system in args.systems:
            calls = vllm_worker.schedule(rounds, warmup, repeat)
            result = vllm_worker.spawn(python, system, dtype, calls, cores)
            results.append(rounds_of(result, rounds, warmup, repeat))
    rows = _rows(results, mixes)
    tables = [_table(dtype, [r for r in rows if r["dtype"] == dtype]) for dtype in args.dtypes]
    settings = dict(mixes={m: table_of[m] for m in mixes}, repeat=repeat, warmup=warmup, cores=cores,
                    worker_env=vllm_worker.worker_env(python, "vllm", cores),
                    student_layers=vllm_worker.STUDENT_LAYERS)  # fmt: skip
    json_path = report.write_json(args.out, "vllm", settings, rows, startup=[
        {k: r[k] for k in ("system", "dtype", "startup_s", "compile_s")} for r in results])  # fmt: skip
    report.finish(tables, [json_path, _plot(rows, args.out)])
    return 0


def _vocab_size() -> int:
    from swiftkv_reference.default_model import default_model_dir

    return json.loads((default_model_dir() / "config.json").read_text())["vocab_size"]


def rounds_of(result: dict, rounds: dict[str, tuple], warmup: int, repeat: int) -> dict[str, Any]:
    """A worker's result as each mix's timed rounds: prefill tok/s, output tok/s, mean TTFT."""
    mixes = {
        mix: [
            dict(
                prefill_tok_s=prefill["prompt_tokens"] / prefill["seconds"],
                output_tok_s=full["output_tokens"] / full["seconds"],
                ttft_ms=1000 * statistics.mean(full["ttft_s"] or [full["seconds"]]),
            )
            for prefill, full in timed
        ]
        for mix, timed in vllm_worker.timed_rounds(result, rounds, warmup, repeat).items()
    }
    return {k: result[k] for k in ("system", "dtype", "startup_s", "compile_s")} | {"mixes": mixes}


def _rows(results: list[dict], mixes: list[str]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        for mix in mixes:
            rounds = r["mixes"][mix]
            row = dict(system=r["system"], dtype=r["dtype"], mix=mix, startup_s=r["startup_s"], rounds=rounds)
            for key in ("prefill_tok_s", "output_tok_s", "ttft_ms"):
                row[key] = statistics.median(x[key] for x in rounds)
            rows.append(row)
    by = {(r["system"], r["dtype"], r["mix"]): r for r in rows}
    for row in rows:  # ratios against plain vLLM at the same precision, on medians
        base = by.get(("vllm", row["dtype"], row["mix"]))
        if base:
            row["prefill_x_vllm"] = row["prefill_tok_s"] / base["prefill_tok_s"]
            row["output_x_vllm"] = row["output_tok_s"] / base["output_tok_s"]
    return rows


def _table(dtype: str, rows: list[dict]) -> report.Table:
    return report.Table(
        title=f"vLLM with and without the SwiftKV plugin vs ours, {dtype} (medians; x vllm at {dtype})",
        columns=["mix", "system", "prefill tok/s", "x vllm", "output tok/s", "x vllm", "TTFT ms", "start s"],
        rows=[
            [
                r["mix"],
                r["system"],
                r["prefill_tok_s"],
                r.get("prefill_x_vllm"),
                r["output_tok_s"],
                r.get("output_x_vllm"),
                r["ttft_ms"],
                r["startup_s"],
            ]
            for r in rows
        ],  # fmt: skip
    )


@report.optional_plot
def _plot(rows: list[dict], out: Path) -> Path:
    mixes = sorted({r["mix"] for r in rows})
    fig, axes = report.new_figure(ncols=len(mixes), width=4.5)
    for ax, mix in zip(axes, mixes):
        sel = [r for r in rows if r["mix"] == mix]
        labels = [f"{r['system']}\n{'bf16' if r['dtype'] == 'bfloat16' else 'fp32'}" for r in sel]
        ax.bar(range(len(sel)), [r["output_tok_s"] for r in sel])
        ax.set_xticks(range(len(sel)), labels, rotation=60, fontsize=7)
        ax.set_title(mix)
        ax.set_ylabel("output tokens/s")
    return report.save_figure(fig, out, "vllm")
