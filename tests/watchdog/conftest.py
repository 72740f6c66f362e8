"""Harness: the real watchdog CLI supervising the fake vLLM server, with real processes, signals
and HTTP on 127.0.0.1, free ports chosen at runtime and thresholds of a few seconds."""
from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil
import pytest
import yaml

FAKE = Path(__file__).with_name("fake_vllm.py")

FAST: dict[str, Any] = yaml.safe_load(FAKE.with_name("fast.yaml").read_text())
FAULT_MARK = re.compile(r"fake fault (\w+) at t=([\d.]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged(tag: str) -> list[psutil.Process]:
    """Every live process whose argv carries the run's tag (API server, engine, escaped grandchild)."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if tag in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            continue
    return out


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


@pytest.fixture
def watchdog(tmp_path):
    """start(mode, cfg=..., fake=[...], serve=[...], wd=[...]) -> Run of the real CLI."""
    runs: list[Run] = []

    def start(mode: str = "clean", cfg: dict[str, Any] | None = None, fake: list[str] = (),
              serve: list[str] = ("--max-model-len", "8192", "--gpu-memory-utilization", "0.05"),
              wd: list[str] = ()) -> Run:
        n = len(runs)
        log_dir, port, tag = tmp_path / f"logs{n}", free_port(), f"fake-{uuid.uuid4().hex[:10]}"
        cfg_file = tmp_path / f"watchdog{n}.yaml"
        cfg_file.write_text(yaml.safe_dump({**FAST, "log_dir": str(log_dir), **(cfg or {})}))
        cmd = [sys.executable, "-m", "ling_watchdog", "--config", str(cfg_file), *wd, "--",
               sys.executable, str(FAKE), "serve", "fake-model", "--port", str(port), "--fake-mode", mode,
               "--fake-tag", tag, "--fake-state", str(tmp_path / f"launches{n}"), "--fake-shard-s", "0.02",
               *fake, *serve]
        out = open(tmp_path / f"stdout{n}.txt", "wb")
        run = Run(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT), log_dir, tag, port)
        runs.append(run)
        return run

    yield start
    for run in runs:  # a failed test must not leak processes into the next one
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGTERM)
            try:
                run.proc.wait(15)
            except subprocess.TimeoutExpired:
                run.proc.kill()
        for p in tagged(run.tag):
            p.kill()
