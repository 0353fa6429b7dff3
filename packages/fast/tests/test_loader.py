"""Checkpoint directories as `LLM(dir)` loads them: Snowflake's own files, refusals that name the file."""

from __future__ import annotations

import pytest
from swiftkv_fast import LLM, SamplingParams
from swiftkv_reference.checkpoint import CheckpointError, save_checkpoint
from swiftkv_reference.testing import random_state_dict, save_snowflake_checkpoint, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE = dict(max_model_len=64, num_kv_blocks=32)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_a_snowflake_checkpoint_with_l_equal_n(tmp_path):
    """Snowflake's LlamaSwiftKVModel writes model.norm_swiftkv.weight also at L == N: unused, accepted."""
    config = tiny_config(num_hidden_layers=4)
    state = save_snowflake_checkpoint(tmp_path, config, seed=3)
    llm = LLM(str(tmp_path), **ENGINE)
    assert (llm.config.model_type, llm.config.num_key_value_layers) == ("llama_swiftkv", 4)
    assert _tokens(llm) == _tokens(LLM.from_state_dict(config, state, **ENGINE))


def test_directories_that_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"), **ENGINE)
    config = tiny_config(num_hidden_layers=2)
    save_checkpoint(tmp_path / "both", config, random_state_dict(config), max_shard_bytes=100_000)
    save_checkpoint(tmp_path / "single", config, random_state_dict(config, seed=1))
    (tmp_path / "single" / "model.safetensors").rename(tmp_path / "both" / "model.safetensors")
    with pytest.raises(CheckpointError, match="both model.safetensors and model.safetensors.index.json"):
        LLM(str(tmp_path / "both"), **ENGINE)
