"""Write the K/V of every scheduled token into the paged cache, all layers in one launch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import check_device, interpreting, next_pow2

_INTERPRETED = interpreting()  # fixed when the kernel below is defined


@triton.jit
def _write_kv_kernel(
    cache_ptr,
    k_ptr,
    v_ptr,
    slot_ptr,
    stride_cl,
    stride_ckv,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_cd,
    stride_kt,
    stride_kl,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vl,
    stride_vh,
    stride_vd,
    block_size,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    layer = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    valid = slot >= 0
    slot = tl.where(valid, slot, 0)
    blk = slot // block_size
    off = slot % block_size

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = tl.where(valid, num_heads, 0)  # a skipped slot masks every lane
    mask = (offs_h[:, None] < heads) & (offs_d[None, :] < head_dim)

    src_k = (
        k_ptr
        + t.to(tl.int64) * stride_kt
        + layer * stride_kl
        + offs_h[:, None] * stride_kh
        + offs_d[None, :] * stride_kd
    )
    src_v = (
        v_ptr
        + t.to(tl.int64) * stride_vt
        + layer * stride_vl
        + offs_h[:, None] * stride_vh
        + offs_d[None, :] * stride_vd
    )
    kk = tl.load(src_k, mask=mask, other=0.0)
    vv = tl.load(src_v, mask=mask, other=0.0)

    dst = (
        cache_ptr
        + layer.to(tl.int64) * stride_cl
        + blk * stride_cb
        + off * stride_cs
        + offs_h[:, None] * stride_ch
        + offs_d[None, :] * stride_cd
    )
    tl.store(dst, kk.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_ckv, vv.to(cache_ptr.dtype.element_ty), mask=mask)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter ``k``/``v`` into ``kv_cache`` by slot, for all layers at once.

    kv_cache: (n_layers, 2, num_blocks, block_size, kv_heads, head_dim) (may be a slice)
    k, v:     (num_tokens, n_layers, kv_heads, head_dim)
    slot_mapping: (num_tokens,) integer; slot = block_id * block_size + offset; -1 = skip.
    """
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache must be (n_layers, 2, num_blocks, block_size, kv_heads, head_dim), "
            f"got {tuple(kv_cache.shape)}"
        )
    n_layers, _, _, block_size, kv_heads, head_dim = kv_cache.shape
    num_tokens = k.shape[0]
    expect = (num_tokens, n_layers, kv_heads, head_dim)
    if tuple(k.shape) != expect or tuple(v.shape) != expect:
        raise ValueError(f"k and v must be {expect}, got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be ({num_tokens},), got {tuple(slot_mapping.shape)}")
    if num_tokens == 0 or n_layers == 0:
        return
    check_device(kv_cache, _INTERPRETED)
    _write_kv_kernel[(num_tokens, n_layers)](
        kv_cache,
        k,
        v,
        slot_mapping,
        *kv_cache.stride(),
        *k.stride(),
        *v.stride(),
        block_size,
        kv_heads,
        head_dim,
        BLOCK_H=max(2, next_pow2(kv_heads)),
        BLOCK_D=max(16, next_pow2(head_dim)),
        num_warps=1 if kv_heads * head_dim <= 256 else 4,
    )
