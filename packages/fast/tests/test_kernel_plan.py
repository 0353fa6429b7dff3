"""The kernel plan (kernels/plan.py, worker/kernel_plan.py): every kernel is chosen once, when the engine
is built, from the engine's own switches; it is logged as one table and reported by the engine; the
steps that follow never ask again; and the compact weight forms are kept or dropped by whole steps."""

from __future__ import annotations

import logging

import pytest
import torch
from swiftkv_fast import LLM, SamplingParams, envs
from swiftkv_fast.kernels import build, native
from swiftkv_fast.kernels.plan import plan_kernels
from swiftkv_fast.worker import form_timing
from swiftkv_reference.testing import four_bit_state_dict, random_state_dict, tiny_config

needs_compiler = pytest.mark.skipif(build.compiler() is None, reason="no C compiler")
PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13]]
GREEDY = SamplingParams(temperature=0, max_tokens=5)


def plan(dtype=torch.float32, disabled=(), device="cpu", head_dim=64, tp=1):
    return plan_kernels(
        device,
        dtype,
        dtype,
        num_heads=6,
        num_kv_heads=2,
        head_dim=head_dim,
        disabled=frozenset(disabled),
        tensor_parallel_size=tp,
    )


def ops(p) -> dict[str, str]:
    """{op: implementation} of a KernelPlan or of its dict (LLM.get_kernel_plan)."""
    d = p if isinstance(p, dict) else p.as_dict()
    return {op: entry["implementation"] for op, entry in d["ops"].items()}


@needs_compiler
def test_fp32_on_cpu_runs_the_c_kernels_and_says_so():
    p = plan()
    assert p.row_ops is not None and p.decode_attention is not None and p.prefill_attention is not None
    assert ops(p)["decode attention"].startswith("C ") and ops(p)["row ops"].startswith("C ")
    assert "head_dim 64, 3 query heads per KV head" in p.as_dict()["ops"]["decode attention"]["note"]


@needs_compiler
def test_bf16_weights_multiplied_in_fp32_run_the_c_kernels_over_a_bf16_cache():
    p = plan_kernels(
        "cpu",
        torch.bfloat16,
        torch.bfloat16,
        num_heads=6,
        num_kv_heads=2,
        head_dim=64,
        disabled=frozenset(),
        compute_dtype=torch.float32,
    )
    assert p.row_ops is not None and p.decode_attention is not None and p.prefill_attention is not None
    assert "bfloat16 cache" in p.as_dict()["ops"]["decode attention"]["note"]
    assert p.as_dict()["dtype"] == "bfloat16" and p.as_dict()["compute_dtype"] == "float32"
    assert "bfloat16 weights (multiplied in float32), bfloat16 KV cache" in p.table().splitlines()[0]


@pytest.mark.parametrize(
    "kwargs, why",
    [
        (dict(dtype=torch.bfloat16), "fp32 only"),
        (dict(device="cuda"), "not on CPU"),
        (dict(disabled={"decode", "ops"}), "in disabled_kernels"),
    ],
)
def test_what_does_not_run_a_c_kernel_is_named_with_the_reason(kwargs, why):
    p = plan(**kwargs)
    assert p.decode_attention is None and p.decode_stack is None
    assert ops(p)["decode attention"] == "torch SDPA"
    assert why in p.as_dict()["ops"]["decode attention"]["note"]
    assert "decode stack" in ops(p)


@needs_compiler
def test_a_head_dim_without_a_build_gets_torch_and_the_reason():
    p = plan(head_dim=20)  # not a multiple of 8
    assert p.decode_attention is None and p.prefill_attention is None
    assert "no build for head_dim 20" in p.as_dict()["ops"]["prefill attention"]["note"]


def test_an_unknown_kernel_name_is_refused_by_the_config():
    cfg = tiny_config(num_hidden_layers=2)
    with pytest.raises(ValueError, match="disabled_kernels.*unknown.*'gemmm'"):
        LLM.from_state_dict(cfg, random_state_dict(cfg), disabled_kernels="ops,gemmm")


@needs_compiler
def test_each_engine_follows_its_own_switches_in_one_process_with_the_same_tokens(caplog):
    cfg = tiny_config(num_hidden_layers=3)
    state = random_state_dict(cfg)
    with caplog.at_level(logging.INFO, logger="swiftkv_fast"):
        fast = LLM.from_state_dict(cfg, state, num_key_value_layers=2, max_model_len=64)
        plain = LLM.from_state_dict(
            cfg, state, num_key_value_layers=2, max_model_len=64, disabled_kernels=list(envs.KERNELS)
        )
    assert sum("kernel plan (" in r.getMessage() for r in caplog.records) == 2  # one table per engine
    on, off = ops(fast.get_kernel_plan()), ops(plain.get_kernel_plan())
    assert on["decode attention"].startswith("C ") and off["decode attention"] == "torch SDPA"
    assert off["row ops"] == "torch" and plain.get_kernel_plan()["disabled_kernels"] == sorted(envs.KERNELS)
    assert plain.llm_engine.runner.model.stacks == (None, None)
    assert fast.get_stats()["kernel_plan"] == fast.get_kernel_plan()
    a = [o.outputs[0].token_ids for o in fast.generate(PROMPTS, GREEDY, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert a == b


@needs_compiler
def test_steps_never_ask_whether_a_kernel_applies(monkeypatch):
    cfg = tiny_config(num_hidden_layers=3)
    llm = LLM.from_state_dict(cfg, random_state_dict(cfg), num_key_value_layers=2, max_model_len=64)
    asked = []
    monkeypatch.setattr(envs, "kernel_enabled", lambda name: asked.append(name) or True)
    monkeypatch.setattr(native, "load", lambda *a, **k: asked.append(a) or None)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=4)
    llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.generate(PROMPTS, sampled, use_tqdm=False)
    assert asked == []


def test_the_plain_layouts_must_win_the_whole_step_score_beyond_noise():
    both = {"compact": {"decode": 1.0, "prefill": 1.0}, "fp32": {"decode": 0.99, "prefill": 0.99}}
    assert form_timing.choose(both)[0] == "compact"  # within noise: the smaller weights stay
    faster = {"compact": {"decode": 1.0, "prefill": 1.0}, "fp32": {"decode": 0.8, "prefill": 0.9}}
    keep, why = form_timing.choose(faster)
    assert keep == "fp32" and "decode 0.80x, prefill 0.90x" in why
    mixed = {"compact": {"decode": 1.0, "prefill": 2.0}, "fp32": {"decode": 0.7, "prefill": 2.2}}
    assert form_timing.choose(mixed)[0] == "fp32"  # 0.7 + 1.0 against 1.0 + 1.1 (each over the faster)


@needs_compiler
@pytest.mark.parametrize("winner", ["compact", "fp32"])
def test_the_compact_forms_are_kept_or_dropped_by_whole_steps(monkeypatch, tmp_path, winner):
    monkeypatch.setenv("SWIFTKV_CACHE", str(tmp_path))
    cfg = tiny_config(num_hidden_layers=3)
    state = four_bit_state_dict(random_state_dict(cfg))
    timed = []

    def fake_times(models, kv_cache, num_groups, decode_rows, prefill_rows, cold, **kwargs):
        timed.append(sorted(models))
        fast, slow = {"decode": 1e-3, "prefill": 1e-2}, {"decode": 2e-3, "prefill": 2e-2}
        return {form: fast if form == winner else slow for form in models}, 0.0  # undisturbed

    monkeypatch.setattr(form_timing, "time_forms", fake_times)
    llm = LLM.from_state_dict(cfg, state, num_key_value_layers=2, max_model_len=64)
    plan_ops = llm.get_kernel_plan()["ops"]
    assert plan_ops["weight forms"]["implementation"].startswith(winner)
    linears = [op for op in plan_ops if op.startswith("  qkv")]
    assert linears and all(("4-bit" in op) == (winner == "compact") for op in linears)
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    # the decision is cached: a second engine does not time again, and decides the same
    again = LLM.from_state_dict(cfg, state, num_key_value_layers=2, max_model_len=64)
    assert timed == [["compact", "fp32"]]
    assert again.get_kernel_plan()["ops"]["weight forms"] == plan_ops["weight forms"]
    assert [o.outputs[0].token_ids for o in again.generate(PROMPTS, GREEDY, use_tqdm=False)] == want


@needs_compiler
def test_forms_timed_on_a_busy_cpu_are_not_cached(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("SWIFTKV_CACHE", str(tmp_path))
    cfg = tiny_config(num_hidden_layers=2)
    state = four_bit_state_dict(random_state_dict(cfg))
    timed = []

    def busy_times(models, *args, **kwargs):
        timed.append(1)
        return {form: {"decode": 1e-3, "prefill": 1e-2} for form in models}, 0.5  # half the time waiting

    monkeypatch.setattr(form_timing, "time_forms", busy_times)
    with caplog.at_level(logging.WARNING, logger="swiftkv_fast"):
        LLM.from_state_dict(cfg, state, max_model_len=64)
        LLM.from_state_dict(cfg, state, max_model_len=64)
    assert len(timed) == 2  # timed again: nothing was cached
    assert sum("weight forms were timed" in r.getMessage() for r in caplog.records) == 2


@needs_compiler
def test_the_forms_are_judged_within_a_short_max_model_len(monkeypatch, tmp_path):
    """The whole steps the forms are timed by stay inside the RoPE table of a short max_model_len."""
    monkeypatch.setenv("SWIFTKV_CACHE", str(tmp_path))
    cfg = tiny_config(num_hidden_layers=2)
    state = four_bit_state_dict(random_state_dict(cfg))
    llm = LLM.from_state_dict(cfg, state, max_model_len=24, max_num_batched_tokens=16, max_num_seqs=4)
    assert "whole steps" in llm.get_kernel_plan()["ops"]["weight forms"]["note"]
    assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
