"""The compiled panel GEMM (kernels/cpu_gemm.py) against F.linear: widths that do not fill a panel,
inputs longer than one pass of IN_BLOCK features, row counts across the register blocks (up to 16 rows
on AVX-512, 6 on AVX2, both paths built here; equal blocks such as 6 + 5 + 5, and full ones with a
short last) and the ~96-row items, strided and 3-d inputs, bias, thread counts; bad input; and the
chooser dropping it when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import at_thread_counts
from swiftkv_fast.kernels import build, cpu_gemm, native
from swiftkv_fast.kernels import linear_kernels as lk

needs_compiler = pytest.mark.skipif(
    build.compiler() is None or not cpu_gemm.enabled(),
    reason="no C compiler (or gemm in SWIFTKV_DISABLED_KERNELS): the panel GEMM is off",
)


def fp32_atol(want: torch.Tensor) -> float:
    return 32 * torch.finfo(torch.float32).eps * max(1.0, float(want.abs().max()))


@needs_compiler
@pytest.mark.parametrize("out_features, in_features", [(16, 8), (33, 5), (100, 64), (7, 130), (40, 600)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 8, 15, 16, 17, 31, 97, 200])
@pytest.mark.parametrize("avx512", [True, False])
def test_matches_f_linear(out_features, in_features, rows, avx512):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    packed = cpu_gemm.PanelWeight(w, avx512=avx512)
    if not avx512:
        assert packed.rows_per_block == 6
    x = torch.randn(rows, in_features, generator=g)
    for bias in (None, b):
        want = F.linear(x, w, bias)
        torch.testing.assert_close(packed.linear(x, bias), want, rtol=0, atol=fp32_atol(want))


@needs_compiler
def test_strided_and_batched_inputs_and_a_transposed_weight():
    g = torch.Generator().manual_seed(1)
    w_t = torch.randn(24, 50, generator=g)  # (in, out): W = w_t.T is a strided view
    packed = cpu_gemm.PanelWeight(w_t.t())
    x = torch.randn(2, 9, 48, generator=g)[..., :24]  # (2, 9, 24) with row stride 48
    want = F.linear(x, w_t.t())
    got = packed.linear(x)
    assert got.shape == (2, 9, 50)
    torch.testing.assert_close(got, want, rtol=0, atol=fp32_atol(want))
    assert packed.linear(torch.randn(0, 24)).shape == (0, 50)


@needs_compiler
def test_threads_do_not_change_the_result():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(300, 64, generator=g), torch.randn(200, 64, generator=g)
    packed = cpu_gemm.PanelWeight(w)
    one, two = at_thread_counts(lambda: packed.linear(x))
    assert torch.equal(one, two)  # every output is one thread's sum, in one order


@needs_compiler
def test_bad_input_is_refused():
    packed = cpu_gemm.PanelWeight(torch.randn(8, 4))
    with pytest.raises(ValueError, match="fp32 CPU rows of 4"):
        packed.linear(torch.randn(3, 5))
    with pytest.raises(ValueError, match="fp32 CPU rows of 4"):
        packed.linear(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-d fp32 CPU weight"):
        cpu_gemm.PanelWeight(torch.randn(8, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("why", ["switch", "no build"])
def test_unavailable_kernel_is_dropped_by_the_chooser_with_one_line(why, monkeypatch, caplog):
    if why == "switch":
        monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "gemm")
    else:
        monkeypatch.setattr(build, "_built", {})
        monkeypatch.setattr(native, "_loaded", {})
        monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="panel GEMM kernel is unavailable"):
        cpu_gemm.PanelWeight(torch.randn(8, 4))
    caplog.set_level(logging.WARNING, logger="swiftkv_fast")
    forced = lk.LinearKernelChooser("panel", "cpu", (1, 16))
    for name in ("a", "b"):
        choice = forced.choose(name, torch.randn(8, 4), None, 16)
        assert choice.plan == ((lk.sys.maxsize, "linear"),)
    assert len([r for r in caplog.records if "'panel' failed" in r.getMessage()]) == 1


@needs_compiler
@pytest.mark.skipif(lk.platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")
def test_the_kernels_can_be_built_for_a_lesser_x86(monkeypatch):
    """SWIFTKV_CPU_MAX_ISA=avx2 builds the kernels without AVX-512 (the panel GEMM's 6-row blocks of 8
    lanes) and keys the kernel timings apart; a value it does not know is refused by name."""
    w, x = torch.randn(40, 64), torch.randn(17, 64)
    monkeypatch.setenv(build.ISA_SWITCH, "avx2")
    lesser = cpu_gemm.PanelWeight(w)
    assert lesser.rows_per_block == 6
    torch.testing.assert_close(lesser.linear(x), F.linear(x, w), atol=fp32_atol(x @ w.T), rtol=0)
    lk.machine_key.cache_clear()
    key = lk.machine_key()["isa"]
    monkeypatch.delenv(build.ISA_SWITCH)
    lk.machine_key.cache_clear()
    assert key[0] == "avx2" and lk.machine_key()["isa"][0] == "native"
    monkeypatch.setenv(build.ISA_SWITCH, "avx9")
    with pytest.raises(ValueError, match="SWIFTKV_CPU_MAX_ISA='avx9'"):
        build.max_isa()
    monkeypatch.delenv(build.ISA_SWITCH)
    lk.machine_key.cache_clear()


@needs_compiler
@pytest.mark.parametrize("rows", [1, 6, 16, 17, 100])
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("avx512", [True, False])
def test_norm_prologue_matches_add_rms_norm_then_linear(rows, with_delta, avx512):
    g = torch.Generator().manual_seed(rows + 7 * with_delta)
    w, b = torch.randn(40, 24, generator=g), torch.randn(40, generator=g)
    norm_w = torch.rand(24, generator=g) + 0.5
    h = torch.randn(rows, 24, generator=g) * 3
    delta = torch.randn(rows, 48, generator=g)[:, ::2].contiguous() if with_delta else None
    h_want = h.clone()
    if delta is not None:
        h_want += delta
    normed = F.rms_norm(h_want, (24,), norm_w, 1e-5)
    want = F.linear(normed, w, b)
    packed = cpu_gemm.PanelWeight(w, avx512=avx512)
    got = packed.linear_after_norm(h, delta, norm_w, 1e-5, b)
    torch.testing.assert_close(got, want, rtol=0, atol=fp32_atol(want))
    torch.testing.assert_close(h, h_want, rtol=0, atol=0)  # the residual add happened in place, once


@needs_compiler
@pytest.mark.parametrize("rows", [1, 16, 33])
@pytest.mark.parametrize("avx512", [True, False])
def test_silu_prologue_matches_silu_and_mul_then_linear(rows, avx512):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(20, 30, generator=g)
    gate_up = torch.randn(rows, 80, generator=g)[:, :60]  # (rows, 2 x 30), rows 80 apart
    before = gate_up.clone()
    gate, up = gate_up.chunk(2, dim=-1)
    want = F.linear(F.silu(gate) * up, w)
    got = cpu_gemm.PanelWeight(w, avx512=avx512).linear_after_silu_and_mul(gate_up)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=fp32_atol(want))
    assert torch.equal(gate_up, before)


@needs_compiler
def test_prologue_bad_input_is_refused_before_any_write():
    packed = cpu_gemm.PanelWeight(torch.randn(8, 4))
    h = torch.randn(3, 4)
    before = h.clone()
    with pytest.raises(ValueError, match="delta as fp32 CPU rows of 4"):
        packed.linear_after_norm(h, torch.randn(3, 5), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="delta has 2 rows"):
        packed.linear_after_norm(h, torch.randn(2, 4), torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="norm_weight must be fp32"):
        packed.linear_after_norm(h, None, torch.ones(5), 1e-5)
    with pytest.raises(ValueError, match="rows dense"):
        packed.linear_after_norm(torch.randn(4, 3).t(), None, torch.ones(4), 1e-5)
    with pytest.raises(ValueError, match="gate_up as fp32 CPU rows of 8"):
        packed.linear_after_silu_and_mul(torch.randn(3, 4))
    assert torch.equal(h, before)
