"""The sampling algorithm of docs/interfaces.md, step by step."""

import pytest
import torch
from swiftkv_reference.sampling import SamplingSettings, apply_top_k_top_p, sample


def _logits(seed=0, vocab=50):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 0.5


def test_greedy_is_argmax_lowest_index_and_draws_nothing():
    logits = torch.tensor([0.0, 2.0, 2.0, 1.0])
    g = torch.Generator().manual_seed(0)
    state = g.get_state()
    assert sample(logits, SamplingSettings(temperature=0.0), g) == 1
    assert torch.equal(g.get_state(), state)


def test_seeded_sampling_is_deterministic_and_matches_the_formula():
    logits = _logits()
    s = SamplingSettings(temperature=0.7, top_k=20, top_p=0.9, seed=123)
    g1, g2 = s.make_generator(), s.make_generator()
    a = [sample(logits, s, g1) for _ in range(20)]
    b = [sample(logits, s, g2) for _ in range(20)]
    assert a == b
    # the exact algorithm, written out again
    g = torch.Generator().manual_seed(123)
    expected = []
    for _ in range(20):
        x = logits / 0.7
        x[x < torch.topk(x, 20).values[-1]] = float("-inf")
        p = torch.softmax(x, -1)
        ps, order = torch.sort(p, descending=True, stable=True)
        drop = (torch.cumsum(ps, -1) - ps) >= 0.9
        drop[0] = False
        x[order[drop]] = float("-inf")
        probs = torch.softmax(x, -1)
        expected.append(int(torch.argmax(probs / torch.empty_like(probs).exponential_(generator=g))))
    assert a == expected
    assert len(set(a)) > 1  # it does sample
    other = SamplingSettings(temperature=0.7, top_k=20, top_p=0.9, seed=124)
    g3 = other.make_generator()
    assert [sample(logits, other, g3) for _ in range(20)] != a


def test_top_k_and_top_p_masks():
    x = torch.tensor([1.0, 3.0, 2.0, 3.0, 0.0])
    assert torch.isinf(apply_top_k_top_p(x, 2, 1.0)).tolist() == [True, False, True, False, True]
    assert torch.isinf(apply_top_k_top_p(x, 100, 1.0)).sum() == 0  # k clamped to the vocab
    # probabilities 0.5, 0.3, 0.2: top_p = 0.5 keeps only the first (the next has cum - p = 0.5 >= 0.5)
    x = torch.log(torch.tensor([0.3, 0.5, 0.2]))
    assert torch.isinf(apply_top_k_top_p(x, 0, 0.5)).tolist() == [True, False, True]
    assert torch.isinf(apply_top_k_top_p(x, 0, 0.51)).tolist() == [False, False, True]
    assert torch.isinf(apply_top_k_top_p(x, 0, 1e-6)).tolist() == [True, False, True]  # first always kept


def test_top_k_1_is_greedy():
    logits = _logits(1)
    s = SamplingSettings(temperature=1.5, top_k=1, seed=0)
    g = s.make_generator()
    assert all(sample(logits, s, g) == int(logits.argmax()) for _ in range(10))


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-1),
        dict(top_p=0),
        dict(top_p=1.5),
        dict(top_k=-2),
        dict(max_tokens=0),
        dict(top_k=1.5),
    ],
)
def test_bad_settings(kwargs):
    with pytest.raises(ValueError):
        SamplingSettings(**kwargs)


def test_sampling_needs_a_generator():
    with pytest.raises(ValueError):
        sample(_logits(), SamplingSettings(temperature=1.0), None)
