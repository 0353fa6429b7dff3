"""The main job (`nox -s demo`): the embedded SmolLM2-135M-Instruct answers a few chat prompts; the
same model is calibrated into a SwiftKV model at L = N/2 (`swiftkv_distill`: the teacher answers
built-in prompts, the SwiftKV K/V projections are fitted in closed form; cached under the user cache
directory, so only the first run pays for it) and answers the same prompts, with its held-out
agreement; then one long-prompt batch runs with SwiftKV off (L = N) and on, side by side."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from bench import engine, report
from bench.harness import Stats, paired_ratio, run_interleaved

log = logging.getLogger(__name__)

HELP = "chat answers from the embedded model, then SwiftKV off vs on on one long-prompt batch"
QUESTIONS = [
    "What is the capital of France?",
    "Name the three primary colors.",
    "Write one sentence about the sea.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, help="prompts in the batch (default 8; quick 4)")
    parser.add_argument("--prompt-len", type=int, help="tokens per prompt (default 1024; quick 256)")
    parser.add_argument("--output-len", type=int, help="output tokens per prompt (default 32; quick 8)")
    parser.add_argument("--num-key-value-layers", type=int, help="SwiftKV L for the 'on' run (default N/2)")


def run(args: argparse.Namespace) -> int:
    quick = args.quick
    num_prompts = args.num_prompts or (4 if quick else 8)
    prompt_len = args.prompt_len or (256 if quick else 1024)
    output_len = args.output_len or (8 if quick else 32)
    repeat = args.repeat or 1
    warmup = 1 if args.warmup is None else args.warmup

    print("== 1. Chat with the fast engine (embedded SmolLM2-135M-Instruct, greedy, SwiftKV off) ==")
    off = engine.build_llm(None)
    n_layers = off.config.num_hidden_layers
    on_layers = args.num_key_value_layers or n_layers // 2
    answers = chat(off, QUESTIONS)

    print(f"\n== 2. Calibrate SwiftKV at L={on_layers} of {n_layers} (swiftkv_distill, cached) ==")
    student_dir, cached, agreement = calibrated_student(on_layers, args.seed)
    print(
        f"{'reused' if cached else 'made'} {student_dir}\n"
        f"held-out agreement with the original model (teacher-forced at its answer tokens): "
        f"top-1 {agreement.top1_agreement:.3f}, KL {agreement.kl:.3f}; identical first "
        f"{agreement.greedy_tokens} greedy tokens on {agreement.greedy_agreement:.0%} of "
        f"{agreement.num_greedy_prompts} held-out prompts"
    )
    on = engine.build_llm(None, model=str(student_dir))
    print(f"\n== 3. The same chat from the SwiftKV model (L={on_layers}) ==")
    swiftkv_answers = chat(on, QUESTIONS)
    paris = "Paris" in swiftkv_answers[0]
    if not paris:
        print("!! expected 'Paris' in the SwiftKV model's first answer")

    print(
        f"\n== 4. One batch of {num_prompts} prompts x {prompt_len} tokens, {output_len} output tokens: "
        f"SwiftKV off (L={n_layers}) vs on (L={on_layers}) =="
    )
    prompts = engine.random_prompts(num_prompts, prompt_len, off.config.vocab_size, seed=args.seed)
    small = prompts[:1]
    llms = {"off": off, "on": on}
    cases, warm = {}, {}
    for phase, max_tokens in (("prefill", 1), ("generate", output_len)):
        for mode, llm in llms.items():
            cases[f"{mode}/{phase}"] = _case(llm, prompts, max_tokens)
            warm[f"{mode}/{phase}"] = _case(llm, [p[:64] for p in small], 2)
    samples = run_interleaved(cases, repeat=repeat, warmup=warmup, warmup_cases=warm, progress=True)

    rows, tput = [], {}
    for mode, llm in llms.items():
        pre, gen = samples[f"{mode}/prefill"], samples[f"{mode}/generate"]
        tput[mode] = {
            "prefill": [s.metrics["prompt_tokens"] / s.seconds for s in pre],
            "output": [s.metrics["output_tokens"] / s.seconds for s in gen],
        }
        alloc = engine.kv_allocation(llm)
        rows.append(
            {
                "mode": mode,
                "num_key_value_layers": llm.config.num_key_value_layers,
                "prefill_tokens_per_second": Stats.of(tput[mode]["prefill"]),
                "output_tokens_per_second": Stats.of(tput[mode]["output"]),
                "kv_cache_bytes_per_token": alloc["bytes_per_token"],
                "kv_allocation": alloc,
            }
        )
    speedup = {
        "prefill": paired_ratio(tput["on"]["prefill"], tput["off"]["prefill"]),
        "output": paired_ratio(tput["on"]["output"], tput["off"]["output"]),
        "kv_bytes": rows[1]["kv_cache_bytes_per_token"] / rows[0]["kv_cache_bytes_per_token"],
    }

    table = report.Table(
        f"SwiftKV off vs on: SmolLM2-135M-Instruct, fp32, {num_prompts} x {prompt_len}-token prompts, "
        f"{output_len} output tokens, {repeat} round(s)",
        ["", "prefill tok/s", "output tok/s", "KV cache bytes/token"],
    )
    for row in rows:
        table.add(
            f"{row['mode']} (L={row['num_key_value_layers']})",
            row["prefill_tokens_per_second"],
            row["output_tokens_per_second"],
            row["kv_cache_bytes_per_token"],
        )
    table.add(
        "on / off",
        f"{speedup['prefill'].median:.2f}x",
        f"{speedup['output'].median:.2f}x",
        f"{speedup['kv_bytes']:.2f}x",
    )
    table.notes += [
        "prefill tok/s: prompt tokens / wall time of generate(max_tokens=1); output tok/s: output tokens / "
        "wall time of the whole generate call (vLLM's output_tokens_per_second). Values: median [min-max].",
        "SwiftKV (G=1) saves prefill compute, not KV memory: every layer keeps its cache. AcrossKV (G>1) "
        "shares it: see `python -m bench memory`.",
    ]
    settings = {
        "num_prompts": num_prompts,
        "prompt_len": prompt_len,
        "output_len": output_len,
        "num_hidden_layers": n_layers,
        "num_key_value_layers": on_layers,
        "repeat": repeat,
        "warmup": warmup,
        "dtype": "float32",
        "seed": args.seed,
    }
    out: Path = args.out
    json_path = report.write_json(
        out,
        "demo",
        settings,
        rows,
        speedup=speedup,
        chat=[
            {"question": q, "answer": a, "swiftkv_answer": b}
            for q, a, b in zip(QUESTIONS, answers, swiftkv_answers)
        ],
        student=str(student_dir),
        agreement=agreement.to_dict(),
        paris=paris,
        samples=samples,
    )
    png_path = plot(rows, out)
    report.finish([table], [json_path, png_path])
    return 0 if paris else 1


# The demo's calibration: sized so the first run (the teacher answers, the fit, the evaluation) takes a
# few minutes on 2 cores; `swiftkv distill --help` has the full-size settings.
DEMO_DISTILL = dict(num_samples=96, max_tokens=128, batch_tokens=2048, greedy_tokens=32)


def calibrated_student(num_key_value_layers: int, seed: int):
    """-> (directory, reused from the cache, its held-out EvalResult)."""
    from swiftkv_distill.pipeline import DistillSettings, cached_student
    from swiftkv_distill.report import read_json

    settings = DistillSettings(num_key_value_layers=num_key_value_layers, seed=seed, **DEMO_DISTILL)
    path, cached = cached_student(None, settings)
    (agreement,) = read_json(path / "eval.json").values()
    return path, cached, agreement


def chat(llm, questions: list[str]) -> list[str]:
    outs = llm.chat(
        [[{"role": "user", "content": q}] for q in questions],
        engine.greedy(48, ignore_eos=False),
        use_tqdm=True,
    )
    answers = [o.outputs[0].text.strip() for o in outs]
    for q, a in zip(questions, answers):
        print(f"\n> {q}\n{a}")
    return answers


def _case(llm, prompts, max_tokens):
    def call():
        return engine.run_batch(llm, prompts, max_tokens).metrics()

    return call


@report.optional_plot
def plot(rows: list[dict], out: Path) -> Path:
    fig, axes = report.new_figure(ncols=3, width=3.6)
    labels = [f"{r['mode']}\nL={r['num_key_value_layers']}" for r in rows]
    for ax, key, title in zip(
        axes,
        ["prefill_tokens_per_second", "output_tokens_per_second"],
        ["prefill tokens/s", "output tokens/s"],
    ):
        report.bars(ax, labels, [r[key] for r in rows])
        ax.set_title(title)
    axes[2].bar(labels, [r["kv_cache_bytes_per_token"] for r in rows], color=["C0", "C1"])
    axes[2].set_title("KV cache bytes / token")
    fig.suptitle("SwiftKV off vs on (SmolLM2-135M-Instruct, fp32)")
    return report.save_figure(fig, out, "demo")
