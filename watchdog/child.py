"""The serve command as its own process group (session): its output pumped line by line, and a
stop that leaves nothing behind: SIGTERM to the group, a grace period, SIGKILL, then a sweep."""
from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
from ling_watchdog import procs

# tqdm redraws with "\r" (vLLM's CUDA-graph capture bar): each redraw counts as a line.
LINE_END = re.compile(rb"\r\n|\r|\n")
MAX_LINE = 1 << 16


@dataclass(frozen=True, slots=True)
class Line:
    text: str
    t: float


@dataclass(frozen=True, slots=True)
class Output:
    """Bytes arrived without a line end: the child is not silent."""
    t: float


@dataclass(frozen=True, slots=True)
class StopReport:
    rc: int
    signal: str  # "none" (already gone) | "SIGTERM" | "SIGKILL"
    seconds: float
    survivors: int


class Child:
    def __init__(self, cmd: list[str], inbox: queue.Queue, echo: Callable[[str], None],
                 env: dict[str, str] | None = None, clock: Callable[[], float] = time.monotonic):
        self._clock, self._inbox, self._echo = clock, inbox, echo
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=procs.die_with_parent)
        self.pid = self.proc.pid  # also its process-group and session id
        self.seen: set[int] = {self.pid}
        self.foreign: set[int] = set()  # processes of ours that are not the server's (the after-serving check)
        self._reader = threading.Thread(target=self._pump, name="ling-watchdog-reader", daemon=True)

    def read(self) -> Child:
        """Start pumping the output (the pipe holds it meanwhile): the caller logs the launch line first,
        so that every line of this launch comes after it in serve.log."""
        self._reader.start()
        return self

    def _pump(self) -> None:
        fd, buf = self.proc.stdout.fileno(), b""
        while chunk := os.read(fd, 1 << 16):
            now = self._clock()
            *lines, buf = LINE_END.split(buf + chunk)
            if len(buf) > MAX_LINE:
                lines, buf = [*lines, buf], b""
            for raw in lines:
                if raw:
                    self._line(raw, now)
            if not lines:
                self._inbox.put(Output(now))
        if buf:
            self._line(buf, self._clock())
        self.proc.stdout.close()

    def _line(self, raw: bytes, t: float) -> None:
        text = raw.decode("utf-8", errors="replace")
        self._echo(text)
        self._inbox.put(Line(text, t))

    def note_tree(self, pids: set[int]) -> None:
        self.seen |= pids

    def exited(self) -> bool:
        return self.proc.poll() is not None

    def flush(self, timeout: float) -> None:
        """Wait (up to timeout) for the output still in the pipe: after an exit, the last lines give the reason.
        Members still alive hold the pipe open, hence the bound."""
        self._reader.join(timeout)

    def _members(self) -> list[psutil.Process]:
        """Our descendants that belong to the serve tree, the leader aside."""
        out = []
        for p in psutil.Process().children(recursive=True):
            try:
                if p.pid != self.pid and procs.ours(p, self.seen, self.pid, frozenset(self.foreign)):
                    out.append(p)
            except (psutil.NoSuchProcess, ProcessLookupError):
                continue
        return out

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float) -> StopReport:
        """Group SIGTERM, up to `grace` seconds for everyone to leave, then SIGKILL and a sweep."""
        t0 = self._clock()
        self.seen |= {p.pid for p in procs.tree(self.pid)}
        used = "none" if self.exited() and not self._members() else "SIGTERM"
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
        _, alive = psutil.wait_procs(self._members(), timeout=max(0.0, grace - (self._clock() - t0)))
        if self.proc.poll() is None or alive:
            used = "SIGKILL"
            self._signal_group(signal.SIGKILL)
            for p in alive:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        rc = self.proc.wait()
        survivors = procs.sweep(self.seen, self.pid, frozenset(self.foreign))
        self._reader.join(timeout=5)
        return StopReport(rc, used, self._clock() - t0, len(survivors))
