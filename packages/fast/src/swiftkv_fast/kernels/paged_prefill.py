"""Paged varlen prefill attention: causal, sliding window, GQA, over block tables.

Query ``j`` of request ``r`` sits at position ``seq_lens[r] - q_len[r] + j`` and
sees keys at positions ``p`` with ``p <= pos`` and, with a window ``W``,
``p > pos - W``. Online softmax in fp32; inputs fp16/bf16/fp32, converted to
fp32 right after loading (the interpreter's bf16 arithmetic is wrong, and it
keeps the GPU and interpreter paths the same).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_cache, check_device, dot_precision, interpreting, next_pow2

_INTERPRETED = interpreting()  # fixed when the kernels below are defined

_LOG2E = 1.4426950408889634


@triton.jit
def _paged_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    cu_q_ptr,
    seq_lens_ptr,
    bt_ptr,
    stride_qt,
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
    stride_ot,
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
    HAS_WINDOW: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    r = tl.program_id(1)
    h = tl.program_id(2)
    kvh = h // q_per_kv

    q_start = tl.load(cu_q_ptr + r)
    q_len = tl.load(cu_q_ptr + r + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + r)
    m_start = pid_m * BLOCK_M
    first_pos = seq_len - q_len + m_start

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    row_valid = (m_start + offs_m) < q_len
    pos = first_pos + offs_m

    q_rows = (q_start + m_start + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)

    # Keys this tile can see: [lo, hi). Keys before lo are outside every row's
    # window, so their blocks are never touched.
    hi = tl.minimum(first_pos + BLOCK_M, seq_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)
    hi = tl.where(m_start < q_len, hi, lo)  # empty tile: no iterations

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    bt_row = bt_ptr + r.to(tl.int64) * stride_btr
    start_al = (lo // BLOCK_N) * BLOCK_N
    for start in range(start_al, hi, BLOCK_N):
        n = start + offs_n
        kv_mask = (n >= lo) & (n < hi)
        blk_idx = n // page_size
        bid = tl.load(bt_row + blk_idx * stride_btb, mask=kv_mask & (blk_idx < max_blocks), other=0)
        in_blk = n % page_size
        k_base = bid.to(tl.int64) * stride_kb + in_blk * stride_ks + kvh * stride_kh
        v_base = bid.to(tl.int64) * stride_vb + in_blk * stride_vs + kvh * stride_vh
        ld_mask = kv_mask[None, :] & d_mask[:, None]
        kt = tl.load(k_ptr + k_base[None, :] + offs_d[:, None] * stride_kd, mask=ld_mask, other=0.0)
        kt = kt.to(tl.float32)  # (BLOCK_D, BLOCK_N)
        vv = tl.load(
            v_ptr + v_base[:, None] + offs_d[None, :] * stride_vd,
            mask=kv_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        vv = vv.to(tl.float32)  # (BLOCK_N, BLOCK_D)

        s = tl.dot(q, kt, input_precision=DOT_PRECISION) * scale_log2
        mask = kv_mask[None, :] & (n[None, :] <= pos[:, None]) & row_valid[:, None]
        if HAS_WINDOW:
            mask = mask & (n[None, :] > pos[:, None] - window)
        s = tl.where(mask, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, vv, input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    tl.store(
        o_ptr + q_rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :] * stride_od,
        out.to(o_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    max_query_len: int,
    window: int | None,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Varlen causal attention of ``q`` over the paged cache.

    q: (num_tokens, num_heads, head_dim); k_cache/v_cache: (num_blocks, block_size, kv_heads, head_dim);
    cu_seqlens_q: (num_reqs + 1,) int32; seq_lens: (num_reqs,) int32 (context after this step);
    block_tables: (num_reqs, max_blocks) int32. Returns (num_tokens, num_heads, head_dim) in q's dtype.
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, kv_heads = check_cache(k_cache, v_cache, num_heads, head_dim)
    num_reqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_reqs == 0 or max_query_len <= 0:
        return out
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    check_device(q, _INTERPRETED)
    if _INTERPRETED:
        block_m, block_n, warps, stages = 16, 16, 1, 1
    else:
        block_m, block_n = 64, (64 if head_dim <= 64 else 32)
        warps, stages = (4 if head_dim <= 64 else 8), 2
    block_d = max(16, next_pow2(head_dim))
    grid = (triton.cdiv(int(max_query_len), block_m), num_reqs, num_heads)
    _paged_prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        cu_seqlens_q,
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
        num_heads // kv_heads,
        HAS_WINDOW=window is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=warps,
        num_stages=stages,
    )
    return out


__all__ = ["paged_prefill"]
