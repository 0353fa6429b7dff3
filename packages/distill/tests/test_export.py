"""A calibrated student saved with `export_student` round-trips through the reference loader and
serves the reference's greedy tokens in `LLM(path)`; refusals and crashes write nothing."""

from __future__ import annotations

import json

import pytest
import swiftkv_distill.export as export
import torch
from swiftkv_distill.batch import Batch
from swiftkv_distill.calibrate import calibrate
from swiftkv_distill.export import export_student
from swiftkv_reference.checkpoint import CheckpointError, load_model, load_state_dict, save_checkpoint
from swiftkv_reference.generate import generate
from swiftkv_reference.sampling import SamplingSettings
from swiftkv_reference.testing import random_state_dict, tiny_config, tiny_model
from tiny_models import PLAIN_MODELS

GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2}


@pytest.fixture(scope="module")
def students(tmp_path_factory):
    """name -> (teacher_dir, config, state) of a G = 2 student calibrated from a saved tiny teacher."""
    out = {}
    for name in ("llama", "qwen2_hybrid_bias"):
        config = tiny_config(**PLAIN_MODELS[name])
        teacher_dir = tmp_path_factory.mktemp(f"teacher-{name}")
        save_checkpoint(teacher_dir, config, random_state_dict(config, seed=5))
        (teacher_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
        g = torch.Generator().manual_seed(0)
        batches = [Batch.from_sequences([torch.randint(3, 128, (30,), generator=g).tolist()] * 3)]
        out[name] = (teacher_dir, *calibrate(load_model(teacher_dir), batches, 2, 2, progress=False))
    return out


@pytest.mark.parametrize("name", ["llama", "qwen2_hybrid_bias"])
def test_round_trip_and_fast_engine(students, tmp_path, name):
    from swiftkv_fast import LLM, SamplingParams

    teacher_dir, config, state = students[name]
    out = export_student(tmp_path / "student", config, state, teacher_dir)
    hf = json.loads((out / "config.json").read_text())
    family = config.family
    assert hf["model_type"] == f"{family}_swiftkv"
    assert (hf["num_key_value_layers"], hf["key_value_group_size"], hf["swiftkv"]) == (2, 2, True)
    assert json.loads((out / "generation_config.json").read_text()) == GENERATION_CONFIG
    saved = load_state_dict(out)
    assert saved.keys() == state.keys()
    assert all(torch.equal(saved[k], state[k]) for k in state)
    assert "model.layers.2.self_attn.k_proj_swiftkv.weight" in saved
    assert "model.layers.3.self_attn.k_proj_swiftkv.weight" not in saved  # AcrossKV: leaders only

    model = load_model(out)
    assert model.config == config.replace(swiftkv=True)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 3, 12]]
    want = generate(model, prompts, SamplingSettings(max_tokens=8, ignore_eos=True))
    llm = LLM(str(out), max_model_len=64, num_kv_blocks=32)
    assert (llm.config.num_key_value_layers, llm.config.key_value_group_size) == (2, 2)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [w.token_ids for w in want]


def test_a_bf16_teacher_gives_a_bf16_student(tmp_path):
    """The student is stored as the teacher is: its weights bit for bit, the fitted ones rounded."""
    from swiftkv_fast import LLM, SamplingParams

    config = tiny_config(**PLAIN_MODELS["llama"])
    stored = {k: v.to(torch.bfloat16) for k, v in random_state_dict(config, seed=5).items()}
    save_checkpoint(tmp_path / "teacher", config, stored)
    g = torch.Generator().manual_seed(0)
    batches = [Batch.from_sequences([torch.randint(3, 128, (30,), generator=g).tolist()] * 3)]
    student_config, state = calibrate(load_model(tmp_path / "teacher"), batches, 2, progress=False)
    out = export_student(tmp_path / "student", student_config, state, tmp_path / "teacher")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    saved = load_state_dict(out, dtype=None)
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert all(torch.equal(saved[k], stored[k]) for k in stored.keys() & saved.keys())
    fitted = "model.layers.2.self_attn.k_proj_swiftkv.weight"
    assert torch.equal(saved[fitted], state[fitted].to(torch.bfloat16))
    assert not torch.equal(saved[fitted].float(), state[fitted])  # fitted in fp32: rounded here
    model = load_model(out)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 3, 12]]
    want = generate(model, prompts, SamplingSettings(max_tokens=8, ignore_eos=True))
    llm = LLM(str(out), max_model_len=64, num_kv_blocks=32)
    got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [w.token_ids for w in want]


def test_refuses_a_non_empty_directory_unless_overwrite(students, tmp_path):
    teacher_dir, config, state = students["llama"]
    target = tmp_path / "student"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="not empty"):
        export_student(target, config, state, teacher_dir)
    with pytest.raises(CheckpointError, match="not a checkpoint"):  # overwrite replaces checkpoints only
        export_student(target, config, state, teacher_dir, overwrite=True)
    assert [p.name for p in target.iterdir()] == ["notes.txt"]
    (target / "notes.txt").unlink()
    export_student(target, config, state, teacher_dir)
    with pytest.raises(CheckpointError, match="not empty"):
        export_student(target, config, state, teacher_dir)
    export_student(target, config, state, teacher_dir, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    with pytest.raises(CheckpointError, match="same directory"):
        export_student(teacher_dir, config, state, teacher_dir, overwrite=True)


def test_bad_state_and_crashes_write_nothing(students, tmp_path, monkeypatch):
    teacher_dir, config, state = students["llama"]
    bad = {k: v for k, v in state.items() if k != "model.norm_swiftkv.weight"}
    with pytest.raises(CheckpointError, match="missing"):
        export_student(tmp_path / "a", config, bad, teacher_dir)
    assert list(tmp_path.iterdir()) == []

    def crash(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(export, "copy_tokenizer_files", crash)  # after the weights are written
    with pytest.raises(OSError, match="disk full"):
        export_student(tmp_path / "b", config, state, teacher_dir)
    assert list(tmp_path.iterdir()) == []


def test_the_teacher_path_is_checked_first(tmp_path):
    config = tiny_config()
    with pytest.raises(FileNotFoundError, match="does not exist"):
        export_student(tmp_path / "out", config, tiny_model(config).state_dict(), tmp_path / "nowhere")
    assert list(tmp_path.iterdir()) == []
