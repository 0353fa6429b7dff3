"""swiftkv_reference: the pure-PyTorch oracle of SwiftKV (Llama / Mistral / Qwen2, SingleInputKV +
AcrossKV, sliding windows), its checkpoints, and a naive generator.

Modules (one concept each): config, rope, attention, kv_cache, model, sampling, generate,
checkpoint, default_model, tokenizer, cache_model, testing.
"""

from .config import ConfigError, SwiftKVConfig

__all__ = ["ConfigError", "SwiftKVConfig"]
