"""The batched sampler reproduces the reference's seeded sampling token for token, with the torch paths
and with the C kernels the plan hands it (kernels/cpu_ops.py's argmax, kernels/cpu_sample.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.kernels import cpu_ops, cpu_sample
from swiftkv_fast.sampler import sample, top_logprobs
from swiftkv_reference.generate import generate as reference_generate
from swiftkv_reference.sampling import SamplingSettings
from swiftkv_reference.sampling import sample as reference_sample

SETTINGS = [
    dict(temperature=0.0),
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, top_k=20, top_p=0.5),
    dict(temperature=2.0, top_k=1000),  # k larger than the vocab
    dict(temperature=0.5, top_p=0.05),
]


@pytest.fixture(params=["torch", "C"])
def kernels(request) -> dict:
    """sample()'s kernel arguments: none (the torch paths), or the C ones as the plan loads them."""
    if request.param == "torch":
        return {}
    row_ops, sample_kernels = cpu_ops.load(), cpu_sample.load()
    if row_ops is None or sample_kernels is None:
        pytest.skip("the C row ops or sampling kernels are not built (or not torch's draw) here")
    return dict(row_ops=row_ops, sample_kernels=sample_kernels)


def test_sampler_rows_equal_reference(kernels):
    torch.manual_seed(0)
    vocab = 300
    for step in range(5):
        logits = torch.randn(len(SETTINGS), vocab) * 3
        params = [SamplingParams(seed=i, **s) for i, s in enumerate(SETTINGS)]
        gens = [torch.Generator().manual_seed(100 * step + i) for i in range(len(SETTINGS))]
        ref_gens = [torch.Generator().manual_seed(100 * step + i) for i in range(len(SETTINGS))]
        got = sample(logits, params, gens, **kernels).token_ids
        want = [
            reference_sample(logits[i], SamplingSettings(**s), ref_gens[i]) for i, s in enumerate(SETTINGS)
        ]
        assert got == want
        # the generators advanced identically (one draw of vocab values per non-greedy row)
        for g, rg in zip(gens, ref_gens):
            assert torch.equal(g.get_state(), rg.get_state())


@pytest.mark.parametrize("banned", [None, [[1, 7], [], [0]]], ids=["unmasked", "banned"])
def test_chosen_logprobs_without_the_full_log_softmax(banned, kernels):
    """full_logprobs=False: the same tokens, generator draws and chosen logprobs (log_softmax of the raw
    logits at each token, within fp32 rounding) as with the whole (B, vocab) log_softmax, which is then
    not returned; a mask changes the choice, never the reported logprob."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)) * 3
    logits[2, 0] = 50.0  # row 2's greedy choice is banned in the masked case
    greedy = SamplingParams(temperature=0)
    params = [greedy, SamplingParams(temperature=0.8, seed=1), greedy]
    results = []
    for full in (True, False):
        gens = [None, torch.Generator().manual_seed(5), None]
        results.append(sample(logits, params, gens, banned, full_logprobs=full, **kernels))
    with_full, without = results
    assert without.logprobs is None and with_full.logprobs is not None
    assert without.token_ids == with_full.token_ids
    want = torch.log_softmax(logits, dim=-1)[torch.arange(3), torch.tensor(with_full.token_ids)]
    assert with_full.chosen_logprobs == want.tolist()
    assert without.chosen_logprobs == pytest.approx(want.tolist(), rel=1e-6, abs=1e-5)
    if banned:
        assert with_full.token_ids[2] != 0


def test_top_logprobs_need_the_full_log_softmax():
    with pytest.raises(ValueError, match="did not compute them"):
        top_logprobs(None, [0], [2])
    assert top_logprobs(None, [0, 1], [None, None]) == [None, None]


def test_top_logprobs():
    logprobs = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0, 2.0]]), dim=-1)
    (entry,) = top_logprobs(logprobs, [0], [2])
    assert list(entry) == [0, 1, 3]
    assert entry[1] == pytest.approx(float(logprobs[0, 1]))
    assert top_logprobs(logprobs, [0], [None]) == [None]


def test_seeded_generation_equals_reference(tiny):
    cfg, state, model = tiny(
        model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2, key_value_group_size=2
    )
    llm = LLM.from_state_dict(cfg, state, block_size=8, max_num_batched_tokens=48)
    prompts = random_prompts(len(SETTINGS), cfg.vocab_size, [3, 70, 25, 110, 9, 40, 60], seed=7)
    params = [SamplingParams(seed=1000 + i, max_tokens=12, logprobs=0, **s) for i, s in enumerate(SETTINGS)]
    settings = [SamplingSettings(seed=1000 + i, max_tokens=12, **s) for i, s in enumerate(SETTINGS)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    refs = reference_generate(model, prompts, settings)
    for i, (o, r) in enumerate(zip(outs, refs)):
        got = o.outputs[0]
        assert got.token_ids == r.token_ids, f"request {i} {SETTINGS[i]}"
        assert got.finish_reason == r.finish_reason
        chosen = [got.logprobs[j][t] for j, t in enumerate(got.token_ids)]
        # |logprob| < 10 on these logits (|x| < 5): 1e-4 is ~100 fp32 ulps; the sum of 12 gets 10x that
        assert chosen == pytest.approx(r.logprobs, abs=1e-4)
        assert got.cumulative_logprob == pytest.approx(sum(r.logprobs), abs=1e-3)


def test_unseeded_requests_follow_engine_seed(tiny):
    cfg, state, _ = tiny(num_hidden_layers=2)
    prompts = random_prompts(3, cfg.vocab_size, [5, 9, 13])
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    runs = [
        [
            o.outputs[0].token_ids
            for o in LLM.from_state_dict(cfg, state, seed=s).generate(prompts, params, use_tqdm=False)
        ]
        for s in (0, 0, 1)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


@pytest.mark.parametrize("vocab", [1, 5, 64, 65, 300, 5000])
def test_top_p_equals_the_reference_full_sort(vocab, kernels):
    """`_apply_top_p` sorts only the kept prefix; it must drop exactly what the reference's full stable
    sort drops: flat rows (a nucleus far past the first candidates, so the prefix grows to the whole
    row), peaked rows, runs of equal probabilities cut in the middle (the lowest ids kept), top-k's
    -inf entries, a NaN row and an all -inf row (nothing dropped), top_p near 0 and near 1."""
    from swiftkv_fast.sampler import _apply_top_p
    from swiftkv_reference.sampling import apply_top_k_top_p

    g = torch.Generator().manual_seed(vocab)
    rows = [torch.randn(vocab, generator=g) * s for s in (0.01, 0.3, 1.0, 3.0, 10.0)]
    rows.append(torch.randint(0, 3, (vocab,), generator=g).float())  # long runs of ties
    rows.append(torch.zeros(vocab))  # one run: every token tied
    masked = torch.randn(vocab, generator=g)
    masked[::2] = float("-inf")
    masked[0] = 1.0
    rows.append(masked)
    nan = torch.randn(vocab, generator=g)
    nan[vocab // 2] = float("nan")
    rows.append(nan)
    rows.append(torch.full((vocab,), float("-inf")))
    x = torch.stack(rows)
    for top_p in (1e-6, 0.3, 0.5, 0.9, 0.95, 0.9999):
        tp = torch.full((x.shape[0],), top_p)
        got = _apply_top_p(x, tp, kernels.get("sample_kernels"))
        want = torch.stack([apply_top_k_top_p(row, 0, top_p) for row in x])
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    mixed = torch.tensor([0.2, 0.7, 0.95] * 4)[: x.shape[0]]  # each row its own top_p
    want = torch.stack([apply_top_k_top_p(row, 0, float(p)) for row, p in zip(x, mixed)])
    got = _apply_top_p(x, mixed, kernels.get("sample_kernels"))
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
