"""The differentiable dense training forward over a batch of right-padded sequences.

The reference's `forward` is per-token and no-grad; this is the same math (swiftkv_reference.model,
anchors/swiftkv-facts.md §1.3) over a (B, T) batch with torch SDPA, built from the reference model's
own modules (RMSNorm, q/k/v/o projections, MLP, lm_weight) and helpers (RoPE, the attention mask), so
gradients flow to every parameter that requires them:

    swiftkv=False  the teacher: every layer projects its own Q/K/V;
    swiftkv=True   layers i >= L take K/V = (k|v)_proj_swiftkv[g](norm_swiftkv(h_L)) of their group
                   leader g and Q from q_proj_swiftkv[i].

In training every token runs every layer (the early exit is an inference saving; the loss needs the
logits of every scored position). Position t of every row is token position t; right padding is exact
for the real tokens (causal attention never lets a real token see a pad), and the pads' own outputs
are finite garbage to be masked by the caller.

    out = training_forward(model, batch.input_ids, swiftkv=True, logits_mask=batch.logits_mask)
    out.logits   # (P, vocab) fp32 at the True positions of logits_mask, row-major
    out.hidden   # (B, T, hidden): the residual stream entering the final norm
    out = training_forward(teacher, ids, swiftkv=False, compute_logits=False, capture_from=L)
    out.residual # (B, T, hidden): h_L, the residual stream entering layer L
    out.kv[i]    # (pre-RoPE K, V) of layer i >= L, each (B, T, num_kv_heads * head_dim)
    out = training_forward(teacher, ids, swiftkv=False, keep_states=(L,))
    out.states[L]  # (B, T, hidden): h_L
    student = training_forward(model, ids, swiftkv=True, start=(L, out.states[L]))  # skips layers < L

`start` saves the first half of a SwiftKV forward whose layers < L are the teacher's (distillation:
one model, two paths): it begins at layer l from a given h_l, which must be what layers < l produce.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from swiftkv_reference.attention import attention_mask
from swiftkv_reference.model import Attention, SwiftKVForCausalLM
from swiftkv_reference.rope import apply_rope, rope_cos_sin


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # (B, T, hidden): the residual stream entering the final norm
    logits: torch.Tensor | None = None  # fp32 (B, T, vocab), or (P, vocab) at logits_mask
    residual: torch.Tensor | None = None  # (B, T, hidden): the stream entering layer capture_from
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None  # layer -> pre-RoPE (K, V)
    states: dict[int, torch.Tensor] | None = None  # layer i -> (B, T, hidden): h_i, for keep_states


# hook(i, h, probs, attn): layer i >= capture_from; h (B, T, hidden) the stream entering it, probs
# (B, heads, T, T) its attention probabilities, attn (B, T, heads * head_dim) its output before o_proj
AttentionHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]


def training_forward(
    model: SwiftKVForCausalLM,
    input_ids: torch.Tensor,
    *,
    swiftkv: bool,
    logits_mask: torch.Tensor | None = None,
    compute_logits: bool = True,
    capture_from: int | None = None,
    keep_states: Collection[int] = (),
    start: tuple[int, torch.Tensor] | None = None,
    attention_hook: AttentionHook | None = None,
    scored_only: bool = False,
    lm_weight: torch.Tensor | None = None,
    fp32_logits: bool = True,
) -> ForwardOutput:
    """Run `model` densely over input_ids (B, T) from position 0 (see the module docstring).

    logits_mask: (B, T) bool; the logits of only its True positions are computed ((P, vocab), in
        row-major order); None computes all of them ((B, T, vocab)). compute_logits=False skips the
        final norm's projection (calibration needs only K/V).
    capture_from: a layer index c; the output then holds `residual` (h_c) and `kv[i]` for i >= c: the
        pre-RoPE K and V that layer i attended with (on the SwiftKV path the members of an AcrossKV
        group hold the same tensors, their leader's).
    keep_states: layer indices i; out.states[i] is h_i, the residual stream entering layer i.
    start: (l, h_l), h_l (B, T, hidden): begin at layer l from h_l instead of the embeddings; layers
        < l are skipped (l must not exceed L on the SwiftKV path, nor capture_from or keep_states).
    attention_hook: called as hook(i, h, probs, attn) for every layer i >= capture_from, in order
        (see AttentionHook; calibration takes its statistics there). Those layers then compute
        attention explicitly (a (B, heads, T, T) temporary) instead of with SDPA.
    scored_only: the SwiftKV path's saving, in training: layers >= L run only the True positions of
        logits_mask (the only ones the logits need: every token's K/V there comes from h_L). out.hidden
        and out.states[i] for i > L are then (P, hidden) at those positions, row-major (out.logits'
        rows); the result equals the full forward's at those positions up to float reassociation.
    lm_weight: the output projection (None: model.lm_weight()), for final_logits.
    fp32_logits: False leaves the logits in the dtype the projection gives (bf16 under autocast), for a
        consumer that upcasts a few rows at a time (distill_loss).
    """
    cfg = model.config
    n = cfg.num_hidden_layers
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, num_tokens), got shape {tuple(input_ids.shape)}")
    if swiftkv and not cfg.is_swiftkv:
        raise ValueError(f"swiftkv=True needs a SwiftKV model (L < N); this one has L = N = {n}")
    if logits_mask is not None and logits_mask.shape != input_ids.shape:
        raise ValueError(
            f"logits_mask shape {tuple(logits_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    if capture_from is not None and not 0 <= capture_from < n:
        raise ValueError(f"capture_from must be in [0, {n}), got {capture_from}")
    batch, num_tokens = input_ids.shape
    big_l = cfg.num_key_value_layers if swiftkv else n
    first = 0 if start is None else start[0]
    if not 0 <= first <= min(big_l, n - 1):
        raise ValueError(f"start layer must be in [0, {min(big_l, n - 1)}], got {first}")
    if start is not None and tuple(start[1].shape) != (batch, num_tokens, cfg.hidden_size):
        raise ValueError(
            f"start state must be {(batch, num_tokens, cfg.hidden_size)}, got {tuple(start[1].shape)}"
        )
    below = [i for i in (*keep_states, *([] if capture_from is None else [capture_from])) if i < first]
    if attention_hook is not None and capture_from is None:
        raise ValueError("attention_hook needs capture_from")
    bad = [i for i in keep_states if not 0 <= i < n]
    if below or bad:
        raise ValueError(f"keep_states / capture_from {sorted(below + bad)} not in [{first}, {n})")
    if scored_only and (not swiftkv or logits_mask is None or capture_from is not None):
        raise ValueError("scored_only needs the SwiftKV path, a logits_mask and no capture_from")
    layers = model.model.layers
    positions = torch.arange(num_tokens, device=input_ids.device)
    cos_t, sin_t = rope_cos_sin(model.inv_freq.to(input_ids.device), positions)  # (T, head_dim)
    cos, sin = cos_t.repeat(batch, 1), sin_t.repeat(batch, 1)  # (B*T, head_dim), row-major over (B, T)
    masks = {
        w: attention_mask(positions, positions, w) for w in {cfg.window(i) for i in range(n)}
    }  # window -> (T, T) bool, True where a query may see a key

    residual, captured = None, ({} if capture_from is not None else None)
    states = {}
    h = model.model.embed_tokens(input_ids) if start is None else start[1]  # (B, T, hidden)
    shared: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # SwiftKV leader -> pre-RoPE (K, V)
    query_pos, valid = None, None  # scored_only, from layer L: (B, Q) positions h holds, and which are real
    q_cos, q_sin = cos, sin
    for i in range(first, n):
        if i == capture_from:
            residual = h
        if i in keep_states:
            states[i] = h if valid is None else h[valid]
        if i == big_l:
            s = model.model.norm_swiftkv(h).reshape(batch * num_tokens, -1)  # (B*T, hidden)
            for g in range(big_l, n, cfg.key_value_group_size):
                shared[g] = _project_kv(layers[g].self_attn, s, swiftkv=True)
            if scored_only:
                query_pos, valid = _scored_positions(logits_mask)  # (B, Q) each
                h = h.gather(1, query_pos[..., None].expand(-1, -1, h.shape[-1]))  # (B, Q, hidden)
                q_cos, q_sin = cos_t[query_pos.flatten()], sin_t[query_pos.flatten()]  # (B*Q, head_dim)
        layer = layers[i]
        num_queries = h.shape[1]
        x = layer.input_layernorm(h).reshape(batch * num_queries, -1)  # (B*Q, hidden)
        own = i < big_l
        k, v = _project_kv(layer.self_attn, x, swiftkv=False) if own else shared[cfg.group_leader(i)]
        if captured is not None and i >= capture_from:
            captured[i] = (k.view(batch, num_tokens, -1), v.view(batch, num_tokens, -1))
        q = layer.self_attn.project_q(x, q_cos, q_sin, swiftkv=not own)  # (B*Q, heads, head_dim)
        k = apply_rope(k.view(batch * num_tokens, -1, cfg.head_dim), cos, sin)
        mask = masks[cfg.window(i)]  # (T, T)
        if valid is not None:
            mask = mask[query_pos][:, None]  # (B, 1, Q, T)
        if attention_hook is not None and i >= capture_from:
            attn, probs = _attention_with_probs(q, k, v, batch, mask, model.scale)
            attention_hook(i, h, probs, attn)
        else:
            attn = _sdpa(q, k, v, batch, mask, model.scale)  # (B, Q, heads * head_dim)
        h = h + layer.self_attn.o_proj(attn)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    if valid is not None:
        h = h[valid]  # (P, hidden)
    logits = None
    if compute_logits:
        rows = h if logits_mask is None or valid is not None else h[logits_mask]  # (B, T | P, hidden)
        logits = final_logits(model, rows, lm_weight, fp32=fp32_logits)
    return ForwardOutput(hidden=h, logits=logits, residual=residual, kv=captured, states=states)


def _scored_positions(logits_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits_mask (B, T) bool -> (positions, valid), each (B, Q), Q the most True positions of a row:
    row b's True positions in ascending order, then padding (position T - 1, valid False).

        _scored_positions(tensor([[0, 1, 1, 0], [1, 0, 0, 0]]).bool())
        # positions [[1, 2], [0, 3]], valid [[True, True], [True, False]]
    """
    num_tokens = logits_mask.shape[1]
    index = torch.arange(num_tokens, device=logits_mask.device).expand_as(logits_mask)
    keyed = torch.where(logits_mask, index, num_tokens)  # the unscored positions sort last
    num_queries = max(int(logits_mask.sum(1).max()), 1)
    positions = keyed.sort(dim=1).values[:, :num_queries]  # (B, Q)
    valid = positions < num_tokens
    return positions.clamp(max=num_tokens - 1), valid


def final_logits(
    model: SwiftKVForCausalLM, h: torch.Tensor, weight: torch.Tensor | None = None, fp32: bool = True
) -> torch.Tensor:
    """Logits (..., vocab) of h (..., hidden), the residual stream entering the final norm, in fp32
    (fp32=False: in the dtype of the projection's output, bf16 under autocast); weight: the output
    projection (vocab, hidden) (None: model.lm_weight(), e.g. a bf16 copy of it)."""
    logits = F.linear(model.model.norm(h), model.lm_weight() if weight is None else weight)
    return logits.float() if fp32 else logits


def _project_kv(attn: Attention, x: torch.Tensor, swiftkv: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x: (num_rows, hidden) -> pre-RoPE K, V: (num_rows, num_kv_heads * head_dim)."""
    if swiftkv:
        return attn.k_proj_swiftkv(x), attn.v_proj_swiftkv(x)
    return attn.k_proj(x), attn.v_proj(x)


def _heads(q, k, v, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q: (B*Q, heads, d), k: (B*T, kv_heads, d), v: (B*T, kv_heads * d) -> (B, heads, Q | T, d)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    q = q.view(batch, -1, num_heads, head_dim).transpose(1, 2)  # (B, heads, Q, d)
    k = k.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)  # (B, kv_heads, T, d)
    v = v.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2)
    rep = num_heads // num_kv_heads
    return q, k.repeat_interleave(rep, dim=1).to(q.dtype), v.repeat_interleave(rep, dim=1).to(q.dtype)


def _sdpa(q, k, v, batch: int, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q: (B*Q, heads, d), k: (B*T, kv_heads, d) after RoPE, v: (B*T, kv_heads * d); mask: (Q, T) or
    (B, 1, Q, T) bool. Returns (B, Q, heads * d).

    The query heads that share a kv head are stacked as one head of rep * Q queries, so SDPA reads each
    K/V once instead of rep repeat_interleave'd copies (and its backward sums no copies): the same
    result bit for bit, in less time."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k.shape[1]
    rep = num_heads // num_kv_heads
    num_queries = q.shape[0] // batch
    q = q.view(batch, num_queries, num_kv_heads, rep, head_dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(batch, num_kv_heads, rep * num_queries, head_dim)  # (B, kv_heads, rep*Q, d)
    k = k.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)  # (B, kv_heads, T, d)
    v = v.view(batch, -1, num_kv_heads, head_dim).transpose(1, 2).to(q.dtype)
    if rep > 1:
        mask = mask.repeat(*([1] * (mask.dim() - 2)), rep, 1)  # (..., rep*Q, T)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)  # (B, kv_heads, rep*Q, d)
    out = out.view(batch, num_kv_heads, rep, num_queries, head_dim).permute(0, 3, 1, 2, 4)
    return out.reshape(batch, num_queries, num_heads * head_dim)


def _attention_with_probs(q, k, v, batch: int, mask: torch.Tensor, scale: float):
    """_sdpa's attention, explicitly: -> ((B, T, heads * d), probs (B, heads, T, T))."""
    q, k, v = _heads(q, k, v, batch)
    scores = (q @ k.transpose(-1, -2)) * scale  # (B, heads, T, T)
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return (probs @ v).transpose(1, 2).reshape(batch, q.shape[2], -1), probs
