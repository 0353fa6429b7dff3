"""Checkpoint I/O: Hugging Face directories of safetensors (single or sharded), never pickle.

Parameter names are the Hugging Face / Snowflake ones (anchors/swiftkv-facts.md §1.2):
    model.embed_tokens.weight, model.norm.weight, lm_head.weight (absent when tied),
    model.layers.{i}.{input_layernorm,post_attention_layernorm}.weight,
    model.layers.{i}.self_attn.{q,k,v,o}_proj.weight (+ q/k/v .bias for qwen2),
    model.layers.{i}.mlp.{gate,up,down}_proj.weight,
    SwiftKV (L < N): model.norm_swiftkv.weight, model.layers.{i}.self_attn.q_proj_swiftkv.* for i >= L,
    model.layers.{g}.self_attn.{k,v}_proj_swiftkv.* on AcrossKV group leaders g only.
Names are compared as whole strings / whole dotted components: `k_proj` never matches `k_proj_swiftkv`.

Pickle files (`pytorch_model.bin`, `*.pt`) are never loaded: unpickling can run code. The error says
how to convert them to safetensors once. A converted checkpoint is written into a temporary sibling
directory and renamed into place, so a crash never leaves half a checkpoint.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shlex
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .config import SwiftKVConfig, read_json_object

logger = logging.getLogger(__name__)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


class CheckpointError(ValueError):
    """A checkpoint that does not fit its config, or cannot be read safely."""


def expected_parameter_shapes(config: SwiftKVConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model's state_dict, in module order, with its shape."""
    h, inter, hd = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
    big_l, n = config.num_key_value_layers, config.num_hidden_layers
    bias = config.attention_bias
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for i in range(n):
        p = f"model.layers.{i}."
        attn: dict[str, int] = {"q_proj": q_out, "k_proj": kv_out, "v_proj": kv_out}
        if i >= big_l:
            attn["q_proj_swiftkv"] = q_out
            if config.group_leader(i) == i:
                attn["k_proj_swiftkv"] = kv_out
                attn["v_proj_swiftkv"] = kv_out
        for name, out in attn.items():
            shapes[f"{p}self_attn.{name}.weight"] = (out, h)
            if bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[f"{p}self_attn.o_proj.weight"] = (h, q_out)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, inter)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    if big_l < n:
        shapes["model.norm_swiftkv.weight"] = (h,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def expected_parameter_names(config: SwiftKVConfig) -> list[str]:
    """The state_dict keys a checkpoint of this config must have (and no others)."""
    return list(expected_parameter_shapes(config))


def check_state_dict(config: SwiftKVConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise CheckpointError naming every missing, unexpected and mis-shaped tensor."""
    expected = expected_parameter_shapes(config)
    missing = [k for k in expected if k not in state_dict]
    unexpected = sorted(k for k in state_dict if k not in expected)
    misshaped = [
        f"{k}: expected {tuple(shape)}, got {tuple(state_dict[k].shape)}"
        for k, shape in expected.items()
        if k in state_dict and tuple(state_dict[k].shape) != tuple(shape)
    ]
    if missing or unexpected or misshaped:
        lines = [
            f"state_dict does not match the {config.model_type} config "
            f"(N={config.num_hidden_layers}, L={config.num_key_value_layers}, "
            f"G={config.key_value_group_size}):"
        ]
        if missing:
            lines.append(f"  missing ({len(missing)}): {missing}")
        if unexpected:
            lines.append(f"  unexpected ({len(unexpected)}): {unexpected}")
        if misshaped:
            lines.append(f"  mis-shaped ({len(misshaped)}): {misshaped}")
        raise CheckpointError("\n".join(lines))


def normalize_state_dict(
    config: SwiftKVConfig, state_dict: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Drop what a loader may ignore: rotary buffers, lm_head.weight of a tied model when it equals
    the embedding (some exporters write it anyway), and model.norm_swiftkv.weight at L == N (Snowflake's
    LlamaSwiftKVModel always has it; without layers >= L nothing reads it)."""
    out = {k: v for k, v in state_dict.items() if k.split(".")[-2:] != ["rotary_emb", "inv_freq"]}
    if not config.is_swiftkv and "model.norm_swiftkv.weight" in out:
        logger.debug("dropping model.norm_swiftkv.weight: unused at L == N (%d)", config.num_hidden_layers)
        del out["model.norm_swiftkv.weight"]
    if config.tie_word_embeddings and "lm_head.weight" in out:
        head, emb = out["lm_head.weight"], out.get("model.embed_tokens.weight")
        if emb is not None and head.shape == emb.shape and torch.equal(head, emb):
            del out["lm_head.weight"]
    return out


def load_config(directory: str | os.PathLike) -> SwiftKVConfig:
    """The SwiftKVConfig of a Hugging Face model directory."""
    return SwiftKVConfig.from_hf(Path(directory))


def load_state_dict(
    directory: str | os.PathLike, dtype: torch.dtype | None = torch.float32
) -> dict[str, torch.Tensor]:
    """All tensors of a model directory: `model.safetensors`, or the shards named by
    `model.safetensors.index.json` (a directory with both is refused: one of them is stale).
    Floating tensors are cast to `dtype` (None keeps them as stored)."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"checkpoint directory {directory} does not exist (or is not a directory)")
    single, index = directory / SAFETENSORS, directory / SAFETENSORS_INDEX
    if single.is_file() and index.is_file():
        raise CheckpointError(
            f"{directory} holds both {SAFETENSORS} and {SAFETENSORS_INDEX}: which weights are current is "
            "ambiguous; delete the stale one"
        )
    if index.is_file():
        state = _load_shards(index)
    elif single.is_file():
        state = _load_safetensors(single)
    else:
        raise CheckpointError(_no_safetensors_message(directory))
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in state.items()}
    return state


# safetensors' dtype names of the floating dtypes
_FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_dtype(directory: str | os.PathLike) -> torch.dtype:
    """The floating dtype most of a checkpoint's floating values are stored in (bf16 for most Hugging
    Face checkpoints, fp32 for the embedded model), read from the safetensors headers: nothing is
    loaded. fp32 when the checkpoint holds no floating tensor."""
    directory = Path(directory)
    index = directory / SAFETENSORS_INDEX
    if index.is_file():
        files = [directory / shard for shard in sorted(set(_weight_map(index).values()))]
    else:
        files = [directory / SAFETENSORS]
    sizes: list[tuple[torch.dtype, int]] = []
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    if tensor.get_dtype() in _FLOAT_DTYPES:
                        sizes.append((_FLOAT_DTYPES[tensor.get_dtype()], math.prod(tensor.get_shape())))
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"cannot read the safetensors header of {path}: {e}") from None
    return _dtype_of_most(sizes)


def state_dict_dtype(state_dict: dict[str, torch.Tensor]) -> torch.dtype:
    """What `stored_dtype` says of a checkpoint, of an in-memory state dict: the floating dtype most of
    its floating values are in; fp32 when it holds no floating tensor."""
    return _dtype_of_most([(t.dtype, t.numel()) for t in state_dict.values() if t.is_floating_point()])


def _dtype_of_most(sizes: list[tuple[torch.dtype, int]]) -> torch.dtype:
    """The dtype holding the most values of (dtype, number of values) pairs; fp32 for none."""
    values: dict[torch.dtype, int] = {}
    for dtype, n in sizes:
        values[dtype] = values.get(dtype, 0) + n
    return max(values, key=values.get) if values else torch.float32


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except SafetensorError as e:
        raise CheckpointError(
            f"{path} is not a valid safetensors file (truncated or corrupt?): {e}"
        ) from None


def _weight_map(index_path: Path) -> dict[str, str]:
    """The index's {tensor name: shard file name}, every shard a plain file name beside the index."""
    weight_map = read_json_object(index_path, CheckpointError).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        got = "nothing" if weight_map is None else repr(weight_map)[:80]
        raise CheckpointError(
            f"{index_path}: 'weight_map' must be a non-empty object mapping tensor names to shard file "
            f"names, got {got}"
        )
    bad = {k: f for k, f in weight_map.items() if not isinstance(f, str)}
    if bad:
        raise CheckpointError(f"{index_path}: 'weight_map' values must be file names, got {bad}"[:300])
    for shard in sorted(set(weight_map.values())):
        if Path(shard).name != shard:
            raise CheckpointError(f"{index_path} names shard {shard!r}, which is not a file name")
    return weight_map


def _load_shards(index_path: Path) -> dict[str, torch.Tensor]:
    weight_map = _weight_map(index_path)
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise CheckpointError(f"shard {shard!r} named by {index_path} is missing")
        tensors = _load_safetensors(shard_path)
        listed = {k for k, f in weight_map.items() if f == shard}
        if set(tensors) != listed:
            raise CheckpointError(
                f"shard {shard_path} holds {sorted(set(tensors) - listed)} not in the index and lacks "
                f"{sorted(listed - set(tensors))}"
            )
        state.update(tensors)
    return state


def _no_safetensors_message(directory: Path) -> str:
    found = f"no {SAFETENSORS} or {SAFETENSORS_INDEX} in {directory}"
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
    weights = [name for name in pickles if name.startswith("pytorch_model")] or pickles
    if not weights:
        return found
    return (
        f"{found}, only pickle files {pickles}, which are never loaded (unpickling can run code). "
        f"Convert them to safetensors once: {_pickle_conversion_command(directory, weights)}"
    )


def _pickle_conversion_command(directory: Path, files: list[str]) -> str:
    """A shell line that writes `model.safetensors` from pickled state dicts (tensors only:
    weights_only=True; cloned, so tied weights that share storage become separate contiguous tensors)."""
    code = (
        "import torch; from safetensors.torch import save_file; "
        f"sd = {{k: v.contiguous().clone() for f in {files!r} "
        "for k, v in torch.load(f, map_location='cpu', weights_only=True).items()}; "
        f"save_file(sd, {SAFETENSORS!r}, metadata={{'format': 'pt'}})"
    )
    quoted = f'"{code}"' if not set(code) & set('"$`\\!') else shlex.quote(code)
    return f"cd {shlex.quote(str(directory))} && python -c {quoted}"


def save_checkpoint(
    directory: str | os.PathLike,
    config: SwiftKVConfig,
    state_dict: dict[str, torch.Tensor],
    max_shard_bytes: int | None = None,
) -> Path:
    """Write config.json and the weights (one file, or shards + index when `max_shard_bytes` is set)."""
    check_state_dict(config, state_dict)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        k: state_dict[k].detach().to("cpu").contiguous().clone() for k in expected_parameter_names(config)
    }
    stored = _dtype_of_most([(t.dtype, t.numel()) for t in tensors.values() if t.is_floating_point()])
    config.save(directory, torch_dtype=str(stored).removeprefix("torch."))  # what most weights are in
    if max_shard_bytes is None:
        save_file(tensors, str(directory / SAFETENSORS), metadata={"format": "pt"})
        return directory
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for k, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][k] = t
        size += nbytes
    weight_map = {}
    for j, shard in enumerate(shards):
        name = f"model-{j + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return directory


def load_model(directory: str | os.PathLike, dtype: torch.dtype = torch.float32):
    """A SwiftKVForCausalLM with the weights of a model directory, in eval mode."""
    from .model import SwiftKVForCausalLM

    config = load_config(directory)
    state = normalize_state_dict(config, load_state_dict(directory, dtype=dtype))
    check_state_dict(config, state)
    model = SwiftKVForCausalLM(config).to(dtype)
    model.load_state_dict(state, strict=True)
    return model.eval()


def swiftkv_config(
    config: SwiftKVConfig, num_key_value_layers: int, key_value_group_size: int = 1
) -> SwiftKVConfig:
    """The config `swiftkv_init` gives a plain model's SwiftKV student (L and G checked by the config);
    CheckpointError when `config` is already a SwiftKV model's."""
    if config.is_swiftkv:
        raise CheckpointError(
            f"the source is already a SwiftKV model (L={config.num_key_value_layers}); convert a plain model"
        )
    model_type = config.model_type
    if num_key_value_layers < config.num_hidden_layers:
        model_type = f"{config.family}_swiftkv"
    return config.replace(
        model_type=model_type,
        num_key_value_layers=num_key_value_layers,
        key_value_group_size=key_value_group_size,
        swiftkv=True,
    )


def swiftkv_init(
    config: SwiftKVConfig,
    state_dict: dict[str, torch.Tensor],
    num_key_value_layers: int,
    key_value_group_size: int = 1,
) -> tuple[SwiftKVConfig, dict[str, torch.Tensor]]:
    """A SwiftKV config and state_dict initialised as Snowflake's trainer does (§1.4):
    norm_swiftkv <- layers[L].input_layernorm; q_proj_swiftkv[i] <- q_proj[i];
    a group leader's k/v_proj_swiftkv <- the mean of its G members' k/v_proj (biases likewise).
    The source must be a plain model (L == N); its tensors are kept unchanged (the teacher)."""
    new_config = swiftkv_config(config, num_key_value_layers, key_value_group_size)
    check_state_dict(config, state_dict)
    big_l, g, n = num_key_value_layers, key_value_group_size, config.num_hidden_layers
    out = {k: v.clone() for k, v in state_dict.items()}
    if big_l == n:
        return new_config, out
    out["model.norm_swiftkv.weight"] = state_dict[f"model.layers.{big_l}.input_layernorm.weight"].clone()
    params = ("weight", "bias") if config.attention_bias else ("weight",)
    for i in range(big_l, n):
        attn = f"model.layers.{i}.self_attn."
        for p in params:
            out[f"{attn}q_proj_swiftkv.{p}"] = state_dict[f"{attn}q_proj.{p}"].clone()
        if new_config.group_leader(i) != i:
            continue
        for proj in ("k_proj", "v_proj"):
            for p in params:
                members = [state_dict[f"model.layers.{j}.self_attn.{proj}.{p}"] for j in range(i, i + g)]
                mean = torch.zeros_like(members[0])
                for w in members:  # Snowflake: zeroed, then += W / G
                    mean += w / g
                out[f"{attn}{proj}_swiftkv.{p}"] = mean
    check_state_dict(new_config, out)
    return new_config, out


def copy_tokenizer_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy the tokenizer / generation files that exist in `src` into `dst`; returns their names."""
    copied = []
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, Path(dst) / name)
            copied.append(name)
    return copied


def convert_to_swiftkv(
    src_dir: str | os.PathLike,
    dst_dir: str | os.PathLike,
    num_key_value_layers: int,
    key_value_group_size: int = 1,
    overwrite: bool = False,
) -> Path:
    """Turn a Llama / Mistral / Qwen2 directory into a SwiftKV one (see `swiftkv_init`), saved as a
    loadable Hugging Face directory with the source's tokenizer files. A non-empty `dst_dir` is refused
    unless `overwrite`, which replaces the whole directory (it must hold a checkpoint: config.json);
    the source is never written. Everything is checked before anything is written."""
    src, dst = Path(src_dir).resolve(), Path(dst_dir).resolve()
    check_conversion_paths(src, dst, overwrite)
    config = load_config(src)
    state = load_state_dict(src, dtype=None)
    state = normalize_state_dict(config, state)
    new_config, new_state = swiftkv_init(config, state, num_key_value_layers, key_value_group_size)
    with staged_directory(dst) as tmp:
        save_checkpoint(tmp, new_config, new_state)
        copied = copy_tokenizer_files(src, tmp)
    logger.info(
        "converted %s -> %s (%s, L=%d of N=%d, G=%d; tokenizer files %s)",
        src,
        dst,
        new_config.model_type,
        num_key_value_layers,
        config.num_hidden_layers,
        key_value_group_size,
        copied,
    )
    return dst


def check_conversion_paths(src: Path, dst: Path, overwrite: bool) -> None:
    """Refuse (before any work) what would destroy the source or mix old and new files: resolved paths."""
    if not src.is_dir():
        raise FileNotFoundError(f"source checkpoint directory {src} does not exist (or is not a directory)")
    if dst == src:
        raise CheckpointError(
            f"source and destination are the same directory ({src}): converting in place would destroy "
            "the source; choose another output directory"
        )
    if src.is_relative_to(dst):
        raise CheckpointError(f"the output directory {dst} contains the source {src}; choose another one")
    if not dst.exists():
        return
    if not dst.is_dir():
        raise NotADirectoryError(f"the output {dst} exists and is not a directory")
    entries = sorted(p.name for p in dst.iterdir())
    if not entries:
        return
    if not overwrite:
        raise CheckpointError(
            f"the output directory {dst} is not empty ({', '.join(entries[:4])}"
            f"{', ...' if len(entries) > 4 else ''}); pass overwrite=True (--overwrite on the command line) "
            "to replace it"
        )
    if not (dst / "config.json").is_file():
        raise CheckpointError(
            f"the output directory {dst} holds no config.json: it is not a checkpoint, so it is not "
            "replaced even with overwrite; choose another output directory"
        )


@contextmanager
def staged_directory(target: Path) -> Iterator[Path]:
    """A temporary sibling of `target` to write into; when the block succeeds it replaces `target`
    (an existing `target` is moved aside first, then deleted). On an exception `target` is untouched."""
    tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)  # not tempfile.mkdtemp: the checkpoint gets the usual (umask) permissions
    try:
        yield tmp
        if not target.exists():
            os.rename(tmp, target)
            return
        old = target.with_name(f".{target.name}.old-{uuid.uuid4().hex[:8]}")
        os.rename(target, old)
        try:
            os.rename(tmp, target)
        except OSError:
            os.rename(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
