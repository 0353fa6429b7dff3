"""The model configuration: one validated dataclass for Llama, Mistral and Qwen2, with SwiftKV.

`SwiftKVConfig` is built from a Hugging Face `config.json` (a dict or a directory) and writes one back
that transformers and Snowflake's `llama_swiftkv` code read. Anything it cannot honour is a
`ConfigError` at load time, never a silently wrong model.

SwiftKV notation (see anchors/swiftkv-facts.md §1.1-1.3):
    N = num_hidden_layers, L = num_key_value_layers (layers >= L take K/V from norm_swiftkv(h_L)),
    G = key_value_group_size (AcrossKV: the G layers of a group share the leader's K/V and one cache).
L == N is exactly the original model.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

FULL = "full_attention"
SLIDING = "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)

# model_type -> (base family, is a SwiftKV checkpoint type)
MODEL_TYPES = {
    "llama": "llama",
    "llama_swiftkv": "llama",
    "mistral": "mistral",
    "mistral_swiftkv": "mistral",  # our own extension: Mistral with SwiftKV fields (no public format)
    "qwen2": "qwen2",
    "qwen2_swiftkv": "qwen2",
}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "llama_swiftkv": "LlamaSwiftKVForCausalLM",
    "mistral": "MistralForCausalLM",
    "mistral_swiftkv": "MistralSwiftKVForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_swiftkv": "Qwen2SwiftKVForCausalLM",
}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class ConfigError(ValueError):
    """A configuration the reference cannot honour exactly."""


@dataclass
class SwiftKVConfig:
    """A decoder-only Llama-family model, optionally with SwiftKV (SingleInputKV + AcrossKV).

    Field names are the Hugging Face ones. Defaults are a small Llama; `head_dim`, `num_key_value_heads`,
    `layer_types`, `num_key_value_layers` and `key_value_group_size` are filled in by `__post_init__`
    when left as None.
    """

    model_type: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # None (default RoPE) or {"rope_type": "llama3", ...}
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v bias (Qwen2); o_proj never has a bias
    layer_types: list[str] | None = None  # one of LAYER_TYPES per layer
    sliding_window: int | None = None  # W: query i sees keys i-W+1..i on sliding layers
    num_key_value_layers: int | None = None  # L (None -> N)
    key_value_group_size: int | None = None  # G (None -> 1)
    swiftkv: bool = True  # False runs the original (teacher) path for layers >= L
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(f"unsupported model_type {self.model_type!r}; supported: {sorted(MODEL_TYPES)}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        n = self.num_hidden_layers
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.num_key_value_heads <= 0 or self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ConfigError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}) and no head_dim is given"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ConfigError(f"head_dim must be a positive even integer, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps must be > 0, got {self.rms_norm_eps}")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta must be > 0, got {self.rope_theta}")
        self.rope_scaling = _normalize_rope_scaling(self.rope_scaling)

        family = MODEL_TYPES[self.model_type]
        if family == "qwen2" and not self.attention_bias:
            raise ConfigError("qwen2 models always have q/k/v biases (attention_bias must be True)")
        if family != "qwen2" and self.attention_bias:
            raise ConfigError(
                f"attention_bias is not supported for {self.model_type} (only qwen2's q/k/v bias)"
            )

        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise ConfigError(
                f"sliding_window must be a positive integer or None, got {self.sliding_window!r}"
            )
        if self.layer_types is None:
            self.layer_types = [SLIDING if self.sliding_window is not None else FULL] * n
        self.layer_types = list(self.layer_types)
        if len(self.layer_types) != n:
            raise ConfigError(f"layer_types has {len(self.layer_types)} entries for {n} layers")
        bad = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
        if bad:
            raise ConfigError(f"unsupported layer types {bad}; supported: {list(LAYER_TYPES)}")
        if SLIDING in self.layer_types and self.sliding_window is None:
            raise ConfigError("layer_types has sliding_attention layers but sliding_window is None")
        if family == "llama" and SLIDING in self.layer_types:
            raise ConfigError("llama models have no sliding-window layers (transformers' Llama ignores it)")
        if family == "mistral" and len(set(self.layer_types)) > 1:
            raise ConfigError(
                "mistral applies sliding_window to every layer; mixed layer_types are not mistral"
            )

        if self.num_key_value_layers is None:
            self.num_key_value_layers = n
        if self.key_value_group_size is None:
            self.key_value_group_size = 1
        big_l, g = self.num_key_value_layers, self.key_value_group_size
        if not 1 <= big_l <= n:
            raise ConfigError(f"num_key_value_layers must be in [1, {n}], got {big_l}")
        if g < 1:
            raise ConfigError(f"key_value_group_size must be >= 1, got {g}")
        if (n - big_l) % g:
            raise ConfigError(
                f"(num_hidden_layers - num_key_value_layers) % key_value_group_size != 0: "
                f"({n} - {big_l}) % {g} = {(n - big_l) % g}"
            )
        for leader in range(big_l, n, g):
            types = {self.layer_types[i] for i in range(leader, leader + g)}
            if len(types) > 1:
                raise ConfigError(
                    f"AcrossKV group of layers {leader}..{leader + g - 1} mixes full and sliding attention"
                )
        self.swiftkv = bool(self.swiftkv)
        self.eos_token_id = _as_id_list(self.eos_token_id)

    # ---- derived helpers -------------------------------------------------------------------------

    @property
    def family(self) -> str:
        """The base architecture: "llama", "mistral" or "qwen2"."""
        return MODEL_TYPES[self.model_type]

    @property
    def is_swiftkv(self) -> bool:
        """True when some layers take their K/V from norm_swiftkv(h_L) (L < N)."""
        return self.num_key_value_layers < self.num_hidden_layers

    @property
    def num_cache_layers(self) -> int:
        """Number of physical KV caches: L + (N - L) // G."""
        big_l = self.num_key_value_layers
        return big_l + (self.num_hidden_layers - big_l) // self.key_value_group_size

    def group_leader(self, i: int) -> int:
        """The layer whose k/v_proj_swiftkv serve layer i (i itself for i < L)."""
        self._check_layer(i)
        big_l, g = self.num_key_value_layers, self.key_value_group_size
        return i if i < big_l else big_l + ((i - big_l) // g) * g

    def cache_layer(self, i: int) -> int:
        """Index of the KV cache layer i reads (the G layers of an AcrossKV group share one)."""
        self._check_layer(i)
        big_l, g = self.num_key_value_layers, self.key_value_group_size
        return i if i < big_l else big_l + (i - big_l) // g

    def cache_layer_members(self, c: int) -> list[int]:
        """The model layers that read cache layer c."""
        return [i for i in range(self.num_hidden_layers) if self.cache_layer(i) == c]

    def window(self, i: int) -> int | None:
        """The sliding window of layer i, or None for full attention."""
        self._check_layer(i)
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    def cache_window(self, c: int) -> int | None:
        """The sliding window of cache layer c (all its members share it), or None."""
        return self.window(self.cache_layer_members(c)[0])

    def _check_layer(self, i: int) -> None:
        if not 0 <= i < self.num_hidden_layers:
            raise IndexError(f"layer {i} out of range for {self.num_hidden_layers} layers")

    # ---- Hugging Face I/O ------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, source: dict | str | os.PathLike) -> SwiftKVConfig:
        """Build from a Hugging Face config dict, a `config.json` path or a model directory.
        A file that is not a JSON object, or holds a value of the wrong type, is a ConfigError naming it."""
        if isinstance(source, dict):
            return _from_hf_dict(dict(source))
        path = Path(source)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"no config.json at {path}")
        hf = read_json_object(path, ConfigError)
        try:
            return _from_hf_dict(hf)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        except (TypeError, AttributeError, ValueError) as e:  # e.g. a list or a word where a number belongs
            raise ConfigError(f"{path}: a field has the wrong type ({type(e).__name__}: {e})") from e

    def to_hf(self) -> dict[str, Any]:
        """A `config.json` dict that transformers (and Snowflake's llama_swiftkv) read."""
        model_type = self.model_type
        if self.is_swiftkv and not model_type.endswith("_swiftkv"):
            model_type = f"{model_type}_swiftkv"
        hf: dict[str, Any] = {
            "architectures": [ARCHITECTURES[model_type]],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "rope_parameters": {
                "rope_theta": self.rope_theta,
                **(self.rope_scaling or {"rope_type": "default"}),
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": _id_list_to_hf(self.eos_token_id),
            "torch_dtype": "float32",
        }
        if self.family == "llama":
            hf.update(attention_bias=False, mlp_bias=False)
        elif self.family == "mistral":
            hf["sliding_window"] = self.sliding_window if SLIDING in self.layer_types else None
        else:  # qwen2
            sliding = [i for i, t in enumerate(self.layer_types) if t == SLIDING]
            hf.update(
                use_sliding_window=bool(sliding),
                sliding_window=self.sliding_window if sliding else None,
                max_window_layers=sliding[0] if sliding else self.num_hidden_layers,
                layer_types=list(self.layer_types),
            )
        if self.is_swiftkv or model_type.endswith("_swiftkv"):
            hf.update(
                num_key_value_layers=self.num_key_value_layers,
                key_value_group_size=self.key_value_group_size,
                swiftkv=self.swiftkv,
            )
        return hf

    def save(self, directory: str | os.PathLike, torch_dtype: str = "float32") -> Path:
        """Write `config.json` into `directory` (created if needed); returns its path. `torch_dtype`: what
        the weights beside it are stored in ("float32", "bfloat16", ...), as Hugging Face reads it."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        hf = self.to_hf() | {"torch_dtype": torch_dtype}
        path = directory / "config.json"
        path.write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        return path

    def replace(self, **changes: Any) -> SwiftKVConfig:
        """A validated copy with some fields changed."""
        values = asdict(self)
        values.update(changes)
        return SwiftKVConfig(**values)


def read_json_object(path: Path, error: type[ValueError]) -> dict[str, Any]:
    """The JSON object in `path`; `error` naming the file when it is not valid UTF-8 JSON or not an object."""
    try:
        value = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path} is not valid JSON ({e})") from None
    if not isinstance(value, dict):
        raise error(f"{path} must hold a JSON object, got a {type(value).__name__}")
    return value


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)) and all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        return list(value)
    raise ConfigError(f"eos_token_id must be an int, a list of ints or None, got {value!r}")


def _id_list_to_hf(ids: list[int]) -> int | list[int] | None:
    return None if not ids else ids[0] if len(ids) == 1 else list(ids)


def _normalize_rope_scaling(scaling: dict | None) -> dict | None:
    """None for plain RoPE; a complete llama3 dict; a ConfigError for anything else."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        raise ConfigError(f"rope_scaling must be a dict or None, got {scaling!r}")
    scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "type")} | {
        "rope_type": scaling.get("rope_type", scaling.get("type", "default"))
    }
    rope_type = scaling["rope_type"]
    if rope_type == "default":
        extra = sorted(set(scaling) - {"rope_type", "partial_rotary_factor"})
        if scaling.get("partial_rotary_factor", 1.0) != 1.0:
            raise ConfigError("partial_rotary_factor != 1 is not supported")
        if extra:
            logger.warning("ignoring default-RoPE parameters %s", extra)
        return None
    if rope_type != "llama3":
        raise ConfigError(f"unsupported rope type {rope_type!r}; supported: default, llama3")
    missing = [k for k in LLAMA3_KEYS if k not in scaling]
    if missing:
        raise ConfigError(f"llama3 rope_scaling is missing {missing}")
    if scaling.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor != 1 is not supported")
    out = {"rope_type": "llama3"}
    for k in LLAMA3_KEYS:
        out[k] = float(scaling[k]) if k != "original_max_position_embeddings" else int(scaling[k])
    if not (out["factor"] > 0 and 0 < out["low_freq_factor"] < out["high_freq_factor"]):
        raise ConfigError(f"invalid llama3 rope_scaling {out}")
    return out


def _rope_from_hf(hf: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the legacy keys or transformers 5's rope_parameters."""
    params = hf.get("rope_parameters")
    scaling = hf.get("rope_scaling")
    theta = hf.get("rope_theta")
    if isinstance(params, dict) and params:
        if all(isinstance(v, dict) for v in params.values()):  # per layer type
            distinct = {json.dumps(v, sort_keys=True) for v in params.values()}
            if len(distinct) > 1:
                raise ConfigError("per-layer-type rope_parameters that differ are not supported")
            params = next(iter(params.values()))
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = params
    if scaling is not None and isinstance(scaling, dict) and theta is None:
        theta = scaling.get("rope_theta")
    return float(theta if theta is not None else 10000.0), scaling


def _from_hf_dict(hf: dict) -> SwiftKVConfig:
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {sorted(MODEL_TYPES)}")
    family = MODEL_TYPES[model_type]
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"unsupported hidden_act {act!r} (only silu)")
    if hf.get("mlp_bias"):
        raise ConfigError("mlp_bias is not supported")
    if family == "llama" and hf.get("attention_bias"):
        raise ConfigError("llama attention_bias (q/k/v/o bias) is not supported")
    rope_theta, rope_scaling = _rope_from_hf(hf)

    layer_types = hf.get("layer_types")
    sliding_window = hf.get("sliding_window")
    n = hf.get("num_hidden_layers")
    if family == "llama":
        if sliding_window is not None:
            logger.info("ignoring sliding_window=%s: transformers' Llama uses full attention", sliding_window)
        sliding_window, layer_types = None, None
    elif family == "mistral":
        if layer_types is not None and len(set(layer_types)) > 1:
            raise ConfigError("mistral with mixed layer_types is not supported (transformers ignores them)")
        layer_types = None  # every layer slides when sliding_window is set
    else:  # qwen2: the window only applies when use_sliding_window, to layers >= max_window_layers
        if not hf.get("use_sliding_window", False):
            sliding_window = None
        if layer_types is None:
            mwl = hf.get("max_window_layers", 28)
            layer_types = [
                SLIDING if sliding_window is not None and i >= mwl else FULL for i in range(n or 0)
            ]
        if sliding_window is None and SLIDING in layer_types:
            raise ConfigError("qwen2 layer_types has sliding layers but use_sliding_window is off")

    big_l = hf.get("num_key_value_layers") or None  # Snowflake: `num_key_value_layers or N`
    g = hf.get("key_value_group_size") or None
    if not model_type.endswith("_swiftkv") and (big_l not in (None, n) or g not in (None, 1)):
        raise ConfigError(f"model_type {model_type!r} with SwiftKV fields; use {model_type}_swiftkv")
    swiftkv = hf.get("swiftkv", True)
    if model_type.endswith("_swiftkv") and not swiftkv and big_l not in (None, n):
        logger.warning("config has swiftkv=false: the original (teacher) path will run for layers >= L")

    return SwiftKVConfig(
        model_type=model_type,
        vocab_size=hf.get("vocab_size"),
        hidden_size=hf.get("hidden_size"),
        intermediate_size=hf.get("intermediate_size"),
        num_hidden_layers=n,
        num_attention_heads=hf.get("num_attention_heads"),
        num_key_value_heads=hf.get("num_key_value_heads"),
        head_dim=hf.get("head_dim"),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=family == "qwen2",
        layer_types=layer_types,
        sliding_window=sliding_window,
        num_key_value_layers=big_l,
        key_value_group_size=g,
        swiftkv=swiftkv,
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=hf.get("eos_token_id"),
    )
