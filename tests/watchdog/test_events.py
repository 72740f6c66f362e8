"""The two logs: human lines + JSON lines, rotation that loses nothing, and the status summary."""
import json

from ling_watchdog.events import (EventLog, format_summary, launch_log, launch_mark, read_events, run_records,
                                  summarise, summary_json)


def test_each_event_is_one_json_line_and_one_human_line(tmp_path):
    log = EventLog(tmp_path, 1 << 20, 3, echo=False, clock=lambda: 1_800_000_000.0)
    log.output("(EngineCore pid=7) Loading safetensors checkpoint shards:  29% Completed | 7/24")
    log.emit("stall", "no shard progress for 180s at shard 7/24", level="error", cause="shard_freeze")
    log.close()
    (record,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert (record["event"], record["cause"], record["t"]) == ("stall", "shard_freeze", 1_800_000_000.0)
    lines = (tmp_path / "serve.log").read_text().splitlines()
    assert lines[0].startswith("(EngineCore pid=7)")
    assert lines[1].endswith("[watchdog] ERROR: no shard progress for 180s at shard 7/24")


def test_quiet_events_go_to_the_event_file_only(tmp_path):
    log = EventLog(tmp_path, 1 << 20, 3, echo=False)
    log.emit("progress", "shard 1/24", quiet=True, shard=1)
    log.close()
    assert read_events(tmp_path)[0]["shard"] == 1 and (tmp_path / "serve.log").read_text() == ""


def test_rotation_and_reopening_lose_no_event(tmp_path):
    for launch in range(3):  # a relaunch reopens the logs in append mode
        log = EventLog(tmp_path, 2000, 50, echo=False)
        for i in range(40):
            log.emit("progress", f"launch {launch} shard {i}", n=launch * 40 + i)
        log.close()
    assert len(list(tmp_path.glob("events.jsonl.*"))) > 1
    assert [r["n"] for r in read_events(tmp_path)] == list(range(120))


def test_a_line_cut_short_by_a_crash_is_skipped(tmp_path):
    whole = '{"event": "start", "t": 1, "ts": "x", "message": "m", "pid": 1}'
    (tmp_path / "events.jsonl").write_text(whole + '\n{"event": "la')
    assert [r["event"] for r in read_events(tmp_path)] == ["start"]


def test_the_tests_poll_reads_a_line_being_written_as_status_does(tmp_path):
    """The supervisor tests poll events.jsonl while the watchdog appends to it: a poll that lands mid-line must
    wait for the line, not fail the test on a JSON error."""
    from watchdog_harness import Run

    whole = '{"event": "phase", "t": 1, "ts": "x", "message": "m", "to": "warmup"}'
    (tmp_path / "events.jsonl").write_text(whole + '\n{"event": "phase", "t": 2, "to": "serv')
    run = Run(proc=None, log_dir=tmp_path, tag="t", port=0)
    assert [r["to"] for r in run.events("phase")] == ["warmup"]


def rec(event, t, **kw):
    return {"event": event, "t": t, "ts": f"T{t}", "message": kw.pop("message", event), **kw}


def test_summary_folds_the_latest_run_into_phase_relaunches_and_last_fault():
    records = [
        rec("start", 0, pid=1), rec("launch", 1), rec("stall", 5, cause="old_run"), rec("final", 6, code=3),
        rec("start", 10, pid=999_999_999), rec("launch", 11), rec("stall", 20, cause="shard_freeze",
        message="no shard progress for 180s"), rec("relaunch", 21), rec("launch", 22),
        rec("phase", 40, to="warmup"), rec("phase", 70, to="serving"), rec("memory", 80, message="MemAvailable 30 GiB"),
    ]
    s = summarise(records)
    assert (s.phase, s.launches, s.relaunches, s.faults) == ("serving", 2, 1, 1)
    assert s.last_stall["cause"] == "shard_freeze"
    text = format_summary(s)
    assert "phase: serving" in text and "last fault: shard_freeze at T20: no shard progress" in text
    assert "not running (no final event: killed?)" in text  # pid 999999999 does not exist


def test_summary_of_a_finished_run_shows_the_final_verdict():
    s = summarise([rec("start", 0, pid=1), rec("launch", 1), rec("final", 9, code=5, message="exit 5: fatal")])
    assert s.phase == "stopped" and "final: exit 5: fatal" in format_summary(s)


def test_status_shows_the_latest_traffic_line_of_the_latest_launch_only():
    first = "traffic: 9,000 tokens in 10.0 min; prefix cache 75.0% of 8,000 prompt tokens hit"
    records = [rec("start", 0, pid=1), rec("launch", 1), rec("traffic", 601, message="traffic: 10 tokens in 10.0 min"),
               rec("traffic", 1201, message=first)]
    assert f"{first} (to T1201)" in format_summary(summarise(records))
    assert f"last event: T1201 {first}" in format_summary(summarise(records))  # its event named once
    relaunched = summarise(records + [rec("launch", 1300)])
    assert relaunched.traffic is None and "traffic" not in format_summary(relaunched)  # the old server's counters


def test_status_shows_the_latest_launchs_memory_edge_warning():
    """The allocator's retry at the device's limit (phases.Monitor, reported once a phase): status shows the latest
    such warning of the latest launch, so a Spark owner sees one that came while serving without reading the log."""
    loading = "the device ran out of memory during loading: ..."
    serving = "the device ran out of memory during serving: ..."
    records = [rec("start", 0, pid=1), rec("launch", 1), rec("memory_edge", 5, message=loading),
               rec("phase", 40, to="serving"), rec("memory_edge", 90, message=serving)]
    assert f"memory edge: {serving} (T90)" in format_summary(summarise(records))
    assert loading not in format_summary(summarise(records))
    relaunched = summarise(records + [rec("launch", 100)])
    assert relaunched.memory_edge is None and "memory edge" not in format_summary(relaunched)


def test_secrets_are_masked_in_both_logs_and_the_files_are_not_world_readable(tmp_path):
    old = tmp_path / "serve.log"
    old.write_text("an older run\n")
    old.chmod(0o644)  # a log from before: tightened when reopened
    log = EventLog(tmp_path, 1 << 20, 3, echo=False)
    log.secrets.add(["sk-secret-1", "tok"])
    log.output("(APIServer pid=1) INFO non-default args: {'api_key': ['sk-secret-1']}")
    log.emit("start", "ling-watchdog: vllm serve m --api-key sk-secret-1", cmd=["--api-key", "sk-secret-1"],
             nested={"hf": ["tok"]})
    log.close()
    text = (tmp_path / "serve.log").read_text() + (tmp_path / "events.jsonl").read_text()
    assert "sk-secret-1" not in text and "tok" not in text and text.count("***") == 5
    assert read_events(tmp_path)[0]["cmd"] == ["--api-key", "***"]
    for name in ("serve.log", "events.jsonl"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640


def test_an_older_runs_rotated_copies_are_tightened_too(tmp_path):
    """serve.log.N from a watchdog before the 0640 rule (or another umask) kept its old mode when only the live
    files were tightened on open."""
    for name in ("serve.log.1", "serve.log.2", "events.jsonl.1"):
        (tmp_path / name).write_text("an older run's line\n")
        (tmp_path / name).chmod(0o644)
    (tmp_path / "serve.log.bak").write_text("not ours\n")
    (tmp_path / "serve.log.bak").chmod(0o644)
    EventLog(tmp_path, 1 << 20, 3, echo=False).close()
    for name in ("serve.log.1", "serve.log.2", "events.jsonl.1"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o640, name
    assert (tmp_path / "serve.log.bak").stat().st_mode & 0o777 == 0o644  # not a rotated copy: left alone


def test_a_launchs_log_starts_at_its_launch_line_even_across_rotation(tmp_path):
    log = EventLog(tmp_path, 400, 10, echo=False)
    log.emit("launch", "launch aaaa-1: pid 1 (own process group): vllm serve m")
    log.output("speculative_config=SpeculativeConfig(method='mtp')  <- the earlier MTP run")
    log.emit("launch", "launch bbbb-1: pid 2 (own process group): vllm serve m")
    for i in range(30):  # rotates serve.log several times after bbbb-1's line
        log.output(f"line {i} of the plain run")
    log.close()
    assert len(list(tmp_path.glob("serve.log.*"))) > 1
    mine = launch_log(tmp_path / "serve.log", "bbbb-1")
    assert mine.splitlines()[0].endswith(launch_mark("bbbb-1") + " pid 2 (own process group): vllm serve m")
    assert "the earlier MTP run" not in mine and mine.rstrip().endswith("line 29 of the plain run")
    assert launch_log(tmp_path, None) == mine  # no id: the latest launch
    assert "the earlier MTP run" in launch_log(tmp_path, "aaaa-1")
    assert launch_log(tmp_path, "cccc-9") == ""  # unknown launch: nothing of it to judge


def test_a_log_no_watchdog_wrote_is_one_run(tmp_path):
    (tmp_path / "serve.log").write_text("INFO vLLM output only\n")
    assert launch_log(tmp_path / "serve.log") == "INFO vLLM output only\n"


def test_run_records_are_one_watchdog_run_by_default_the_latest():
    records = [rec("start", 0, pid=10), rec("launch", 1), rec("final", 2, code=0),
               rec("start", 3, pid=11), rec("launch", 4), rec("start", 5, pid=12), rec("launch", 6)]
    assert [r["t"] for r in run_records(records)] == [5, 6]
    assert [r["t"] for r in run_records(records, pid=11)] == [3, 4]
    assert run_records(records, pid=99) == []


def test_status_shows_the_self_check_verdict_the_relaunch_budget_and_the_last_fault():
    records = [
        rec("start", 0, pid=999_999_999, config={"max_relaunches": 3}), rec("launch", 1),
        rec("crash", 5, cause="exit_serving", message="crash during serving: EngineDeadError"),
        rec("relaunch", 6, in_a_row=1), rec("launch", 7), rec("phase", 9, to="serving"),
        rec("after_serving", 10, level="info", check="MTP", state="ON", message="vllm-ling self-check: MTP ON x"),
        rec("after_serving", 11, level="error", check="MTP acceptance", state="FAILED",
            message="vllm-ling self-check: MTP acceptance FAILED no draft tokens"),
        rec("after_serving", 12, level="error", code=2, message="after-serving check exit 2"),
        rec("final", 20, code=143, message="exit 143: stopped by signal; server stopped"),
    ]
    s = summarise(records)
    assert s.selfcheck["code"] == 2 and s.selfcheck["failed"] == ["MTP acceptance"] and s.relaunches_left == 2
    text = format_summary(s)
    assert "self-check: exit 2: FAILED MTP acceptance at T12" in text
    assert "  vllm-ling self-check: MTP ON x" in text and "2 of 3 left before it gives up" in text
    assert "last fault: exit_serving at T5" in text and "final: exit 143" in text
    js = summary_json(s)
    assert js["selfcheck"]["lines"][1]["level"] == "error" and js["relaunches_left"] == 2
    assert summarise(records[:9] + [rec("launch", 30)]).selfcheck is None  # a new launch: no verdict yet


def test_status_says_a_check_was_stopped_with_its_launch_not_that_it_failed():
    records = [rec("start", 0, pid=1), rec("launch", 1), rec("after_serving", 2, message="a line"),
               rec("after_serving", 3, code=-15, verdict="stopped with its launch", message="stopped")]
    assert "self-check: stopped with its launch (exit -15) at T3" in format_summary(summarise(records))
