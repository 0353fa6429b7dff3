"""The external oracle: the reference against Hugging Face transformers on the same random weights.

Together with the model matrix this closes the chain fast -> reference -> transformers in one run.
transformers has no SwiftKV, so only L == N models are compared: Llama (full attention), Mistral
(sliding window), Qwen2 (biases; and per-layer `layer_types` for the hybrid full+sliding model).
"""

from __future__ import annotations

import pytest
import torch

from .adapters.base import Sampling
from .cases import Case, make_prompts, model_overrides
from .compare import FP32_LOGITS_ATOL, assert_close

ORACLE_MODELS = ("llama", "mistral-window", "hybrid", "qwen2-bias")


def _hf_model(config, state_dict: dict[str, torch.Tensor], case_name: str) -> torch.nn.Module:
    import transformers

    common = dict(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        rms_norm_eps=config.rms_norm_eps,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
    )
    if getattr(config, "rope_scaling", None):
        common["rope_parameters"] = {**config.rope_scaling, "rope_theta": config.rope_theta}
    layer_types = list(getattr(config, "layer_types", None) or [])
    if case_name == "llama":
        hf_config = transformers.LlamaConfig(**common, head_dim=config.head_dim, attention_bias=False)
        cls = transformers.LlamaForCausalLM
    elif case_name == "mistral-window":
        hf_config = transformers.MistralConfig(
            **common, head_dim=config.head_dim, sliding_window=config.sliding_window
        )
        cls = transformers.MistralForCausalLM
    else:  # Qwen2: biases; per-layer layer_types for the hybrid model
        assert config.head_dim * config.num_attention_heads == config.hidden_size, "HF Qwen2 derives head_dim"
        sliding = "sliding_attention" in layer_types
        hf_config = transformers.Qwen2Config(
            **common,
            use_sliding_window=sliding,
            sliding_window=config.sliding_window if sliding else None,
            layer_types=layer_types or None,
            max_window_layers=config.num_hidden_layers,
        )
        cls = transformers.Qwen2ForCausalLM
    hf_config._attn_implementation = "eager"
    model = cls(hf_config).eval()
    sd = dict(state_dict)
    own = model.state_dict()
    for name, tensor in own.items():  # Qwen2 always has q/k/v biases: zero where our model has none
        if name not in sd and name.endswith("_proj.bias"):
            sd[name] = torch.zeros_like(tensor)
    if config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]
    assert not missing and not unexpected, f"HF {cls.__name__}: missing {missing}, unexpected {unexpected}"
    return model


def _reference_logits(model, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    try:
        out = model(x)
    except Exception:  # noqa: BLE001 - a reference that takes a flat sequence
        out = model(x[0])
    out = getattr(out, "logits", out)
    return out.reshape(len(ids), -1).float()


@pytest.mark.impl_only("reference")
@pytest.mark.parametrize("model", ORACLE_MODELS)
def test_reference_matches_transformers(impl, model, bench, request):
    config, sd = bench.model(model)
    if getattr(config, "num_key_value_layers", config.num_hidden_layers) != config.num_hidden_layers:
        pytest.fail(f"{model}: the external oracle needs L == N")
    hf = _hf_model(config, sd, model)
    ref = bench.reference_model(model)
    prompts = make_prompts(config.vocab_size, (45, 17), seed=5)
    sampling = [Sampling(max_tokens=5)] * len(prompts)
    case = Case(request.node.nodeid, impl, model, None, "all", prompts, sampling)
    context = case.describe() + f"\nHF config: {hf.config.to_dict()}"
    with torch.inference_mode():
        # 1. every position of a forward pass (the window is 8: most positions are windowed)
        for p in prompts:
            expected = hf(torch.tensor([p])).logits[0].float()
            assert_close(
                _reference_logits(ref, p),
                expected,
                atol=FP32_LOGITS_ATOL,
                what=f"{model}: reference forward vs transformers (prompt of {len(p)})",
                context=context,
            )
        # 2. the reference generator's logits rows at its sampled positions vs HF on the same tokens
        gens = bench.expected(model, prompts, sampling)
        for p, g in zip(prompts, gens):
            seq = p + g.token_ids
            hf_rows = hf(torch.tensor([seq])).logits[0, len(p) - 1 : len(seq) - 1].float()
            assert g.token_ids == hf_rows.argmax(-1).tolist(), (
                f"{model}: greedy tokens vs transformers\n{context}"
            )
            assert_close(
                g.logits,
                hf_rows,
                atol=FP32_LOGITS_ATOL,
                what=f"{model}: reference generate rows vs transformers",
                context=context,
            )
    assert model_overrides(model)["num_hidden_layers"] == config.num_hidden_layers
