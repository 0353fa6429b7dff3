"""Which part of each checkpoint tensor one tensor-parallel rank keeps (vLLM's sharding).

    q_proj, k_proj, v_proj, q/k/v_proj_swiftkv, gate_proj, up_proj   column-parallel: rows of its heads
    o_proj, down_proj                                                row-parallel: columns; all-reduce
    embed_tokens, lm_head                                            vocab-parallel: rows of its vocab
    norms                                                            replicated

Rank r of N keeps query heads [r nh/N, (r+1) nh/N). K/V heads are split the same way when N divides
them; with fewer K/V heads than ranks each one is replicated on N / kvh consecutive ranks (the ranks
whose query heads read it). The fused SwiftKV K/V projection is split by K/V head like k/v_proj, so
each rank writes only its own heads' cache and holds 1/N of the KV cache (1/kvh when replicated).

Worked example, the embedded SmolLM2 (9 heads, 3 K/V heads, intermediate 1536, vocab 49152) at N = 3:
rank 1 keeps q heads 3..5 (rows 192..383 of q_proj), K/V head 1, intermediate rows 512..1023 of
gate/up (and those columns of down), vocab rows 16384..32767.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class TensorParallelShard:
    rank: int
    size: int
    num_heads: int  # query heads of this rank
    num_kv_heads: int  # K/V heads of this rank (1 when replicated)
    kv_head_start: int  # its first K/V head in the model
    vocab_start: int
    vocab_size: int  # rows of the embedding / lm_head this rank keeps

    @classmethod
    def of(cls, config, rank: int, size: int) -> TensorParallelShard:
        check_tensor_parallel(config, size)
        nh, kvh = config.num_attention_heads, config.num_key_value_heads
        if kvh >= size:
            local_kv, kv_start = kvh // size, rank * (kvh // size)
        else:
            local_kv, kv_start = 1, rank // (size // kvh)
        vocab = config.vocab_size // size
        return cls(rank, size, nh // size, local_kv, kv_start, rank * vocab, vocab)


def check_tensor_parallel(config, size: int) -> None:
    """ValueError naming every model dimension that `size` ranks cannot split."""
    problems = []
    nh, kvh = config.num_attention_heads, config.num_key_value_heads
    if nh % size:
        problems.append(f"num_attention_heads={nh}")
    if kvh % size and size % kvh:
        problems.append(f"num_key_value_heads={kvh} (neither divides the other)")
    if config.intermediate_size % size:
        problems.append(f"intermediate_size={config.intermediate_size}")
    if config.vocab_size % size:
        problems.append(f"vocab_size={config.vocab_size}")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's "
            + ", ".join(problems)
            + ": choose a tensor_parallel_size that does"
        )


def shard_state_dict(config, state_dict: dict[str, torch.Tensor], shard: TensorParallelShard):
    """The rank's slices of every tensor, under the same names: copies, so the whole checkpoint can be
    freed once every rank has its shard."""
    hd = config.head_dim
    r, n = shard.rank, shard.size
    q_rows = slice(r * shard.num_heads * hd, (r + 1) * shard.num_heads * hd)
    kv_rows = slice(shard.kv_head_start * hd, (shard.kv_head_start + shard.num_kv_heads) * hd)
    inter = config.intermediate_size // n
    mlp_rows = slice(r * inter, (r + 1) * inter)
    vocab_rows = slice(shard.vocab_start, shard.vocab_start + shard.vocab_size)
    out = {}
    for name, t in state_dict.items():
        parts = name.split(".")
        module = parts[-2] if len(parts) >= 2 else ""
        if module in ("q_proj", "q_proj_swiftkv"):
            t = t[q_rows]
        elif module in ("k_proj", "v_proj", "k_proj_swiftkv", "v_proj_swiftkv"):
            t = t[kv_rows]
        elif module in ("gate_proj", "up_proj"):
            t = t[mlp_rows]
        elif module == "o_proj":
            t = t[:, q_rows]
        elif module == "down_proj":
            t = t[:, mlp_rows]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            t = t[vocab_rows]
        else:
            out[name] = t
            continue
        out[name] = t.clone(memory_format=torch.contiguous_format)
    return out
