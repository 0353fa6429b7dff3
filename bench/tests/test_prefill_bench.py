"""`bench prefill` end to end on the embedded model at a tiny size, in fp32 and in bf16 (`--dtype`)."""

from __future__ import annotations

import json

import pytest

from bench import engine, prefill
from bench.__main__ import build_parser


@pytest.mark.parametrize("dtype, short", [("float32", "fp32"), ("bfloat16", "bf16")])
def test_prefill_runs_its_engines_in_the_dtype_asked(dtype, short, monkeypatch, tmp_path, capsys):
    built = []
    build_llm = engine.build_llm

    def recording(*args, **kwargs):
        llm = build_llm(*args, **kwargs)
        plan = llm.get_kernel_plan()
        built.append((plan["dtype"], plan["kv_cache_dtype"]))
        return llm

    monkeypatch.setattr(engine, "build_llm", recording)
    argv = ["prefill", "--layers", "30,15", "--lengths", "32", "--tokens-per-batch", "64", "--dtype", dtype]
    args = build_parser().parse_args([*argv, "--repeat", "1", "--warmup", "0", "--out", str(tmp_path)])
    assert prefill.run(args) == 0
    result = json.loads((tmp_path / "prefill.json").read_text())
    assert result["settings"]["dtype"] == dtype and built == [(dtype, dtype)] * 2
    assert [r["num_key_value_layers"] for r in result["results"]] == [30, 15]
    assert f"SmolLM2-135M-Instruct {short} (N=30)" in capsys.readouterr().out
