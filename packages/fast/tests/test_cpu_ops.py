"""The compiled CPU ops (kernels/cpu_ops.py) against their torch specification in model/layers.py:
RMSNorm with and without the residual add, SiLU-and-mul, in-place RoPE; strided rows, one thread and
several (PARALLEL_MIN), inputs they do not take, and the fallback when they cannot run."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from swiftkv_fast.kernels import build, cpu_ops, native
from swiftkv_fast.model import layers

needs_compiler = pytest.mark.skipif(
    build.compiler() is None or not cpu_ops.enabled(),
    reason="no C compiler (or ops in SWIFTKV_DISABLED_KERNELS): the compiled CPU ops are off",
)
# small calls run on one thread, large ones on every thread: both sides of PARALLEL_MIN
ROWS = [1, 16, 2 * cpu_ops.PARALLEL_MIN // 64 + 3]


def torch_rms_norm(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


@needs_compiler
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(rows, with_delta):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 100, generator=g)
    h = wide[:, 10:74]  # rows 100 apart: the kernel takes any row stride
    delta = torch.randn(rows, 64, generator=g) if with_delta else None
    w = torch.randn(64, generator=g)
    want_h = h + delta if with_delta else h.clone()
    want = torch_rms_norm(want_h, w, 1e-5)
    untouched = wide[:, :10].clone()
    got = cpu_ops.add_rms_norm(h, delta, w, 1e-5)
    assert got is not None and got.is_contiguous()
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)  # the residual add is exact and in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(wide[:, :10], untouched)  # nothing outside the view is written


@needs_compiler
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_torch(rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 48 + 8, generator=g)[:, :96] * 6  # strided rows; large |x| too
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0  # far outside exp's range: silu -> 0 and -> x
    want = F.silu(gate_up[:, :48]) * gate_up[:, 48:]
    got = cpu_ops.silu_and_mul(gate_up)
    assert got is not None and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("rows", ROWS)
def test_rope_in_place_matches_apply_rope(rows):
    g = torch.Generator().manual_seed(rows)
    table = layers.RotaryTable(1.0 / (10000 ** (torch.arange(0, 32, 2) / 32)), 4096, torch.device("cpu"))
    qkv = torch.randn(rows, 7 * 32, generator=g)  # 5 q/k heads rotated, 2 v heads left alone
    positions = torch.randint(0, 4096, (rows,), generator=g)
    x = qkv[:, : 5 * 32].view(rows, 5, 32)
    want = layers.apply_rope(x, *table.lookup(positions))
    v_before = qkv[:, 5 * 32 :].clone()
    assert cpu_ops.rope_(x, positions, table.cos, table.sin)
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 5 * 32 :], v_before)


@needs_compiler
def test_rope_position_outside_the_table_raises_and_writes_nothing():
    table = layers.RotaryTable(torch.ones(4), 10, torch.device("cpu"))
    x = torch.randn(3, 2, 8)
    before = x.clone()
    with pytest.raises(ValueError, match="outside the RoPE table"):
        cpu_ops.rope_(x, torch.tensor([0, 10, 1]), table.cos, table.sin)
    assert torch.equal(x, before)


def test_inputs_the_kernels_do_not_take_are_left_to_torch():
    w = torch.randn(8)
    h16 = torch.randn(4, 8).to(torch.bfloat16)
    assert cpu_ops.add_rms_norm(h16, None, w, 1e-5) is None  # bf16
    assert cpu_ops.add_rms_norm(torch.randn(8, 4).t(), None, w, 1e-5) is None  # columns, not rows
    assert cpu_ops.silu_and_mul(torch.randn(4, 7)) is None  # odd width
    x = torch.randn(3, 2, 8)[:, :, :6]  # heads not dense within a token
    assert not cpu_ops.rope_(x, torch.zeros(3, dtype=torch.int64), torch.ones(1, 3), torch.ones(1, 3))


@pytest.mark.parametrize("switch", ["env", "failed-build"])
def test_layers_fall_back_to_torch_with_one_warning(switch, monkeypatch, caplog):
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(cpu_ops, "_resolved", [])
    if switch == "env":
        monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "ops")
    else:
        monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    g = torch.Generator().manual_seed(0)
    h, delta, w = (
        torch.randn(5, 16, generator=g),
        torch.randn(5, 16, generator=g),
        torch.randn(16, generator=g),
    )
    table = layers.RotaryTable(torch.ones(4), 10, torch.device("cpu"))
    with caplog.at_level(logging.WARNING, logger="swiftkv_fast"):
        for _ in range(2):
            assert cpu_ops.add_rms_norm(h, delta, w, 1e-5) is None
            want_h = h + delta
            got = layers.add_rms_norm(h, delta, w, 1e-5)
            torch.testing.assert_close(h, want_h)
            torch.testing.assert_close(got, torch_rms_norm(want_h, w, 1e-5))
            gu = torch.randn(5, 32, generator=g)
            torch.testing.assert_close(layers.silu_and_mul(gu.clone()), F.silu(gu[:, :16]) * gu[:, 16:])
            x = torch.randn(5, 2, 8, generator=g)
            pos = torch.arange(5)
            want = layers.apply_rope(x, *table.lookup(pos))
            torch.testing.assert_close(table.at(pos).apply_(x), want)
    warnings = [r.message for r in caplog.records]
    assert len(warnings) == (0 if switch == "env" else 1)
    if warnings:
        assert "did not build" in warnings[0]


def _index_copy_write(kv_cache, k, v, slot_mapping):
    """The torch backend's portable write: the specification of cpu_ops.write_kv."""
    n_layers, _, num_blocks, block_size = kv_cache.shape[:4]
    flat = kv_cache.view(n_layers, 2, num_blocks * block_size, *kv_cache.shape[4:])
    valid = slot_mapping >= 0
    flat[:, 0].index_copy_(1, slot_mapping[valid], k[valid].transpose(0, 1))
    flat[:, 1].index_copy_(1, slot_mapping[valid], v[valid].transpose(0, 1))


@needs_compiler
@pytest.mark.parametrize("tokens", [1, 16, 700])
def test_write_kv_matches_index_copy(tokens):
    g = torch.Generator().manual_seed(tokens)
    engine_cache = torch.randn(5, 2, 90, 8, 3, 16, generator=g)  # 5 slots, 90 blocks of 8
    kv_cache = engine_cache[1:4]  # a run of 3 cache layers, as the SwiftKV write passes it
    slots = torch.randperm(90 * 8, generator=g)[:tokens]
    slots[::5] = -1  # skipped tokens (padding)
    qkv = torch.randn(tokens, 2, 3 * 6 * 16, generator=g)  # K/V as strided views of a wider output
    k = qkv[:, 0].view(tokens, 6, 3, 16)[:, ::2]  # (T, 3 layers, kv_heads, head_dim), layers 2 apart
    v = qkv[:, 1].view(tokens, 6, 3, 16)[:, 1::2]
    want = engine_cache.clone()
    _index_copy_write(want[1:4], k, v, slots)
    assert cpu_ops.write_kv(kv_cache, k, v, slots)
    assert torch.equal(engine_cache, want)  # exact copies, and nothing outside the slots or layers


@needs_compiler
def test_write_kv_into_a_bf16_cache_rounds_as_torch_does():
    """Round to nearest even, ties both ways, NaN, infinities, overflow to inf, subnormals: every bit as
    the index_copy_ of the values cast by torch."""
    g = torch.Generator().manual_seed(3)
    tokens, n_layers, kv_heads, dim = 40, 2, 2, 16
    k = torch.randn(tokens, n_layers, kv_heads, dim, generator=g) * 10.0 ** torch.randint(
        -6, 6, (tokens, 1, 1, 1)
    )
    v = torch.randn(tokens, n_layers, kv_heads, dim, generator=g)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-126 * (1 + 2**-8), 3.3961775e38])
    special = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, -1e-45, 3.4028235e38]
    )
    k.view(-1)[: ties.numel()] = ties
    v.view(-1)[: special.numel()] = special
    slots = torch.randperm(30 * 4, generator=g)[:tokens]
    slots[::7] = -1
    cache = torch.full((n_layers, 2, 30, 4, kv_heads, dim), 7.0, dtype=torch.bfloat16)
    want = cache.clone()
    _index_copy_write(want, k.to(torch.bfloat16), v.to(torch.bfloat16), slots)
    assert cpu_ops.write_kv(cache, k, v, slots)
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))
    assert not cpu_ops.write_kv(cache.to(torch.float16), k, v, slots)  # a dtype the kernel does not write


@needs_compiler
def test_write_kv_slot_outside_the_cache_raises_and_writes_nothing():
    kv_cache = torch.zeros(1, 2, 4, 2, 1, 8)
    k = v = torch.ones(2, 1, 1, 8)
    with pytest.raises(ValueError, match="slot is outside the cache"):
        cpu_ops.write_kv(kv_cache, k, v, torch.tensor([3, 8]))
    assert not kv_cache.any()


@needs_compiler
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (16, 49152), (2, cpu_ops.PARALLEL_MIN + 5)])
def test_argmax_rows_equals_torch_argmax_with_ties_nan_and_inf(rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, 2 * vocab, generator=g)[:, :vocab]  # strided rows
    want = x.argmax(dim=-1)
    assert torch.equal(cpu_ops.argmax_rows(x), want)
    if vocab < 7:
        return
    x = x.clone()
    x[0] = float("-inf")  # every id banned: the first one, as torch
    x[-1, 2] = x[-1, 5] = 1e9  # a tie: the first one
    if rows > 1:
        x[1, 4] = float("nan")  # a NaN: as torch, the NaN
        x[1, 6] = float("nan")
    x[rows // 2, vocab - 1] = float("inf")
    assert torch.equal(cpu_ops.argmax_rows(x), x.argmax(dim=-1))


@needs_compiler
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (16, 49152), (2, cpu_ops.PARALLEL_MIN + 5)])
def test_argmax_logsumexp_rows_equals_torch(rows, vocab):
    """The argmax as argmax_rows; the logsumexp as torch's within fp32 rounding, NaN where torch's
    log_softmax is NaN (a NaN, an all -inf row, a +inf), finite with some -inf (banned) ids."""
    g = torch.Generator().manual_seed(rows + vocab)
    x = (torch.randn(rows, 2 * vocab, generator=g) * 4)[:, :vocab]  # strided rows
    tokens, lse = cpu_ops.argmax_logsumexp_rows(x)
    assert torch.equal(tokens, x.argmax(dim=-1))
    torch.testing.assert_close(lse, x.logsumexp(dim=-1), rtol=1e-6, atol=1e-5)
    if vocab < 7:
        return
    x = x.clone()
    x[0, 1:] = float("-inf")  # one id left: logsumexp = its logit
    x[-1, 3] = float("nan")
    x[rows // 2, 2] = float("inf") if rows > 2 else x[rows // 2, 2]
    tokens, lse = cpu_ops.argmax_logsumexp_rows(x)
    assert torch.equal(tokens, x.argmax(dim=-1))
    want = x.logsumexp(dim=-1)
    want[torch.log_softmax(x, dim=-1).isnan().all(dim=-1)] = float("nan")  # torch: logsumexp(+inf) = inf
    torch.testing.assert_close(lse, want, rtol=1e-6, atol=1e-5, equal_nan=True)
    assert float(lse[0]) == float(x[0, 0]) or rows == 1


def test_argmax_rows_leaves_other_inputs_to_torch():
    for fn in (cpu_ops.argmax_rows, cpu_ops.argmax_logsumexp_rows):
        assert fn(torch.randn(2, 5, dtype=torch.float64)) is None
        assert fn(torch.randn(5)) is None
        assert fn(torch.randn(3, 4).t()) is None
