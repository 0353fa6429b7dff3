"""The LLM API on a tiny model: outputs, checkpoint shape errors, stop tokens, backend selection (bad
input: test_validation.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.attention import TorchBackend, get_attention_backend

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny):
    cfg, state, _ = tiny(model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2)
    return LLM.from_state_dict(cfg, state, block_size=8, max_model_len=256, num_kv_blocks=200)


def test_outputs_in_input_order_with_metrics(llm):
    prompts = random_prompts(5, 128, [40, 3, 90, 1, 20])
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 1, 3, 2, 4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 1, 3, 2, 4]
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
        assert o.metrics.ttft is not None and o.metrics.ttft >= 0
    assert outs[0].metrics.tpot is not None and outs[1].metrics.tpot is None
    # a single token-id prompt is accepted as is, and repeats hit the prefix cache
    again = llm.generate(prompts[0], params[0], use_tqdm=False)
    assert again[0].outputs[0].token_ids == outs[0].outputs[0].token_ids
    assert again[0].num_cached_tokens == (40 - 1) // 8 * 8  # the last token is always recomputed


def test_stop_token_ids_and_logprobs(llm):
    base = llm.generate(
        [[7, 8, 9]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False
    )
    tokens = base[0].outputs[0].token_ids
    stop_at = tokens[2]
    params = SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[stop_at], logprobs=3
    )
    out = llm.generate([[7, 8, 9]], params, use_tqdm=False)[0].outputs[0]
    k = tokens.index(stop_at)
    assert out.token_ids == tokens[: k + 1] and out.finish_reason == "stop" and out.stop_reason == stop_at
    assert len(out.logprobs) == k + 1 and all(len(d) >= 3 for d in out.logprobs)
    for tok, d in zip(out.token_ids, out.logprobs):
        assert max(d.values()) == d[tok]  # greedy: the chosen token is the most likely


def test_wrong_checkpoint_shape_names_tensor(tiny):
    cfg, state, _ = tiny(num_hidden_layers=2)
    bad = dict(state)
    bad["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        LLM.from_state_dict(cfg, bad)


def test_backend_registry():
    assert isinstance(get_attention_backend("auto", "cpu", 16), TorchBackend)
    assert get_attention_backend("torch", "cpu", 16).name == "torch"
    with pytest.raises(RuntimeError, match="CUDA"):
        get_attention_backend("flash_attn", "cpu", 256)
    with pytest.raises(ValueError):
        get_attention_backend("xformers", "cpu", 16)


def test_cli_convert_and_load_directory(tiny, tmp_path):
    from swiftkv_fast.cli import main
    from swiftkv_reference.checkpoint import save_checkpoint

    cfg, state, _ = tiny(num_hidden_layers=4)
    save_checkpoint(tmp_path / "plain", cfg, state)
    assert (
        main(["convert", str(tmp_path / "plain"), str(tmp_path / "skv"), "--num-key-value-layers", "2"]) == 0
    )
    prompt = [[5, 6, 7, 8]]
    a = LLM(str(tmp_path / "skv"), max_model_len=128, num_kv_blocks=64).generate(
        prompt, GREEDY, use_tqdm=False
    )
    b = LLM(str(tmp_path / "plain"), num_key_value_layers=2, max_model_len=128, num_kv_blocks=64).generate(
        prompt, GREEDY, use_tqdm=False
    )
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
