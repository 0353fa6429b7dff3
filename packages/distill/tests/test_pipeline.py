"""`swiftkv_distill.pipeline`: DistillSettings checks every field (each error names it) and maps a teacher
to its student's config; run_distill calibrates and trains on the training share only and evaluates on
the held-out share; cached_student distills once per (teacher files, settings) and reuses the result."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import re
import shutil
from pathlib import Path

import pytest
import swiftkv_distill.data as data_module
import swiftkv_distill.pipeline as pipeline
import torch
from swiftkv_distill.calibrate import CALIBRATION_VERSION
from swiftkv_distill.data import load_jsonl, split_holdout
from swiftkv_distill.pipeline import (
    DistillSettings,
    cached_student,
    prune_students,
    resolve_teacher_dir,
    run_distill,
    teacher_fingerprint,
)
from swiftkv_reference.checkpoint import load_state_dict, save_checkpoint
from swiftkv_reference.testing import random_state_dict, tiny_config
from swiftkv_reference.tokenizer import load_tokenizer
from tiny_teacher import save_tiny_teacher

BAD_SETTINGS = [  # (field, bad value)
    ("num_key_value_layers", 0),
    ("num_key_value_layers", -1),
    ("num_key_value_layers", 1.5),
    ("num_key_value_layers", True),
    ("num_key_value_layers", "2"),
    ("key_value_group_size", 0),
    ("num_samples", 1),
    ("max_tokens", 0),
    ("batch_tokens", 1),
    ("steps", -1),
    ("steps", 2.0),
    ("greedy_tokens", -1),
    ("seed", -1),
    ("temperature", 0),
    ("temperature", -0.5),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", True),
    ("temperature", "0.7"),
    ("holdout_share", 0),
    ("holdout_share", 1),
    ("holdout_share", 1.5),
    ("ridge", -1e-4),
    ("ridge", math.nan),
    ("weighting", "mass"),
    ("precision", "fp16"),
    ("lr", 0),
    ("lr", math.inf),
    ("calibration_samples", 0),
    ("calibration_samples", 2.5),
    ("logits_loss_temp", 0),
    ("logits_loss_temp", math.nan),
    ("hidden_loss_mult", -0.5),
    ("hidden_loss_mult", math.inf),
    ("device", "tpu"),
    ("device", "cuda:x"),
]


@pytest.mark.parametrize("name, value", BAD_SETTINGS)
def test_settings_refuse_bad_values_naming_the_field(name, value):
    with pytest.raises(ValueError, match=rf"^{name} must be"):
        DistillSettings(**{"num_key_value_layers": 2, name: value})


def test_settings_accept_the_edges():
    s = DistillSettings(
        num_key_value_layers=1,
        num_samples=2,
        max_tokens=1,
        batch_tokens=2,
        steps=0,
        greedy_tokens=0,
        seed=0,
        temperature=1,
        holdout_share=0.5,
        ridge=0,
        lr=1,
        hidden_loss_mult=0,
    )
    assert s.steps == 0 and s.ridge == 0
    with pytest.raises(AttributeError):
        s.steps = 3  # frozen: a checked value stays checked


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_settings_refuse_cuda_without_cuda():
    with pytest.raises(ValueError, match="^device='cuda'.*no CUDA"):
        DistillSettings(num_key_value_layers=2, device="cuda")


def test_cache_key_is_every_setting_but_the_device_and_the_calibrations_version():
    s = DistillSettings(num_key_value_layers=3, steps=5, calibration_samples=100)
    key = s.cache_key()
    settings = {k: v for k, v in s.__dict__.items() if k != "device"}
    assert key == settings | {"calibration": CALIBRATION_VERSION}
    assert key == dataclasses.replace(s, device="cpu:0").cache_key()


def test_cache_key_leaves_out_the_distillation_settings_without_steps():
    distillation = {"logits_loss_temp": 1.0, "hidden_loss_mult": 0.0}
    plain = DistillSettings(num_key_value_layers=3).cache_key()
    assert DistillSettings(num_key_value_layers=3, **distillation).cache_key() == plain
    assert not set(distillation) & set(plain)
    trained = DistillSettings(num_key_value_layers=3, steps=5).cache_key()
    for name, value in distillation.items():
        changed = DistillSettings(num_key_value_layers=3, steps=5, **{name: value}).cache_key()
        assert changed[name] == value and changed != trained, name
    # the precision reaches a calibrated student too (its data and calibration's pass run in it)
    for steps in (0, 5):
        fp32 = DistillSettings(num_key_value_layers=3, steps=steps, precision="fp32").cache_key()
        assert (
            fp32["precision"] == "fp32"
            and fp32 != DistillSettings(num_key_value_layers=3, steps=steps).cache_key()
        )


def test_cache_key_holds_calibration_samples_when_set():
    everything = DistillSettings(num_key_value_layers=3).cache_key()
    assert "calibration_samples" not in everything  # the key students cached before the setting had
    some = DistillSettings(num_key_value_layers=3, calibration_samples=64).cache_key()
    assert some == everything | {"calibration_samples": 64}


def test_distill_config_carries_every_distillation_setting():
    s = DistillSettings(
        num_key_value_layers=3,
        steps=7,
        lr=3e-3,
        logits_loss_temp=1.5,
        hidden_loss_mult=0.25,
        precision="bf16",
    )
    c = s.distill_config()
    got = (c.steps, c.lr, c.logits_loss_temp, c.hidden_loss_mult, c.precision)
    assert got == (7, 3e-3, 1.5, 0.25, "bf16")
    with pytest.raises(ValueError, match="steps is 0"):
        DistillSettings(num_key_value_layers=3).distill_config()


@pytest.mark.parametrize(
    "model_type, n, big_l, g, swiftkv_type",
    [
        ("llama", 4, 1, 3, "llama_swiftkv"),
        ("mistral", 4, 2, 2, "mistral_swiftkv"),
        ("qwen2", 5, 3, 1, "qwen2_swiftkv"),
    ],
)
def test_student_config(model_type, n, big_l, g, swiftkv_type):
    teacher = tiny_config(model_type=model_type, num_hidden_layers=n)
    student = DistillSettings(num_key_value_layers=big_l, key_value_group_size=g).student_config(teacher)
    assert (student.model_type, student.num_key_value_layers, student.key_value_group_size) == (
        swiftkv_type,
        big_l,
        g,
    )
    assert student.swiftkv and student.is_swiftkv
    assert student.replace(model_type=model_type, num_key_value_layers=n, key_value_group_size=1) == teacher


@pytest.mark.parametrize(
    "big_l, g, overrides, message",
    [
        (4, 1, {}, r"num_key_value_layers must be in \[1, 4\) for this 4-layer model"),
        (5, 1, {}, r"num_key_value_layers must be in \[1, 4\)"),
        (1, 2, {}, "key_value_group_size=2 must divide num_hidden_layers - num_key_value_layers = 3"),
        (2, 4, {}, "key_value_group_size=4 must divide"),
        (2, 1, dict(model_type="llama_swiftkv", num_key_value_layers=2), "already a SwiftKV model"),
    ],
)
def test_student_config_refuses_what_does_not_fit_the_teacher(big_l, g, overrides, message):
    teacher = tiny_config(**({"num_hidden_layers": 4} | overrides))
    with pytest.raises(ValueError, match=message):
        DistillSettings(num_key_value_layers=big_l, key_value_group_size=g).student_config(teacher)


def test_resolve_teacher_dir(tmp_path, monkeypatch):
    import swiftkv_reference.default_model as default_model

    monkeypatch.setattr(default_model, "default_model_dir", lambda: tmp_path / "embedded")
    assert resolve_teacher_dir(None) == tmp_path / "embedded"
    assert resolve_teacher_dir(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path / "missing"))):
        resolve_teacher_dir(tmp_path / "missing")


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    return save_tiny_teacher(tmp_path_factory.mktemp("teacher"))


DATA = [{"text": f"Fact number {i}: the sky over city {i} is blue at noon."} for i in range(8)] + [
    {"messages": [{"role": "user", "content": f"Count to {i}."}, {"role": "assistant", "content": "1 2 3."}]}
    for i in range(8)
]


@pytest.mark.parametrize("calibration_samples", [None, 2])
def test_run_distill_trains_on_the_training_share_only(teacher, tmp_path, monkeypatch, calibration_samples):
    """Calibration (on the first calibration_samples) and distillation see only training examples, the
    evaluation exactly the held-out ones; the report and eval.json say so."""
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in DATA))
    settings = DistillSettings(
        num_key_value_layers=2,
        steps=1,
        greedy_tokens=0,
        batch_tokens=256,
        seed=3,
        logits_loss_temp=1.0,
        hidden_loss_mult=0.5,
        calibration_samples=calibration_samples,
    )
    train, heldout = split_holdout(load_jsonl(data, load_tokenizer(teacher)), settings.holdout_share, seed=3)
    assert train and heldout
    seen = {"calibrate": [], "distill": [], "evaluate": []}

    def spy(name, real, get):
        def wrapper(*args, **kwargs):
            seen[name].append(get(*args, **kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(pipeline, name, wrapper)

    def sequences(batches):
        return sorted(
            tuple(ids[mask].tolist()) for b in batches for ids, mask in zip(b.input_ids, b.attention_mask)
        )

    spy("calibrate", pipeline.calibrate, lambda teacher, batches, *a, **k: sequences(batches))
    caches = []

    def distill_args(student, batches, config, **kwargs):
        caches.append((batches, kwargs["teacher_cache"]))
        return sequences(batches), config

    spy("distill", pipeline.distill, distill_args)
    spy(
        "evaluate",
        pipeline.evaluate,
        lambda teacher, student, heldout, **k: sorted(e.token_ids for e in heldout),
    )

    report = run_distill(teacher, tmp_path / "out", settings, data_path=data)
    want_train = sorted(e.token_ids for e in train)
    assert calibration_samples is None or calibration_samples < len(train)  # a real subset
    want_fit = sorted(e.token_ids for e in train[:calibration_samples])
    assert seen["calibrate"] == [want_fit] and seen["distill"] == [(want_train, settings.distill_config())]
    assert seen["evaluate"] == [sorted(e.token_ids for e in heldout)] * 2  # calibrated, then distilled
    # calibration's teacher pass kept distillation's batches that it saw (all of them if it read them all)
    ((train_batches, cache),) = caches
    if calibration_samples is None:
        assert set(cache.outputs) == {cache.key(b) for b in train_batches} and cache.num_misses == 0
    else:
        assert set(cache.outputs) <= {cache.key(b) for b in train_batches}
    assert (report.num_train_examples, report.num_heldout_examples) == (len(train), len(heldout))
    assert report.num_train_tokens == sum(len(e) for e in train)
    assert list(report.results) == ["calibrated", "distilled"]
    assert {"data", "calibrate", "distill", "evaluate"} <= set(report.seconds)
    assert report.out_dir == tmp_path / "out" and report.config.num_key_value_layers == 2
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    resolved = saved["settings"].pop("resolved_precision")  # what "auto" measured on this machine
    assert saved["settings"].pop("distill_precision") == resolved  # the steps ran in it too
    assert saved["settings"] == settings.cache_key() and resolved in ("fp32", "bf16")
    assert saved["results"]["distilled"]["num_examples"] == len(heldout)


def test_a_bf16_teacher_is_scored_as_its_student_is_written(tmp_path, monkeypatch):
    """The final evaluation reads the weights rounded to the teacher's bf16, as the checkpoint holds them."""
    teacher = save_tiny_teacher(tmp_path / "teacher", dtype=torch.bfloat16)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in DATA))
    scored = []

    real = pipeline.evaluate

    def evaluate(teacher, student, heldout, **kwargs):
        scored.append({k: v.detach().clone() for k, v in student.state_dict().items()})
        return real(teacher, student, heldout, **kwargs)

    monkeypatch.setattr(pipeline, "evaluate", evaluate)
    settings = DistillSettings(num_key_value_layers=2, greedy_tokens=0, batch_tokens=256, seed=3)
    report = run_distill(teacher, tmp_path / "out", settings, data_path=data)
    saved = load_state_dict(report.out_dir, dtype=None)
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    (weights,) = scored
    assert weights.keys() == saved.keys()
    assert all(torch.equal(weights[k], saved[k].float()) for k in saved)


@pytest.mark.parametrize("resolved, matmul_precision", [("bf16", "high"), ("fp32", "highest")])
def test_the_resolved_precision_reaches_the_data_and_the_calibration(
    teacher, tmp_path, monkeypatch, resolved, matmul_precision
):
    """The precision is resolved once, before the teacher writes its answers: bf16 lets the engine take
    bf16x3 products (matmul_precision "high"), and calibration's pass runs in it; eval.json names it."""
    import swiftkv_fast

    seen = {}
    examples = load_jsonl(_write(tmp_path / "data.jsonl", DATA), load_tokenizer(teacher))

    class RecordingLLM:
        def __init__(self, model, **kwargs):
            seen["llm"] = kwargs

    def calibrate(*args, **kwargs):
        seen["calibrate"] = kwargs["precision"]
        return real_calibrate(*args, **kwargs)

    real_calibrate = pipeline.calibrate
    monkeypatch.setattr(pipeline, "resolve_precision", lambda precision, model, device: resolved)
    monkeypatch.setattr(swiftkv_fast, "LLM", RecordingLLM)
    monkeypatch.setattr(pipeline, "generate_teacher_data", lambda llm, prompts, **kwargs: examples)
    monkeypatch.setattr(pipeline, "calibrate", calibrate)
    settings = DistillSettings(num_key_value_layers=2, greedy_tokens=0, batch_tokens=256)
    run_distill(teacher, tmp_path / "out", settings)
    assert seen == {"llm": seen["llm"], "calibrate": resolved}
    assert seen["llm"]["matmul_precision"] == matmul_precision
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["settings"]["resolved_precision"] == resolved and saved["settings"]["precision"] == "auto"


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def plain_teacher(path, seed=0):
    config = tiny_config(num_hidden_layers=4)
    save_checkpoint(path, config, random_state_dict(config, seed=seed))
    (path / "tokenizer.json").write_text("{}")
    return path


class FakeRun:
    """run_distill that writes a checkpoint's marker files, or fails the test once `allowed` runs are used."""

    def __init__(self, allowed: int):
        self.calls = []
        self.allowed = allowed

    def __call__(self, teacher_dir, out_dir, settings, *, overwrite=False, **kwargs):
        if len(self.calls) >= self.allowed:
            raise AssertionError("the cached student should have been reused")
        self.calls.append((teacher_dir, out_dir, settings, overwrite))
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text("{}")
        (out_dir / "eval.json").write_text("{}")


def test_cached_student_distills_once(teacher, tmp_path, monkeypatch):
    settings = DistillSettings(
        num_key_value_layers=2, num_samples=8, max_tokens=4, greedy_tokens=2, batch_tokens=256
    )
    path, cached = cached_student(teacher, settings, cache_root=tmp_path / "cache")
    assert not cached and path.parent == tmp_path / "cache"
    assert re.fullmatch(r"L2-G1-[0-9a-f]{16}", path.name)
    assert json.loads((path / "config.json").read_text())["num_key_value_layers"] == 2
    assert (path / "eval.json").is_file() and (path / "model.safetensors").is_file()
    monkeypatch.setattr(pipeline, "run_distill", FakeRun(allowed=0))
    assert cached_student(teacher, settings, cache_root=tmp_path / "cache") == (path, True)
    assert cached_student(str(teacher), settings, cache_root=str(tmp_path / "cache")) == (path, True)


def test_cached_student_keys(tmp_path, monkeypatch):
    run = FakeRun(allowed=100)
    monkeypatch.setattr(pipeline, "run_distill", run)
    monkeypatch.setattr(pipeline, "STUDENTS_KEPT", 100)  # every key's student stays to be looked up again
    teacher = plain_teacher(tmp_path / "teacher")
    root = tmp_path / "cache"
    base = DistillSettings(num_key_value_layers=2)
    first, cached = cached_student(teacher, base, cache_root=root)
    assert not cached and run.calls == [(teacher, first, base, True)]
    assert cached_student(teacher, base, cache_root=root) == (first, True)
    on_another_device = DistillSettings(num_key_value_layers=2, device="cpu:0")
    assert cached_student(teacher, on_another_device, cache_root=root) == (first, True)
    paths = {first}
    for other in (
        DistillSettings(num_key_value_layers=1),
        DistillSettings(num_key_value_layers=2, key_value_group_size=2),
        DistillSettings(num_key_value_layers=2, steps=3),
        DistillSettings(num_key_value_layers=2, seed=1),
        DistillSettings(num_key_value_layers=2, ridge=1e-3),
        DistillSettings(num_key_value_layers=2, weighting="uniform"),
    ):
        path, cached = cached_student(teacher, other, cache_root=root)
        assert not cached and path not in paths
        paths.add(path)
    assert len(run.calls) == 7

    copy = shutil.copytree(teacher, tmp_path / "copy")
    assert teacher_fingerprint(copy) == teacher_fingerprint(teacher)
    assert cached_student(copy, base, cache_root=root) == (first, True)  # the files, not the path
    for name, change in (
        ("model.safetensors", lambda p: plain_teacher(p.parent, seed=1)),
        ("tokenizer.json", lambda p: p.write_text('{"changed": true}')),
        (
            "config.json",
            lambda p: p.write_text(json.dumps(json.loads(p.read_text()) | {"rms_norm_eps": 1e-6})),
        ),
    ):
        changed = shutil.copytree(teacher, tmp_path / f"changed-{name}")
        before = teacher_fingerprint(changed)
        change(changed / name)
        assert teacher_fingerprint(changed) != before, name
        path, cached = cached_student(changed, base, cache_root=root)
        assert not cached and path != first and path.name.startswith("L2-G1-"), name
    (teacher / "notes.txt").write_text("not part of the model")
    assert cached_student(teacher, base, cache_root=root) == (first, True)

    prompts = pipeline.builtin_prompts()  # another built-in prompt set: another student
    monkeypatch.setattr(data_module, "builtin_prompts", lambda: [*prompts, "One more prompt."])
    path, cached = cached_student(teacher, base, cache_root=root)
    assert not cached and path != first
    monkeypatch.setattr(data_module, "builtin_prompts", lambda: prompts)
    assert cached_student(teacher, base, cache_root=root) == (first, True)


def test_cached_student_redoes_an_incomplete_entry_and_uses_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SWIFTKV_CACHE", str(tmp_path / "user-cache"))
    run = FakeRun(allowed=2)
    monkeypatch.setattr(pipeline, "run_distill", run)
    teacher = plain_teacher(tmp_path / "teacher")
    settings = DistillSettings(num_key_value_layers=2)
    path, cached = cached_student(teacher, settings)
    assert not cached and path.parent == tmp_path / "user-cache" / "students"
    (path / "eval.json").unlink()  # e.g. interrupted between the checkpoint and its evaluation
    assert cached_student(teacher, settings) == (path, False)
    assert run.calls[-1][3] is True  # overwrite: the old checkpoint is replaced
    assert cached_student(teacher, settings) == (path, True)


def test_prune_students_keeps_the_most_recently_used(tmp_path, caplog):
    root = tmp_path / "students"
    names = [f"L15-G1-{i:016x}" for i in range(5)]
    for age, name in enumerate(names):  # names[0] the newest, names[4] the oldest
        d = root / name
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
        os.utime(d, (1e9 - age * 3600, 1e9 - age * 3600))
    (root / "notes").mkdir()  # not a student: never touched
    (root / "L15-G1-tmp").mkdir()
    with caplog.at_level(logging.INFO, logger=pipeline.__name__):
        removed = prune_students(root, keep=3, protect=root / names[4])  # the one just written stays
    assert sorted(p.name for p in removed) == sorted(names[2:4])
    assert sorted(p.name for p in root.iterdir()) == sorted([*names[:2], names[4], "notes", "L15-G1-tmp"])
    assert "removed 2 cached student(s)" in caplog.text
    assert prune_students(root, keep=3) == []
    with pytest.raises(ValueError, match="keep"):
        prune_students(root, keep=0)


def test_an_interrupted_prune_leaves_no_student_that_looks_complete(tmp_path, monkeypatch):
    root = tmp_path / "students"
    for age, name in enumerate(["L2-G1-" + "a" * 16, "L2-G1-" + "b" * 16]):
        (root / name).mkdir(parents=True)
        for f in ("config.json", "eval.json", "model.safetensors"):
            (root / name / f).write_text("{}")
        os.utime(root / name, (1e9 - age, 1e9 - age))

    def interrupted(path, *args, **kwargs):
        (Path(path) / "model.safetensors").unlink()  # half way
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline.shutil, "rmtree", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prune_students(root, keep=1)
    # the older student is out of the names cached_student looks up, though its files are half there
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["L2-G1-" + "a" * 16]
    monkeypatch.undo()
    assert prune_students(root, keep=1) == []  # and the next prune clears what was left
    assert [p.name for p in root.iterdir()] == ["L2-G1-" + "a" * 16]


def test_cached_student_prunes_after_a_new_fit_and_a_hit_counts_as_use(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "run_distill", FakeRun(allowed=100))
    monkeypatch.setattr(pipeline, "STUDENTS_KEPT", 2)
    teacher = plain_teacher(tmp_path / "teacher")
    root = tmp_path / "cache"
    paths = []
    for seed in range(2):
        path, _ = cached_student(teacher, DistillSettings(num_key_value_layers=2, seed=seed), cache_root=root)
        os.utime(path, (1e9 + seed, 1e9 + seed))  # seed 0 the older
        paths.append(path)
    assert cached_student(teacher, DistillSettings(num_key_value_layers=2, seed=0), cache_root=root)[1]
    third, cached = cached_student(teacher, DistillSettings(num_key_value_layers=2, seed=2), cache_root=root)
    assert not cached
    # seed 0 was used last (the hit), so seed 1 is the least recently used one
    assert paths[0].is_dir() and third.is_dir() and not paths[1].exists()
