"""The two logs people monitor, and the `status` summary read back from them.

serve.log holds the serve command's output plus one human line per watchdog event; events.jsonl
holds one JSON object per event. Both open in append mode and rotate by size, so a relaunch never
loses what an earlier launch wrote, and a log dir holds earlier runs too: every reader takes one run
(`run_records`) or one launch (`launch_log`, from the launch line the watchdog writes), never the whole
file. Secrets (API keys, tokens) are masked in everything written, and the files are not
world-readable (docs/ops-walls.md, "Secrets and logs").
"""
from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SERVE_LOG = "serve.log"
EVENTS_LOG = "events.jsonl"
FAULTS = ("stall", "wedge", "crash", "memory_guard", "fatal")
LOG_MODE, DIR_MODE = 0o640, 0o750
MASK = "***"
LAUNCH_LINE = "[watchdog] launch "  # every launch's line in serve.log starts with this, then its id


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).astimezone().isoformat(timespec="milliseconds")


def launch_mark(launch_id: str) -> str:
    """The text of a launch's line in serve.log that readers of that launch's lines start from."""
    return f"{LAUNCH_LINE}{launch_id}:"


class _PrivateFileHandler(logging.handlers.RotatingFileHandler):
    """Rotating and appending, created (and tightened, if an older file is looser) as mode 0640."""

    def _open(self):
        fd = os.open(self.baseFilename, os.O_WRONLY | os.O_APPEND | os.O_CREAT, LOG_MODE)
        os.fchmod(fd, os.fstat(fd).st_mode & LOG_MODE)
        return open(fd, self.mode, encoding=self.encoding, errors=self.errors)


def _logger(path: Path, max_bytes: int, backups: int, echo: bool) -> logging.Logger:
    # A private Logger (not in logging's global registry): two EventLogs never share handlers.
    log = logging.Logger(str(path), logging.INFO)
    handlers: list[logging.Handler] = [_PrivateFileHandler(path, maxBytes=max_bytes, backupCount=backups,
                                                           encoding="utf-8")]
    if echo:
        handlers.append(logging.StreamHandler(sys.stdout))
    for h in handlers:
        h.setFormatter(logging.Formatter("%(message)s"))
        log.addHandler(h)
    return log


class Secrets:
    """Values to mask in every line written; the longest first, so a key that contains another is whole."""

    def __init__(self) -> None:
        self._values: list[str] = []

    def add(self, values: Iterable[str]) -> None:
        self._values = sorted({*self._values, *(v for v in values if v)}, key=len, reverse=True)

    def mask(self, obj: Any) -> Any:
        if isinstance(obj, str):
            for v in self._values:
                obj = obj.replace(v, MASK)
            return obj
        if isinstance(obj, dict):
            return {k: self.mask(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [self.mask(v) for v in obj]
        return obj


class EventLog:
    """`output(line)` records a line of the child; `emit(event, message, **fields)` a watchdog event."""

    def __init__(self, log_dir: str | Path, max_bytes: int, backups: int, echo: bool = True,
                 clock: Callable[[], float] = time.time):
        self.dir = Path(log_dir)
        self.dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
        self._clock = clock
        self.secrets = Secrets()
        self._serve = _logger(self.dir / SERVE_LOG, max_bytes, backups, echo)
        self._events = _logger(self.dir / EVENTS_LOG, max_bytes, backups, echo=False)
        for name in (SERVE_LOG, EVENTS_LOG):  # an older run's rotated copies hold its secrets' context too
            _tighten(_newest_first(self.dir / name)[1:])

    def output(self, line: str) -> None:
        self._serve.info(self.secrets.mask(line))

    def emit(self, event: str, message: str, level: str = "info", quiet: bool = False,
             **fields: Any) -> dict[str, Any]:
        """quiet: events.jsonl only (for events whose vLLM line is already in serve.log)."""
        t = self._clock()
        record = self.secrets.mask({"ts": _iso(t), "t": round(t, 3), "event": event, "level": level, **fields,
                                    "message": message})
        self._events.info(json.dumps(record, default=str))
        if not quiet:
            tag = "" if level == "info" else f"{level.upper()}: "
            self._serve.info(f"{record['ts']} [watchdog] {tag}{record['message']}")
        return record

    def close(self) -> None:
        for log in (self._serve, self._events):
            for h in list(log.handlers):
                h.close()
                log.removeHandler(h)


def _tighten(paths: Iterable[Path]) -> None:
    """Mode 0640 at most for files an older watchdog (or another umask) left looser; the open handlers tighten
    the live files, and rotation renames those, so only copies from before this run can be looser."""
    for p in paths:
        try:
            mode = p.stat().st_mode
            if mode & ~LOG_MODE & 0o777:
                p.chmod(mode & LOG_MODE)
        except OSError:  # rotated away meanwhile, or not ours to change: reading it stays as it was
            pass


def _newest_first(base: Path) -> list[Path]:
    """A log file and its rotated copies (base.1 is the newest of those), newest first."""
    rotated = [p for p in base.parent.glob(base.name + ".*") if p.suffix[1:].isdigit()]
    return [base, *sorted(rotated, key=lambda p: int(p.suffix[1:]))]


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """All events of a log dir (or one events file), oldest first, rotated files included."""
    path = Path(path)
    base = path / EVENTS_LOG if path.is_dir() else path
    records = []
    for p in reversed(_newest_first(base)):
        if not p.is_file():
            continue
        for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut short by a crash: skip it, keep the rest
    return records


def run_records(records: list[dict[str, Any]], pid: int | None = None) -> list[dict[str, Any]]:
    """The events of one watchdog run: the latest, or the latest whose watchdog had `pid`."""
    starts = [i for i, r in enumerate(records) if r.get("event") == "start" and pid in (None, r.get("pid"))]
    if not starts:
        return [] if pid is not None else records
    later = [i for i, r in enumerate(records) if r.get("event") == "start" and i > starts[-1]]
    return records[starts[-1]:later[0] if later else None]


def launch_log(log: str | Path, launch_id: str | None = None) -> str:
    """serve.log from one launch's line to the end: the launch `launch_id`, else the latest launch.

    Rotated files are searched newest first. A log that no watchdog wrote (no launch line) is one run
    and read whole; a launch id that is not found gives "" (nothing of that launch to judge)."""
    path = Path(log)
    base = path / SERVE_LOG if path.is_dir() else path
    needle = launch_mark(launch_id) if launch_id else LAUNCH_LINE
    text = ""
    for p in _newest_first(base):
        if p.is_file():
            text = p.read_text(encoding="utf-8", errors="replace") + text
            at = text.rfind(needle)
            if at >= 0:
                return text[text.rfind("\n", 0, at) + 1:]
    return "" if launch_id else text


def dirs_with_events(log_dir: str | Path, depth: int = 2) -> list[Path]:
    """Folders under log_dir (at most `depth` levels down) that hold an events.jsonl."""
    root = Path(log_dir)
    return sorted({p.parent for d in range(1, depth + 1) for p in root.glob("/".join(["*"] * d) + "/" + EVENTS_LOG)})


@dataclass(slots=True)
class Summary:
    phase: str = "unknown"
    phase_since: float | None = None
    launches: int = 0
    relaunches: int = 0
    in_a_row: int = 0  # relaunches since the last stable serving period: the budget's use
    max_relaunches: int | None = None
    faults: int = 0
    last_stall: dict[str, Any] | None = None
    last_memory: dict[str, Any] | None = None
    memory_edge: dict[str, Any] | None = None  # the latest launch's latest allocator-at-the-limit warning
    final: dict[str, Any] | None = None
    watchdog_pid: int | None = None
    run: str | None = None
    last_event: dict[str, Any] | None = None
    preflight: list[dict[str, Any]] = field(default_factory=list)
    selfcheck: dict[str, Any] | None = None  # the latest launch's: code (None: running), ts, lines, failed,
    # and once it ended, its exit line (message)
    traffic: dict[str, Any] | None = None  # the latest launch's latest traffic line

    @property
    def relaunches_left(self) -> int | None:
        return None if self.max_relaunches is None else max(0, self.max_relaunches - self.in_a_row)


def _selfcheck(s: Summary, r: dict[str, Any]) -> None:
    check = s.selfcheck if s.selfcheck is not None else {"code": None, "ts": r["ts"], "lines": [], "failed": []}
    if "code" in r:
        check.update(code=r["code"], ts=r["ts"], verdict=r.get("verdict"), message=r["message"])
    else:
        check["lines"].append({"level": r.get("level", "info"), "message": r["message"]})
        if r.get("state") == "FAILED":
            check["failed"].append(r.get("check", r["message"]))
    s.selfcheck = check


def summarise(records: list[dict[str, Any]]) -> Summary:
    """Fold the event stream of the latest watchdog run into its current state."""
    s = Summary()
    for r in run_records(records):
        kind = r.get("event")
        s.last_event = r
        if kind == "start":
            s.watchdog_pid, s.run = r.get("pid"), r.get("run")
            s.max_relaunches = (r.get("config") or {}).get("max_relaunches")
        elif kind == "launch":
            s.launches += 1
            s.phase, s.phase_since, s.selfcheck, s.traffic, s.memory_edge = "loading", r["t"], None, None, None
        elif kind == "phase":
            s.phase, s.phase_since = r["to"], r["t"]
        elif kind == "relaunch":
            s.relaunches += 1
            s.in_a_row = r.get("in_a_row", s.in_a_row + 1)
        elif kind == "stable":
            s.in_a_row = 0
        elif kind == "preflight":
            s.preflight.append(r)
        elif kind == "after_serving":
            _selfcheck(s, r)
        elif kind == "traffic":
            s.traffic = r
        elif kind == "final":
            s.final, s.phase, s.phase_since = r, "stopped", r["t"]
        if kind in FAULTS:
            s.faults += 1
            s.last_stall = r
        if kind in ("memory", "memory_guard"):
            s.last_memory = r
        elif kind == "memory_edge":
            s.memory_edge = r
    return s


def summary_json(s: Summary) -> dict[str, Any]:
    from dataclasses import asdict

    return {**asdict(s), "relaunches_left": s.relaunches_left}


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


def _selfcheck_lines(check: dict[str, Any]) -> list[str]:
    verdict = check.get("verdict")
    if check["code"] is None:
        head = "self-check: running"
    elif check["code"] == 0:
        head = f"self-check: OK (exit 0) at {check['ts']}"
    elif verdict not in (None, "FAILED"):
        head = f"self-check: {verdict} (exit {check['code']}) at {check['ts']}"
    else:
        failed = f": FAILED {', '.join(check['failed'])}" if check["failed"] else ""
        head = f"self-check: exit {check['code']}{failed} at {check['ts']}"
    return [head, *(f"  {line['message']}" for line in check["lines"])]


def format_summary(s: Summary) -> str:
    if s.last_event is None:
        return "no events yet"
    lines = []
    if s.final is None:
        state = "running" if _alive(s.watchdog_pid) else "not running (no final event: killed?)"
        lines.append(f"watchdog: pid {s.watchdog_pid}, {state}")
    lines.append(f"phase: {s.phase} since {_iso(s.phase_since) if s.phase_since else '?'}")
    budget = (f"; {s.relaunches_left} of {s.max_relaunches} left before it gives up (the count resets after "
              f"a stable serving period)" if s.max_relaunches is not None else "")
    lines.append(f"launches: {s.launches} (relaunches: {s.relaunches}, faults detected: {s.faults}{budget})")
    if s.last_stall:
        lines.append(f"last fault: {s.last_stall.get('cause', s.last_stall['event'])} at "
                     f"{s.last_stall['ts']}: {s.last_stall['message']}")
    if s.last_memory:
        lines.append(f"memory: {s.last_memory['message']} ({s.last_memory['ts']})")
    if s.memory_edge:
        lines.append(f"memory edge: {s.memory_edge['message']} ({s.memory_edge['ts']})")
    refused = [p for p in s.preflight if p.get("verdict") != "ok"]
    for p in refused:
        lines.append(f"preflight {p['verdict']}: {p['message']}")
    if s.selfcheck:
        lines += _selfcheck_lines(s.selfcheck)
    if s.traffic:
        lines.append(f"{s.traffic['message']} (to {s.traffic['ts']})")
    if s.final:
        lines.append(f"final: {s.final['message']}")
    event, message = s.last_event["event"], s.last_event["message"]
    said = message if message.startswith(f"{event}: ") else f"{event}: {message}"  # a message naming its event
    lines.append(f"last event: {s.last_event['ts']} {said}")
    return "\n".join(lines)
