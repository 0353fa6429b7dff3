"""transformers config classes for the SwiftKV model types, checked by the reference's rules.

transformers knows `llama`, `mistral` and `qwen2` but not their `_swiftkv` variants, so vLLM could not
read such a `config.json` without these. Each class is the family's own config plus the SwiftKV fields
(`num_key_value_layers` L, `key_value_group_size` G, `swiftkv`); construction runs the reference's
`SwiftKVConfig` checks, so a bad L or G is refused in the reference's words before vLLM builds
anything, and fills in `layer_types` (one attention type per layer), which vLLM's layers and its
cache configuration read to give each layer its own window.
"""

from __future__ import annotations

from typing import Any

from swiftkv_reference.config import SwiftKVConfig
from transformers import AutoConfig, LlamaConfig, MistralConfig, Qwen2Config


def _finish(config: Any) -> None:
    """Fill the SwiftKV defaults, run the reference's checks and set `layer_types` and
    `sliding_window` as the reference reads them (the window only where a layer slides)."""
    config.num_key_value_layers = config.num_key_value_layers or config.num_hidden_layers
    config.key_value_group_size = config.key_value_group_size or 1
    checked = swiftkv_config(config)
    config.layer_types = list(checked.layer_types)
    config.sliding_window = checked.sliding_window


def swiftkv_config(config: Any) -> SwiftKVConfig:
    """The reference's view of a transformers config (raises its `ConfigError` on anything it cannot
    honour, e.g. "(num_hidden_layers - num_key_value_layers) % key_value_group_size != 0")."""
    return SwiftKVConfig.from_hf(config.to_dict())


class LlamaSwiftKVConfig(LlamaConfig):
    model_type = "llama_swiftkv"
    num_key_value_layers: int | None = None  # L (None: N, the original model)
    key_value_group_size: int | None = None  # G (AcrossKV; None: 1)
    swiftkv: bool = True  # False: layers >= L run the teacher's own K/V path

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        _finish(self)


class MistralSwiftKVConfig(MistralConfig):
    model_type = "mistral_swiftkv"
    num_key_value_layers: int | None = None
    key_value_group_size: int | None = None
    swiftkv: bool = True
    layer_types: list[str] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        _finish(self)


class Qwen2SwiftKVConfig(Qwen2Config):
    model_type = "qwen2_swiftkv"
    num_key_value_layers: int | None = None
    key_value_group_size: int | None = None
    swiftkv: bool = True
    qkv_bias: bool = True  # q/k/v bias without an o_proj bias, as vLLM's Llama layer reads it

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        _finish(self)


CONFIG_CLASSES = (LlamaSwiftKVConfig, MistralSwiftKVConfig, Qwen2SwiftKVConfig)


def register_configs() -> None:
    """Make `AutoConfig` read the SwiftKV model types (idempotent)."""
    for cls in CONFIG_CLASSES:
        try:
            AutoConfig.register(cls.model_type, cls)
        except ValueError:  # already registered in this process
            pass
