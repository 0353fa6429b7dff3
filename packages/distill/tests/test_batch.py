"""`Batch`: right padding, the answer and scored positions, and refusals of malformed input."""

from __future__ import annotations

import pytest
import torch
from swiftkv_distill.batch import Batch


def test_from_sequences_pads_right_and_marks_answers():
    batch = Batch.from_sequences([[1, 5, 9, 4], [1, 7]], answer_starts=[2, 1], pad_token_id=0)
    assert batch.input_ids.tolist() == [[1, 5, 9, 4], [1, 7, 0, 0]]
    assert batch.attention_mask.tolist() == [[True] * 4, [True, True, False, False]]
    assert batch.answer_mask.tolist() == [[False, False, True, True], [False, True, False, False]]
    # logits at t predict token t + 1: the scored positions are answer_start - 1 .. length - 2
    assert batch.logits_mask.tolist() == [[False, True, True, False], [True, False, False, False]]
    assert batch.num_tokens == 6
    plain = Batch.from_sequences([[3, 4, 5]])  # plain text: every token after the first is an answer
    assert plain.answer_mask.tolist() == [[False, True, True]]


def test_malformed_input_is_refused():
    with pytest.raises(ValueError, match="at least one sequence"):
        Batch.from_sequences([])
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        Batch.from_sequences([[1], []])
    with pytest.raises(ValueError, match=r"sequence 0: answer_start 3 outside \[1, 2\]"):
        Batch.from_sequences([[1, 2]], answer_starts=[3])
    with pytest.raises(ValueError, match="2 answer_starts for 1 sequences"):
        Batch.from_sequences([[1, 2]], answer_starts=[1, 1])
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="prefix of each row"):
        Batch(ids, torch.tensor([[True, False, True]]), torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="answer_mask marks padding"):
        Batch(ids, torch.tensor([[True, True, False]]), torch.tensor([[False, False, True]]))
    with pytest.raises(ValueError, match="attention_mask must be a bool tensor"):
        Batch(ids, torch.ones(1, 3), torch.zeros(1, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="input_ids must be a 2-D long tensor"):
        Batch(ids[0], torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool))
