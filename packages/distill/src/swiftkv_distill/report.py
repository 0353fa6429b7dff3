"""Evaluation results as a table (a string: the CLI prints it), a JSON file and a PNG plot (matplotlib,
optional: `pip install swiftkv-distill[plot]`; without it the plot is skipped with a log line).

`results` maps a label ("snowflake init", "calibrated", "distilled", a checkpoint path) to the
`EvalResult` of that student against the same teacher and held-out data; order is kept.

    print(format_table(results))
    paths = write_report("out/", results, name="eval", settings={"num_key_value_layers": 15})
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .evaluate import EvalResult

logger = logging.getLogger(__name__)

COLUMNS = ("student", "L/N", "G", "top-1 agree", "KL", "perplexity", "greedy agree")


def format_table(results: Mapping[str, EvalResult]) -> str:
    """One row per student, right-aligned columns, and a line for the teacher's perplexity and the
    held-out data (taken from the first result)."""
    _check(results)
    rows = [
        [
            label,
            f"{r.num_key_value_layers}/{r.num_hidden_layers}",
            str(r.key_value_group_size),
            f"{r.top1_agreement:.4f}",
            f"{r.kl:.4f}",
            f"{r.student_perplexity:.3f}",
            "-" if r.greedy_agreement is None else f"{r.greedy_agreement:.3f}",
        ]
        for label, r in results.items()
    ]
    widths = [max(len(c) for c in column) for column in zip(COLUMNS, *rows)]
    rule = "  ".join("-" * w for w in widths)
    lines = [rule, _row(COLUMNS, widths), rule, *(_row(r, widths) for r in rows), rule]
    first = next(iter(results.values()))
    greedy = f"; greedy: first {first.greedy_tokens} tokens of {first.num_greedy_prompts} prompts"
    lines.append(
        f"teacher perplexity {first.teacher_perplexity:.3f}; held out: {first.num_examples} examples, "
        f"{first.num_answer_tokens} answer tokens" + (greedy if first.greedy_tokens else "")
    )
    return "\n".join(lines)


def _row(cells, widths) -> str:
    return "  ".join([cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])])


def write_json(path: str | os.PathLike, results: Mapping[str, EvalResult], **extra: Any) -> Path:
    """{"results": {label: EvalResult fields}, **extra} (extra: settings, timings; JSON-serialisable)."""
    _check(results)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"results": {label: r.to_dict() for label, r in results.items()}, **extra}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def read_json(path: str | os.PathLike) -> dict[str, EvalResult]:
    """The results of a file `write_json` wrote."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("results"), dict):
        raise ValueError(f"{path}: not an evaluation report (no 'results' object)")
    return {label: EvalResult.from_dict(r) for label, r in data["results"].items()}


def plot(path: str | os.PathLike, results: Mapping[str, EvalResult]) -> Path | None:
    """A PNG: top-1 and greedy agreement with the teacher per student (left), mean KL per student
    (right). None (and a log line) when matplotlib is not installed."""
    _check(results)
    try:
        import matplotlib
    except ImportError:
        logger.info("matplotlib is not installed: no plot (pip install 'swiftkv-distill[plot]')")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(results)
    xs = range(len(labels))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(8.0, 2.2 * len(labels) + 4), 4.0))
    width = 0.38
    top1 = [r.top1_agreement for r in results.values()]
    greedy = [math.nan if r.greedy_agreement is None else r.greedy_agreement for r in results.values()]
    left.bar([x - width / 2 for x in xs], top1, width, label="top-1 (teacher-forced)")
    left.bar([x + width / 2 for x in xs], greedy, width, label="greedy (first tokens equal)")
    for x, v in zip(xs, top1):
        left.annotate(f"{v:.3f}", (x - width / 2, v), ha="center", va="bottom", fontsize=8)
    left.set(ylim=(0, 1.2), ylabel="agreement with the teacher", title="Agreement (held out)")
    left.set_xticks(list(xs), labels, rotation=15)
    left.legend(loc="upper center", ncol=2, fontsize=8)
    kls = [r.kl for r in results.values()]
    right.bar(list(xs), kls, 0.6, color="C2")
    for x, v in zip(xs, kls):
        right.annotate(f"{v:.3f}", (x, v), ha="center", va="bottom", fontsize=8)
    right.set(ylabel="nats per answer token", title="KL(teacher || student) (held out)")
    right.set_xticks(list(xs), labels, rotation=15)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    out_dir: str | os.PathLike, results: Mapping[str, EvalResult], name: str = "eval", **extra: Any
) -> list[Path]:
    """`out_dir/{name}.json` and, with matplotlib, `out_dir/{name}.png`; returns the paths written."""
    out_dir = Path(out_dir)
    paths = [write_json(out_dir / f"{name}.json", results, **extra)]
    png = plot(out_dir / f"{name}.png", results)
    return paths + ([png] if png is not None else [])


def _check(results: Mapping[str, EvalResult]) -> None:
    if not results:
        raise ValueError("no evaluation results to report")
    for label, r in results.items():
        if not isinstance(r, EvalResult):
            raise TypeError(f"result {label!r} must be an EvalResult, got {type(r).__name__}")
