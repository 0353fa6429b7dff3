"""Tensor parallelism (`tensor_parallel_size` N = 1, 2, 3): KV memory per rank, and the step time.

KV memory (nothing timed): each model is built at every N with the same cache budget per rank
(`--cache-mib`, the engine's kv_cache_memory) and rank 0's kv_cache tensor is read (every rank holds as
many blocks): bytes per token per rank = nbytes / (blocks x block_size), beside `bench.memory`'s formula
at the rank's K/V heads, kv_heads / N (1 when N > kv_heads: each head replicated on N / kv_heads ranks).
So a rank's bytes per token are 1/N of N = 1's, the budget holds N times the blocks, and max concurrency
((blocks - 1 null block) / blocks per request) grows N-fold. An N that the model's heads, intermediate
size or vocab cannot be split by is shown as refused, with the engine's message.

Step time: the step model is built at every N side by side and timed in interleaved rounds (N = 1, 2,
3, 1, 2, 3, ...). A round drives one batch through `LLMEngine.step` and times every step: a decode step
(every unfinished request past its prompt) or a mixed one (a prefill chunk, beside running decodes once
the first prompts finish; the token budget is half the batch's prompt tokens). Ratios to N = 1 are taken
round by round: > 1 is slower.

CPU: rank 0 is this process; every rank runs the model with torch.get_num_threads() // N threads (at
least 1; rank 0 restores its count after each step), so the ranks share the cores, and gloo
all-reduces twice per layer (after o_proj and down_proj) and all-gathers the logits. N > 1 is not
expected to be faster on a small CPU: the figure is there to catch a regression. CUDA (bf16): rank r on
cuda:r over NCCL; an N above torch.cuda.device_count() is skipped, saying so.

Models (`--models`, KV figures; `--step-model`, step time):
  smollm2        the embedded SmolLM2-135M-Instruct: 9 heads, 3 K/V heads, so N = 2 is refused
  smollm2-split  SmolLM2-135M's shapes with 12 heads and 6 K/V heads of 48 (random weights): N = 1, 2, 3
  tiny           swiftkv_reference.testing.tiny_config with 6 heads, 6 K/V heads, vocab 192 (random
                 weights): N = 1, 2, 3
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import statistics
import time
from pathlib import Path

from bench import engine, memory, report
from bench.harness import Stats, paired_ratio, run_interleaved

log = logging.getLogger(__name__)

HELP = "tensor parallelism: KV bytes, blocks, max concurrency per rank and step time at N = 1, 2, 3"
MODELS = ("smollm2", "smollm2-split", "tiny")
# (prompts, prompt tokens, output tokens)
WORKLOAD = (8, 256, 32)
QUICK_WORKLOAD = (4, 32, 8)


def _csv(kind):
    return lambda s: [kind(x) for x in s.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=_csv(int), default=[1, 2, 3], help="N values (default 1,2,3)")
    parser.add_argument(
        "--models",
        type=_csv(str),
        help=f"models of the KV figures, from {', '.join(MODELS)} (default smollm2,smollm2-split; "
        "quick smollm2,tiny)",
    )
    parser.add_argument(
        "--step-model",
        choices=[*MODELS, "none"],
        help="the model timed (default smollm2-split; quick tiny; none: no timing)",
    )
    parser.add_argument("--cache-mib", type=int, default=256, help="KV cache per rank in MiB (default 256)")
    parser.add_argument("--request-len", type=int, default=2048, help="tokens per request (default 2048)")
    parser.add_argument(
        "--workload",
        type=_csv(int),
        help=f"timed batch: prompts,prompt tokens,output tokens (default {WORKLOAD}; quick {QUICK_WORKLOAD})",
    )


def load_model(name: str, dtype) -> tuple:
    """-> (config, state_dict); state_dict None for the embedded model (workers read its checkpoint)."""
    from swiftkv_reference.checkpoint import load_config
    from swiftkv_reference.default_model import default_model_dir
    from swiftkv_reference.testing import random_state_dict, tiny_config

    if name == "smollm2":
        return load_config(default_model_dir()), None
    if name == "smollm2-split":
        config = dataclasses.replace(
            load_config(default_model_dir()), num_attention_heads=12, num_key_value_heads=6, head_dim=48
        )
    elif name == "tiny":
        config = tiny_config(
            num_attention_heads=6, num_key_value_heads=6, vocab_size=192, max_position_embeddings=8192
        )
    else:
        raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")
    return config, random_state_dict(config, dtype=dtype)


def run(args: argparse.Namespace) -> int:
    import torch

    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    models = args.models or (["smollm2", "tiny"] if args.quick else ["smollm2", "smollm2-split"])
    step_model = args.step_model or ("tiny" if args.quick else "smollm2-split")
    workload = tuple(args.workload or (QUICK_WORKLOAD if args.quick else WORKLOAD))
    repeat = args.repeat or 3
    warmup = 1 if args.warmup is None else args.warmup
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise SystemExit(f"bench tp: unknown --models {unknown}: choose from {', '.join(MODELS)}")
    if 1 not in args.sizes or min(args.sizes) < 1:
        raise SystemExit(f"bench tp: --sizes must be positive and include 1 (the baseline), got {args.sizes}")
    if len(workload) != 3 or min(workload) < 1:
        raise SystemExit(f"bench tp: --workload is prompts,prompt tokens,output tokens, got {workload}")
    build_kw = dict(device=device, dtype=dtype, max_num_batched_tokens=max(1, workload[0] * workload[1] // 2))

    kv_rows, timed = [], {}  # timed: {N: the step model's engine}, kept up for the timing
    try:
        for name in dict.fromkeys([*models, *([step_model] if step_model != "none" else [])]):
            mine = _kv_rows(name, args, build_kw, timed if name == step_model else None)
            kv_rows += mine if name in models else []
        _check_scaling(kv_rows)
        step_rows = _time_steps(timed, workload, repeat, warmup, args)
    finally:
        for llm in timed.values():
            llm.shutdown()

    tables = [_kv_table(kv_rows, args)]
    if step_rows:
        tables.append(
            _step_table(step_rows, step_model, workload, build_kw["max_num_batched_tokens"], repeat)
        )
    settings = {
        "sizes": args.sizes,
        "models": models,
        "step_model": step_model,
        "cache_mib": args.cache_mib,
        "request_len": args.request_len,
        "workload": dict(zip(("prompts", "prompt_len", "output_len"), workload)),
        "max_num_batched_tokens": build_kw["max_num_batched_tokens"],
        "repeat": repeat,
        "warmup": warmup,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        "rank0_threads": torch.get_num_threads(),
    }
    json_path = report.write_json(args.out, "tp", settings, kv_rows, step_time=step_rows)
    png_path = plot(kv_rows, step_rows, args.out)
    report.finish(tables, [json_path, png_path])
    return 0 if all(r.get("matches_formula", True) and r.get("scales", True) for r in kv_rows) else 1


def _kv_rows(name: str, args, build_kw: dict, keep: dict | None) -> list[dict]:
    """`memory.kv_row` of `name` at every N (refused or skipped rows say why); the engines go into
    `keep` ({N: llm}) when given, else are shut down."""
    import torch

    config, state = load_model(name, build_kw["dtype"])
    rows = []
    for n in args.sizes:
        row = {"model": name, "tensor_parallel_size": n}
        rows.append(row)
        if build_kw["device"] == "cuda" and n > torch.cuda.device_count():
            row["skipped"] = f"needs {n} CUDA devices, {torch.cuda.device_count()} here"
            continue
        llm, refused = memory.build(
            config, state, None, None, args.cache_mib << 20, args.request_len, n, **build_kw
        )
        if llm is None:
            row["refused"] = refused
            continue
        row.update(memory.kv_row(llm, n, args.request_len))
        if keep is not None:
            keep[n] = llm
        else:
            llm.shutdown()
    return rows


def _check_scaling(rows: list[dict]) -> None:
    """Each measured row against N = 1's of its model: `bytes_of_n1` (bytes per token per rank over
    N = 1's), `scales` (exactly the rank's share of the K/V heads: 1/N, or 1/kv_heads when replicated),
    `concurrency_x_n1`."""
    base = {r["model"]: r for r in rows if r["tensor_parallel_size"] == 1 and "bytes_per_token" in r}
    for r in rows:
        one = base.get(r["model"])
        if one is None or "bytes_per_token" not in r:
            continue
        heads = memory.kv_heads_per_rank(one["kv_heads"], r["tensor_parallel_size"])
        r["bytes_of_n1"] = r["bytes_per_token"] / one["bytes_per_token"]
        r["scales"] = r["bytes_per_token"] * one["kv_heads"] == one["bytes_per_token"] * heads
        r["concurrency_x_n1"] = r["max_concurrency"] / one["max_concurrency"]


def _steps(llm, prompts: list[list[int]], output_len: int) -> dict:
    """One batch through the engine step by step: the median decode step and mixed step, in ms."""
    eng = llm.llm_engine
    reqs = [eng.add_request(p, engine.greedy(output_len)) for p in prompts]
    decode, mixed = [], []
    while eng.has_unfinished_requests():
        is_decode = all(r.num_output_tokens > 0 for r in reqs if not r.is_finished)
        start = time.perf_counter()
        eng.step()
        (decode if is_decode else mixed).append(1e3 * (time.perf_counter() - start))
    return {
        "decode_step_ms": statistics.median(decode) if decode else float("nan"),
        "mixed_step_ms": statistics.median(mixed) if mixed else float("nan"),
        "decode_steps": len(decode),
        "mixed_steps": len(mixed),
    }


def _time_steps(timed: dict, workload: tuple, repeat: int, warmup: int, args) -> list[dict]:
    """Interleaved rounds over the engines of `timed` ({N: llm}); the warm-up runs the whole batch, or
    (quick) one prompt for two tokens."""
    if not timed:
        return []
    num_prompts, prompt_len, output_len = workload
    vocab = next(iter(timed.values())).config.vocab_size
    prompts = engine.random_prompts(num_prompts, prompt_len, vocab, seed=args.seed)
    cases = {n: (lambda llm=llm: _steps(llm, prompts, output_len)) for n, llm in timed.items()}
    stand_ins = {n: (lambda llm=llm: _steps(llm, prompts[:1], 2)) for n, llm in timed.items()}
    print(f"step time: N in {list(timed)}, {num_prompts} x {prompt_len} prompt tokens -> {output_len} tokens")
    samples = run_interleaved(
        cases, repeat=repeat, warmup=warmup, warmup_cases=stand_ins if args.quick else None, progress=True
    )
    rows = []
    for n, ss in samples.items():
        row = {"tensor_parallel_size": n, "seconds": [s.seconds for s in ss]}
        for key in ("decode_step_ms", "mixed_step_ms"):
            values = [s.metrics[key] for s in ss]
            row[key] = Stats.of(values)
            if 1 in samples:
                row[key.replace("_ms", "_x_n1")] = paired_ratio(values, [s.metrics[key] for s in samples[1]])
        row["decode_steps"], row["mixed_steps"] = ss[0].metrics["decode_steps"], ss[0].metrics["mixed_steps"]
        rows.append(row)
    return rows


def _kv_table(rows: list[dict], args) -> report.Table:
    table = report.Table(
        f"KV cache per rank: {args.cache_mib} MiB on each rank, {args.request_len}-token requests",
        [
            "model",
            "N",
            "K/V heads/rank",
            "bytes/token/rank",
            "formula",
            "of N=1",
            "blocks",
            "max concurrency",
            "x N=1",
        ],
    )
    for r in rows:
        if "bytes_per_token" not in r:
            what = "refused" if "refused" in r else "skipped"
            table.add(r["model"], r["tensor_parallel_size"], what, "-", "-", "-", "-", "-", "-")
            continue
        table.add(
            r["model"],
            r["tensor_parallel_size"],
            r["kv_heads"],
            r["bytes_per_token"],
            f"{r['formula_bytes_per_token']:,.0f}" + ("" if r["matches_formula"] else " (!)"),
            _fraction(r.get("bytes_of_n1")) + ("" if r.get("scales", True) else " (!)"),
            r["num_blocks"],
            f"{r['max_concurrency']:.2f}",
            f"{r['concurrency_x_n1']:.2f}x" if "concurrency_x_n1" in r else "-",
        )
    table.notes.append(
        "bytes/token/rank and blocks: rank 0's allocated kv_cache tensor (nbytes / (blocks x block_size)); "
        "formula: bench.memory's at kv_heads / N heads per rank; (!) marks a mismatch."
    )
    for r in rows:
        if "bytes_per_token" not in r:
            why = r.get("refused") or r["skipped"]
            table.notes.append(f"{r['model']} N={r['tensor_parallel_size']}: {why}")
    return table


def _fraction(x: float | None) -> str:
    if x is None:
        return "-"
    return "1" if x == 1 else f"1/{1 / x:.3g}"


def _step_table(rows, model, workload, token_budget, repeat) -> report.Table:
    num_prompts, prompt_len, output_len = workload
    table = report.Table(
        f"Step time, {model}, {num_prompts} x {prompt_len} prompt tokens -> {output_len} tokens, "
        f"token budget {token_budget}, {repeat} round(s), ms (median [min-max] of rounds)",
        ["N", "decode step ms", "x N=1", "mixed step ms", "x N=1", "decode/mixed steps"],
    )
    for r in rows:
        table.add(
            r["tensor_parallel_size"],
            r["decode_step_ms"],
            _ratio(r.get("decode_step_x_n1")),
            r["mixed_step_ms"],
            _ratio(r.get("mixed_step_x_n1")),
            f"{r['decode_steps']}/{r['mixed_steps']}",
        )
    table.notes.append(
        "x N=1: step time over N=1's, round by round (> 1: slower). Every rank runs with "
        "torch.get_num_threads() // N threads (at least 1), and gloo adds 2 all-reduces per layer: not "
        "expected to be faster on a small CPU."
    )
    return table


def _ratio(s: Stats | None) -> str:
    return "-" if s is None else f"{s.median:.2f}x"


@report.optional_plot
def plot(kv_rows: list[dict], step_rows: list[dict], out: Path) -> Path:
    fig, (ax_b, ax_s) = report.new_figure(ncols=2)
    for i, model in enumerate(dict.fromkeys(r["model"] for r in kv_rows)):
        mine = [r for r in kv_rows if r["model"] == model and "bytes_per_token" in r]
        xs = [r["tensor_parallel_size"] for r in mine]
        ax_b.plot(xs, [r["bytes_per_token"] for r in mine], "o-", color=f"C{i}", label=f"{model} allocated")
        ax_b.plot(xs, [r["formula_bytes_per_token"] for r in mine], "x--", color=f"C{i}", label="formula")
    ax_b.set_ylabel("KV bytes / token / rank")
    if step_rows:
        xs = [r["tensor_parallel_size"] for r in step_rows]
        report.errorbar(ax_s, xs, [r["decode_step_ms"] for r in step_rows], "decode step", color="C0")
        report.errorbar(ax_s, xs, [r["mixed_step_ms"] for r in step_rows], "mixed step", color="C1")
        ax_s.set_ylabel("ms per step (median, min-max of rounds)")
    sizes = sorted({r["tensor_parallel_size"] for r in kv_rows + step_rows})
    for ax in (ax_b, ax_s):
        ax.set_yscale("log")
        ax.set_xticks(sizes)
        ax.set_xlabel("tensor_parallel_size N")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("Tensor parallelism: KV memory per rank (same cache per rank) and step time")
    return report.save_figure(fig, out, "tp")
