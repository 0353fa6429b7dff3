"""KV cache bytes per token and maximum concurrency for a fixed cache size, across SwiftKV L and
AcrossKV G, read from the engine's real allocation (kv_cache.nbytes / (blocks x block_size)) beside
the formula

    bytes/token = 2 * (L + (N - L) / G) * kv_heads * head_dim * element_bytes

(K and V, for L own layers plus one shared cache per AcrossKV group). SwiftKV alone (G = 1) keeps a
cache for every layer; only G > 1 saves memory. Nothing is timed here."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from bench import engine, report

log = logging.getLogger(__name__)

HELP = "KV bytes/token and max concurrency across L and G (AcrossKV), measured vs formula"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cache-mib", type=int, default=256, help="KV cache size in MiB (default 256)")
    parser.add_argument("--request-len", type=int, default=2048, help="tokens per request (default 2048)")


def formula_bytes_per_token(n_layers: int, L: int, G: int, kv_heads: int, head_dim: int, elem: int) -> float:
    return 2 * (L + (n_layers - L) / G) * kv_heads * head_dim * elem


def splits(n_layers: int, quick: bool) -> list[tuple[int, int]]:
    """(L, G) pairs: L = N, 3N/4 and N/2, each with the group sizes that divide N - L."""
    out = [(n_layers, 1)]
    for L in [n_layers // 2] if quick else [3 * n_layers // 4, n_layers // 2]:
        gs = [g for g in range(1, n_layers - L + 1) if (n_layers - L) % g == 0]
        out += [(L, g) for g in (gs[:2] if quick else gs[:5])]
    return out


def run(args: argparse.Namespace) -> int:
    from swiftkv_reference.checkpoint import load_config, load_state_dict
    from swiftkv_reference.default_model import default_model_dir

    model_dir = default_model_dir()
    config, state = load_config(model_dir), load_state_dict(model_dir)
    n_layers = config.num_hidden_layers
    budget = args.cache_mib << 20
    rows = []
    for L, G in splits(n_layers, args.quick):
        llm = engine.build_llm(
            L,
            G,
            config=config,
            state_dict=state,
            kv_cache_memory=budget,
            max_model_len=max(args.request_len, 16),
        )
        a = engine.kv_allocation(llm)
        del llm
        formula = formula_bytes_per_token(n_layers, L, G, a["kv_heads"], a["head_dim"], a["element_bytes"])
        per_request = -(-args.request_len // a["block_size"])
        rows.append(
            {
                "num_key_value_layers": L,
                "key_value_group_size": G,
                **a,
                "formula_bytes_per_token": formula,
                "matches_formula": a["bytes_per_token"] == formula,
                "kv_fraction_of_full": a["cache_layers"] / n_layers,
                "max_concurrency": (a["num_blocks"] - 1) / per_request,
            }
        )
    full = rows[0]
    table = report.Table(
        f"KV memory, SmolLM2-135M-Instruct fp32 (N={n_layers}), {args.cache_mib} MiB cache, "
        f"{args.request_len}-token requests",
        [
            "L",
            "G",
            "cache layers",
            "bytes/token",
            "formula",
            "of full",
            "blocks",
            "max concurrency",
            "x full",
        ],
    )
    for r in rows:
        table.add(
            r["num_key_value_layers"],
            r["key_value_group_size"],
            r["cache_layers"],
            r["bytes_per_token"],
            f"{r['formula_bytes_per_token']:,.0f}" + ("" if r["matches_formula"] else " (!)"),
            f"{100 * r['kv_fraction_of_full']:.0f}%",
            r["num_blocks"],
            f"{r['max_concurrency']:.2f}",
            f"{r['max_concurrency'] / max(full['max_concurrency'], 1):.2f}x",
        )
    table.notes.append(
        "bytes/token and blocks: from the engine's allocated kv_cache tensor; "
        "max concurrency: (blocks - 1 null block) / blocks per request (as the engine logs it)."
    )
    settings = {
        "cache_mib": args.cache_mib,
        "request_len": args.request_len,
        "num_hidden_layers": n_layers,
        "dtype": "float32",
    }
    json_path = report.write_json(args.out, "memory", settings, rows)
    png_path = plot(rows, args.out)
    report.finish([table], [json_path, png_path])
    return 0 if all(r["matches_formula"] for r in rows) else 1


def plot(rows: list[dict], out: Path) -> Path:
    fig, (ax_b, ax_c) = report.new_figure(ncols=2)
    labels = [f"L={r['num_key_value_layers']}\nG={r['key_value_group_size']}" for r in rows]
    xs = range(len(rows))
    ax_b.bar([x - 0.2 for x in xs], [r["bytes_per_token"] for r in rows], 0.4, label="allocated")
    ax_b.bar([x + 0.2 for x in xs], [r["formula_bytes_per_token"] for r in rows], 0.4, label="formula")
    ax_b.set_ylabel("KV bytes / token")
    ax_b.legend()
    ax_c.bar(xs, [r["max_concurrency"] for r in rows], color="C2")
    ax_c.set_ylabel("max concurrent requests")
    for ax in (ax_b, ax_c):
        ax.set_xticks(list(xs), labels, fontsize=7)
    fig.suptitle("SwiftKV + AcrossKV: KV memory for a fixed cache size")
    return report.save_figure(fig, out, "memory")
