"""`Batch`: right-padded token sequences with the answer tokens marked, the unit every stage consumes.

    batch = Batch.from_sequences([[1, 5, 9, 4], [1, 7]], answer_starts=[2, 1])
    batch.input_ids       # (B, T) long, right-padded with pad_token_id
    batch.attention_mask  # (B, T) bool, True at real tokens (a prefix of each row)
    batch.answer_mask     # (B, T) bool, True at answer tokens (the suffix from answer_starts[b])
    batch.logits_mask     # (B, T) bool, True at positions whose logits predict an answer token

Right padding is exact for the real tokens under causal attention: a real token never sees a pad.
Logits at position t predict token t + 1, so the scored positions (distillation loss, agreement,
perplexity) are `logits_mask`: answer_start - 1 <= t < length - 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class Batch:
    input_ids: torch.Tensor  # (B, T) long
    attention_mask: torch.Tensor  # (B, T) bool
    answer_mask: torch.Tensor  # (B, T) bool, a subset of attention_mask

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.dtype != torch.long:
            raise ValueError(
                f"input_ids must be a 2-D long tensor, "
                f"got {tuple(self.input_ids.shape)} {self.input_ids.dtype}"
            )
        for name in ("attention_mask", "answer_mask"):
            mask = getattr(self, name)
            if mask.shape != self.input_ids.shape or mask.dtype != torch.bool:
                raise ValueError(
                    f"{name} must be a bool tensor of shape {tuple(self.input_ids.shape)}, "
                    f"got {tuple(mask.shape)} {mask.dtype}"
                )
        if bool((self.answer_mask & ~self.attention_mask).any()):
            raise ValueError("answer_mask marks padding positions")
        lengths = self.attention_mask.sum(1, keepdim=True)  # (B, 1)
        prefix = torch.arange(self.input_ids.shape[1], device=lengths.device)[None, :] < lengths
        if not torch.equal(prefix, self.attention_mask):
            raise ValueError("attention_mask must be a prefix of each row (right padding)")

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[Sequence[int]],
        answer_starts: Sequence[int] | None = None,
        pad_token_id: int = 0,
    ) -> Batch:
        """Right-pad token id lists. answer_starts[b]: index of sequence b's first answer token
        (1 <= start <= len; None: every token after the first is an answer, as for plain text)."""
        if not sequences:
            raise ValueError("a batch needs at least one sequence")
        if answer_starts is None:
            answer_starts = [1] * len(sequences)
        if len(answer_starts) != len(sequences):
            raise ValueError(f"{len(answer_starts)} answer_starts for {len(sequences)} sequences")
        for b, (seq, start) in enumerate(zip(sequences, answer_starts)):
            if not seq:
                raise ValueError(f"sequence {b} is empty")
            if not 1 <= start <= len(seq):
                raise ValueError(f"sequence {b}: answer_start {start} outside [1, {len(seq)}]")
        width = max(len(seq) for seq in sequences)
        input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros(len(sequences), width, dtype=torch.bool)
        answer_mask = torch.zeros(len(sequences), width, dtype=torch.bool)
        for b, (seq, start) in enumerate(zip(sequences, answer_starts)):
            input_ids[b, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
            attention_mask[b, : len(seq)] = True
            answer_mask[b, start : len(seq)] = True
        return cls(input_ids, attention_mask, answer_mask)

    @property
    def logits_mask(self) -> torch.Tensor:
        """(B, T) bool: positions t whose logits predict an answer token (answer_mask shifted left)."""
        out = torch.zeros_like(self.answer_mask)
        out[:, :-1] = self.answer_mask[:, 1:]
        return out

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device), self.attention_mask.to(device), self.answer_mask.to(device))
