"""The real recipe under the real watchdog on the CPU engine: a SIGKILLed engine core (after which vLLM's API
server exits 0) is detected, relaunched and serves again, with no false kill and no process left behind (one case
of real_faults.py's table; the rest: `python3 tests/watchdog/real_faults.py`, ~15 min); and a prompt over the
configured context gets vLLM's own 400, never a wedge: the server answers the next request and the watchdog sees
no fault."""
from __future__ import annotations

import pytest
from fault_table import Scenario, run
from real_faults import DEATH_BOUND_S, SCENARIOS, recipe_command
from watchdog_harness import free_port

pytestmark = pytest.mark.engine


def test_a_sigkilled_engine_core_on_the_real_recipe_is_relaunched_and_serves_again(tmp_path):
    sc = next(s for s in SCENARIOS if s.inflict == "kill_engine")
    row = run(sc, tmp_path, recipe_command, timeout=900)
    assert row["detected"] in ("yes: crash (engine_dead)", "yes: crash (exit_serving)"), row  # /health 503 or rc 0
    assert float(row["ttd"].split()[0]) <= DEATH_BOUND_S, row
    assert "relaunch x1, serving" in row["action"] and row["action"].endswith("exit 143 (stopped by SIGTERM)"), row
    assert (row["relaunches"], row["false_kills"], row["orphans"]) == (1, 0, 0), row


def test_a_prompt_over_the_context_gets_vllms_400_and_the_server_serves_on(tmp_path):
    from ling_tools.demo import serve_env

    context = int(serve_env("/m", 0, tmp_path)["CTX"])  # the demo recipe's --max-model-len
    sc = Scenario("prompt over the context", end="serving", hold_s=5, harmless=True, port=free_port(),
                  over_context=context)
    row = run(sc, tmp_path, recipe_command, timeout=900)
    over, after = row["asked"]["over"], row["asked"]["after"]
    assert over["status"] == 400 and str(context) in over["body"], over  # vLLM's message names the limit
    assert after["status"] == 200, after
    assert row["detected"] == "no fault seen (correct)", row
    assert (row["relaunches"], row["false_kills"], row["orphans"]) == (0, 0, 0), row
    assert row["action"].endswith("exit 143 (stopped by SIGTERM)"), row
