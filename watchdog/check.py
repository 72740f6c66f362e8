"""The after-serving check: a command run once per launch when serving starts (vLLM-ling's start-up
self-check), its lines and verdict logged as `after_serving` events.

The command is a template; `{url} {log} {launch} {pid} {args}` are filled in per launch: the probe URL,
serve.log, this launch's id (its line in serve.log: the check judges only this launch's lines), the server's
pid (its environment is the server's, /proc/<pid>/environ) and `-- <serve command>` with secrets masked.
Credentials never go through argv (any user can read it): the check inherits VLLM_API_KEY, the variable
vLLM itself reads. A line that is a JSON object with a "message" is logged at its "level" with its other
keys as fields; other lines at info (stdout) or error (stderr, or any line of a failed check).
The check runs in its own process group beside the server (the server's kills leave it alone) and dies
with the watchdog and with its launch, children included: it never outlives the server it checks.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import threading
from collections.abc import Mapping
from typing import Any

from ling_watchdog import procs
from ling_watchdog.events import EventLog

LEVELS = ("info", "warning", "error")
INCOMPLETE = 2  # the check's exit code for "an optimisation asked for is not active"


def expand(template: str, values: Mapping[str, str], cmd: list[str]) -> list[str]:
    """The template's argv with the placeholders filled in; `{args}` becomes `--` and the command."""
    argv: list[str] = []
    for token in shlex.split(template):
        argv += ["--", *cmd] if token == "{args}" else [token.format(**values)]
    return argv


def _record(line: str, default: str) -> tuple[str, str, dict[str, Any]]:
    """(level, message, fields) of one output line."""
    try:
        obj = json.loads(line)
    except ValueError:
        obj = None
    if isinstance(obj, dict) and isinstance(obj.get("message"), str):
        level = obj.pop("level", default)
        message = obj.pop("message")
        return (level if level in LEVELS else default), message, obj
    return default, line, {}


class AfterServing(threading.Thread):
    """start() launches the check (its pid is known on return: the supervisor keeps it out of the serve
    tree's kills); the thread collects its output and logs the verdict."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log: EventLog, timeout: float):
        super().__init__(name="after-serving", daemon=True)
        self.argv, self.env, self.log, self.timeout = argv, dict(env), log, timeout
        self._proc: subprocess.Popen | None = None
        self._stopped = threading.Event()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> None:
        try:
            self._proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=self.env, start_new_session=True,
                                          preexec_fn=procs.die_with_parent)
        except OSError as e:
            self.log.emit("after_serving", f"after-serving check could not run: {e}", level="error", code=-1,
                          verdict="not run")
            return
        super().start()

    def run(self) -> None:
        try:
            out, err = self._proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            out, err = self._proc.communicate()
            self._emit(out, err, failed=True)
            self.log.emit("after_serving", f"after-serving check did not finish in {self.timeout:g}s: killed",
                          level="error", code=-1, verdict="timed out")
            return
        rc = self._proc.returncode
        self._emit(out, err, failed=rc != 0)
        if self._stopped.is_set():
            self.log.emit("after_serving", f"after-serving check stopped with its launch (rc {rc})",
                          level="warning", code=rc, verdict="stopped with its launch")
            return
        why = ": an optimisation asked for is NOT active (see above)" if rc == INCOMPLETE else ""
        self.log.emit("after_serving", f"after-serving check exit {rc}{why}", level="error" if rc else "info",
                      code=rc, verdict="OK" if rc == 0 else "FAILED")

    def _emit(self, out: str, err: str, failed: bool) -> None:
        for stream, default in ((out, "error" if failed else "info"), (err, "error" if failed else "warning")):
            for line in stream.splitlines():
                if line.strip():
                    level, message, fields = _record(line, default)
                    fields.pop("code", None)  # "code" marks the verdict event
                    self.log.emit("after_serving", message, level=level, **fields)

    def _signal(self, sig: int) -> None:
        """To the check's own process group: it and whatever it started (vllm_parse, ...)."""
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, grace: float = 5.0) -> None:
        """The launch is over: end the check and its children (its verdict is about a server that is gone)."""
        self._stopped.set()
        if self._proc is None:
            return
        self._signal(signal.SIGTERM)
        self.join(timeout=grace)
        self._signal(signal.SIGKILL)  # a child of the check that ignored SIGTERM, or the check itself
        self.join(timeout=grace)
