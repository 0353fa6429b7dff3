"""vLLM's own engine with and without the SwiftKV plugin, beside our engine, on the embedded model.

Systems, each in a process of its own, in fp32 and bf16:

  vllm              plain vLLM on the embedded SmolLM2-135M-Instruct (L = N = 30), compiled (its default)
  vllm-swiftkv      vLLM with `swiftkv_vllm` on the demo's calibrated student (L = 15),
                    `kv_sharing_fast_prefill` on (layers >= L run only the sampled tokens)
  ours-off, ours-on our engine on the same two checkpoints

On each of `bench throughput`'s mixes: prefill tokens/s (every request with max_tokens = 1), output
tokens/s and mean TTFT of the whole mix (greedy, EOS ignored), median over the rounds after a warm-up;
start-up (and vLLM's compilation) is reported apart, not counted. vLLM runs with the CPU settings of
`../shared/anchors/vllm-plugin-facts.md`: its KV space fixed, its OpenMP threads on every core, no
reserved core, the engine core in the benchmark's process, and Intel's OpenMP preloaded where its venv
has it (what vLLM's CPU install guide asks for; tcmalloc too where the system has it). Its processes
need vLLM's CPU build: by default the interpreter of the `vllm` nox session's venv (`--vllm-python`).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench import report
from bench.throughput import MIXES, QUICK_MIXES, mix_prompts

log = logging.getLogger(__name__)

HELP = "vLLM's engine with / without the SwiftKV plugin vs ours: prefill and output tok/s, TTFT"
ROOT = Path(__file__).resolve().parents[1]
SYSTEMS = ("vllm", "vllm-swiftkv", "ours-off", "ours-on")
DTYPES = ("float32", "bfloat16")
STUDENT_LAYERS = 15
VLLM_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "4",
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_LOGGING_LEVEL": "WARNING",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    split = lambda s: s.split(",")  # noqa: E731
    parser.add_argument("--systems", type=split, default=list(SYSTEMS), help=f"from {SYSTEMS}")
    parser.add_argument("--dtypes", type=split, default=list(DTYPES), help=f"comma-separated, from {DTYPES}")
    parser.add_argument("--mixes", type=split, help=f"comma-separated, from {list(MIXES)}")
    parser.add_argument(
        "--vllm-python",
        type=Path,
        default=ROOT / ".nox" / "vllm" / "bin" / "python",
        help="a Python with vLLM's CPU build and swiftkv-vllm (default: the `vllm` nox session's venv)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: one system in this process
    parser.add_argument("--worker-dtype", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    table_of = QUICK_MIXES if args.quick else MIXES
    mixes = args.mixes or list(table_of)
    repeat = args.repeat or 3
    warmup = 1 if args.warmup is None else args.warmup
    python = args.vllm_python if args.vllm_python.exists() else Path(sys.executable)
    results = []
    for dtype in args.dtypes:
        for system in args.systems:
            log.info("%s in %s: a process of its own (%s)", system, dtype, python)
            results.append(_spawn(python, system, dtype, mixes, repeat, warmup, args))
    rows = _rows(results, mixes)
    tables = [_table(dtype, [r for r in rows if r["dtype"] == dtype]) for dtype in args.dtypes]
    settings = dict(mixes={m: table_of[m] for m in mixes}, repeat=repeat, warmup=warmup, vllm_env=VLLM_ENV,
                    student_layers=STUDENT_LAYERS)
    json_path = report.write_json(args.out, "vllm", settings, rows, startup=[
        {k: r[k] for k in ("system", "dtype", "startup_s")} for r in results])
    report.finish(tables, [json_path, _plot(rows, args.out)])
    return 0


def _spawn(python: Path, system: str, dtype: str, mixes: list[str], repeat: int, warmup: int, args) -> dict:
    out = args.out / f"vllm-{system}-{dtype}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    command = [
        str(python), "-m", "bench", "vllm", "--worker", system, "--worker-dtype", dtype,
        "--worker-out", str(out), "--mixes", ",".join(mixes), "--repeat", str(repeat),
        "--warmup", str(warmup), "--seed", str(args.seed),
    ] + (["--quick"] if args.quick else [])  # fmt: skip
    env = os.environ | VLLM_ENV | {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if system.startswith("vllm") and (preload := _vllm_preload(python)):
        env["LD_PRELOAD"] = ":".join(filter(None, [*preload, os.environ.get("LD_PRELOAD")]))
    subprocess.run(command, check=True, cwd=ROOT, env=env)
    return json.loads(out.read_text())


def _vllm_preload(python: Path) -> list[str]:
    """The libraries vLLM's CPU guide preloads: tcmalloc (from the system) and Intel's OpenMP (from the
    venv, where vLLM's CPU wheel installs it), each where present."""
    libs = Path("/usr/lib/x86_64-linux-gnu")
    tcmalloc = sorted(libs.glob("libtcmalloc_minimal.so*")) + sorted(libs.glob("libtcmalloc.so*"))
    iomp = python.parent.parent / "lib" / "libiomp5.so"
    return [str(p) for p in tcmalloc[:1]] + ([str(iomp)] if iomp.exists() else [])


def _worker(args: argparse.Namespace) -> int:
    """One system, one dtype, every mix: build once, then warm-up and timed rounds per mix."""
    system, dtype = args.worker, args.worker_dtype
    table_of = QUICK_MIXES if args.quick else MIXES
    started = time.perf_counter()
    runner = _runner(system, dtype)
    startup = time.perf_counter() - started
    mixes = {}
    for name in args.mixes:
        prompts, output_len = mix_prompts(table_of[name], 49152, args.seed)
        for _ in range(args.warmup):
            runner(prompts, 1)
            runner(prompts, output_len)
        rounds = []
        for _ in range(args.repeat):
            prefill_s, _ = runner(prompts, 1)
            wall_s, ttfts = runner(prompts, output_len)
            rounds.append(dict(
                prefill_tok_s=sum(map(len, prompts)) / prefill_s,
                output_tok_s=len(prompts) * output_len / wall_s,
                ttft_ms=1000 * statistics.mean(ttfts),
            ))  # fmt: skip
        mixes[name] = rounds
    args.worker_out.write_text(json.dumps(dict(system=system, dtype=dtype, startup_s=startup, mixes=mixes)))
    return 0


def _checkpoint(system: str) -> str:
    from swiftkv_reference.default_model import default_model_dir

    if system in ("vllm", "ours-off"):
        return str(default_model_dir())
    sys.path.insert(0, str(ROOT))
    from bench.demo import calibrated_student

    path, _, _ = calibrated_student(STUDENT_LAYERS, seed=0)
    return str(path)


def _runner(system: str, dtype: str):
    """A function (prompts, max_tokens) -> (wall seconds, per-request TTFT seconds), greedy."""
    path = _checkpoint(system)
    if system.startswith("vllm"):
        from vllm import LLM, SamplingParams

        llm = LLM(
            path, dtype=dtype, max_model_len=2048, seed=0, disable_log_stats=False,
            kv_sharing_fast_prefill=system == "vllm-swiftkv", enable_prefix_caching=False,
        )  # fmt: skip

        def run_vllm(prompts, max_tokens):
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            wall = time.perf_counter() - start
            return wall, [o.metrics.first_token_latency if o.metrics else wall for o in outs]

        return run_vllm
    from bench import engine

    llm = engine.build_llm(model=path, dtype=dtype)

    def run_ours(prompts, max_tokens):
        start = time.perf_counter()
        outs = llm.generate(prompts, engine.greedy(max_tokens), use_tqdm=False)
        wall = time.perf_counter() - start
        return wall, [o.outputs[0].metrics.ttft or wall for o in outs]

    return run_ours


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
            [r["mix"], r["system"], r["prefill_tok_s"], r.get("prefill_x_vllm"), r["output_tok_s"],
             r.get("output_x_vllm"), r["ttft_ms"], r["startup_s"]]
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
