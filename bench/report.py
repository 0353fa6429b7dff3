"""The one output format: a printed table, a JSON file, a PNG plot (matplotlib, Agg backend; where
matplotlib is not installed, the table and the JSON still come, without the plot).

JSON layout (every benchmark):
    {"benchmark": name, "settings": {...}, "machine": machine_info(), "results": [...rows...], **extra}
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

from bench.harness import Stats, machine_info, machine_summary

log = logging.getLogger(__name__)

DEFAULT_OUT = Path(__file__).parent / "results"


@dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(
                f"{self.title}: row has {len(cells)} cells, table has {len(self.columns)} columns"
            )
        self.rows.append(list(cells))

    def render(self) -> str:
        cells = [[_cell(c) for c in row] for row in self.rows]
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(self.columns)]
        line = "  ".join("-" * w for w in widths)
        out = [self.title, line, "  ".join(h.rjust(w) for h, w in zip(self.columns, widths)), line]
        out += ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
        out.append(line)
        out += self.notes
        return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, Stats):
        return value.fmt()
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3g}" if abs(value) < 10 else f"{value:,.1f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def to_jsonable(value: Any) -> Any:
    if isinstance(value, Stats):
        return value.to_dict()
    if is_dataclass(value) and not isinstance(value, type):
        return to_jsonable(asdict(value))
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(out_dir: Path, name: str, settings: dict, results: Sequence[dict], **extra: Any) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"benchmark": name, "settings": settings, "machine": machine_info(), "results": list(results)}
    payload.update(extra)
    path.write_text(json.dumps(to_jsonable(payload), indent=2) + "\n")
    return path


def optional_plot(plot: Callable[..., Path]) -> Callable[..., Path | None]:
    """A benchmark's plot function that returns None, with one log line, where matplotlib is missing, so
    that a run's table and JSON are not lost to it."""

    @functools.wraps(plot)
    def wrapper(*args: Any, **kwargs: Any) -> Path | None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            log.warning("matplotlib is not installed: no plot (pip install matplotlib, or nox -s bench)")
            return None
        return plot(*args, **kwargs)

    return wrapper


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0):
    """A matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def save_figure(fig, out_dir: Path, name: str) -> Path:
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def errorbar(ax, xs: Sequence[float], stats: Sequence[Stats], label: str, **kw: Any) -> None:
    """Median with a min–max bar."""
    med = [s.median for s in stats]
    lo = [s.median - s.min for s in stats]
    hi = [s.max - s.median for s in stats]
    ax.errorbar(xs, med, yerr=[lo, hi], label=label, marker="o", capsize=3, **kw)


def bars(ax, labels: Sequence[str], stats: Sequence[Stats], **kw: Any) -> None:
    """Bars at the median with a min–max whisker."""
    med = [s.median for s in stats]
    err = [[s.median - s.min for s in stats], [s.max - s.median for s in stats]]
    ax.bar(labels, med, yerr=err, capsize=4, color=[f"C{i}" for i in range(len(labels))], **kw)


def finish(tables: Sequence[Table], paths: Sequence[Path | None]) -> None:
    """Print the machine, the tables, and say where the files went."""
    print()
    print("\n".join(machine_summary(machine_info())))
    for table in tables:
        print()
        print(table.render())
    print()
    for path in paths:
        if path is not None:
            print(f"wrote {path}")
