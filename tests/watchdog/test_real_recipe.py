"""The real recipe under the real watchdog on the CPU engine: a SIGKILLed engine core (after which vLLM's API
server exits 0) is detected, relaunched and serves again, with no false kill and no process left behind.
One case of real_faults.py's table (the rest: `python3 tests/watchdog/real_faults.py`, ~15 min)."""
from __future__ import annotations

import pytest
from fault_table import run
from real_faults import DEATH_BOUND_S, SCENARIOS, recipe_command

pytestmark = pytest.mark.engine


def test_a_sigkilled_engine_core_on_the_real_recipe_is_relaunched_and_serves_again(tmp_path):
    sc = next(s for s in SCENARIOS if s.inflict == "kill_engine")
    row = run(sc, tmp_path, recipe_command, timeout=900)
    assert row["detected"] in ("yes: crash (engine_dead)", "yes: crash (exit_serving)"), row  # /health 503 or rc 0
    assert float(row["ttd"].split()[0]) <= DEATH_BOUND_S, row
    assert "relaunch x1, serving" in row["action"] and row["action"].endswith("exit 143 (stopped by SIGTERM)"), row
    assert (row["relaunches"], row["false_kills"], row["orphans"]) == (1, 0, 0), row
