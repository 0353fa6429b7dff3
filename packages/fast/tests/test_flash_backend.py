"""The flash_attn adapter: block-size rule, clear errors, argument mapping (fake module on CPU),
and the real kernels against the Triton-free torch reference where CUDA + flash_attn exist."""

import sys
import types

import pytest
import torch
from swiftkv_fast.attention import flash_backend as fb
from swiftkv_fast.attention.flash_backend import FlashAttnBackend, torch_write_kv, validate_block_size


@pytest.mark.parametrize("bs", [256, 512, 1024])
def test_block_size_multiple_of_256_ok(bs):
    assert validate_block_size(bs) == bs


@pytest.mark.parametrize("bs", [1, 16, 128, 255, 300, 0, -256])
def test_block_size_rule_rejects(bs):
    with pytest.raises(ValueError, match="multiple of 256"):
        validate_block_size(bs)
    with pytest.raises(ValueError, match="multiple of 256"):  # before flash_attn is even imported
        FlashAttnBackend(bs)


def test_missing_flash_attn_is_a_clear_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # import flash_attn -> ImportError
    with pytest.raises(ImportError, match="needs the `flash-attn` package"):
        FlashAttnBackend(256)
    assert not fb.flash_attn_available()


def _fake_flash(calls):
    mod = types.ModuleType("flash_attn")

    def varlen(q, k, v, **kw):
        calls.append(("varlen", kw))
        return torch.zeros_like(q)

    def with_kvcache(q, k_cache, v_cache, **kw):
        calls.append(("kvcache", dict(kw, q_shape=tuple(q.shape))))
        return torch.zeros_like(q)

    mod.flash_attn_varlen_func = varlen
    mod.flash_attn_with_kvcache = with_kvcache
    return mod


def test_missing_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash([]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        FlashAttnBackend(256)


def test_adapter_argument_mapping(monkeypatch):
    calls = []
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash(calls))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    be = FlashAttnBackend(256)
    assert be.name == "flash_attn"
    kc = torch.zeros(3, 256, 2, 32)
    meta = types.SimpleNamespace(
        cu_seqlens_q=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([300, 7], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [0, 0]], dtype=torch.int32),
        max_query_len=3,
        max_seq_len=300,
    )
    q = torch.zeros(4, 6, 32)
    assert be.prefill(q, kc, kc, meta, 100, 0.5).shape == q.shape
    name, kw = calls[-1]
    assert name == "varlen"
    assert kw["cu_seqlens_k"].tolist() == [0, 300, 307] and kw["cu_seqlens_k"].dtype == torch.int32
    assert kw["window_size"] == (99, 0) and kw["causal"] and kw["softmax_scale"] == 0.5
    assert kw["max_seqlen_q"] == 3 and kw["max_seqlen_k"] == 300 and kw["block_table"] is meta.block_tables
    be.prefill(q, kc, kc, meta, None, 0.5)
    assert calls[-1][1]["window_size"] == (-1, -1)

    out = be.decode(q[:2], kc, kc, meta.seq_lens, meta.block_tables, 64, 0.5)
    assert out.shape == (2, 6, 32)
    name, kw = calls[-1]
    assert name == "kvcache" and kw["q_shape"] == (2, 1, 6, 32)
    assert kw["cache_seqlens"] is meta.seq_lens and kw["block_table"] is meta.block_tables
    assert kw["window_size"] == (63, 0) and kw["causal"]


def test_torch_write_kv_skips_padding():
    kv = torch.zeros(2, 2, 3, 4, 1, 8)
    k = torch.randn(3, 2, 1, 8)
    v = torch.randn(3, 2, 1, 8)
    torch_write_kv(kv, k, v, torch.tensor([5, -1, 11]))
    assert torch.equal(kv[:, 0, 1, 1], k[0]) and torch.equal(kv[:, 1, 2, 3], v[2])
    assert kv.count_nonzero() == 2 * 2 * 2 * 8 - (k[[0, 2]] == 0).sum() - (v[[0, 2]] == 0).sum()


def _dense_ref(q, k_cache, v_cache, cu, seq_lens, tables, window, scale):
    q, k_cache, v_cache = q.double(), k_cache.double(), v_cache.double()
    bs, rep = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for r in range(len(seq_lens)):
        s0, s1, sl = int(cu[r]), int(cu[r + 1]), int(seq_lens[r])
        kpos = torch.arange(sl, device=q.device)
        slots = tables[r, kpos // bs].long() * bs + kpos % bs
        k = k_cache.flatten(0, 1)[slots].repeat_interleave(rep, 1)
        v = v_cache.flatten(0, 1)[slots].repeat_interleave(rep, 1)
        qpos = sl - (s1 - s0) + torch.arange(s1 - s0, device=q.device)
        mask = kpos[None] <= qpos[:, None]
        if window is not None:
            mask &= kpos[None] > qpos[:, None] - window
        sc = torch.einsum("qhd,khd->hqk", q[s0:s1], k).mul(scale).masked_fill(~mask[None], float("-inf"))
        out[s0:s1] = torch.einsum("hqk,khd->qhd", sc.softmax(-1), v)
    return out


@pytest.mark.skipif(not fb.flash_attn_available(), reason="needs CUDA and flash_attn")
@pytest.mark.parametrize("window", [None, 300])
def test_real_flash_attn_kernels(window):
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    kc = torch.randn(8, 256, 2, 64, device=dev, generator=g).to(dt)
    vc = torch.randn(8, 256, 2, 64, device=dev, generator=g).to(dt)
    tables = torch.tensor([[3, 5, 1], [7, 2, 0]], dtype=torch.int32, device=dev)
    seq_lens = torch.tensor([700, 260], dtype=torch.int32, device=dev)
    cu = torch.tensor([0, 40, 41], dtype=torch.int32, device=dev)
    q = torch.randn(41, 6, 64, device=dev, generator=g).to(dt)
    meta = types.SimpleNamespace(
        cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=tables, max_query_len=40, max_seq_len=700
    )
    be = FlashAttnBackend(256)
    out = be.prefill(q, kc, vc, meta, window, 0.125)
    torch.testing.assert_close(
        out.double(), _dense_ref(q, kc, vc, cu, seq_lens, tables, window, 0.125), atol=2e-2, rtol=0
    )
    last = (cu[1:] - 1).long()
    dec = be.decode(q[last], kc, vc, seq_lens, tables, window, 0.125)
    torch.testing.assert_close(dec.double(), out[last].double(), atol=2e-2, rtol=0)


def test_adapter_write_kv_on_cpu_uses_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", _fake_flash([]))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    kv = torch.zeros(1, 2, 2, 256, 1, 8)
    k = torch.ones(2, 1, 1, 8)
    FlashAttnBackend(256).write_kv(kv, k, 2 * k, torch.tensor([-1, 300]))
    assert (kv[0, 0, 1, 44] == 1).all() and (kv[0, 1, 1, 44] == 2).all() and kv.sum() == 3 * 8
