"""Distillation checkpoints: everything `distill(..., resume=True)` needs to continue bit-for-bit,
as safetensors + JSON (never pickle).

    checkpoint_dir/step-00000100/
        trainer_state.safetensors   param.{name}                      the trainable tensors
                                    optimizer.{name}.{exp_avg,...}    AdamW's per-parameter state
                                    rng.cpu, rng.cuda.{i}             torch's generator states (uint8)
        trainer_state.json          step, the settings, the model's shape, the loss history

Parameter names are the model's (Snowflake's) names. The learning rate is a function of the step
(`DistillConfig.lr_at`), so the step is the whole scheduler state. A checkpoint is written into a
temporary sibling directory and renamed into place (swiftkv_reference.checkpoint.staged_directory),
so a crash never leaves half of one; a directory without both files is not a checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from swiftkv_reference.checkpoint import staged_directory

logger = logging.getLogger(__name__)

TENSORS_FILE = "trainer_state.safetensors"
META_FILE = "trainer_state.json"
FORMAT = "swiftkv-distill trainer state"
VERSION = 1
_STEP_DIR = re.compile(r"step-(\d+)")


@dataclass
class TrainerState:
    step: int  # optimizer steps completed
    params: dict[str, torch.Tensor]  # trainable name -> tensor
    optimizer: dict[str, dict[str, torch.Tensor]]  # trainable name -> AdamW state (step, exp_avg, ...)
    rng: dict[str, torch.Tensor]  # "cpu" / "cuda.{i}" -> generator state
    meta: dict  # JSON-able: settings, model shape, history


def checkpoint_path(checkpoint_dir: Path, step: int) -> Path:
    return checkpoint_dir / f"step-{step:08d}"


def list_checkpoints(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints in `checkpoint_dir` as (step, path), oldest first."""
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for path in checkpoint_dir.iterdir():
        match = _STEP_DIR.fullmatch(path.name)
        if match and (path / TENSORS_FILE).is_file() and (path / META_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state.update({f"cuda.{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    cuda = [state[f"cuda.{i}"] for i in range(sum(k.startswith("cuda.") for k in state))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[: torch.cuda.device_count()])


def save_trainer_state(checkpoint_dir: Path, state: TrainerState, keep: int | None) -> Path:
    """Write `state` as checkpoint_dir/step-{step}; then delete all but the newest `keep` checkpoints
    (None keeps all). Returns the new checkpoint's path."""
    tensors = {f"param.{k}": v for k, v in state.params.items()}
    for name, per_param in state.optimizer.items():
        tensors.update({f"optimizer.{name}.{k}": v for k, v in per_param.items()})
    tensors.update({f"rng.{k}": v for k, v in state.rng.items()})
    tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()}
    meta = {"format": FORMAT, "version": VERSION, "step": state.step, **state.meta}
    target = checkpoint_path(checkpoint_dir, state.step)
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    with staged_directory(target) as tmp:
        save_file(tensors, str(tmp / TENSORS_FILE), metadata={"format": "pt"})
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    if keep is not None:
        for _, old in list_checkpoints(checkpoint_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    logger.info("saved distillation checkpoint %s", target)
    return target


def load_trainer_state(path: Path) -> TrainerState:
    """Read a checkpoint written by `save_trainer_state`; ValueError naming the file when it is not one."""
    meta_path = path / META_FILE
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{meta_path}: not a readable distillation checkpoint ({e})") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{meta_path}: not a {FORMAT!r} version {VERSION} file")
    tensors = load_file(str(path / TENSORS_FILE))
    params, optimizer, rng = {}, {}, {}
    for key, value in tensors.items():
        kind, _, rest = key.partition(".")
        if kind == "param":
            params[rest] = value
        elif kind == "optimizer":
            name, _, field = rest.rpartition(".")
            optimizer.setdefault(name, {})[field] = value
        elif kind == "rng":
            rng[rest] = value
        else:
            raise ValueError(f"{path / TENSORS_FILE}: unexpected tensor {key!r}")
    step = meta.pop("step")
    del meta["format"], meta["version"]
    return TrainerState(step=step, params=params, optimizer=optimizer, rng=rng, meta=meta)
