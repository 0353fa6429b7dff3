"""The plugin as vLLM finds it: the entry point, lazy registration, the config classes, the version gate."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys

import pytest
from swiftkv_reference.config import ConfigError
from swiftkv_vllm.configs import LlamaSwiftKVConfig, MistralSwiftKVConfig, Qwen2SwiftKVConfig
from swiftkv_vllm.version import SUPPORTED_VLLM, UnsupportedVLLMVersion, check_vllm_version


def test_vllm_finds_the_plugin_through_its_entry_point():
    (entry,) = [
        e for e in importlib.metadata.entry_points(group="vllm.general_plugins") if e.name == "swiftkv"
    ]
    assert entry.value == "swiftkv_vllm:register"


def test_registration_is_lazy_and_idempotent():
    code = (
        "import sys, swiftkv_vllm; swiftkv_vllm.register(); swiftkv_vllm.register()\n"
        "from vllm import ModelRegistry\n"
        "assert set(swiftkv_vllm.ARCHITECTURES) <= set(ModelRegistry.get_supported_archs())\n"
        "assert 'swiftkv_vllm.model' not in sys.modules, 'registering imported the model code'\n"
        "from transformers import AutoConfig\n"
        "assert type(AutoConfig.for_model('qwen2_swiftkv')).__name__ == 'Qwen2SwiftKVConfig'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)


def test_the_installed_vllm_is_in_the_supported_range():
    check_vllm_version()


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "1.0.0"])
def test_another_vllm_is_refused_naming_both_versions(version):
    with pytest.raises(UnsupportedVLLMVersion) as info:
        check_vllm_version(version)
    assert version in str(info.value) and str(SUPPORTED_VLLM) in str(info.value)


def test_a_local_build_suffix_counts_as_its_release():
    check_vllm_version("0.32.0+cpu")


def test_config_classes_fill_layer_types_and_check_l_and_g():
    assert (
        Qwen2SwiftKVConfig(
            num_hidden_layers=4,
            num_key_value_layers=2,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=2,
        ).layer_types
        == ["full_attention"] * 2 + ["sliding_attention"] * 2
    )
    assert (
        MistralSwiftKVConfig(num_hidden_layers=2, sliding_window=8).layer_types == ["sliding_attention"] * 2
    )
    assert LlamaSwiftKVConfig(num_hidden_layers=4).num_key_value_layers == 4
    with pytest.raises(ConfigError, match="num_key_value_layers must be in"):
        LlamaSwiftKVConfig(num_hidden_layers=4, num_key_value_layers=5)
    with pytest.raises(ConfigError, match="mixes full and sliding"):
        Qwen2SwiftKVConfig(
            num_hidden_layers=4,
            num_key_value_layers=1,
            key_value_group_size=3,
            use_sliding_window=True,
            sliding_window=8,
            max_window_layers=2,
        )
