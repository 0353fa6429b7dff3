"""Top-p at its boundary, in the reference's sampler and the engine's (both implement the algorithm of
`swiftkv_reference.sampling`, token for token on CPU).

vLLM keeps the token whose probability carries the cumulative mass up to or past `top_p` and drops
every later one. On crafted rows, many seeded draws must produce the boundary token at least once and
never a token beyond it: a row where the mass before a token is exactly `top_p` (four equal
probabilities of 1/4, exact in fp32: keep `cum - p < top_p`, not `<=`), and one where the boundary
token crosses `top_p` with a margin (keep by the mass *before* a token, not after it). The tokens sit
at scattered ids, so a sampler that forgets the sort fails too.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

VOCAB = 16
NUM_DRAWS = 300


@dataclass(frozen=True)
class Row:
    name: str
    probs: dict[int, float]  # token -> probability (the other tokens: logit -inf)
    top_p: float
    kept: frozenset[int]  # what top-p keeps; the boundary token is the least probable of them

    def logits(self) -> torch.Tensor:
        row = torch.full((VOCAB,), float("-inf"))
        for t, p in self.probs.items():
            row[t] = torch.tensor(p).log()
        return row  # (vocab,)


ROWS = [
    # stable descending sort: 3, 7, 8, 14; cum - p = 0, 1/4, 1/2, 3/4; top_p = 1/2 keeps 3 and 7
    Row("mass-before-equals-top-p", {7: 0.25, 14: 0.25, 3: 0.25, 8: 0.25}, 0.5, frozenset({3, 7})),
    # sorted: 5 (0.4), 2 (0.3), 12 (0.2), 9 (0.1); 2 carries the mass from 0.4 to 0.7 > 0.6
    Row("boundary-crosses-top-p", {2: 0.3, 9: 0.1, 5: 0.4, 12: 0.2}, 0.6, frozenset({5, 2})),
]


def reference_draws(row: Row) -> list[int]:
    from swiftkv_reference.sampling import SamplingSettings, sample

    logits = row.logits()
    out = []
    for seed in range(NUM_DRAWS):
        settings = SamplingSettings(temperature=1.0, top_p=row.top_p, seed=seed)
        out.append(sample(logits, settings, settings.make_generator()))
    return out


def fast_draws(row: Row) -> list[int]:
    swiftkv_fast = pytest.importorskip("swiftkv_fast", reason="swiftkv_fast is not importable")
    from swiftkv_fast.sampler import sample

    logits = row.logits().expand(NUM_DRAWS, VOCAB).clone()  # (draws, vocab)
    params = [swiftkv_fast.SamplingParams(temperature=1.0, top_p=row.top_p, seed=s) for s in range(NUM_DRAWS)]
    generators = [torch.Generator().manual_seed(s) for s in range(NUM_DRAWS)]
    return sample(logits, params, generators).token_ids


SAMPLERS = {"reference": reference_draws, "fast": fast_draws}


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_top_p_keeps_the_boundary_token_and_nothing_beyond(sampler, row):
    draws = SAMPLERS[sampler](row)
    boundary = min(row.kept, key=row.probs.__getitem__)
    drawn = set(draws)
    assert boundary in drawn, (
        f"{sampler}: top_p={row.top_p} over {row.probs}: the boundary token {boundary} was never drawn in "
        f"{NUM_DRAWS} seeded draws (drawn: {sorted(drawn)}); top-p must keep the token that reaches the mass"
    )
    assert drawn <= row.kept, (
        f"{sampler}: top_p={row.top_p} over {row.probs}: drew {sorted(drawn - row.kept)}, beyond the "
        f"top-p set {sorted(row.kept)}"
    )


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_top_p_draws_equal_reference(row):
    """Same seed, same row: the engine's sampler draws what the reference's does."""
    assert fast_draws(row) == reference_draws(row)
