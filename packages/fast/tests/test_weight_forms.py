"""Weights that are exactly 4-bit blocks (kernels/weight_forms.py): found only where every value is d q + m
per block of 32 inputs; the panel GEMM's 4-bit layout (and its bf16 layout, for weights exact in bf16)
then gives the fp32 layout's results bit for bit (both register-block widths, the fused prologues, a
bias), and the AMX kernel for them (q4-amx) is an fp32 product, a chooser candidate for such weights
only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.kernels import build, cpu_amx, cpu_gemm
from swiftkv_fast.kernels import linear_kernels as lk
from swiftkv_fast.kernels.cpu_amx import Bf16x3Weight
from swiftkv_fast.kernels.cpu_amx_q4 import Q4AmxWeight
from swiftkv_fast.kernels.weight_forms import (
    Q4_BLOCK,
    FormMismatch,
    bf16_exact,
    q4_blocks,
    q4_panels,
    q8_blocks,
)
from swiftkv_fast.model.decode_stack import layer_linears, stack_panel
from swiftkv_fast.worker.stack_timing import stack_key
from swiftkv_reference.testing import (
    four_bit_state_dict,
    fp32_atol,
    q4_1_dequantized,
    q8_0_dequantized,
    random_state_dict,
    tiny_config,
)


def q8_0(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return q8_0_dequantized(torch.randn(out_features, in_features, generator=g))


def q4_1(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return q4_1_dequantized(0.05 * torch.randn(out_features, in_features, generator=g))


def test_finds_the_blocks_of_a_dequantized_q4_1_weight():
    w = q4_1(40, 96)
    d, m, q = q4_blocks(w)
    assert d.shape == m.shape == (40, 3) and q.shape == (40, 96) and q.dtype == torch.uint8
    assert int(q.max()) <= 15
    rebuilt = d.repeat_interleave(Q4_BLOCK, 1) * q.float() + m.repeat_interleave(Q4_BLOCK, 1)
    assert torch.equal(rebuilt, w)
    assert torch.equal(d, d.half().float())  # the fp16 scales it was written with


def test_an_fp32_scale_is_found_where_fp16_cannot_hold_it():
    d = torch.full((2, 1, 1), 1.5 * 2.0**-30)  # below fp16's range, exact products with 4-bit codes
    q = torch.arange(Q4_BLOCK).remainder(16).float().expand(2, 1, Q4_BLOCK)
    w = (d * q + 2.0**-27).reshape(2, Q4_BLOCK)
    found = q4_blocks(w)
    assert found is not None
    assert torch.equal(found[0], d.reshape(2, 1))


@pytest.mark.parametrize(
    "why",
    ["random fp32", "one value off by an ulp", "a NaN", "an infinity", "inputs not a multiple of 32", "bf16"],
)
def test_no_4_bit_form_is_claimed_where_the_weight_has_none(why):
    w = q4_1(16, 64)
    if why == "random fp32":
        w = torch.randn(16, 64)
    elif why == "one value off by an ulp":
        w[3, 17] = torch.nextafter(w[3, 17], torch.tensor(1.0))
    elif why == "a NaN":
        w[0, 0] = float("nan")
    elif why == "an infinity":
        w[5, 40] = float("inf")
    elif why == "inputs not a multiple of 32":
        w = q4_1(16, 64)[:, :48]
    else:
        w = w.to(torch.bfloat16)
    assert q4_blocks(w) is None
    assert q4_panels(w) is None


def test_the_worked_example_of_the_docstring():
    """[0.5, 0.75, 0.5, 1.25] (padded to a block with 0.5): no fp16 scale rebuilds it, and the fp32
    scale 0.05 rebuilds it only through an inexact product, so no 4-bit form."""
    row = torch.full((1, Q4_BLOCK), 0.5)
    row[0, 1], row[0, 3] = 0.75, 1.25
    half = torch.tensor(0.05).half().float()
    assert half * 15 + 0.5 != 1.25
    f = torch.tensor(0.05)
    assert f * 5 + 0.5 == 0.75 and f.double() * 15 != (f * 15).double()
    assert q4_blocks(row) is None


pytestmark_kernel = pytest.mark.skipif(
    build.compiler() is None, reason="no C compiler here (the panel GEMM is a compiled kernel)"
)


def bf16_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (0.05 * torch.randn(out_features, in_features, generator=g)).to(torch.bfloat16).float()


def q8_0_small(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """q8_0 at q4_1's scale (a layer's weights), so that one fp32 tolerance fits every form below."""
    g = torch.Generator().manual_seed(seed)
    return q8_0_dequantized(0.05 * torch.randn(out_features, in_features, generator=g))


# form: (a weight of that form, bytes per input and panel)
COMPACT = {"q4": (q4_1, 12), "q8": (q8_0_small, 20), "bf16": (bf16_weight, 32)}


@pytestmark_kernel
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (40, 96), (7, 64), (200, 576), (33, 1536)])
@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("form", COMPACT)
def test_compact_panels_give_the_fp32_panels_results_bit_for_bit(out_features, in_features, avx512, form):
    """4-bit, 8-bit and bf16 panels rebuild the fp32 weights exactly and run the same FMAs: the fp32
    panels' results bit for bit, at row counts of one register block and of several (each slice rebuilt
    once and kept for the item's other blocks)."""
    make, in_bytes = COMPACT[form]
    w = make(out_features, in_features, seed=out_features)
    compact = cpu_gemm.PanelWeight(w, avx512=avx512)
    full = cpu_gemm.PanelWeight(w, avx512=avx512, compact=False)
    assert (compact.format, full.format) == (form, "fp32")
    panels = -(-out_features // 16)
    assert compact.nbytes == panels * in_features * in_bytes and full.nbytes == panels * in_features * 64
    bias = torch.randn(out_features)
    for rows in (1, 5, 6, 7, 16, 17, 40, 300):
        x = torch.randn(rows, in_features)
        assert torch.equal(compact.linear(x), full.linear(x))
        assert torch.equal(compact.linear(x, bias), full.linear(x, bias))
        torch.testing.assert_close(compact.linear(x), x @ w.T, atol=1e-4, rtol=1e-5)


@pytestmark_kernel
@pytest.mark.parametrize("avx512", [True, False])
@pytest.mark.parametrize("form", COMPACT)
def test_compact_panels_with_the_fused_prologues(avx512, form):
    make = COMPACT[form][0]
    w = make(48, 64, seed=3)
    compact = cpu_gemm.PanelWeight(w, avx512=avx512)
    full = cpu_gemm.PanelWeight(w, avx512=avx512, compact=False)
    norm_weight = 1 + 0.1 * torch.randn(64)
    for rows in (1, 16, 33):
        h, delta = torch.randn(rows, 64), torch.randn(rows, 64)
        h2 = h.clone()
        a = compact.linear_after_norm(h, delta, norm_weight, 1e-5)
        b = full.linear_after_norm(h2, delta, norm_weight, 1e-5)
        assert torch.equal(a, b) and torch.equal(h, h2)
        gate_up = torch.randn(rows, 128)
        mlp = cpu_gemm.PanelWeight(make(16, 64, seed=4), avx512=avx512)
        mlp_full = cpu_gemm.PanelWeight(make(16, 64, seed=4), avx512=avx512, compact=False)
        assert mlp.format == form
        assert torch.equal(
            mlp.linear_after_silu_and_mul(gate_up), mlp_full.linear_after_silu_and_mul(gate_up)
        )


def test_the_switch_keeps_fp32_panels_and_the_timings_apart(monkeypatch, tmp_path):
    w = q4_1(32, 64)
    chooser = lk.LinearKernelChooser("auto", "cpu", (1, 16), cache_dir=tmp_path)
    assert chooser._form(w) == "q4" and chooser._form(torch.randn(32, 64)) is None
    assert chooser._form(q8_0(32, 64)) == "q8"
    assert chooser._shape_key(w, "q4") == "float32 32x64 q4"
    assert chooser._shape_key(w, None) == "float32 32x64"
    monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "gemm-4bit")
    assert chooser._form(w) is None
    if build.compiler() is not None:
        assert cpu_gemm.PanelWeight(w).format == "fp32"


def test_q4_amx_is_a_candidate_for_four_bit_weights_only(monkeypatch):
    """Chosen by measurement where it applies; a weight without the form neither offers it nor marks it
    failed for the others (a stand-in kernel, so this runs on any CPU)."""

    def pack(w):
        if q4_blocks(w) is None:
            raise FormMismatch("no form")
        return w

    monkeypatch.setitem(
        lk.KERNELS, "q4-amx", lk.LinearKernel("q4-amx", pack, F.linear, forms=frozenset({"q4"}))
    )
    timer = lambda kernel, rows, call: (call(), 1e-4 if kernel == "q4-amx" else 1e-3)[1]  # noqa: E731
    chooser = lk.LinearKernelChooser("auto", "cpu", (1, 16, 64), timer=timer)
    plain = chooser.choose("plain", torch.randn(48, 64), None, 64)
    assert "q4-amx" not in {k for _, k in plain.plan} and "q4-amx" not in chooser.failed
    four_bit = chooser.choose("four_bit", q4_1(48, 64), None, 64)
    assert {k for _, k in four_bit.plan} == {"q4-amx"}
    forced = lk.LinearKernelChooser("q4-amx", "cpu", (1, 16))
    assert forced.choose("plain", torch.randn(48, 64), None, 16).plan[0][1] == lk.FALLBACK
    assert forced.choose("four_bit", q4_1(48, 64), None, 16).plan[0][1] == "q4-amx"


def test_kernels_this_machine_cannot_run_are_not_offered_and_not_called_failed(monkeypatch, caplog):
    """A CPU without AMX (here: the switch off) is not a failure: the AMX candidates are left out of the
    timing with their reason (`absent`, a line of the kernel plan), no warning, and the fp32 kernels are
    chosen as before."""
    import logging

    monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "amx")
    caplog.set_level(logging.INFO, logger=lk.logger.name)
    timer = lambda kernel, rows, call: (call(), 1e-3)[1]  # noqa: E731
    chooser = lk.LinearKernelChooser("auto", "cpu", (1, 16), timer=timer)
    choice = chooser.choose("four_bit", q4_1(48, 64), None, 16)
    chooser.finish()
    assert not {"q4-amx", "panel-amx"} & {k for _, k in choice.plan}
    assert not chooser.failed and {"q4-amx", "panel-amx"} <= set(chooser.absent)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert chooser.absent["q4-amx"] == chooser.absent["panel-amx"] == "amx in disabled_kernels"


amx = pytest.mark.skipif(cpu_amx.unavailable_reason() is not None, reason="no AMX here")


@amx
@pytest.mark.parametrize("out_features, in_features", [(40, 64), (960, 576), (576, 1536)])
def test_q4_amx_is_an_fp32_product(out_features, in_features):
    """Every product exact, fp32 sums: as close to the fp64 product as F.linear, bias included."""
    w = q4_1(out_features, in_features, seed=in_features)
    layout = Q4AmxWeight(w)
    assert layout.nbytes == -(-out_features // 32) * 32 * in_features * 9 // 4
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(out_features, generator=g)
    for rows in (1, 17, 33, 300):
        x = torch.randn(rows, in_features, generator=g)
        want = (x.double() @ w.double().T + bias.double()).float()
        torch.testing.assert_close(layout.linear(x, bias), want, rtol=0, atol=fp32_atol(want))
    with pytest.raises(FormMismatch):
        Q4AmxWeight(torch.randn(32, 64))


def forced_engine_tokens(state_of, kernel: str) -> tuple[list[list[int]], str]:
    """Greedy tokens of a 3-layer tiny model (SwiftKV L = 2) whose weights `state_of` makes from random
    ones, every linear forced to `kernel`, and the kernel its lm_head got."""
    config = tiny_config(num_hidden_layers=3)
    llm = LLM.from_state_dict(
        config,
        state_of(random_state_dict(config)),
        linear_kernel=kernel,
        num_key_value_layers=2,
        max_model_len=64,
    )
    outputs = llm.generate(
        [[5, 6, 7, 8, 9] * 3, [11, 12, 13]], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False
    )
    return [o.outputs[0].token_ids for o in outputs], llm.llm_engine.runner.model.w.lm_head.plan[0][1]


@amx
def test_q4_amx_engine_gives_the_f_linear_engines_tokens():
    tokens, lm_head = forced_engine_tokens(four_bit_state_dict, "q4-amx")
    # lm_head is at Q8_0 values, as the GGUF's: not a form q4-amx takes, so F.linear there
    assert lm_head == "linear"
    assert tokens == forced_engine_tokens(four_bit_state_dict, "linear")[0]


@amx
@pytest.mark.parametrize("out_features, in_features", [(16, 32), (40, 96), (960, 576), (33, 1536)])
def test_4_bit_panels_on_amx_are_an_fp32_product(out_features, in_features):
    """panel-amx: the 4-bit panels' bytes multiplied on AMX tiles, as close to the fp64 product as
    F.linear, alone and with the fused prologues (bit-identical inputs to the FMA path's)."""
    w = q4_1(out_features, in_features, seed=out_features + in_features)
    tiles = cpu_gemm.PanelWeight(w, amx=True)
    fma = cpu_gemm.PanelWeight(w)
    assert (tiles.format, fma.format) == ("q4-amx", "q4") and torch.equal(tiles.packed, fma.packed)
    g = torch.Generator().manual_seed(2)
    bias = torch.randn(out_features, generator=g)
    for rows in (1, 5, 16, 17, 40, 100):
        x = torch.randn(rows, in_features, generator=g)
        want = (x.double() @ w.double().T + bias.double()).float()
        torch.testing.assert_close(tiles.linear(x, bias), want, rtol=0, atol=fp32_atol(want))
        h, delta = torch.randn(rows, in_features, generator=g), torch.randn(rows, in_features, generator=g)
        norm_weight = 1 + 0.1 * torch.randn(in_features, generator=g)
        h2 = h.clone()
        got = tiles.linear_after_norm(h, delta, norm_weight, 1e-5)
        ref = fma.linear_after_norm(h2, delta, norm_weight, 1e-5)
        assert torch.equal(h, h2)
        torch.testing.assert_close(got, ref, rtol=0, atol=fp32_atol(ref))
    with pytest.raises(FormMismatch):
        cpu_gemm.PanelWeight(torch.randn(32, 64), amx=True)


def test_finds_the_blocks_of_a_dequantized_q8_0_weight_and_nothing_else():
    w = q8_0(40, 96)
    d, q = q8_blocks(w)
    assert d.shape == (40, 3) and q.dtype == torch.int8 and int(q.abs().max()) <= 127
    assert torch.equal(d.repeat_interleave(Q4_BLOCK, 1) * q.float(), w)
    assert q8_blocks(torch.randn(40, 96)) is None and q8_blocks(q8_0(40, 96)[:, :48]) is None
    w[1, 2] = torch.nextafter(w[1, 2], torch.tensor(2.0))
    assert q8_blocks(w) is None
    assert q4_blocks(q8_0(40, 96)) is None  # 255 levels: not a 4-bit form


@amx
def test_8_bit_panels_on_amx_are_an_fp32_product():
    """panel-amx over a Q8_0 weight (the embedded model's embedding and tied lm_head): 8-bit panels,
    the codes exact in bf16, as close to the fp64 product as F.linear."""
    w = q8_0(1000, 576)
    tiles = cpu_gemm.PanelWeight(w, amx=True)
    assert tiles.format == "q8-amx" and cpu_gemm.PanelWeight(w).format == "q8"
    assert tiles.nbytes == -(-1000 // 16) * 576 * 20
    g = torch.Generator().manual_seed(3)
    for rows in (1, 16, 17, 100):
        x = torch.randn(rows, 576, generator=g)
        want = (x.double() @ w.double().T).float()
        torch.testing.assert_close(tiles.linear(x), want, rtol=0, atol=fp32_atol(want))


@amx
def test_stack_over_4_bit_panels_on_amx_gives_the_references_tokens():
    config = tiny_config(model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2)
    state = four_bit_state_dict(random_state_dict(config))
    prompts = [[5, 6, 7, 8, 9] * 3, [11, 12, 13], list(range(20, 60))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = {}
    for kernel in ("linear", "panel-amx"):
        llm = LLM.from_state_dict(config, state, linear_kernel=kernel, max_model_len=96, return_logits=True)
        got[kernel] = llm.generate(prompts, params, use_tqdm=False)
        if kernel == "panel-amx":
            assert llm.llm_engine.runner.model.w.lm_head.layouts["panel-amx"].format == "q8-amx"
            stacks = llm.llm_engine.runner.model.stacks
            assert all(s.calls > 0 for s in stacks)
            formats = {stack_panel(lin).format for s in stacks for x in s.layers for lin in layer_linears(x)}
            assert formats == {"q4-amx"}
            # the stacks' cached timings are keyed by the panels they read, AMX ones included
            assert all(" panels q4-amx " in stack_key(s, "first", cold=False) for s in stacks)
    for a, b in zip(got["panel-amx"], got["linear"]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        torch.testing.assert_close(a.outputs[0].logits, b.outputs[0].logits, rtol=0, atol=1e-4)


def test_a_weights_form_is_found_once_while_the_chooser_holds_it(monkeypatch):
    from swiftkv_fast.kernels import weight_forms as blocks

    w, calls = q4_1(32, 64), []
    original = blocks._fit

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(blocks, "_fit", counting)
    with blocks.remembered(w):
        first = q4_blocks(w)
        assert q4_blocks(w) is first and q4_panels(w) is not None
        assert q4_blocks(w.clone()) is not first  # another tensor: not remembered
    assert len(calls) == 2
    q4_blocks(w)
    assert len(calls) == 3  # outside the block: found again


def test_bf16_exact_weights_are_found_and_nothing_else():
    w = torch.randn(16, 40).to(torch.bfloat16).float()
    assert bf16_exact(w) and not bf16_exact(torch.randn(16, 40)) and not bf16_exact(w.to(torch.bfloat16))
    w[2, 3] = float("inf")
    assert not bf16_exact(w)
    chooser = lk.LinearKernelChooser("auto", "cpu", (1, 16))
    assert chooser._form(torch.randn(16, 64).to(torch.bfloat16).float()) == "bf16"


@amx
@pytest.mark.parametrize("out_features, in_features", [(40, 64), (960, 576), (33, 100)])
def test_bf16_amx_is_an_fp32_product(out_features, in_features):
    """bf16-amx: W exact in bf16 as its hi tiles alone, x in three exact parts: as close to the fp64
    product as F.linear (where bf16x3 drops terms), at half bf16x3's weight bytes."""
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(out_features, in_features, generator=g).to(torch.bfloat16).float()
    exact, bf16x3 = Bf16x3Weight(w, exact=True), Bf16x3Weight(w)
    assert 2 * exact.nbytes == bf16x3.nbytes
    bias = torch.randn(out_features, generator=g)
    for rows in (1, 17, 300):
        x = torch.randn(rows, in_features, generator=g)
        want = (x.double() @ w.double().T + bias.double()).float()
        torch.testing.assert_close(exact.linear(x, bias), want, rtol=0, atol=2 * fp32_atol(want))
    with pytest.raises(FormMismatch):
        Bf16x3Weight(torch.randn(32, 64), exact=True)


@amx
def test_bf16_amx_engine_gives_the_f_linear_engines_tokens():
    def bf16(state):
        return {k: v.to(torch.bfloat16).float() for k, v in state.items()}

    tokens, lm_head = forced_engine_tokens(bf16, "bf16-amx")
    assert lm_head == "bf16-amx"
    assert tokens == forced_engine_tokens(bf16, "linear")[0]
