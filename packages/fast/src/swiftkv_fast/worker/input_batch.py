"""One flat batch per step (model/model_input.py): positions, slot mappings, block tables and query
offsets as tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swiftkv_fast.attention.base import AttentionMetadata, ranges
from swiftkv_fast.model.model_input import GroupBatch, ModelInput


def pad_block_tables(tables: list[list[int]]) -> torch.Tensor:
    # -> (R, max_blocks) int32, padded with the null block 0
    width = max(1, max(len(t) for t in tables))
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


@dataclass
class StepInput:
    """What every rank needs of one step, as plain lists (rank 0 sends it to the tensor-parallel
    workers): the scheduled tokens, where each request starts, and the block tables."""

    token_ids: list[int]  # the scheduled tokens of every request, concatenated
    starts: list[int]  # per request: tokens already in the cache
    num_scheduled: list[int]  # per request: tokens scheduled this step
    sampled: list[bool]  # per request: its last scheduled token is sampled
    block_tables: list[list[list[int]]]  # [group][request] -> block ids


def build_model_input(step: StepInput, block_size: int, device: torch.device) -> ModelInput:
    token_ids, starts, num_scheduled = step.token_ids, step.starts, step.num_scheduled
    sampled, block_tables = step.sampled, step.block_tables
    starts_t = torch.tensor(starts, dtype=torch.int64)
    q_lens = torch.tensor(num_scheduled, dtype=torch.int64)
    num_reqs = len(starts)
    positions = ranges(starts_t, q_lens)  # (T,)
    req_of_tok = torch.repeat_interleave(torch.arange(num_reqs), q_lens)  # (T,)
    cu = F.pad(torch.cumsum(q_lens, 0), (1, 0))  # (R + 1,)
    seq_lens = starts_t + q_lens
    sampled_t = torch.tensor(sampled, dtype=torch.bool)
    logits_indices = (cu[1:] - 1)[sampled_t]
    groups = []
    for tables in block_tables:
        bt = pad_block_tables(tables)
        slots = bt[req_of_tok, positions // block_size].long() * block_size + positions % block_size
        meta = AttentionMetadata(
            cu_seqlens_q=cu.to(torch.int32).to(device),
            seq_lens=seq_lens.to(torch.int32).to(device),
            block_tables=bt.to(device),
            max_query_len=int(q_lens.max()),
            max_seq_len=int(seq_lens.max()),
        )
        groups.append(GroupBatch(meta, slots.to(device), bt[sampled_t].to(device)))
    return ModelInput(
        input_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        positions=positions.to(device),
        groups=groups,
        logits_indices=logits_indices.to(device),
        sampled_seq_lens=seq_lens[sampled_t].to(torch.int32).to(device),
        sampled_positions=(seq_lens[sampled_t] - 1).to(device),
    )
