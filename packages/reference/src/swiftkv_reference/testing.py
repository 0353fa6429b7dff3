"""Tiny random models for tests (this package's, the conformance suite's, the fast engine's), and the
fp32 tolerance for comparing two computations of their outputs.

    config = tiny_config(num_hidden_layers=6, num_key_value_layers=2, key_value_group_size=2)
    state = random_state_dict(config, seed=0)
    model = tiny_model(config, seed=0)          # SwiftKVForCausalLM with those weights, eval, fp32
    assert (got - want).abs().max() <= fp32_atol(want, depth=config.num_hidden_layers)

Weights are random with non-unit norms and small biases so that every term matters (replacing
norm_swiftkv by another norm changes the logits).
"""

from __future__ import annotations

import math

import torch

from .checkpoint import expected_parameter_shapes
from .config import SwiftKVConfig

_TINY = dict(
    model_type="llama",
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=[2],
)


def tiny_config(**overrides) -> SwiftKVConfig:
    """A small valid config (head_dim 32, GQA 2:1, 4 layers) with `overrides` applied.
    `model_type="qwen2"` turns on attention_bias automatically."""
    values = dict(_TINY)
    values.update(overrides)
    if values["model_type"].startswith("qwen2"):
        values.setdefault("attention_bias", True)
    return SwiftKVConfig(**values)


def random_state_dict(
    config: SwiftKVConfig, seed: int = 0, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Random weights for every expected tensor: projections ~ N(0, 1/fan_in) scaled, norms ~ 1 +- 0.3,
    biases ~ N(0, 0.1), embeddings ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in expected_parameter_shapes(config).items():
        if (
            name.endswith("norm.weight")
            or name.endswith("layernorm.weight")
            or name == "model.norm_swiftkv.weight"
        ):
            t = 1.0 + 0.3 * torch.randn(shape, generator=g)
        elif name.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        elif name == "model.embed_tokens.weight":
            t = torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        state[name] = t.to(dtype)
    return state


def q4_1_dequantized(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """w (out, in) as a Q4_1 checkpoint holds it once dequantized to fp32 (llama.cpp's rule per block of
    32 inputs: m the minimum and d the range / 15, both stored in fp16; codes round((w - m) / d))."""
    b = w.reshape(w.shape[0], -1, block)
    m = b.amin(-1, keepdim=True).half().float()
    d = ((b.amax(-1, keepdim=True) - m) / 15).half().float()
    q = torch.where(d > 0, (b - m) / torch.where(d > 0, d, 1.0), 0.0).round().clamp(0, 15)
    return (d * q + m).reshape(w.shape)


def q8_0_dequantized(w: torch.Tensor, block: int = 32) -> torch.Tensor:
    """w (out, in) as a Q8_0 checkpoint holds it once dequantized to fp32 (llama.cpp's rule per block of
    32 inputs: d = max |w| / 127 stored in fp16, codes round(w / d))."""
    b = w.reshape(w.shape[0], -1, block)
    d = (b.abs().amax(-1, keepdim=True) / 127).half().float()
    q = torch.where(d > 0, b / torch.where(d > 0, d, 1.0), 0.0).round().clamp(-127, 127)
    return (d * q).reshape(w.shape)


def four_bit_state_dict(state: dict[str, torch.Tensor], block: int = 32) -> dict[str, torch.Tensor]:
    """`state` as a dequantized GGUF Q4_1 checkpoint (the embedded model) holds it: every projection at
    its Q4_1 values, the embedding and lm_head at their Q8_0 ones; weights whose input width is not a
    multiple of `block`, norms and biases stay as they are."""
    four = ("_proj.weight", "_proj_swiftkv.weight")
    eight = ("lm_head.weight", "embed_tokens.weight")

    def fits(v: torch.Tensor) -> bool:
        return v.dim() == 2 and v.shape[1] % block == 0

    def quantized(k: str, v: torch.Tensor) -> torch.Tensor:
        if k.endswith(four) and fits(v):
            return q4_1_dequantized(v, block)
        return q8_0_dequantized(v, block) if k.endswith(eight) and fits(v) else v

    return {k: quantized(k, v) for k, v in state.items()}


def tiny_model(config: SwiftKVConfig | None = None, seed: int = 0, **overrides):
    """A SwiftKVForCausalLM (eval, fp32) of `config` (or `tiny_config(**overrides)`) with random weights."""
    from .model import SwiftKVForCausalLM

    config = config if config is not None else tiny_config(**overrides)
    model = SwiftKVForCausalLM(config)
    model.load_state_dict(random_state_dict(config, seed), strict=True)
    return model.eval()


def fp32_atol(expected: torch.Tensor, depth: int = 1, ulps: float = 32) -> float:
    """The max abs difference allowed between two fp32 computations of `expected` that may differ in
    summation order (another CPU's kernels, other matmul shapes, chunked prefill, a paged cache):
    `ulps` units in the last place of its largest |value|, times sqrt(depth) for the rounding errors
    of `depth` layers adding up as a random walk. Measured differences stay under 5 such units; a real
    bug (a window mask off by one, a wrong RoPE offset) moves logits by O(0.1-1), >100x this bound."""
    return ulps * torch.finfo(torch.float32).eps * float(expected.detach().abs().max()) * math.sqrt(depth)


def save_snowflake_checkpoint(directory, config: SwiftKVConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a Llama `config` (L == N) the way Snowflake's LlamaSwiftKVForCausalLM.save_pretrained does:
    model_type llama_swiftkv, num_key_value_layers = N, swiftkv false (its training switch), and
    `model.norm_swiftkv.weight` (the model always creates norm_swiftkv). Returns the plain model's weights."""
    import json
    from pathlib import Path

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = random_state_dict(config, seed)
    hf = {
        **config.to_hf(),
        "architectures": ["LlamaSwiftKVForCausalLM"],
        "model_type": "llama_swiftkv",
        "num_key_value_layers": config.num_hidden_layers,
        "key_value_group_size": 1,
        "swiftkv": False,
        "transformers_version": "4.48.0",
    }
    (directory / "config.json").write_text(json.dumps(hf, indent=2))
    norm = 1.0 + 0.3 * torch.randn(config.hidden_size, generator=torch.Generator().manual_seed(seed + 1))
    tensors = {**state, "model.norm_swiftkv.weight": norm}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return state
