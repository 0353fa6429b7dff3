"""Write a student as a Hugging Face directory that `LLM(path)`, the reference loader and Snowflake's
`llama_swiftkv` model code read: config.json (model_type `{llama,mistral,qwen2}_swiftkv`,
num_key_value_layers, key_value_group_size, swiftkv: true), model.safetensors with Snowflake's
parameter names, and the tokenizer / generation files of the teacher's directory.

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
)
from swiftkv_reference.config import SwiftKVConfig

logger = logging.getLogger(__name__)


def export_student(
    out_dir: str | os.PathLike,
    config: SwiftKVConfig,
    state_dict: dict[str, torch.Tensor],
    teacher_dir: str | os.PathLike,
    overwrite: bool = False,
) -> Path:
    """Save (config, state_dict) (from `calibrate` or distillation) into `out_dir` with the tokenizer
    files of `teacher_dir`, the checkpoint the student was made from; returns the resolved `out_dir`."""
    src, dst = Path(teacher_dir).resolve(), Path(out_dir).resolve()
    check_conversion_paths(src, dst, overwrite)
    check_state_dict(config, state_dict)
    config = config.replace(swiftkv=True)
    with staged_directory(dst) as tmp:
        save_checkpoint(tmp, config, state_dict)
        copied = copy_tokenizer_files(src, tmp)
    logger.info(
        "wrote %s (%s, L=%d of N=%d, G=%d; tokenizer files %s)",
        dst,
        config.to_hf()["model_type"],
        config.num_key_value_layers,
        config.num_hidden_layers,
        config.key_value_group_size,
        copied,
    )
    return dst
