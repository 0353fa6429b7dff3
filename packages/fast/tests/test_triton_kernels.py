"""Triton paged-attention kernels and the ``triton`` backend against a dense torch reference.

On a machine without CUDA the kernels run under Triton's interpreter, which
must be switched on before the kernels are imported.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import math  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

from swiftkv_fast.kernels.paged_decode import paged_decode  # noqa: E402
from swiftkv_fast.kernels.paged_prefill import paged_prefill  # noqa: E402
from swiftkv_fast.kernels.write_kv import write_kv  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"
# outputs are convex combinations of N(0, 1) values (|out| < 5): fp32 1e-5 is ~20 ulps of them
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


def make_case(seed, q_lens, seq_lens, block_size, kv_heads, q_per_kv, head_dim, window, dtype):
    """Random paged cache and block tables; blocks wholly outside every query's window are the
    null block 0, which is filled with NaN so that any read of it shows in the output."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(seq_lens)
    nblk = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(nblk + [1]) + 1  # one column of padding
    num_blocks = sum(nblk) + 5
    ids = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    tables = torch.zeros(num_reqs, max_blocks, dtype=torch.int32)
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        first_pos = sl - ql
        skipped = max(0, first_pos - window + 1) if window is not None else 0
        for b in range(nblk[r]):
            tables[r, b] = 0 if (b + 1) * block_size <= skipped else ids.pop()
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g)
    v_cache = torch.randn(shape, generator=g)
    k_cache[0] = float("nan")
    v_cache[0] = float("nan")
    q = torch.randn(sum(q_lens), kv_heads * q_per_kv, head_dim, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    to = dict(device=DEVICE)
    return (
        q.to(dtype).to(**to),
        k_cache.to(dtype).to(**to),
        v_cache.to(dtype).to(**to),
        cu.to(**to),
        sl.to(**to),
        tables.to(**to),
    )


def reference(q, k_cache, v_cache, cu, seq_lens, tables, window, scale):
    """Dense attention in fp64: gather K/V through the block table, explicit causal/window mask."""
    q, k_cache, v_cache = q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu()
    cu, seq_lens, tables = cu.cpu(), seq_lens.cpu(), tables.cpu()
    bs = k_cache.shape[1]
    rep = q.shape[1] // k_cache.shape[2]
    out = torch.zeros_like(q)
    for r in range(len(seq_lens)):
        s0, s1, sl = int(cu[r]), int(cu[r + 1]), int(seq_lens[r])
        if s1 == s0 or sl == 0:
            continue
        kpos = torch.arange(sl)
        slots = tables[r, kpos // bs].long() * bs + kpos % bs
        k = k_cache.flatten(0, 1)[slots].repeat_interleave(rep, dim=1)  # (sl, H, D)
        v = v_cache.flatten(0, 1)[slots].repeat_interleave(rep, dim=1)
        qpos = sl - (s1 - s0) + torch.arange(s1 - s0)
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= kpos[None, :] > qpos[:, None] - window
        # positions outside the mask may be the (NaN) null block: never let them in
        k = torch.where(mask.any(0)[:, None, None], k, 0.0)
        v = torch.where(mask.any(0)[:, None, None], v, 0.0)
        scores = torch.einsum("qhd,khd->hqk", q[s0:s1], k) * scale
        scores = scores.masked_fill(~mask[None], float("-inf"))
        out[s0:s1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out


def check(out, ref, dtype):
    assert out.dtype == dtype
    assert not torch.isnan(out).any()
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= TOL[dtype], err


PREFILL_LAYOUT = dict(q_lens=[1, 21, 5, 3], seq_lens=[9, 38, 5, 3])


@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("q_per_kv", [1, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_prefill_fp32(block_size, q_per_kv, window):
    case = make_case(
        0,
        **PREFILL_LAYOUT,
        block_size=block_size,
        kv_heads=2,
        q_per_kv=q_per_kv,
        head_dim=32,
        window=window,
        dtype=torch.float32,
    )
    q, kc, vc, cu, sl, bt = case
    out = paged_prefill(q, kc, vc, cu, sl, bt, max_query_len=21, window=window, scale=0.3)
    check(out, reference(*case, window, 0.3), torch.float32)


@pytest.mark.parametrize(
    "dtype,window,head_dim", [(torch.bfloat16, 7, 32), (torch.float16, None, 24), (torch.bfloat16, None, 64)]
)
def test_prefill_half(dtype, window, head_dim):
    case = make_case(
        1,
        **PREFILL_LAYOUT,
        block_size=16,
        kv_heads=1,
        q_per_kv=3,
        head_dim=head_dim,
        window=window,
        dtype=dtype,
    )
    q, kc, vc, cu, sl, bt = case
    out = paged_prefill(q, kc, vc, cu, sl, bt, max_query_len=21, window=window, scale=head_dim**-0.5)
    check(out, reference(*case, window, head_dim**-0.5), dtype)


def test_prefill_window_longer_than_context_and_empty_request():
    layout = dict(q_lens=[4, 0, 6], seq_lens=[10, 3, 6])
    case = make_case(
        2, **layout, block_size=4, kv_heads=2, q_per_kv=2, head_dim=32, window=100, dtype=torch.float32
    )
    q, kc, vc, cu, sl, bt = case
    out = paged_prefill(q, kc, vc, cu, sl, bt, max_query_len=6, window=100, scale=0.2)
    check(out, reference(*case, 100, 0.2), torch.float32)


DECODE_SEQ_LENS = [1, 17, 40, 0, 23]


@pytest.mark.parametrize("block_size,num_splits", [(1, 3), (16, 1), (16, 3), (5, 2)])
@pytest.mark.parametrize("q_per_kv", [1, 3])
@pytest.mark.parametrize("window", [None, 6])
def test_decode_fp32(block_size, q_per_kv, window, num_splits):
    case = make_case(
        3,
        q_lens=[1] * 5,
        seq_lens=DECODE_SEQ_LENS,
        block_size=block_size,
        kv_heads=2,
        q_per_kv=q_per_kv,
        head_dim=32,
        window=window,
        dtype=torch.float32,
    )
    q, kc, vc, cu, sl, bt = case
    out = paged_decode(q, kc, vc, sl, bt, window=window, scale=0.3, num_splits=num_splits)
    ref = reference(*case, window, 0.3)
    check(out, ref, torch.float32)
    assert (out[3] == 0).all()  # seq_len 0: a padding row, zeros


@pytest.mark.parametrize("dtype,window", [(torch.bfloat16, None), (torch.bfloat16, 6), (torch.float16, 30)])
def test_decode_half(dtype, window):
    case = make_case(
        4,
        q_lens=[1] * 5,
        seq_lens=DECODE_SEQ_LENS,
        block_size=16,
        kv_heads=1,
        q_per_kv=3,
        head_dim=64,
        window=window,
        dtype=dtype,
    )
    q, kc, vc, cu, sl, bt = case
    out = paged_decode(q, kc, vc, sl, bt, window=window, scale=0.125, num_splits=4)
    check(out, reference(*case, window, 0.125), dtype)


def test_decode_default_splits_long_context():
    case = make_case(
        5,
        q_lens=[1, 1],
        seq_lens=[300, 77],
        block_size=16,
        kv_heads=1,
        q_per_kv=1,
        head_dim=16,
        window=None,
        dtype=torch.float32,
    )
    q, kc, vc, cu, sl, bt = case
    out = paged_decode(q, kc, vc, sl, bt, window=None, scale=0.25)
    check(out, reference(*case, None, 0.25), torch.float32)


def _write_ref(kv_cache, k, v, slots):
    kv = kv_cache.clone()
    bs = kv.shape[3]
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            kv[:, 0, s // bs, s % bs] = k[t]
            kv[:, 1, s // bs, s % bs] = v[t]
    return kv


@pytest.mark.parametrize("dtype,block_size", [(torch.float32, 16), (torch.bfloat16, 5), (torch.float16, 1)])
def test_write_kv_all_layers_skip_padding(dtype, block_size):
    g = torch.Generator().manual_seed(6)
    full = torch.randn(5, 2, 12, block_size, 3, 24, generator=g).to(dtype).to(DEVICE)
    kv_cache = full[1:4]  # a slice of the engine's cache: layers 1..3
    n = 9
    k = torch.randn(n, 3, 3, 24, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(n, 3, 3, 24, generator=g).to(dtype).to(DEVICE)
    slots = torch.randperm(12 * block_size, generator=g)[:n]
    slots[[2, 7]] = -1
    expect = _write_ref(kv_cache.cpu(), k.cpu(), v.cpu(), slots)
    before = full.cpu().clone()
    write_kv(kv_cache, k, v, slots.to(DEVICE))
    assert torch.equal(kv_cache.cpu(), expect)
    assert torch.equal(full[[0, 4]].cpu(), before[[0, 4]])


def test_write_kv_rejects_bad_shapes():
    kv_cache = torch.zeros(2, 2, 4, 4, 1, 16, device=DEVICE)
    with pytest.raises(ValueError, match="k and v"):
        write_kv(
            kv_cache,
            torch.zeros(3, 1, 1, 16, device=DEVICE),
            torch.zeros(3, 1, 1, 16, device=DEVICE),
            torch.zeros(3, dtype=torch.int64, device=DEVICE),
        )


# ---------------------------------------------------------------- the backend


def test_triton_backend_roundtrip():
    """write_kv then prefill and decode through TritonBackend equal the dense reference."""
    from swiftkv_fast.attention.triton_backend import TritonBackend

    be = TritonBackend()
    assert be.name == "triton"
    case = make_case(
        7,
        q_lens=[3, 1, 6],
        seq_lens=[11, 20, 6],
        block_size=4,
        kv_heads=2,
        q_per_kv=2,
        head_dim=32,
        window=None,
        dtype=torch.float32,
    )
    q, kc, vc, cu, sl, bt = case
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    kv_cache = torch.stack([kc, vc])[None].repeat(2, 1, 1, 1, 1, 1)  # 2 layers
    # overwrite the new tokens' K/V through write_kv (layer 1 is the one attended)
    g = torch.Generator().manual_seed(8)
    k_new = torch.randn(10, 2, 2, 32, generator=g).to(DEVICE)
    v_new = torch.randn(10, 2, 2, 32, generator=g).to(DEVICE)
    slots = []
    for r in range(3):
        for j in range(int(cu[r + 1] - cu[r])):
            p = int(sl[r]) - int(cu[r + 1] - cu[r]) + j
            slots.append(int(bt[r, p // 4]) * 4 + p % 4)
    be.write_kv(kv_cache, k_new, v_new, torch.tensor(slots, device=DEVICE))
    kc1, vc1 = kv_cache[1, 0], kv_cache[1, 1]
    meta = SimpleNamespace(cu_seqlens_q=cu, seq_lens=sl, block_tables=bt, max_query_len=6, max_seq_len=20)
    out = be.prefill(q, kc1, vc1, meta, None, 0.2)
    check(out, reference(q, kc1, vc1, cu, sl, bt, None, 0.2), torch.float32)

    last = (cu[1:] - 1).long()
    dec = be.decode(q[last], kc1, vc1, sl, bt, 5, 0.2)
    cu1 = torch.arange(4, dtype=torch.int32, device=DEVICE)
    check(dec, reference(q[last], kc1, vc1, cu1, sl, bt, 5, 0.2), torch.float32)
    # the decode of each request's last query equals the prefill's row for it (window None)
    dec_full = be.decode(q[last], kc1, vc1, sl, bt, None, 0.2)
    torch.testing.assert_close(dec_full, out[last], atol=TOL[torch.float32], rtol=0)


def test_triton_backend_strided_views():
    """The model hands the backend views: q and k sliced from one RoPE'd (T, nh + kvh, hd) tensor, v a
    view of a slice of the fused qkv output, K/V of a run of layers sliced out of all layers. The kernels
    take strides, so the views give exactly the results of contiguous copies."""
    from swiftkv_fast.attention.triton_backend import TritonBackend

    be = TritonBackend()
    q, kc, vc, cu, sl, bt = make_case(
        5,
        q_lens=[3, 1, 6],
        seq_lens=[11, 20, 6],
        block_size=4,
        kv_heads=2,
        q_per_kv=2,
        head_dim=32,
        window=None,
        dtype=torch.float32,
    )
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    g = torch.Generator().manual_seed(9)
    qk = torch.cat([q, torch.randn(q.shape[0], 2, 32, generator=g).to(DEVICE)], dim=1)  # (T, nh + kvh, hd)
    q_view = qk[:, :4]
    assert not q_view.is_contiguous()
    meta = SimpleNamespace(cu_seqlens_q=cu, seq_lens=sl, block_tables=bt, max_query_len=6, max_seq_len=20)
    assert torch.equal(
        be.prefill(q_view, kc, vc, meta, 8, 0.2), be.prefill(q_view.contiguous(), kc, vc, meta, 8, 0.2)
    )
    last = (cu[1:] - 1).long()
    assert torch.equal(
        be.decode(q_view[last], kc, vc, sl, bt, None, 0.2),
        be.decode(q[last].contiguous(), kc, vc, sl, bt, None, 0.2),
    )
    # write_kv: (T, 3 layers, kvh, hd) K/V, layers 1..2 written into a 2-layer cache slice
    T = 10
    kv = torch.randn(T, 2, 3, 2, 32, generator=g).to(DEVICE)
    k_view, v_view = kv[:, 0, 1:3], kv[:, 1, 1:3]
    assert not k_view.is_contiguous()
    slots = torch.randperm(40, generator=g)[:T].to(DEVICE)
    a = torch.zeros(3, 2, 10, 4, 2, 32, device=DEVICE)
    b = torch.zeros_like(a)
    be.write_kv(a[1:3], k_view, v_view, slots)
    be.write_kv(b[1:3], k_view.contiguous(), v_view.contiguous(), slots)
    assert torch.equal(a, b) and a[0].abs().sum() == 0 and a[1:].abs().sum() > 0
