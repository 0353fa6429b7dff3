"""The torch backend: its decode paths (the compiled C kernel of kernels/cpu_decode.py and the portable
one: gathered slots, grouped-query SDPA, per-step plan) and its SDPA prompt paths (per request and
padded), against a naive per-request attention over the paged cache; the engine through every path."""

import pytest
import torch
from conftest import naive_decode, naive_prefill
from swiftkv_fast import envs
from swiftkv_fast.attention import AttentionMetadata, TorchBackend
from swiftkv_fast.kernels import build, cpu_decode, cpu_prefill


def compiled_decode(head_dim: int, group: int):
    """The decode kernel the plan would hand the backend for these heads and an fp32 cache, or a skip."""
    if build.compiler() is None or not envs.kernel_enabled(cpu_decode.KERNEL):
        pytest.skip("no C compiler (or decode in SWIFTKV_DISABLED_KERNELS): the compiled decode is off")
    fn = cpu_decode.kernel(head_dim, group)
    if fn is None:
        pytest.skip("the decode kernel did not build here")
    return fn


@pytest.fixture(params=["compiled", "gather"])
def backend(request):
    """Both tests below use head_dim 8 and 3 query heads per KV head."""
    if request.param == "gather":
        return TorchBackend()
    return TorchBackend(decode_kernel=compiled_decode(8, 3))


@pytest.mark.parametrize("window", [None, 5])
def test_decode_matches_naive(window, backend):
    torch.manual_seed(0)
    num_blocks, block_size, kv_heads, heads, dim = 12, 4, 2, 6, 8
    k_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, dim)
    seq_lens = torch.tensor([7, 1, 12], dtype=torch.int32)
    block_tables = torch.tensor([[3, 5, 0], [9, 0, 0], [1, 2, 11]], dtype=torch.int32)
    q = torch.randn(3, heads, dim)
    be = backend
    want = naive_decode(q, k_cache, v_cache, seq_lens, block_tables, window, 0.3)
    got = be.decode(q, k_cache, v_cache, seq_lens, block_tables, window, 0.3)
    # attention outputs are convex combinations of N(0, 1) values (|out| < 5): 1e-5 is ~20 fp32 ulps
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # through prefill(): all queries single; the gather path builds its plan once for every layer
    meta = AttentionMetadata(
        cu_seqlens_q=torch.arange(4, dtype=torch.int32),
        seq_lens=seq_lens,
        block_tables=block_tables,
        max_query_len=1,
        max_seq_len=12,
    )
    for _ in range(2):
        got = be.prefill(q, k_cache, v_cache, meta, window, 0.3)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(meta.backend_cache) == (0 if be.decode_kernel is not None else 1)  # the C kernel: no plan


def test_decode_strided_query(backend):
    # q as the model passes it: the query heads of a fused (T, heads + kv_heads, D) tensor
    torch.manual_seed(1)
    k_cache = torch.randn(6, 4, 2, 8)
    v_cache = torch.randn(6, 4, 2, 8)
    qk = torch.randn(2, 6 + 2, 8)
    seq_lens = torch.tensor([5, 3], dtype=torch.int32)
    block_tables = torch.tensor([[1, 4], [2, 0]], dtype=torch.int32)
    be = backend
    got = be.decode(qk[:, :6], k_cache, v_cache, seq_lens, block_tables, None, 0.5)
    want = be.decode(qk[:, :6].contiguous(), k_cache, v_cache, seq_lens, block_tables, None, 0.5)
    assert torch.equal(got, want)
    ref = naive_decode(qk[:, :6], k_cache, v_cache, seq_lens, block_tables, None, 0.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_decode_in_chunks_of_requests(monkeypatch):
    # a chunk budget below one request's K/V: every request is attended on its own
    from swiftkv_fast.attention import torch_backend

    torch.manual_seed(2)
    k_cache = torch.randn(10, 4, 2, 8)
    v_cache = torch.randn(10, 4, 2, 8)
    seq_lens = torch.tensor([9, 2, 6], dtype=torch.int32)
    block_tables = torch.tensor([[4, 7, 1], [3, 0, 0], [8, 2, 0]], dtype=torch.int32)
    q = torch.randn(3, 4, 8)
    want = naive_decode(q, k_cache, v_cache, seq_lens, block_tables, None, 0.4)
    monkeypatch.setattr(torch_backend, "DECODE_CHUNK_BYTES", 1)
    got = TorchBackend().decode(q, k_cache, v_cache, seq_lens, block_tables, None, 0.4)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_per_request_prefill_pays_off_only_when_padding_costs_more_than_the_calls():
    from swiftkv_fast.attention.torch_backend import SdpaCost

    cost = SdpaCost(per_call=1e-4, per_unit=1e-9, per_masked_unit=1.35e-9)
    lens = [480, 800] * 8
    assert cost.per_request_is_faster(lens, lens, heads=9)  # 16 long prompts of mixed lengths
    short = [4, 8] * 64
    assert not cost.per_request_is_faster(short, short, heads=9)  # 128 short ones: the calls cost more
    assert not cost.per_request_is_faster([300, 300], [300, 300], heads=9)  # nothing padded
    # one chunk continues its prompt: the padded call would mask all seven, per request only that one
    assert cost.per_request_is_faster([640] * 7, [640] * 6 + [1280], heads=9)
    # a window: per request reads only the keys it reaches (127 of the first request's 1,024)
    assert cost.per_request_is_faster([64, 64], [1024, 64], heads=9, window=64)
    assert not cost.per_request_is_faster([8, 8], [8, 8], heads=9, window=64)


def test_per_request_prefill_of_chunks_and_windows_matches_naive_attention(monkeypatch):
    """Prompt rows that continue a prompt, fresh ones, and windows that cut them: one SDPA call per
    request and the padded masked call both equal a naive attention over the paged cache."""
    from swiftkv_fast.attention import torch_backend
    from swiftkv_fast.attention.torch_backend import SdpaCost

    torch.manual_seed(3)
    block_size, kv_heads, heads, dim = 4, 2, 6, 8
    k_cache = torch.randn(40, block_size, kv_heads, dim)
    v_cache = torch.randn(40, block_size, kv_heads, dim)
    q_lens, kv_lens = [5, 9, 3], [5, 21, 11]  # fresh; a chunk after 12 cached tokens; after 8
    block_tables = torch.tensor(
        [[7, 2, 0, 0, 0, 0], [11, 3, 30, 17, 5, 22], [9, 39, 14, 0, 0, 0]], dtype=torch.int32
    )
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens=torch.tensor(kv_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(q_lens),
        max_seq_len=max(kv_lens),
    )
    q = torch.randn(sum(q_lens), heads, dim)
    for window in (None, 6, 2):
        want = naive_prefill(q, k_cache, v_cache, q_lens, kv_lens, block_tables, window, 0.3)
        for cost in (SdpaCost(0.0, 1.0, 1.0), SdpaCost(1.0, 0.0, 0.0)):  # per request; padded
            monkeypatch.setattr(torch_backend, "sdpa_cost", lambda *args, c=cost: c)
            got = TorchBackend().prefill(q, k_cache, v_cache, meta, window, 0.3)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", ["per_request", "padded", "compiled"])
def test_fresh_prompts_of_different_lengths_every_way_match_the_reference(tiny_engine_case, path):
    """One batch of fresh prompts of different lengths, with the per-request or the padded SDPA forced,
    or the compiled prefill kernel: greedy tokens and logits as the reference's."""
    if path == "compiled" and (build.compiler() is None or not envs.kernel_enabled(cpu_prefill.KERNEL)):
        pytest.skip("no C compiler (or prefill in SWIFTKV_DISABLED_KERNELS): compiled prefill is off")
    run, expected = tiny_engine_case
    tokens, logits, prefill = run(path)
    # the plan's choice: the C kernel where it builds, SDPA where the engine switched it off
    assert prefill.startswith("C" if path == "compiled" else "torch SDPA"), prefill
    assert tokens == expected[0]
    for got, want in zip(logits, expected[1]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def tiny_engine_case():
    from conftest import reference_greedy
    from swiftkv_fast import LLM, SamplingParams
    from swiftkv_fast.attention import torch_backend
    from swiftkv_fast.attention.torch_backend import SdpaCost
    from swiftkv_reference.testing import random_state_dict, tiny_config, tiny_model

    cfg = tiny_config(model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2)
    state, model = random_state_dict(cfg, seed=0), tiny_model(cfg, seed=0)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, cfg.vocab_size, (n,), generator=g).tolist() for n in (7, 40, 23, 64)]
    refs = [reference_greedy(model, p, 4) for p in prompts]
    expected = ([t for t, _ in refs], [rows for _, rows in refs])

    def run(path: str):
        forced = SdpaCost(0.0, 1.0, 1.0) if path == "per_request" else SdpaCost(1.0, 0.0, 0.0)
        real = torch_backend.sdpa_cost
        torch_backend.sdpa_cost = lambda *args: forced
        disabled = envs.disabled_kernels() | ({"prefill"} if path != "compiled" else set())
        try:
            llm = LLM.from_state_dict(
                cfg, state, return_logits=True, num_kv_blocks=64, max_model_len=128, disabled_kernels=disabled
            )
            outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        finally:
            torch_backend.sdpa_cost = real
        prefill = llm.get_kernel_plan()["ops"]["prefill attention"]["implementation"]
        return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logits for o in outs], prefill

    return run, expected
