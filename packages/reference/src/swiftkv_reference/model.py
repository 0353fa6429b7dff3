"""SwiftKVForCausalLM: Llama / Mistral / Qwen2 with SingleInputKV and AcrossKV, the reference math.

Forward (h_i = residual stream entering layer i; anchors/swiftkv-facts.md §1.3):
  layers 0..L-1: normal decoder layers;
  s = norm_swiftkv(h_L); for i >= L with leader g = L + ((i-L)//G)*G:
      K_i = RoPE(k_proj_swiftkv[g](s)), V_i = v_proj_swiftkv[g](s)  (stored once per group)
  layers i >= L: Q_i = RoPE(q_proj_swiftkv[i](input_layernorm_i(h_i))), then o_proj, MLP as usual;
  only tokens whose logits are needed run layers L..N-1 (early exit), against the K/V of all tokens.
With swiftkv=False every layer runs the original path (Snowflake's distillation teacher).

`step` runs new tokens of one request against a NaiveKVCache; `forward` is `step` over an empty
cache, so the dense forward and incremental generation share one definition of each layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention
from .config import SwiftKVConfig
from .kv_cache import NaiveKVCache
from .rope import apply_rope, rope_cos_sin, rope_inv_freq


class RMSNorm(nn.Module):
    """RMS_w(x) = w * x / sqrt(mean(x^2) + eps), computed in fp32."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, config: SwiftKVConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """The teacher q/k/v/o projections, plus q_proj_swiftkv on layers >= L and k/v_proj_swiftkv on
    AcrossKV group leaders."""

    def __init__(self, config: SwiftKVConfig, layer_idx: int):
        super().__init__()
        h, hd, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            hd,
        )
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=bias)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)
        if layer_idx >= config.num_key_value_layers:
            self.q_proj_swiftkv = nn.Linear(h, self.num_heads * hd, bias=bias)
            if config.group_leader(layer_idx) == layer_idx:
                self.k_proj_swiftkv = nn.Linear(h, self.num_kv_heads * hd, bias=bias)
                self.v_proj_swiftkv = nn.Linear(h, self.num_kv_heads * hd, bias=bias)

    def project_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swiftkv: bool):
        """x: (num_tokens, hidden) normed input -> K (after RoPE), V: (num_tokens, num_kv_heads, head_dim)."""
        k_proj, v_proj = (self.k_proj_swiftkv, self.v_proj_swiftkv) if swiftkv else (self.k_proj, self.v_proj)
        k = k_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        v = v_proj(x).view(-1, self.num_kv_heads, self.head_dim)
        return apply_rope(k, cos, sin), v

    def project_q(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, swiftkv: bool) -> torch.Tensor:
        """x: (num_tokens, hidden) normed input -> Q after RoPE: (num_tokens, num_heads, head_dim)."""
        q = (self.q_proj_swiftkv if swiftkv else self.q_proj)(x).view(-1, self.num_heads, self.head_dim)
        return apply_rope(q, cos, sin)


class DecoderLayer(nn.Module):
    def __init__(self, config: SwiftKVConfig, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class SwiftKVModel(nn.Module):
    """The `model.` part of the state_dict: embeddings, layers, norm, norm_swiftkv (when L < N)."""

    def __init__(self, config: SwiftKVConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.is_swiftkv:
            self.norm_swiftkv = RMSNorm(config.hidden_size, config.rms_norm_eps)


class SwiftKVForCausalLM(nn.Module):
    """The reference model. state_dict keys are the Hugging Face / Snowflake names."""

    def __init__(self, config: SwiftKVConfig):
        super().__init__()
        self.config = config
        self.model = SwiftKVModel(config)
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.inv_freq = rope_inv_freq(config)  # fp32 always (a plain attribute: `.to(dtype)` keeps it)
        self.scale = config.head_dim**-0.5

    def lm_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def new_cache(self, swiftkv: bool | None = None) -> NaiveKVCache:
        """An empty per-request cache for `step` (swiftkv=None: the config's `swiftkv` flag)."""
        return NaiveKVCache(self.config, self.config.swiftkv if swiftkv is None else swiftkv)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        logits_positions: torch.Tensor | list[int] | None = None,
        swiftkv: bool | None = None,
    ) -> torch.Tensor:
        """Dense forward from position 0. input_ids: (num_tokens,) or (batch, num_tokens).
        Returns fp32 logits (num_tokens, vocab) / (batch, num_tokens, vocab), or only the rows at
        `logits_positions` ((P, vocab) / (batch, P, vocab)); the other tokens stop after layer L-1.
        swiftkv=None uses `config.swiftkv`; False runs the original (teacher) path."""
        if input_ids.dim() == 2:
            return torch.stack([self.forward(row, logits_positions, swiftkv) for row in input_ids])
        if input_ids.dim() != 1:
            raise ValueError(f"input_ids must be 1-D or 2-D, got shape {tuple(input_ids.shape)}")
        num_tokens = input_ids.shape[0]
        if logits_positions is None:
            logits_positions = torch.arange(num_tokens)
        cache = self.new_cache(swiftkv)
        return self.step(input_ids, torch.arange(num_tokens), cache, logits_positions)

    @torch.no_grad()
    def step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: NaiveKVCache,
        logits_indices: torch.Tensor | list[int],
    ) -> torch.Tensor:
        """Run new tokens of one request against its cache and append their K/V to it.

        input_ids, positions: (num_new,); logits_indices: indices into the new tokens whose logits are
        returned, (P, vocab) fp32. Layers >= L run only those tokens (SwiftKV path).
        """
        cfg = self.config
        logits_indices = torch.as_tensor(logits_indices, dtype=torch.long).reshape(-1)
        if len(logits_indices) and not (
            0 <= int(logits_indices.min()) and int(logits_indices.max()) < len(input_ids)
        ):
            raise IndexError(
                f"logits positions {logits_indices.tolist()} out of range for {len(input_ids)} tokens"
            )
        positions = positions.to(torch.long)
        layers = self.model.layers
        cos, sin = rope_cos_sin(self.inv_freq.to(input_ids.device), positions)  # (num_new, head_dim)
        h = self.model.embed_tokens(input_ids)  # (num_new, hidden)

        first_half = cfg.num_key_value_layers if cache.swiftkv else cfg.num_hidden_layers
        for i in range(first_half):
            h = self._layer(i, h, positions, cos, sin, cache, own_kv=True)

        if cache.swiftkv:
            # K/V of every layer >= L for all new tokens, from s = norm_swiftkv(h_L); once per group.
            s = self.model.norm_swiftkv(h)  # (num_new, hidden)
            for g in range(cfg.num_key_value_layers, cfg.num_hidden_layers, cfg.key_value_group_size):
                k, v = layers[g].self_attn.project_kv(s, cos, sin, swiftkv=True)
                cache.append(cache.layer_index(g), k, v, positions)
            # Early exit: only the tokens whose logits are needed run layers L..N-1.
            h, positions = h[logits_indices], positions[logits_indices]
            cos, sin = cos[logits_indices], sin[logits_indices]
            for i in range(cfg.num_key_value_layers, cfg.num_hidden_layers if len(h) else 0):
                h = self._layer(i, h, positions, cos, sin, cache, own_kv=False)
        else:
            h = h[logits_indices]
        cache.trim()
        h = self.model.norm(h)
        return F.linear(h, self.lm_weight()).float()  # (P, vocab)

    def _layer(self, i, h, positions, cos, sin, cache: NaiveKVCache, own_kv: bool) -> torch.Tensor:
        """One decoder layer on rows h (num_rows, hidden). own_kv: compute and cache this layer's K/V
        (original path); else read the SwiftKV K/V already in the cache and use q_proj_swiftkv."""
        layer = self.model.layers[i]
        c = cache.layer_index(i)
        x = layer.input_layernorm(h)
        if own_kv:
            k, v = layer.self_attn.project_kv(x, cos, sin, swiftkv=False)
            cache.append(c, k, v, positions)
        q = layer.self_attn.project_q(x, cos, sin, swiftkv=not own_kv)
        k_all, v_all, k_positions = cache.get(c)
        out = attention(q, k_all, v_all, positions, k_positions, self.config.window(i), self.scale)
        h = h + layer.self_attn.o_proj(out.flatten(1))
        return h + layer.mlp(layer.post_attention_layernorm(h))
