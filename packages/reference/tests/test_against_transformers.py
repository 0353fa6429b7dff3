"""The reference against transformers' Llama / Mistral / Qwen2 on the same random weights (L == N)."""

import pytest
import torch
from swiftkv_reference.config import SLIDING, SwiftKVConfig
from swiftkv_reference.testing import fp32_atol, random_state_dict, tiny_config, tiny_model

transformers = pytest.importorskip("transformers")

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _hf_logits(hf_cls, hf_config_cls, config, seed, ids):
    hf_config = hf_config_cls(**config.to_hf())
    hf_config._attn_implementation = "eager"
    model = hf_cls(hf_config).eval()
    state = random_state_dict(config, seed)
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys
    assert set(result.missing_keys) <= {"lm_head.weight"}  # tied
    with torch.no_grad():
        return model(ids[None]).logits[0].float(), hf_config


def _compare(hf_cls, hf_config_cls, config, num_tokens=40, seed=0):
    ids = torch.randint(0, config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    ref, hf_config = _hf_logits(hf_cls, hf_config_cls, config, seed, ids)
    ours = tiny_model(config, seed)(ids)
    assert (ours - ref).abs().max().item() <= fp32_atol(ref, config.num_hidden_layers)
    return hf_config


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("rope_scaling", [None, LLAMA3])
def test_llama_gqa(tied, rope_scaling):
    config = tiny_config(tie_word_embeddings=tied, rope_scaling=rope_scaling, rope_theta=500000.0)
    _compare(transformers.LlamaForCausalLM, transformers.LlamaConfig, config)


def test_mistral_window_shorter_than_sequence():
    config = tiny_config(model_type="mistral", sliding_window=7, num_key_value_heads=2)
    assert config.layer_types == [SLIDING] * 4
    _compare(transformers.MistralForCausalLM, transformers.MistralConfig, config, num_tokens=30)
    # the window matters: without it the logits differ
    ids = torch.arange(30) % config.vocab_size
    full = tiny_model(config.replace(sliding_window=None, layer_types=None))(ids)
    assert (tiny_model(config)(ids) - full).abs().max() > 1e-2


def test_qwen2_bias_and_sliding_layers():
    hf = tiny_config(model_type="qwen2").to_hf()
    hf.update(use_sliding_window=True, sliding_window=6, max_window_layers=2)
    hf.pop("layer_types")
    config = SwiftKVConfig.from_hf(hf)
    assert config.attention_bias
    assert config.layer_types == ["full_attention"] * 2 + [SLIDING] * 2
    hf_config = _compare(transformers.Qwen2ForCausalLM, transformers.Qwen2Config, config, num_tokens=30)
    assert list(hf_config.layer_types) == config.layer_types


def test_qwen2_layer_types_match_transformers():
    """Our reading of use_sliding_window / max_window_layers is transformers' one."""
    for use, mwl in [(False, 1), (True, 0), (True, 3), (True, 10)]:
        hf = {
            "model_type": "qwen2",
            "vocab_size": 64,
            "hidden_size": 64,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "use_sliding_window": use,
            "sliding_window": 5,
            "max_window_layers": mwl,
        }
        ours = SwiftKVConfig.from_hf(hf)
        theirs = transformers.Qwen2Config(**hf)
        assert ours.layer_types == list(theirs.layer_types)
        assert ours.sliding_window == theirs.sliding_window
