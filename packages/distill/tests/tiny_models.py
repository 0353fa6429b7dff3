"""The tiny models the distill tests run on (swiftkv_reference.testing.tiny_config overrides)."""

FULL, SLIDE = "full_attention", "sliding_attention"

# plain models: teachers for calibration (any L, G can be asked of them)
PLAIN_MODELS = {
    "llama": dict(num_hidden_layers=4),
    "mistral_window": dict(model_type="mistral", num_hidden_layers=4, sliding_window=8),
    "qwen2_hybrid_bias": dict(
        model_type="qwen2", num_hidden_layers=4, sliding_window=8, layer_types=[FULL, SLIDE, FULL, FULL]
    ),
}

# every kind of model the training forward must reproduce
FORWARD_MODELS = {
    **PLAIN_MODELS,
    "swiftkv_g1": dict(model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2),
    "swiftkv_g2": dict(
        model_type="llama_swiftkv", num_hidden_layers=5, num_key_value_layers=1, key_value_group_size=2
    ),
    "mistral_swiftkv_g2": dict(
        model_type="mistral_swiftkv",
        num_hidden_layers=4,
        sliding_window=8,
        num_key_value_layers=2,
        key_value_group_size=2,
    ),
    "qwen2_hybrid_swiftkv": dict(
        model_type="qwen2_swiftkv",
        num_hidden_layers=5,
        sliding_window=8,
        num_key_value_layers=1,
        key_value_group_size=2,
        layer_types=[FULL, SLIDE, SLIDE, FULL, FULL],
    ),
}
