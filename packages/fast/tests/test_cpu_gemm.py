"""The compiled panel GEMM (kernels/cpu_gemm.py) against F.linear: widths that do not fill a panel,
row counts across the register blocks (16 rows on AVX-512, 6 on AVX2; both paths built here) and the
96-row items, strided and 3-d inputs, bias, thread
counts; bad input; and the chooser dropping it when it cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from swiftkv_fast.kernels import cpu_compile, cpu_gemm
from swiftkv_fast.model import linear_kernels as lk

needs_compiler = pytest.mark.skipif(
    cpu_compile.compiler() is None or not cpu_gemm.enabled(),
    reason="no C compiler (or SWIFTKV_CPU_GEMM_KERNEL=0): the panel GEMM is off",
)


def fp32_atol(want: torch.Tensor) -> float:
    return 32 * torch.finfo(torch.float32).eps * max(1.0, float(want.abs().max()))


@needs_compiler
@pytest.mark.parametrize("out_features, in_features", [(16, 8), (33, 5), (100, 64), (7, 130)])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 16, 17, 97, 200])
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
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = packed.linear(x)
        torch.set_num_threads(2)
        two = packed.linear(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # every output is one thread's sum, in one order


@needs_compiler
def test_bad_input_is_refused():
    packed = cpu_gemm.PanelWeight(torch.randn(8, 4))
    with pytest.raises(ValueError, match="fp32 rows of 4"):
        packed.linear(torch.randn(3, 5))
    with pytest.raises(ValueError, match="fp32 rows of 4"):
        packed.linear(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-d fp32 CPU weight"):
        cpu_gemm.PanelWeight(torch.randn(8, 4, dtype=torch.bfloat16))


@pytest.mark.parametrize("why", ["switch", "no build"])
def test_unavailable_kernel_is_dropped_by_the_chooser_with_one_line(why, monkeypatch, caplog):
    if why == "switch":
        monkeypatch.setenv(cpu_gemm.ENV_SWITCH, "0")
    else:
        monkeypatch.setattr(cpu_compile, "_built", {})
        monkeypatch.setenv("CC", "false")
    with pytest.raises(RuntimeError, match="panel GEMM kernel is unavailable"):
        cpu_gemm.PanelWeight(torch.randn(8, 4))
    caplog.set_level(logging.WARNING, logger="swiftkv_fast")
    forced = lk.LinearKernelChooser("panel", "cpu", (1, 16))
    for name in ("a", "b"):
        choice = forced.choose(name, torch.randn(8, 4), None, 16)
        assert choice.plan == ((lk.sys.maxsize, "linear"),)
    assert len([r for r in caplog.records if "'panel' failed" in r.getMessage()]) == 1
