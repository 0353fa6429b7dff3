"""bf16 on CPU: dtype="auto" follows the checkpoint as vLLM's does (fp32 stays fp32; bf16 and fp16 run in
bf16); a bf16 engine keeps its residual stream and its logits in fp32. Where the CPU has bf16 units its
activations are bf16 and it runs no fp32-only kernel; where it has none (said once) its weights and KV
cache stay bf16 and are multiplied in fp32 by the fp32 engine's kernels (`compute_dtype`)."""

from __future__ import annotations

import logging

import pytest
import torch
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast import config as config_module
from swiftkv_fast.config import EngineConfig
from swiftkv_fast.kernels import plan as plan_module
from swiftkv_fast.kernels.cpu_gemm import PANEL, PanelWeight
from swiftkv_fast.kernels.linear_kernels import nbytes
from swiftkv_reference.checkpoint import save_checkpoint
from swiftkv_reference.testing import random_state_dict, tiny_config

PROMPTS = [[5, 6, 7, 8, 9] * 3, [11, 12, 13]]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{dtype name: a tiny checkpoint directory with its weights stored in that dtype}."""
    cfg = tiny_config(num_hidden_layers=2)
    state = random_state_dict(cfg)
    dirs = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        path = tmp_path_factory.mktemp(name)
        save_checkpoint(path, cfg, {k: v.to(dtype) for k, v in state.items()})
        dirs[name] = path
    return dirs


@pytest.mark.parametrize("units", [True, False])
@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
def test_auto_follows_the_checkpoint(checkpoints, monkeypatch, caplog, stored, units):
    monkeypatch.setattr(config_module, "cpu_bf16_units", lambda: units)
    with caplog.at_level(logging.INFO, logger="swiftkv_fast"):
        llm = LLM(str(checkpoints[stored]), max_model_len=64, kv_cache_memory=4 << 20, linear_kernel="linear")
    want = torch.bfloat16 if stored != "float32" else torch.float32
    econf = llm.llm_engine.econf
    assert econf.dtype == want and econf.kv_cache_dtype == want  # the KV cache follows an "auto" dtype
    assert econf.compute_dtype == (want if units else torch.float32)
    said = [r.getMessage() for r in caplog.records if "no bf16 units" in r.getMessage()]
    assert len(said) == (1 if stored != "float32" and not units else 0)


def test_an_explicit_dtype_is_kept_whatever_the_checkpoint(checkpoints):
    econf = EngineConfig(dtype="float32", kv_cache_dtype="bfloat16")
    assert econf.follow_checkpoint(torch.bfloat16) is None
    assert econf.dtype == torch.float32 and econf.kv_cache_dtype == torch.bfloat16


def test_an_in_memory_bf16_state_dict_is_followed_too(monkeypatch):
    monkeypatch.setattr(config_module, "cpu_bf16_units", lambda: True)
    cfg = tiny_config(num_hidden_layers=2)
    state = {k: v.bfloat16() for k, v in random_state_dict(cfg).items()}
    llm = LLM.from_state_dict(cfg, state, max_model_len=64, kv_cache_memory=4 << 20, linear_kernel="linear")
    assert llm.llm_engine.econf.dtype == torch.bfloat16


def test_a_bf16_engine_keeps_an_fp32_residual_and_fp32_logits_and_says_so(monkeypatch):
    monkeypatch.setattr(config_module, "cpu_bf16_units", lambda: True)  # bf16 activations (emulated here)
    cfg = tiny_config(num_hidden_layers=3)
    state = random_state_dict(cfg)
    bf16 = LLM.from_state_dict(cfg, state, dtype="bfloat16", max_model_len=64, return_logits=True)
    plan = bf16.get_kernel_plan()["ops"]
    assert (
        plan["row ops"]["note"] == "fp32 only" and plan["decode attention"]["implementation"] == "torch SDPA"
    )
    assert not any("panel" in entry["implementation"] for entry in plan.values())  # fp32-only kernels
    w = bf16.llm_engine.runner.model.w
    assert all(t.dtype == torch.float32 for t in w.lm_head.layouts.values())
    assert w.layers[0].qkv.layouts and w.embed.dtype == torch.bfloat16 and w.norm.dtype == torch.float32
    model = bf16.llm_engine.runner.model
    assert model._embed(torch.tensor([1, 2])).dtype == torch.float32
    out = bf16.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    fp32 = LLM.from_state_dict(cfg, state, max_model_len=64, return_logits=True)
    ref = fp32.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    for a, b in zip(out, ref):
        assert a.outputs[0].logits.dtype == torch.float32
        # the first token's logits, from the same prompt: bf16 weights and activations, close to fp32
        torch.testing.assert_close(a.outputs[0].logits[0], b.outputs[0].logits[0], atol=0.1, rtol=0.05)
    if not plan_module.cpu_bf16_units():
        assert "bf16 units" in plan and plan["bf16 units"]["implementation"] == "none on this CPU"


def test_without_bf16_units_bf16_weights_are_multiplied_in_fp32(monkeypatch):
    monkeypatch.setattr(config_module, "cpu_bf16_units", lambda: False)
    cfg = tiny_config(num_hidden_layers=3, tie_word_embeddings=True)
    state = random_state_dict(cfg)
    kw = dict(max_model_len=64, return_logits=True, num_kv_blocks=32)
    llm = LLM.from_state_dict(cfg, state, dtype="bfloat16", **kw)
    econf, runner = llm.llm_engine.econf, llm.llm_engine.runner
    assert (econf.dtype, econf.compute_dtype, econf.kv_cache_dtype) == (
        torch.bfloat16,
        torch.float32,
        torch.bfloat16,
    )
    got = llm.get_kernel_plan()
    assert (got["dtype"], got["compute_dtype"], got["kv_cache_dtype"]) == ("bfloat16", "float32", "bfloat16")
    assert got["ops"]["row ops"]["note"] != "fp32 only"  # the fp32 engine's kernels run
    assert runner.kv_cache.dtype == torch.bfloat16
    # every weight in bf16 bytes: the embedding as bf16, each linear's layouts (the tied head's included)
    w = runner.model.w
    assert w.embed.dtype == torch.bfloat16 and w.norm.dtype == torch.float32
    linears = [w.lm_head, *(getattr(x, n) for x in w.layers for n in ("qkv", "o", "gate_up", "down"))]
    for lin in linears:
        for layout in lin.layouts.values():
            padded = (
                -(-lin.out_features // PANEL) * PANEL if isinstance(layout, PanelWeight) else lin.out_features
            )
            assert nbytes(layout) <= padded * lin.in_features * 2, (lin.plan, type(layout))
    # the same as an fp32 engine over the weights rounded to bf16 with a bf16 KV cache, up to the kernels'
    # summation orders; not the unrounded fp32 model's
    rounded = {k: v.bfloat16().float() for k, v in state.items()}
    same = LLM.from_state_dict(cfg, rounded, dtype="float32", kv_cache_dtype="bfloat16", **kw)
    fp32 = LLM.from_state_dict(cfg, state, dtype="float32", **kw)
    params = SamplingParams(temperature=0, max_tokens=4)
    out, want, ref = (e.generate(PROMPTS, params, use_tqdm=False) for e in (llm, same, fp32))
    for a, b, c in zip(out, want, ref):
        torch.testing.assert_close(a.outputs[0].logits, b.outputs[0].logits, atol=2e-4, rtol=1e-4)
        assert not torch.equal(a.outputs[0].logits[0], c.outputs[0].logits[0])
