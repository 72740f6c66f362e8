"""The two logs: human lines + JSON lines, rotation that loses nothing, and the status summary."""
import json

from ling_watchdog.events import EventLog, format_summary, read_events, summarise


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
