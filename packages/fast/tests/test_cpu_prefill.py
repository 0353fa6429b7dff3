"""The compiled C prompt-attention kernel (kernels/cpu_prefill.py) against a naive attention over the
paged cache: fresh prompts, chunks that continue a prompt, windows, GQA groups, tile and chunk edges,
strided queries, thread counts; bad block tables; and the plan's SDPA path where it does not apply or
cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import naive_prefill, scattered_paged_cache
from swiftkv_fast import envs
from swiftkv_fast.attention import AttentionMetadata, TorchBackend
from swiftkv_fast.kernels import build, cpu_decode, cpu_prefill, native
from swiftkv_fast.kernels.plan import plan_kernels

needs_compiler = pytest.mark.skipif(
    build.compiler() is None or not cpu_prefill.enabled(),
    reason="no C compiler (or prefill in SWIFTKV_DISABLED_KERNELS): the compiled prefill kernel is off",
)
# every C kernel but prompt attention switched off: the plans below build (or fail to build) that one
ALL_BUT_PREFILL = frozenset(envs.KERNELS) - {cpu_prefill.KERNEL}


def compiled(q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, window, scale, *, avx512=True):
    """The C kernel built for q's heads and the cache's dtype (avx512=False: the 8-lane register blocks
    even where the compiler targets AVX-512), as the plan hands it to the backend."""
    fn = cpu_prefill.kernel(
        q.shape[-1], q.shape[1] // k_cache.shape[2], avx512=avx512, kv_dtype=k_cache.dtype
    )
    assert fn is not None
    return cpu_prefill.prefill_attention(
        fn, q, k_cache, v_cache, cu_seqlens_q, seq_lens, block_tables, window, scale
    )


def plan_for(heads, kv_heads, dim, dtype=torch.float32, disabled=ALL_BUT_PREFILL):
    return plan_kernels(
        "cpu", dtype, dtype, num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, disabled=disabled
    )


def prefill_choice(plan) -> str:
    return plan.as_dict()["ops"]["prefill attention"]["implementation"]


def prompt_case(seed, *, heads, kv_heads, dim, block_size, q_lens, kv_lens, spare_blocks=2):
    """Random queries and a K/V cache with every request's blocks scattered over it."""
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, block_tables = scattered_paged_cache(
        gen, kv_heads=kv_heads, dim=dim, block_size=block_size, kv_lens=kv_lens, spare_blocks=spare_blocks
    )
    q = torch.randn(sum(q_lens), heads, dim, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k_cache, v_cache, cu, torch.tensor(kv_lens, dtype=torch.int32), block_tables


# (query rows, positions) per request: fresh prompts, a chunk after cached tokens, single rows, lengths
# at and across the 32-position tiles and 128-key chunks
LENGTHS = [
    ([5, 1, 40], [5, 9, 40]),
    ([31, 32, 33], [31, 64, 33]),
    ([130, 7], [300, 7]),
    ([257], [257]),
]


@needs_compiler
@pytest.mark.parametrize(
    "heads, kv_heads, dim, block_size",
    [(9, 3, 64, 16), (4, 4, 16, 4), (8, 1, 32, 1), (16, 2, 128, 16), (6, 2, 16, 3)],
)
@pytest.mark.parametrize("window", [None, 1, 7, 100])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda c: str(c[0]))
@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "8-lane"])
def test_kernel_matches_naive_attention(heads, kv_heads, dim, block_size, window, lengths, avx512):
    """Both register blocks (32 query rows in two 16-lane vectors where the compiler targets AVX-512,
    else 16 rows in two 8-lane vectors; avx512=False forces the latter) against the naive attention."""
    q_lens, kv_lens = lengths
    q, k, v, cu, lens, tables = prompt_case(
        0, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, q_lens=q_lens, kv_lens=kv_lens
    )
    got = compiled(q, k, v, cu, lens, tables, window, 0.3, avx512=avx512)
    want = naive_prefill(q, k, v, q_lens, kv_lens, tables, window, 0.3)
    # outputs are convex combinations of N(0, 1) values (|out| < 5): 2e-5 is ~40 fp32 ulps
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@needs_compiler
@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [(9, 3, 64, 16), (6, 2, 16, 3)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("avx512", [True, False], ids=["avx512", "8-lane"])
def test_bf16_cache_reads_as_its_values_widened(heads, kv_heads, dim, block_size, window, avx512):
    """A bf16 cache (kv_cache_dtype="bfloat16"): the fp32 kernel's result over the same values widened,
    and the naive attention's over them."""
    q_lens, kv_lens = [130, 7, 33], [300, 7, 33]
    q, k, v, cu, lens, tables = prompt_case(
        3, heads=heads, kv_heads=kv_heads, dim=dim, block_size=block_size, q_lens=q_lens, kv_lens=kv_lens
    )
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    got = compiled(q, k16, v16, cu, lens, tables, window, 0.3, avx512=avx512)
    assert got.dtype == torch.float32
    widened = compiled(q, k16.float(), v16.float(), cu, lens, tables, window, 0.3, avx512=avx512)
    torch.testing.assert_close(got, widened, rtol=1e-6, atol=1e-6)
    want = naive_prefill(q, k16.float(), v16.float(), q_lens, kv_lens, tables, window, 0.3)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    meta = AttentionMetadata(
        cu_seqlens_q=cu,
        seq_lens=lens,
        block_tables=tables,
        max_query_len=max(q_lens),
        max_seq_len=max(kv_lens),
    )
    sdpa = TorchBackend().prefill(q, k16, v16, meta, window, 0.3)  # casts the cache
    torch.testing.assert_close(got, sdpa, rtol=2e-5, atol=2e-5)


@needs_compiler
def test_through_the_backend_with_decode_rows_in_the_batch():
    """A mixed batch: the decode row goes to the decode kernel, the prompt rows to this one."""
    q_lens, kv_lens = [3, 1, 50], [10, 20, 50]
    q, k, v, cu, lens, tables = prompt_case(
        1, heads=6, kv_heads=2, dim=16, block_size=4, q_lens=q_lens, kv_lens=kv_lens
    )
    meta = AttentionMetadata(
        cu_seqlens_q=cu, seq_lens=lens, block_tables=tables, max_query_len=50, max_seq_len=50
    )
    backend = TorchBackend(decode_kernel=cpu_decode.kernel(16, 3), prefill_kernel=cpu_prefill.kernel(16, 3))
    assert backend.prefill_kernel is not None
    for window in (None, 8):
        want = naive_prefill(q, k, v, q_lens, kv_lens, tables, window, 0.3)
        got = backend.prefill(q, k, v, meta, window, 0.3)
        torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
        sdpa = TorchBackend().prefill(q, k, v, meta, window, 0.3)
        torch.testing.assert_close(got, sdpa, rtol=2e-5, atol=2e-5)


@needs_compiler
def test_strided_queries_as_the_model_passes_them():
    # q as the model passes it: the query heads of a fused (T, heads + 2 * kv_heads, D) tensor
    q, k, v, cu, lens, tables = prompt_case(
        2, heads=9, kv_heads=3, dim=64, block_size=16, q_lens=[40, 70], kv_lens=[40, 100]
    )
    fused = torch.cat([q, torch.randn(q.shape[0], 6, 64)], 1)
    got = compiled(fused[:, :9], k, v, cu, lens, tables, None, 0.125)
    assert got.is_contiguous()
    assert torch.equal(got, compiled(q, k, v, cu, lens, tables, None, 0.125))


@needs_compiler
def test_threads_do_not_change_the_result():
    q, k, v, cu, lens, tables = prompt_case(
        3, heads=9, kv_heads=3, dim=64, block_size=16, q_lens=[300, 17, 64, 1], kv_lens=[300, 40, 64, 129]
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = compiled(q, k, v, cu, lens, tables, None, 0.125)
        torch.set_num_threads(2)
        two = compiled(q, k, v, cu, lens, tables, None, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)  # each (request, KV head, tile) is one thread's work, in a fixed order


@needs_compiler
def test_bad_lengths_and_block_tables_raise_before_reading():
    q, k, v, cu, lens, tables = prompt_case(
        4, heads=4, kv_heads=2, dim=16, block_size=4, q_lens=[5, 7], kv_lens=[5, 9]
    )
    too_long = lens.clone()
    too_long[1] = 4 * tables.shape[1] + 1
    with pytest.raises(ValueError, match="exceeds its block table"):
        compiled(q, k, v, cu, too_long, tables, None, 0.3)
    too_short = lens.clone()
    too_short[1] = 6  # 7 queries, 6 positions
    with pytest.raises(ValueError, match="more queries than positions"):
        compiled(q, k, v, cu, too_short, tables, None, 0.3)
    outside = tables.clone()
    outside[1, 2] = k.shape[0]
    with pytest.raises(ValueError, match="block id outside"):
        compiled(q, k, v, cu, lens, outside, None, 0.3)
    # blocks a window has left behind are never read (nor checked), whatever they hold
    q2, k2, v2, cu2, lens2, tables2 = prompt_case(
        4, heads=4, kv_heads=2, dim=16, block_size=4, q_lens=[5, 2], kv_lens=[5, 13]
    )
    behind = tables2.clone()
    behind[1, :1] = k2.shape[0]  # positions 0..3; the window of 2 starts at 11 - 1 = 10
    got = compiled(q2, k2, v2, cu2, lens2, behind, 2, 0.3)
    want = naive_prefill(q2, k2, v2, [5, 2], [5, 13], tables2, 2, 0.3)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    with pytest.raises(ValueError, match="does not split"):
        compiled(q, k, v, cu[:-1], lens, tables, None, 0.3)


def test_not_applicable_shapes_and_dtypes_are_planned_as_sdpa():
    """head_dim 12 and 8 (not whole 16-column blocks), or bf16 queries: the plan hands the backend no
    prefill kernel, and the backend runs SDPA; the kernel itself refuses queries it does not take."""
    q, k, v, cu, lens, tables = prompt_case(
        5, heads=4, kv_heads=2, dim=12, block_size=4, q_lens=[5, 7], kv_lens=[5, 9]
    )
    meta = AttentionMetadata(
        cu_seqlens_q=cu, seq_lens=lens, block_tables=tables, max_query_len=7, max_seq_len=9
    )
    for dim in (12, 8):
        plan = plan_for(4, 2, dim)
        assert plan.prefill_attention is None and prefill_choice(plan) == "torch SDPA"
    got = TorchBackend.for_plan(plan_for(4, 2, 12)).prefill(q, k, v, meta, None, 0.3)
    torch.testing.assert_close(got, naive_prefill(q, k, v, [5, 7], [5, 9], tables, None, 0.3))
    plan = plan_for(4, 2, 16, dtype=torch.bfloat16)
    assert plan.prefill_attention is None and prefill_choice(plan) == "torch SDPA"
    q16, k16, v16 = (t[..., :8].to(torch.bfloat16) for t in (q, k, v))
    with pytest.raises(ValueError, match="fp32 CPU queries"):
        cpu_prefill.prefill_attention(lambda *args: 0, q16, k16, v16, cu, lens, tables, None, 0.3)


def test_a_failed_build_falls_back_with_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(build, "_built", {})
    monkeypatch.setattr(native, "_loaded", {})
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    q, k, v, cu, lens, tables = prompt_case(
        6, heads=4, kv_heads=2, dim=16, block_size=4, q_lens=[5, 7], kv_lens=[5, 9]
    )
    meta = AttentionMetadata(
        cu_seqlens_q=cu, seq_lens=lens, block_tables=tables, max_query_len=7, max_seq_len=9
    )
    with caplog.at_level(logging.WARNING, logger="swiftkv_fast"):
        for _ in range(2):
            plan = plan_for(4, 2, 16)
            assert plan.prefill_attention is None and prefill_choice(plan) == "torch SDPA"
            got = TorchBackend.for_plan(plan).prefill(q, k, v, meta, None, 0.3)
            torch.testing.assert_close(got, naive_prefill(q, k, v, [5, 7], [5, 9], tables, None, 0.3))
    messages = [r.message for r in caplog.records if "prefill-attention" in r.message]
    assert len(messages) == 1 and "did not build" in messages[0]


@pytest.mark.parametrize("switch", ["env", "engine"])
def test_switched_off_by_the_environment_or_the_engine(switch, monkeypatch):
    if switch == "env":
        monkeypatch.setenv("SWIFTKV_DISABLED_KERNELS", "prefill")
        assert cpu_prefill.kernel(16, 2) is None
        disabled = envs.disabled_kernels()  # what EngineConfig(disabled_kernels=None) resolves to
    else:
        monkeypatch.delenv("SWIFTKV_DISABLED_KERNELS", raising=False)
        disabled = frozenset({"prefill"})  # EngineConfig(disabled_kernels="prefill")
    plan = plan_for(4, 2, 16, disabled=ALL_BUT_PREFILL | disabled)
    assert plan.prefill_attention is None
    assert plan.as_dict()["ops"]["prefill attention"] == {
        "implementation": "torch SDPA",
        "note": "prefill in disabled_kernels",
    }
