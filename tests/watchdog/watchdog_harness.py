"""Shared helpers of the watchdog tests and fault tables (a uniquely named module: every tests/<area>/ has a
conftest.py): the fake vLLM server, the fast thresholds, the processes of a run (and those it left behind),
and the faults a test inflicts on a live server tree: SIGKILL or SIGSTOP its engine core, worker or API server."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import yaml
from ling_watchdog.events import read_events
from ling_watchdog.ports import free_port  # noqa: F401  (re-exported: the tests' one import of it)

FAKE = Path(__file__).with_name("fake_vllm.py")

FAST: dict[str, Any] = yaml.safe_load(FAKE.with_name("fast.yaml").read_text())
FAULT_MARK = re.compile(r"fake fault (\w+) at t=([\d.]+)")
# How vLLM names its processes (setproctitle), and how the fake's show in their argv.
ROLES = {"worker": ("VLLM::Worker", "--worker"), "engine": ("VLLM::EngineCore", "--engine-fd")}
INJECT = {"kill_engine": ("engine", signal.SIGKILL), "kill_worker": ("worker", signal.SIGKILL),
          "kill_api": ("api", signal.SIGKILL), "stop_engine": ("engine", signal.SIGSTOP)}


def tagged(tag: str) -> list[psutil.Process]:
    """Every live process whose argv carries the run's tag (API server, engine, worker, escaped grandchild)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if tag in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def role_of(argv: str) -> str | None:
    """The role, "worker" or "engine", by vLLM's process title or the fake's flag; None for the API server or others."""
    return next((r for r, marks in ROLES.items() if any(m in argv for m in marks)), None)


def server_roles(api_pid: int) -> dict[str, psutil.Process]:
    """The API server and, below it, its engine core and worker (vLLM's process titles or the fake's flags)."""
    api = psutil.Process(api_pid)
    out = {"api": api}
    for p in api.children(recursive=True):
        try:
            text = " ".join(p.cmdline())
        except psutil.Error:
            continue
        role = role_of(text)
        if role:
            out.setdefault(role, p)
    return out


def inject(action: str, api_pid: int) -> float:
    """Send the action's signal to its process of the server tree; the time it was sent."""
    role, sig = INJECT[action]
    target = server_roles(api_pid).get(role)
    if target is None:
        raise LookupError(f"{action}: no {role} process under the API server {api_pid}")
    t = time.time()
    os.kill(target.pid, sig)
    return t


def ask_over_context(port: int, context: int) -> dict[str, dict]:
    """What a client over the context gets from a live server, and what the next one gets: a completion whose
    prompt is `context` + 8 token ids, then an 8-token one. Each: the HTTP status and the start of the body."""
    import urllib.error
    import urllib.request

    base = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(f"{base}/v1/models", timeout=30) as resp:
        model = json.load(resp)["data"][0]["id"]

    def complete(n: int) -> dict:
        body = json.dumps({"model": model, "prompt": [11] * n, "max_tokens": 4, "temperature": 0}).encode()
        req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                return {"status": resp.status, "body": resp.read().decode(errors="replace")[:500]}
        except urllib.error.HTTPError as e:
            return {"status": e.code, "body": e.read().decode(errors="replace")[:500]}

    return {"over": complete(context + 8), "after": complete(8)}


def launched_pid(events: list[dict[str, Any]]) -> int | None:
    """The API server's pid: the latest launch's."""
    launches = [e for e in events if e.get("event") == "launch"]
    return launches[-1]["pid"] if launches else None


class Tree:
    """Every process seen in a watchdog's tree while it ran (pid, start time: no pid-reuse confusion)."""

    def __init__(self, root: int):
        self.root, self.seen = root, {}

    def sample(self) -> None:
        try:
            for p in psutil.Process(self.root).children(recursive=True):
                try:
                    self.seen.setdefault(p.pid, p.create_time())
                except psutil.Error:
                    continue
        except psutil.Error:
            pass

    def alive(self) -> list[psutil.Process]:
        left = []
        for pid, born in self.seen.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == born and p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.Error:
                continue
        return left


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The events as `ling-watchdog status` reads them: a line the watchdog is still writing (a poll can see it cut
    short) is skipped until it is whole, not a JSON error that fails the test."""
    return read_events(path) if path.exists() else []


@dataclass
class Run:
    proc: subprocess.Popen
    log_dir: Path
    tag: str
    port: int
    started: float = field(default_factory=time.time)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        records = read_jsonl(self.log_dir / "events.jsonl")
        return [r for r in records if kind is None or r["event"] == kind]

    def wait_for(self, pred: Callable[[dict[str, Any]], bool], timeout: float = 30) -> dict[str, Any]:
        deadline = time.time() + timeout
        while time.time() < deadline:
            hits = [r for r in self.events() if pred(r)]
            if hits:
                return hits[0]
            if self.proc.poll() is not None:
                hits = [r for r in self.events() if pred(r)]
                assert hits, f"watchdog exited rc={self.proc.returncode} first; log:\n{self.serve_log()[-3000:]}"
                return hits[0]
            time.sleep(0.1)
        raise AssertionError(f"no matching event in {timeout}s; log:\n{self.serve_log()[-3000:]}")

    def wait_phase(self, phase: str, timeout: float = 30, after: float = 0.0) -> dict[str, Any]:
        return self.wait_for(lambda r: r["event"] == "phase" and r["to"] == phase and r["t"] > after, timeout)

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout)

    def serve_log(self) -> str:
        path = self.log_dir / "serve.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def fault_times(self) -> list[float]:
        return [float(m[2]) for m in FAULT_MARK.finditer(self.serve_log())]

    def inject(self, action: str) -> float:
        """Inflict a fault on the latest launch's server tree; the time it was inflicted."""
        return inject(action, launched_pid(self.events()))

    def orphans(self, settle: float = 3.0) -> Orphans:
        """Tagged processes still alive after `settle` seconds (zombies excluded). The tests assert
        `not (left := run.orphans()), left`: a failure then says why each one is still up (Orphans' repr)."""
        deadline = time.time() + settle
        while (left := tagged(self.tag)) and time.time() < deadline:
            time.sleep(0.1)
        return Orphans(left)


class Orphans(list):
    """Processes a run left behind. Their repr says why they are still up: a handler that never ran shows SIGTERM
    caught (SigCgt) with nothing pending, its main thread waiting in a futex (a lock) rather than in a poll."""

    def __repr__(self) -> str:
        return "[" + ", ".join(_why_alive(p) for p in self) + "]"


def _why_alive(p: psutil.Process) -> str:
    try:
        role = role_of(" ".join(p.cmdline())) or "api/other"
        status = {k: v.strip() for k, v in (line.split(":", 1) for line in Path(f"/proc/{p.pid}/status").read_text()
                                           .splitlines() if line.startswith(("SigPnd", "ShdPnd", "SigBlk", "SigCgt")))}
        waits = []
        for tid in sorted(os.listdir(f"/proc/{p.pid}/task")):
            waits.append(f"{tid}:{Path(f'/proc/{p.pid}/task/{tid}/wchan').read_text() or 'running'}")
        return f"pid {p.pid} ({role}, parent {p.ppid()}, {p.status()}; {status}; threads {' '.join(waits)})"
    except (psutil.Error, OSError) as e:
        return f"pid {p.pid} ({type(e).__name__})"
