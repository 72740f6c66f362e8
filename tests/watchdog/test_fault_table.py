"""The fault table's rows, built from an event stream (the full table runs real scenarios:
`python -m ling_watchdog.fault_table`, ~1.5 min)."""
import signal

from ling_watchdog.fault_table import Scenario, _row, markdown


def ev(event, t, **kw):
    return {"event": event, "t": t, **kw}


def test_a_detected_and_recovered_fault_reports_time_to_detect_action_and_relaunches():
    events = [ev("launch", 0), ev("stall", 11.6, cause="shard_freeze"), ev("kill", 11.7, signal="SIGTERM", seconds=0.1),
              ev("relaunch", 11.8), ev("launch", 12), ev("phase", 14, to="serving"),
              ev("kill", 20, signal="SIGTERM", seconds=0.1), ev("final", 20.1, code=143, message="exit 143: stopped")]
    row = _row(Scenario("freeze", "stall_shard"), events, "x fake fault stall_shard at t=10.0 y", 143, 0)
    assert row["detected"] == "yes: stall (shard_freeze)" and row["ttd"] == "1.6 s" and row["relaunches"] == 1
    assert row["action"] == "SIGTERM to the group, relaunch x1, serving, exit 143 (stopped by SIGTERM)"


def test_a_fault_that_must_not_be_acted_on_reads_as_correctly_ignored():
    events = [ev("launch", 0), ev("phase", 5, to="serving"), ev("kill", 9, signal="SIGKILL", seconds=2.5)]
    row = _row(Scenario("jit", "slow_first"), events, "fake fault slow_first at t=2.0", 143, 0)
    assert row["detected"] == "no fault seen (correct: not a hang)" and row["ttd"] == "-"
    assert row["action"] == "serving, exit 143 (stopped by SIGTERM, SIGKILL after 2.5 s)"


def test_markdown_has_one_row_per_scenario_and_counts_orphans():
    rows = [_row(Scenario("w", "clean", kill=signal.SIGKILL), [ev("phase", 1, to="serving")], "", -9, 2)]
    table = markdown(rows).splitlines()
    assert table[0].startswith("| fault | detected? | time to detect | action | relaunches | orphans |")
    assert table[2].endswith("| 0 | 2 |") and len(table) == 3
