"""`swiftkv distill` / `swiftkv eval` through `swiftkv_fast.cli.main`, end to end on a tiny random Llama
with the embedded model's tokenizer (the teacher writes its own data, the student loads in `LLM`); bad
input is one line on stderr, exit status 2, refused before the teacher answers anything, and writes
nothing; `swiftkv_fast` dispatches to this package without importing it for other commands."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import swiftkv_distill.pipeline as pipeline
import swiftkv_fast.cli as fast_cli
from swiftkv_distill.trainer_state import META_FILE, TENSORS_FILE, checkpoint_path
from swiftkv_fast.cli import main
from swiftkv_reference.checkpoint import save_checkpoint
from swiftkv_reference.testing import random_state_dict, tiny_config
from tiny_teacher import NUM_HIDDEN_LAYERS, save_tiny_teacher

DATA_FLAGS = ["--num-samples", "12", "--max-tokens", "8", "--greedy-tokens", "4"]
FAST = [*DATA_FLAGS, "--batch-tokens", "256"]
STUDENT_FILES = {
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
    "eval.json",
}
DATA = [
    {"text": "The capital of France is Paris, a city on the Seine."},
    {"text": "Water boils at one hundred degrees Celsius at sea level."},
    {"text": "A haiku has three lines of five, seven and five syllables."},
    {
        "messages": [
            {"role": "user", "content": "Name a primary colour."},
            {"role": "assistant", "content": "Red."},
        ]
    },
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four."},
        ]
    },
    {"messages": [{"role": "user", "content": "Say hello."}, {"role": "assistant", "content": "Hello!"}]},
]


def run(*argv) -> tuple[int, str, str]:
    """main(argv) -> (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


def snapshot(root: Path) -> dict[str, bytes | None]:
    return {str(p.relative_to(root)): p.read_bytes() if p.is_file() else None for p in root.rglob("*")}


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return save_tiny_teacher(tmp_path_factory.mktemp("teacher"))


@pytest.fixture(scope="module")
def student(teacher, tmp_path_factory):
    """(out, stdout) of `swiftkv distill TEACHER OUT -L 2` (calibration only, the teacher's own data)."""
    out = tmp_path_factory.mktemp("run") / "student"
    rc, stdout, stderr = run("distill", teacher, out, "-L", "2", *FAST)
    assert rc == 0, stderr
    return out, stdout


def test_distill_writes_a_swiftkv_checkpoint(student):
    out, stdout = student
    assert {p.name for p in out.iterdir()} >= STUDENT_FILES
    assert [p.name for p in out.parent.iterdir()] == ["student"]  # no staging directory left behind
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama_swiftkv"
    assert (config["num_hidden_layers"], config["num_key_value_layers"]) == (NUM_HIDDEN_LAYERS, 2)
    assert (config["key_value_group_size"], config["swiftkv"]) == (1, True)
    report = json.loads((out / "eval.json").read_text())
    assert list(report["results"]) == ["calibrated"]
    result = report["results"]["calibrated"]
    assert (result["num_key_value_layers"], result["num_hidden_layers"], result["greedy_tokens"]) == (2, 4, 4)
    assert 0 <= result["top1_agreement"] <= 1 and result["kl"] >= 0 and result["num_answer_tokens"] > 0
    assert report["settings"]["num_samples"] == 12 and report["settings"]["max_tokens"] == 8
    assert "device" not in report["settings"]
    assert "top-1 agree" in stdout and "calibrated" in stdout
    assert f"wrote {out}" in stdout


def test_student_serves_in_the_fast_engine(student):
    from swiftkv_fast import LLM, SamplingParams

    out, _ = student
    llm = LLM(str(out), max_model_len=64, num_kv_blocks=16)
    assert (llm.config.num_key_value_layers, llm.config.key_value_group_size) == (2, 1)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    (result,) = llm.chat([{"role": "user", "content": "What is the capital of France?"}], params)
    assert len(result.outputs[0].token_ids) == 5
    assert isinstance(result.outputs[0].text, str)


def test_eval_reproduces_the_distill_evaluation(teacher, student, tmp_path):
    out, _ = student
    rc, stdout, stderr = run("eval", teacher, out, *DATA_FLAGS, "--out", tmp_path / "report")
    assert rc == 0, stderr
    assert "top-1 agree" in stdout and "student" in stdout and "2/4" in stdout
    got = json.loads((tmp_path / "report" / "eval.json").read_text())["results"]["student"]
    want = json.loads((out / "eval.json").read_text())["results"]["calibrated"]
    # the same data (seeded teacher answers), the same held-out split, the same weights
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


def test_data_file_and_distillation_steps(teacher, tmp_path, monkeypatch):
    def no_generation(*args, **kwargs):
        raise AssertionError("--data must not make the teacher generate")

    monkeypatch.setattr(pipeline, "generate_teacher_data", no_generation)
    data = write_jsonl(tmp_path / "data.jsonl", DATA)
    out = tmp_path / "student"
    rc, stdout, stderr = run(
        "distill",
        teacher,
        out,
        "-L",
        "2",
        "-G",
        "2",
        "--data",
        data,
        "--steps",
        "2",
        "--precision",
        "bf16",
        "--logits-loss-temp",
        "1.5",
        "--hidden-loss-mult",
        "0",
        *FAST,
    )
    assert rc == 0, stderr
    report = json.loads((out / "eval.json").read_text())
    assert list(report["results"]) == ["calibrated", "distilled"]
    assert report["settings"]["steps"] == 2
    settings = report["settings"]
    assert settings["precision"] == settings["resolved_precision"] == settings["distill_precision"] == "bf16"
    assert (report["settings"]["logits_loss_temp"], report["settings"]["hidden_loss_mult"]) == (1.5, 0.0)
    assert report["results"]["distilled"]["key_value_group_size"] == 2
    assert "calibrated" in stdout and "distilled" in stdout
    config = json.loads((out / "config.json").read_text())
    assert (config["num_key_value_layers"], config["key_value_group_size"]) == (2, 2)


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> Path:
    """A tiny plain 4-layer checkpoint without tokenizer files: everything below fails before needing one."""
    config = tiny_config(num_hidden_layers=NUM_HIDDEN_LAYERS)
    return save_checkpoint(tmp_path_factory.mktemp("plain"), config, random_state_dict(config))


@pytest.fixture
def no_work(monkeypatch):
    """Every stage after the checks fails the test if it is reached."""

    def fail(*args, **kwargs):
        raise AssertionError("the input should have been refused before any work")

    for name in ("load_examples", "generate_teacher_data", "load_model", "calibrate", "distill"):
        monkeypatch.setattr(pipeline, name, fail)


def swiftkv_checkpoint(root: Path) -> Path:
    config = tiny_config(model_type="llama_swiftkv", num_hidden_layers=4, num_key_value_layers=2)
    return save_checkpoint(root / "swiftkv-teacher", config, random_state_dict(config))


def a_file(root: Path) -> Path:
    (root / "file").write_text("")
    return root / "file"


def non_empty(root: Path) -> Path:
    (root / "out").mkdir()
    (root / "out" / "notes.txt").write_text("mine")
    return root / "out"


REFUSALS = {  # name: (argv after "distill" given (model, out, tmp_path), what the message says)
    "L=0": (lambda m, o, t: [m, o, "-L", "0"], "num_key_value_layers must be an int >= 1"),
    "L=N": (lambda m, o, t: [m, o, "-L", "4"], "num_key_value_layers must be in [1, 4)"),
    "L>N": (lambda m, o, t: [m, o, "-L", "9"], "num_key_value_layers must be in [1, 4)"),
    "G does not divide N-L": (
        lambda m, o, t: [m, o, "-L", "1", "-G", "2"],
        "key_value_group_size=2 must divide",
    ),
    "G=0": (lambda m, o, t: [m, o, "-L", "2", "-G", "0"], "key_value_group_size must be an int >= 1"),
    "holdout share": (lambda m, o, t: [m, o, "-L", "2", "--holdout-share", "1"], "holdout_share"),
    "temperature": (lambda m, o, t: [m, o, "-L", "2", "--temperature", "nan"], "temperature"),
    "num samples": (lambda m, o, t: [m, o, "-L", "2", "--num-samples", "1"], "num_samples"),
    "device": (lambda m, o, t: [m, o, "-L", "2", "--device", "tpu"], "device"),
    "non-empty output": (lambda m, o, t: [m, non_empty(t), "-L", "2"], "is not empty"),
    "output is the model": (lambda m, o, t: [m, m, "-L", "2", "--overwrite"], "same directory"),
    "missing model": (lambda m, o, t: [t / "missing", o, "-L", "2"], "does not exist"),
    "too many paths": (lambda m, o, t: [m, o, t / "third", "-L", "2"], "expected [MODEL] OUT, got 3 paths"),
    "SwiftKV teacher": (lambda m, o, t: [swiftkv_checkpoint(t), o, "-L", "2"], "already a SwiftKV model"),
    "model without a tokenizer": (lambda m, o, t: [m, o, "-L", "2"], "cannot load the tokenizer of"),
    "missing data file": (lambda m, o, t: [m, o, "-L", "2", "--data", t / "none.jsonl"], "is not a file"),
    "resume without a checkpoint dir": (
        lambda m, o, t: [m, o, "-L", "2", "--steps", "2", "--resume"],
        "resume (--resume) needs a checkpoint_dir (--checkpoint-dir)",
    ),
    "checkpoint dir without steps": (
        lambda m, o, t: [m, o, "-L", "2", "--checkpoint-dir", t / "ckpt"],
        "need distillation steps (--steps N)",
    ),
    "checkpoint dir is a file": (
        lambda m, o, t: [m, o, "-L", "2", "--steps", "2", "--checkpoint-dir", a_file(t)],
        "is not a directory",
    ),
}


def assert_refused(argv, message: str, root: Path) -> None:
    before = snapshot(root)
    rc, stdout, stderr = run(*argv)
    lines = stderr.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("swiftkv: error: "), stderr
    assert message in lines[0], lines[0]
    assert stdout == ""
    assert snapshot(root) == before


@pytest.mark.parametrize("case", REFUSALS, ids=list(REFUSALS))
def test_bad_input_is_refused_before_any_work(plain, tmp_path, no_work, case):
    argv, message = REFUSALS[case]
    args = ["distill", *argv(plain, tmp_path / "out", tmp_path)]
    teacher_files = snapshot(plain)
    assert_refused(args, message, tmp_path)
    assert not (tmp_path / "out").exists() or case == "non-empty output"
    assert snapshot(plain) == teacher_files


def test_a_checkpoint_dir_holding_checkpoints_needs_resume(plain, tmp_path, no_work):
    step = checkpoint_path(tmp_path / "ckpt", 2)
    step.mkdir(parents=True)
    (step / META_FILE).write_text("{}")
    (step / TENSORS_FILE).write_bytes(b"")
    flags = ["-L", "2", "--steps", "2", "--checkpoint-dir", tmp_path / "ckpt"]
    assert_refused(
        ["distill", plain, tmp_path / "out", *flags], "already holds distillation checkpoints", tmp_path
    )


DATA_REFUSALS = {  # name: (the data file's lines, what the message says)
    "empty file": ("", "no examples (the file is empty)"),
    "blank lines only": ("\n  \n", "no examples"),
    "malformed line": (json.dumps(DATA[0]) + "\n\n{not json\n", "data.jsonl, line 3: malformed JSON"),
    "neither text nor messages": (json.dumps({"prompt": "x"}) + "\n", "line 1"),
    "one prompt only": (
        json.dumps(DATA[0]) + "\n" + json.dumps(DATA[0]) + "\n",
        "at least 2 distinct prompts",
    ),
}


@pytest.mark.parametrize("case", DATA_REFUSALS, ids=list(DATA_REFUSALS))
def test_bad_data_is_refused_before_the_teacher_runs(teacher, tmp_path, monkeypatch, case):
    def fail(*args, **kwargs):
        raise AssertionError("bad data should have been refused before any work")

    for name in ("generate_teacher_data", "load_model", "calibrate", "distill"):
        monkeypatch.setattr(pipeline, name, fail)
    text, message = DATA_REFUSALS[case]
    data = tmp_path / "data.jsonl"
    data.write_text(text)
    assert_refused(["distill", teacher, tmp_path / "out", "-L", "2", "--data", data], message, tmp_path)
    assert not (tmp_path / "out").exists()


def test_eval_refuses_bad_paths_a_plain_student_and_a_swiftkv_teacher(plain, tmp_path, no_work):
    swiftkv = swiftkv_checkpoint(tmp_path)
    assert_refused(["eval", plain, plain], "is not a SwiftKV checkpoint", tmp_path)
    assert_refused(["eval", swiftkv, swiftkv], "already a SwiftKV model", tmp_path)
    assert_refused(["eval", tmp_path / "missing", swiftkv], "TEACHER", tmp_path)
    assert_refused(["eval", plain, swiftkv, "--out", a_file(tmp_path)], "is not a directory", tmp_path)


def test_eval_refuses_a_student_of_another_model(plain, tmp_path, no_work):
    config = tiny_config(
        model_type="llama_swiftkv", num_hidden_layers=6, num_key_value_layers=2, hidden_size=96, head_dim=48
    )
    other = save_checkpoint(tmp_path / "other", config, random_state_dict(config))
    assert_refused(["eval", plain, other], "num_hidden_layers", tmp_path)


@pytest.mark.parametrize("command, flag", [("distill", "--num-key-value-layers"), ("eval", "--out")])
def test_help(command, flag):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    assert out.getvalue().startswith(f"usage: swiftkv {command}")
    assert flag in out.getvalue() and "--num-samples" in out.getvalue() and "--data" in out.getvalue()


def _python(code_or_args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.run(
        [sys.executable, *code_or_args], capture_output=True, text=True, env=env, timeout=120
    )


def test_python_m_swiftkv_distill_help():
    done = _python(["-m", "swiftkv_distill", "--help"])
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m swiftkv_distill")
    assert "distill" in done.stdout and "eval" in done.stdout


def test_serving_does_not_import_training_code():
    code = (
        "import sys\n"
        "from swiftkv_fast.cli import main\n"
        "try:\n"
        "    main(['generate', '--help'])\n"
        "except SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'swiftkv_distill'))\n"
    )
    done = _python(["-c", code])
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    "argv", [["distill", "out", "-L", "2"], ["distill"], ["eval", "a", "b"], ["eval", "--help"]]
)
def test_without_the_package_swiftkv_says_how_to_install_it(monkeypatch, argv):
    real_find_spec = fast_cli.importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "swiftkv_distill" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(fast_cli.importlib.util, "find_spec", find_spec)
    rc, stdout, stderr = run(*argv)
    assert rc == 2 and stdout == ""
    assert "pip install swiftkv-distill" in stderr and argv[0] in stderr
