"""Portable attention over the paged KV cache with `scaled_dot_product_attention`.

Requests are batched by padding: each request's blocks are gathered into a dense (R, max_kv) K/V, the
queries into (R, max_q), and causal / sliding-window / padding masks are built as tensors. Single-query
requests of a mixed batch go through the decode path so one long prompt does not pad every decode.

The C kernels the engine's plan chose (kernels/plan.py: on CPU in fp32, for the model's head shape)
are handed to the constructor; without them every path below is torch. Decode with the C kernel of
kernels/cpu_decode.py reads each K/V row once straight from the cache blocks (no gathered copy, no SDPA
for 3-query problems); a bf16 cache (kv_cache_dtype) it reads as fp32, exactly. Without it, decode
gathers exactly the context slots (one
`index_select` per K and V, the indices and the mask built once per step: `DecodePlan`, kept in
`meta.backend_cache` and shared by every layer of the group), and serves GQA by viewing the query
heads of one KV head as that head's queries: (R, kv_heads, group, D) against (R, kv_heads, max_kv, D),
so K/V are never repeated. Requests are attended in chunks whose gathered K/V fit in L2
(DECODE_CHUNK_BYTES), so SDPA reads them from cache rather than memory.

KV writes with the plan's row ops copy (or round to a bf16 cache) each token's rows to its slot in one C
call (kernels/cpu_ops.py write_kv); elsewhere two index_copy_ calls. A cache of another dtype than the
queries' is cast to theirs where SDPA reads it.

Prompt rows with the C kernel of kernels/cpu_prefill.py run every request's queries in tiles that read
only the keys they see, straight from the blocks. Without it, one of two SDPA paths runs. One
padded SDPA call computes R x max_q x max_kv scores (causal without a mask tensor only when every
prompt is fresh and there is no window; otherwise under a mask, which SDPA runs slower per score).
One call per request computes only its own n x s scores, causal where that request is fresh, and
reads only the keys inside its window, but pays the per-call overhead R times. Which is faster is
decided per batch from `SdpaCost`, three SDPA timings taken once per process and head shape. Per
request tends to win for fresh prompts of different lengths and for every batch with a chunk that
continues a prompt (the padded call would mask all of them); the padded call wins for many short
prompts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from swiftkv_fast.attention.base import AttentionBackend, AttentionMetadata, ranges
from swiftkv_fast.kernels import cpu_decode, cpu_ops, cpu_prefill


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_kv: int) -> torch.Tensor:
    # cache: (num_blocks, block_size, kv_heads, head_dim) -> (R, kv_heads, max_kv, head_dim)
    block_size = cache.shape[1]
    num_blocks = -(-max_kv // block_size)
    kv = cache[block_tables[:, :num_blocks].long()]  # (R, nb, block_size, kv_heads, head_dim)
    kv = kv.flatten(1, 2)[:, :max_kv]
    return kv.transpose(1, 2)


def _gather_range(cache: torch.Tensor, block_table: torch.Tensor, first: int, end: int) -> torch.Tensor:
    # cache: (num_blocks, block_size, kv_heads, head_dim); block_table: (max_blocks,) of one request
    # -> its positions [first, end): (1, kv_heads, end - first, head_dim)
    block_size = cache.shape[1]
    lo, hi = first // block_size, -(-end // block_size)
    kv = cache[block_table[lo:hi].long()].flatten(0, 1)  # ((hi - lo) * block_size, kv_heads, head_dim)
    return kv[first - lo * block_size : end - lo * block_size].transpose(0, 1)[None]


@dataclass
class DecodePlan:
    """What a decode batch gathers from the cache; the same for every layer of a kvcache group."""

    slots: torch.Tensor  # (R * max_kv,) int64: cache slot of every context position (null block past the end)
    mask: torch.Tensor  # (R, 1, 1, max_kv) bool: the positions each request's query sees
    max_kv: int


def decode_plan(
    seq_lens: torch.Tensor, block_tables: torch.Tensor, block_size: int, window: int | None
) -> DecodePlan:
    # seq_lens: (R,) int; block_tables: (R, max_blocks) int32
    seq_lens = seq_lens.long()
    max_kv = max(1, int(seq_lens.max()))
    num_blocks = -(-max_kv // block_size)
    offsets = torch.arange(block_size, device=block_tables.device)
    slots = block_tables[:, :num_blocks].long()[:, :, None] * block_size + offsets  # (R, nb, block_size)
    kpos = torch.arange(max_kv, device=block_tables.device)
    mask = kpos[None, :] < seq_lens[:, None]  # (R, max_kv)
    if window is not None:
        mask &= kpos[None, :] > seq_lens[:, None] - 1 - window
    return DecodePlan(slots.flatten(1)[:, :max_kv].reshape(-1), mask[:, None, None], max_kv)


# K+V bytes gathered per chunk of decode requests: small enough to be attended while still in the
# core's L2 cache, instead of being written to memory by the gather and read back by SDPA
DECODE_CHUNK_BYTES = 2 << 20


def _decode_attention(q, k_cache, v_cache, plan: DecodePlan, scale):
    # q: (R, H, D); k_cache, v_cache: (num_blocks, block_size, kv_heads, D) -> (R, H, D)
    num_reqs, num_heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    k_flat, v_flat = k_cache.flatten(0, 1), v_cache.flatten(0, 1)  # (num_slots, KVH, D)
    # GQA: the `group` query heads of KV head h are h's queries: (R, KVH, group, D)
    qg = q.unflatten(1, (kv_heads, num_heads // kv_heads))
    out = torch.empty(qg.shape, dtype=q.dtype, device=q.device)
    per_req = 2 * plan.max_kv * kv_heads * head_dim * k_cache.element_size()
    chunk = max(1, DECODE_CHUNK_BYTES // per_req)
    for a in range(0, num_reqs, chunk):
        b = min(a + chunk, num_reqs)
        slots = plan.slots[a * plan.max_kv : b * plan.max_kv]
        # a cache of another dtype than the queries' (kv_cache_dtype) is read as theirs
        k = k_flat.index_select(0, slots).view(b - a, plan.max_kv, kv_heads, head_dim).to(q.dtype)
        v = v_flat.index_select(0, slots).view(b - a, plan.max_kv, kv_heads, head_dim).to(q.dtype)
        out[a:b] = F.scaled_dot_product_attention(
            qg[a:b], k.transpose(1, 2), v.transpose(1, 2), attn_mask=plan.mask[a:b], scale=scale
        )  # (b - a, KVH, group, D)
    return out.view(num_reqs, num_heads, head_dim)


def _sdpa(q, k, v, mask, scale, is_causal=False):
    # q: (R, H, Sq, D); k, v: (R, KVH, Sk, D); mask: (R, 1, Sq, Sk) bool or None. GQA without copies.
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
    )


@dataclass(frozen=True)
class SdpaCost:
    """Seconds of one SDPA call here: per_call + per_unit * heads * n^2 for a causal call over n fresh
    tokens (no mask tensor), per_call + per_masked_unit * heads * n * s for n queries against s keys
    under a mask."""

    per_call: float
    per_unit: float
    per_masked_unit: float

    def call(self, heads: int, num_queries: int, num_keys: int, causal: bool) -> float:
        scores = num_queries * num_queries if causal else num_queries * num_keys
        return self.per_call + heads * scores * (self.per_unit if causal else self.per_masked_unit)

    def per_request_is_faster(
        self, q_lens: list[int], kv_lens: list[int], heads: int, window: int | None = None
    ) -> bool:
        """One call per request (each causal where it may be, over its window's keys only) instead of
        one padded call for prompt rows of these query and context lengths."""
        fresh = window is None and q_lens == kv_lens
        max_q, max_kv = max(q_lens), max(kv_lens)
        padded = self.call(heads * len(q_lens), max_q, max_kv, causal=fresh)
        per_request = sum(
            self.call(heads, n, s - _first_key(n, s, window), _causal(n, s, window))
            for n, s in zip(q_lens, kv_lens)
        )
        return per_request < padded


def _first_key(num_queries: int, num_keys: int, window: int | None) -> int:
    """The first key position any of the last `num_queries` of `num_keys` positions sees."""
    return 0 if window is None else max(0, num_keys - num_queries - window + 1)


def _causal(num_queries: int, num_keys: int, window: int | None) -> bool:
    """A fresh prompt that no window cuts: SDPA's is_causal (top-left aligned) is its exact mask."""
    return num_queries == num_keys and (window is None or num_queries <= window)


_SDPA_COSTS: dict[tuple, SdpaCost] = {}


def sdpa_cost(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> SdpaCost:
    """Measured once per process and shape on the CPU: the best of 3 causal calls at 16 and at 256
    tokens, and of 3 masked calls at 256."""
    key = (heads, kv_heads, head_dim, dtype)
    if key not in _SDPA_COSTS:
        small, large = 16, 256

        def seconds(n: int, masked: bool = False) -> float:
            q = torch.randn(1, heads, n, head_dim).to(dtype)
            kv = torch.randn(1, kv_heads, n, head_dim).to(dtype)
            mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None] if masked else None
            best = math.inf
            for _ in range(3):
                start = time.perf_counter()
                _sdpa(q, kv, kv, mask, head_dim**-0.5, is_causal=not masked)
                best = min(best, time.perf_counter() - start)
            return best

        t_small, t_large = seconds(small), seconds(large)
        per_unit = max(0.0, (t_large - t_small) / (heads * (large**2 - small**2)))
        per_call = max(0.0, t_small - per_unit * heads * small**2)
        per_masked_unit = max(0.0, (seconds(large, masked=True) - per_call) / (heads * large**2))
        _SDPA_COSTS[key] = SdpaCost(per_call, per_unit, per_masked_unit)
    return _SDPA_COSTS[key]


class TorchBackend(AttentionBackend):
    name = "torch"
    supports_cuda_graph = False  # decode sizes its gather with int(seq_lens.max()): a host sync

    def __init__(
        self,
        decode_kernel: Callable | None = None,
        prefill_kernel: Callable | None = None,
        row_ops: SimpleNamespace | None = None,
    ):
        """The plan's C kernels (kernels/plan.py), each None for the torch path: decode_kernel and
        prefill_kernel built for the model's heads and cache dtype, row_ops for the KV writes."""
        self.decode_kernel, self.prefill_kernel, self.row_ops = decode_kernel, prefill_kernel, row_ops

    @classmethod
    def for_plan(cls, plan) -> TorchBackend:
        return cls(plan.decode_attention, plan.prefill_attention, plan.row_ops)

    def write_kv(self, kv_cache, k, v, slot_mapping):
        # kv_cache: (n_layers, 2, num_blocks, block_size, kv_heads, head_dim); k, v: (T, n_layers, kvh, hd)
        if self.row_ops is not None:
            cpu_ops.write_kv(self.row_ops, kv_cache, k, v, slot_mapping)
            return  # one C call: per-row torch calls would cost more than the copies
        n_layers, _, num_blocks, block_size = kv_cache.shape[:4]
        flat = kv_cache.view(n_layers, 2, num_blocks * block_size, *kv_cache.shape[4:])
        slot_mapping = slot_mapping.long()
        valid = slot_mapping >= 0
        if not bool(valid.all()):
            k, v, slot_mapping = k[valid], v[valid], slot_mapping[valid]
        flat[:, 0].index_copy_(1, slot_mapping, k.transpose(0, 1).to(kv_cache.dtype))
        flat[:, 1].index_copy_(1, slot_mapping, v.transpose(0, 1).to(kv_cache.dtype))

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, window, scale):
        if meta.max_query_len == 1:
            if self.decode_kernel is not None:
                return cpu_decode.decode_attention(
                    self.decode_kernel, q, k_cache, v_cache, meta.seq_lens, meta.block_tables, window, scale
                )
            # every layer of the group decodes the same requests: one plan per step and window
            key = ("decode_plan", window)
            plan = meta.backend_cache.get(key)
            if plan is None:
                plan = decode_plan(meta.seq_lens, meta.block_tables, k_cache.shape[1], window)
                meta.backend_cache[key] = plan
            return _decode_attention(q, k_cache, v_cache, plan, scale)
        cu = meta.cu_seqlens_q.long()
        q_lens = cu[1:] - cu[:-1]
        single = q_lens == 1
        if bool(single.any()):
            # NOTE: decode rows and prompt rows are served separately (no padding of decodes to max_q)
            out = torch.empty_like(q)
            dec = single.nonzero().squeeze(1)
            out[cu[dec]] = self.decode(
                q[cu[dec]], k_cache, v_cache, meta.seq_lens[dec], meta.block_tables[dec], window, scale
            )
            pre = (~single).nonzero().squeeze(1)
            tok = ranges(cu[pre], q_lens[pre])
            sub = AttentionMetadata(
                cu_seqlens_q=F.pad(q_lens[pre].cumsum(0), (1, 0)).to(torch.int32),
                seq_lens=meta.seq_lens[pre],
                block_tables=meta.block_tables[pre],
                max_query_len=meta.max_query_len,
                max_seq_len=int(meta.seq_lens[pre].max()),
            )
            out[tok] = self._prefill_prompts(q[tok], k_cache, v_cache, sub, q_lens[pre], window, scale)
            return out
        return self._prefill_prompts(q, k_cache, v_cache, meta, q_lens, window, scale)

    def _prefill_prompts(self, q, k_cache, v_cache, meta, q_lens, window, scale):
        # q: (T, H, D), the prompt rows of meta's requests (none has a single query unless all do)
        if self.prefill_kernel is not None:
            return cpu_prefill.prefill_attention(
                self.prefill_kernel,
                q,
                k_cache,
                v_cache,
                meta.cu_seqlens_q,
                meta.seq_lens,
                meta.block_tables,
                window,
                scale,
            )
        if q.is_cpu:
            lens, kv_lens = q_lens.tolist(), meta.seq_lens.tolist()
            cost = sdpa_cost(q.shape[1], k_cache.shape[2], q.shape[2], q.dtype)
            if cost.per_request_is_faster(lens, kv_lens, q.shape[1], window):
                return self._prefill_per_request(q, k_cache, v_cache, meta, lens, kv_lens, window, scale)
        return self._prefill_padded(q, k_cache, v_cache, meta, q_lens, window, scale)

    def _prefill_padded(self, q, k_cache, v_cache, meta, q_lens, window, scale):
        # q: (T, H, D)
        num_reqs, max_q, max_kv = q_lens.shape[0], meta.max_query_len, meta.max_seq_len
        seq_lens = meta.seq_lens.long()
        cu = meta.cu_seqlens_q.long()
        fresh = window is None and bool((seq_lens == q_lens).all())
        no_padding = q.shape[0] == num_reqs * max_q  # every request has max_q queries: a plain view
        if no_padding:
            qpad = q.unflatten(0, (num_reqs, max_q))
        else:
            req_of_tok = torch.repeat_interleave(torch.arange(num_reqs, device=q.device), q_lens)  # (T,)
            j_of_tok = torch.arange(q.shape[0], device=q.device) - cu[req_of_tok]  # (T,)
            qpad = q.new_zeros(num_reqs, max_q, *q.shape[1:])
            qpad[req_of_tok, j_of_tok] = q
        k = _gather_kv(k_cache, meta.block_tables, max_kv).to(q.dtype)  # (R, KVH, max_kv, D)
        v = _gather_kv(v_cache, meta.block_tables, max_kv).to(q.dtype)
        if fresh:
            # fresh prompts: top-left causal alignment is the right one, no mask tensor needed
            out = _sdpa(qpad.transpose(1, 2), k, v, None, scale, is_causal=True)
        else:
            start = (seq_lens - q_lens)[:, None]  # (R, 1)
            qpos = torch.minimum(start + torch.arange(max_q, device=q.device), seq_lens[:, None] - 1)
            kpos = torch.arange(max_kv, device=q.device)
            mask = kpos[None, None, :] <= qpos[:, :, None]  # (R, max_q, max_kv)
            if window is not None:
                mask &= kpos[None, None, :] > qpos[:, :, None] - window
            out = _sdpa(qpad.transpose(1, 2), k, v, mask[:, None], scale)
        out = out.transpose(1, 2)  # (R, max_q, H, D)
        if no_padding:
            return out.reshape(q.shape)
        return out[req_of_tok, j_of_tok]  # (T, H, D)

    def _prefill_per_request(self, q, k_cache, v_cache, meta, lens, kv_lens, window, scale):
        # q: (T, H, D): request r's lens[r] queries, the last of its kv_lens[r] positions, one after
        # the other; one SDPA call each, over the keys its window reaches
        out = torch.empty_like(q)
        start = 0
        for r, (n, s) in enumerate(zip(lens, kv_lens)):
            first = _first_key(n, s, window)
            k = _gather_range(k_cache, meta.block_tables[r], first, s).to(q.dtype)  # (1, KVH, s - first, D)
            v = _gather_range(v_cache, meta.block_tables[r], first, s).to(q.dtype)
            qr = q[start : start + n].transpose(0, 1)[None]  # (1, H, n, D)
            if _causal(n, s, window):
                o = _sdpa(qr, k, v, None, scale, is_causal=True)
            else:
                qpos = torch.arange(s - n, s, device=q.device)[:, None]  # (n, 1)
                kpos = torch.arange(first, s, device=q.device)[None, :]  # (1, s - first)
                mask = kpos <= qpos
                if window is not None:
                    mask &= kpos > qpos - window
                o = _sdpa(qr, k, v, mask[None, None], scale)
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        return out

    def decode(self, q, k_cache, v_cache, seq_lens, block_tables, window, scale):
        # q: (R, H, D)
        if self.decode_kernel is not None:
            return cpu_decode.decode_attention(
                self.decode_kernel, q, k_cache, v_cache, seq_lens, block_tables, window, scale
            )
        plan = decode_plan(seq_lens, block_tables, k_cache.shape[1], window)
        return _decode_attention(q, k_cache, v_cache, plan, scale)
