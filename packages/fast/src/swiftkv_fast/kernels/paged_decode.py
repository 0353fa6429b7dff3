"""Paged decode attention: one query per request, split over long contexts.

Request ``r``'s query sits at position ``seq_lens[r] - 1``; with a window
``W`` it sees keys ``[seq_lens[r] - W, seq_lens[r])`` and the kernel only
walks those: blocks entirely outside the window are never read (they may be
the null block). The visible range is cut into ``num_splits`` chunks
(flash-decoding); each program handles one (request, KV head, chunk) with all
the query heads of that KV head packed into one tile, and a second kernel
merges the chunks by their log-sum-exp. Requests with ``seq_lens == 0`` (the
padding rows of a captured CUDA graph) produce zeros.

The launch configuration depends only on tensor shapes (never on tensor
values), so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_cache, check_device, dot_precision, interpreting, next_pow2

_INTERPRETED = interpreting()  # fixed when the kernels below are defined

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    part_o_ptr,
    part_lse_ptr,
    seq_lens_ptr,
    bt_ptr,
    stride_qr,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_or,
    stride_oh,
    stride_od,
    stride_btr,
    stride_btb,
    scale_log2,
    window,
    max_blocks,
    page_size,
    head_dim,
    q_per_kv,
    num_heads,
    HAS_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + r)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)
    span = tl.maximum(seq_len - lo, 0)
    chunk = tl.cdiv(tl.cdiv(span, NUM_SPLITS), BLOCK_N) * BLOCK_N
    s_lo = lo + split * chunk
    s_hi = tl.minimum(s_lo + chunk, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    h_mask = offs_h < q_per_kv
    heads = kvh * q_per_kv + offs_h

    q = tl.load(
        q_ptr + r.to(tl.int64) * stride_qr + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    bt_row = bt_ptr + r.to(tl.int64) * stride_btr
    for start in range(s_lo, s_hi, BLOCK_N):
        n = start + offs_n
        kv_mask = n < s_hi
        blk_idx = n // page_size
        bid = tl.load(bt_row + blk_idx * stride_btb, mask=kv_mask & (blk_idx < max_blocks), other=0)
        in_blk = n % page_size
        k_base = bid.to(tl.int64) * stride_kb + in_blk * stride_ks + kvh * stride_kh
        v_base = bid.to(tl.int64) * stride_vb + in_blk * stride_vs + kvh * stride_vh
        kt = tl.load(
            k_ptr + k_base[None, :] + offs_d[:, None] * stride_kd,
            mask=kv_mask[None, :] & d_mask[:, None],
            other=0.0,
        ).to(tl.float32)
        vv = tl.load(
            v_ptr + v_base[:, None] + offs_d[None, :] * stride_vd,
            mask=kv_mask[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)

        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(kv_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, vv, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    st_mask = h_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        o_rows = o_ptr + r.to(tl.int64) * stride_or + heads * stride_oh
        tl.store(o_rows[:, None] + offs_d[None, :] * stride_od, out.to(o_ptr.dtype.element_ty), mask=st_mask)
    else:
        # part_o: (num_reqs, num_heads, NUM_SPLITS, head_dim); part_lse: (num_reqs, num_heads, NUM_SPLITS)
        row = (r.to(tl.int64) * num_heads + heads) * NUM_SPLITS + split
        lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=h_mask)
        tl.store(part_o_ptr + row[:, None] * head_dim + offs_d[None, :], out, mask=st_mask)


@triton.jit
def _reduce_splits_kernel(
    o_ptr,
    part_o_ptr,
    part_lse_ptr,
    stride_or,
    stride_oh,
    stride_od,
    num_heads,
    head_dim,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < head_dim
    row = (r.to(tl.int64) * num_heads + h) * NUM_SPLITS + offs_s
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.where(s_mask & (lse > float("-inf")), tl.exp2(lse - m), 0.0)
    po = tl.load(
        part_o_ptr + row[:, None] * head_dim + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    po = tl.where(w[:, None] > 0, po, 0.0)
    total = tl.sum(w, 0)
    out = tl.sum(po * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        o_ptr + r.to(tl.int64) * stride_or + h * stride_oh + offs_d * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=d_mask,
    )


def default_num_splits(num_reqs: int, kv_heads: int, max_context: int, block_n: int) -> int:
    """Splits per request from shapes only: enough programs to fill a GPU, >= ~256 keys per split."""
    by_len = max(1, triton.cdiv(max_context, max(256, block_n)))
    by_occupancy = max(1, triton.cdiv(264, max(1, num_reqs * kv_heads)))  # ~2 waves on 132 SMs
    return int(min(by_len, by_occupancy, 32))


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    window: int | None,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per request over the paged cache.

    q: (num_reqs, num_heads, head_dim); k_cache/v_cache: (num_blocks, block_size, kv_heads, head_dim);
    seq_lens: (num_reqs,) int32, query at position seq_lens[r] - 1 (0 = padding row, output zeros);
    block_tables: (num_reqs, max_blocks) int32. ``num_splits=None`` picks a count from shapes only.
    """
    num_reqs, num_heads, head_dim = q.shape
    block_size, kv_heads = check_cache(k_cache, v_cache, num_heads, head_dim)
    if out is None:
        out = torch.empty_like(q)
    if num_reqs == 0:
        return out
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    q_per_kv = num_heads // kv_heads
    check_device(q, _INTERPRETED)
    if _INTERPRETED:
        block_n, warps, stages = 16, 1, 1
    else:
        block_n, warps, stages = (64 if head_dim <= 128 else 32), 4, 2
    max_context = block_tables.shape[1] * block_size
    if window is not None:
        max_context = min(max_context, int(window))
    if num_splits is None:
        num_splits = default_num_splits(num_reqs, kv_heads, max_context, block_n)
    num_splits = max(1, int(num_splits))
    block_d = max(16, next_pow2(head_dim))
    if num_splits > 1:
        f32 = dict(dtype=torch.float32, device=q.device)
        part_o = torch.empty((num_reqs, num_heads, num_splits, head_dim), **f32)
        part_lse = torch.empty((num_reqs, num_heads, num_splits), **f32)
    else:
        part_o = part_lse = out  # unused
    _paged_decode_kernel[(num_reqs, kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_o,
        part_lse,
        seq_lens,
        block_tables,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        *out.stride(),
        *block_tables.stride(),
        float(scale) * _LOG2E,
        int(window) if window is not None else 0,
        block_tables.shape[1],
        block_size,
        head_dim,
        q_per_kv,
        num_heads,
        HAS_WINDOW=window is not None,
        NUM_SPLITS=num_splits,
        BLOCK_H=max(16, next_pow2(q_per_kv)),
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_reqs, num_heads)](
            out,
            part_o,
            part_lse,
            *out.stride(),
            num_heads,
            head_dim,
            NUM_SPLITS=num_splits,
            BLOCK_S=max(2, next_pow2(num_splits)),
            BLOCK_D=block_d,
            num_warps=1 if _INTERPRETED else 4,
        )
    return out
