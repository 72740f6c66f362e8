"""The fault table's rows, built from an event stream (the full table runs real scenarios:
`python3 tests/watchdog/fault_table.py`, ~3 min; on the real recipe: real_faults.py)."""
import signal

from fault_table import Scenario, _row, markdown


def ev(event, t, **kw):
    return {"event": event, "t": t, **kw}


def test_a_detected_and_recovered_fault_reports_time_to_detect_action_and_relaunches():
    events = [ev("launch", 0), ev("stall", 11.6, cause="shard_freeze"), ev("kill", 11.7, signal="SIGTERM", seconds=0.1),
              ev("relaunch", 11.8), ev("launch", 12), ev("phase", 14, to="serving"),
              ev("kill", 20, signal="SIGTERM", seconds=0.1), ev("final", 20.1, code=143, message="exit 143: stopped")]
    row = _row(Scenario("freeze", "stall_shard"), events, "x fake fault stall_shard at t=10.0 y", 143, 0)
    assert row["detected"] == "yes: stall (shard_freeze)" and row["ttd"] == "1.6 s" and row["relaunches"] == 1
    assert row["action"] == "SIGTERM to the group, relaunch x1, serving, exit 143 (stopped by SIGTERM)"
    assert row["false_kills"] == 0


def test_an_inflicted_fault_is_timed_from_its_signal():
    events = [ev("phase", 5, to="serving"), ev("crash", 12.5, cause="exit_serving"),
              ev("kill", 12.5, signal="none", seconds=0.0), ev("relaunch", 12.6)]
    row = _row(Scenario("engine", inflict="kill_engine"), events, "", 143, 0, inflicted=10.0)
    assert row["detected"] == "yes: crash (exit_serving)" and row["ttd"] == "2.5 s"
    assert row["action"].startswith("reap the group, relaunch x1")


def test_a_fault_that_must_not_be_acted_on_reads_as_correctly_ignored_and_any_kill_is_false():
    events = [ev("launch", 0), ev("phase", 5, to="serving"), ev("kill", 9, signal="SIGKILL", seconds=2.5)]
    row = _row(Scenario("jit", "slow_first", harmless=True), events, "fake fault slow_first at t=2.0", 143, 0)
    assert row["detected"] == "no fault seen (correct: not a hang)" and row["ttd"] == "-"
    assert row["action"] == "serving, exit 143 (stopped by SIGTERM, SIGKILL after 2.5 s)"
    wedged = _row(Scenario("key", harmless=True), events + [ev("wedge", 6, cause="liveness")], "", 3, 0)
    assert wedged["false_kills"] == 1


def test_a_preflight_refusal_is_a_detection_without_a_launch():
    events = [ev("preflight", 0, rule="port", verdict="refuse"), ev("final", 0.1, code=2)]
    row = _row(Scenario("port", port=99999), events, "", 2, 0)
    assert row["detected"] == "yes: refused by preflight (port)" and row["action"] == "exit 2 (refused by preflight)"


def test_markdown_has_one_row_per_scenario_and_counts_orphans():
    rows = [_row(Scenario("w", "clean", kill=signal.SIGKILL), [ev("phase", 1, to="serving")], "", -9, 2)]
    table = markdown(rows).splitlines()
    assert table[0].startswith("| fault | detected? | time to detect | action | relaunches | false kills | orphans |")
    assert table[2].endswith("| 0 | 0 | 2 |") and len(table) == 3
