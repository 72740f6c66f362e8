"""Run every fault of the fake vLLM server under the real watchdog CLI and tabulate the outcome.

    python3 tests/watchdog/fault_table.py [--out table.md] [--only NAME-SUBSTRING]

Real processes, signals and HTTP on 127.0.0.1; thresholds from tests/watchdog/fast.yaml (a few seconds
each). "Time to detect" runs from the fault's start (the fake prints `fake fault X at t=`; an inflicted
fault: when its signal was sent) to the watchdog's verdict; "orphans" counts the run's processes (all
it ever had, and the fake's tagged ones) alive after the watchdog exits. real_faults.py runs the same
scenarios' shapes on the real serve recipe.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from watchdog_harness import (FAKE, FAST, FAULT_MARK, Tree, ask_over_context, free_port, inject, launched_pid,
                              read_jsonl, tagged)

FAULT_EVENTS = ("stall", "wedge", "crash", "memory_guard")
EXITS = {0: "server stopped on purpose", 2: "refused by preflight", 3: "gave up", 4: "memory guard",
         5: "fatal, no relaunch", 7: "bad settings", 143: "stopped by SIGTERM"}


@dataclass(frozen=True)
class Scenario:
    name: str
    mode: str = "clean"
    fake: tuple[str, ...] = ()
    cfg: dict = field(default_factory=dict)
    end: str = "exit"  # "exit": wait for the watchdog to stop | "serving": signal it once serving
    hold_s: float = 0.0  # keep serving this long first (faults that must NOT be acted on)
    kill: int = signal.SIGTERM
    recovers: bool = False  # a fault that the watchdog must act on, then serve again
    harmless: bool = False  # not a fault: any kill is a false one (slow JIT, busy, a server with a key)
    inflict: str | None = None  # once serving: kill_engine | kill_worker | kill_api | stop_engine
    over_context: int | None = None  # once serving, before any inflicted fault: a prompt over this context,
    # then a short one (needs `port`)
    wait_check: bool = False  # stop only once the serving launch's self-check has its verdict (a stop during the
    # check's requests may outlast the kill grace on a loaded CPU: then the stop is a SIGKILL, not the fault's doing)
    model: str = "fake-model"
    port: int | None = None  # None: a free one
    serve: tuple[str, ...] = ()  # more serve flags
    wd: tuple[str, ...] = ()  # watchdog flags
    env: dict = field(default_factory=dict)  # the serve command's environment on top of ours


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
    Scenario("engine core SIGKILLed while serving (rc 0 after EngineDeadError)", inflict="kill_engine",
             end="serving", recovers=True),
    Scenario("worker SIGKILLed while serving (the OOM killer's pick)", inflict="kill_worker", end="serving",
             recovers=True),
    Scenario("API server SIGKILLed while serving", inflict="kill_api", end="serving", recovers=True),
    Scenario("engine core SIGSTOPped: wedged, /health still 200", inflict="stop_engine", end="serving",
             recovers=True),
    Scenario("--api-key set (probes present it)", serve=("--api-key", "sk-fault-table"), end="serving", hold_s=3,
             harmless=True),
    Scenario("VLLM_API_KEY set (probes present it)", env={"VLLM_API_KEY": "sk-fault-table"}, end="serving",
             hold_s=3, harmless=True),
    Scenario("bad port 99999", port=99999),
    Scenario("bad port 99999 forced past preflight", port=99999, wd=("--force",)),
    Scenario("missing model /nonexistent", model="/nonexistent"),
    Scenario("missing model forced past preflight", model="/nonexistent", wd=("--force",)),
    Scenario("slow first request, 3 s JIT (W8)", "slow_first", ("--fake-jit-s", "3"), end="serving", hold_s=2,
             harmless=True),
    Scenario("busy: completions slower than the probe", "busy", ("--fake-busy-s", "2.5"), end="serving", hold_s=5,
             harmless=True),
    Scenario("memory hog (guard 150 MB under start)", "memory_hog", ("--fake-hog-mb", "500"),
             cfg={"guard_floor_below_start_mb": 150}),
    Scenario("engine ignores SIGTERM + setsid() escapee", fake=("--fake-stubborn", "--fake-escape"), end="serving"),
    Scenario("watchdog itself SIGKILLed", end="serving", kill=signal.SIGKILL),
)

Command = Callable[[Scenario, Path, str], tuple[list[str], dict[str, str] | None]]


def fake_command(sc: Scenario, log_dir: Path, tag: str) -> tuple[list[str], dict[str, str] | None]:
    """The real watchdog CLI over the fake server, with fast.yaml's thresholds."""
    cfg_file = log_dir.with_suffix(".yaml")
    cfg_file.parent.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(yaml.safe_dump({**FAST, "log_dir": str(log_dir), **sc.cfg}))
    cmd = [sys.executable, "-m", "ling_watchdog", "--config", str(cfg_file), *sc.wd, "--", sys.executable,
           str(FAKE), "serve", sc.model, "--port", str(sc.port or free_port()), "--max-model-len", "8192",
           "--gpu-memory-utilization", "0.05", "--fake-mode", sc.mode, "--fake-tag", tag,
           "--fake-state", str(log_dir) + ".launches", "--fake-shard-s", "0.02", *sc.fake, *sc.serve]
    return cmd, ({**os.environ, **sc.env} if sc.env else None)


def _serving(events: list[dict], after_fault: bool) -> bool:
    """Serving now; with after_fault, serving again on a relaunch that followed a fault."""
    serving = [e["t"] for e in events if e.get("to") == "serving"]
    faults = [e["t"] for e in events if e["event"] in FAULT_EVENTS]
    if not after_fault:
        return bool(serving)
    return bool(serving and faults) and serving[-1] > faults[-1]


def _checked(events: list[dict]) -> bool:
    """The self-check of the latest serving launch has its verdict (an after_serving event with a code)."""
    serving = [e["t"] for e in events if e.get("to") == "serving"]
    return bool(serving) and any(e["event"] == "after_serving" and "code" in e and e["t"] >= serving[-1]
                                 for e in events)


def run(sc: Scenario, workdir: Path, command: Command = fake_command, timeout: float = 90,
        tree_settle_s: float = 0.5) -> dict:
    """One scenario through the real CLI; returns the row of the table as a dict."""
    tag, log_dir = f"ft-{uuid.uuid4().hex[:8]}", workdir / uuid.uuid4().hex[:6]
    cmd, env = command(sc, log_dir, tag)
    wd = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    tree, inflicted, asked = Tree(wd.pid), None, None
    deadline = time.time() + timeout
    while wd.poll() is None and time.time() < deadline:
        tree.sample()
        events = read_jsonl(log_dir / "events.jsonl")
        if sc.over_context is not None and asked is None and _serving(events, False):
            asked = ask_over_context(sc.port, sc.over_context)  # first, so a fault inflicted next comes after it
        elif sc.inflict and inflicted is None and _serving(events, False):
            inflicted = inject(sc.inflict, launched_pid(events))
        elif (sc.end == "serving" and (not sc.inflict or inflicted) and _serving(events, sc.recovers)
              and (not sc.wait_check or _checked(events))):
            time.sleep(sc.hold_s)
            wd.send_signal(sc.kill)
            break
        time.sleep(0.1)
    try:
        rc = wd.wait(60)
    except subprocess.TimeoutExpired:
        wd.kill()
        rc = wd.wait()
    time.sleep(3.0 if sc.kill == signal.SIGKILL else tree_settle_s)  # parent-death signal, shutdown
    left = {p.pid: p for p in [*tree.alive(), *tagged(tag)]}
    for p in left.values():
        p.kill()
    log = (log_dir / "serve.log").read_text(errors="replace") if (log_dir / "serve.log").exists() else ""
    row = _row(sc, read_jsonl(log_dir / "events.jsonl"), log, rc, len(left), inflicted)
    if asked is not None:
        row["asked"] = asked
    if secret := _secret(sc):  # the key, anywhere the watchdog wrote (serve.log, events.jsonl, status)
        status = subprocess.run([sys.executable, "-m", "ling_watchdog", "status", "--log-dir", str(log_dir)],
                                capture_output=True, text=True).stdout
        written = sum(p.read_text(errors="replace").count(secret) for p in log_dir.glob("*") if p.is_file())
        row["action"] += f"; key written {written + status.count(secret)}x"
    return row


def _secret(sc: Scenario) -> str | None:
    if "--api-key" in sc.serve:
        return sc.serve[sc.serve.index("--api-key") + 1]
    return sc.env.get("VLLM_API_KEY")


def _row(sc: Scenario, events: list[dict], log: str, rc: int, orphans: int, inflicted: float | None = None) -> dict:
    marks = [inflicted] if inflicted else [float(m[2]) for m in FAULT_MARK.finditer(log)]
    faults = [e for e in events if e["event"] in FAULT_EVENTS]
    finals = [e for e in events if e["event"] == "final"]
    kills = [e for e in events if e["event"] == "kill"]
    code = finals[-1]["code"] if finals else None
    refused = [e for e in events if e["event"] == "preflight" and e.get("verdict") == "refuse"]
    if faults:
        detected = f"yes: {faults[0]['event']} ({faults[0].get('cause', '')})"
        when = faults[0]["t"]
    elif code == 5:
        detected = "yes: fatal vLLM error"
        when = next((e["t"] for e in events if e["event"] == "fatal_line" and not e.get("retry")), finals[-1]["t"])
    elif code == 2 and refused:
        detected, when = f"yes: refused by preflight ({', '.join(e['rule'] for e in refused)})", None
    else:
        detected, when = "no fault seen" + (" (correct: not a hang)" if marks else " (correct)"), None
    ttd = f"{when - marks[0]:.1f} s" if when and marks else "-"
    acted = [k for k in kills if when and k["t"] >= when][:1]  # the kill that answered the fault
    steps = [f"{k['signal']} to the group" if k["signal"] != "none" else "reap the group" for k in acted]
    relaunches = sum(e["event"] == "relaunch" for e in events)
    if relaunches:
        steps.append(f"relaunch x{relaunches}")
    if any(e.get("to") == "serving" and (when is None or e["t"] > when) for e in events):
        steps.append("serving")
    # a verdict on a server that was fine: any, for a harmless scenario; else one before the fault began
    false_kills = sum(1 for f in faults if sc.harmless or (marks and f["t"] < marks[0]))
    checks = [e for e in events if e["event"] == "after_serving" and "code" in e]
    if checks:
        steps.append("self-check exit " + "/".join(str(e["code"]) for e in checks))
    if sc.kill == signal.SIGKILL:
        steps.append("watchdog SIGKILLed: its child got the parent-death SIGTERM")
    else:
        stop = kills[-1] if kills and kills[-1] not in acted else None
        how = f", {stop['signal']} after {stop['seconds']:.1f} s" if stop and stop["signal"] == "SIGKILL" else ""
        steps.append(f"exit {rc} ({EXITS.get(rc, 'see log')}{how})")
    return dict(fault=sc.name, detected=detected, ttd=ttd, action=", ".join(steps), relaunches=relaunches,
                false_kills=false_kills, orphans=orphans)


def markdown(rows: list[dict]) -> str:
    head = ("| fault | detected? | time to detect | action | relaunches | false kills | orphans |\n"
            "|---|---|---|---|---|---|---|\n")
    return head + "".join(f"| {r['fault']} | {r['detected']} | {r['ttd']} | {r['action']} | {r['relaunches']} | "
                          f"{r['false_kills']} | {r['orphans']} |\n" for r in rows)


def main(argv: list[str] | None = None, scenarios: tuple[Scenario, ...] = SCENARIOS,
         command: Command = fake_command, timeout: float = 90) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, help="also write the table here")
    p.add_argument("--only", help="run only scenarios whose name contains this")
    args = p.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="ling-fault-table-") as tmp:
        for sc in scenarios:
            if not args.only or args.only in sc.name:
                rows.append(run(sc, Path(tmp), command, timeout))
                print(markdown(rows[-1:]).splitlines()[-1], flush=True)
    table = markdown(rows)
    print(table)
    if args.out:
        args.out.write_text(table)
    return 0 if all(r["orphans"] == 0 and r["false_kills"] == 0 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
