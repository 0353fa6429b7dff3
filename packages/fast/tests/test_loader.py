"""Checkpoint directories as `LLM(dir)` loads them: Snowflake's own files, refusals that name the file."""

from __future__ import annotations

import pytest
import torch
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.model.loader import apply_swiftkv_options, load_checkpoint
from swiftkv_reference.checkpoint import CheckpointError, save_checkpoint, swiftkv_init
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


def test_weights_load_in_the_dtype_they_are_stored_in(tmp_path):
    """A bf16 checkpoint takes its own bytes while the engine is built, not fp32's; converted on the fly,
    Snowflake's init averages in fp32 whatever the stored dtype."""
    config = tiny_config(num_hidden_layers=4)
    state = {k: v.bfloat16() for k, v in random_state_dict(config).items()}
    save_checkpoint(tmp_path, config, state)
    _, loaded, _ = load_checkpoint(str(tmp_path), None, None)
    assert all(v.dtype == torch.bfloat16 for v in loaded.values() if v.is_floating_point())
    new_config, converted = apply_swiftkv_options(config, loaded, 2, 2)
    _, want = swiftkv_init(config, {k: v.float() for k, v in state.items()}, 2, 2)
    assert new_config.num_key_value_layers == 2 and converted.keys() == want.keys()
    assert all(torch.equal(converted[k], want[k]) for k in want)
    # an fp32 engine over the bf16 checkpoint: the same tokens as over its values loaded as fp32
    fp32 = {k: v.float() for k, v in state.items()}
    got = _tokens(LLM(str(tmp_path), dtype="float32", **ENGINE))
    assert got == _tokens(LLM.from_state_dict(config, fp32, dtype="float32", **ENGINE))
