"""KV cache bytes per token and maximum concurrency for a fixed cache size, across SwiftKV L and
AcrossKV G, read from the engine's real allocation (kv_cache.nbytes / (blocks x block_size)) beside
the formula

    bytes/token = 2 * (L + (N - L) / G) * kv_heads * head_dim * element_bytes

(K and V, for L own layers plus one shared cache per AcrossKV group). SwiftKV alone (G = 1) keeps a
cache for every layer; only G > 1 saves memory, or `--kv-cache-dtype bfloat16` (the engine's
kv_cache_dtype: 2 bytes per value instead of fp32's 4, for K/V of 8 significant bits). Nothing is
timed here.

Under tensor parallelism over TP ranks (`--tensor-parallel-size`, default 3: the embedded model's 9
heads and 3 K/V heads split 1 and 3 ways, not 2) each rank holds kv_heads / TP of the K/V heads (1 when
TP > kv_heads: replicated), so the formula's kv_heads is the rank's, and the same cache budget per rank
(`kv_cache_memory`) holds TP times the blocks: TP times the concurrency. The per-rank columns are rank
0's allocated tensor (every rank holds as many blocks). `python -m bench tp` has the same figures at
TP = 1, 2, 3, and the step time."""

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
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "bfloat16"],
        help="what the KV cache holds (the engine's kv_cache_dtype; auto: fp32, the model's dtype)",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=3,
        help="N of the per-rank columns (default 3; 1: none); N - 1 worker processes per row",
    )


def formula_bytes_per_token(n_layers: int, L: int, G: int, kv_heads: int, head_dim: int, elem: int) -> float:
    return 2 * (L + (n_layers - L) / G) * kv_heads * head_dim * elem


def kv_heads_per_rank(kv_heads: int, tensor_parallel_size: int) -> int:
    """K/V heads one of TP ranks holds: kv_heads / TP, or 1 when TP > kv_heads (each head replicated on
    TP / kv_heads ranks)."""
    return kv_heads // tensor_parallel_size if kv_heads >= tensor_parallel_size else 1


def build(
    config,
    state_dict: dict | None,
    L: int | None,
    G: int | None,
    kv_cache_memory: int,
    request_len: int,
    tensor_parallel_size: int = 1,
    **build_kw,
) -> tuple:
    """The engine of a KV measurement (`kv_cache_memory` bytes per rank, room for `request_len`-token
    requests): (llm, None), or (None, the engine's message) for a tensor_parallel_size the model cannot
    be split by. `state_dict` None: the embedded model (`config` is its config)."""
    try:
        llm = engine.build_llm(
            L,
            G,
            config=config,
            state_dict=state_dict,
            kv_cache_memory=kv_cache_memory,
            max_model_len=max(request_len, 16),
            tensor_parallel_size=tensor_parallel_size,
            **build_kw,
        )
    except ValueError as e:
        if f"tensor_parallel_size={tensor_parallel_size} does not divide" not in str(e):
            raise
        return None, str(e)
    return llm, None


def kv_row(llm, tensor_parallel_size: int, request_len: int) -> dict:
    """KV bytes per token and blocks of the engine's allocation (rank 0's tensor under tensor
    parallelism: every rank holds as many blocks) beside the formula at the rank's K/V heads, and max
    concurrency for `request_len`-token requests."""
    config = llm.config
    n_layers, L, G = config.num_hidden_layers, config.num_key_value_layers, config.key_value_group_size
    a = engine.kv_allocation(llm)
    heads = kv_heads_per_rank(config.num_key_value_heads, tensor_parallel_size)
    formula = formula_bytes_per_token(n_layers, L, G, heads, config.head_dim, a["element_bytes"])
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "num_key_value_layers": L,
        "key_value_group_size": G,
        **a,
        "formula_bytes_per_token": formula,
        "matches_formula": a["bytes_per_token"] == formula,
        "kv_fraction_of_full": a["cache_layers"] / n_layers,
        "request_len": request_len,
        "max_concurrency": (a["num_blocks"] - 1) / -(-request_len // a["block_size"]),
    }


def measure(
    config, state_dict, L, G, kv_cache_memory, request_len, tensor_parallel_size=1, kv_cache_dtype="auto"
) -> dict:
    """`kv_row` of a fresh engine (shut down after), or {"refused": the engine's message}."""
    llm, refused = build(
        config,
        state_dict,
        L,
        G,
        kv_cache_memory,
        request_len,
        tensor_parallel_size,
        kv_cache_dtype=kv_cache_dtype,
    )
    if llm is None:
        return {
            "tensor_parallel_size": tensor_parallel_size,
            "num_key_value_layers": L,
            "key_value_group_size": G,
            "refused": refused,
        }
    try:
        return kv_row(llm, tensor_parallel_size, request_len)
    finally:
        llm.shutdown()


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
    tp = args.tensor_parallel_size
    kv_dtype = args.kv_cache_dtype
    kv_name = "bfloat16" if kv_dtype == "bfloat16" else "float32"  # auto: the model's fp32
    rows = []
    for L, G in splits(n_layers, args.quick):
        row = measure(config, state, L, G, budget, args.request_len, kv_cache_dtype=kv_dtype)
        if tp > 1:  # the workers read their shards from the checkpoint directory
            row["tensor_parallel"] = measure(config, None, L, G, budget, args.request_len, tp, kv_dtype)
        rows.append(row)
    full = rows[0]
    per_rank = [] if tp == 1 else [f"TP={tp} bytes/token/rank", f"TP={tp} max concurrency"]
    table = report.Table(
        f"KV memory, SmolLM2-135M-Instruct fp32 (N={n_layers}), KV cache {kv_name}, {args.cache_mib} MiB "
        "cache (per rank), "
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
            *per_rank,
        ],
    )
    for r in rows:
        table.add(
            r["num_key_value_layers"],
            r["key_value_group_size"],
            r["cache_layers"],
            r["bytes_per_token"],
            _formula_cell(r),
            f"{100 * r['kv_fraction_of_full']:.0f}%",
            r["num_blocks"],
            f"{r['max_concurrency']:.2f}",
            f"{r['max_concurrency'] / max(full['max_concurrency'], 1):.2f}x",
            *_per_rank_cells(r.get("tensor_parallel")),
        )
    table.notes.append(
        "bytes/token and blocks: from the engine's allocated kv_cache tensor; "
        "max concurrency: (blocks - 1 null block) / blocks per request (as the engine logs it)."
    )
    if tp > 1:
        table.notes.append(
            f"TP={tp}: tensor_parallel_size={tp}, rank 0's tensor, the same {args.cache_mib} MiB on each "
            "rank; (!) marks a mismatch with the formula at the rank's K/V heads."
        )
    settings = {
        "cache_mib": args.cache_mib,
        "request_len": args.request_len,
        "num_hidden_layers": n_layers,
        "tensor_parallel_size": tp,
        "dtype": "float32",
        "kv_cache_dtype": kv_name,
    }
    json_path = report.write_json(args.out, "memory", settings, rows)
    png_path = plot(rows, args.out)
    report.finish([table], [json_path, png_path])
    checked = rows + [r["tensor_parallel"] for r in rows if "tensor_parallel" in r]
    return 0 if all(r.get("matches_formula") for r in checked) else 1


def _formula_cell(row: dict) -> str:
    return f"{row['formula_bytes_per_token']:,.0f}" + ("" if row["matches_formula"] else " (!)")


def _per_rank_cells(row: dict | None) -> list:
    if row is None:
        return []
    if "refused" in row:
        return ["refused", "-"]
    bytes_cell = f"{row['bytes_per_token']:,}" + ("" if row["matches_formula"] else " (!)")
    return [bytes_cell, f"{row['max_concurrency']:.2f}"]


@report.optional_plot
def plot(rows: list[dict], out: Path) -> Path:
    fig, (ax_b, ax_c) = report.new_figure(ncols=2)
    labels = [f"L={r['num_key_value_layers']}\nG={r['key_value_group_size']}" for r in rows]
    xs = range(len(rows))
    tp = [r["tensor_parallel"] for r in rows if "bytes_per_token" in r.get("tensor_parallel", {})]
    width = 0.27 if tp else 0.4
    ax_b.bar([x - width for x in xs], [r["bytes_per_token"] for r in rows], width, label="allocated")
    ax_b.bar(list(xs), [r["formula_bytes_per_token"] for r in rows], width, label="formula")
    ax_c.bar([x - width / 2 for x in xs], [r["max_concurrency"] for r in rows], width, label="one process")
    if len(tp) == len(rows):
        n = tp[0]["tensor_parallel_size"]
        ax_b.bar(
            [x + width for x in xs], [r["bytes_per_token"] for r in tp], width, label=f"per rank, TP={n}"
        )
        ax_c.bar([x + width / 2 for x in xs], [r["max_concurrency"] for r in tp], width, label=f"TP={n}")
    ax_b.set_ylabel("KV bytes / token")
    ax_c.set_ylabel("max concurrent requests")
    for ax in (ax_b, ax_c):
        ax.set_xticks(list(xs), labels, fontsize=7)
        ax.legend(fontsize=8)
    fig.suptitle("SwiftKV + AcrossKV (+ tensor parallelism): KV memory for a fixed cache size per rank")
    return report.save_figure(fig, out, "memory")
