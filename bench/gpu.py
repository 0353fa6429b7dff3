"""Short CUDA benchmark for `nox -s gpu` (a few minutes on one GPU), bf16:

  models   the embedded SmolLM2-135M-Instruct, and a random-weight model with Llama-3.1-8B's layer
           shapes (hidden 4096, 32 heads, 8 KV heads, intermediate 14336, vocab 128256) and 4 layers
  cases    prefill tokens/s with SwiftKV off (L = N) and on (L = N/2); decode tokens/s (short
           prompts, long outputs) with SwiftKV off, on, and on with the second-half CUDA graphs off
           (enforce_eager=True)

Prints a table and writes gpu.json + gpu.png into $OUT when that variable is set (else --out).
Without CUDA it prints that it needs CUDA and exits 0 (`nox -s gpu` skips such machines anyway).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from bench import engine, report
from bench.harness import Stats, paired_ratio, run_interleaved

log = logging.getLogger(__name__)

HELP = "short CUDA benchmark (embedded + Llama-3.1-8B-shaped model, bf16); needs CUDA"
LLAMA8B_SHAPES = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    rope_theta=500000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=[128001],
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--layers", type=int, default=4, help="layers of the 8B-shaped model (default 4, L=N/2)"
    )
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache per engine (default 4 GiB)")
    parser.add_argument(
        "--models",
        type=lambda s: s.split(","),
        default=["smollm2", "llama8b-shaped"],
        help="comma-separated: smollm2, llama8b-shaped",
    )


def run(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        print("bench gpu needs CUDA: no CUDA device here, nothing measured.")
        return 0
    out = Path(os.environ["OUT"]) if os.environ.get("OUT") else args.out
    repeat = args.repeat or 3
    warmup = 1 if args.warmup is None else args.warmup
    prefill = (4, 512) if args.quick else (16, 2048)  # prompts x tokens
    decode = (8, 16, 32) if args.quick else (64, 32, 128)  # prompts x tokens -> output tokens
    rows, failures = [], []
    for name in args.models:
        try:
            rows += _model(name, args, prefill, decode, repeat, warmup)
        except Exception as e:  # one model failing must not hide the other's numbers
            log.exception("model %s failed", name)
            failures.append(f"{name}: {type(e).__name__}: {e}")
        torch.cuda.empty_cache()
    table = report.Table(
        f"GPU ({torch.cuda.get_device_name(0)}), bf16, prefill {prefill[0]} x {prefill[1]} tokens, decode "
        f"{decode[0]} x {decode[1]} -> {decode[2]} tokens, {repeat} round(s)",
        ["model", "case", "L", "CUDA graph", "tokens/s", "ratio"],
    )
    for r in rows:
        table.add(
            r["model"],
            r["case"],
            r["num_key_value_layers"],
            "off" if r["enforce_eager"] else "on",
            r["tokens_per_second"],
            r.get("ratio_note"),
        )
    table.notes += [f"FAILED {f}" for f in failures]
    settings = {
        "prefill": prefill,
        "decode": decode,
        "repeat": repeat,
        "warmup": warmup,
        "dtype": "bfloat16",
        "llama8b_shapes": {**LLAMA8B_SHAPES, "num_hidden_layers": args.layers},
    }
    json_path = report.write_json(out, "gpu", settings, rows, failures=failures)
    png_path = plot(rows, out)
    report.finish([table], [json_path, png_path])
    return 1 if failures else 0


def _model(name: str, args, prefill, decode, repeat, warmup) -> list[dict]:
    import torch

    device = getattr(args, "device", "cuda")  # a CPU smoke test passes device="cpu" and small shapes
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    kw = dict(dtype=dtype, device=device, kv_cache_memory=int(args.kv_cache_gib * (1 << 30)))
    if name == "smollm2":
        from swiftkv_reference.checkpoint import load_config
        from swiftkv_reference.default_model import default_model_dir

        config = state = None
        n_layers = load_config(default_model_dir()).num_hidden_layers
    elif name == "llama8b-shaped":
        from swiftkv_reference.config import SwiftKVConfig
        from swiftkv_reference.testing import random_state_dict

        shapes = getattr(args, "shapes", LLAMA8B_SHAPES)
        config = SwiftKVConfig(**shapes, num_hidden_layers=args.layers)
        state = random_state_dict(config, dtype=dtype)
        n_layers = args.layers
    else:
        raise ValueError(f"unknown model {name!r}")
    half = n_layers // 2

    def build(L, eager):
        return engine.build_llm(L, config=config, state_dict=state, enforce_eager=eager, **kw)

    llms = {"off": (n_layers, False), "on": (half, False), "on-eager": (half, True)}
    built = {k: build(L, eager) for k, (L, eager) in llms.items()}
    vocab = next(iter(built.values())).config.vocab_size
    p_prompts = engine.random_prompts(prefill[0], prefill[1], vocab, seed=args.seed)
    d_prompts = engine.random_prompts(decode[0], decode[1], vocab, seed=args.seed + 1)

    def case(llm, prompts, max_tokens):
        def call():
            r = engine.run_batch(llm, prompts, max_tokens)
            if device == "cuda":
                torch.cuda.synchronize()
            return r.metrics()

        return call

    cases = {
        "prefill/off": case(built["off"], p_prompts, 1),
        "prefill/on": case(built["on"], p_prompts, 1),
        "decode/off": case(built["off"], d_prompts, decode[2]),
        "decode/on": case(built["on"], d_prompts, decode[2]),
        "decode/on-eager": case(built["on-eager"], d_prompts, decode[2]),
    }
    print(f"{name}: N={n_layers}, L={half}; {len(cases)} cases")
    samples = run_interleaved(cases, repeat=repeat, warmup=warmup, progress=True)
    tps = {}
    for key, ss in samples.items():
        field = "prompt_tokens" if key.startswith("prefill") else "output_tokens"
        tps[key] = [s.metrics[field] / s.seconds for s in ss]
    rows = []
    for key in cases:
        phase, mode = key.split("/")
        L, eager = llms[mode]
        row = {
            "model": name,
            "case": f"{phase} {mode}",
            "num_key_value_layers": L,
            "enforce_eager": eager,
            "tokens_per_second": Stats.of(tps[key]),
        }
        if key == "prefill/on":
            row["ratio"] = paired_ratio(tps[key], tps["prefill/off"])
            row["ratio_note"] = f"{row['ratio'].median:.2f}x prefill off"
        if key == "decode/on":
            row["ratio"] = paired_ratio(tps[key], tps["decode/on-eager"])
            row["ratio_note"] = f"{row['ratio'].median:.2f}x graph off"
        rows.append(row)
    del built
    return rows


@report.optional_plot
def plot(rows: list[dict], out: Path) -> Path:
    models = list(dict.fromkeys(r["model"] for r in rows)) or ["(none)"]
    fig, axes = report.new_figure(ncols=len(models), width=5)
    for ax, model in zip(axes, models):
        mine = [r for r in rows if r["model"] == model]
        if mine:
            report.bars(ax, [r["case"] for r in mine], [r["tokens_per_second"] for r in mine])
        ax.set_title(model)
        ax.set_ylabel("tokens/s")
        ax.tick_params(axis="x", labelrotation=30)
    fig.suptitle("GPU: SwiftKV on/off and second-half CUDA graphs (bf16)")
    return report.save_figure(fig, out, "gpu")
