"""The evaluation report: an aligned table, a JSON file that reads back, a plot (skipped, with a log
line, without matplotlib)."""

from __future__ import annotations

import json
import logging
import sys

import pytest
from swiftkv_distill.evaluate import EvalResult
from swiftkv_distill.report import format_table, plot, read_json, write_json, write_report


def _result(top1: float, kl: float, big_l: int = 15, greedy: float | None = 0.5) -> EvalResult:
    return EvalResult(
        num_examples=20,
        num_answer_tokens=2600,
        top1_agreement=top1,
        kl=kl,
        teacher_perplexity=3.25,
        student_perplexity=4.5,
        greedy_agreement=greedy,
        num_greedy_prompts=20 if greedy is not None else 0,
        greedy_tokens=32 if greedy is not None else 0,
        num_hidden_layers=30,
        num_key_value_layers=big_l,
        key_value_group_size=1,
    )


RESULTS = {"snowflake init": _result(0.552, 0.84, greedy=0.1), "calibrated": _result(0.7171, 0.35)}


def test_table_has_a_row_per_student_in_aligned_columns():
    text = format_table(RESULTS)
    lines = text.splitlines()
    assert lines[0] == lines[2] == lines[5] and set(lines[0]) == {"-", " "}
    header, init, calibrated = lines[1], lines[3], lines[4]
    assert header.split("  ")[0].strip() == "student" and "top-1 agree" in header and "KL" in header
    assert init.split() == ["snowflake", "init", "15/30", "1", "0.5520", "0.8400", "4.500", "0.100"]
    assert calibrated.split()[-4:] == ["0.7171", "0.3500", "4.500", "0.500"]
    assert len({len(line) for line in lines[:6]}) == 1  # every column right-aligned to one width
    assert "teacher perplexity 3.250" in lines[6] and "2600 answer tokens" in lines[6]
    assert format_table({"x": _result(0.9, 0.1, greedy=None)}).splitlines()[3].split()[-1] == "-"


def test_json_reads_back(tmp_path):
    path = write_json(tmp_path / "sub" / "eval.json", RESULTS, settings={"num_key_value_layers": 15})
    data = json.loads(path.read_text())
    assert list(data["results"]) == ["snowflake init", "calibrated"]
    assert data["settings"] == {"num_key_value_layers": 15}
    assert read_json(path) == RESULTS
    (tmp_path / "bad.json").write_text("[]")
    with pytest.raises(ValueError, match="not an evaluation report"):
        read_json(tmp_path / "bad.json")


def test_plot_is_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_report(tmp_path, RESULTS, name="eval")
    assert [p.name for p in paths] == ["eval.json", "eval.png"]
    assert paths[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_matplotlib_the_plot_is_skipped_with_a_log_line(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.INFO, logger="swiftkv_distill.report"):
        assert plot(tmp_path / "eval.png", RESULTS) is None
        paths = write_report(tmp_path, RESULTS)
    assert "matplotlib is not installed" in caplog.text
    assert [p.name for p in paths] == ["eval.json"] and not (tmp_path / "eval.png").exists()


def test_report_refuses_no_results_and_wrong_types(tmp_path):
    with pytest.raises(ValueError, match="no evaluation results"):
        format_table({})
    with pytest.raises(TypeError, match="result 'x' must be an EvalResult, got dict"):
        write_json(tmp_path / "e.json", {"x": {"top1_agreement": 1}})
