import pytest
import torch
import torch.nn.functional as F
from swiftkv_fast.model.layers import Linear
from swiftkv_reference.testing import fp32_atol


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)  # (out, in), the checkpoint's layout
    b = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 40, generator=g)
    lin = Linear(w, b)
    assert (lin.in_features, lin.out_features) == (40, 96)
    want = F.linear(x, w, b)  # sums of 40 N(0, 1) products: |want| ~ 30, not O(1)
    torch.testing.assert_close(lin(x), want, rtol=0, atol=fp32_atol(want))
    # a strided input (the attention output's flatten of a view) works too
    xs = torch.randn(rows, 80, generator=g)[:, ::2]
    want = F.linear(xs, w, b)
    torch.testing.assert_close(lin(xs), want, rtol=0, atol=fp32_atol(want))


@pytest.mark.parametrize("kernel", ["panel", "linear", "mkldnn"])
@pytest.mark.parametrize("rows", [1, 16])
@pytest.mark.parametrize("row_ops", ["torch", "C"])
def test_fused_calls_equal_the_ops_one_after_the_other(kernel, rows, row_ops):
    """Linear.after_norm / after_silu_and_mul equal add_rms_norm / silu_and_mul then the Linear, whichever
    kernel runs the row count (the panel GEMM fuses them into its packing, the others do not) and
    whichever row ops the plan gave it (the torch functions, or the C ones of kernels/cpu_ops.py)."""
    from swiftkv_fast.kernels import cpu_ops
    from swiftkv_fast.kernels.linear_kernels import KernelChoice
    from swiftkv_fast.model.layers import RowOps, add_rms_norm, silu_and_mul

    lib = None
    if row_ops == "C" and (lib := cpu_ops.load()) is None:
        pytest.skip("the C row ops did not build here")
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(48, 32, generator=g), torch.randn(48, generator=g)
    try:
        lin = Linear(w, b, KernelChoice.single(kernel, w), RowOps(lib))
    except (RuntimeError, AttributeError) as e:  # no compiler / no oneDNN here
        pytest.skip(f"{kernel} unavailable: {e}")
    norm_w = torch.rand(32, generator=g) + 0.5
    h, delta = torch.randn(rows, 32, generator=g), torch.randn(rows, 32, generator=g)
    h_ref = h.clone()
    want = lin(add_rms_norm(h_ref, delta, norm_w, 1e-6))
    got = lin.after_norm(h, delta, norm_w, 1e-6)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=fp32_atol(want))
    torch.testing.assert_close(h, h_ref, rtol=0, atol=0)
    gate_up = torch.randn(rows, 64, generator=g)
    want = lin(silu_and_mul(gate_up.clone()))
    torch.testing.assert_close(lin.after_silu_and_mul(gate_up), want, rtol=1e-5, atol=fp32_atol(want))
