"""Bad input is refused before any work, naming what is wrong: the config's L / G in the reference's
words, a missing or mis-shaped tensor by name, settings SwiftKV cannot honour by the setting."""

from __future__ import annotations

import json

import pytest
from helpers import PROMPTS, engine, generate, write_checkpoint
from safetensors.torch import load_file, save_file

SWIFTKV = dict(model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2)


def _edit_weights(path, edit) -> None:
    weights = load_file(path / "model.safetensors")
    edit(weights)
    save_file(weights, path / "model.safetensors")


def _refused_at_start(path, error: type[BaseException], match: str, **kwargs) -> None:
    """Building an engine on `path` raises `error` matching `match`, before any request."""
    with pytest.raises(error, match=match):
        with engine(path, **kwargs):
            pass


def test_a_group_size_that_does_not_divide_the_swiftkv_layers_is_refused_in_the_reference_words(tmp_path):
    path, _, _ = write_checkpoint(tmp_path, **SWIFTKV)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"key_value_group_size": 3}))
    _refused_at_start(path, Exception, r"\(num_hidden_layers - num_key_value_layers\) % key_value_group_size")


def test_a_missing_tensor_is_named(tmp_path):
    path, _, _ = write_checkpoint(tmp_path, **SWIFTKV)
    _edit_weights(path, lambda w: w.pop("model.layers.3.self_attn.q_proj_swiftkv.weight"))
    _refused_at_start(
        path, ValueError, r"missing 1 tensor.*model\.layers\.3\.self_attn\.q_proj_swiftkv\.weight"
    )


def test_a_mis_shaped_tensor_is_named_with_both_shapes(tmp_path):
    path, _, _ = write_checkpoint(tmp_path, **SWIFTKV)
    name = "model.layers.2.self_attn.k_proj_swiftkv.weight"
    _edit_weights(path, lambda w: w.update({name: w[name][:16]}))
    _refused_at_start(
        path, ValueError, rf"{name.replace('.', '[.]')}' has shape \(16, 64\).*needs \(32, 64\)"
    )


def test_the_teachers_projections_beside_the_swiftkv_ones_are_skipped(tmp_path):
    """Snowflake's checkpoints keep q/k/v_proj of layers >= L; they load and are never used."""
    path, _, _ = write_checkpoint(tmp_path, **SWIFTKV)
    name = "model.layers.3.self_attn.q_proj.weight"
    _edit_weights(path, lambda w: w.update({name: w[name] * 100}))
    with engine(path) as llm:
        assert len(generate(llm, PROMPTS[:1], 2)[0][0]) == 2


def test_pipeline_parallelism_is_refused_by_name(tmp_path):
    path, _, _ = write_checkpoint(tmp_path, **SWIFTKV)
    _refused_at_start(
        path, NotImplementedError, "Pipeline parallelism is not supported", pipeline_parallel_size=2
    )


def test_prompt_logprobs_with_fast_prefill_are_refused_and_served_without_it(tmp_path):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    path, _, _ = write_checkpoint(tmp_path, **SWIFTKV)
    params = SamplingParams(max_tokens=2, prompt_logprobs=1, detokenize=False)
    # without fast prefill first: vLLM's prompt-logprob path keeps the first engine's process groups
    with engine(path) as llm:
        (out,) = llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
        assert len(out.prompt_logprobs) == len(PROMPTS[1])
    with engine(path, kv_sharing_fast_prefill=True) as llm:
        with pytest.raises(
            VLLMValidationError, match="prompt_logprobs is incorrect with --kv-sharing-fast-prefill"
        ):
            llm.generate([{"prompt_token_ids": PROMPTS[1]}], params, use_tqdm=False)
        assert generate(llm, PROMPTS[1:2], 2)[0][0], "the engine serves the next request"
