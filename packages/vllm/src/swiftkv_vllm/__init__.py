"""SwiftKV checkpoints on vLLM: a plugin that vLLM loads in every process it starts.

`register()` (the `vllm.general_plugins` entry point) checks the vLLM version, registers the config
classes of `llama_swiftkv`, `mistral_swiftkv` and `qwen2_swiftkv` with transformers' `AutoConfig`, and
their architectures with vLLM's `ModelRegistry` as lazy strings (loading the plugin imports no model
code), and refuses prompt logprobs where fast prefill would make them wrong (`guards`). After that,
`vllm serve DIR` and `vllm.LLM(DIR)` load a directory written by `swiftkv convert` or `swiftkv distill`,
or a Snowflake SwiftKV checkpoint.
"""

from __future__ import annotations

from .version import SUPPORTED_VLLM, check_vllm_version

ARCHITECTURES = ("LlamaSwiftKVForCausalLM", "MistralSwiftKVForCausalLM", "Qwen2SwiftKVForCausalLM")

__all__ = ["ARCHITECTURES", "SUPPORTED_VLLM", "check_vllm_version", "register"]


def register() -> None:
    """Idempotent: vLLM may call it several times in one process."""
    check_vllm_version()
    from vllm import ModelRegistry

    from .configs import register_configs
    from .guards import install_prompt_logprobs_guard

    register_configs()
    install_prompt_logprobs_guard()
    for arch in ARCHITECTURES:
        if arch not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(arch, f"swiftkv_vllm.model:{arch}")
