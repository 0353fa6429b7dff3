"""The SwiftKV Llama-family model over a paged KV cache, with early exit.

    layers < L   : every scheduled token; fused qkv, RoPE, K/V written to the cache, varlen attention
    s = norm_swiftkv(h_L); one fused projection -> K/V of every cache layer >= L, RoPE on K, written
    layers >= L  : only the sampled tokens (one per request: decode-shaped attention), own q_proj_swiftkv
    final norm + lm_head on the sampled tokens only
`first_half` runs everything up to the early exit (K/V of all layers written); `second_half` is a
function of static-shaped inputs only (hidden, positions, seq_lens, one block table per kvcache
group), which is what a CUDA graph captures (worker/cuda_graph.py). L == N is the plain model
(the second half is then the final norm and lm_head). Weights are fused at load (model/loader.py):
qkv, gate_up, and the k/v_proj_swiftkv of all group leaders in one matrix. Cache layer c lives in
physical KV slot `self.kv_slot[c]` of the engine's tensor (model/kv_cache_layout.py: the i-th cache
layer of each kvcache group is slot i; a hybrid model's groups share slots, never block ids).
On CPU, a half's layers over decode rows run as one C call where it applies (`self.stacks`,
model/decode_stack.py), with the same result as the op-by-op loop below.

Under tensor parallelism (model/tp_sharding.py) the weights are one rank's shard: `num_heads` and
`num_kv_heads` are the rank's, o_proj and down_proj outputs are summed over the ranks (`tp.all_reduce`),
the embedding is looked up in the rank's vocab rows and summed, and lm_head's vocab columns are
gathered, so every rank ends with the same hidden states and logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swiftkv_fast.attention.base import AttentionBackend
from swiftkv_fast.distributed.parallel_state import SINGLE, TensorParallelGroup
from swiftkv_fast.model.decode_stack import DecodeStack
from swiftkv_fast.model.kv_cache_layout import KVCacheLayout
from swiftkv_fast.model.layers import Linear, RotaryTable, Rotation
from swiftkv_fast.model.model_input import GroupBatch, ModelInput

# the residual stream's dtype whatever the weights' (each layer adds its outputs to it; its norms read
# it whole and round once): what first_half returns and second_half takes
RESIDUAL_DTYPE = torch.float32


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    post_norm: torch.Tensor  # (hidden,)
    qkv: Linear  # hidden -> q + 2 kv for layers < L; hidden -> q (q_proj_swiftkv) for layers >= L
    o: Linear  # q -> hidden
    gate_up: Linear  # hidden -> 2 * intermediate
    down: Linear  # intermediate -> hidden
    window: int | None
    cache_layer: int
    group: int  # kvcache group (attention type) of its cache layer


@dataclass
class ModelWeights:
    embed: torch.Tensor  # (vocab, hidden): the rank's vocab rows under tensor parallelism
    norm: torch.Tensor  # (hidden,)
    lm_head: Linear  # hidden -> vocab (tied: over the embedding's storage where its kernel allows)
    layers: list[LayerWeights]
    rope_inv_freq: torch.Tensor  # (head_dim // 2,) fp32: the RoPE frequencies (llama3 scaling applied)
    norm_swiftkv: torch.Tensor | None = None  # (hidden,)
    kv_swiftkv: Linear | None = None  # hidden -> 2 * n_leaders * kv_heads * head_dim: [K of all; V of all]


class SwiftKVModel:
    def __init__(
        self,
        weights: ModelWeights,
        *,
        num_key_value_layers: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        rotary: RotaryTable,
        layout: KVCacheLayout,
        backend: AttentionBackend,
        tp: TensorParallelGroup = SINGLE,
        vocab_start: int = 0,
        stack_kernel=None,
    ):
        """`stack_kernel`: the decode stack's C kernel the plan chose (kernels/cpu_decode_stack.py
        `kernel`), None where each half runs op by op."""
        self.w = weights
        self.tp, self.vocab_start = tp, vocab_start
        self.L = num_key_value_layers
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps = eps
        self.rotary = rotary
        self.backend = backend
        self.scale = head_dim**-0.5
        self.kv_slot = layout.kv_slot  # physical KV slot of every cache layer
        # runs [a, b) of second-half cache layers in one group whose slots are consecutive too:
        # one write_kv each, on the plain slice kv_cache[kv_slot[a] : kv_slot[a] + b - a]
        self.swiftkv_write_runs = layout.slot_runs(self.L)
        # each half's layers over decode rows as one C call where the plan chose it (model/decode_stack.py)
        self.stacks: tuple[DecodeStack | None, DecodeStack | None] = (None, None)
        if stack_kernel is not None:
            shape = dict(
                kernel=stack_kernel,
                kv_slot=self.kv_slot,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                eps=eps,
                scale=self.scale,
                rotary=rotary,
                kv_dtype=layout.dtype,
            )
            self.stacks = (
                DecodeStack(weights.layers[: self.L], writes_kv=True, **shape),
                DecodeStack(weights.layers[self.L :], writes_kv=False, **shape),
            )

    def _layer_tail(self, h: torch.Tensor, attn: torch.Tensor, lw: LayerWeights) -> torch.Tensor:
        """o_proj and the MLP of a layer after its attention output attn (T, heads * head_dim): o_proj's
        residual is added to h (in place); the MLP's output is returned, for the next add_rms_norm."""
        gate_up = lw.gate_up.after_norm(h, self.tp.all_reduce(lw.o(attn)), lw.post_norm, self.eps)
        return self.tp.all_reduce(lw.down.after_silu_and_mul(gate_up))

    def _first_half_layer(
        self,
        h: torch.Tensor,
        mlp_out: torch.Tensor | None,
        lw: LayerWeights,
        grp: GroupBatch,
        rope: Rotation,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """One layer < L over every scheduled token, one op at a time: h += mlp_out (the previous layer's
        MLP output) in place; returns this layer's MLP output."""
        nh, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = lw.qkv.after_norm(h, mlp_out, lw.input_norm, self.eps)  # (T, (nh + 2 kvh) hd)
        # RoPE on q and k in one pass, in place: (T, nh + kvh, hd)
        qk = rope.apply_(qkv[:, : (nh + kvh) * hd].view(-1, nh + kvh, hd))
        q, k = qk[:, :nh], qk[:, nh:]
        v = qkv[:, (nh + kvh) * hd :]
        p = self.kv_slot[lw.cache_layer]
        self.backend.write_kv(kv_cache[p : p + 1], k[:, None], v.view(-1, 1, kvh, hd), grp.slot_mapping)
        o = self.backend.prefill(q, kv_cache[p, 0], kv_cache[p, 1], grp.meta, lw.window, self.scale)
        return self._layer_tail(h, o.flatten(1), lw)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        # (T,) -> (T, hidden) in RESIDUAL_DTYPE. A rank looks up the ids of its vocab rows, zeros
        # elsewhere, then the sum.
        if self.tp.size == 1:
            return F.embedding(input_ids, self.w.embed).to(RESIDUAL_DTYPE)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.w.embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.w.embed).to(RESIDUAL_DTYPE)
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0))

    @torch.inference_mode()
    def first_half(self, inp: ModelInput, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """Layers < L over every scheduled token, then the K/V of every cache layer >= L written for
        every scheduled token. kv_cache: (num_kv_slots, 2, num_blocks, block_size, kv_heads,
        head_dim), cache layer c at slot kv_slot[c]. Returns the hidden states (S, hidden) of the
        sampled tokens, None if there are none."""
        kvh, hd = self.num_kv_heads, self.head_dim
        h = self._embed(inp.input_ids)  # (T, hidden)
        rope = self.rotary.at(inp.positions)
        mlp_out = None  # the previous layer's MLP output: the next norm adds it to h
        stack = self.stacks[0]
        decode_only = all(g.meta.max_query_len == 1 for g in inp.groups)
        if stack is not None and decode_only and stack.applies(h, kv_cache):
            stack.run(
                h,
                inp.positions,
                [g.meta.seq_lens for g in inp.groups],
                [g.meta.block_tables for g in inp.groups],
                [g.slot_mapping for g in inp.groups],
                kv_cache,
            )
        else:
            for lw in self.w.layers[: self.L]:
                mlp_out = self._first_half_layer(h, mlp_out, lw, inp.groups[lw.group], rope, kv_cache)
        if mlp_out is not None:
            h = h.add_(mlp_out)
        if self.w.kv_swiftkv is not None:
            kv = self.w.kv_swiftkv.after_norm(h, None, self.w.norm_swiftkv, self.eps)
            kv = kv.view(h.shape[0], 2, -1, kvh, hd)
            n_sk = kv.shape[2]  # (T, 2, n_swiftkv_cache_layers, kvh, hd)
            rope.apply_(kv[:, 0].view(-1, n_sk * kvh, hd))
            k, v = kv[:, 0], kv[:, 1]
            for a, b, g in self.swiftkv_write_runs:
                p = self.kv_slot[a]
                self.backend.write_kv(
                    kv_cache[p : p + b - a],
                    k[:, a - self.L : b - self.L],
                    v[:, a - self.L : b - self.L],
                    inp.groups[g].slot_mapping,
                )
        if inp.logits_indices.numel() == 0:
            return None
        return h[inp.logits_indices]  # (S, hidden): early exit for every other token

    @torch.inference_mode()
    def second_half(
        self,
        h: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: tuple[torch.Tensor, ...],
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Layers >= L, the final norm and lm_head for one query per request: h (S, hidden) of the
        sampled tokens, positions (S,) int64, seq_lens (S,) int32 (the query sits at seq_lens - 1),
        block_tables one (S, max_blocks) int32 per kvcache group. Returns fp32 logits (S, vocab).
        Capturable in a CUDA graph with a capturable backend: no host syncs, row-wise only, and the
        input ``h`` is not modified."""
        nh, hd = self.num_heads, self.head_dim
        rope = self.rotary.at(positions)
        h = h.clone()  # the residual stream is updated in place; the caller's input stays as it was
        mlp_out = None
        stack = self.stacks[1]
        if stack is not None and stack.applies(h, kv_cache):
            stack.run(h, positions, [seq_lens] * len(block_tables), block_tables, None, kv_cache)
            return self.tp.all_gather(self.w.lm_head.after_norm(h, None, self.w.norm, self.eps).float())
        for lw in self.w.layers[self.L :]:
            q = rope.apply_(lw.qkv.after_norm(h, mlp_out, lw.input_norm, self.eps).view(-1, nh, hd))
            p = self.kv_slot[lw.cache_layer]
            o = self.backend.decode(
                q,
                kv_cache[p, 0],
                kv_cache[p, 1],
                seq_lens,
                block_tables[lw.group],
                lw.window,
                self.scale,
            )
            mlp_out = self._layer_tail(h, o.flatten(1), lw)
        return self.tp.all_gather(self.w.lm_head.after_norm(h, mlp_out, self.w.norm, self.eps).float())
