"""SwiftKV Llama / Mistral / Qwen2 built from vLLM's layers and its cross-layer KV sharing.

With N layers, L = `num_key_value_layers` and G = `key_value_group_size` (the reference's math,
`swiftkv_reference.model`):

    layers 0..L-1      vLLM's Llama decoder layer, each with its own KV cache
    s = norm_swiftkv(h_L)
    cache owners       one per AcrossKV group: K = RoPE(k_proj_swiftkv(s)), V = v_proj_swiftkv(s) of
                       every scheduled token, written into the group's cache; they never attend
    layers L..N-1      vLLM's Llama decoder layer whose attention projects only Q (q_proj_swiftkv) and
                       reads its group's cache (`kv_sharing_target_layer_name`): no cache of its own

So vLLM allocates L + (N-L)/G caches. With `--kv-sharing-fast-prefill`, vLLM restricts the attention
metadata of the trailing KV-sharing layers to the tokens whose logits are needed, and this model runs
layers L..N-1 on those rows only: SwiftKV's prefill saving. Mistral's and Qwen2's decoder layers are
Llama's with a window per layer (`layer_types`) and Qwen2's q/k/v bias; vLLM's Qwen2 layer ignores
per-layer windows, so Llama's serves all three.

The cache owners are built after layers 0..L-1 and before layers L..N-1: a sharing target must exist
before its readers, and vLLM marks fast-prefill layers by walking attention layers back from the last
one until one owns a cache. Their names carry an index past the decoder layers (N + group), since
vLLM binds caches by layer index and two attention layers must not share one.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group, get_tensor_model_parallel_world_size
from vllm.forward_context import get_forward_context
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.llama import LlamaDecoderLayer
from vllm.model_executor.models.utils import extract_layer_index
from vllm.sequence import IntermediateTensors
from vllm.v1.attention.backends.utils import KVSharingFastPrefillMetadata

from . import kv_write  # noqa: F401  (registers torch.ops.swiftkv_vllm.write_kv_cache)
from .configs import swiftkv_config
from .weights import load_swiftkv_weights

logger = logging.getLogger(__name__)


def cache_owner_prefix(model_prefix: str, config, layer_idx: int) -> str:
    """The module path of the cache owner whose cache layer `layer_idx` (>= L) reads."""
    big_l, g = config.num_key_value_layers, config.key_value_group_size
    return f"{model_prefix}.swiftkv_cache.{config.num_hidden_layers + (layer_idx - big_l) // g}"


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _heads_per_rank(total: int, what: str) -> int:
    tp = get_tensor_model_parallel_world_size()
    if total % tp:
        raise ValueError(
            f"SwiftKV's K/V projection splits {what} ({total}) across tensor_parallel_size={tp} ranks; "
            f"choose a tensor_parallel_size that divides {total}"
        )
    return total // tp


class SwiftKVCacheOwner(nn.Module):
    """One AcrossKV group's cache: K/V of every scheduled token from s = norm_swiftkv(h_L)."""

    def __init__(self, vllm_config: VllmConfig, leader: int, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        head_dim = _head_dim(config)
        self.num_kv_heads = _heads_per_rank(config.num_key_value_heads, "num_key_value_heads")
        self.head_dim = head_dim
        kv_out = config.num_key_value_heads * head_dim
        # K and V of the group leader's k/v_proj_swiftkv, split by K/V head across ranks as vLLM's k_proj
        self.kv_proj = MergedColumnParallelLinear(
            config.hidden_size,
            [kv_out, kv_out],
            bias=bool(getattr(config, "qkv_bias", False)),
            quant_config=vllm_config.quant_config,
            prefix=f"{prefix}.kv_proj",
        )
        self.rotary_emb = get_rope(
            head_dim,
            max_position=config.max_position_embeddings,
            rope_parameters=config.rope_parameters,
            is_neox_style=True,
        )
        window = config.sliding_window if config.layer_types[leader] == "sliding_attention" else None
        self.attn = Attention(
            _heads_per_rank(config.num_attention_heads, "num_attention_heads"),
            head_dim,
            head_dim**-0.5,
            num_kv_heads=self.num_kv_heads,
            cache_config=vllm_config.cache_config,
            quant_config=vllm_config.quant_config,
            per_layer_sliding_window=window,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, s: torch.Tensor) -> None:
        kv, _ = self.kv_proj(s)  # (num_tokens, 2 * num_kv_heads * head_dim)
        k, v = kv.chunk(2, dim=-1)
        k, _ = self.rotary_emb(positions, k)
        shape = (-1, self.num_kv_heads, self.head_dim)
        torch.ops.swiftkv_vllm.write_kv_cache(k.reshape(shape), v.reshape(shape), self.attn.layer_name)


class SwiftKVAttention(nn.Module):
    """Attention of a layer >= L: Q from q_proj_swiftkv, K/V read from its group's cache.

    Takes `LlamaAttention`'s constructor arguments, so vLLM's `LlamaDecoderLayer` builds it."""

    def __init__(
        self,
        config,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        max_position_embeddings: int = 8192,
        quant_config=None,
        bias: bool = False,
        bias_o_proj: bool = False,
        cache_config=None,
        prefix: str = "",
        **_: object,
    ) -> None:
        super().__init__()
        layer_idx = extract_layer_index(prefix)
        head_dim = _head_dim(config)
        self.num_heads = _heads_per_rank(num_heads, "num_attention_heads")
        self.q_proj_swiftkv = ColumnParallelLinear(
            hidden_size,
            num_heads * head_dim,
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.q_proj_swiftkv",
        )
        self.o_proj = RowParallelLinear(
            num_heads * head_dim,
            hidden_size,
            bias=bias_o_proj,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = get_rope(
            head_dim,
            max_position=max_position_embeddings,
            rope_parameters=config.rope_parameters,
            is_neox_style=True,
        )
        window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None
        model_prefix = prefix.rsplit(".layers.", 1)[0]
        self.attn = Attention(
            self.num_heads,
            head_dim,
            head_dim**-0.5,
            num_kv_heads=_heads_per_rank(num_kv_heads, "num_key_value_heads"),
            cache_config=cache_config,
            quant_config=quant_config,
            per_layer_sliding_window=window,
            prefix=f"{prefix}.attn",
            kv_sharing_target_layer_name=f"{cache_owner_prefix(model_prefix, config, layer_idx)}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, _ = self.q_proj_swiftkv(hidden_states)  # (num_rows, num_heads * head_dim)
        q, _ = self.rotary_emb(positions, q)
        no_kv = q.new_empty(0)  # a KV-sharing layer writes nothing; the op's schema still wants tensors
        out = self.attn(q, no_kv, no_kv)
        out, _ = self.o_proj(out)
        return out


def _fast_prefill(vllm_config: VllmConfig) -> bool:
    return vllm_config.cache_config.kv_sharing_fast_prefill


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "inputs_embeds": 0}, enable_if=_fast_prefill
)
class SwiftKVFirstHalf(nn.Module):
    """Every scheduled token: embeddings, layers 0..L-1, then the K/V of layers >= L into their caches.
    Returns h_L: (num_tokens, hidden)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: SwiftKVModel) -> None:
        super().__init__()
        self.embed_tokens = model.embed_tokens
        self.layers = model.layers[: model.config.num_key_value_layers]
        self.norm_swiftkv = model.norm_swiftkv
        self.cache_owners = model.swiftkv_cache

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        residual = None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual)
        hidden = hidden + residual  # h_L
        if self.norm_swiftkv is not None:
            s = self.norm_swiftkv(hidden)
            for owner in self.cache_owners.values():
                owner(positions, s)
        return hidden


@support_torch_compile(dynamic_arg_dims={"positions": 0, "hidden_states": 0}, enable_if=_fast_prefill)
class SwiftKVSecondHalf(nn.Module):
    """Layers L..N-1 and the final norm on the rows whose logits are needed: (num_rows, hidden)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "", model: SwiftKVModel) -> None:
        super().__init__()
        self.layers = model.layers[model.config.num_key_value_layers :]
        self.norm = model.norm

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if residual is None:  # no layer >= L (L == N)
            return self.norm(hidden_states)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


@support_torch_compile(
    dynamic_arg_dims={"input_ids": 0, "positions": 0, "intermediate_tensors": 0, "inputs_embeds": 0},
    enable_if=lambda vllm_config: not _fast_prefill(vllm_config),
)
class SwiftKVModel(nn.Module):
    """The `model.` part: one compiled graph without fast prefill, two (halves) with it."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        n, big_l, g = config.num_hidden_layers, config.num_key_value_layers, config.key_value_group_size
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        layers = [
            LlamaDecoderLayer(vllm_config=vllm_config, prefix=f"{prefix}.layers.{i}") for i in range(big_l)
        ]
        self.norm_swiftkv = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if big_l < n else None
        self.swiftkv_cache = nn.ModuleDict()
        for leader in range(big_l, n, g):
            owner = cache_owner_prefix(prefix, config, leader)
            self.swiftkv_cache[owner.rsplit(".", 1)[1]] = SwiftKVCacheOwner(vllm_config, leader, owner)
        layers += [
            LlamaDecoderLayer(
                vllm_config=vllm_config, prefix=f"{prefix}.layers.{i}", attn_layer_type=SwiftKVAttention
            )
            for i in range(big_l, n)
        ]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

        from vllm.compilation.backends import set_model_tag

        with set_model_tag("swiftkv_first_half"):
            self.first_half = SwiftKVFirstHalf(
                vllm_config=vllm_config, prefix=f"{prefix}.first_half", model=self
            )
        with set_model_tag("swiftkv_second_half"):
            self.second_half = SwiftKVSecondHalf(
                vllm_config=vllm_config, prefix=f"{prefix}.second_half", model=self
            )
        self.fast_prefill = vllm_config.cache_config.kv_sharing_fast_prefill
        self.last_attn_name = self.layers[-1].self_attn.attn.layer_name

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.first_half(input_ids, positions, inputs_embeds)  # (num_tokens, hidden): h_L
        rows = self._rows_needing_logits() if self.fast_prefill else None
        if rows is None:
            return self.second_half(positions, hidden)
        indices, num_rows = rows
        out = self.second_half(positions[indices], hidden[indices])
        hidden = hidden.clone()  # the first half's output may be a compiled graph's reused buffer
        hidden[indices[:num_rows]] = out[:num_rows]  # other rows are never sampled
        return hidden

    def _rows_needing_logits(self) -> tuple[torch.Tensor, int] | None:
        """(logits_indices_padded, num_logits_indices) when vLLM restricted the KV-sharing layers to
        the sampled tokens this step; None when they run every token (decode-only steps, warm-up)."""
        metadata = get_forward_context().attn_metadata
        if not isinstance(metadata, dict):
            return None
        layer_metadata = metadata.get(self.last_attn_name)
        if not isinstance(layer_metadata, KVSharingFastPrefillMetadata):
            return None
        if layer_metadata.logits_indices_padded is None or layer_metadata.num_logits_indices is None:
            return None
        return layer_metadata.logits_indices_padded, layer_metadata.num_logits_indices


class SwiftKVForCausalLM(nn.Module):
    """vLLM's entry class for the three SwiftKV architectures."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.swiftkv = swiftkv_config(config)  # the reference's checks, again, in every worker
        _check_settings(vllm_config)
        if not self.swiftkv.swiftkv and self.swiftkv.is_swiftkv:
            raise ValueError(
                f"{config.model_type} with swiftkv=false (the teacher path for layers >= L) is not served "
                "by swiftkv-vllm; serve the teacher checkpoint itself with plain vLLM"
            )
        if self.swiftkv.is_swiftkv and not vllm_config.cache_config.kv_sharing_fast_prefill:
            logger.warning(
                "SwiftKV runs layers >= %d on every prompt token without --kv-sharing-fast-prefill "
                "(kv_sharing_fast_prefill=True): correct, but without SwiftKV's prefill saving",
                config.num_key_value_layers,
            )
        self.config = config
        prefix = f"{prefix}.model" if prefix else "model"
        self.model = SwiftKVModel(vllm_config=vllm_config, prefix=prefix)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, quant_config=vllm_config.quant_config, prefix="lm_head"
        )
        if config.tie_word_embeddings:
            self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return load_swiftkv_weights(self, self.swiftkv, weights)


def _check_settings(vllm_config: VllmConfig) -> None:
    """vLLM settings SwiftKV cannot honour, refused by name before any weight is read."""
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp > 1 or get_pp_group().world_size > 1:
        raise ValueError(
            f"pipeline_parallel_size={pp}: SwiftKV models are not split across pipeline stages "
            "(layers >= L read caches that layer L's input fills); use tensor_parallel_size instead"
        )


class LlamaSwiftKVForCausalLM(SwiftKVForCausalLM):
    pass


class MistralSwiftKVForCausalLM(SwiftKVForCausalLM):
    pass


class Qwen2SwiftKVForCausalLM(SwiftKVForCausalLM):
    pass
