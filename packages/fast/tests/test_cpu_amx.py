"""The AMX bf16x3 kernel (kernels/cpu_amx.py) against fp64: shapes that do not fill a tile or a block
(padding of rows, columns and input features), row counts across the 32-row blocks and 256-row items,
strided and 3-d inputs, bias, thread counts; that it is bf16x3 (far more exact than one bf16 pass, and
within the bound of its split); bad input; and the switch that turns it off. Skipped where the CPU or
the compiler has no AMX-BF16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import at_thread_counts
from swiftkv_fast.kernels import cpu_amx

REASON = cpu_amx.unavailable_reason()
needs_amx = pytest.mark.skipif(REASON is not None, reason=f"AMX bf16x3 kernel unavailable: {REASON}")


def bf16x3_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|error| of each output: a product loses at most ~2^-15 of |a b| to the split (a_lo b_lo, about
    2^-16, and each operand's residual past hi + lo, 2^-17), and the fp32 sum its own rounding."""
    magnitude = x.abs().double() @ w.abs().double().T
    return 2.0**-14 * magnitude + 1e-6


def exact(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double())


@needs_amx
@pytest.mark.parametrize(
    "out_features, in_features", [(32, 32), (16, 8), (33, 5), (100, 64), (7, 130), (96, 600)]
)
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 33, 97, 257, 300])
def test_matches_fp64_within_the_bf16x3_bound(out_features, in_features, rows):
    g = torch.Generator().manual_seed(rows * 1000 + out_features)
    w = torch.randn(out_features, in_features, generator=g)
    b = torch.randn(out_features, generator=g)
    packed = cpu_amx.Bf16x3Weight(w)
    x = torch.randn(rows, in_features, generator=g)
    for bias in (None, b):
        got = packed.linear(x, bias)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        error = (got.double() - exact(x, w, bias)).abs()
        assert bool((error <= bf16x3_bound(x, w)).all()), float((error / bf16x3_bound(x, w)).max())


@needs_amx
def test_it_is_three_products_not_one():
    """Dropping the lo terms (one bf16 pass) would be ~100x less exact: the kernel must beat one bf16
    pass by far and stay within a few times fp32's own error."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(256, 576, generator=g), torch.randn(64, 576, generator=g)
    want = exact(x, w, None)
    err_x3 = (cpu_amx.Bf16x3Weight(w).linear(x).double() - want).abs().max()
    err_bf16 = (F.linear(x.bfloat16().float(), w.bfloat16().float()).double() - want).abs().max()
    err_fp32 = (F.linear(x, w).double() - want).abs().max()
    assert err_x3 < err_bf16 / 30
    assert err_x3 < 30 * err_fp32


@needs_amx
def test_strided_and_batched_inputs_and_a_transposed_weight():
    g = torch.Generator().manual_seed(1)
    w_t = torch.randn(24, 50, generator=g)  # (in, out): W = w_t.T is a strided view
    packed = cpu_amx.Bf16x3Weight(w_t.t())
    x = torch.randn(2, 9, 48, generator=g)[..., :24]  # (2, 9, 24) with row stride 48
    got = packed.linear(x)
    assert got.shape == (2, 9, 50)
    error = (got.double() - exact(x, w_t.t(), None)).abs()
    assert bool((error <= bf16x3_bound(x.reshape(-1, 24), w_t.t()).view(2, 9, 50)).all())
    assert packed.linear(torch.randn(0, 24)).shape == (0, 50)
    assert packed.nbytes == 2 * 64 * 32 * 2  # hi + lo: 2 x (64 columns x 32 features) bf16


@needs_amx
def test_threads_do_not_change_the_result():
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(300, 64, generator=g), torch.randn(600, 64, generator=g)
    packed = cpu_amx.Bf16x3Weight(w)
    one, two = at_thread_counts(lambda: packed.linear(x))
    assert torch.equal(one, two)  # every output is one thread's sum, in one order


@needs_amx
def test_bad_input_is_refused():
    packed = cpu_amx.Bf16x3Weight(torch.randn(8, 4))
    with pytest.raises(ValueError, match="fp32 CPU rows of 4"):
        packed.linear(torch.randn(3, 5))
    with pytest.raises(ValueError, match="fp32 CPU rows of 4"):
        packed.linear(torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="2-d fp32 CPU weight"):
        cpu_amx.Bf16x3Weight(torch.randn(8, 4, dtype=torch.float64))


def test_the_switch_turns_it_off(monkeypatch):
    monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "amx")
    assert cpu_amx.unavailable_reason() == "amx in disabled_kernels"
    with pytest.raises(RuntimeError, match="unavailable here"):
        cpu_amx.Bf16x3Weight(torch.randn(8, 4))
