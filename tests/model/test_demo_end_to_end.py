"""The README's main command, end to end on CPU: serve script + watchdog + tiny checkpoint + a real chat completion."""

from __future__ import annotations

import re
import subprocess
import sys

import psutil
import pytest

pytestmark = pytest.mark.engine


def test_demo_serves_tiny_model_through_watchdog_and_leaves_nothing_running(tmp_path):
    before = {p.pid for p in psutil.process_iter()}
    proc = subprocess.run([sys.executable, "-m", "ling_tools.demo", "--log-dir", str(tmp_path / "logs")],
                          capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "[demo] chat reply:" in out and "[demo] completion:" in out
    assert "vllm-ling self-check: MTP" in out
    assert re.search(r"vllm-ling self-check: batch agreement\s+ON ", out), "the two-sequence greedy probe did not pass"
    log = (tmp_path / "logs" / "serve.log").read_text()
    assert "vllm-ling: BailingMoeV3ForCausalLM and its MTP draft are served by vllm-ling" in log
    assert '"POST /v1/chat/completions HTTP/1.1" 200' in log
    leftovers = [p for p in psutil.process_iter(["pid", "cmdline"])
                 if p.pid not in before and "vllm.entrypoints.openai.api_server" in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"processes left running: {[p.pid for p in leftovers]}"
