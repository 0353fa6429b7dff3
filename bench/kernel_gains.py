"""What each hand-written C kernel earns end to end: the engine as its plan builds it by default, against
the same engine with that one kernel switched off (`disabled_kernels`), so the plan falls back to the
library route (oneDNN / MKL through torch for GEMMs; torch's own ops for attention, norms and sampling).

Every pair runs in this process, interleaved round by round on `bench throughput`'s mixes (output
tokens/s, greedy; the `sample` kernel's pair samples at temperature 1, seeded, since greedy decoding
never calls it). A kernel's gain is the default engine's throughput over the switched-off one's, round
by round (1.25 = the kernel makes the mix 25% faster). Two more library routes are measured:

  library       every C kernel off at once: the engine on torch and its libraries alone
  ops-inductor  the row ops (RMSNorm + residual, SiLU-and-mul, RoPE) by torch.compile with Inductor's
                CPU backend instead of the C kernels: the compiled library route for element-wise ops

A kernel whose gain stays under --keep-threshold on every mix measured is marked `retire?` in the table.
"""

from __future__ import annotations

import argparse
import logging
from contextlib import contextmanager
from typing import Any

from bench import engine, report
from bench.harness import Stats, paired_ratio, run_interleaved
from bench.throughput import MIXES, QUICK_MIXES, mix_prompts

log = logging.getLogger(__name__)

HELP = "each C kernel's end-to-end gain over the library route (that kernel switched off), per mix"
SAMPLED = {"sample": 1.0}  # kernels measured sampling, at this temperature
EXTRA = ("library", "ops-inductor")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from swiftkv_fast.envs import KERNELS

    split = lambda s: s.split(",")  # noqa: E731
    parser.add_argument("--mixes", type=split, help=f"comma-separated, from {list(MIXES)}")
    parser.add_argument(
        "--kernels",
        type=split,
        help=f"comma-separated, from {[*KERNELS, *EXTRA]} (default: all)",
    )
    parser.add_argument(
        "--swiftkv", action="store_true", help="the engine at L = N/2 (default: SwiftKV off, L = N)"
    )
    parser.add_argument(
        "--keep-threshold",
        type=float,
        default=1.05,
        help="a kernel whose median gain stays under this on every mix is marked `retire?` (default 1.05)",
    )


def run(args: argparse.Namespace) -> int:
    from swiftkv_fast.envs import KERNELS

    table_of = QUICK_MIXES if args.quick else MIXES
    mixes = args.mixes or list(table_of)
    variants = args.kernels or [*KERNELS, *EXTRA]
    unknown = set(variants) - {*KERNELS, *EXTRA}
    if unknown:
        raise SystemExit(f"unknown kernels {sorted(unknown)}; choose from {[*KERNELS, *EXTRA]}")
    repeat = args.repeat or 3
    warmup = 1 if args.warmup is None else args.warmup
    layers = None
    base = _build(layers, frozenset())
    if args.swiftkv:
        layers = base.llm_engine.config.num_hidden_layers // 2
        base = _build(layers, frozenset())
    vocab = base.llm_engine.config.vocab_size
    rows = []
    for variant in variants:
        with _library_ops(variant == "ops-inductor"):
            off = _build(layers, _disabled(variant, KERNELS))
        temperature = SAMPLED.get(variant, 0.0)
        plan = _plan_diff(base, off)
        for mix in mixes:
            prompts, output_len = mix_prompts(table_of[mix], vocab, args.seed)
            cases = {
                name: _case(llm, prompts, output_len, temperature)
                for name, llm in (("on", base), ("off", off))
            }
            samples = run_interleaved(cases, repeat=repeat, warmup=warmup)
            tps = {k: [s.metrics["output_tokens"] / s.seconds for s in v] for k, v in samples.items()}
            rows.append(
                {
                    "kernel": variant,
                    "mix": mix,
                    "temperature": temperature,
                    "gain": paired_ratio(tps["on"], tps["off"]),
                    "default_output_tps": Stats.of(tps["on"]),
                    "switched_off_output_tps": Stats.of(tps["off"]),
                    "plan_difference": plan,
                }
            )
            print(f"{variant:>14} {mix:>14}: gain {rows[-1]['gain'].median:.3f}")
        del off
    settings = {
        "mixes": {m: table_of[m] for m in mixes},
        "kernels": variants,
        "num_key_value_layers": layers,
        "repeat": repeat,
        "warmup": warmup,
        "keep_threshold": args.keep_threshold,
        "default_plan": base.get_kernel_plan(),
    }
    table = _table(rows, mixes, args.keep_threshold)
    path = report.write_json(args.out, "kernel_gains", settings, rows)
    report.finish([table], [path])
    return 0


def _build(layers: int | None, disabled: frozenset[str]):
    # a small KV cache: several engines live in this process at once
    return engine.build_llm(layers, disabled_kernels=disabled, kv_cache_memory=256 << 20, max_model_len=2048)


def _disabled(variant: str, kernels) -> frozenset[str]:
    if variant == "library":
        return frozenset(kernels)
    if variant == "ops-inductor":
        return frozenset({"ops"})
    return frozenset({variant})


@contextmanager
def _library_ops(compiled: bool):
    """While an engine is built, its torch row ops (model/layers.py) compiled by Inductor."""
    if not compiled:
        yield
        return
    import torch
    from swiftkv_fast.model import layers

    saved = layers.add_rms_norm, layers.silu_and_mul, layers.apply_rope
    layers.add_rms_norm = torch.compile(saved[0], dynamic=True)
    layers.silu_and_mul = torch.compile(saved[1], dynamic=True)
    layers.apply_rope = torch.compile(saved[2], dynamic=True)
    try:
        yield
    finally:
        layers.add_rms_norm, layers.silu_and_mul, layers.apply_rope = saved


def _case(llm, prompts: list[list[int]], output_len: int, temperature: float):
    def call() -> dict[str, Any]:
        return engine.run_batch(llm, prompts, output_len, temperature=temperature).metrics()

    return call


def _plan_diff(base, off) -> dict[str, list[str]]:
    """The ops whose implementation differs between the two engines' plans: {op: [default, off]}."""
    a, b = base.get_kernel_plan()["ops"], off.get_kernel_plan()["ops"]
    return {
        op: [a.get(op, {}).get("implementation", "-"), b.get(op, {}).get("implementation", "-")]
        for op in sorted(set(a) | set(b), key=lambda op: (op not in a, op))
        if a.get(op) != b.get(op)
    }


def _table(rows: list[dict], mixes: list[str], threshold: float) -> report.Table:
    table = report.Table(
        "end-to-end gain of each C kernel (default engine's output tok/s over the engine without it)",
        ["kernel", *mixes, "verdict"],
    )
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        gains = {r["mix"]: r["gain"] for r in rows if r["kernel"] == kernel}
        cells = [f"{g.median:.3f} [{g.min:.3f}-{g.max:.3f}]" if (g := gains.get(m)) else "-" for m in mixes]
        keep = any(g.median >= threshold for g in gains.values())
        verdict = "keep" if keep else "retire?" if kernel not in EXTRA else "-"
        table.add(kernel, *cells, verdict)
    table.notes.append(
        "median [min-max] of the per-round ratios; > 1: the kernel is faster than the library route. "
        "`library`: every C kernel off; `ops-inductor`: the row ops by torch.compile instead of C."
    )
    return table
