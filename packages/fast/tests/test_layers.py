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
