"""The repository cites only its own docs: every `docs/<file>.md §<Heading>` (and `docs/ops-walls.md
W<n>`) in a .py/.sh/.md file names a file and a heading that exist, and nothing points at the notes that used to
live outside the repository."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".sh", ".md")
SKIP_DIRS = {"results", "build", "dist", "__pycache__"}  # results/ holds raw device logs, quoted as they came

# The notes that lived outside the repository, by file name or by how the code used to cite them.
EXTERNAL = re.compile(
    r"\.\./shared|ling3-architecture|vllm-integration|ops-facts|perf-baselines|speed-levers|style-anchors"
    r"|notes §|(?:architecture|integration|baseline) notes",
    re.IGNORECASE,
)
# `docs/x.md` then any chain of sections: `§A`, `§A, §B`, `§A/§B`, `§1-§2`, `W6`; a chain may run onto the next
# (comment) line. `§<Name>` (a placeholder in angle brackets) is not a citation.
_SEP = r"\s*(?:#\s*)?(?:,|/|-|and)?\s*"
CITATION = re.compile(rf"(?<![\w./-])docs/(?P<file>[\w-]+\.md)(?P<chain>(?:{_SEP}(?:§\w+|W\d+\b))*)")
SECTION = re.compile(r"§(\w+)|\b(W\d+)\b")


@dataclass(frozen=True)
class Problem:
    where: str
    what: str

    def __str__(self) -> str:
        return f"{self.where}: {self.what}"


def repo_files(root: Path = REPO) -> Iterator[Path]:
    """The .py/.sh/.md files of the checkout, without hidden folders (bundles, caches), results/ or build output."""
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in SKIP_DIRS
                         and not d.endswith(".egg-info"))
        yield from (Path(folder) / n for n in sorted(names) if n.endswith(SUFFIXES))


def headings(doc: str) -> list[str]:
    """A doc's headings without the '#'s and the leading '§': "KDA kernels", "1. The format"."""
    return [line.lstrip("#").strip().removeprefix("§") for line in doc.splitlines() if line.startswith("#")]


def _has_heading(heads: list[str], name: str) -> bool:
    """`name` starts a heading as a whole word: "KDA" starts "KDA kernels", "1" does not start "10. Limits"."""
    return any(re.match(re.escape(name) + r"(?!\w)", h) for h in heads)


def _has_wall(doc: str, wall: str) -> bool:
    return re.search(rf"^\|\s*{wall}\s*\|", doc, re.MULTILINE) is not None


def citation_problems(text: str, where: str, docs: Path = REPO / "docs") -> list[Problem]:
    """Every citation of docs/ in `text` whose file, heading or wall does not exist there."""
    problems = []
    for m in CITATION.finditer(text):
        line = f"{where}:{text.count(chr(10), 0, m.start()) + 1}"
        path = docs / m["file"]
        if not path.is_file():
            problems.append(Problem(line, f"docs/{m['file']} does not exist"))
            continue
        doc = path.read_text(encoding="utf-8")
        for section, wall in SECTION.findall(m["chain"]):
            if section and not _has_heading(headings(doc), section):
                problems.append(Problem(line, f"docs/{m['file']} has no heading starting with {section!r}"))
            if wall and not _has_wall(doc, wall):
                problems.append(Problem(line, f"docs/{m['file']} has no wall {wall}"))
    return problems


def external_problems(text: str, where: str) -> list[Problem]:
    """Every mention of the notes outside the repository."""
    return [Problem(f"{where}:{text.count(chr(10), 0, m.start()) + 1}", f"cites outside the repo: {m[0]!r}")
            for m in EXTERNAL.finditer(text)]


def _scanned() -> Iterator[tuple[str, str]]:
    """(path relative to the repo, text) of every file checked; not this one, whose made-up citations are meant."""
    here = Path(__file__).resolve()
    for path in repo_files():
        if path != here:
            yield str(path.relative_to(REPO)), path.read_text(encoding="utf-8", errors="replace")


def test_every_docs_citation_names_an_existing_file_and_heading():
    seen, problems = 0, []
    for where, text in _scanned():
        seen += len(CITATION.findall(text))
        problems += citation_problems(text, where)
    assert seen > 100, f"only {seen} citations found: the scan missed the repository"
    assert not problems, "\n".join(map(str, problems))


def test_nothing_cites_the_notes_outside_the_repository():
    problems = []
    for where, text in _scanned():
        problems += external_problems(text, where)
    assert not problems, "\n".join(map(str, problems))


@pytest.mark.parametrize("text", [
    "see docs/architecture.md §Routing",  # no such heading
    "docs/architecture.md §KDA, §Rope",  # the second of a chain
    "(docs/parsers.md §1-§9)",  # numbered sections: 9 does not exist
    "docs/ops-walls.md W12",  # walls are W1-W11
    "docs/architecture-notes.md §KDA",  # no such file
    "# docs/architecture.md\n# §Nope",  # a chain continued on the next comment line
])
def test_the_checker_flags_a_made_up_citation(text):
    assert citation_problems(text, "made-up.py")


def test_a_heading_matches_only_as_a_whole_word():
    assert _has_heading(["10. Limits", "KDA kernels"], "KDA")
    assert not _has_heading(["10. Limits"], "1")
    assert not _has_heading(["KDA kernels"], "KD")


def test_the_checker_passes_real_citations_and_placeholders():
    text = ("docs/architecture.md §Layers/§MTP/§Tensors; docs/parsers.md §1-§2; docs/vllm-seams.md §KDA kernels; "
            "docs/ops-walls.md W6; `docs/speed.md §<Name>`; docs/architecture.md\n§INT4")
    assert citation_problems(text, "x") == []
    assert len(CITATION.findall(text)) == 6


@pytest.mark.parametrize("text", ["architecture notes §3.2", "see ../shared/device/README.md",
                                  "ling3-architecture.md §8", "the baseline notes count 2.95 MB"])
def test_the_checker_flags_the_outside_notes(text):
    assert external_problems(text, "made-up.py")
