"""The two logs people monitor, and the `status` summary read back from them.

serve.log holds the serve command's output plus one human line per watchdog event; events.jsonl
holds one JSON object per event. Both open in append mode and rotate by size, so a relaunch never
loses what an earlier launch wrote.
"""
from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SERVE_LOG = "serve.log"
EVENTS_LOG = "events.jsonl"
FAULTS = ("stall", "wedge", "crash", "memory_guard", "fatal")


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).astimezone().isoformat(timespec="milliseconds")


def _logger(path: Path, max_bytes: int, backups: int, echo: bool) -> logging.Logger:
    # A private Logger (not in logging's global registry): two EventLogs never share handlers.
    log = logging.Logger(str(path), logging.INFO)
    handlers: list[logging.Handler] = [
        logging.handlers.RotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
    ]
    if echo:
        handlers.append(logging.StreamHandler(sys.stdout))
    for h in handlers:
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
    return log


class EventLog:
    """`output(line)` records a line of the child; `emit(event, message, **fields)` a watchdog event."""

    def __init__(self, log_dir: str | Path, max_bytes: int, backups: int, echo: bool = True,
                 clock: Callable[[], float] = time.time):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._clock = clock
        self._serve = _logger(self.dir / SERVE_LOG, max_bytes, backups, echo)
        self._events = _logger(self.dir / EVENTS_LOG, max_bytes, backups, echo=False)

    def output(self, line: str) -> None:
        self._serve.info(line)

    def emit(self, event: str, message: str, level: str = "info", quiet: bool = False,
             **fields: Any) -> dict[str, Any]:
        """quiet: events.jsonl only (for events whose vLLM line is already in serve.log)."""
        t = self._clock()
        record = {"ts": _iso(t), "t": round(t, 3), "event": event, "level": level, **fields,
                  "message": message}
        self._events.info(json.dumps(record, default=str))
        if not quiet:
            tag = "" if level == "info" else f"{level.upper()}: "
            self._serve.info(f"{record['ts']} [watchdog] {tag}{message}")
        return record

    def close(self) -> None:
        for log in (self._serve, self._events):
            for h in list(log.handlers):
                h.close()
                log.removeHandler(h)


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All events of a log dir (or one events file), oldest first, rotated files included."""
    path = Path(path)
    base = path / EVENTS_LOG if path.is_dir() else path
    rotated = sorted(base.parent.glob(base.name + ".*"),
                     key=lambda p: int(p.suffix[1:]) if p.suffix[1:].isdigit() else -1, reverse=True)
    records = []
    for p in [*rotated, base]:
        if not p.is_file():
            continue
        for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: skip it, keep the rest
    return records


@dataclass(slots=True)
class Summary:
    phase: str = "unknown"
    phase_since: float | None = None
    launches: int = 0
    relaunches: int = 0
    faults: int = 0
    last_stall: dict[str, Any] | None = None
    last_memory: dict[str, Any] | None = None
    final: dict[str, Any] | None = None
    watchdog_pid: int | None = None
    last_event: dict[str, Any] | None = None
    preflight: list[dict[str, Any]] = field(default_factory=list)


def summarise(records: list[dict[str, Any]]) -> Summary:
    """Fold the event stream of the latest watchdog run into its current state."""
    starts = [i for i, r in enumerate(records) if r.get("event") == "start"]
    s = Summary()
    for r in records[starts[-1] if starts else 0:]:
        kind = r.get("event")
        s.last_event = r
        if kind == "start":
            s.watchdog_pid = r.get("pid")
        elif kind == "launch":
            s.launches += 1
            s.phase, s.phase_since = "loading", r["t"]
        elif kind == "phase":
            s.phase, s.phase_since = r["to"], r["t"]
        elif kind == "relaunch":
            s.relaunches += 1
        elif kind == "preflight":
            s.preflight.append(r)
        elif kind == "final":
            s.final, s.phase, s.phase_since = r, "stopped", r["t"]
        if kind in FAULTS:
            s.faults += 1
            s.last_stall = r
        if kind in ("memory", "memory_guard"):
            s.last_memory = r
    return s


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def format_summary(s: Summary) -> str:
    if s.last_event is None:
        return "no events yet"
    lines = []
    if s.final is None:
        state = "running" if _alive(s.watchdog_pid) else "not running (no final event: killed?)"
        lines.append(f"watchdog: pid {s.watchdog_pid}, {state}")
    lines.append(f"phase: {s.phase} since {_iso(s.phase_since) if s.phase_since else '?'}")
    lines.append(f"launches: {s.launches} (relaunches: {s.relaunches}, faults detected: {s.faults})")
    if s.last_stall:
        lines.append(f"last fault: {s.last_stall.get('cause', s.last_stall['event'])} at "
                     f"{s.last_stall['ts']}: {s.last_stall['message']}")
    if s.last_memory:
        lines.append(f"memory: {s.last_memory['message']} ({s.last_memory['ts']})")
    refused = [p for p in s.preflight if p.get("verdict") != "ok"]
    for p in refused:
        lines.append(f"preflight {p['verdict']}: {p['message']}")
    if s.final:
        lines.append(f"final: {s.final['message']}")
    lines.append(f"last event: {s.last_event['ts']} {s.last_event['event']}: {s.last_event['message']}")
    return "\n".join(lines)
