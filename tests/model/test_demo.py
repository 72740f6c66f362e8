"""The demo shows this run's self-check verdict, never one an earlier run left in the same log dir."""

from __future__ import annotations

import subprocess
import sys

from ling_watchdog.events import EventLog

from vllm_ling.demo import selfcheck_verdict


def _log(tmp_path, t: float) -> EventLog:
    return EventLog(tmp_path, max_bytes=1 << 20, backups=1, echo=False, clock=lambda: t)


def test_an_earlier_runs_verdict_in_the_log_dir_is_not_this_runs(tmp_path, capsys):
    old = _log(tmp_path, 1000.0)
    old.emit("after_serving", "vllm-ling self-check: MTP ON (an earlier run)")
    old.emit("after_serving", "after-serving check exit 0", code=0)
    old.close()
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert selfcheck_verdict(tmp_path, server, timeout=1.5, since=2000.0) is None
        new = _log(tmp_path, 2001.0)
        new.emit("after_serving", "after-serving check exit 2", code=2)
        new.close()
        assert selfcheck_verdict(tmp_path, server, timeout=5, since=2000.0) == 2
    finally:
        server.kill()
        server.wait()
    out = capsys.readouterr().out
    assert "an earlier run" not in out and "after-serving check exit 2" in out
