"""Request checks vLLM's offline path lacks for SwiftKV models.

With `kv_sharing_fast_prefill`, layers >= L never see the prompt tokens that are not sampled, so their
prompt logprobs would be computed from layer L's hidden state: wrong numbers, no error. vLLM's
`AsyncLLM` (the server) refuses such requests; its offline `LLM` does not in the versions this plugin
supports. This wraps the request validation of vLLM's `InputProcessor` so that a SwiftKV model refuses
them there too, before the request is queued, in the server's words.
"""

from __future__ import annotations

import functools

_INSTALLED = "_swiftkv_prompt_logprobs_guard"


def install_prompt_logprobs_guard() -> None:
    """Idempotent. Applies only to models whose `model_type` ends in `_swiftkv`."""
    from vllm.exceptions import VLLMValidationError
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    original = InputProcessor._validate_params
    if getattr(original, _INSTALLED, False):
        return

    @functools.wraps(original)
    def validate(self, params, supported_tasks):
        config = self.vllm_config
        if (
            isinstance(params, SamplingParams)
            and params.prompt_logprobs
            and config.cache_config.kv_sharing_fast_prefill
            and str(getattr(config.model_config.hf_config, "model_type", "")).endswith("_swiftkv")
        ):
            raise VLLMValidationError(
                "prompt_logprobs is incorrect with --kv-sharing-fast-prefill (kv_sharing_fast_prefill=True): "
                "SwiftKV's layers >= num_key_value_layers skip the prompt tokens that are not sampled; "
                "disable fast prefill for scoring",
                parameter="prompt_logprobs",
                value=params.prompt_logprobs,
            )
        return original(self, params, supported_tasks)

    setattr(validate, _INSTALLED, True)
    InputProcessor._validate_params = validate
