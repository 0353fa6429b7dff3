"""The compiled CPU ops (kernels/cpu_ops.py) against their torch specification in model/layers.py:
RMSNorm with and without the residual add, SiLU-and-mul, in-place RoPE; strided rows, one thread and
several (PARALLEL_MIN), inputs they do not take, and the torch path when the plan does not choose them."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from swiftkv_fast import envs
from swiftkv_fast.kernels import build, cpu_ops, native
from swiftkv_fast.kernels.plan import plan_kernels
from swiftkv_fast.model import layers

needs_compiler = pytest.mark.skipif(
    build.compiler() is None or not envs.kernel_enabled(cpu_ops.KERNEL),
    reason="no C compiler (or ops in SWIFTKV_DISABLED_KERNELS): the compiled CPU ops are off",
)


@pytest.fixture(scope="module")
def lib():
    """The built row-ops library, as the kernel plan holds it."""
    loaded = cpu_ops.load()
    if loaded is None:
        pytest.skip("the row ops did not build here")
    return loaded


# small calls run on one thread, large ones on every thread: both sides of PARALLEL_MIN
ROWS = [1, 16, 2 * cpu_ops.PARALLEL_MIN // 64 + 3]


def torch_rms_norm(x, w, eps):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


@needs_compiler
@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_torch(lib, rows, with_delta):
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 100, generator=g)
    h = wide[:, 10:74]  # rows 100 apart: the kernel takes any row stride
    delta = torch.randn(rows, 64, generator=g) if with_delta else None
    w = torch.randn(64, generator=g)
    want_h = h + delta if with_delta else h.clone()
    want = torch_rms_norm(want_h, w, 1e-5)
    untouched = wide[:, :10].clone()
    got = cpu_ops.add_rms_norm(lib, h, delta, w, 1e-5)
    assert got is not None and got.is_contiguous()
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)  # the residual add is exact and in place
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(wide[:, :10], untouched)  # nothing outside the view is written


@needs_compiler
@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul_matches_torch(lib, rows):
    g = torch.Generator().manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 48 + 8, generator=g)[:, :96] * 6  # strided rows; large |x| too
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0  # far outside exp's range: silu -> 0 and -> x
    want = F.silu(gate_up[:, :48]) * gate_up[:, 48:]
    got = cpu_ops.silu_and_mul(lib, gate_up)
    assert got is not None and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)


@needs_compiler
@pytest.mark.parametrize("rows", ROWS)
def test_rope_in_place_matches_apply_rope(lib, rows):
    g = torch.Generator().manual_seed(rows)
    table = layers.RotaryTable(1.0 / (10000 ** (torch.arange(0, 32, 2) / 32)), 4096, torch.device("cpu"))
    qkv = torch.randn(rows, 7 * 32, generator=g)  # 5 q/k heads rotated, 2 v heads left alone
    positions = torch.randint(0, 4096, (rows,), generator=g)
    x = qkv[:, : 5 * 32].view(rows, 5, 32)
    want = layers.apply_rope(x, *table.lookup(positions))
    v_before = qkv[:, 5 * 32 :].clone()
    assert cpu_ops.rope_(lib, x, positions, table.cos, table.sin) is x
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 5 * 32 :], v_before)


@needs_compiler
def test_rope_position_outside_the_table_raises_and_writes_nothing(lib):
    table = layers.RotaryTable(torch.ones(4), 10, torch.device("cpu"))
    x = torch.randn(3, 2, 8)
    before = x.clone()
    with pytest.raises(ValueError, match="outside the RoPE table"):
        cpu_ops.rope_(lib, x, torch.tensor([0, 10, 1]), table.cos, table.sin)
    assert torch.equal(x, before)


def test_inputs_the_kernels_do_not_take_raise():
    """The plan hands the row ops only fp32 CPU rows: anything else is a caller's bug, refused before
    the library is touched (so no library is needed here)."""
    w = torch.randn(8)
    h16 = torch.randn(4, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match="fp32 CPU"):
        cpu_ops.add_rms_norm(None, h16, None, w, 1e-5)  # bf16
    with pytest.raises(ValueError, match="dense rows"):
        cpu_ops.add_rms_norm(None, torch.randn(8, 4).t(), None, w, 1e-5)  # columns: h is written in place
    with pytest.raises(ValueError, match="odd width"):
        cpu_ops.silu_and_mul(None, torch.randn(4, 7))
    with pytest.raises(ValueError, match="fp32 CPU"):
        cpu_ops.rope_(
            None,
            torch.randn(3, 2, 8, dtype=torch.float64),
            torch.zeros(3, dtype=torch.int64),
            torch.ones(1, 4),
            torch.ones(1, 4),
        )
    with pytest.raises(ValueError, match="do not fit"):
        cpu_ops.rope_(
            None, torch.randn(3, 2, 8), torch.zeros(3, dtype=torch.int64), torch.ones(1, 3), torch.ones(1, 3)
        )
    with pytest.raises(ValueError, match="write_kv"):
        cpu_ops.write_kv(
            None,
            torch.zeros(1, 2, 4, 2, 1, 8, dtype=torch.float16),
            torch.ones(2, 1, 1, 8),
            torch.ones(2, 1, 1, 8),
            torch.tensor([0, 1]),
        )


@needs_compiler
def test_inputs_whose_rows_are_not_dense_are_copied(lib):
    """A delta, a gate_up or RoPE's heads not dense within a row run on a copy, with torch's results
    (RoPE's written back into x)."""
    g = torch.Generator().manual_seed(5)
    h, w = torch.randn(4, 8, generator=g), torch.randn(8, generator=g)
    delta = torch.randn(8, 4, generator=g).t()  # columns, not rows
    want_h = h + delta
    got = cpu_ops.add_rms_norm(lib, h, delta, w, 1e-5)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)
    torch.testing.assert_close(got, torch_rms_norm(want_h, w, 1e-5), rtol=1e-6, atol=1e-6)
    gate_up = torch.randn(12, 4, generator=g).t()
    torch.testing.assert_close(
        cpu_ops.silu_and_mul(lib, gate_up), F.silu(gate_up[:, :6]) * gate_up[:, 6:], rtol=2e-6, atol=1e-6
    )
    table = layers.RotaryTable(torch.ones(3), 10, torch.device("cpu"))
    wide = torch.randn(3, 2, 8, generator=g)
    x = wide[:, :, :6]  # heads not dense within a token
    positions = torch.tensor([0, 9, 4])
    want = layers.apply_rope(x, *table.lookup(positions))
    rest = wide[:, :, 6:].clone()
    assert cpu_ops.rope_(lib, x, positions, table.cos, table.sin) is x
    torch.testing.assert_close(x, want, rtol=1e-6, atol=1e-6)
    assert torch.equal(wide[:, :, 6:], rest)


# every C kernel but the row ops switched off: the plan builds (or fails to build) that one library
_ALL_BUT_OPS = frozenset(envs.KERNELS) - {cpu_ops.KERNEL}


@pytest.mark.parametrize("switch", ["disabled", "failed-build"])
def test_layers_run_torch_where_the_plan_does_not_choose_the_row_ops(switch, monkeypatch, caplog):
    """Row ops switched off (the engine's disabled_kernels) or not built (one warning, however often
    plans are made): the plan holds no library, and the layers built from it run the torch ops."""
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setattr(native, "_loaded", {})
    disabled = _ALL_BUT_OPS
    if switch == "disabled":
        disabled = disabled | envs.disabled_kernels("ops")
    else:
        monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    g = torch.Generator().manual_seed(0)
    h, delta, w = (
        torch.randn(5, 16, generator=g),
        torch.randn(5, 16, generator=g),
        torch.randn(16, generator=g),
    )
    with caplog.at_level(logging.WARNING, logger="swiftkv_fast"):
        for _ in range(2):
            plan = plan_kernels(
                "cpu",
                torch.float32,
                torch.float32,
                num_heads=4,
                num_kv_heads=2,
                head_dim=8,
                disabled=disabled,
            )
            assert plan.row_ops is None
            ops = layers.RowOps(plan.row_ops)
            table = layers.RotaryTable(torch.ones(4), 10, torch.device("cpu"), ops)
            want_h = h + delta
            got = ops.add_rms_norm(h, delta, w, 1e-5)
            torch.testing.assert_close(h, want_h)
            torch.testing.assert_close(got, torch_rms_norm(want_h, w, 1e-5))
            gu = torch.randn(5, 32, generator=g)
            torch.testing.assert_close(ops.silu_and_mul(gu.clone()), F.silu(gu[:, :16]) * gu[:, 16:])
            x = torch.randn(5, 2, 8, generator=g)
            pos = torch.arange(5)
            want = layers.apply_rope(x, *table.lookup(pos))
            torch.testing.assert_close(table.at(pos).apply_(x), want)
    warnings = [r.message for r in caplog.records]
    assert len(warnings) == (0 if switch == "disabled" else 1)
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
def test_write_kv_matches_index_copy(lib, tokens):
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
    assert cpu_ops.write_kv(lib, kv_cache, k, v, slots) is None
    assert torch.equal(engine_cache, want)  # exact copies, and nothing outside the slots or layers


@needs_compiler
def test_write_kv_into_a_bf16_cache_rounds_as_torch_does(lib):
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
    cpu_ops.write_kv(lib, cache, k, v, slots)
    assert torch.equal(cache.view(torch.int16), want.view(torch.int16))
    with pytest.raises(ValueError, match="fp32 or bf16 CPU cache"):  # a dtype the kernel does not write
        cpu_ops.write_kv(lib, cache.to(torch.float16), k, v, slots)


@needs_compiler
def test_write_kv_slot_outside_the_cache_raises_and_writes_nothing(lib):
    kv_cache = torch.zeros(1, 2, 4, 2, 1, 8)
    k = v = torch.ones(2, 1, 1, 8)
    with pytest.raises(ValueError, match="slot is outside the cache"):
        cpu_ops.write_kv(lib, kv_cache, k, v, torch.tensor([3, 8]))
    assert not kv_cache.any()


@needs_compiler
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (16, 49152), (2, cpu_ops.PARALLEL_MIN + 5)])
def test_argmax_rows_equals_torch_argmax_with_ties_nan_and_inf(lib, rows, vocab):
    g = torch.Generator().manual_seed(rows * vocab)
    x = torch.randn(rows, 2 * vocab, generator=g)[:, :vocab]  # strided rows
    want = x.argmax(dim=-1)
    assert torch.equal(cpu_ops.argmax_rows(lib, x), want)
    if vocab < 7:
        return
    x = x.clone()
    x[0] = float("-inf")  # every id banned: the first one, as torch
    x[-1, 2] = x[-1, 5] = 1e9  # a tie: the first one
    if rows > 1:
        x[1, 4] = float("nan")  # a NaN: as torch, the NaN
        x[1, 6] = float("nan")
    x[rows // 2, vocab - 1] = float("inf")
    assert torch.equal(cpu_ops.argmax_rows(lib, x), x.argmax(dim=-1))


@needs_compiler
@pytest.mark.parametrize("rows, vocab", [(1, 1), (3, 7), (16, 49152), (2, cpu_ops.PARALLEL_MIN + 5)])
def test_argmax_logsumexp_rows_equals_torch(lib, rows, vocab):
    """The argmax as argmax_rows; the logsumexp as torch's within fp32 rounding, NaN where torch's
    log_softmax is NaN (a NaN, an all -inf row, a +inf), finite with some -inf (banned) ids."""
    g = torch.Generator().manual_seed(rows + vocab)
    x = (torch.randn(rows, 2 * vocab, generator=g) * 4)[:, :vocab]  # strided rows
    tokens, lse = cpu_ops.argmax_logsumexp_rows(lib, x)
    assert torch.equal(tokens, x.argmax(dim=-1))
    torch.testing.assert_close(lse, x.logsumexp(dim=-1), rtol=1e-6, atol=1e-5)
    if vocab < 7:
        return
    x = x.clone()
    x[0, 1:] = float("-inf")  # one id left: logsumexp = its logit
    x[-1, 3] = float("nan")
    x[rows // 2, 2] = float("inf") if rows > 2 else x[rows // 2, 2]
    tokens, lse = cpu_ops.argmax_logsumexp_rows(lib, x)
    assert torch.equal(tokens, x.argmax(dim=-1))
    want = x.logsumexp(dim=-1)
    want[torch.log_softmax(x, dim=-1).isnan().all(dim=-1)] = float("nan")  # torch: logsumexp(+inf) = inf
    torch.testing.assert_close(lse, want, rtol=1e-6, atol=1e-5, equal_nan=True)
    assert float(lse[0]) == float(x[0, 0]) or rows == 1


def test_argmax_rows_refuses_what_is_not_fp32_rows():
    for fn in (cpu_ops.argmax_rows, cpu_ops.argmax_logsumexp_rows):
        with pytest.raises(ValueError, match="fp32 CPU"):
            fn(None, torch.randn(2, 5, dtype=torch.float64))
        with pytest.raises(ValueError, match="fp32 CPU"):
            fn(None, torch.randn(5))
        with pytest.raises(ValueError, match="empty vocabulary"):
            fn(None, torch.randn(2, 0))


@needs_compiler
def test_argmax_rows_of_columns_run_on_a_copy(lib):
    x = torch.randn(3, 4).t()  # rows not dense
    assert torch.equal(cpu_ops.argmax_rows(lib, x), x.argmax(dim=-1))
    tokens, lse = cpu_ops.argmax_logsumexp_rows(lib, x)
    assert torch.equal(tokens, x.argmax(dim=-1))
    torch.testing.assert_close(lse, x.logsumexp(dim=-1), rtol=1e-6, atol=1e-5)
