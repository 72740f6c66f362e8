"""The demo shows this run's self-check verdict, never one an earlier run left in the same log dir: it reads
the events of the run whose watchdog it started (the recipe execs the watchdog: same pid), latest launch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from ling_watchdog.events import EventLog

from ling_tools.demo import selfcheck_verdict


def _log(tmp_path, t: float) -> EventLog:
    return EventLog(tmp_path, max_bytes=1 << 20, backups=1, echo=False, clock=lambda: t)


@pytest.fixture
def server():
    """A live process standing in for the recipe's watchdog (the demo waits only while it runs)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()
    proc.wait()


def test_an_earlier_runs_verdict_in_the_log_dir_is_not_this_runs(tmp_path, capsys, server):
    old = _log(tmp_path, 1000.0)
    old.emit("start", "ling-watchdog pid 1 (an earlier run)", pid=1)
    old.emit("launch", "launch aaaa-1: pid 2")
    old.emit("after_serving", "vllm-ling self-check: MTP ON (an earlier run)")
    old.emit("after_serving", "after-serving check exit 0", code=0)
    old.emit("start", f"ling-watchdog pid {server.pid} (this run)", pid=server.pid)
    old.emit("launch", "launch bbbb-1: pid 3")
    old.close()
    assert selfcheck_verdict(tmp_path, server, timeout=1.5) is None
    new = _log(tmp_path, 900.0)  # a clock that went backwards: times decide nothing
    new.emit("after_serving", "vllm-ling self-check: MTP OFF not configured")
    new.emit("after_serving", "after-serving check exit 2", code=2)
    new.close()
    assert selfcheck_verdict(tmp_path, server, timeout=5) == 2
    out = capsys.readouterr().out
    assert "an earlier run" not in out and "after-serving check exit 2" in out and "MTP OFF" in out


def test_a_relaunch_shows_only_the_latest_launchs_verdict(tmp_path, capsys, server):
    log = _log(tmp_path, 1.0)
    log.emit("start", "ling-watchdog", pid=server.pid)
    log.emit("launch", "launch cccc-1: pid 2")
    log.emit("after_serving", "first launch's check exit 2", code=2)
    log.emit("launch", "launch cccc-2: pid 3")
    log.emit("after_serving", "second launch's check exit 0", code=0)
    log.close()
    assert selfcheck_verdict(tmp_path, server, timeout=5) == 0
    assert "first launch" not in capsys.readouterr().out
