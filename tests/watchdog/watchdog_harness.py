"""Shared helpers of the watchdog tests (a uniquely named module: every tests/<area>/ has a conftest.py):
the fake vLLM server, the fast thresholds, free ports, and the processes a run left behind."""
from __future__ import annotations

import json
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
from ling_watchdog.fault_table import free_port, tagged  # noqa: F401  (re-exported: shared with the fault table)

FAKE = Path(__file__).with_name("fake_vllm.py")

FAST: dict[str, Any] = yaml.safe_load(FAKE.with_name("fast.yaml").read_text())
FAULT_MARK = re.compile(r"fake fault (\w+) at t=([\d.]+)")



@dataclass
class Run:
    proc: subprocess.Popen
    log_dir: Path
    tag: str
    port: int
    started: float = field(default_factory=time.time)

    def events(self, kind: str | None = None) -> list[dict[str, Any]]:
        path = self.log_dir / "events.jsonl"
        if not path.exists():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
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

    def wait_phase(self, phase: str, timeout: float = 30) -> dict[str, Any]:
        return self.wait_for(lambda r: r["event"] == "phase" and r["to"] == phase, timeout)

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

    def orphans(self, settle: float = 3.0) -> list[psutil.Process]:
        """Tagged processes still alive after `settle` seconds (zombies excluded)."""
        deadline = time.time() + settle
        while (left := tagged(self.tag)) and time.time() < deadline:
            time.sleep(0.1)
        return left
