"""Fixture: the real watchdog CLI supervising the fake vLLM server, with real processes, signals
and HTTP on 127.0.0.1, free ports chosen at runtime and thresholds of a few seconds."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from typing import Any

import pytest
import yaml
from ling_watchdog import vllm_parse
from watchdog_harness import FAKE, FAST, Run, free_port, tagged


@pytest.fixture(scope="session")
def vllm_parser():
    """vLLM's own argument parser, imported once per session: ServeArgs.parse then runs it in this process
    (the watchdog runs it in a subprocess; serve_args.py says why). ~10-20 s on a loaded 2-core box."""
    vllm_parse.parse([])


@pytest.fixture
def watchdog(tmp_path):
    """start(mode, cfg=..., fake=[...], serve=[...], wd=[...]) -> Run of the real CLI."""
    runs: list[Run] = []

    def start(mode: str = "clean", cfg: dict[str, Any] | None = None, fake: list[str] = (),
              serve: list[str] = ("--max-model-len", "8192", "--gpu-memory-utilization", "0.05"),
              wd: list[str] = (), model: str = "fake-model", port: int | None = None,
              env: dict[str, str] | None = None) -> Run:
        n = len(runs)
        log_dir, port, tag = tmp_path / f"logs{n}", port or free_port(), f"fake-{uuid.uuid4().hex[:10]}"
        cfg_file = tmp_path / f"watchdog{n}.yaml"
        cfg_file.write_text(yaml.safe_dump({**FAST, "log_dir": str(log_dir), **(cfg or {})}))
        cmd = [sys.executable, "-m", "ling_watchdog", "--config", str(cfg_file), *wd, "--",
               sys.executable, str(FAKE), "serve", model, "--port", str(port), "--fake-mode", mode,
               "--fake-tag", tag, "--fake-state", str(tmp_path / f"launches{n}"), "--fake-shard-s", "0.02",
               *fake, *serve]
        out = open(tmp_path / f"stdout{n}.txt", "wb")
        run = Run(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}),
                  log_dir, tag, port)
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
