"""Checkpoint I/O, name matching, the SwiftKV conversion init rules, and bad checkpoints."""

import json

import pytest
import torch
from swiftkv_reference.checkpoint import (
    CheckpointError,
    check_state_dict,
    convert_to_swiftkv,
    expected_parameter_names,
    load_config,
    load_model,
    load_state_dict,
    save_checkpoint,
    swiftkv_init,
)
from swiftkv_reference.testing import random_state_dict, tiny_config, tiny_model


def _ids():
    return torch.arange(3, 23)


@pytest.mark.parametrize("shard", [None, 40_000])
def test_round_trip(tmp_path, shard):
    config = tiny_config(
        model_type="qwen2_swiftkv",
        num_hidden_layers=4,
        num_key_value_layers=2,
        key_value_group_size=2,
        tie_word_embeddings=True,
    )
    model = tiny_model(config, seed=1)
    save_checkpoint(tmp_path, config, model.state_dict(), max_shard_bytes=shard)
    if shard:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 1
    assert load_config(tmp_path) == config
    assert set(load_state_dict(tmp_path)) == set(expected_parameter_names(config))
    assert torch.equal(load_model(tmp_path)(_ids()), model(_ids()))


def test_names():
    config = tiny_config(num_hidden_layers=6, num_key_value_layers=2, key_value_group_size=2)
    names = expected_parameter_names(config)
    assert "model.norm_swiftkv.weight" in names and "lm_head.weight" in names
    assert [n for n in names if "k_proj_swiftkv" in n] == [
        "model.layers.2.self_attn.k_proj_swiftkv.weight",
        "model.layers.4.self_attn.k_proj_swiftkv.weight",
    ]
    assert [n for n in names if "q_proj_swiftkv" in n] == [
        f"model.layers.{i}.self_attn.q_proj_swiftkv.weight" for i in range(2, 6)
    ]
    assert sorted(names) == sorted(tiny_model(config).state_dict())
    assert "lm_head.weight" not in expected_parameter_names(tiny_config(tie_word_embeddings=True))
    qwen = expected_parameter_names(tiny_config(model_type="qwen2"))
    assert (
        "model.layers.0.self_attn.q_proj.bias" in qwen and "model.layers.0.self_attn.o_proj.bias" not in qwen
    )


def test_check_state_dict_names_every_problem():
    config = tiny_config(num_hidden_layers=4, num_key_value_layers=2, key_value_group_size=2)
    state = random_state_dict(config)
    check_state_dict(config, state)
    bad = dict(state)
    del bad["model.layers.2.self_attn.k_proj_swiftkv.weight"]  # the leader's
    bad["model.layers.3.self_attn.k_proj_swiftkv.weight"] = state["model.layers.2.self_attn.k_proj.weight"]
    bad["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointError) as e:
        check_state_dict(config, bad)
    msg = str(e.value)
    assert "missing (1): ['model.layers.2.self_attn.k_proj_swiftkv.weight']" in msg
    assert "unexpected (1): ['model.layers.3.self_attn.k_proj_swiftkv.weight']" in msg
    assert "model.layers.0.self_attn.q_proj.weight: expected (64, 64), got (3, 3)" in msg
    # k_proj never stands in for k_proj_swiftkv
    renamed = {k.replace("k_proj_swiftkv", "k_proj_swift"): v for k, v in state.items()}
    with pytest.raises(CheckpointError, match="missing"):
        check_state_dict(config, renamed)


def test_conversion_init_rules(tmp_path):
    plain = tiny_config(model_type="qwen2", num_hidden_layers=6)
    state = random_state_dict(plain, seed=2)
    save_checkpoint(tmp_path / "src", plain, state)
    (tmp_path / "src" / "tokenizer.json").write_text("{}")
    dst = convert_to_swiftkv(
        tmp_path / "src", tmp_path / "dst", num_key_value_layers=2, key_value_group_size=2
    )
    config = load_config(dst)
    assert (config.model_type, config.num_key_value_layers, config.key_value_group_size) == (
        "qwen2_swiftkv",
        2,
        2,
    )
    assert (dst / "tokenizer.json").is_file()
    out = load_state_dict(dst)
    for name, t in state.items():  # the teacher is kept unchanged
        assert torch.equal(out[name], t)
    assert torch.equal(out["model.norm_swiftkv.weight"], state["model.layers.2.input_layernorm.weight"])
    for i in range(2, 6):
        for p in ("weight", "bias"):
            assert torch.equal(
                out[f"model.layers.{i}.self_attn.q_proj_swiftkv.{p}"],
                state[f"model.layers.{i}.self_attn.q_proj.{p}"],
            )
    for leader in (2, 4):
        for proj in ("k_proj", "v_proj"):
            for p in ("weight", "bias"):
                mean = (
                    state[f"model.layers.{leader}.self_attn.{proj}.{p}"]
                    + state[f"model.layers.{leader + 1}.self_attn.{proj}.{p}"]
                ) / 2
                got = out[f"model.layers.{leader}.self_attn.{proj}_swiftkv.{p}"]
                assert torch.allclose(got, mean, atol=1e-6)
    model = load_model(dst)
    # the teacher path of the converted model is the source model
    assert torch.equal(model(_ids(), swiftkv=False), load_model(tmp_path / "src")(_ids()))
    with pytest.raises(CheckpointError, match="already a SwiftKV"):
        swiftkv_init(config, out, 2, 2)


def test_bad_checkpoints(tmp_path):
    config = tiny_config()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_state_dict(tmp_path)
    save_checkpoint(tmp_path / "sharded", config, random_state_dict(config), max_shard_bytes=40_000)
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())
    (tmp_path / "sharded" / next(iter(index["weight_map"].values()))).unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_state_dict(tmp_path / "sharded")
    with pytest.raises(CheckpointError, match="missing"):
        save_checkpoint(tmp_path / "x", config, {})
    # a state dict of another config fails loudly at load
    save_checkpoint(tmp_path / "other", config, random_state_dict(config))
    tiny_config(num_hidden_layers=3).save(tmp_path / "other")
    with pytest.raises(CheckpointError, match="unexpected"):
        load_model(tmp_path / "other")


def test_pickle_only_with_weights_only(tmp_path):
    config = tiny_config()
    state = random_state_dict(config)
    config.save(tmp_path)
    torch.save(state, tmp_path / "pytorch_model.bin")
    assert torch.equal(load_model(tmp_path)(_ids()), tiny_model(config)(_ids()))
    torch.save({"x": object()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception, match="[Ww]eights only"):
        load_state_dict(tmp_path)


def test_tied_checkpoint_with_a_redundant_lm_head(tmp_path):
    config = tiny_config(tie_word_embeddings=True)
    state = random_state_dict(config)
    config.save(tmp_path)
    from safetensors.torch import save_file

    save_file(
        {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
        str(tmp_path / "model.safetensors"),
    )
    assert torch.equal(load_model(tmp_path)(_ids()), tiny_model(config)(_ids()))
