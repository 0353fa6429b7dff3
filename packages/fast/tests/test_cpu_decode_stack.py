"""The decode stack (kernels/cpu_decode_stack.py, model/decode_stack.py): a half's layers over decode rows
as one C call give the per-op path's logits and KV cache bit for bit, on every tiny model kind and at 1-3
threads; it runs only where it applies; bad input raises before anything is written."""

from __future__ import annotations

import platform
import time

import pytest
import torch
from conftest import TINY_MODELS, random_prompts
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.kernels import build, cpu_decode_stack
from swiftkv_fast.model.decode_stack import layer_linears
from swiftkv_reference.testing import four_bit_state_dict

pytestmark = pytest.mark.skipif(
    build.compiler() is None or cpu_decode_stack.kernel(16, 2) is None,
    reason="no C compiler here (the decode stack is a compiled kernel)",
)

ENGINE = dict(
    block_size=4,
    max_model_len=160,
    num_kv_blocks=300,
    max_num_seqs=6,
    max_num_batched_tokens=64,
    return_logits=True,
    linear_kernel="panel",  # every linear through the panel GEMM: the stack's precondition
)
GREEDY = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
ALL = ["full", "swiftkv_g1", "swiftkv_g2", "mistral_swiftkv_g2", "hybrid_swiftkv"]


def _engine(tiny, name, stacks: bool, **overrides):
    cfg, state, _ = tiny(**TINY_MODELS[name])
    llm = LLM.from_state_dict(cfg, state, **{**ENGINE, **overrides})
    model = llm.llm_engine.runner.model
    if not stacks:
        model.stacks = (None, None)
    return cfg, llm, model


def _runs_under(monkeypatch, env: str, values, cfg, state, prompts) -> dict:
    """The same engine built and run greedily under each value of the environment variable `env`:
    {value: (outputs, KV cache, model)}, every decode stack having run."""
    runs = {}
    for value in values:
        monkeypatch.setenv(env, value)
        llm = LLM.from_state_dict(cfg, state, **ENGINE)
        model = llm.llm_engine.runner.model
        runs[value] = (llm.generate(prompts, GREEDY, use_tqdm=False), llm.llm_engine.runner.kv_cache, model)
        assert all(s.calls > 0 for s in model.stacks if s.layers)
    return runs


@pytest.mark.parametrize(
    "name, threads, kv_cache_dtype",
    [
        *((name, threads, "auto") for name in ALL for threads in (1, 3)),
        ("swiftkv_g1", 1, "bfloat16"),  # the cache in bf16: written rounded, read widened, the same both ways
        ("hybrid_swiftkv", 3, "bfloat16"),
    ],
)
def test_stack_equals_per_op_layers(tiny, name, threads, kv_cache_dtype):
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        cfg, per_op, _ = _engine(tiny, name, stacks=False, kv_cache_dtype=kv_cache_dtype)
        _, fused, model = _engine(tiny, name, stacks=True, kv_cache_dtype=kv_cache_dtype)
        assert model.stacks[0].kv_dtype == per_op.llm_engine.runner.kv_cache.dtype
        assert all(s is not None for s in model.stacks)
        # lengths past the sliding windows (16-24) and blocks of 4: windowed reads skip whole blocks
        prompts = random_prompts(5, cfg.vocab_size, [3, 40, 9, 70, 25], seed=2)
        expected = per_op.generate(prompts, GREEDY, use_tqdm=False)
        actual = fused.generate(prompts, GREEDY, use_tqdm=False)
    finally:
        torch.set_num_threads(previous)
    for e, a in zip(expected, actual):
        assert a.outputs[0].token_ids == e.outputs[0].token_ids
        assert torch.equal(a.outputs[0].logits, e.outputs[0].logits)
    first, second = model.stacks
    L = model.L
    # decode steps ran both halves through the stack (the first half of a prompt step did not)
    assert first.calls > 0
    assert second.calls > 0 if L < cfg.num_hidden_layers else second.calls == 0
    kv_per_op = per_op.llm_engine.runner.kv_cache
    kv_fused = fused.llm_engine.runner.kv_cache
    assert kv_fused.dtype == (torch.bfloat16 if kv_cache_dtype == "bfloat16" else torch.float32)
    assert torch.equal(kv_per_op, kv_fused)


@pytest.mark.parametrize("form", ["q4", "bf16"])
@pytest.mark.parametrize("name", ["swiftkv_g1", "hybrid_swiftkv"])
def test_stack_over_compact_panels_equals_fp32_panels(tiny, name, form, monkeypatch):
    """Weights that are a dequantized 4-bit checkpoint's, or a bf16 one's: the stack reads them as 4-bit
    or bf16 panels and gives the fp32 panels' logits and KV cache bit for bit (the per-op path too, on
    prompt steps)."""
    cfg, state, _ = tiny(**TINY_MODELS[name])
    if form == "q4":
        state = four_bit_state_dict(state)
    else:
        state = {k: v.to(torch.bfloat16).float() for k, v in state.items()}
    prompts = random_prompts(4, cfg.vocab_size, [3, 40, 9, 25], seed=5)
    runs = _runs_under(monkeypatch, "SWIFTKV_DISABLED_KERNELS", ("gemm-4bit", ""), cfg, state, prompts)
    for disabled, (_, _, model) in runs.items():
        formats = {lin.layouts["panel"].format for x in model.stacks[0].layers for lin in layer_linears(x)}
        assert formats == {"fp32" if disabled else form}
    (full, kv_full, _), (compact, kv_compact, _) = runs["gemm-4bit"], runs[""]
    for e, a in zip(full, compact):
        assert a.outputs[0].token_ids == e.outputs[0].token_ids
        assert torch.equal(a.outputs[0].logits, e.outputs[0].logits)
    assert torch.equal(kv_full, kv_compact)


def test_stack_stays_off_where_a_linear_is_not_the_panel_gemm(tiny):
    _, llm, model = _engine(tiny, "swiftkv_g1", stacks=True, linear_kernel="linear")
    cfg = llm.llm_engine.runner.config
    llm.generate(random_prompts(2, cfg.vocab_size, [5, 9], seed=1), GREEDY, use_tqdm=False)
    assert all(not s.runs_at(2) and s.calls == 0 for s in model.stacks)


def test_stack_refuses_layers_of_other_widths(tiny):
    """The C call trusts the widths it is given: layers that are not what it computes never reach it."""
    from swiftkv_fast.model.decode_stack import DecodeStack

    _, _, model = _engine(tiny, "swiftkv_g1", stacks=True)
    first = model.stacks[0]
    shape = dict(
        kernel=first._kernel,  # the plan's built stack kernel
        kv_slot=model.kv_slot,
        num_heads=model.num_heads,
        num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim,
        eps=model.eps,
        scale=model.scale,
        rotary=model.rotary,
    )
    assert first.runs_at(2)
    # first-half layers (qkv = q + k + v) taken as second-half ones (qkv = q): refused
    assert not DecodeStack(first.layers, writes_kv=False, **shape).runs_at(2)


def test_bad_input_raises_before_anything_is_written(tiny):
    cfg, llm, model = _engine(tiny, "swiftkv_g1", stacks=True)
    runner = llm.llm_engine.runner
    llm.generate(random_prompts(2, cfg.vocab_size, [20, 30], seed=4), GREEDY, use_tqdm=False)
    stack = model.stacks[1]
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, cfg.hidden_size, generator=g)
    seq_lens = torch.tensor([20, 30], dtype=torch.int32)
    tables = torch.randint(1, 300, (2, 10), generator=g, dtype=torch.int32)
    positions = seq_lens.long() - 1
    cache_before = runner.kv_cache.clone()
    assert stack.applies(h, runner.kv_cache)
    # what the engine never passes: rows of another dtype, a cache of another dtype than it was built for
    with pytest.raises(ValueError, match="decode stack"):
        stack.applies(h.double(), runner.kv_cache)
    with pytest.raises(ValueError, match="decode stack"):
        stack.applies(h, runner.kv_cache.to(torch.bfloat16))
    cases = {
        "RoPE table": dict(positions=torch.tensor([5, 10**6])),
        "block table": dict(seq_lens=torch.tensor([20, 41], dtype=torch.int32)),  # 11 blocks of 4 > 10
        "outside the cache": dict(tables=tables.clone().index_fill_(1, torch.tensor([3]), 300)),
    }
    for what, bad in cases.items():
        x = h.clone()
        with pytest.raises(ValueError, match=what):
            stack.run(
                x,
                bad.get("positions", positions),
                [bad.get("seq_lens", seq_lens)],
                [bad.get("tables", tables)],
                None,
                runner.kv_cache,
            )
        assert torch.equal(x, h), what
    # a slot outside the cache, in the first half (the one that writes K/V)
    x = h.clone()
    slots = torch.tensor([7, 4 * 300])
    with pytest.raises(ValueError, match="slot is outside"):
        model.stacks[0].run(x, positions, [seq_lens], [tables], [slots], runner.kv_cache)
    assert torch.equal(x, h) and torch.equal(runner.kv_cache, cache_before)


def test_stack_survives_the_state_dicts_storage_moving(tiny):
    """The model's norms alias the caller's state dict; a tensor-parallel engine built from the same dict
    moves its storage into shared memory (share_memory_) to send it to the workers. The stack points at
    its own copies, so it still gives the per-op path's tokens and logits."""
    cfg, state, _ = tiny(**TINY_MODELS["swiftkv_g1"])
    per_op = LLM.from_state_dict(cfg, state, **ENGINE)
    per_op.llm_engine.runner.model.stacks = (None, None)
    fused = LLM.from_state_dict(cfg, state, **ENGINE)
    for t in state.values():
        t.share_memory_()  # new storage; the old one is freed
    torch.randn(1 << 16).mul_(float("nan"))  # reuse freed memory for something else
    prompts = random_prompts(3, cfg.vocab_size, [5, 11, 8], seed=6)
    expected = per_op.generate(prompts, GREEDY, use_tqdm=False)
    actual = fused.generate(prompts, GREEDY, use_tqdm=False)
    assert fused.llm_engine.runner.model.stacks[0].calls > 0
    for e, a in zip(expected, actual):
        assert a.outputs[0].token_ids == e.outputs[0].token_ids
        assert torch.equal(a.outputs[0].logits, e.outputs[0].logits)


def test_timed_phases_add_up_and_change_nothing(tiny):
    cfg, llm, model = _engine(tiny, "swiftkv_g1", stacks=True)
    runner = llm.llm_engine.runner
    llm.generate(random_prompts(2, cfg.vocab_size, [20, 30], seed=4), GREEDY, use_tqdm=False)
    stack = model.stacks[0]  # the first half: GEMMs, RoPE + KV writes and attention
    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, cfg.hidden_size, generator=g)
    seq_lens = torch.tensor([20, 30], dtype=torch.int32)
    tables = torch.arange(1, 21, dtype=torch.int32).view(2, 10)
    positions, slots = seq_lens.long() - 1, torch.tensor([4 * 5 + 3, 4 * 18 + 1])
    args = (positions, [seq_lens], [tables], [slots], runner.kv_cache)
    plain = stack.run(h.clone(), *args)
    stack.timings = torch.zeros(3, dtype=torch.float64)
    start = time.perf_counter()
    timed = stack.run(h.clone(), *args)
    wall = time.perf_counter() - start
    phases = dict(zip(cpu_decode_stack.TIMED_PHASES, stack.timings.tolist(), strict=True))
    assert torch.equal(timed, plain)
    assert all(s > 0 for s in phases.values()), phases
    assert sum(phases.values()) <= wall
    stack.timings = torch.zeros(3)  # fp32: refused before the call
    with pytest.raises(ValueError, match="float64"):
        stack.run(h.clone(), *args)
    stack.timings = None


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
@pytest.mark.parametrize("weights", ["fp32", "q4"])
def test_an_engine_built_for_a_lesser_x86_gives_the_same_tokens(tiny, weights, monkeypatch):
    """SWIFTKV_CPU_MAX_ISA=avx2: every C kernel of the engine (panel GEMM, decode stack, attention, ops,
    sampling) built without AVX-512 and AMX, as on an AVX2-only CPU, gives the native build's greedy
    tokens and logits within fp32 reassociation (the 8-lane blocks sum in another order)."""
    cfg, state, _ = tiny(**TINY_MODELS["swiftkv_g1"])
    if weights == "q4":
        state = four_bit_state_dict(state)
    prompts = random_prompts(4, cfg.vocab_size, [3, 40, 9, 25], seed=7)
    runs = _runs_under(monkeypatch, build.ISA_SWITCH, ("native", "avx2"), cfg, state, prompts)
    assert runs["avx2"][2].stacks[0].layers[0].qkv.layouts["panel"].rows_per_block == 6
    for native, lesser in zip(runs["native"][0], runs["avx2"][0]):
        assert lesser.outputs[0].token_ids == native.outputs[0].token_ids
        torch.testing.assert_close(lesser.outputs[0].logits, native.outputs[0].logits, atol=1e-4, rtol=0)
