"""Run every fault of the fake vLLM server under the real watchdog CLI and tabulate the outcome.

    python -m ling_watchdog.fault_table [--out table.md]

Real processes, signals and HTTP on 127.0.0.1; thresholds from tests/watchdog/fast.yaml (a few
seconds each). "Time to detect" runs from the fault's start (the fake prints `fake fault X at t=`)
to the watchdog's fault event; "orphans" counts the run's processes alive after the watchdog exits.
"""
from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import yaml

TESTS = Path(__file__).resolve().parents[1] / "tests" / "watchdog"
FAULT_EVENTS = ("stall", "wedge", "crash", "memory_guard")
EXITS = {0: "server stopped itself", 3: "gave up", 4: "memory guard", 5: "fatal, no relaunch",
         143: "stopped by SIGTERM"}
MARK = re.compile(r"fake fault (\w+) at t=([\d.]+)")


@dataclass(frozen=True)
class Scenario:
    name: str
    mode: str
    fake: tuple[str, ...] = ()
    cfg: dict = field(default_factory=dict)
    end: str = "exit"  # "exit": wait for the watchdog to stop | "serving": signal it once serving
    hold_s: float = 0.0  # keep serving this long first (faults that must NOT be acted on)
    kill: int = signal.SIGTERM
    recovers: bool = False  # a fault that the watchdog must act on, then serve again


SCENARIOS = (
    Scenario("cold-start shard freeze, 1 CPU pinned (W7)", "stall_shard", ("--fake-faulty-launches", "1"),
             end="serving", recovers=True),
    Scenario("shard freeze on every launch", "stall_shard"),
    Scenario("silent stall while loading, CPU idle", "stall_silent", ("--fake-faulty-launches", "1"),
             end="serving", recovers=True),
    Scenario("crash during load", "crash_load", ("--fake-faulty-launches", "1"), end="serving", recovers=True),
    Scenario("vLLM config error (free memory < util)", "fatal_config"),
    Scenario("wedge after ready, /health still 200", "wedge", ("--fake-faulty-launches", "1"), end="serving",
             recovers=True),
    Scenario("slow first request, 3 s JIT (W8)", "slow_first", ("--fake-jit-s", "3"), end="serving", hold_s=2),
    Scenario("busy: completions slower than the probe", "busy", ("--fake-busy-s", "2.5"), end="serving", hold_s=5),
    Scenario("memory hog (guard 150 MB under start)", "memory_hog", ("--fake-hog-mb", "500"),
             cfg={"guard_floor_below_start_mb": 150}),
    Scenario("engine ignores SIGTERM + setsid() escapee", "clean", ("--fake-stubborn", "--fake-escape"),
             end="serving"),
    Scenario("watchdog itself SIGKILLed", "clean", end="serving", kill=signal.SIGKILL),
)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tagged(tag: str) -> list[psutil.Process]:
    """Every live process whose argv carries the run's tag (API server, engine, escaped grandchild)."""
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if tag in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def _events(log_dir: Path) -> list[dict]:
    path = log_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _serving(events: list[dict], after_fault: bool) -> bool:
    """Serving now; with after_fault, serving again on a relaunch that followed a fault."""
    serving = [e["t"] for e in events if e.get("to") == "serving"]
    faults = [e["t"] for e in events if e["event"] in FAULT_EVENTS]
    if not after_fault:
        return bool(serving)
    return bool(serving and faults) and serving[-1] > faults[-1]


def run(sc: Scenario, workdir: Path, timeout: float = 90) -> dict:
    """One scenario through the real CLI; returns the row of the table as a dict."""
    tag, log_dir = f"ft-{uuid.uuid4().hex[:8]}", workdir / sc.mode / uuid.uuid4().hex[:6]
    cfg = {**yaml.safe_load((TESTS / "fast.yaml").read_text()), "log_dir": str(log_dir), **sc.cfg}
    cfg_file = log_dir.with_suffix(".yaml")
    cfg_file.parent.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "ling_watchdog", "--config", str(cfg_file), "--", sys.executable,
           str(TESTS / "fake_vllm.py"), "serve", "fake-model", "--port", str(free_port()), "--max-model-len",
           "8192", "--gpu-memory-utilization", "0.05", "--fake-mode", sc.mode, "--fake-tag", tag,
           "--fake-state", str(log_dir) + ".launches",
           "--fake-shard-s", "0.02", *sc.fake]
    wd = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while wd.poll() is None and time.time() < deadline:
        if sc.end == "serving" and _serving(_events(log_dir), sc.recovers):
            time.sleep(sc.hold_s)
            wd.send_signal(sc.kill)
            break
        time.sleep(0.1)
    try:
        rc = wd.wait(30)
    except subprocess.TimeoutExpired:
        wd.kill()
        rc = wd.wait()
    time.sleep(3.0 if sc.kill == signal.SIGKILL else 0.5)  # parent-death signal and shutdown take a moment
    orphans = tagged(tag)
    for p in orphans:
        p.kill()
    return _row(sc, _events(log_dir), (log_dir / "serve.log").read_text(errors="replace"), rc, len(orphans))


def _row(sc: Scenario, events: list[dict], log: str, rc: int, orphans: int) -> dict:
    marks = [float(m[2]) for m in MARK.finditer(log)]
    faults = [e for e in events if e["event"] in FAULT_EVENTS]
    finals = [e for e in events if e["event"] == "final"]
    kills = [e for e in events if e["event"] == "kill"]
    fatal = bool(finals) and finals[-1]["code"] == 5
    if faults:
        detected = f"yes: {faults[0]['event']} ({faults[0].get('cause', '')})"
        when = faults[0]["t"]
    elif fatal:
        detected = "yes: fatal vLLM error"
        when = next((e["t"] for e in events if e["event"] == "fatal_line" and not e.get("retry")), finals[-1]["t"])
    else:
        detected, when = "no fault seen" + (" (correct: not a hang)" if marks else ""), None
    ttd = f"{when - marks[0]:.1f} s" if when and marks else "-"
    acted = [k for k in kills if when and k["t"] >= when][:1]  # the kill that answered the fault
    steps = [f"{k['signal']} to the group" if k["signal"] != "none" else "reap the group" for k in acted]
    relaunches = sum(e["event"] == "relaunch" for e in events)
    if relaunches:
        steps.append(f"relaunch x{relaunches}")
    if any(e.get("to") == "serving" and (when is None or e["t"] > when) for e in events):
        steps.append("serving")
    if sc.kill == signal.SIGKILL:
        steps.append("watchdog SIGKILLed: its child got the parent-death SIGTERM")
    else:
        stop = kills[-1] if kills and kills[-1] not in acted else None
        how = f", {stop['signal']} after {stop['seconds']:.1f} s" if stop and stop["signal"] == "SIGKILL" else ""
        steps.append(f"exit {rc} ({EXITS.get(rc, 'see log')}{how})")
    return dict(fault=sc.name, detected=detected, ttd=ttd, action=", ".join(steps), relaunches=relaunches,
                orphans=orphans)


def markdown(rows: list[dict]) -> str:
    head = "| fault | detected? | time to detect | action | relaunches | orphans |\n|---|---|---|---|---|---|\n"
    return head + "".join(f"| {r['fault']} | {r['detected']} | {r['ttd']} | {r['action']} | {r['relaunches']} | "
                          f"{r['orphans']} |\n" for r in rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="also write the table here")
    p.add_argument("--only", help="run only scenarios whose fake mode matches")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ling-fault-table-") as tmp:
        rows = [run(sc, Path(tmp)) for sc in SCENARIOS if not args.only or args.only == sc.mode]
    table = markdown(rows)
    print(table)
    if args.out:
        args.out.write_text(table)
    return 0 if all(r["orphans"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
