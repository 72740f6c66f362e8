"""No product file speaks of how the project was developed: README.md, FINDINGS.md, BENCHMARKS.md, docs/*.md, the
shipped code and the tests (their comments, docstrings and messages) cite a measurement by its date and a BENCHMARKS.md /
FINDINGS.md topic, never by work session ("session 13", "sessions 17-18"), device rental ("one lease", "lease C",
"the lent H200") or tracker issue ("issue #14", "#11's table").

Product words stay allowed: an agent session of the benchmark (numbered from 0: "session 0's first turn"), an
HTTP or process session, pytest's session scope, "release", "please"."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The shipped code and the tests: their folders' .py/.sh/.yaml files, and the installer. This file holds the habits'
# own examples (SELF), so it is left out.
CODE_DIRS = ("vllm_ling", "common", "watchdog", "tuning", "bench", "tools", "serve", "tests")
SELF = "tests/test_no_worklog.py"
CODE_SUFFIXES = (".py", ".sh", ".yaml", ".yml")
SINGLE_FILES = ("README.md", "FINDINGS.md", "BENCHMARKS.md", "install.sh")
SKIP_DIRS = {"__pycache__", "build", "dist"}

# Each pattern names one work-log habit. Work sessions were numbered from 1; agent sessions (bench/agent.py) from 0,
# so "session 0" is the benchmark's word, never the log's; so is the flag `--agent-sessions 4`.
WORKLOG = [
    ("work session by number", re.compile(r"(?<![-_])\bsessions? [1-9]\d*\b", re.IGNORECASE)),
    ("work session by position", re.compile(
        r"\b(?:this|last|next|previous|earlier|later|work|helper|device|GPU|H200) sessions?\b", re.IGNORECASE)),
    ("device lease", re.compile(r"\blease[sd]?\b", re.IGNORECASE)),
    ("device lent", re.compile(r"\blent\b", re.IGNORECASE)),
    ("tracker issue", re.compile(r"\bissues? #?\d+|\(#\d+\)|(?<![\w&$])#\d+'s\b|\bthe issue's\b|\(issue:",
                                 re.IGNORECASE)),
]

# Files another change owns today, with the work-log words they still hold: to be cleaned by that change, then
# removed from here. Keep this list small and visible; a new product file never goes on it.
ALLOWED: dict[str, str] = {}  # file -> why it may still hold a work-log use (none today)


def product_files(root: Path = REPO) -> Iterator[Path]:
    """README.md, FINDINGS.md, BENCHMARKS.md, docs/*.md, the installer, the device runner and every .py/.sh/.yaml
    under the code folders."""
    for name in SINGLE_FILES:
        if (root / name).is_file():
            yield root / name
    yield from sorted((root / "docs").glob("*.md"))
    for top in CODE_DIRS:
        for folder, dirs, names in os.walk(root / top):
            dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                             and not d.endswith(".egg-info"))
            yield from (Path(folder) / n for n in sorted(names) if n.endswith(CODE_SUFFIXES))


def worklog_uses(text: str) -> list[str]:
    """`line N: <habit>: <the line>` for every line that holds a work-log reference."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        for habit, pattern in WORKLOG:
            if pattern.search(line):
                found.append(f"line {n}: {habit}: {line.strip()[:160]}")
    return found


@pytest.mark.parametrize("line, bad", [
    ("(BENCHMARKS.md, session 8)", True),
    ("in sessions 10 and 11 with the tiny checkpoint", True),
    ("session 13's recipe step", True),
    ("Session 17 (2026-12-03): the table", True),
    ("vLLM 0.33, one lease,", True),
    ("lease C of FINDINGS §7", True),
    ("until a GPU lease measures it", True),
    ("on the lent device, `bash tests/gpu/run_on_device.sh`", True),
    ("no two-GPU machine was lent, issue #14", True),
    ("#11's table re-measured", True),
    ("the unit the issue's target is stated in", True),
    ("Issue 34: docs by topic", True),
    ("# session 0's first turn under its own salt", False),
    ("`n_sessions` sessions at once (sessions 0..n-1 of the seed)", False),
    ("--agent-sessions N (N > 1) adds a second scenario", False),
    ("ling-bench --workload agent --agent-sessions 4 --out agent4.json", False),
    ("AgentConfig(agent_sessions 2)", False),
    ("f\"session {session}, turn {turn}\"", False),
    ("Run one engine; its own session so a timeout takes vLLM's children with it.", False),
    ("resp = session.get(base_url)", False),
    ("vLLM 0.34.0, the current release; please report", False),
    ("@pytest.fixture(scope=\"session\")", False),
    ("released, 7 bad watchdog settings", False),
    ("R=${RELEASE#0.}", False),
    ("(BENCHMARKS.md, 2026-12-01)", False),
])
def test_patterns(line: str, bad: bool) -> None:
    assert bool(worklog_uses(line)) is bad


def test_allow_list_is_current() -> None:
    """An allowed file exists and still needs its place: once cleaned, it leaves the list. A warning, not a
    failure, so that the owner's cleaning commit does not turn this test red before the list is edited."""
    stale = [f for f in ALLOWED if not (REPO / f).is_file() or not worklog_uses((REPO / f).read_text())]
    if stale:
        warnings.warn(f"tests/test_no_worklog.py: remove from ALLOWED (no work-log use left, or no such file): {stale}",
                      stacklevel=1)


def test_no_worklog_in_product_files() -> None:
    problems = []
    for path in product_files():
        rel = path.relative_to(REPO).as_posix()
        if rel in ALLOWED or rel == SELF:
            continue
        problems += [f"{rel} {use}" for use in worklog_uses(path.read_text(encoding="utf-8", errors="replace"))]
    assert not problems, ("work-log references in product files; cite the date and the BENCHMARKS.md / FINDINGS.md "
                          "topic instead (\"BENCHMARKS.md, 2026-12-02\", \"measured side by side in one run\"):\n"
                          + "\n".join(problems))
