"""Write a student as a Hugging Face directory that `LLM(path)`, the reference loader and Snowflake's
`llama_swiftkv` model code read: config.json (model_type `{llama,mistral,qwen2}_swiftkv`,
num_key_value_layers, key_value_group_size, swiftkv: true), model.safetensors with Snowflake's
parameter names, and the tokenizer / generation files of the teacher's directory.

The weights are stored in the dtype the teacher's are (`stored_dtype`: bf16 for most Hugging Face
checkpoints), whatever the student was computed in: the teacher's own weights come back bit for bit, the
fitted SwiftKV ones are rounded to it, and the checkpoint is the teacher's size, not twice it.

The same machinery as `swiftkv convert` (swiftkv_reference.checkpoint): paths and the state dict are
checked before anything is written, a non-empty output directory is refused unless `overwrite` (and
then only when it holds a checkpoint), the teacher's directory is never written, and the files go into
a temporary sibling directory renamed into place at the end, so a crash leaves nothing half-written.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from swiftkv_reference.checkpoint import (
    check_conversion_paths,
    check_state_dict,
    copy_tokenizer_files,
    save_checkpoint,
    staged_directory,
    stored_dtype,
)
from swiftkv_reference.config import SwiftKVConfig

logger = logging.getLogger(__name__)


def export_student(
    out_dir: str | os.PathLike,
    config: SwiftKVConfig,
    state_dict: dict[str, torch.Tensor],
    teacher_dir: str | os.PathLike,
    overwrite: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Save (config, state_dict) (from `calibrate` or distillation) into `out_dir` with the tokenizer
    files of `teacher_dir`, the checkpoint the student was made from, its floating tensors in `dtype`
    (None: the teacher's, `stored_dtype`); returns the resolved `out_dir`."""
    src, dst = Path(teacher_dir).resolve(), Path(out_dir).resolve()
    check_conversion_paths(src, dst, overwrite)
    check_state_dict(config, state_dict)
    dtype = stored_dtype(src) if dtype is None else dtype
    state_dict = as_exported(state_dict, dtype)
    config = config.replace(swiftkv=True)
    with staged_directory(dst) as tmp:
        save_checkpoint(tmp, config, state_dict)
        copied = copy_tokenizer_files(src, tmp)
    logger.info(
        "wrote %s (%s, L=%d of N=%d, G=%d, %s; tokenizer files %s)",
        dst,
        config.to_hf()["model_type"],
        config.num_key_value_layers,
        config.num_hidden_layers,
        config.key_value_group_size,
        str(dtype).removeprefix("torch."),
        copied,
    )
    return dst


def as_exported(state_dict: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The floating tensors rounded to `dtype` (what the checkpoint will hold), the rest as they are."""
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state_dict.items()}
