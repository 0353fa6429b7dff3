"""`python -m bench NAME [options]`: run one benchmark (or `all`), print its table, write JSON + PNG."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

from bench.report import DEFAULT_OUT

# name -> module in bench/ (each has HELP, add_arguments(parser), run(args) -> exit code)
BENCHMARKS = {
    "demo": "demo",
    "prefill": "prefill",
    "throughput": "throughput",
    "kvcache": "kv_trace",
    "memory": "memory",
    "tp": "tp",
    "gpu": "gpu",
    "quality": "quality",
    "distill-step": "distill_step",
    "serve": "serve",
    "vllm": "vllm_peer",
    "kernels": "kernel_gains",
}
ALL = ["prefill", "throughput", "kvcache", "memory"]

DESCRIPTION = """\
SwiftKV benchmarks. Each prints a table, and writes NAME.json (settings, machine info, every
measurement) and NAME.png into --out. Timed cases run interleaved (A, B, A, B, ...) after a warm-up;
tables show the median [min-max] over the rounds, and ratios are computed round by round.

  demo        chat answers from the embedded model, then SwiftKV off vs on (the `nox -s demo` job)
  prefill     prefill tokens/s for prompt lengths 256-4096 at L = N, 3N/4, N/2, beside the FLOP limit
  throughput  the fast engine vs transformers' generate / generate_batch (and vLLM: vllm-fp32, vllm-bf16)
  kvcache     the kvcache trace benchmark (and vLLM's cache manager when importable)
  memory      KV bytes per token and maximum concurrency across L and G (AcrossKV), per rank at TP=3
  tp          tensor parallelism N = 1, 2, 3: KV bytes, blocks, concurrency per rank; step time vs N = 1
  quality     how closely SwiftKV students answer like the model, per L, beside the prefill speedup
  distill-step  a distillation micro-batch's time per loss and per bf16 weight handling
  serve       swiftkv serve (SwiftKV off/on) vs transformers serve under 1, 4, 16 concurrent chat clients
  vllm        vLLM with / without the SwiftKV plugin vs ours, fp32 and bf16 (`nox -s vllm`'s venv)
  kernels     each C kernel's end-to-end gain over the library route (that kernel switched off)
  gpu         short CUDA benchmark for `nox -s gpu` (exits 0 with a message without CUDA)
  all         prefill, throughput, kvcache, memory

Start with `python -m bench demo --quick` (under a minute on 2 cores).
"""


def _common(out_default: Path) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    g = common.add_argument_group("common options")
    g.add_argument("--quick", action="store_true", help="small sizes and one round: checks that it runs")
    g.add_argument("--out", type=Path, default=out_default, help=f"output directory (default {out_default})")
    g.add_argument("--repeat", type=int, help="timed rounds per case (default 3, demo 1, serve 2; quick 1)")
    g.add_argument(
        "--warmup",
        type=int,
        help="warm-up calls per case before timing (default 1; quick: 0, or a small stand-in)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    g.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    g.add_argument(
        "--matmul-precision",
        choices=["highest", "high"],
        default="highest",
        help="torch.set_float32_matmul_precision for every system measured (the engine's matmul_precision "
        "too): 'high' lets fp32 linears use bf16x3 where a kernel offers it (default highest: fp32)",
    )
    g.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return common


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="name", required=True, metavar="NAME")
    common = _common(DEFAULT_OUT)
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(f"bench.{module}")
        p = sub.add_parser(
            name,
            help=mod.HELP,
            description=mod.__doc__,
            parents=[common],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.add_arguments(p)
    sub.add_parser("all", help="prefill, throughput, kvcache, memory", parents=[common])
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("bench").setLevel(logging.DEBUG if args.verbose else logging.INFO)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.set_float32_matmul_precision(args.matmul_precision)
    if args.quick:
        args.repeat = args.repeat or 1
    names = ALL if args.name == "all" else [args.name]
    status = 0
    for name in names:
        mod = importlib.import_module(f"bench.{BENCHMARKS[name]}")
        if args.name == "all":  # the sub-benchmark's own options keep their defaults
            sub_args = build_parser().parse_args([name, *_forwarded(args)])
            sub_args.threads = None
        else:
            sub_args = args
        print(f"\n######## bench {name} ########")
        status = max(status, mod.run(sub_args) or 0)
    return status


def _forwarded(args: argparse.Namespace) -> list[str]:
    out = ["--out", str(args.out), "--seed", str(args.seed), "--matmul-precision", args.matmul_precision]
    out += ["--quick"] if args.quick else []
    out += ["--verbose"] if args.verbose else []
    for flag in ("repeat", "warmup"):
        if getattr(args, flag) is not None:
            out += [f"--{flag}", str(getattr(args, flag))]
    return out


if __name__ == "__main__":
    sys.exit(main())
