"""Model matrix: every tiny random model, each implementation against the reference (default engine)."""

from __future__ import annotations

import pytest

from .adapters.base import Sampling
from .cases import MODEL_CASES, PROMPT_LENGTHS, SMALL_PROMPT_LENGTHS, Case, make_prompts, submit
from .checks import against_reference

INTERPRETER_MODELS = ("mistral-window-swiftkv", "acrosskv-g2")  # the Triton interpreter runs only these


def _prompts_for(impl, bench, model):
    config, _ = bench.model(model)
    lengths = SMALL_PROMPT_LENGTHS if impl.interpreted else PROMPT_LENGTHS
    return make_prompts(config.vocab_size, lengths, seed=7)


@pytest.mark.parametrize("model", list(MODEL_CASES))
def test_model_matrix(impl, model, bench, request):
    if impl.interpreted and model not in INTERPRETER_MODELS:
        pytest.skip(
            f"{impl.name} under the Triton interpreter runs only {INTERPRETER_MODELS} (slow); "
            "the full matrix runs on GPU"
        )
    engine = impl.default_engine()
    prompts = _prompts_for(impl, bench, model)
    sampling = [Sampling(max_tokens=3 if impl.interpreted else 5)] * len(prompts)
    case = Case(request.node.nodeid, impl, model, engine, "all", prompts, sampling)
    # the oracle runs each prompt alone; the implementation gets the whole batch in one call
    actual = submit(bench.runner(impl, model, engine), prompts, sampling, "all")
    expected = bench.expected(model, prompts, sampling)
    print(against_reference(impl, actual, expected, case))


@pytest.mark.parametrize("model", ["swiftkv-half", "hybrid-acrosskv-window"])
def test_seeded_sampling(impl, model, bench, request):
    """temperature / top-k / top-p with per-request seeds: token for token (fp32 on CPU only)."""
    if not impl.exact:
        pytest.skip("seeded sampling equals the reference token for token only in fp32")
    impl.require("seeded-sampling")
    if impl.interpreted:
        pytest.skip(
            f"{impl.name} under the Triton interpreter: the sampler is backend-independent (see fast-torch)"
        )
    engine = impl.default_engine()
    config, _ = bench.model(model)
    prompts = make_prompts(config.vocab_size, (3, 17, 30), seed=11)
    sampling = [
        Sampling(max_tokens=6, temperature=0.8, seed=1),
        Sampling(max_tokens=6, temperature=1.0, top_k=20, seed=2),
        Sampling(max_tokens=6, temperature=1.3, top_p=0.7, top_k=50, seed=3),
    ]
    case = Case(request.node.nodeid, impl, model, engine, "all", prompts, sampling)
    actual = submit(bench.runner(impl, model, engine), prompts, sampling, "all")
    expected = bench.expected(model, prompts, sampling)
    print(against_reference(impl, actual, expected, case))


@pytest.mark.parametrize("model", ["swiftkv-half", "hybrid-acrosskv-window"])
def test_without_logprobs(impl, model, bench, request):
    """Requests that ask for no logprobs: the engine's sampler then skips the (B, vocab) log_softmax
    (greedy rows take the argmax and logsumexp of one kernel on CPU). The tokens still equal the
    reference's, greedy and seeded; the comparison's top-n come from the returned logits rows."""
    if impl.interpreted:
        pytest.skip(f"{impl.name} under the Triton interpreter: the sampler is backend-independent")
    engine = impl.default_engine()
    config, _ = bench.model(model)
    prompts = make_prompts(config.vocab_size, (3, 17, 30), seed=13)
    sampling = [Sampling(max_tokens=5, logprobs=None)] * 2
    if impl.exact and "seeded-sampling" not in impl.lacks:  # token for token only in fp32
        sampling.append(Sampling(max_tokens=5, temperature=0.9, top_k=30, seed=4, logprobs=None))
    else:
        sampling.append(sampling[0])
    case = Case(request.node.nodeid, impl, model, engine, "all", prompts, sampling)
    actual = submit(bench.runner(impl, model, engine), prompts, sampling, "all")
    expected = bench.expected(model, prompts, sampling)
    print(against_reference(impl, actual, expected, case))
