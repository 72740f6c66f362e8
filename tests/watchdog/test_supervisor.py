"""End to end: the ling-watchdog CLI supervising the fake vLLM server through each fault."""
from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from watchdog_harness import FAST

SLACK_S = 3.0  # scheduling slack on a loaded 2-core CI box, on top of the configured threshold


def test_clean_run_reaches_serving_and_sigterm_stops_the_whole_group(watchdog):
    run = watchdog("clean")
    run.wait_phase("serving")
    assert run.stop(signal.SIGTERM) == 143
    kills = run.events("kill")
    assert [k["signal"] for k in kills] == ["SIGTERM"] and kills[0]["survivors"] == 0
    assert not run.events("stall") and not run.events("wedge") and not run.events("relaunch")
    assert [p["to"] for p in run.events("phase")] == ["warmup", "serving"]
    assert run.events("final")[-1]["code"] == 143
    assert run.orphans() == []


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_sigint_and_sighup_stop_the_child_with_their_exit_codes(watchdog, sig, code):
    run = watchdog("clean")
    run.wait_phase("serving")
    assert run.stop(sig) == code
    assert run.events("kill")[0]["survivors"] == 0
    assert run.orphans() == []


def test_shard_freeze_with_a_busy_cpu_is_killed_and_the_relaunch_serves(watchdog):
    run = watchdog("stall_shard", fake=["--fake-faulty-launches", "1", "--fake-stall-at", "7"])
    stall = run.wait_for(lambda r: r["event"] == "stall")
    assert stall["cause"] == "shard_freeze" and stall["shard"] == 7 and stall["total"] == 24
    assert stall["cpu_percent"] >= FAST["busy_cpu_percent"]
    assert FAST["load_stall_s"] <= stall["held_s"] <= FAST["load_stall_s"] + SLACK_S
    fault_t = run.fault_times()[0]
    assert FAST["load_stall_s"] <= stall["t"] - fault_t <= FAST["load_stall_s"] + FAST["cpu_busy_s"] + SLACK_S
    run.wait_phase("serving")
    assert len(run.events("relaunch")) == 1 and len(run.events("launch")) == 2
    assert run.events("kill")[0]["survivors"] == 0
    assert run.stop() == 143
    log = run.serve_log()  # the first launch's lines survive the relaunch
    assert log.count("Loading safetensors checkpoint shards:   0% Completed | 0/24") == 2
    assert "fake fault stall_shard" in log
    assert run.orphans() == []


def test_persistent_shard_freeze_gives_up_after_three_relaunches_with_backoff(watchdog):
    run = watchdog("stall_shard", fake=["--fake-stall-at", "3"])
    assert run.wait(90) == 3
    assert len(run.events("launch")) == 4
    assert [r["backoff_s"] for r in run.events("relaunch")] == [0.2, 0.4, 0.8]
    assert [s["cause"] for s in run.events("stall")] == ["shard_freeze"] * 4
    final = run.events("final")[-1]
    assert final["code"] == 3 and "relaunch limit" in final["message"] and final["relaunches"] == 3
    assert run.orphans() == []


def test_silent_stall_without_cpu_is_not_a_shard_freeze_but_hits_the_silence_limit(watchdog):
    run = watchdog("stall_silent", cfg=dict(max_relaunches=0))
    assert run.wait(60) == 3
    (stall,) = run.events("stall")
    assert stall["cause"] == "silent"  # idle CPU: the shard rule must not fire
    assert FAST["load_silent_s"] <= stall["t"] - run.fault_times()[0] <= FAST["load_silent_s"] + SLACK_S
    assert run.orphans() == []


def test_crash_during_load_is_relaunched_and_reports_vllms_reason(watchdog):
    run = watchdog("crash_load", fake=["--fake-faulty-launches", "1"])
    run.wait_phase("serving")
    (crash,) = run.events("crash")
    assert crash["phase"] == "loading" and crash["rc"] == 1
    assert "first error: RuntimeError: fake crash while loading shard 7" in crash["message"]
    assert "vLLM said:" in crash["message"]
    assert len(run.events("relaunch")) == 1
    assert run.stop() == 143
    assert run.orphans() == []


def test_fatal_config_error_stops_without_relaunching(watchdog):
    run = watchdog("fatal_config")
    assert run.wait(30) == 5
    assert not run.events("relaunch") and len(run.events("launch")) == 1
    assert "Free memory on device" in run.events("final")[-1]["message"]
    assert run.orphans() == []


def test_wedge_after_ready_is_caught_by_liveness_while_health_says_200(watchdog):
    run = watchdog("wedge", fake=["--fake-faulty-launches", "1"])
    wedge = run.wait_for(lambda r: r["event"] == "wedge")
    assert wedge["cause"] == "liveness" and wedge["phase"] == "serving"
    fails = run.events("probe_fail")
    assert len(fails) == FAST["fail_threshold"] and all("completion" in f["message"] for f in fails)
    # K probes of (health + completion timeout) spaced probe_interval apart
    bound = FAST["fail_threshold"] * (FAST["probe_interval_s"] + FAST["liveness_timeout_s"] + FAST["health_timeout_s"])
    assert wedge["t"] - run.fault_times()[0] <= bound + SLACK_S
    run.wait_for(lambda r: r.get("to") == "serving" and r["t"] > wedge["t"])  # the relaunch is clean
    assert len(run.events("relaunch")) == 1
    assert run.stop() == 143
    assert run.orphans() == []


def test_wedge_during_the_first_request_is_not_judged_before_the_jit_grace(watchdog):
    run = watchdog("wedge", cfg=dict(max_relaunches=0, warmup_grace_s=3), fake=["--fake-wedge-at-s", "0"])
    assert run.wait(30) == 3
    (wedge,) = run.events("wedge")
    assert wedge["cause"] == "first_request" and wedge["phase"] == "warmup"
    assert wedge["t"] - run.fault_times()[0] >= 3


def test_slow_first_request_jit_is_never_killed(watchdog):
    jit = 3.0  # longer than liveness_timeout_s (1 s), shorter than warmup_grace_s (10 s)
    run = watchdog("slow_first", fake=["--fake-jit-s", str(jit)])
    serving = run.wait_phase("serving", timeout=40)
    assert serving["t"] - run.fault_times()[0] >= jit
    time.sleep(4 * FAST["probe_interval_s"])
    assert not run.events("wedge") and not run.events("probe_fail") and not run.events("kill")
    assert run.stop() == 143
    assert run.orphans() == []


def test_busy_server_whose_tokens_advance_is_not_wedged(watchdog):
    run = watchdog("busy", fake=["--fake-busy-s", "2.5"], cfg=dict(warmup_grace_s=10))
    run.wait_phase("serving", timeout=40)
    busy = run.wait_for(lambda r: r["event"] == "probe_busy", timeout=20)
    assert "busy, not wedged" in busy["message"]
    time.sleep((FAST["fail_threshold"] + 1) * (FAST["probe_interval_s"] + FAST["liveness_timeout_s"]))
    assert not run.events("wedge") and not run.events("kill"), [f["message"] for f in run.events("probe_fail")]
    assert run.stop() == 143
    assert run.orphans() == []


def test_memory_guard_stops_the_server_before_memory_runs_out(watchdog):
    run = watchdog("memory_hog", cfg=dict(guard_floor_below_start_mb=150),
                   fake=["--fake-hog-mb", "500", "--fake-hog-step-mb", "25"])
    assert run.wait(60) == 4
    (guard,) = run.events("memory_guard")
    assert guard["available"] < guard["floor"] and "before the box wedges" in guard["message"]
    assert not run.events("relaunch")
    assert run.events("kill")[0]["survivors"] == 0
    assert run.orphans() == []


def test_engine_ignoring_sigterm_is_sigkilled_after_grace_and_escapees_are_swept(watchdog):
    run = watchdog("clean", fake=["--fake-stubborn", "--fake-escape"])
    run.wait_phase("serving")
    assert run.stop() == 143
    (kill,) = run.events("kill")
    assert kill["signal"] == "SIGKILL" and kill["seconds"] >= FAST["kill_grace_s"] - 0.1
    assert kill["survivors"] == 0
    assert run.orphans(settle=0.5) == []  # the setsid() grandchild too


def test_burst_limit_stops_before_the_relaunch_limit(watchdog):
    run = watchdog("crash_load", cfg=dict(max_relaunches=10, burst_failures=2, burst_window_s=600))
    assert run.wait(60) == 3
    assert len(run.events("launch")) == 2 and len(run.events("relaunch")) == 1
    assert "burst limit" in run.events("final")[-1]["message"]


def test_watchdog_killed_with_sigkill_still_takes_the_server_down(watchdog):
    run = watchdog("clean")
    run.wait_phase("serving")
    run.proc.kill()  # no handler can run: the child's parent-death signal must do it
    run.proc.wait(5)
    assert run.orphans(settle=5) == []


def test_status_summarises_phase_relaunches_and_last_fault(watchdog):
    run = watchdog("stall_shard", fake=["--fake-faulty-launches", "1"])
    run.wait_phase("serving")
    out = subprocess.run([sys.executable, "-m", "ling_watchdog", "status", "--log-dir", str(run.log_dir)],
                         capture_output=True, text=True, check=True).stdout
    assert "phase: serving" in out and "relaunches: 1" in out and "running" in out
    assert "last fault: shard_freeze" in out
    run.stop()
    out = subprocess.run([sys.executable, "-m", "ling_watchdog", "status", "--log-dir", str(run.log_dir)],
                         capture_output=True, text=True, check=True).stdout
    assert "phase: stopped" in out and "exit 143" in out


@pytest.mark.parametrize("code, level", [(0, "info"), (2, "error")])
def test_after_serving_check_runs_once_and_its_verdict_is_logged(watchdog, code, level):
    """The start-up self-check hook: run once serving starts, its lines and exit code land in the event log."""
    import sys

    check = f"{sys.executable} -c \"import sys; print('checked', sys.argv[1:3]); sys.exit({code})\" {{url}} {{log}}"
    run = watchdog("clean", cfg=dict(after_serving=check))
    run.wait_phase("serving")
    verdict = run.wait_for(lambda e: e["event"] == "after_serving" and "code" in e)
    assert verdict["code"] == code and verdict["level"] == level
    lines = [e["message"] for e in run.events("after_serving")]
    assert any(line.startswith("checked ['http://127.0.0.1:") and "serve.log" in line for line in lines)
    assert run.stop(signal.SIGTERM) == 143
    assert len([e for e in run.events("after_serving") if "code" in e]) == 1
    assert run.orphans() == []
