"""Checkpoint tensors (Hugging Face / Snowflake names) into the vLLM model's parameters.

Every tensor is checked against the reference's list of names and shapes before it is copied, so a
checkpoint that does not fit its config fails naming the tensor, never with a shape error deep in a
weight loader. Where the names differ:

    layers i < L:  self_attn.{q,k,v}_proj         -> self_attn.qkv_proj (shards "q", "k", "v")
    layers i >= L: self_attn.{q,k,v}_proj         -> skipped: the teacher's, kept by Snowflake's format
                   self_attn.q_proj_swiftkv       -> self_attn.q_proj_swiftkv
    leaders g:     self_attn.{k,v}_proj_swiftkv   -> swiftkv_cache.{N + (g-L)//G}.kv_proj (shards 0, 1)
    every layer:   mlp.{gate,up}_proj             -> mlp.gate_up_proj (shards 0, 1)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from swiftkv_reference.checkpoint import expected_parameter_shapes
from swiftkv_reference.config import SwiftKVConfig
from torch import nn
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

Target = tuple[str, "str | int | None"]  # (parameter name, shard id for a fused linear)

_QKV = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}
_KV_SWIFTKV = {"k_proj_swiftkv": 0, "v_proj_swiftkv": 1}


def vllm_target(config: SwiftKVConfig, name: str) -> Target | None:
    """The parameter (and shard) a checkpoint tensor loads into; None for one the model does not use."""
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return name, None
    layer, module = int(parts[2]), parts[4]
    prefix, leaf = ".".join(parts[:4]), ".".join(parts[5:])
    if module in _QKV:
        if layer >= config.num_key_value_layers:
            return None
        return f"{prefix}.qkv_proj.{leaf}", _QKV[module]
    if module in _GATE_UP:
        return f"{prefix}.gate_up_proj.{leaf}", _GATE_UP[module]
    if module in _KV_SWIFTKV:
        group = (layer - config.num_key_value_layers) // config.key_value_group_size
        return f"model.swiftkv_cache.{config.num_hidden_layers + group}.kv_proj.{leaf}", _KV_SWIFTKV[module]
    return name, None


def load_swiftkv_weights(
    model: nn.Module, config: SwiftKVConfig, weights: Iterable[tuple[str, torch.Tensor]]
) -> set[str]:
    """Copy `weights` into `model`; returns the parameter names loaded (vLLM checks none is left)."""
    expected = expected_parameter_shapes(config)
    params = dict(model.named_parameters())
    where = (
        f"{config.model_type} (N={config.num_hidden_layers}, L={config.num_key_value_layers}, "
        f"G={config.key_value_group_size})"
    )
    seen: set[str] = set()
    loaded: set[str] = set()
    for name, tensor in weights:
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if name not in expected:
            if name == "lm_head.weight" and config.tie_word_embeddings:
                continue  # some exporters write the tied head; the embedding is the one used
            if name == "model.norm_swiftkv.weight" and not config.is_swiftkv:
                continue  # Snowflake's models always have it; at L == N nothing reads it
            raise ValueError(f"checkpoint tensor {name!r} does not belong to a {where} model")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}; "
                f"a {where} model needs {expected[name]}"
            )
        seen.add(name)
        target = vllm_target(config, name)
        if target is None:
            continue
        param_name, shard = target
        param = params[param_name]
        loader = getattr(param, "weight_loader", default_weight_loader)
        if shard is None:
            loader(param, tensor)
        else:
            loader(param, tensor, shard)
        loaded.add(param_name)
    missing = [n for n in expected if n not in seen and vllm_target(config, n) is not None]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensor(s) of a {where} model: {missing}")
    return loaded
