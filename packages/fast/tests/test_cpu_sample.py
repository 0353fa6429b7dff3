"""The exponential race kernel (kernels/cpu_sample.py) against its specification, torch's own
`exponential_` draw and argmax: the same tokens and the same generator states afterwards, for
generators anywhere in the MT19937's block, flat, peaked and masked rows, a NaN row, a draw of exactly
zero, several threads; the plan's torch path when it cannot run, and the sampler using it."""

from __future__ import annotations

import logging

import pytest
import torch
from swiftkv_fast import SamplingParams, envs
from swiftkv_fast.kernels import build, cpu_sample
from swiftkv_fast.kernels.plan import plan_kernels
from swiftkv_fast.sampler import sample

needs_kernel = pytest.mark.skipif(
    build.compiler() is None or not envs.kernel_enabled(cpu_sample.KERNEL),
    reason="no C compiler (or sample in SWIFTKV_DISABLED_KERNELS): the sampling kernel is off",
)


@pytest.fixture(scope="module")
def kernels() -> cpu_sample.SampleKernels:
    """The built and self-checked kernels, as the plan holds them."""
    loaded = cpu_sample.load()
    if loaded is None:
        pytest.skip("the sampling kernel did not build, or does not reproduce torch's draw here")
    return loaded


def generators(num: int, seed: int) -> list[torch.Generator]:
    """Generators at different places of the MT19937's 624-word block (each int32 random_ is one word)."""
    rng = torch.Generator().manual_seed(seed)
    out = []
    for i in range(num):
        g = torch.Generator().manual_seed(seed * 1000 + i)
        # fresh (the next draw twists), at the block's last word, one word in, anywhere
        words = [0, 623, 1][i] if i < 3 else int(torch.randint(0, 2000, (1,), generator=rng))
        if words:
            torch.empty(words, dtype=torch.int32).random_(generator=g)
        out.append(g)
    return out


def clones(gens: list[torch.Generator]) -> list[torch.Generator]:
    return [cpu_sample._clone(g) for g in gens]


def assert_same_as_torch(kernels, probs: torch.Tensor, gens: list[torch.Generator]) -> None:
    mine, theirs = clones(gens), clones(gens)
    got = cpu_sample.exponential_race(kernels, probs, mine)
    want = cpu_sample.torch_race(probs, theirs)
    assert got is not None
    assert got.tolist() == want.tolist()
    for a, b in zip(mine, theirs):
        assert torch.equal(a.get_state(), b.get_state())
        # and they go on alike
        assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 2, 2047, 2048, 2049, 49152])
@pytest.mark.parametrize("scale", [0.01, 1.0, 8.0, 40.0], ids=["flat", "normal", "peaked", "one-hot"])
def test_race_matches_torch(kernels, vocab, scale):
    rows = 9  # more rows than threads
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)) * scale
    assert_same_as_torch(kernels, torch.softmax(logits, dim=-1), generators(rows, vocab))


@needs_kernel
def test_race_masked_rows_and_strided_probs(kernels):
    """Zeros from top-k / top-p never win unless every token is zero (then token 0, as argmax), and the
    rows may lie any stride apart (rows not dense run on a copy)."""
    vocab = 3000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)) * 2
    logits[0, 5:] = float("-inf")  # top-k = 5
    logits[1, ::2] = float("-inf")
    probs = torch.softmax(logits, dim=-1)
    probs[2] = 0.0
    wide = torch.zeros(4, vocab + 17)
    wide[:, 17:] = probs
    assert_same_as_torch(kernels, wide[:, 17:], generators(4, 2))
    assert_same_as_torch(kernels, probs.t().contiguous().t(), generators(4, 2))  # columns not dense
    got = cpu_sample.exponential_race(kernels, probs, generators(4, 3))
    assert got[0] < 5 and got[1] % 2 == 1 and got[2] == 0


@needs_kernel
def test_race_nan_row(kernels):
    """A NaN ratio wins, the first one (torch's argmax); the draw still advances the generator fully."""
    probs = torch.softmax(torch.randn(3, 500, generator=torch.Generator().manual_seed(4)), dim=-1)
    probs[0, 123] = float("nan")
    probs[1] = float("nan")
    assert_same_as_torch(kernels, probs, generators(3, 5))


@needs_kernel
@pytest.mark.parametrize("p_at_zero", [0.5, 0.0], ids=["positive", "zero"])
def test_race_exact_zero_draw(kernels, p_at_zero):
    """A uniform of exactly 0 (both words 0) gives q = 0: p / 0 = inf wins, and 0 / 0 = NaN wins."""
    g = torch.Generator().manual_seed(9)
    torch.empty(10, dtype=torch.int32).random_(generator=g)
    state = g.get_state().clone()
    left = int(state[8:12].view(torch.int32))
    nxt = int(state[16:24].view(torch.int64))
    assert left > 20  # the next words are in this block: draw 3 reads words next + 6 and next + 7
    words = state[24 : 24 + 624 * 8].view(torch.int64)
    words[nxt + 6] = 0  # temper(0) = 0: the output word is 0 too
    words[nxt + 7] = 0
    g.set_state(state)
    probs = torch.full((1, 10), 0.5 / 9)
    probs[0, 3] = p_at_zero
    if p_at_zero == 0.0:
        probs[0, 0] = 0.5 + 0.5 / 9
    assert_same_as_torch(kernels, probs, [g])
    assert cpu_sample.exponential_race(kernels, probs, clones([g])).item() == 3


@needs_kernel
def test_invalid_state_is_refused_untouched(kernels):
    """A state torch's generator cannot be in (left = 0) gets -1 from the C call; the wrapper then
    returns None and no generator moves."""
    race = kernels.race
    state = torch.Generator().manual_seed(1).get_state().clone()
    state[8:12].view(torch.int32)[0] = 0
    states = state[None].clone()
    out = torch.empty(1, dtype=torch.int64)
    probs = torch.full((1, 4), 0.25)
    race(probs.data_ptr(), 4, 1, 4, states.data_ptr(), states.stride(0), out.data_ptr(), 1)
    assert out.item() == -1 and torch.equal(states[0], state)


def test_inputs_it_does_not_take_leave_the_generators_untouched():
    """Not fp32 rows, or not one generator per row: a ValueError (a caller's bug); a generator not on
    the CPU: None (the sampler then draws with torch). Refused before the kernels are touched (so none
    is needed here), and no generator moves."""
    gens = generators(2, 7)
    before = [g.get_state() for g in gens]
    probs = torch.softmax(torch.randn(2, 50), dim=-1)
    with pytest.raises(ValueError, match="fp32 CPU"):
        cpu_sample.exponential_race(None, probs.double(), gens)
    with pytest.raises(ValueError, match="generators"):
        cpu_sample.exponential_race(None, probs, gens[:1])
    assert cpu_sample.exponential_race(None, probs, [gens[0], None]) is None
    assert all(torch.equal(g.get_state(), b) for g, b in zip(gens, before))


@needs_kernel
def test_self_check_failure_disables_the_kernel(monkeypatch, caplog):
    """When torch's draw and the kernel differ (another torch's generator), the kernel is not loaded and
    the plan leaves seeded sampling to torch."""
    monkeypatch.setattr(cpu_sample, "_checked", {})
    monkeypatch.setattr(cpu_sample, "torch_race", lambda probs, gens: torch.zeros(probs.shape[0]) - 1)
    with caplog.at_level(logging.WARNING, logger=cpu_sample.__name__):
        assert cpu_sample.load() is None
    assert "does not reproduce torch" in caplog.text
    all_but_sample = frozenset(envs.KERNELS) - {cpu_sample.KERNEL}
    plan = plan_kernels(
        "cpu", torch.float32, torch.float32, num_heads=4, num_kv_heads=2, head_dim=8, disabled=all_but_sample
    )
    assert plan.sample is None
    assert plan.as_dict()["ops"]["seeded sampling"]["implementation"] == "torch"


@needs_kernel
def test_sampler_uses_the_kernel(kernels, monkeypatch):
    """The sampler's sampled rows go through the kernel it is given (in one call), and give what torch's
    draw gives without it."""
    calls = []
    race = cpu_sample.exponential_race
    monkeypatch.setattr(
        cpu_sample, "exponential_race", lambda k, p, g: calls.append((k, len(g))) or race(k, p, g)
    )
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(3)) * 3
    params = [SamplingParams(temperature=t, seed=i) for i, t in enumerate([0.7, 0.0, 1.0, 1.3])]
    gens = generators(4, 11)
    gens[1] = None
    kernel_gens = [g and cpu_sample._clone(g) for g in gens]
    torch_gens = [g and cpu_sample._clone(g) for g in gens]
    with_kernel = sample(logits, params, kernel_gens, full_logprobs=False, sample_kernels=kernels)
    assert calls == [(kernels, 3)]
    with_torch = sample(logits, params, torch_gens, full_logprobs=False)
    assert len(calls) == 1
    assert with_kernel.token_ids == with_torch.token_ids
    for a, b in zip(kernel_gens, torch_gens):
        assert a is None or torch.equal(a.get_state(), b.get_state())


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 3, 64, 1000])
def test_topk_values_match_torch(kernels, vocab):
    """The heap pass gives torch.topk's values, descending: ties, -inf entries, k = 1 to V, rows any
    stride apart; what it does not take (not fp32 rows, k out of range) is a ValueError."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.cat([torch.randn(3, vocab, generator=g), torch.randint(0, 3, (2, vocab), generator=g).float()])
    x[0, ::2] = float("-inf")
    wide = torch.zeros(5, vocab + 3)
    wide[:, 3:] = x
    for k in sorted({1, min(2, vocab), min(64, vocab), vocab}):
        want = torch.topk(x, k, dim=-1).values
        assert torch.equal(cpu_sample.topk_values(kernels, x, k), want)
        assert torch.equal(cpu_sample.topk_values(kernels, wide[:, 3:], k), want)
    for bad, k in ((x.double(), 1), (x, 0), (x, vocab + 1)):
        with pytest.raises(ValueError, match="topk_values"):
            cpu_sample.topk_values(kernels, bad, k)
