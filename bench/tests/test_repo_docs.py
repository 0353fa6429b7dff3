"""The README's test command is the one CI runs, its links resolve, and every results table in
docs/performance.md is headed by the command that regenerates it (the tables of the section on
figures "without a bench command" excepted, and the machines' table above the first section)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TEST_COMMAND = "python3 -m pip install -q nox && python3 -m nox -s tests lint"


def test_ci_runs_exactly_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(TEST_COMMAND)}\s+# the tests$", readme, re.M)
    commands = [
        line for line in ci.splitlines() if line.strip() and not line.startswith(("#", "set ", "cd "))
    ]
    assert commands == [TEST_COMMAND]


def test_readme_links_resolve():
    readme = (ROOT / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    assert links
    for link in links:
        assert (ROOT / link).exists(), link


def test_every_performance_table_is_headed_by_a_command():
    lines = (ROOT / "docs" / "performance.md").read_text().splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("|") and not lines[i - 1].startswith("|")]
    assert tables
    for start in tables:
        # the lines between this table and the table or heading before it
        above = start - 1
        while above > 0 and not lines[above].startswith(("|", "#")):
            above -= 1
        heading = next(line for line in reversed(lines[:start]) if line.startswith("#"))
        if heading.startswith("# ") or "without a bench command" in heading:
            continue  # the machines' table above the first section; the figures no command makes yet
        head = lines[above:start]
        assert any(line.startswith("`") and line.endswith("`") for line in head), lines[start]
