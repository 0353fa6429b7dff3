"""swiftkv_reference: the pure-PyTorch oracle of SwiftKV (Llama / Mistral / Qwen2, SingleInputKV +
AcrossKV, sliding windows), its checkpoints, and a naive step-by-step generator.

Modules (one concept each): config, rope, attention, kv_cache, model, sampling, generate,
checkpoint, default_model, tokenizer, cache_model (brute-force paged-cache rules), testing.
The generator is `swiftkv_reference.generate.generate` (the package attribute `generate` stays the
module, so `from swiftkv_reference import generate` gives the module).
"""

from .config import ConfigError, SwiftKVConfig
from .generate import Generation
from .model import SwiftKVForCausalLM
from .sampling import SamplingSettings, sample

__all__ = [
    "ConfigError",
    "Generation",
    "SamplingSettings",
    "SwiftKVConfig",
    "SwiftKVForCausalLM",
    "sample",
]
