"""The trade-off a user chooses L from: how closely SwiftKV students of the embedded model answer like
it, against the prefill speedup they buy, for L = 10, 15, 20, 25 of N = 30, and AcrossKV G = 3 at
L = 15 (G must divide N - L; `--layers 16:2` gives a G = 2 point). Each split is evaluated with
Snowflake's initialisation, with the closed-form calibration, and (with --steps) with the calibration
followed by Snowflake's distillation (`swiftkv_distill`).

The teacher answers the built-in prompts once (`swiftkv_distill.pipeline.load_examples`); every split
is fitted on the same training share and scored on the same held-out share (never fitted on):
teacher-forced top-1 agreement and KL(teacher || student) at the answer tokens, and greedy agreement
(identical first tokens). The prefill speedup of each split is measured as `bench prefill` does: one
batch of long random prompts, generate(max_tokens=1), interleaved with L = N, ratios round by round.

With `--folds K` the same data is scored by K-fold cross-validation by prompt instead of one held-out
share: every prompt's answers are held out once, scored by students fitted on the other K - 1 folds
only (the calibration statistics are collected once per fold and summed for each fit), and the folds'
results are pooled, with the fold standard error beside the agreement and the KL. One held-out share of
a few dozen prompts is one noisy draw; the folds cost one more evaluation pass over the
data and K fits (K distillations with --steps), and hold K sets of calibration statistics (266 MiB
each for the embedded model at L = 15).

The defaults are 256 teacher answers of up to 256 tokens (a quarter of `swiftkv distill`'s, so the
agreement is a little below what `swiftkv distill` gives), and every split runs its own calibration pass
over that data and its own evaluations: tens of minutes on 2 cores (more with --steps). `--num-samples
96 --max-tokens 128` is the demo's size."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench import engine, flops, prefill, report
from bench.harness import Stats, paired_ratio, run_interleaved

log = logging.getLogger(__name__)

HELP = "held-out agreement of SwiftKV students (init, calibration, distillation) vs prefill speedup, per L"
# (L, G); at L = 15, N - L = 15: G = 3 is the smallest AcrossKV group that divides it
SPLITS = [(10, 1), (15, 1), (20, 1), (25, 1), (15, 3)]
QUICK_SPLITS = [(15, 1), (25, 1), (15, 3)]
# a quarter of `swiftkv distill`'s teacher answers (every split calibrates on its own pass over them);
# its max_tokens and greedy_tokens
NUM_SAMPLES, MAX_TOKENS, GREEDY_TOKENS = 256, 256, 32
QUICK_NUM_SAMPLES, QUICK_MAX_TOKENS = 16, 32
SPEED_PROMPTS, SPEED_PROMPT_LEN = 4, 1024
SPEED_KV_CACHE_BYTES = 512 << 20  # per engine: the speed batch fits (4 x 1024 tokens at L = N: 189 MB)
METHODS = ("snowflake init", "calibrated", "distilled")


def parse_splits(text: str) -> list[tuple[int, int]]:
    """Comma-separated L or L:G: "10,15,16:2" -> [(10, 1), (15, 1), (16, 2)]."""
    out = []
    for item in text.split(","):
        try:
            parts = [int(x) for x in item.split(":")]
        except ValueError:
            parts = []
        if len(parts) not in (1, 2):
            raise argparse.ArgumentTypeError(f"{item!r} is not L or L:G (e.g. 15 or 15:3)")
        out.append((parts[0], parts[1] if len(parts) == 2 else 1))
    if len(set(out)) != len(out):
        raise argparse.ArgumentTypeError(f"{text!r} names a split twice")
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default = ",".join(f"{L}" if G == 1 else f"{L}:{G}" for L, G in SPLITS)
    quick = ",".join(f"{L}" if G == 1 else f"{L}:{G}" for L, G in QUICK_SPLITS)
    parser.add_argument(
        "--layers",
        type=parse_splits,
        help=f"SwiftKV splits, comma-separated L or L:G (AcrossKV) (default {default}; quick {quick})",
    )
    parser.add_argument(
        "--num-samples",
        type=int,
        help=f"teacher answers to the built-in prompts (default {NUM_SAMPLES}; quick {QUICK_NUM_SAMPLES})",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        help=f"longest teacher answer in tokens (default {MAX_TOKENS}; quick {QUICK_MAX_TOKENS})",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=0,
        help="distillation steps after the calibration, for every split (default 0: no distillation)",
    )
    parser.add_argument("--lr", type=float, default=2e-4, help="distillation learning rate (Snowflake's)")
    parser.add_argument(
        "--logits-loss-temp",
        type=float,
        default=2.0,
        help="distillation: the KL's temperature (Snowflake's 2; see `swiftkv distill --help`)",
    )
    parser.add_argument(
        "--hidden-loss-mult",
        type=float,
        default=1.0,
        help="distillation: weight of the hidden-state MSE (Snowflake's 1; 0: the KL alone)",
    )
    parser.add_argument(
        "--folds",
        type=_folds,
        default=1,
        help="K-fold cross-validation by prompt: every prompt held out once, scored by students fitted on "
        "the other folds (default 1: one held-out share of the prompts)",
    )
    parser.add_argument(
        "--greedy-tokens",
        type=int,
        help=f"greedy agreement over this many tokens per held-out prompt (default {GREEDY_TOKENS}; "
        "quick 0: skipped)",
    )
    parser.add_argument(
        "--no-speed", action="store_true", help="skip the prefill speedup measurement (quick skips it)"
    )


def _folds(text: str) -> int:
    try:
        k = int(text)
    except ValueError:
        k = 0
    if k < 1:
        raise argparse.ArgumentTypeError(f"--folds must be an integer >= 1, got {text!r}")
    return k


def run(args: argparse.Namespace) -> int:
    from swiftkv_distill.data import split_folds, split_holdout
    from swiftkv_distill.pipeline import _model, load_examples, resolve_teacher_dir
    from swiftkv_reference.checkpoint import load_config, load_state_dict
    from swiftkv_reference.tokenizer import load_tokenizer

    quick = args.quick
    splits = args.layers or (QUICK_SPLITS if quick else SPLITS)
    base = base_settings(args, splits)
    teacher_dir = resolve_teacher_dir(None)
    config = load_config(teacher_dir)
    settings = split_settings(config, splits, base)  # every split checked before any work
    measure_speed = not (quick or args.no_speed)
    repeat = args.repeat or 3
    warmup = 1 if args.warmup is None else args.warmup
    seconds: dict[str, float] = {}

    state = load_state_dict(teacher_dir)
    speed = None
    if measure_speed:
        print(
            f"== prefill speedup: {SPEED_PROMPTS} x {SPEED_PROMPT_LEN}-token prompts, each split "
            f"interleaved with L={config.num_hidden_layers} =="
        )
        t = time.perf_counter()
        speed = measure_speedups(
            splits,
            lambda L, G: engine.build_llm(
                L, G, config=config, state_dict=state, kv_cache_memory=SPEED_KV_CACHE_BYTES
            ),
            num_prompts=SPEED_PROMPTS,
            prompt_len=SPEED_PROMPT_LEN,
            repeat=repeat,
            warmup=warmup,
            seed=args.seed,
        )
        seconds["speed"] = time.perf_counter() - t

    print(f"== teacher data: {base.num_samples} answers of at most {base.max_tokens} tokens ==")
    t = time.perf_counter()
    tokenizer = load_tokenizer(teacher_dir)
    examples = load_examples(teacher_dir, base, None, tokenizer)
    if args.folds > 1:
        folds = split_folds(examples, args.folds, seed=base.seed)
    else:
        train, heldout = split_holdout(examples, share=base.holdout_share, seed=base.seed)
    seconds["data"] = time.perf_counter() - t
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    scored = f"{args.folds}-fold cross-validation" if args.folds > 1 else "the held-out data"
    print(f"== {len(splits)} splits x {2 + bool(base.steps)} methods: fit, then score on {scored} ==")
    teacher = _model(config, state, base.device)
    t = time.perf_counter()
    if args.folds > 1:
        rows = cross_validate_splits(teacher, folds, settings, pad_token_id=pad)
        data = {
            "folds": args.folds,
            "train_examples": len(examples) - min(map(len, folds)),  # the most any fold's fit saw
            "train_tokens": sum(len(e) for e in examples) - min(sum(map(len, f)) for f in folds),
        }
    else:
        rows = evaluate_splits(teacher, train, heldout, settings, pad_token_id=pad)
        data = {"folds": 1, "train_examples": len(train), "train_tokens": sum(len(e) for e in train)}
    seconds["quality"] = time.perf_counter() - t
    data |= {
        "heldout_examples": rows[0]["num_examples"],
        "heldout_answer_tokens": rows[0]["num_answer_tokens"],
        "teacher_perplexity": rows[0]["teacher_perplexity"],
    }
    json_settings = {
        "splits": splits,
        "num_hidden_layers": config.num_hidden_layers,
        **{
            k: v
            for k, v in base.cache_key().items()
            if k not in ("num_key_value_layers", "key_value_group_size")
        },
        "folds": args.folds,
        "speed": measure_speed,
        "speed_prompts": SPEED_PROMPTS,
        "speed_prompt_len": SPEED_PROMPT_LEN,
        "repeat": repeat,
        "warmup": warmup,
        "dtype": "float32",
    }
    paths = write_outputs(args.out, rows, speed, json_settings, data, seconds=seconds)
    t = table(rows, speed, config.num_hidden_layers, data, base.greedy_tokens)
    if quick:
        t.notes.append(
            "--quick: too little data for meaningful figures (the fit overfits): it only checks the run."
        )
    report.finish([t], paths)
    return 0


def base_settings(args: argparse.Namespace, splits: Sequence[tuple[int, int]]):
    """The DistillSettings every split shares (ValueError naming a bad field), from the parsed flags."""
    from swiftkv_distill.pipeline import DistillSettings

    quick = args.quick
    return DistillSettings(
        num_key_value_layers=splits[0][0],
        num_samples=_given(args.num_samples, QUICK_NUM_SAMPLES if quick else NUM_SAMPLES),
        max_tokens=_given(args.max_tokens, QUICK_MAX_TOKENS if quick else MAX_TOKENS),
        steps=args.steps,
        lr=args.lr,
        logits_loss_temp=args.logits_loss_temp,
        hidden_loss_mult=args.hidden_loss_mult,
        greedy_tokens=_given(args.greedy_tokens, 0 if quick else GREEDY_TOKENS),
        seed=args.seed,
    )


def _given(value, default):
    return default if value is None else value


def split_settings(config, splits: Sequence[tuple[int, int]], base) -> list:
    """One DistillSettings per (L, G), each checked against the teacher's config (ValueError naming
    the split)."""
    out = [dataclasses.replace(base, num_key_value_layers=L, key_value_group_size=G) for L, G in splits]
    check_splits(config, out)
    return out


def check_splits(config, settings: Sequence) -> None:
    """ValueError naming the split unless every settings' L, G fit the teacher's config."""
    if not settings:
        raise ValueError("no splits to evaluate")
    for s in settings:
        try:
            s.student_config(config)
        except ValueError as e:
            raise ValueError(f"split L={s.num_key_value_layers}, G={s.key_value_group_size}: {e}") from None


def evaluate_splits(teacher, train, heldout, settings: Sequence, pad_token_id: int = 0) -> list[dict]:
    """For every DistillSettings (one per split): Snowflake's init, the calibration and (settings.steps)
    the calibration + distillation of a student of `teacher` (a plain SwiftKVForCausalLM), fitted on
    `train` and scored on `heldout` (lists of Example). -> one row per (split, method): the EvalResult's
    fields, the method, fit_seconds and eval_seconds. The teacher is left as it was."""
    from swiftkv_distill.calibrate import calibrate
    from swiftkv_distill.data import batches
    from swiftkv_distill.distill import distill
    from swiftkv_distill.evaluate import evaluate
    from swiftkv_distill.pipeline import _model
    from swiftkv_reference.checkpoint import swiftkv_init

    check_splits(teacher.config, settings)
    teacher_state = {k: v.detach().cpu() for k, v in teacher.state_dict().items()}
    fit_batches = batches(train, settings[0].batch_tokens, pad_token_id)
    rows = []
    for s in settings:
        L, G = s.num_key_value_layers, s.key_value_group_size
        log.info("split L=%d G=%d", L, G)

        def score(method, student, fit_seconds, s=s):
            t = time.perf_counter()
            result = evaluate(teacher, student, heldout, greedy_tokens=s.greedy_tokens)
            rows.append(
                {
                    "method": method,
                    **result.to_dict(),
                    "fit_seconds": fit_seconds,
                    "eval_seconds": time.perf_counter() - t,
                }
            )

        t = time.perf_counter()
        student = _model(*swiftkv_init(teacher.config, teacher_state, L, G), s.device)
        score(METHODS[0], student, time.perf_counter() - t)
        del student
        t = time.perf_counter()
        student = _model(*calibrate(teacher, fit_batches, L, G, ridge=s.ridge), s.device)
        score(METHODS[1], student, time.perf_counter() - t)
        if s.steps:
            t = time.perf_counter()
            train_batches = batches(train, s.batch_tokens, pad_token_id, seed=s.seed)
            distill(student, train_batches, s.distill_config(), device=s.device)
            score(METHODS[2], student, rows[-1]["fit_seconds"] + time.perf_counter() - t)
        del student
    return rows


def cross_validate_splits(teacher, folds, settings: Sequence, pad_token_id: int = 0) -> list[dict]:
    """evaluate_splits by K-fold cross-validation: for every DistillSettings, each fold (a list of
    Example; split_folds) is scored by Snowflake's init, by the calibration fitted on the other folds'
    statistics (collected once per fold, summed per fit) and (settings.steps) by that calibration
    distilled on the other folds' examples; never by a fit that saw it. -> one row per (split, method):
    EvalResult.pooled over the folds, the method, `folds`, the fold standard errors `top1_agreement_se`
    and `kl_se`, `fold_top1_agreement` (per fold), and fit_seconds / eval_seconds over all folds."""
    from functools import reduce
    from operator import add

    from swiftkv_distill.calibrate import collect_statistics, fit
    from swiftkv_distill.data import batches
    from swiftkv_distill.distill import distill
    from swiftkv_distill.evaluate import evaluate
    from swiftkv_distill.pipeline import _model
    from swiftkv_reference.checkpoint import swiftkv_init

    check_splits(teacher.config, settings)
    if len(folds) < 2 or not all(folds):
        sizes = [len(fold) for fold in folds]
        raise ValueError(f"cross-validation needs at least 2 non-empty folds, got sizes {sizes}")
    teacher_state = {k: v.detach().cpu() for k, v in teacher.state_dict().items()}
    fold_batches = [batches(fold, settings[0].batch_tokens, pad_token_id) for fold in folds]
    rows = []
    for s in settings:
        L, G = s.num_key_value_layers, s.key_value_group_size
        log.info("split L=%d G=%d, %d folds", L, G, len(folds))
        results: dict[str, list] = {m: [] for m in METHODS}
        seconds = {m: [0.0, 0.0] for m in METHODS}  # fit, eval

        def score(method, student, fold, s=s, results=results, seconds=seconds):
            t = time.perf_counter()
            results[method].append(evaluate(teacher, student, fold, greedy_tokens=s.greedy_tokens))
            seconds[method][1] += time.perf_counter() - t

        t = time.perf_counter()
        student = _model(*swiftkv_init(teacher.config, teacher_state, L, G), s.device)
        seconds[METHODS[0]][0] = time.perf_counter() - t
        for fold in folds:
            score(METHODS[0], student, fold)
        del student
        t = time.perf_counter()
        parts = [collect_statistics(teacher, fb, L, G, progress=False) for fb in fold_batches]
        seconds[METHODS[1]][0] = time.perf_counter() - t
        for f, fold in enumerate(folds):
            t = time.perf_counter()
            others = reduce(add, (part for g, part in enumerate(parts) if g != f))
            student = _model(*fit(teacher, others, ridge=s.ridge), s.device)
            seconds[METHODS[1]][0] += time.perf_counter() - t
            score(METHODS[1], student, fold)
            if s.steps:
                t = time.perf_counter()
                train = [e for g, other in enumerate(folds) if g != f for e in other]
                train_batches = batches(train, s.batch_tokens, pad_token_id, seed=s.seed)
                distill(student, train_batches, s.distill_config(), device=s.device)
                seconds[METHODS[2]][0] += time.perf_counter() - t
                score(METHODS[2], student, fold)
            del student
        if s.steps:  # a distilled student's fit includes its calibration's
            seconds[METHODS[2]][0] += seconds[METHODS[1]][0]
        for method in METHODS:
            if results[method]:
                rows.append(_pooled_row(method, results[method], *seconds[method]))
    return rows


def _pooled_row(method: str, results: list, fit_seconds: float, eval_seconds: float) -> dict:
    from swiftkv_distill.evaluate import EvalResult

    def standard_error(values: list[float]) -> float:
        return statistics.stdev(values) / math.sqrt(len(values))

    agreement = [r.top1_agreement for r in results]
    return {
        "method": method,
        **EvalResult.pooled(results).to_dict(),
        "folds": len(results),
        "top1_agreement_se": standard_error(agreement),
        "kl_se": standard_error([r.kl for r in results]),
        "fold_top1_agreement": agreement,
        "fit_seconds": fit_seconds,
        "eval_seconds": eval_seconds,
    }


def measure_speedups(
    splits: Sequence[tuple[int, int]],
    build: Callable[[int | None, int | None], object],
    *,
    num_prompts: int,
    prompt_len: int,
    repeat: int,
    warmup: int,
    seed: int,
) -> dict[tuple[int, int], dict]:
    """Prefill tokens/s of every split and of L = N (build(None, None)) on one batch of random prompts,
    interleaved (`bench prefill`'s cases). -> (L, G) -> {prefill_tokens_per_second, speedup (over
    L = N, round by round), flop_limit}."""
    full = build(None, None)
    cfg = full.config
    llms = {"full": full} | {_label(L, G): build(L, G) for L, G in splits}
    prompts = engine.random_prompts(num_prompts, prompt_len, cfg.vocab_size, seed=seed)
    samples = run_interleaved(
        {name: prefill._case(llm, prompts) for name, llm in llms.items()},
        repeat=repeat,
        warmup=warmup,
        progress=True,
    )
    tps = {name: [s.metrics["prompt_tokens"] / s.seconds for s in samples[name]] for name in llms}
    return {
        (L, G): {
            "prefill_tokens_per_second": Stats.of(tps[_label(L, G)]),
            "full_prefill_tokens_per_second": Stats.of(tps["full"]),
            "speedup": paired_ratio(tps[_label(L, G)], tps["full"]),
            "flop_limit": flops.speedup_limit(cfg, prompt_len, L, G),
            "seconds": [s.seconds for s in samples[_label(L, G)]],
        }
        for L, G in splits
    }


def _label(L: int, G: int) -> str:
    return f"L={L}" if G == 1 else f"L={L} G={G}"


def _split(row: dict) -> tuple[int, int]:
    return row["num_key_value_layers"], row["key_value_group_size"]


def table(
    rows: list[dict], speed: dict | None, n_layers: int, data: dict, greedy_tokens: int
) -> report.Table:
    folds = data.get("folds", 1)
    scored = (
        f"{folds}-fold cross-validation by prompt over {data['heldout_examples']} examples"
        if folds > 1
        else f"held out: {data['heldout_examples']} examples"
    )
    t = report.Table(
        f"SwiftKV quality vs prefill speed: SmolLM2-135M-Instruct (N={n_layers}), {scored}, "
        f"{data['heldout_answer_tokens']} answer tokens",
        ["L", "G", "prefill speedup", "FLOP limit", "method", "top-1 agree", "KL", "greedy agree", "ppl"],
    )
    previous = None
    for row in rows:
        split = _split(row)
        first = split != previous
        previous = split
        sp = speed.get(split) if speed else None
        t.add(
            split[0] if first else "",
            split[1] if first else "",
            (f"{sp['speedup'].median:.2f}x" if sp else None) if first else "",
            (f"{sp['flop_limit']:.2f}x" if sp else None) if first else "",
            row["method"],
            _with_se(row, "top1_agreement"),
            _with_se(row, "kl"),
            None if row["greedy_agreement"] is None else f"{row['greedy_agreement']:.3f}",
            f"{row['student_perplexity']:.2f}",
        )
    t.notes += [
        "top-1 agree / KL: teacher-forced at the held-out answer tokens, argmax equal to the original "
        "model's / KL(original || SwiftKV) in nats; ppl: the SwiftKV model's perplexity on those tokens "
        f"(the original's: {data['teacher_perplexity']:.2f}).",
        f"greedy agree: held-out prompts whose first {greedy_tokens} greedy tokens equal the original's"
        if greedy_tokens
        else "greedy agree: skipped (--greedy-tokens 0)",
        f"each fold scored by a fit on the other {folds - 1} (at most {data['train_examples']} teacher "
        f"answers, {data['train_tokens']} tokens); agreement and KL pooled over the folds, +- the folds' "
        "standard error."
        if folds > 1
        else f"fitted on {data['train_examples']} teacher answers ({data['train_tokens']} tokens).",
    ]
    if speed:
        t.notes.append(
            f"prefill speedup: tok/s over L={n_layers}, {SPEED_PROMPTS} x {SPEED_PROMPT_LEN}-token prompts, "
            "median of round-by-round ratios; FLOP limit: bench/flops.py."
        )
    else:
        t.notes.append(
            "prefill speedup: not measured (--quick or --no-speed); see `python -m bench prefill`."
        )
    return t


def _with_se(row: dict, key: str) -> str:
    se = row.get(f"{key}_se")
    return f"{row[key]:.3f}" + ("" if se is None else f" +- {se:.3f}")


def write_outputs(
    out: Path, rows: list[dict], speed: dict | None, settings: dict, data: dict, **extra
) -> list[Path]:
    """quality.json (every row with its split's speed figures) and quality.png."""
    results = []
    for row in rows:
        sp = (speed or {}).get(_split(row))
        results.append({**row, **({k: v for k, v in sp.items() if k != "seconds"} if sp else {})})
    speed_rows = [
        {"num_key_value_layers": L, "key_value_group_size": G, **v} for (L, G), v in (speed or {}).items()
    ]
    json_path = report.write_json(out, "quality", settings, results, data=data, speed=speed_rows, **extra)
    return [json_path, plot(rows, speed, out)]


@report.optional_plot
def plot(rows: list[dict], speed: dict | None, out: Path) -> Path:
    """Top-1 agreement (solid; greedy agreement dotted) and KL against the prefill speedup (or L without
    it): one line per method through the G = 1 splits, AcrossKV splits as open squares."""
    fig, (ax_agree, ax_kl) = report.new_figure(ncols=2)

    def x_of(row):
        return speed[_split(row)]["speedup"].median if speed else row["num_key_value_layers"]

    methods = [m for m in METHODS if any(r["method"] == m for r in rows)]
    for i, method in enumerate(methods):
        mine = [r for r in rows if r["method"] == method]
        line = sorted((r for r in mine if r["key_value_group_size"] == 1), key=x_of)
        across = [r for r in mine if r["key_value_group_size"] > 1]
        for ax, key, style in (
            (ax_agree, "top1_agreement", "-"),
            (ax_agree, "greedy_agreement", ":"),
            (ax_kl, "kl", "-"),
        ):
            if any(r[key] is None for r in mine):
                continue
            label = method if style == "-" else None
            ax.plot(
                [x_of(r) for r in line], [r[key] for r in line], style, marker="o", color=f"C{i}", label=label
            )
            ax.plot([x_of(r) for r in across], [r[key] for r in across], "s", mfc="none", color=f"C{i}")
            for r in mine if i == 0 else []:
                xy = (x_of(r), r[key])
                ax.annotate(_label(*_split(r)), xy, fontsize=7, xytext=(3, 3), textcoords="offset points")
    xlabel = "prefill speedup over L = N" if speed else "L (layers that prefill every prompt token)"
    greedy = any(r["greedy_agreement"] is not None for r in rows)
    ax_agree.set(
        xlabel=xlabel,
        ylabel="agreement with the original model",
        title="Top-1 agreement" + (" (dotted: greedy)" if greedy else "") + ", held out",
        ylim=(0, 1.05),
    )
    ax_kl.set(xlabel=xlabel, ylabel="nats per answer token", title="KL(original || SwiftKV), held out")
    for ax in (ax_agree, ax_kl):
        ax.legend(fontsize=7, title="open squares: AcrossKV", title_fontsize=7)
    fig.suptitle("SwiftKV quality vs speed (SmolLM2-135M-Instruct, fp32)")
    return report.save_figure(fig, out, "quality")
