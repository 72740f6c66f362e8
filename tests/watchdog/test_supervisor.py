"""End to end: the ling-watchdog CLI supervising the fake vLLM server through each fault."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest
from watchdog_harness import FAST, launched_pid, tagged

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
    assert not (left := run.orphans()), left


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGHUP, 129)])
def test_sigint_and_sighup_stop_the_child_with_their_exit_codes(watchdog, sig, code):
    run = watchdog("clean")
    run.wait_phase("serving")
    assert run.stop(sig) == code
    assert run.events("kill")[0]["survivors"] == 0
    assert not (left := run.orphans()), left


def test_a_second_signal_during_the_stop_neither_restarts_it_nor_changes_the_exit_code(watchdog):
    """Ctrl-C on top of systemd's stop. The SIGINT goes once the SIGTERM was taken (the server logged the watchdog's
    stop), while a stubborn engine holds the stop in its grace period: two signals sent back to back would be
    delivered lowest number first, SIGINT before SIGTERM, whatever order they were sent in."""
    run = watchdog("clean", fake=["--fake-stubborn"])
    run.wait_phase("serving")
    run.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + 20
    while "shutdown triggered" not in run.serve_log() and time.time() < deadline:
        time.sleep(0.05)
    run.proc.send_signal(signal.SIGINT)
    assert run.wait(20) == 143
    kills = run.events("kill")
    assert len(kills) == 1 and kills[0]["signal"] == "SIGKILL" and kills[0]["survivors"] == 0  # after the grace
    assert run.events("final")[-1]["code"] == 143
    assert not (left := run.orphans()), left


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
    assert not (left := run.orphans()), left


def test_persistent_shard_freeze_gives_up_after_three_relaunches_with_backoff(watchdog):
    run = watchdog("stall_shard", fake=["--fake-stall-at", "3"])
    assert run.wait(90) == 3
    assert len(run.events("launch")) == 4
    assert [r["backoff_s"] for r in run.events("relaunch")] == [0.2, 0.4, 0.8]
    assert [s["cause"] for s in run.events("stall")] == ["shard_freeze"] * 4
    final = run.events("final")[-1]
    assert final["code"] == 3 and "relaunch limit" in final["message"] and final["relaunches"] == 3
    assert not (left := run.orphans()), left


def test_silent_stall_without_cpu_is_not_a_shard_freeze_but_hits_the_silence_limit(watchdog):
    run = watchdog("stall_silent", cfg=dict(max_relaunches=0))
    assert run.wait(60) == 3
    (stall,) = run.events("stall")
    assert stall["cause"] == "silent"  # idle CPU: the shard rule must not fire
    assert FAST["load_silent_s"] <= stall["t"] - run.fault_times()[0] <= FAST["load_silent_s"] + SLACK_S
    assert not (left := run.orphans()), left


def test_crash_during_load_is_relaunched_and_reports_vllms_reason(watchdog):
    run = watchdog("crash_load", fake=["--fake-faulty-launches", "1"])
    run.wait_phase("serving")
    (crash,) = run.events("crash")
    assert crash["phase"] == "loading" and crash["rc"] == 1
    assert "first error: RuntimeError: fake crash while loading shard 7" in crash["message"]
    assert "vLLM said:" in crash["message"]
    assert len(run.events("relaunch")) == 1
    assert run.stop() == 143
    assert not (left := run.orphans()), left


def test_fatal_config_error_stops_without_relaunching(watchdog):
    run = watchdog("fatal_config")
    assert run.wait(30) == 5
    assert not run.events("relaunch") and len(run.events("launch")) == 1
    assert "Free memory on device" in run.events("final")[-1]["message"]
    assert not (left := run.orphans()), left


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
    assert not (left := run.orphans()), left


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
    assert not (left := run.orphans()), left


def test_busy_server_whose_tokens_advance_is_not_wedged(watchdog):
    run = watchdog("busy", fake=["--fake-busy-s", "2.5"], cfg=dict(warmup_grace_s=10))
    run.wait_phase("serving", timeout=40)
    busy = run.wait_for(lambda r: r["event"] == "probe_busy", timeout=20)
    assert "busy, not wedged" in busy["message"]
    time.sleep((FAST["fail_threshold"] + 1) * (FAST["probe_interval_s"] + FAST["liveness_timeout_s"]))
    assert not run.events("wedge") and not run.events("kill"), [f["message"] for f in run.events("probe_fail")]
    assert run.stop() == 143
    assert not (left := run.orphans()), left


def test_memory_guard_stops_the_server_before_memory_runs_out(watchdog):
    run = watchdog("memory_hog", cfg=dict(guard_floor_below_start_mb=150),
                   fake=["--fake-hog-mb", "500", "--fake-hog-step-mb", "25"])
    assert run.wait(60) == 4
    (guard,) = run.events("memory_guard")
    assert guard["available"] < guard["floor"] and "before the box wedges" in guard["message"]
    assert not run.events("relaunch")
    assert run.events("kill")[0]["survivors"] == 0
    assert not (left := run.orphans()), left


def test_engine_ignoring_sigterm_is_sigkilled_after_grace_and_escapees_are_swept(watchdog):
    run = watchdog("clean", fake=["--fake-stubborn", "--fake-escape"])
    run.wait_phase("serving")
    assert run.stop() == 143
    (kill,) = run.events("kill")
    assert kill["signal"] == "SIGKILL" and kill["seconds"] >= FAST["kill_grace_s"] - 0.1
    assert kill["survivors"] == 0
    assert not (left := run.orphans(settle=0.5)), left  # the setsid() grandchild too


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
    assert not (left := run.orphans(settle=5)), left


# A second signal can run the watchdog's handler again inside the first one's Event.set(), which holds the Event's
# lock: this script makes that happen every time (CPython's Event.set, with the second signal raised inside its
# lock, where the interpreter runs the nested handler). A nested set() would wait on that lock forever.
SECOND_SIGNAL_INSIDE_SET = """
import signal, sys, threading
from ling_watchdog.config import load_config
from ling_watchdog.events import EventLog
from ling_watchdog.supervisor import Supervisor


class SecondSignalInsideSet(threading.Event):
    def set(self):
        with self._cond:
            signal.raise_signal(signal.SIGINT)  # the nested handler runs here, the lock held
            self._flag = True
            self._cond.notify_all()


sup = Supervisor(["true"], load_config(), EventLog(sys.argv[1], 1 << 20, 1, echo=False), "http://127.0.0.1:1")
sup._halt = SecondSignalInsideSet()
for sig in (signal.SIGTERM, signal.SIGINT):
    signal.signal(sig, sup.request_stop)
signal.raise_signal(signal.SIGTERM)
print(sup._signal_code(), sup._halt.is_set())
"""


def test_a_second_signal_inside_the_first_handler_neither_hangs_nor_changes_the_exit_code(tmp_path):
    done = subprocess.run([sys.executable, "-c", SECOND_SIGNAL_INSIDE_SET, str(tmp_path)], capture_output=True,
                          text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["143", "True"]  # SIGTERM's code: the first signal decides


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


def test_a_traffic_line_is_logged_each_window_and_status_shows_the_latest(watchdog):
    """traffic_log_s: the /metrics counters over each window (here only the probes' own 1-token requests: 2 prompt
    tokens each, none of them a cached block) in the event log, the latest in `status`."""
    run = watchdog("clean", cfg={"traffic_log_s": 1.0})
    run.wait_phase("serving")
    first = run.wait_for(lambda r: r["event"] == "traffic", timeout=15)
    assert first["tokens"] > 0 and first["seconds"] >= 1.0 and first["spec_decode"] is None
    assert first["probes"] > 0 and first["requests"] == 0  # nobody but the watchdog asked anything
    cache = first["prefix_cache"]
    assert cache["queries"] > 0 and cache["hits"] == 0 and cache["hit_rate"] == 0.0
    assert first["message"].startswith("traffic: ") and "prefix cache 0.0% of" in first["message"]
    run.wait_for(lambda r: r["event"] == "traffic" and r["t"] > first["t"], timeout=15)
    out = subprocess.run([sys.executable, "-m", "ling_watchdog", "status", "--log-dir", str(run.log_dir)],
                         capture_output=True, text=True, check=True).stdout
    assert run.stop() == 143
    latest = run.events("traffic")[-1]
    assert any(line.startswith("traffic: ") and "prefix cache" in line for line in out.splitlines()), out
    assert len(run.events("traffic")) >= 2 and latest["t"] >= first["t"]


@pytest.mark.parametrize("memory_model, length, warned", [("unified", 1.2, True), ("unified", 1.6, False),
                                                          ("discrete", 1.2, False)])
def test_speculation_below_its_break_even_is_warned_on_a_spark_only(watchdog, memory_model, length, warned):
    """spec_break_even (the recipe sets it from ling_bench.projection): a traffic window whose drafts yielded fewer
    tokens a verify step warns, with the numbers and what to serve instead; above it nothing; on a discrete GPU
    the projection does not hold, so the setting is dropped at start with a note."""
    run = watchdog("clean", cfg={"traffic_log_s": 1.0, "spec_break_even": 1.33, "memory_model": memory_model},
                   fake=["--fake-spec-length", str(length)])
    run.wait_phase("serving")
    first = run.wait_for(lambda r: r["event"] == "traffic", timeout=15)
    assert first["spec_decode"]["num_drafts"] >= 200, first  # enough verify steps to judge
    run.wait_for(lambda r: r["event"] == "traffic" and r["t"] > first["t"], timeout=15)
    assert run.stop() == 143
    warnings = run.events("spec_break_even")
    assert bool(warnings) == warned, warnings
    if warned:
        w = warnings[0]
        assert w["level"] == "warning" and w["break_even"] == 1.33 and abs(w["mean_accepted_length"] - 1.2) < 0.01
        assert "yielded 1.20 tokens each" in w["message"] and "SPEC=mtp" in w["message"]
    assert bool(run.events("spec_break_even_off")) == (memory_model != "unified")


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
    assert not (left := run.orphans()), left


# --- a dead engine, wherever it dies, is a crash whatever the exit code (vLLM exits 0 after EngineDeadError) ---
# Bounds: the fake's engine death reaches the API server at once; the watchdog's loop ticks every 0.25 s.
DEATH_BOUND_S = 2.0


@pytest.mark.parametrize("action, said", [
    ("kill_engine", "EngineDeadError"),
    ("kill_worker", "Worker proc VllmWorker-0 died unexpectedly"),
])
def test_a_dead_engine_is_relaunched_though_the_api_server_exits_0(watchdog, action, said):
    run = watchdog("clean", fake=["--fake-dead-exit-s", "0"])  # exits before any probe sees /health 503
    run.wait_phase("serving")
    t = run.inject(action)
    crash = run.wait_for(lambda r: r["event"] == "crash")
    assert crash["rc"] == 0 and crash["phase"] == "serving"  # the fake exits 0 like vLLM does
    assert said in run.serve_log() and "a crash whatever the exit code" in crash["message"]
    assert crash["t"] - t <= DEATH_BOUND_S + SLACK_S
    relaunch = run.wait_for(lambda r: r["event"] == "relaunch")
    assert relaunch["cause"] == "exit_serving" and relaunch["left"] == FAST["max_relaunches"] - 1
    run.wait_phase("serving", after=crash["t"])
    assert run.stop() == 143
    assert not (left := run.orphans()), left


def test_health_503_is_vllms_word_that_its_engine_died_a_crash_before_the_exit(watchdog):
    """vLLM answers /health 503 on EngineDeadError for a few seconds before its API server exits 0."""
    run = watchdog("clean", fake=["--fake-dead-exit-s", "30"])
    run.wait_phase("serving")
    t = run.inject("kill_engine")
    crash = run.wait_for(lambda r: r["event"] == "crash")
    assert crash["cause"] == "engine_dead" and "/health 503: vLLM reports its engine dead" in crash["message"]
    assert crash["t"] - t <= FAST["probe_interval_s"] + FAST["health_timeout_s"] + SLACK_S
    assert not run.events("probe_fail")  # one answer decides it, not fail_threshold of them
    run.wait_phase("serving", after=crash["t"])
    assert run.stop() == 143
    assert not (left := run.orphans()), left


def test_a_sigkilled_api_server_is_a_crash_and_its_engine_is_swept(watchdog):
    run = watchdog("clean")
    run.wait_phase("serving")
    t = run.inject("kill_api")
    crash = run.wait_for(lambda r: r["event"] == "crash")
    assert crash["rc"] == -9 and "rc -9 (SIGKILL)" in crash["message"] and crash["t"] - t <= 1 + SLACK_S
    run.wait_phase("serving", after=crash["t"])
    assert run.stop() == 143
    assert not (left := run.orphans()), left


def test_a_sigstopped_engine_is_a_wedge_caught_by_liveness_while_health_says_200(watchdog):
    run = watchdog("clean", cfg=dict(kill_grace_s=1))
    run.wait_phase("serving")
    t = run.inject("stop_engine")
    wedge = run.wait_for(lambda r: r["event"] == "wedge")
    assert wedge["cause"] == "liveness"
    assert all("completion" in f["message"] for f in run.events("probe_fail"))  # /health kept answering 200
    bound = FAST["fail_threshold"] * (FAST["probe_interval_s"] + FAST["liveness_timeout_s"] + FAST["health_timeout_s"])
    assert wedge["t"] - t <= bound + SLACK_S
    run.wait_phase("serving", after=wedge["t"])  # the stopped engine was SIGKILLed with its group
    assert run.stop() == 143
    assert not (left := run.orphans()), left


def test_a_server_stopped_by_a_signal_from_outside_exits_0_on_purpose(watchdog):
    """vLLM's own signal handler logs that it was asked to stop: that rc 0 is not a crash."""
    run = watchdog("clean")
    run.wait_phase("serving")
    import os

    os.kill(launched_pid(run.events()), signal.SIGTERM)
    assert run.wait(20) == 0
    assert "stopped by a signal (not from the watchdog)" in run.events("final")[-1]["message"]
    assert not run.events("relaunch") and not run.events("crash")
    assert not (left := run.orphans()), left


# --- a server with an API key is healthy: probes present its key, and the key is written nowhere -----


@pytest.mark.parametrize("how", ["flag", "env"])
def test_an_api_key_server_is_probed_with_its_key_and_the_key_is_masked_everywhere(watchdog, how, tmp_path):
    key = "sk-wd-test-7f3a"
    flag = ["--api-key", key] if how == "flag" else []
    run = watchdog("clean", serve=["--max-model-len", "8192", "--gpu-memory-utilization", "0.05", *flag],
                   env={"VLLM_API_KEY": key} if how == "env" else None)
    run.wait_phase("serving")
    time.sleep(4 * FAST["probe_interval_s"])
    assert not run.events("probe_fail") and not run.events("wedge") and not run.events("probe_refused")
    status = subprocess.run([sys.executable, "-m", "ling_watchdog", "status", "--log-dir", str(run.log_dir)],
                            capture_output=True, text=True, check=True).stdout
    assert run.stop() == 143
    if how == "flag":  # the fake prints its non-default args with the key in plain text
        assert "'api_key': ['***']" in run.serve_log() and "--api-key ***" in run.serve_log()
    for text in (run.serve_log(), (run.log_dir / "events.jsonl").read_text(), status):
        assert key not in text
    for name in ("serve.log", "events.jsonl"):
        assert (run.log_dir / name).stat().st_mode & 0o077 in (0, 0o040)  # not world-readable
    assert not (left := run.orphans()), left


def test_a_probe_refused_for_want_of_a_key_is_reported_and_never_counted_as_a_wedge(watchdog):
    """A key the watchdog cannot see (e.g. a server's own auth middleware): the server answers, so it is up."""
    run = watchdog("clean", fake=["--fake-require-key", "only-the-server-knows"])
    refused = run.wait_for(lambda r: r["event"] == "probe_refused")
    assert "HTTP 401" in refused["message"] and "VLLM_API_KEY" in refused["message"]
    time.sleep(4 * FAST["probe_interval_s"])
    assert not run.events("wedge") and not run.events("kill") and not run.events("probe_fail")
    assert run.stop() == 143


# --- failures a relaunch cannot fix stop at once, with a code systemd does not restart ----------------


@pytest.mark.parametrize("kw, rule", [(dict(port=99999), "port"), (dict(model="/nonexistent"), "model")])
def test_a_bad_port_or_a_missing_model_is_refused_before_any_launch(watchdog, kw, rule):
    run = watchdog("clean", **kw)
    assert run.wait(60) == 2
    assert [r["rule"] for r in run.events("preflight") if r["verdict"] == "refuse"] == [rule]
    assert not run.events("launch")


@pytest.mark.parametrize("kw, said", [(dict(port=99999), "port must be 0-65535"),
                                      (dict(model="/nonexistent"), "Repo id must use alphanumeric")])
def test_forced_past_preflight_vllms_own_error_stops_after_one_launch(watchdog, kw, said):
    run = watchdog("clean", wd=["--force"], **kw)
    assert run.wait(60) == 5
    assert len(run.events("launch")) == 1 and not run.events("relaunch")
    assert said in run.events("final")[-1]["message"]
    assert not (left := run.orphans()), left


def test_after_serving_lines_keep_their_levels_and_the_check_gets_this_launch_the_pid_and_the_key(watchdog, tmp_path):
    """One failed self-check line does not turn the passing ones into errors; the check judges this launch
    (its id), reads the server's env (its pid), presents its key (VLLM_API_KEY), and never sees it in argv."""
    seen = tmp_path / "seen.json"
    script = tmp_path / "check.py"
    script.write_text(
        "import json, os, sys\n"
        f"open({str(seen)!r}, 'w').write(json.dumps({{'argv': sys.argv, 'key': os.environ.get('VLLM_API_KEY')}}))\n"
        "print(json.dumps({'message': 'good line', 'level': 'info', 'check': 'A', 'state': 'ON'}))\n"
        "print(json.dumps({'message': 'bad line', 'level': 'error', 'check': 'B', 'state': 'FAILED'}))\n"
        "print('a plain line')\n"
        "sys.exit(2)\n")
    key = "sk-check-1234"
    run = watchdog("clean", cfg=dict(after_serving=f"{sys.executable} {script} {{launch}} {{pid}} {{args}}"),
                   serve=["--max-model-len", "8192", "--gpu-memory-utilization", "0.05", "--api-key", key])
    verdict = run.wait_for(lambda e: e["event"] == "after_serving" and "code" in e)
    lines = {e["message"]: e for e in run.events("after_serving") if "code" not in e}
    assert lines["good line"]["level"] == "info" and lines["good line"]["state"] == "ON"
    assert lines["bad line"]["level"] == "error" and lines["a plain line"]["level"] == "error"
    assert verdict["code"] == 2 and verdict["level"] == "error"
    got = json.loads(seen.read_text())
    (launch,) = run.events("launch")
    assert got["argv"][1:3] == [launch["launch"], str(launch["pid"])] and got["key"] == key
    assert key not in " ".join(got["argv"]) and "--api-key" in got["argv"]
    assert run.stop() == 143
    status = subprocess.run([sys.executable, "-m", "ling_watchdog", "status", "--log-dir", str(run.log_dir), "--json"],
                            capture_output=True, text=True, check=True).stdout
    check = json.loads(status)["selfcheck"]
    assert check["code"] == 2 and check["failed"] == ["B"] and len(check["lines"]) == 3
    assert not (left := run.orphans()), left


def test_a_running_check_is_no_part_of_the_server_it_neither_delays_a_kill_nor_outlives_its_launch(watchdog):
    """The check runs beside the server: a dead engine's group is reaped at once (not after kill_grace_s of
    waiting for the check), and the check, children included, ends with its launch."""
    check = (f"{sys.executable} -c \"import subprocess, sys, time; "  # the launch id tags the check and its child
             f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', sys.argv[1]]); "
             f"time.sleep(60)\" {{launch}}")
    run = watchdog("clean", cfg=dict(after_serving=check))
    run.wait_for(lambda e: e["event"] == "phase" and e["to"] == "serving")
    time.sleep(1)  # the check and its child are up
    run.inject("kill_engine")
    crash = run.wait_for(lambda r: r["event"] == "crash")
    kill = run.wait_for(lambda r: r["event"] == "kill" and r["t"] >= crash["t"])
    assert kill["signal"] != "SIGKILL" and kill["seconds"] < FAST["kill_grace_s"], kill
    stopped = run.wait_for(lambda r: r["event"] == "after_serving" and "stopped with its launch" in r["message"])
    assert stopped["level"] == "warning"
    run.wait_phase("serving", after=crash["t"])
    assert run.stop() == 143
    launches = [e["launch"] for e in run.events("launch")]
    left = [p for launch in launches for p in tagged(launch)]
    assert left == [], left
    assert not (left := run.orphans()), left
