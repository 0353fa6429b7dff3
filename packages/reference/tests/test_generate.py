"""Generation over the naive cache: equal to the full forward at every step; sliding caches bounded."""

import pytest
import torch
from swiftkv_reference.generate import generate
from swiftkv_reference.sampling import SamplingSettings
from swiftkv_reference.testing import fp32_atol, tiny_config, tiny_model

SLIDE = "sliding_attention"
FULL = "full_attention"
CONFIGS = {
    "llama_acrosskv": dict(
        model_type="llama_swiftkv", num_hidden_layers=6, num_key_value_layers=2, key_value_group_size=2
    ),
    "mistral_window": dict(model_type="mistral", sliding_window=5),
    "qwen2_hybrid_swiftkv": dict(
        model_type="qwen2_swiftkv",
        num_hidden_layers=6,
        num_key_value_layers=2,
        key_value_group_size=2,
        sliding_window=4,
        layer_types=[FULL, SLIDE, SLIDE, SLIDE, FULL, FULL],
    ),
    "mistral_swiftkv_window": dict(
        model_type="mistral_swiftkv",
        num_hidden_layers=4,
        num_key_value_layers=1,
        key_value_group_size=3,
        sliding_window=3,
    ),
}


def _prompt(n, seed=0):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("prefill_chunk", [None, 3])
def test_incremental_equals_full_forward(name, prefill_chunk):
    model = tiny_model(tiny_config(**CONFIGS[name]), seed=7)
    prompt = _prompt(11)
    settings = SamplingSettings(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    (gen,) = generate(model, [prompt], settings, prefill_chunk=prefill_chunk)
    assert len(gen.token_ids) == 12 and gen.finish_reason == "length"
    full = model(torch.tensor(prompt + gen.token_ids))
    atol = fp32_atol(full, model.config.num_hidden_layers)
    for j, row in enumerate(gen.logits):
        assert (row - full[len(prompt) - 1 + j]).abs().max() <= atol
        assert gen.logprobs[j] == pytest.approx(float(torch.log_softmax(row, -1)[gen.token_ids[j]]))


def test_sliding_cache_never_exceeds_window():
    config = tiny_config(**CONFIGS["qwen2_hybrid_swiftkv"])
    model = tiny_model(config, seed=8)
    cache = model.new_cache()
    windows = [config.cache_window(c) for c in range(cache.num_layers)]
    assert windows == [None, 4, 4, None]  # layers 0 | 1 | {2,3} | {4,5}
    tokens = _prompt(20)
    for start, n in [(0, 9), (9, 1), (10, 1), (11, 6), (17, 1), (18, 2)]:
        model.step(torch.tensor(tokens[start : start + n]), torch.arange(start, start + n), cache, [n - 1])
        end = start + n
        for c, w in enumerate(windows):
            expected = list(range(max(0, end - w), end)) if w else list(range(end))
            assert cache.positions[c].tolist() == expected
            assert w is None or cache.num_tokens(c) <= w


def test_batch_of_prompts_and_stop_tokens():
    config = tiny_config(eos_token_id=[5, 6])
    model = tiny_model(config, seed=9)
    prompts = [_prompt(5, 1), _prompt(8, 2), _prompt(3, 3)]
    greedy = generate(model, prompts, SamplingSettings(max_tokens=6, ignore_eos=True))
    assert [g.prompt_token_ids for g in greedy] == prompts
    # generate() equals running each prompt alone
    for p, g in zip(prompts, greedy):
        assert (
            generate(model, [p], SamplingSettings(max_tokens=6, ignore_eos=True))[0].token_ids == g.token_ids
        )
    # stopping on a token that greedy decoding produces: the stop token is kept, finish_reason "stop"
    first = greedy[1].token_ids
    stop = SamplingSettings(max_tokens=6, ignore_eos=True, stop_token_ids=[first[2]])
    (g,) = generate(model, [prompts[1]], stop)
    k = first.index(first[2])
    assert g.token_ids == first[: k + 1] and g.finish_reason == "stop"
    # eos: forced by making eos the only finite logit
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.weight[6, 0] = 1.0
        model.model.embed_tokens.weight[:, 0] = 1.0
    (g,) = generate(model, [prompts[0]], SamplingSettings(max_tokens=6))
    assert g.token_ids[-1] in (5, 6) and g.finish_reason == "stop"


def test_bad_inputs():
    model = tiny_model(tiny_config(), seed=0)
    with pytest.raises(ValueError):
        generate(model, [[]], SamplingSettings())
    with pytest.raises(ValueError):
        generate(model, [[1, 999]], SamplingSettings())
    with pytest.raises(ValueError):
        generate(model, [[1], [2]], [SamplingSettings()])
    with pytest.raises(ValueError):
        generate(model, [[1, 2]], SamplingSettings(), prefill_chunk=0)
    with pytest.raises(IndexError):
        model(torch.tensor([1, 2, 3]), logits_positions=[3])
