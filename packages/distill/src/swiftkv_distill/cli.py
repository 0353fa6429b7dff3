"""`swiftkv distill` and `swiftkv eval` (also `python -m swiftkv_distill distill|eval ...`).

    swiftkv distill out/smollm2-swiftkv --num-key-value-layers 15             # the embedded model
    swiftkv distill path/to/llama out/llama-swiftkv --num-key-value-layers 16 --steps 300
    swiftkv eval path/to/llama out/llama-swiftkv

`swiftkv_fast.cli` hands these two commands to `main` here, so serving never imports training code.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .calibrate import DEFAULT_RIDGE, DEFAULT_WEIGHTING, WEIGHTINGS
from .data import DEFAULT_HOLDOUT_SHARE, DEFAULT_NUM_SAMPLES, DEFAULT_TEMPERATURE
from .precision import PRECISIONS

USER_ERRORS = (ValueError, OSError)
# what a student shares with its teacher (SwiftKVConfig fields; model_type differs by "_swiftkv")
ARCHITECTURE_FIELDS = (
    "family",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "attention_bias",
    "tie_word_embeddings",
    "layer_types",
    "sliding_window",
)


def _add_data_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument(
        "--data",
        type=Path,
        default=None,
        help='your own data, JSONL: one {"messages": [...]} (the last assistant message is the answer) or '
        '{"text": ...} per line; default: the teacher answers the built-in prompts itself',
    )
    g.add_argument(
        "--num-samples",
        type=int,
        default=DEFAULT_NUM_SAMPLES,
        help="teacher answers to generate (without --data). More answers fit better until the fit levels "
        "off (about 1,024 on the embedded model); what each count gives and costs: docs/distill.md",
    )
    g.add_argument("--max-tokens", type=int, default=256, help="longest teacher answer, in tokens")
    g.add_argument(
        "--temperature", type=float, default=DEFAULT_TEMPERATURE, help="the teacher's sampling temperature"
    )
    g.add_argument(
        "--holdout-share",
        type=float,
        default=DEFAULT_HOLDOUT_SHARE,
        help="share of the prompts kept for evaluation only (never calibrated or trained on)",
    )
    g.add_argument("--seed", type=int, default=0, help="seeds the teacher's sampling and the held-out split")
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="auto",
        help="the arithmetic of the teacher's and the student's passes. fp32; or bf16: the teacher writes "
        "its answers with bf16x3 products where the engine measures them faster (Intel AMX; about fp32's "
        "accuracy), calibration's pass runs under bf16 autocast with fp32 products for its statistics, and "
        "distillation under bf16 autocast over fp32 weights. auto: bf16 on CUDA; on CPU, bf16 when one "
        "decoder layer of the model runs at least 1.2x as fast in it (measured at start-up: CPUs with "
        "AVX512-BF16 or AMX; the same held-out agreement), else fp32. `eval` writes the held-out answers "
        "again: give it the precision `distill` ran in",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--greedy-tokens", type=int, default=32, help="greedy agreement over this many tokens per prompt"
    )


def build_parser(prog: str = "swiftkv") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Make and evaluate SwiftKV weights.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parsers(sub)
    return parser


def add_parsers(sub) -> None:
    d = sub.add_parser(
        "distill",
        help="make SwiftKV weights for a plain checkpoint (calibration, optional distillation)",
        usage="%(prog)s [MODEL] OUT --num-key-value-layers L [options]",
        description="Turn a plain Llama / Mistral / Qwen2 checkpoint into a SwiftKV checkpoint that answers "
        "like it. The teacher (the model itself) answers about 1,500 built-in prompts (or --data); the "
        "SwiftKV K/V projections are fitted to its own K/V in closed form (minutes on a CPU); --steps N "
        "adds Snowflake's distillation. A held-out share of the data is never trained on: the student is "
        "evaluated on it against the teacher, and the figures are written next to the checkpoint "
        "(eval.json, eval.png).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    d.add_argument(
        "paths",
        nargs="+",
        metavar="[MODEL] OUT",
        help="the plain checkpoint directory (omit it for the embedded SmolLM2-135M-Instruct) and the "
        "output directory",
    )
    d.add_argument(
        "--num-key-value-layers",
        "-L",
        type=int,
        required=True,
        metavar="L",
        help="layers >= L take their K/V from layer L's input; prefill of prompt tokens stops at L",
    )
    d.add_argument(
        "--key-value-group-size",
        "-G",
        type=int,
        default=1,
        metavar="G",
        help="AcrossKV: G consecutive layers >= L share one KV cache (G must divide N - L)",
    )
    t = d.add_argument_group("fit")
    t.add_argument("--batch-tokens", type=int, default=2048, help="tokens per calibration / training batch")
    t.add_argument(
        "--ridge", type=float, default=DEFAULT_RIDGE, help="ridge strength of the closed-form fit (relative)"
    )
    t.add_argument(
        "--weighting",
        choices=WEIGHTINGS,
        default=DEFAULT_WEIGHTING,
        help="calibration: fit what the answer tokens' attention reads (default: keys weighted by the "
        "attention they get, values through the attention output; see `swiftkv_distill.calibrate`) or "
        "every token's K/V alike (uniform: less memory for large models)",
    )
    t.add_argument(
        "--calibration-samples",
        type=int,
        default=None,
        metavar="N",
        help="calibrate on the first N training examples only (default: all of them). The fit levels off "
        "near 1,000 teacher answers while distillation keeps gaining from more (with --steps: e.g. "
        "--num-samples 2048 --calibration-samples 1024)",
    )
    t.add_argument("--steps", type=int, default=0, help="distillation steps after the calibration (0: none)")
    t.add_argument(
        "--lr",
        type=float,
        default=2e-4,
        help="distillation learning rate (AdamW, warm-up then cosine decay; Snowflake's default; "
        "docs/distill.md compares others)",
    )
    t.add_argument(
        "--logits-loss-temp",
        type=float,
        default=2.0,
        metavar="T",
        help="distillation: temperature of the KL to the teacher's logits (Snowflake's 2; 1 is the KL the "
        "evaluation reports)",
    )
    t.add_argument(
        "--hidden-loss-mult",
        type=float,
        default=1.0,
        metavar="W",
        help="distillation: weight of the MSE between the student's and the teacher's hidden state entering "
        "the last layer (Snowflake's 1; 0 trains on the KL alone, and then runs the layers >= L only where "
        "the KL is taken)",
    )
    t.add_argument("--checkpoint-dir", type=Path, default=None, help="where distillation checkpoints go")
    t.add_argument("--resume", action="store_true", help="continue distillation from --checkpoint-dir")
    d.add_argument("--overwrite", action="store_true", help="replace OUT if it already holds a checkpoint")
    _add_data_flags(d)
    d.set_defaults(func=_distill)

    e = sub.add_parser(
        "eval",
        help="compare a SwiftKV checkpoint with its teacher on held-out data",
        description="Evaluate STUDENT (a SwiftKV checkpoint) against TEACHER (the plain model) on the "
        "held-out share of the data (the same split `swiftkv distill` used, given the same --data and "
        "--seed): top-1 agreement and KL at the answer tokens, both perplexities, and greedy agreement.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    e.add_argument("teacher", type=Path, metavar="TEACHER", help="the plain checkpoint directory")
    e.add_argument("student", type=Path, metavar="STUDENT", help="the SwiftKV checkpoint directory")
    e.add_argument("--out", type=Path, default=None, help="write eval.json / eval.png here")
    _add_data_flags(e)
    e.set_defaults(func=_eval)


def _settings(args, num_key_value_layers: int, key_value_group_size: int, **fit):
    from .pipeline import DistillSettings

    return DistillSettings(
        num_key_value_layers=num_key_value_layers,
        key_value_group_size=key_value_group_size,
        num_samples=args.num_samples,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        holdout_share=args.holdout_share,
        greedy_tokens=args.greedy_tokens,
        seed=args.seed,
        device=args.device,
        precision=args.precision,
        **fit,
    )


def _distill(args) -> None:
    from .pipeline import run_distill

    if len(args.paths) > 2:
        raise ValueError(f"expected [MODEL] OUT, got {len(args.paths)} paths: {args.paths}")
    model, out = (None, args.paths[0]) if len(args.paths) == 1 else args.paths
    settings = _settings(
        args,
        args.num_key_value_layers,
        args.key_value_group_size,
        batch_tokens=args.batch_tokens,
        ridge=args.ridge,
        weighting=args.weighting,
        calibration_samples=args.calibration_samples,
        steps=args.steps,
        lr=args.lr,
        logits_loss_temp=args.logits_loss_temp,
        hidden_loss_mult=args.hidden_loss_mult,
    )
    if args.data is not None and not args.data.is_file():
        raise FileNotFoundError(f"--data {str(args.data)!r} is not a file")
    report = run_distill(
        model,
        out,
        settings,
        data_path=args.data,
        overwrite=args.overwrite,
        checkpoint_dir=args.checkpoint_dir,
        resume=args.resume,
    )
    from .report import format_table

    print(format_table(report.results))
    print(f"wrote {report.out_dir} (evaluation: {report.out_dir / 'eval.json'})")


def _eval(args) -> None:
    import torch
    from swiftkv_reference.checkpoint import load_config, load_model

    from .data import split_holdout
    from .evaluate import evaluate
    from .pipeline import load_examples, load_teacher_tokenizer
    from .precision import resolve_precision
    from .report import format_table, write_report

    for name in ("teacher", "student"):
        if not getattr(args, name).is_dir():
            raise FileNotFoundError(f"{name.upper()} {str(getattr(args, name))!r} is not a directory")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        raise NotADirectoryError(f"--out {str(args.out)!r} exists and is not a directory")
    student_config = load_config(args.student)
    if not student_config.is_swiftkv:
        raise ValueError(f"STUDENT {str(args.student)!r} is not a SwiftKV checkpoint (L == N)")
    settings = _settings(args, student_config.num_key_value_layers, student_config.key_value_group_size)
    expected = settings.student_config(load_config(args.teacher))  # the teacher is plain, L and G fit it
    differ = [
        f"{name} {getattr(expected, name)} vs {getattr(student_config, name)}"
        for name in ARCHITECTURE_FIELDS
        if getattr(expected, name) != getattr(student_config, name)
    ]
    if differ:
        raise ValueError(
            f"STUDENT {str(args.student)!r} is not a SwiftKV version of TEACHER {str(args.teacher)!r} "
            f"(teacher vs student: {'; '.join(differ)})"
        )
    tokenizer = load_teacher_tokenizer(args.teacher)
    if args.data is not None:  # read and split (or refused) before the models load
        _, heldout = split_holdout(
            load_examples(args.teacher, settings, args.data, tokenizer),
            settings.holdout_share,
            seed=args.seed,
        )
    teacher = load_model(args.teacher).to(args.device)
    if args.data is None:  # the teacher writes its answers again, in the precision distill resolved
        precision = resolve_precision(settings.precision, teacher, torch.device(args.device))
        examples = load_examples(args.teacher, settings, None, tokenizer, precision)
        _, heldout = split_holdout(examples, settings.holdout_share, seed=args.seed)
    student = load_model(args.student).to(args.device)
    results = {"student": evaluate(teacher, student, heldout, greedy_tokens=args.greedy_tokens)}
    print(format_table(results))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for path in write_report(args.out, results, name="eval", settings=settings.cache_key()):
            print(f"wrote {path}")


def main(argv: list[str] | None = None, prog: str = "swiftkv") -> int:
    args = build_parser(prog).parse_args(argv)
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        args.func(args)
    except USER_ERRORS as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    return 0
