"""Append-only result log, so an interrupted tuning run resumes where it stopped.

One JSON object per line, flushed and fsynced after each measurement. The first line is a header
holding the run's fingerprint (shape, device, timing method); a log whose header differs is never
mixed in: measurements from another device or shape would pick wrong tiles. A torn last line
(power cut mid-write) is ignored.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ling_tuning.space import Config, config_key

STATUS = ("ok", "wrong", "error")


@dataclass(frozen=True)
class Result:
    """One candidate at one batch size: its time, or why it was rejected."""

    m: int
    config: Config
    status: str  # ok | wrong (differs from the reference) | error (raised at compile or launch)
    us: float | None = None
    rel_err: float | None = None
    smem: int | None = None  # compiled shared memory (Triton kernels), checked against each run's limit
    detail: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUS:
            raise ValueError(f"status={self.status!r} not in {STATUS}")


def fingerprint(meta: dict[str, Any]) -> str:
    """Short stable hash of what makes measurements comparable."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True).encode()).hexdigest()[:16]


class ResultStore:
    """Results of one fingerprint, loaded from and appended to `folder/results-<fp>.jsonl`."""

    def __init__(self, folder: Path, meta: dict[str, Any]):
        self.meta = meta
        self.path = Path(folder) / f"results-{fingerprint(meta)}.jsonl"
        self._done: dict[tuple[int, str], Result] = {}
        if self.path.exists():
            for rec in self._records():
                r = Result(**rec)
                self._done[(r.m, config_key(r.config))] = r
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._append({"header": meta})

    def _records(self) -> Iterator[dict[str, Any]]:
        with self.path.open() as f:
            lines = f.read().splitlines()
        header = json.loads(lines[0]) if lines else {}
        if header.get("header") != self.meta:
            raise ValueError(f"{self.path}: header {header} does not match this run {self.meta}")
        for line in lines[1:]:
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue  # torn final write

    def _append(self, obj: dict[str, Any]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(obj, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def get(self, m: int, cfg: Config) -> Result | None:
        return self._done.get((m, config_key(cfg)))

    def add(self, result: Result) -> None:
        self._done[(result.m, config_key(result.config))] = result
        self._append(asdict(result))

    def results(self, m: int) -> list[Result]:
        return [r for (mm, _), r in self._done.items() if mm == m]
