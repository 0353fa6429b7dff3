"""SwiftKVConfig: reading and writing Hugging Face configs, derived helpers, every bad-input error."""

import json

import pytest
from swiftkv_reference.config import ConfigError, SwiftKVConfig
from swiftkv_reference.testing import tiny_config

transformers = pytest.importorskip("transformers")


def test_round_trip_and_save(tmp_path):
    for cfg in [
        tiny_config(),
        tiny_config(
            model_type="llama_swiftkv",
            num_hidden_layers=6,
            num_key_value_layers=2,
            key_value_group_size=2,
            tie_word_embeddings=True,
            eos_token_id=[2, 3],
        ),
        tiny_config(model_type="mistral", sliding_window=8),
        tiny_config(
            model_type="qwen2_swiftkv",
            num_hidden_layers=4,
            num_key_value_layers=2,
            sliding_window=3,
            layer_types=["full_attention"] * 2 + ["sliding_attention"] * 2,
        ),
    ]:
        assert SwiftKVConfig.from_hf(cfg.to_hf()) == cfg
        cfg.save(tmp_path / cfg.model_type)
        assert SwiftKVConfig.from_hf(tmp_path / cfg.model_type) == cfg
        assert SwiftKVConfig.from_hf(tmp_path / cfg.model_type / "config.json") == cfg


def test_llama_swiftkv_config_json():
    cfg = tiny_config(num_hidden_layers=6, num_key_value_layers=4)  # model_type llama, L < N
    hf = cfg.to_hf()
    assert hf["model_type"] == "llama_swiftkv"
    assert hf["architectures"] == ["LlamaSwiftKVForCausalLM"]
    assert (hf["num_key_value_layers"], hf["key_value_group_size"], hf["swiftkv"]) == (4, 1, True)
    assert "num_key_value_layers" not in tiny_config().to_hf()
    # transformers reads our llama config.json (the SwiftKV fields ride along as extra attributes)
    theirs = transformers.LlamaConfig(**json.loads(json.dumps(hf)))
    assert theirs.num_hidden_layers == 6 and theirs.num_key_value_layers == 4


def test_defaults_and_helpers():
    cfg = SwiftKVConfig.from_hf(
        {
            "model_type": "llama_swiftkv",
            "vocab_size": 10,
            "hidden_size": 64,
            "intermediate_size": 8,
            "num_hidden_layers": 7,
            "num_attention_heads": 4,
            "eos_token_id": 2,
            "num_key_value_layers": 1,
            "key_value_group_size": 3,
            "rope_scaling": {"type": "default"},
        }
    )
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == 4 and cfg.eos_token_id == [2]
    assert cfg.rope_scaling is None and cfg.num_cache_layers == 3
    assert [cfg.cache_layer(i) for i in range(7)] == [0, 1, 1, 1, 2, 2, 2]
    assert [cfg.group_leader(i) for i in range(7)] == [0, 1, 1, 1, 4, 4, 4]
    assert cfg.window(3) is None
    assert SwiftKVConfig.from_hf({**cfg.to_hf(), "num_key_value_layers": None}).num_key_value_layers == 7
    with pytest.raises(IndexError):
        cfg.window(7)
    mistral = tiny_config(model_type="mistral", sliding_window=5)
    assert mistral.window(0) == 5 and mistral.cache_window(0) == 5


def test_transformers5_rope_parameters():
    hf = tiny_config().to_hf()
    del hf["rope_theta"], hf["rope_scaling"]
    hf["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 5e5,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg = SwiftKVConfig.from_hf(hf)
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3"


MIX = ["full_attention", "sliding_attention"]


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(model_type="gpt2"), "model_type"),
        (dict(num_attention_heads=3, num_key_value_heads=2), "multiple"),
        (dict(hidden_size=100, num_attention_heads=3, head_dim=None), "divisible"),
        (dict(head_dim=33), "even"),
        (
            dict(num_hidden_layers=5, num_key_value_layers=2, key_value_group_size=2),
            r"% key_value_group_size",
        ),
        (dict(num_key_value_layers=0), "num_key_value_layers"),
        (dict(num_key_value_layers=5), "num_key_value_layers"),
        (dict(key_value_group_size=0), "key_value_group_size"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "rope type"),
        (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "missing"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope type"),
        (
            dict(
                model_type="qwen2_swiftkv",
                num_key_value_layers=2,
                key_value_group_size=2,
                sliding_window=4,
                layer_types=["full_attention"] * 3 + ["sliding_attention"],
            ),
            "mixes full and sliding",
        ),
        (dict(sliding_window=4, layer_types=MIX * 2), "llama"),
        (dict(model_type="mistral", sliding_window=4, layer_types=MIX * 2), "mistral"),
        (dict(model_type="qwen2", layer_types=MIX * 2), "sliding_window is None"),
        (dict(layer_types=["full_attention"] * 3), "entries"),
        (dict(layer_types=["chunked_attention"] * 4), "unsupported layer types"),
        (dict(model_type="qwen2", attention_bias=False), "bias"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(sliding_window=0, model_type="mistral"), "sliding_window"),
        (dict(eos_token_id="2"), "eos_token_id"),
        (dict(vocab_size=0), "vocab_size"),
    ],
)
def test_bad_configs(overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**overrides)


@pytest.mark.parametrize(
    "extra,match",
    [
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(num_key_value_layers=2), "_swiftkv"),
    ],
)
def test_bad_hf_configs(extra, match):
    with pytest.raises(ConfigError, match=match):
        SwiftKVConfig.from_hf({**tiny_config().to_hf(), **extra})


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        SwiftKVConfig.from_hf(tmp_path)
