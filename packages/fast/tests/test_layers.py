import pytest
import torch
import torch.nn.functional as F
from swiftkv_fast.model.layers import Linear


@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_f_linear(rows, with_bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(96, 40, generator=g)  # (out, in), the checkpoint's layout
    b = torch.randn(96, generator=g) if with_bias else None
    x = torch.randn(rows, 40, generator=g)
    lin = Linear(w, b)
    assert (lin.in_features, lin.out_features) == (40, 96)
    torch.testing.assert_close(lin(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    # a strided input (the attention output's flatten of a view) works too
    xs = torch.randn(rows, 80, generator=g)[:, ::2]
    torch.testing.assert_close(lin(xs), F.linear(xs, w, b), rtol=1e-5, atol=1e-5)


def test_linear_keeps_cpu_weights_transposed():
    w = torch.randn(8, 4)
    lin = Linear(w)
    assert lin.transposed and lin.weight.shape == (4, 8) and lin.weight.is_contiguous()
