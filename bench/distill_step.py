"""What a distillation step (`swiftkv distill --steps`) costs on this machine, by loss and by how the
frozen weights reach bf16: cached-teacher micro-batches (forward and backward; every epoch after the
first reuses the teacher's outputs) of the embedded model's SwiftKV student, timed interleaved.

    snowflake loss   KL at T = 2 + the hidden-state MSE at every token: the student's layers >= L run
                     every token
    kl only          the KL at T = 1 alone (--logits-loss-temp 1 --hidden-loss-mult 0): layers >= L run
                     only the positions the KL is taken at

In bf16 on CPU each runs twice: with autocast casting the frozen fp32 weights on every use ("casts")
and with bf16 copies of them held for the run ("copies", what distill does; bit for bit the same
losses, which the benchmark checks). The sequences are random tokens shaped
like the teacher's data (prompts of 30-60 tokens, answers of 40-256), packed as distill packs them; the
student is Snowflake's initialisation at L (its weights do not change the cost)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import random
from collections.abc import Callable

from bench import report
from bench.harness import Stats, paired_ratio, run_interleaved

log = logging.getLogger(__name__)

HELP = "a distillation micro-batch's time, per loss and per bf16 weight handling (the embedded model)"
PROMPT_TOKENS, ANSWER_TOKENS = (30, 60), (40, 256)
BASELINE = "snowflake loss, casts"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=15, help="the student's SwiftKV L (default 15)")
    parser.add_argument(
        "--batch-tokens",
        type=int,
        default=1024,
        help="tokens per micro-batch, padding included (default 1024)",
    )
    parser.add_argument("--micro-batches", type=int, help="micro-batches per timed call (default 6; quick 2)")
    parser.add_argument(
        "--precision",
        choices=("auto", "fp32", "bf16"),
        default="auto",
        help="the steps' arithmetic, as `swiftkv distill --precision` (default auto: measured)",
    )


def synthetic_batches(vocab_size: int, num_batches: int, batch_tokens: int, seed: int = 0) -> list:
    """Random-token Examples shaped like the teacher's answers, packed by swiftkv_distill.data.batches
    until there are num_batches micro-batches."""
    from swiftkv_distill.data import Example, batches

    rng = random.Random(seed)
    examples: list = []
    while True:
        prompt, answer = rng.randint(*PROMPT_TOKENS), rng.randint(*ANSWER_TOKENS)
        ids = [rng.randrange(3, vocab_size) for _ in range(prompt + answer)]
        examples.append(Example(tuple(ids), prompt))
        packed = batches(examples, batch_tokens, seed=seed)
        if len(packed) >= num_batches:
            return packed[:num_batches]


def step_cases(
    make_student: Callable[[], object], batches: list, precision: str, stack: contextlib.ExitStack
) -> dict[str, Callable[[], dict]]:
    """name -> a call running every micro-batch of `batches` forward and backward on its own student
    (make_student() per case; the teacher's outputs computed here, once). The "copies" cases hold their
    bf16 weights until `stack` closes. Each call returns {"loss": the sum of the micro-batches' losses}."""
    import torch
    from swiftkv_distill.distill import DistillConfig, TeacherCache, _micro_batch_loss, trainable_parameters
    from swiftkv_distill.precision import autocast, frozen_weights_in_bf16

    device = torch.device("cpu")
    losses = {
        "snowflake loss": DistillConfig(steps=1, precision=precision),
        "kl only": DistillConfig(steps=1, logits_loss_temp=1.0, hidden_loss_mult=0.0, precision=precision),
    }
    weights = ("casts", "copies") if precision == "bf16" else ("fp32",)
    cases = {}
    for loss_name, config in losses.items():
        for handling in weights:
            model = make_student()
            trainable = trainable_parameters(model)
            for name, p in model.named_parameters():
                p.requires_grad_(name in trainable)
            lm_weight = None
            if handling == "copies":
                lm_weight = stack.enter_context(frozen_weights_in_bf16(model, precision, device))
            cache = TeacherCache(model.config, config, max_bytes=1 << 40)

            def call(model=model, config=config, cache=cache, lm_weight=lm_weight) -> dict:
                total = 0.0
                for batch in batches:
                    with autocast(precision, device):
                        loss = _micro_batch_loss(model, batch, config, cache, lm_weight)[0]
                    loss.backward()
                    model.zero_grad(set_to_none=True)
                    total += float(loss.detach())
                return {"loss": total}

            call()  # the teacher's outputs, as an epoch after the first finds them
            cases[f"{loss_name}, {handling}"] = call
    return cases


def run(args: argparse.Namespace) -> int:
    import torch
    from swiftkv_distill.precision import resolve_precision
    from swiftkv_reference.checkpoint import load_model, swiftkv_init
    from swiftkv_reference.default_model import default_model_dir
    from swiftkv_reference.model import SwiftKVForCausalLM

    repeat = args.repeat or (1 if args.quick else 3)
    warmup = (0 if args.quick else 1) if args.warmup is None else args.warmup
    num_batches = args.micro_batches or (2 if args.quick else 6)
    teacher = load_model(default_model_dir())
    config, state = swiftkv_init(teacher.config, teacher.state_dict(), args.layers, 1)
    del teacher

    def make_student():
        model = SwiftKVForCausalLM(config).eval()
        model.load_state_dict(state)
        return model

    batches = synthetic_batches(config.vocab_size, num_batches, args.batch_tokens, args.seed)
    precision = resolve_precision(args.precision, make_student(), torch.device("cpu"))
    with contextlib.ExitStack() as stack:
        cases = step_cases(make_student, batches, precision, stack)
        samples = run_interleaved(cases, repeat=repeat, warmup=warmup, progress=True)
    for name in cases:
        if "copies" in name:
            casts = name.replace("copies", "casts")
            if [s.metrics["loss"] for s in samples[name]] != [s.metrics["loss"] for s in samples[casts]]:
                raise AssertionError(f"{name!r} and {casts!r} gave different losses")
    baseline = BASELINE if precision == "bf16" else "snowflake loss, fp32"
    tokens = sum(b.input_ids.numel() for b in batches)
    scored = sum(int(b.logits_mask.sum()) for b in batches)
    rows = []
    for name, runs in samples.items():
        seconds = [s.seconds / num_batches for s in runs]
        rows.append(
            {
                "case": name,
                "ms_per_micro_batch": Stats.of([1e3 * s for s in seconds]),
                "speedup": paired_ratio([s.seconds for s in samples[baseline]], [s.seconds for s in runs]),
                "seconds": [s.seconds for s in runs],
            }
        )
    table = report.Table(
        f"Distillation micro-batches, SmolLM2-135M-Instruct at L = {args.layers}, {precision}, "
        f"{num_batches} x {args.batch_tokens} tokens, {repeat} round(s)",
        ["case", "ms per micro-batch", f"x {baseline}"],
    )
    for r in rows:
        table.add(r["case"], r["ms_per_micro_batch"].fmt(0), f"{r['speedup'].median:.2f}x")
    table.notes.append(
        f"scored positions (answer tokens): {scored / tokens:.0%} of the micro-batches' tokens"
    )
    settings = {
        "layers": args.layers,
        "batch_tokens": args.batch_tokens,
        "micro_batches": num_batches,
        "precision": precision,
        "repeat": repeat,
        "warmup": warmup,
        "seed": args.seed,
        "scored_share": scored / tokens,
    }
    json_path = report.write_json(args.out, "distill_step", settings, rows)
    report.finish([table], [json_path])
    return 0
