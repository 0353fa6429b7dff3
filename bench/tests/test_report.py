"""A benchmark run without matplotlib still prints its table and writes its JSON (bench/report.py)."""

from __future__ import annotations

import logging
import sys

from bench import report, throughput


def test_a_plot_without_matplotlib_is_skipped_with_a_log_line(monkeypatch, tmp_path, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    caplog.set_level(logging.WARNING, logger=report.log.name)
    assert throughput.plot([], ["issue4"], ["fast-off"], tmp_path) is None
    assert "matplotlib is not installed" in caplog.text
    assert not list(tmp_path.iterdir())


def test_every_benchmark_plot_is_optional():
    import importlib

    for name in ("demo", "gpu", "kv_trace", "memory", "prefill", "quality", "serve", "throughput", "tp"):
        plot = importlib.import_module(f"bench.{name}").plot
        assert hasattr(plot, "__wrapped__"), name  # wrapped by report.optional_plot
