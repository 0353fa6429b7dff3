"""The compiled C decode kernel (kernels/cpu_decode.py) against the torch backend's gather + SDPA path:
shapes, windows, padding rows, strided inputs, thread counts; and the plan's torch path where it does
not apply or cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import scattered_paged_cache
from swiftkv_fast import envs
from swiftkv_fast.attention import TorchBackend
from swiftkv_fast.kernels import build, cpu_decode, native
from swiftkv_fast.kernels.plan import plan_kernels

needs_compiler = pytest.mark.skipif(
    build.compiler() is None or not cpu_decode.enabled(),
    reason="no C compiler (or decode in SWIFTKV_DISABLED_KERNELS): the compiled decode kernel is off",
)
# every C kernel but decode attention switched off: the plans below build (or fail to build) that one
ALL_BUT_DECODE = frozenset(envs.KERNELS) - {cpu_decode.KERNEL}


def compiled(q, k_cache, v_cache, seq_lens, block_tables, window, scale):
    """The C kernel built for q's heads and the cache's dtype, as the plan hands it to the backend."""
    fn = cpu_decode.kernel(q.shape[-1], q.shape[1] // k_cache.shape[2], k_cache.dtype)
    assert fn is not None
    return cpu_decode.decode_attention(fn, q, k_cache, v_cache, seq_lens, block_tables, window, scale)


def plan_for(heads, kv_heads, dim, dtype=torch.float32, disabled=ALL_BUT_DECODE):
    return plan_kernels(
        "cpu", dtype, dtype, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, disabled=disabled
    )


def decode_choice(plan) -> str:
    return plan.as_dict()["ops"]["decode attention"]["implementation"]


def paged_case(seed, *, num_reqs, heads, kv_heads, dim, block_size, seq_lens, spare_blocks=2):
    """Random q and a K/V cache with every request's blocks scattered over it."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = scattered_paged_cache(
        gen, kv_heads=kv_heads, dim=dim, block_size=block_size, kv_lens=seq_lens, spare_blocks=spare_blocks
    )
    q = torch.randn(num_reqs, heads, dim, generator=gen)
    return q, k_cache, v_cache, torch.tensor(seq_lens, dtype=torch.int32), block_tables


def gathered(q, k_cache, v_cache, seq_lens, block_tables, window, scale):
    return TorchBackend().decode(q, k_cache, v_cache, seq_lens, block_tables, window, scale)


@needs_compiler
@pytest.mark.parametrize(
    "heads, kv_heads, dim, block_size",
    [(9, 3, 64, 16), (4, 4, 8, 4), (8, 1, 16, 1), (16, 2, 128, 16), (2, 1, 32, 3)],
)
@pytest.mark.parametrize("window", [None, 1, 7])
def test_kernel_matches_gather_and_sdpa(heads, kv_heads, dim, block_size, window):
    # lengths at, below and past block boundaries, a single position, and a long one
    seq_lens = [1, block_size, block_size + 1, 3 * block_size - 1, 45]
    q, k, v, lens, tables = paged_case(
        0, num_reqs=5, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, seq_lens=seq_lens
    )
    got = compiled(q, k, v, lens, tables, window, dim**-0.5)
    want = gathered(q, k, v, lens, tables, window, dim**-0.5)
    # convex combinations of N(0, 1) values: 1e-5 is ~20 fp32 ulps (the kernel sums in another order)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize(
    "heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (4, 4, 8, 4), (16, 2, 128, 16), (2, 1, 32, 3)]
)
@pytest.mark.parametrize("window", [None, 7])
def test_bf16_cache_reads_as_its_values_widened(heads, kv_heads, dim, block_size, window):
    """A bf16 cache (kv_cache_dtype="bfloat16") is read as fp32 exactly: the same result as the fp32
    kernel over the same values widened, and as the gather path, which casts the cache to the queries'."""
    seq_lens = [1, block_size + 1, 3 * block_size - 1, 45]
    q, k, v, lens, tables = paged_case(
        5, num_reqs=4, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, seq_lens=seq_lens
    )
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    got = compiled(q, k16, v16, lens, tables, window, dim**-0.5)
    assert got.dtype == torch.float32
    widened = compiled(q, k16.float(), v16.float(), lens, tables, window, dim**-0.5)
    # the same arithmetic on the same values (a widening mistake would be off by bf16's ~4e-3)
    torch.testing.assert_close(got, widened, rtol=1e-6, atol=1e-6)
    want = gathered(q, k16, v16, lens, tables, window, dim**-0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # and it is not the fp32 cache's result: the values were rounded
    assert not torch.allclose(got, gathered(q, k, v, lens, tables, window, dim**-0.5), rtol=0, atol=1e-5)


@needs_compiler
def test_padding_rows_are_zero_and_leave_other_rows_alone():
    q, k, v, lens, tables = paged_case(
        1, num_reqs=3, heads=6, kv_heads=2, dim=16, block_size=4, seq_lens=[5, 1, 9]
    )
    lens[1] = 0  # a padding row: no context, its block table row left as the null block
    tables[1] = 0
    got = compiled(q, k, v, lens, tables, None, 0.25)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    rows = [0, 2]
    want = gathered(q[rows], k, v, lens[rows], tables[rows], None, 0.25)
    torch.testing.assert_close(got[rows], want, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_strided_inputs_as_the_model_passes_them():
    # q: the query heads of a fused (R, heads + kv_heads, D) tensor; the cache: one slot of the engine's
    # (num_kv_slots, 2, num_blocks, block_size, kv_heads, D) tensor; int64 lengths; a strided block table
    q, k, v, lens, tables = paged_case(
        2, num_reqs=4, heads=6, kv_heads=2, dim=8, block_size=4, seq_lens=[3, 8, 13, 6]
    )
    qk = torch.cat([q, torch.randn(4, 2, 8)], dim=1)
    kv_cache = torch.randn(3, 2, *k.shape)
    kv_cache[1, 0], kv_cache[1, 1] = k, v
    wide = torch.zeros(4, 2 * tables.shape[1], dtype=torch.int32)
    wide[:, ::2] = tables  # a strided view of it is the block table
    got = compiled(qk[:, :6], kv_cache[1, 0], kv_cache[1, 1], lens.long(), wide[:, ::2], 5, 0.3)
    want = gathered(q, k, v, lens, tables, 5, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@needs_compiler
def test_threads_do_not_change_the_result():
    q, k, v, lens, tables = paged_case(
        3, num_reqs=6, heads=9, kv_heads=3, dim=64, block_size=16, seq_lens=[300, 17, 64, 1, 250, 129]
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = compiled(q, k, v, lens, tables, None, 0.125)
        torch.set_num_threads(2)
        two = compiled(q, k, v, lens, tables, None, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (request, KV head) is one thread's work, in a fixed order


@needs_compiler
@pytest.mark.parametrize("num_reqs", [1, 2])
def test_fewer_requests_than_threads_split_the_heads(num_reqs):
    # a request's KV heads are split over items when the threads outnumber the requests: the same
    # result, bit for bit, as one item per request
    q, k, v, lens, tables = paged_case(
        5, num_reqs=num_reqs, heads=12, kv_heads=4, dim=32, block_size=8, seq_lens=[70, 33][:num_reqs]
    )
    threads = torch.get_num_threads()
    got = []
    try:
        for n in [1, 2, 3, 8]:
            torch.set_num_threads(n)
            got.append(compiled(q, k, v, lens, tables, None, 0.2))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(got[0], other) for other in got[1:])
    torch.testing.assert_close(got[0], gathered(q, k, v, lens, tables, None, 0.2), rtol=1e-5, atol=1e-5)


def test_not_applicable_shapes_and_dtypes_are_planned_as_gather():
    """A head_dim the kernel is not built for, or bf16 queries: the plan hands the backend no decode
    kernel, and the backend gathers; the kernel itself refuses queries it does not take."""
    q, k, v, lens, tables = paged_case(
        4, num_reqs=2, heads=4, kv_heads=2, dim=12, block_size=4, seq_lens=[5, 7]
    )
    plan = plan_for(4, 2, 12)  # head_dim 12
    assert plan.decode_attention is None and decode_choice(plan) == "torch SDPA"
    got = TorchBackend.for_plan(plan).decode(q, k, v, lens, tables, None, 0.3)
    torch.testing.assert_close(got, gathered(q, k, v, lens, tables, None, 0.3))
    plan = plan_for(4, 2, 8, dtype=torch.bfloat16)
    assert plan.decode_attention is None and decode_choice(plan) == "torch SDPA"
    q16, k16, v16 = (t[..., :8].to(torch.bfloat16) for t in (q, k, v))
    got = TorchBackend.for_plan(plan).decode(q16, k16, v16, lens, tables, None, 0.3)
    torch.testing.assert_close(got, gathered(q16, k16, v16, lens, tables, None, 0.3))
    with pytest.raises(ValueError, match="fp32 CPU queries"):
        cpu_decode.decode_attention(lambda *args: 0, q16, k16, v16, lens, tables, None, 0.3)


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    q, k, v, lens, tables = paged_case(
        5, num_reqs=2, heads=4, kv_heads=2, dim=8, block_size=4, seq_lens=[5, 7]
    )
    with caplog.at_level(logging.WARNING, logger="swiftkv_fast"):
        for _ in range(2):
            plan = plan_for(4, 2, 8)
            assert plan.decode_attention is None and decode_choice(plan) == "torch SDPA"
            got = TorchBackend.for_plan(plan).decode(q, k, v, lens, tables, None, 0.3)
            torch.testing.assert_close(got, gathered(q, k, v, lens, tables, None, 0.3))
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "did not build" in caplog.records[0].message


@pytest.mark.parametrize("switch", ["env", "engine"])
def test_switched_off_by_the_environment_or_the_engine(switch, monkeypatch):
    if switch == "env":
        monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "decode")
        assert cpu_decode.kernel(8, 2) is None
        disabled = envs.disabled_kernels()  # what EngineConfig(disabled_kernels=None) resolves to
    else:
        monkeypatch.delenv("SWIFTKV_DISABLED_KERNELS", raising=False)
        disabled = frozenset({"decode"})  # EngineConfig(disabled_kernels="decode")
    plan = plan_for(4, 2, 8, disabled=ALL_BUT_DECODE | disabled)
    assert plan.decode_attention is None
    assert plan.as_dict()["ops"]["decode attention"] == {
        "implementation": "torch SDPA",
        "note": "decode in disabled_kernels",
    }


@needs_compiler
def test_bad_block_tables_raise_before_reading():
    q, k, v, lens, tables = paged_case(
        7, num_reqs=2, heads=4, kv_heads=2, dim=8, block_size=4, seq_lens=[5, 7]
    )
    too_long = lens.clone()
    too_long[1] = 4 * tables.shape[1] + 1
    with pytest.raises(ValueError, match="exceeds its block table"):
        compiled(q, k, v, too_long, tables, None, 0.3)
    outside = tables.clone()
    outside[0, 1] = k.shape[0]
    with pytest.raises(ValueError, match="block id outside"):
        compiled(q, k, v, lens, outside, None, 0.3)


@needs_compiler
def test_a_compiler_without_openmp_gets_a_one_thread_build(monkeypatch, tmp_path, caplog):
    cc = tmp_path / "cc-without-openmp"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *-fopenmp*) exit 1;; esac\nexec {build.compiler()} "$@"\n')
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setattr(build, "_openmp", lambda: True)
    q, k, v, lens, tables = paged_case(
        8, num_reqs=2, heads=4, kv_heads=2, dim=8, block_size=4, seq_lens=[5, 7]
    )
    with caplog.at_level(logging.INFO, logger="swiftkv_fast"):
        got = compiled(q, k, v, lens, tables, None, 0.3)  # builds the kernel
    assert any("one thread" in r.message for r in caplog.records)
    torch.testing.assert_close(got, gathered(q, k, v, lens, tables, None, 0.3), rtol=1e-5, atol=1e-5)
