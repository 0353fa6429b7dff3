"""The `swiftkv` command line on tiny checkpoints: every user error is one line on stderr and exit
status 2, while a bug keeps its traceback; `convert` never serves stale weights or destroys its source."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from swiftkv_fast import LLM, SamplingParams
from swiftkv_fast.cli import main
from swiftkv_reference.checkpoint import save_checkpoint
from swiftkv_reference.testing import random_state_dict, tiny_config

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SMALL = ["--max-model-len", "64", "--kv-cache-memory", str(1 << 20)]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A plain 4-layer checkpoint without tokenizer files."""
    path = tmp_path_factory.mktemp("ckpt") / "plain"
    config = tiny_config(num_hidden_layers=4)
    save_checkpoint(path, config, random_state_dict(config, seed=0))
    return path


@pytest.mark.parametrize("command", [["generate"], ["serve"]])
def test_engine_flag_defaults_are_engine_config_defaults(command, monkeypatch):
    import dataclasses

    from swiftkv_fast.cli import _engine_kwargs, build_parser
    from swiftkv_fast.config import EngineConfig

    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    kwargs = _engine_kwargs(build_parser().parse_args(command))
    assert kwargs == {name: fields[name].default for name in kwargs}
    monkeypatch.setattr(fields["block_size"], "default", 32)  # one definition: the CLI follows it
    monkeypatch.setattr(fields["max_num_seqs"], "default", 8)
    kwargs = _engine_kwargs(build_parser().parse_args(command))
    assert kwargs["block_size"] == 32 and kwargs["max_num_seqs"] == 8


def test_matmul_precision_flag_reaches_the_engine():
    from swiftkv_fast.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(["generate", "--matmul-precision", "high", "--linear-kernel", "bf16x3"])
    kwargs = _engine_kwargs(args)
    assert kwargs["matmul_precision"] == "high" and kwargs["linear_kernel"] == "bf16x3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--matmul-precision", "medium"])


def test_kv_cache_dtype_flag_reaches_the_engine():
    from swiftkv_fast.cli import _engine_kwargs, build_parser

    assert (
        _engine_kwargs(build_parser().parse_args(["serve", "--kv-cache-dtype", "bfloat16"]))["kv_cache_dtype"]
        == "bfloat16"
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--kv-cache-dtype", "fp8"])


def _broken_dirs(root: Path, ckpt: Path) -> dict[str, Path]:
    pickle_only = root / "pickle_only"
    pickle_only.mkdir()
    shutil.copy(ckpt / "config.json", pickle_only)
    torch.save({"x": torch.zeros(1)}, pickle_only / "pytorch_model.bin")
    bad_config = root / "bad_config"
    shutil.copytree(ckpt, bad_config)
    (bad_config / "config.json").write_text("[1, 2]")
    return {"pickle_only": pickle_only, "bad_config": bad_config}


def _run(argv, capsys) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _assert_one_line_error(rc: int, out: str, err: str, match: str) -> None:
    assert rc == 2, (rc, out, err)
    assert err.startswith("swiftkv: error: ") and err.count("\n") == 1, err
    assert match in err, err
    assert "Traceback" not in err and out == ""


GENERATE_ERRORS = [
    (["--prompts-file", "{tmp}/missing.txt"], "--prompts-file"),
    (["--model", "{tmp}/nowhere"], "does not exist"),
    (["--model", "{ckpt}/config.json"], "checkpoint directory"),
    (["--model", "{pickle_only}"], "pickle"),
    (["--model", "{bad_config}"], "config.json must hold a JSON object"),
    (["--top-p", "2"], "top_p"),
    (["--temperature", "-1"], "temperature"),
    (["--max-tokens", "0"], "max_tokens"),
    (["--block-size", "0"], "block_size"),
    (["--dtype", "int8"], "dtype"),
    (["--num-key-value-layers", "9"], "num_key_value_layers"),
    (["--kv-cache-memory", str(10**15)], "kv_cache_memory"),
    (["--linear-kernel", "bf16x3"], "needs matmul_precision='high'"),
    ([], "tokenizer"),  # a text prompt on a checkpoint without tokenizer files
    pytest.param(["--device", "cuda"], "cuda", marks=NO_CUDA),
]


@pytest.mark.parametrize("flags,match", GENERATE_ERRORS)
def test_generate_user_errors_are_one_line(tmp_path, ckpt, capsys, flags, match):
    paths = {"tmp": tmp_path, "ckpt": ckpt, **_broken_dirs(tmp_path, ckpt)}
    flags = [f.format(**paths) for f in flags]
    if "--model" not in flags:
        flags += ["--model", str(ckpt)]
    _assert_one_line_error(*_run(["generate", "--prompt", "hi", *SMALL, *flags], capsys), match)


def test_no_prompts_is_one_line(ckpt, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n  \n"))
    _assert_one_line_error(*_run(["generate", "--model", ckpt, *SMALL], capsys), "no prompts")


def test_a_bug_keeps_its_traceback(ckpt, monkeypatch):
    def broken(*args, **kwargs):
        raise KeyError("an internal bug")

    monkeypatch.setattr(LLM, "__init__", broken)
    with pytest.raises(KeyError, match="an internal bug"):
        main(["generate", "--model", str(ckpt), "--prompt", "hi"])


CONVERT_ERRORS = [
    (["{ckpt}", "{ckpt}", "-L", "2"], "same directory"),
    (["{ckpt}", "{ckpt}/../plain/", "-L", "2", "--overwrite"], "same directory"),
    (["{tmp}/nowhere", "{tmp}/out", "-L", "2"], "does not exist"),
    (["{ckpt}", "{ckpt}/config.json", "-L", "2"], "not a directory"),
    (["{ckpt}", "{tmp}/out", "-L", "0"], "num_key_value_layers"),
    (["{ckpt}", "{tmp}/out", "-L", "9"], "num_key_value_layers"),
    (["{ckpt}", "{tmp}/out", "-L", "1", "-G", "2"], "key_value_group_size"),
    (["{pickle_only}", "{tmp}/out", "-L", "2"], "pickle"),
]


@pytest.mark.parametrize("args,match", CONVERT_ERRORS)
def test_convert_user_errors_are_one_line(tmp_path, ckpt, capsys, args, match):
    paths = {"tmp": tmp_path, "ckpt": ckpt, **_broken_dirs(tmp_path, ckpt)}
    args = [a.format(**paths) for a in args]
    args = [{"-L": "--num-key-value-layers", "-G": "--key-value-group-size"}.get(a, a) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    _assert_one_line_error(*_run(["convert", *args], capsys), match)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, nothing left behind
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "model.safetensors"]


def _tokens(llm: LLM) -> list[list[int]]:
    outs = llm.generate([[5, 6, 7, 8], [9, 10, 11]], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_convert_over_a_stale_sharded_checkpoint(tmp_path, ckpt, capsys):
    stale = tiny_config(num_hidden_layers=4)
    dst = tmp_path / "dst"
    save_checkpoint(dst, stale, random_state_dict(stale, seed=7), max_shard_bytes=100_000)
    engine = dict(max_model_len=64, num_kv_blocks=32)
    stale_tokens = _tokens(LLM(str(dst), **engine))
    argv = ["convert", ckpt, dst, "--num-key-value-layers", "2"]
    _assert_one_line_error(*_run(argv, capsys), "--overwrite")
    assert _tokens(LLM(str(dst), **engine)) == stale_tokens
    rc, out, err = _run([*argv, "--overwrite"], capsys)
    assert (rc, err) == (0, "") and out == f"wrote {dst}\n"
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors"]
    want = _tokens(LLM(str(ckpt), num_key_value_layers=2, **engine))
    assert _tokens(LLM(str(dst), **engine)) == want != stale_tokens


@NO_CUDA
def test_installed_entry_point(tmp_path, ckpt):
    """The console script (or `python -m swiftkv_fast.cli`), without the Triton interpreter: the triton
    backend on CPU is a user error."""
    exe = shutil.which("swiftkv", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "swiftkv_fast.cli"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    argv = ["generate", "--model", str(ckpt), "--prompt", "hi", "--attention-backend", "triton", *SMALL]
    proc = subprocess.run(cmd + argv, env=env, capture_output=True, text=True, timeout=120)
    _assert_one_line_error(proc.returncode, proc.stdout, proc.stderr, "triton")
