"""The `swiftkv` command line.

swiftkv generate --prompt "What is the capital of France?" --chat --temperature 0
echo "Once upon a time" | swiftkv generate --num-key-value-layers 15 --max-tokens 64
swiftkv convert path/to/llama path/to/llama-swiftkv --num-key-value-layers 16
swiftkv serve --port 8000                      # OpenAI-compatible HTTP server (docs/serving.md)
swiftkv distill out/smollm2-swiftkv --num-key-value-layers 15     # with swiftkv-distill installed

A user error (a bad flag value, a missing file, a checkpoint that cannot be read) prints one line,
`swiftkv: error: ...`, on stderr and exits with status 2; anything else is a bug and shows its traceback.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import time
from pathlib import Path


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown; the epilog (the environment variables' table) kept as written."""


def _environment_epilog() -> str:
    from swiftkv_fast import envs

    width = max(map(len, envs.VARIABLES))
    lines = [f"  {name:<{width}}  {var.doc}" for name, var in envs.VARIABLES.items()]
    kernels = [f"  {name:<{width}}  {doc}" for name, doc in envs.KERNELS.items()]
    return "\n".join(
        [
            "environment variables (docs/environment.md):",
            *lines,
            "",
            "kernel names for --disabled-kernels:",
            *kernels,
        ]
    )


def _add_generate(sub) -> None:
    p = sub.add_parser(
        "generate",
        help="generate text for one or more prompts",
        description="Generate text. Prompts come from --prompt (repeatable), --prompts-file (one per line), "
        "or stdin (one per line) when neither is given. Without --model the embedded "
        "SmolLM2-135M-Instruct is used.",
        formatter_class=_HelpFormatter,
        epilog=_environment_epilog(),
    )
    p.add_argument(
        "--model", default=None, help="checkpoint directory (default: the embedded SmolLM2-135M-Instruct)"
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat the flag for several)")
    p.add_argument("--prompts-file", type=Path, help="a text file with one prompt per line")
    p.add_argument(
        "--chat", action="store_true", help="wrap each prompt as a user message in the chat template"
    )
    g = p.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    g.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="nucleus sampling: keep the most likely tokens up to this mass",
    )
    g.add_argument("--top-k", type=int, default=-1, help="-1 disables top-k")
    g.add_argument("--seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    g.add_argument(
        "--min-tokens",
        type=int,
        default=0,
        help="generate at least this many tokens (EOS is not sampled before)",
    )
    g.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    g.add_argument(
        "--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token"
    )
    _add_engine_flags(p)
    p.set_defaults(func=_generate)


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """The `LLM` engine settings, shared by `generate` and `serve` (see `_engine_kwargs`); their defaults
    are EngineConfig's."""
    from swiftkv_fast.attention import BACKENDS
    from swiftkv_fast.config import KV_CACHE_DTYPES, LINEAR_KERNELS, MATMUL_PRECISIONS, EngineConfig

    default = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    e = p.add_argument_group("engine")
    e.add_argument(
        "--num-key-value-layers",
        type=int,
        default=default["num_key_value_layers"],
        help="SwiftKV L: layers >= L take their KV from layer L's input (a plain checkpoint is converted on "
        "the fly; quality needs distillation)",
    )
    e.add_argument(
        "--key-value-group-size",
        type=int,
        default=default["key_value_group_size"],
        help="AcrossKV G: layers sharing one KV cache",
    )
    e.add_argument(
        "--dtype",
        default=default["dtype"],
        help="the weights' dtype: auto (the checkpoint's), float32, bfloat16 or float16; a CPU without bf16 "
        "units keeps bf16 weights and multiplies them in float32",
    )
    e.add_argument("--device", default=default["device"], help="auto, cpu or cuda")
    e.add_argument(
        "--attention-backend",
        default=default["attention_backend"],
        choices=list(BACKENDS),
        help="auto: triton on CUDA when it imports, torch otherwise",
    )
    e.add_argument("--block-size", type=int, default=default["block_size"], help="tokens per KV cache block")
    e.add_argument(
        "--max-num-seqs", type=int, default=default["max_num_seqs"], help="requests running at once"
    )
    e.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=default["max_num_batched_tokens"],
        help="token budget per step",
    )
    e.add_argument(
        "--max-model-len",
        type=int,
        default=default["max_model_len"],
        help="longest prompt + output; None: the model's limit",
    )
    e.add_argument(
        "--kv-cache-memory", type=int, default=default["kv_cache_memory"], help="KV cache size in bytes"
    )
    e.add_argument(
        "--kv-cache-dtype",
        default=default["kv_cache_dtype"],
        choices=list(KV_CACHE_DTYPES),
        help="what the KV cache holds: auto, the model's dtype; bfloat16 on a CPU fp32 model halves its "
        "memory (twice the tokens) and what decode attention reads, for K/V rounded to 8 significant bits",
    )
    e.add_argument(
        "--no-prefix-caching", action="store_true", help="do not reuse the KV of prompts seen before"
    )
    e.add_argument(
        "--linear-kernel",
        default=default["linear_kernel"],
        choices=list(LINEAR_KERNELS),
        help="CPU GEMM kernel of the linear layers: auto times them once per machine (cached); q4-amx, "
        "panel-amx and bf16-amx run only weights of the exact form they take (a dequantized 4- or 8-bit "
        "checkpoint; values exact in bf16), the others fall back to F.linear",
    )
    e.add_argument(
        "--disabled-kernels",
        default=None,
        help="comma-separated C kernels this engine does not run (names below; the library / torch path "
        "runs instead); default: $SWIFTKV_DISABLED_KERNELS. The kernel plan logged at start-up shows "
        "what runs where",
    )
    e.add_argument(
        "--matmul-precision",
        default=default["matmul_precision"],
        choices=list(MATMUL_PRECISIONS),
        help="as torch.set_float32_matmul_precision: 'high' lets fp32 CPU linears run on Intel AMX "
        "as sums of bf16 products (bf16x3: ~16 significant bits per operand, fp32 sums) where faster",
    )
    e.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=default["tensor_parallel_size"],
        help="split the model over this many ranks (processes; one GPU each on CUDA, gloo on CPU)",
    )
    e.add_argument(
        "--distributed-init-method",
        default=default["distributed_init_method"],
        help="tcp://HOST:PORT that rank 0 serves for the other ranks (default: a free port on 127.0.0.1)",
    )


def _engine_kwargs(args) -> dict:
    return dict(
        num_key_value_layers=args.num_key_value_layers,
        key_value_group_size=args.key_value_group_size,
        dtype=args.dtype,
        device=args.device,
        attention_backend=args.attention_backend,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        enable_prefix_caching=not args.no_prefix_caching,
        linear_kernel=args.linear_kernel,
        matmul_precision=args.matmul_precision,
        disabled_kernels=args.disabled_kernels,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_init_method=args.distributed_init_method,
    )


def _add_serve(sub) -> None:
    from swiftkv_fast.entrypoints.limits import (
        BODY_BYTES_PER_TOKEN,
        MAX_SEQUENCES_PER_REQUEST,
        MIN_BODY_BYTES,
    )

    p = sub.add_parser(
        "serve",
        help="serve a model over HTTP with OpenAI's API (completions, chat completions, streaming)",
        description="Serve MODEL over HTTP with OpenAI's API, as `vllm serve` does: POST /v1/completions, "
        "POST /v1/chat/completions (streaming with server-sent events), GET /v1/models, /health, "
        "/version and /metrics (Prometheus). Any OpenAI client works: point its base URL at "
        "http://HOST:PORT/v1. Without MODEL the embedded SmolLM2-135M-Instruct is served. "
        "Needs the serve extra: pip install 'swiftkv-fast[serve]'. Examples: docs/serving.md. Exit status: 0 "
        "after SIGINT or SIGTERM (requests in flight are answered with an error), 2 for a bad flag or "
        "model, 3 when the engine died (for a supervisor to restart the server).",
        formatter_class=_HelpFormatter,
        epilog=_environment_epilog(),
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="checkpoint directory; None: the embedded SmolLM2-135M-Instruct",
    )
    s = p.add_argument_group("server")
    s.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to listen on (127.0.0.1: clients on this machine only; 0.0.0.0: every interface)",
    )
    s.add_argument("--port", type=int, default=8000, help="TCP port; 0: any free port (logged at start)")
    s.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every /v1 route; None: $SWIFTKV_API_KEY when set "
        "(keeps the key out of the process list), else no key",
    )
    s.add_argument(
        "--max-waiting",
        type=int,
        default=None,
        help="backpressure: counted in sequences (prompts x n); a request that would take the sequences "
        "waiting to start past this gets 503 with Retry-After (unless none waits); None: no limit",
    )
    s.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=MAX_SEQUENCES_PER_REQUEST,
        help="the most sequences (prompts x n) one request may ask for; more is a 400",
    )
    s.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=None,
        help="a larger request body gets 413 before it is read whole; None: room for a prompt of "
        f"max_model_len tokens ({BODY_BYTES_PER_TOKEN} bytes a token, at least {MIN_BODY_BYTES})",
    )
    s.add_argument(
        "--allowed-origins",
        nargs="+",
        default=None,
        metavar="ORIGIN",
        help="origins (https://example.com, or *) whose web pages may call the API (CORS); None: no CORS "
        "headers, so browsers keep other sites' pages from reading answers",
    )
    s.add_argument(
        "--keep-alive-on-engine-death",
        action="store_true",
        help="when the engine dies, keep serving 503s instead of exiting with status 3 (vLLM's "
        "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH)",
    )
    s.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the name(s) clients put in the request's 'model' field (responses report the first); None: "
        "MODEL as given, or SmolLM2-135M-Instruct",
    )
    s.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level (info logs every request)",
    )
    _add_engine_flags(p)
    p.set_defaults(func=_serve)


def _add_convert(sub) -> None:
    p = sub.add_parser(
        "convert",
        help="turn a plain Llama/Mistral/Qwen2 checkpoint into a SwiftKV checkpoint",
        description="Write a SwiftKV checkpoint initialised as Snowflake's trainer does (norm_swiftkv from "
        "layer L's input norm, q_proj_swiftkv from q_proj, k/v_proj_swiftkv as the group mean). The result "
        "runs as is, but its quality needs distillation. The output is written into a temporary directory "
        "next to DST and renamed into place at the end, so an interrupted conversion leaves nothing behind; "
        "the source is never modified.",
        formatter_class=_HelpFormatter,
        epilog=_environment_epilog(),
    )
    p.add_argument(
        "src", type=Path, metavar="SRC", help="plain checkpoint directory (config.json + *.safetensors)"
    )
    p.add_argument(
        "dst", type=Path, metavar="DST", help="output directory (must not exist, or be empty; not SRC)"
    )
    p.add_argument(
        "--num-key-value-layers",
        type=int,
        required=True,
        default=argparse.SUPPRESS,
        metavar="L",
        help="SwiftKV L: layers >= L take their KV from layer L's input (1 <= L < the model's layers)",
    )
    p.add_argument(
        "--key-value-group-size",
        type=int,
        default=1,
        metavar="G",
        help="AcrossKV G: layers >= L sharing one KV cache (must divide the number of layers - L)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace DST and everything in it when it already holds a checkpoint (a config.json)",
    )
    p.set_defaults(func=_convert)


def _read_prompts(args) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        try:
            text = args.prompts_file.read_text()
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"--prompts-file {args.prompts_file}: {reason}") from e
        prompts += [line for line in text.splitlines() if line.strip()]
    if not prompts:
        if sys.stdin.isatty():
            print("reading prompts from stdin, one per line (Ctrl-D to end)", file=sys.stderr)
        prompts = [line for line in sys.stdin.read().splitlines() if line.strip()]
    if not prompts:
        raise ValueError("no prompts: use --prompt, --prompts-file or stdin")
    return prompts


def _generate(args) -> None:
    from swiftkv_fast import LLM, SamplingParams

    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        min_tokens=args.min_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
    )
    prompts = _read_prompts(args)
    llm = LLM(args.model, **_engine_kwargs(args))
    start = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for i, (prompt, out) in enumerate(zip(prompts, outs)):
        print(f"--- [{i}] {prompt!r}")
        print(out.outputs[0].text)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(
        f"Throughput: {len(outs) / elapsed:.2f} requests/s, {(n_in + n_out) / elapsed:.1f} total tokens/s, "
        f"{n_out / elapsed:.1f} output tokens/s ({n_in} prompt + {n_out} output tokens in {elapsed:.2f} s)"
    )


def _serve(args) -> int:
    if importlib.util.find_spec("fastapi") is None or importlib.util.find_spec("uvicorn") is None:
        raise ValueError(
            "'swiftkv serve' needs the serve extra: pip install 'swiftkv-fast[serve]' "
            "(fastapi, uvicorn, prometheus-client, pydantic)"
        )
    if args.port is not None and not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_key is None:
        from swiftkv_fast import envs

        args.api_key = envs.SWIFTKV_API_KEY or None
    from swiftkv_fast.entrypoints.api_server import run_server

    return run_server(args, _engine_kwargs(args))


def _convert(args) -> None:
    from swiftkv_fast.model.loader import convert_to_swiftkv

    dst = convert_to_swiftkv(
        args.src, args.dst, args.num_key_value_layers, args.key_value_group_size, overwrite=args.overwrite
    )
    print(f"wrote {dst}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swiftkv",
        description="SwiftKV inference: prompt tokens that will not be sampled stop after layer L; the KV "
        "cache of the later layers is computed from layer L's input in one projection.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_convert(sub)
    for name, what in TRAINING_COMMANDS.items():  # listed here, run by swiftkv_distill (see main)
        sub.add_parser(name, help=what, add_help=False)
    return parser


# Commands that live in the optional swiftkv-distill package: `main` hands their whole command line to
# it, so generating and serving never import training code.
TRAINING_COMMANDS = {
    "distill": "make SwiftKV weights for a plain checkpoint (needs swiftkv-distill)",
    "eval": "compare a SwiftKV checkpoint with its teacher (needs swiftkv-distill)",
}


def _training_command_missing(command: str) -> str:
    return (
        f"'swiftkv {command}' needs the swiftkv-distill package: pip install swiftkv-distill "
        "(from this repository: pip install packages/distill)"
    )


# What our checks raise for bad input (ConfigError and CheckpointError are ValueErrors; OSError covers a
# missing or unreadable file). Any other exception is a bug and keeps its traceback (argparse types
# every flag, so a TypeError from here is one of ours).
USER_ERRORS = (ValueError, OSError)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in TRAINING_COMMANDS:  # whatever its arguments: they are swiftkv_distill's
        if importlib.util.find_spec("swiftkv_distill") is None:
            print(f"swiftkv: error: {_training_command_missing(argv[0])}", file=sys.stderr)
            return 2
        from swiftkv_distill.cli import main as training_main

        return training_main(argv)
    args = build_parser().parse_args(argv)
    try:
        status = args.func(args)  # None, or serve's exit status
    except USER_ERRORS as e:
        print(f"swiftkv: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("swiftkv: interrupted", file=sys.stderr)
        return 130
    return status or 0


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror and e.filename:  # raised by the OS: name the file
        return f"{e.strerror}: {e.filename}"
    return " ".join(line.strip() for line in str(e).splitlines() if line.strip()) or type(e).__name__


if __name__ == "__main__":
    raise SystemExit(main())
