"""Tiny random models, prompts, engine configurations, and the text that reproduces a case alone."""

from __future__ import annotations

import dataclasses
import pprint
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from .adapters.base import EngineOptions, Implementation, Output, Runner, Sampling

# Shared by every model case: head_dim >= 32 (compiled flex_attention on CPU is wrong for 16), GQA 4q/2kv.
BASE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
)
WINDOW = 8  # shorter than every multi-block prompt below
SLIDING, FULL = "sliding_attention", "full_attention"

MODEL_CASES: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama"),
    "swiftkv-half": dict(model_type="llama", num_key_value_layers=2, key_value_group_size=1),
    "acrosskv-g2": dict(model_type="llama", num_key_value_layers=2, key_value_group_size=2),
    "swiftkv-l1": dict(model_type="llama", num_key_value_layers=1, key_value_group_size=1),
    "mistral-window": dict(model_type="mistral", sliding_window=WINDOW, layer_types=[SLIDING] * 4),
    "mistral-window-swiftkv": dict(
        model_type="mistral",
        sliding_window=WINDOW,
        layer_types=[SLIDING] * 4,
        num_key_value_layers=2,
        key_value_group_size=1,
    ),
    # hybrid models are Qwen2-style (mistral windows every layer): q/k/v biases, per-layer layer_types
    "hybrid": dict(
        model_type="qwen2", hidden_size=128, sliding_window=WINDOW, layer_types=[SLIDING, FULL, SLIDING, FULL]
    ),
    "qwen2-bias": dict(
        model_type="qwen2", attention_bias=True, hidden_size=128
    ),  # HF Qwen2: head_dim = hidden / heads
    # everything at once: two cache groups (full + sliding), a windowed AcrossKV group in the second half
    "hybrid-acrosskv-window": dict(
        model_type="qwen2",
        hidden_size=128,
        sliding_window=WINDOW,
        layer_types=[FULL, SLIDING, SLIDING, SLIDING],
        num_key_value_layers=2,
        key_value_group_size=2,
    ),
}
WEIGHT_SEED = 1234

PROMPT_LENGTHS = (1, 9, 26, 45)
SMALL_PROMPT_LENGTHS = (5, 19)  # for the Triton interpreter


def model_overrides(name: str) -> dict[str, Any]:
    over = {**BASE, **MODEL_CASES[name]}
    n = over["num_hidden_layers"]
    if over.get("num_key_value_layers", n) < n:
        over["swiftkv"] = True
    return over


def build_config(overrides: dict[str, Any]) -> Any:
    from swiftkv_reference.testing import tiny_config

    return tiny_config(**overrides)


def make_prompts(
    vocab_size: int, lengths: tuple[int, ...], seed: int, shared_prefix: int = 0
) -> list[list[int]]:
    """Random token ids in [1, vocab); with `shared_prefix`, every prompt starts with the same tokens."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(1, vocab_size, (shared_prefix,), generator=g).tolist()
    return [prefix + torch.randint(1, vocab_size, (n,), generator=g).tolist() for n in lengths]


@dataclass(frozen=True)
class EngineCase:
    """An engine configuration plus how the prompts are submitted.

    waves: "all" = one generate call; "each" = one call per prompt; "prefix" = the first prompt alone,
    then the rest (they share a prefix with it, so a prefix cache hits).
    """

    options: EngineOptions
    waves: str = "all"
    shared_prefix: int = 0
    interp: bool = False  # also run under the Triton interpreter
    expect_cache_hits: bool | None = None  # True: some prompt tokens must come from the prefix cache
    expect_preemption: bool = False  # the pool is too small for the batch: the engine must preempt
    prompt_lengths: tuple[int, ...] | None = None  # (after the shared prefix); None: the suite's default
    max_tokens: int | None = None


def engine_cases(model_name: str) -> dict[str, EngineCase]:
    two_groups = FULL in MODEL_CASES[model_name].get("layer_types", [FULL]) and SLIDING in MODEL_CASES[
        model_name
    ].get("layer_types", [])
    tiny_pool = 26 if two_groups else 14  # bs 4: one request fits alone, the batch does not
    E = EngineOptions
    return {
        "bs1": EngineCase(E(block_size=1)),
        "bs16": EngineCase(E(block_size=16)),
        "bs256": EngineCase(E(block_size=256)),
        "chunk5-bs16": EngineCase(E(block_size=16, max_num_batched_tokens=5), interp=True),  # < one block
        "chunk24-bs4": EngineCase(E(block_size=4, max_num_batched_tokens=24)),
        "chunk4096": EngineCase(E(block_size=16, max_num_batched_tokens=4096)),  # > the whole batch
        "seqs1": EngineCase(E(block_size=16, max_num_seqs=1)),
        "seqs8-each": EngineCase(E(block_size=16, max_num_seqs=8), waves="each"),
        "prefix-on-bs4": EngineCase(
            E(block_size=4, enable_prefix_caching=True),
            waves="prefix",
            shared_prefix=20,
            interp=True,
            expect_cache_hits=True,
        ),
        "prefix-on-bs16-chunk7": EngineCase(
            E(block_size=16, max_num_batched_tokens=7, enable_prefix_caching=True),
            waves="prefix",
            shared_prefix=37,
            expect_cache_hits=True,
        ),
        "prefix-off-bs4": EngineCase(
            E(block_size=4, enable_prefix_caching=False),
            waves="prefix",
            shared_prefix=20,
            expect_cache_hits=False,
        ),
        # four equal requests admitted together, then every decode needs a new block: preemption
        "preempt-bs4": EngineCase(
            E(block_size=4, num_kv_blocks=tiny_pool, max_num_seqs=8, max_model_len=32),
            prompt_lengths=(12, 12, 12, 12),
            max_tokens=8,
            expect_preemption=True,
        ),
        "preempt-bs4-prefix": EngineCase(
            E(
                block_size=4,
                num_kv_blocks=tiny_pool,
                enable_prefix_caching=True,
                max_model_len=32,
                max_num_batched_tokens=16,
            ),
            waves="prefix",
            shared_prefix=8,
            prompt_lengths=(4, 4, 4, 4),
            max_tokens=8,
        ),
    }


@dataclass
class Case:
    """Everything needed to reproduce one comparison alone."""

    nodeid: str
    impl: Implementation
    model: str
    engine: EngineOptions | None = None
    waves: str = "all"
    prompts: list[list[int]] = field(default_factory=list)
    sampling: list[Sampling] = field(default_factory=list)
    seed: int = WEIGHT_SEED
    extra_overrides: dict[str, Any] = field(default_factory=dict)  # on top of the model case's config

    def describe(self) -> str:
        overrides = {**model_overrides(self.model), **self.extra_overrides}
        sampling = (
            self.sampling[0] if self.sampling and all(s == self.sampling[0] for s in self.sampling) else None
        )
        dtype = str(self.impl.dtype).removeprefix("torch.")
        over = pprint.pformat(overrides, width=200, compact=True)
        lines = [
            "---- reproduce this case alone ----",
            f"rerun:    pytest '{self.nodeid}' --impl={self.impl.name} --dtype={dtype}",
            f"impl:     {self.impl.describe()}",
            f"model:    {self.model}: swiftkv_reference.testing.tiny_config(**{over})",
            f"weights:  swiftkv_reference.testing.random_state_dict(config, seed={self.seed})",
        ]
        if self.impl.weights == "four-bit":
            lines[-1] = f"weights:  swiftkv_reference.testing.four_bit_state_dict({lines[-1][10:]})"
        elif self.impl.weights == "bf16":
            lines[-1] += ", every tensor .to(torch.bfloat16).float()"
        if self.engine is not None:
            lines.append(f"engine:   {self.engine}, submitted as waves={self.waves!r}")
        lines.append(f"sampling: {sampling if sampling is not None else self.sampling}")
        lines.append(f"prompts:  {self.prompts}")
        return "\n".join(lines)


def submit(runner: Runner, prompts: list[list[int]], sampling: list[Sampling], waves: str) -> list[Output]:
    if waves == "all":
        return runner.generate(prompts, sampling)
    if waves == "each":
        return [runner.generate([p], [s])[0] for p, s in zip(prompts, sampling)]
    if waves == "prefix":
        return runner.generate(prompts[:1], sampling[:1]) + runner.generate(prompts[1:], sampling[1:])
    raise ValueError(waves)


class Workbench:
    """Session-wide caches: configs, weights, the reference's outputs, and built engines (LRU)."""

    def __init__(self, max_runners: int = 3):
        self._models: dict[str, tuple[Any, dict[str, torch.Tensor]]] = {}
        self._expected: dict[Any, list[Output]] = {}
        self._runners: OrderedDict[Any, Runner] = OrderedDict()
        self._baselines: dict[Any, list[Output]] = {}
        self._ref_models: dict[str, torch.nn.Module] = {}
        self.max_runners = max_runners

    def model(self, name: str) -> tuple[Any, dict[str, torch.Tensor]]:
        """A model case's config and weights; "NAME@four-bit": at a dequantized Q4_1 checkpoint's values;
        "NAME@bf16": every weight rounded to bf16, as a bf16 checkpoint loaded in fp32."""
        if name not in self._models:
            from swiftkv_reference.testing import four_bit_state_dict, random_state_dict

            base, _, weights = name.partition("@")
            config = build_config(model_overrides(base))
            state = random_state_dict(config, seed=WEIGHT_SEED)
            if weights == "four-bit":
                state = four_bit_state_dict(state)
            elif weights == "bf16":  # a bf16 checkpoint, loaded as fp32
                state = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
            elif weights:
                raise ValueError(f"unknown weights {weights!r} in model case {name!r}")
            self._models[name] = (config, state)
        return self._models[name]

    def on(self, weights: str) -> Workbench | WeightsView:
        """This bench as an implementation with `weights` ("random", "four-bit") sees it."""
        return self if weights == "random" else WeightsView(self, weights)

    def reference_model(self, name: str) -> torch.nn.Module:
        if name not in self._ref_models:
            from .adapters.reference import build_reference_model

            config, sd = self.model(name)
            self._ref_models[name] = build_reference_model(config, sd)
        return self._ref_models[name]

    def expected(self, name: str, prompts: list[list[int]], sampling: list[Sampling]) -> list[Output]:
        """The oracle: the reference, fp32 on CPU, each prompt alone."""
        from .adapters.reference import reference_generate

        outs = []
        for p, s in zip(prompts, sampling):
            key = (name, tuple(p), s)
            if key not in self._expected:
                self._expected[key] = reference_generate(self.reference_model(name), [p], [s])
            outs.append(self._expected[key][0])
        return outs

    def baseline(self, impl: Implementation, name: str, prompts: list[list[int]], sampling: list[Sampling]):
        """The implementation's own outputs under its default engine, one batch (memoized)."""
        key = (impl.name, str(impl.dtype), name, tuple(map(tuple, prompts)), tuple(sampling))
        if key not in self._baselines:
            engine = impl.default_engine()
            self._baselines[key] = submit(self.runner(impl, name, engine), prompts, sampling, "all")
        return self._baselines[key]

    def runner(self, impl: Implementation, name: str, engine: EngineOptions) -> Runner:
        if impl.name == "reference":  # share the oracle's module (weights are read-only)
            from .adapters.reference import ReferenceRunner

            return ReferenceRunner(self.reference_model(name))
        key = (impl.name, str(impl.dtype), name, engine)
        if key in self._runners:
            self._runners.move_to_end(key)
            return self._runners[key]
        while len(self._runners) >= self.max_runners:
            _, old = self._runners.popitem(last=False)
            old.close()
        config, sd = self.model(name)
        runner = impl.build(config, sd, engine)
        self._runners[key] = runner
        return runner

    def fresh_runner(self, impl: Implementation, name: str, engine: EngineOptions) -> Runner:
        """A runner with an empty prefix cache (not shared with other tests)."""
        config, sd = self.model(name)
        return impl.build(config, sd, engine)

    def close(self) -> None:
        for r in self._runners.values():
            r.close()
        self._runners.clear()


def config_summary(config: Any) -> str:
    if dataclasses.is_dataclass(config):
        return repr(config)
    return str(config)


class WeightsView:
    """A Workbench whose model cases carry other weights ("NAME@four-bit"), the oracle's outputs and
    engines included; tests pass the plain model names."""

    def __init__(self, bench: Workbench, weights: str):
        self._bench, self._suffix = bench, f"@{weights}"

    def model(self, name: str):
        return self._bench.model(name + self._suffix)

    def reference_model(self, name: str):
        return self._bench.reference_model(name + self._suffix)

    def expected(self, name: str, prompts, sampling):
        return self._bench.expected(name + self._suffix, prompts, sampling)

    def baseline(self, impl, name: str, prompts, sampling):
        return self._bench.baseline(impl, name + self._suffix, prompts, sampling)

    def runner(self, impl, name: str, engine):
        return self._bench.runner(impl, name + self._suffix, engine)

    def fresh_runner(self, impl, name: str, engine):
        return self._bench.fresh_runner(impl, name + self._suffix, engine)
