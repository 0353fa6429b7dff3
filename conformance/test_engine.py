"""Engine matrix and scheduling invariance, and the stop rules.

For every engine configuration (block size, chunk budget, max_num_seqs, prefix caching with shared
prefixes, a tiny pool that forces preemption, one call per prompt vs one batch), each implementation
must (1) match the reference and (2) give the same greedy tokens as itself under its default engine.
`min_tokens` against an EOS the model prefers at a known output index, and stop strings that occur
in the prompt but not in the output, must match the reference with vLLM's rules
(`adapters.reference.reference_generate`).
"""

from __future__ import annotations

import pytest

from .adapters.base import CharTokenizer, Sampling
from .adapters.reference import build_reference_model, reference_generate
from .cases import (
    PROMPT_LENGTHS,
    SMALL_PROMPT_LENGTHS,
    Case,
    build_config,
    engine_cases,
    make_prompts,
    model_overrides,
    submit,
)
from .checks import against_reference, against_reference_twice, invariant

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

    def run() -> tuple[list, dict[str, int]]:
        # a fresh engine: the prefix-cache state must be the one this case sets up
        runner = bench.fresh_runner(impl, model, ec.options)
        try:
            return submit(runner, prompts, sampling, ec.waves), runner.counters()
        finally:
            runner.close()

    def rerun() -> tuple[list, list]:
        ref = bench.reference_model(model)  # each prompt alone, as bench.expected computes it
        recomputed = [reference_generate(ref, [p], [s])[0] for p, s in zip(prompts, sampling)]
        return run()[0], recomputed

    actual, counters = run()
    expected = bench.expected(model, prompts, sampling)
    print(against_reference_twice(impl, actual, expected, case, rerun))

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


STOP_RULES_MODEL = "hybrid-acrosskv-window"
STOP_RULES_MAX_TOKENS = 12


def _stop_rules_case(impl) -> None:
    if not impl.exact:
        pytest.skip("the stop-rule cases compare greedy tokens exactly: fp32 only")
    if impl.interpreted:
        pytest.skip(f"{impl.name} under the Triton interpreter: the stop rules are backend-independent")


def _craft_eos_at_k(bench, model: str) -> tuple[dict, list[int], int]:
    """(config overrides making EOS the token the model prefers at output index k, prompt, k).

    Greedy without EOS, the prompt's outputs first produce token t at index k >= 2; t becomes an EOS.
    With it masked at k (min_tokens = k + 1) the outputs go another way; if they never come back to
    t, the first new token they produce after k becomes a second EOS id (models have several), so the
    case also shows where the first allowed EOS lands. Found with the reference, deterministically."""
    config, state = bench.model(model)
    special = {config.bos_token_id, *config.eos_token_id}
    for seed in range(20):
        prompt = make_prompts(config.vocab_size, (10,), seed=1000 + seed)[0]
        free = bench.expected(model, [prompt], [Sampling(max_tokens=STOP_RULES_MAX_TOKENS)])[0].token_ids
        k = next((k for k in range(2, 6) if free[k] not in free[:k] and free[k] not in special), None)
        if k is None:
            continue
        extra = {"eos_token_id": [free[k]]}
        ref = build_reference_model(build_config({**model_overrides(model), **extra}), state)
        masked = Sampling(max_tokens=STOP_RULES_MAX_TOKENS, ignore_eos=False, min_tokens=k + 1)
        out = reference_generate(ref, [prompt], [masked])[0]
        if out.finish_reason == "stop":
            return extra, prompt, k
        later = out.token_ids
        u = next((u for e, u in enumerate(later) if e > k and u not in later[:e] and u not in special), None)
        if u is not None:
            return {"eos_token_id": [free[k], u]}, prompt, k
    raise AssertionError(f"{model}: no prompt found whose greedy output crafts the min_tokens case")


def test_min_tokens_against_eos_at_index_k(impl, bench, request):
    """The model prefers EOS at output index k: min_tokens = k lets it stop there; min_tokens = k + 1
    masks it there (the next best token instead) and the first EOS lands where the reference with the
    same mask says; nothing before it changes."""
    _stop_rules_case(impl)
    model = STOP_RULES_MODEL
    extra, prompt, k = _craft_eos_at_k(bench, model)
    _, state = bench.model(model)
    config = build_config({**model_overrides(model), **extra})
    eos = set(config.eos_token_id)
    engine = impl.default_engine()
    sampling = [
        Sampling(max_tokens=STOP_RULES_MAX_TOKENS, ignore_eos=False, min_tokens=m) for m in (0, k, k + 1)
    ]
    prompts = [prompt] * len(sampling)
    case = Case(request.node.nodeid, impl, model, engine, "all", prompts, sampling, extra_overrides=extra)
    expected = reference_generate(build_reference_model(config, state), prompts, sampling)
    free, at_k, past_k = (e.token_ids for e in expected)
    assert free == at_k and len(free) == k + 1 and free[k] in eos, f"crafted case broken\n{case.describe()}"
    assert past_k[:k] == free[:k] and not eos & set(past_k[: k + 1]) and past_k[-1] in eos, case.describe()
    runner = impl.build(config, state, engine)
    try:
        actual = runner.generate(prompts, sampling)
    finally:
        runner.close()
    print(against_reference(impl, actual, expected, case))
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a.finish_reason, a.text) == (e.finish_reason, e.text), (
            f"request {i} (min_tokens={sampling[i].min_tokens}): finish {a.finish_reason!r} text {a.text!r}, "
            f"reference {e.finish_reason!r} {e.text!r}\n{case.describe()}"
        )


def test_stop_string_in_prompt_does_not_stop(impl, bench, request):
    """Stop strings are searched in the output text only: one inside the prompt and one across the
    prompt/output boundary never stop the request; one the output completes at token j stops it
    there, every token kept and the text cut before it."""
    _stop_rules_case(impl)
    impl.require("stop-strings")
    model = STOP_RULES_MODEL
    config, _ = bench.model(model)
    tok = CharTokenizer.for_config(config)
    for seed in range(50):  # a prompt whose outputs hold no special id: one character per token
        prompt = make_prompts(config.vocab_size, (12,), seed=2000 + seed)[0]
        free = bench.expected(model, [prompt], [Sampling(max_tokens=STOP_RULES_MAX_TOKENS)])[0].token_ids
        if not set(prompt + free) & tok.special_ids:
            break
    prompt_text, out_text = tok.decode(prompt), tok.decode(free)
    in_prompt = next(prompt_text[i : i + 3] for i in range(10) if prompt_text[i : i + 3] not in out_text)
    across = prompt_text[-2:] + out_text[:1]
    assert across not in out_text, f"prompt {prompt}: pick another seed"
    j = next(j for j in range(4, len(free)) if out_text[j - 1 : j + 1] not in out_text[:j])
    completes_at_j = out_text[j - 1 : j + 1]
    sampling = [
        Sampling(max_tokens=STOP_RULES_MAX_TOKENS, stop=(in_prompt, across)),
        Sampling(max_tokens=STOP_RULES_MAX_TOKENS, stop=(in_prompt, completes_at_j)),
    ]
    prompts = [prompt, prompt]
    engine = impl.default_engine()
    case = Case(request.node.nodeid, impl, model, engine, "all", prompts, sampling)
    expected = bench.expected(model, prompts, sampling)
    assert (expected[0].token_ids, expected[0].finish_reason, expected[0].text) == (free, "length", out_text)
    assert (expected[1].token_ids, expected[1].finish_reason) == (free[: j + 1], "stop"), case.describe()
    assert expected[1].text == out_text[: j - 1], case.describe()
    actual = submit(bench.runner(impl, model, engine), prompts, sampling, "all")
    print(against_reference(impl, actual, expected, case))
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert (a.finish_reason, a.text) == (e.finish_reason, e.text), (
            f"request {i} (stop={sampling[i].stop}): finish {a.finish_reason!r} text {a.text!r}, "
            f"reference {e.finish_reason!r} {e.text!r}\n{case.describe()}"
        )
