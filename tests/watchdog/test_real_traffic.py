"""The watchdog's traffic line against the real recipe on the CPU engine: requests sharing a 700-token prefix show up
in the next window as prefix-cache hits and as requests (the watchdog's own probes counted apart), read from vLLM's
own /metrics counters (the fake server only mimics their names), and `ling-watchdog status` shows that line."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from watchdog_harness import free_port

pytestmark = pytest.mark.engine
PREFIX, REQUESTS = 700, 6
WINDOW_S = 20


def _traffic(log_dir: Path) -> list[dict]:
    from ling_watchdog.events import read_events

    return [e for e in read_events(log_dir) if e.get("event") == "traffic"]


def _until(pred, timeout: float, proc: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the watchdog exited with {proc.returncode}"
        if found := pred():
            return found
        time.sleep(2)
    raise AssertionError(f"not within {timeout:.0f} s")


def test_requests_sharing_a_prefix_show_as_hits_in_the_next_traffic_line(tmp_path):
    from ling_tools.demo import serve_env, wait_ready
    from ling_tools.tiny import ensure_tiny

    port, log_dir = free_port(), tmp_path / "logs"
    env = serve_env(ensure_tiny(), port, log_dir) | {
        "WATCHDOG_ARGS": f"--traffic-log-s {WINDOW_S} --probe-interval-s 5", "SELFCHECK": "0"}
    proc = subprocess.Popen(["bash", str(Path(__file__).parents[2] / "serve" / "serve-int4.sh")], env=env,
                            start_new_session=True, stdout=open(tmp_path / "serve.out", "w"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, 900)
        first = _until(lambda: _traffic(log_dir), 4 * WINDOW_S, proc)[-1]  # a window is open from here on
        model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(0)
        prefix = [rng.randrange(10, 900) for _ in range(PREFIX)]
        for _ in range(REQUESTS):
            prompt = prefix + [rng.randrange(10, 900) for _ in range(40)]
            r = requests.post(f"{url}/v1/completions", timeout=300, json={
                "model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
        sent = REQUESTS * (PREFIX + 40)
        lines = _until(lambda: [e for e in _traffic(log_dir) if e["t"] > first["t"]
                                and sum(x["prefix_cache"]["queries"] for x in _traffic(log_dir)
                                        if x["t"] > first["t"]) >= sent], 6 * WINDOW_S, proc)
        after = [e for e in _traffic(log_dir) if e["t"] > first["t"]]
        queries, hits = (sum(e["prefix_cache"][k] for e in after) for k in ("queries", "hits"))
        # every request after the first finds the shared prefix cached, in whole blocks (vLLM recomputes the rest)
        assert sent <= queries < sent + 100 and (REQUESTS - 1) * PREFIX // 2 < hits <= (REQUESTS - 1) * PREFIX, after
        assert any("prefix cache" in e["message"] and e["prefix_cache"]["hits"] > 0 for e in lines)
        assert sum(e["requests"] for e in after) == REQUESTS, after  # the probes' own counted apart
        status = subprocess.run([sys.executable, "-m", "ling_watchdog", "status", "--log-dir", str(log_dir)],
                                capture_output=True, text=True, check=True).stdout
        assert any(line.startswith("traffic: ") for line in status.splitlines()), status
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
