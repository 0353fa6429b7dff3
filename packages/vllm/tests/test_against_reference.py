"""vLLM with the plugin gives the reference's greedy tokens and logprobs on every SwiftKV model shape,
with fast prefill off and on; with it on, also under chunked prefill and on prefix-cache hits."""

from __future__ import annotations

import pytest
from helpers import MODELS, fast_prefill_twice, matches_reference_once, write_checkpoint


@pytest.mark.parametrize("name", list(MODELS))
def test_greedy_tokens_and_logprobs_equal_the_reference_without_fast_prefill(tmp_path, name):
    matches_reference_once(*write_checkpoint(tmp_path, **MODELS[name]))


@pytest.mark.parametrize("name", list(MODELS))
def test_fast_prefill_chunked_and_prefix_hits_equal_the_reference(tmp_path, name):
    """16-token steps split the 45-token prompt; the second round hits its first 32-token block (vLLM's
    CPU attention takes blocks of multiples of 32)."""
    path, config, state = write_checkpoint(tmp_path, **MODELS[name])
    second = fast_prefill_twice(path, config, state)
    assert second[0][2] >= 32, f"the 45-token prompt's second run hit only {second[0][2]} cached tokens"
