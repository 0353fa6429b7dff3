"""What the model reads of one step: the flat batch of scheduled tokens as tensors (built by
worker/input_batch.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from swiftkv_fast.attention.base import AttentionMetadata


@dataclass
class GroupBatch:
    """The scheduled batch seen by the layers of one kvcache group (one attention type)."""

    meta: AttentionMetadata  # all scheduled requests
    slot_mapping: torch.Tensor  # (T,) int64
    sampled_block_tables: torch.Tensor  # (S, max_blocks) int32: rows of the sampled requests


@dataclass
class ModelInput:
    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64
    groups: list[GroupBatch]  # one per kvcache group
    logits_indices: torch.Tensor  # (S,) int64: the token of each sampled request in the flat batch
    sampled_seq_lens: torch.Tensor  # (S,) int32: context of each sampled request after this step
    sampled_positions: torch.Tensor  # (S,) int64: position of each sampled token (sampled_seq_lens - 1)

    @property
    def sampled_block_tables(self) -> tuple[torch.Tensor, ...]:
        """One (S, max_blocks) int32 table per kvcache group: the second half's block tables."""
        return tuple(g.sampled_block_tables for g in self.groups)
