"""Engine matrix and scheduling invariance.

For every engine configuration (block size, chunk budget, max_num_seqs, prefix caching with shared
prefixes, a tiny pool that forces preemption, one call per prompt vs one batch), each implementation
must (1) match the reference and (2) give the same greedy tokens as itself under its default engine.
"""

from __future__ import annotations

import pytest

from .adapters.base import Sampling
from .cases import PROMPT_LENGTHS, SMALL_PROMPT_LENGTHS, Case, engine_cases, make_prompts, submit
from .checks import against_reference, invariant

pytestmark = pytest.mark.engine  # the reference has no engine: these tests do not apply to it

ENGINE_MODELS = ("swiftkv-half", "hybrid-acrosskv-window")
INTERPRETER_ENGINE_MODELS = ("hybrid-acrosskv-window",)
_ALL = [(m, e) for m in ENGINE_MODELS for e in engine_cases(m)]


@pytest.mark.parametrize(("model", "engine_name"), _ALL, ids=[f"{m}-{e}" for m, e in _ALL])
def test_engine_matrix(impl, model, engine_name, bench, request):
    ec = engine_cases(model)[engine_name]
    if impl.interpreted and not (ec.interp and model in INTERPRETER_ENGINE_MODELS):
        pytest.skip(
            f"{impl.name} under the Triton interpreter runs only the small engine cases (slow); "
            "the full matrix runs on GPU"
        )
    if (why := impl.unsupported(ec.options)) is not None:
        pytest.skip(f"{impl.name}: {why}")
    if ec.options.block_size == 256 and not str(impl.device()).startswith("cuda") and impl.interpreted:
        pytest.skip("block size 256 under the Triton interpreter is too slow")

    config, _ = bench.model(model)
    lengths = SMALL_PROMPT_LENGTHS if impl.interpreted else PROMPT_LENGTHS
    if ec.shared_prefix:
        lengths = tuple(max(1, n // 3) for n in lengths)
    lengths = ec.prompt_lengths or lengths
    prompts = make_prompts(config.vocab_size, lengths, seed=21, shared_prefix=ec.shared_prefix)
    max_tokens = ec.max_tokens or (3 if impl.interpreted else 5)
    sampling = [Sampling(max_tokens=max_tokens)] * len(prompts)
    case = Case(request.node.nodeid, impl, model, ec.options, ec.waves, prompts, sampling)

    # a fresh engine: the prefix-cache state must be the one this case sets up
    runner = bench.fresh_runner(impl, model, ec.options)
    try:
        actual = submit(runner, prompts, sampling, ec.waves)
        counters = runner.counters()
    finally:
        runner.close()

    expected = bench.expected(model, prompts, sampling)
    print(against_reference(impl, actual, expected, case))

    baseline = bench.baseline(impl, model, prompts, sampling)
    invariant(impl, actual, baseline, case, what=f"engine {engine_name}")

    if ec.expect_preemption and "num_preemptions" in counters:
        assert counters["num_preemptions"] > 0, f"the tiny pool forced no preemption\n{case.describe()}"
    if ec.expect_cache_hits is not None:
        cached = [o.num_cached_tokens for o in actual[1:]]
        if any(c is None for c in cached):
            pytest.skip(f"{impl.name} reports no num_cached_tokens; tokens matched, cache use not verified")
        if ec.expect_cache_hits:
            assert sum(cached) > 0, (
                f"prefix caching on, shared prefix, yet no cached tokens: {cached}\n{case.describe()}"
            )
        else:
            assert sum(cached) == 0, (
                f"prefix caching off, yet cached tokens reported: {cached}\n{case.describe()}"
            )


def test_prefix_cache_state_invariance(impl, bench, request):
    """The same request before and after its own prefix is cached (and after the cache is reset)."""
    model = "hybrid-acrosskv-window"
    if impl.interpreted:
        pytest.skip(f"{impl.name} under the Triton interpreter: covered by the prefix-on engine case")
    options = impl.default_engine().replace(enable_prefix_caching=True)
    if options.block_size > 16:  # flash: the shared prefix must span a block
        shared = options.block_size + 8
    else:
        options, shared = options.replace(block_size=4), 24
    if (why := impl.unsupported(options)) is not None:
        pytest.skip(f"{impl.name}: {why}")
    config, _ = bench.model(model)
    prompts = make_prompts(config.vocab_size, (6, 6), seed=33, shared_prefix=shared)
    sampling = [Sampling(max_tokens=5)] * 2
    case = Case(request.node.nodeid, impl, model, options, "repeat", prompts, sampling)
    runner = bench.fresh_runner(impl, model, options)
    try:
        cold = runner.generate(prompts, sampling)
        warm = runner.generate(prompts, sampling)  # full-prompt hits (capped at len - 1)
        warm_rev = runner.generate(prompts[::-1], sampling)[::-1]
    finally:
        runner.close()
    invariant(impl, warm, cold, case, what="second run (prefix cache warm)")
    invariant(impl, warm_rev, cold, case, what="reversed batch, cache warm")
