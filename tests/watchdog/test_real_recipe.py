"""The real recipe under the real watchdog on the CPU engine, one server for two checks (a recipe start is most of
the cost). Once serving, a prompt over the configured context gets vLLM's own 400, never a wedge: the next request is
served and the watchdog sees no fault. Then its engine core is SIGKILLed (after which vLLM's API server exits 0): that
is detected, relaunched and serves again, with no false kill and no process left behind (one case of
real_faults.py's table; the rest: `python3 tests/watchdog/real_faults.py`, ~15 min)."""
from __future__ import annotations

import dataclasses

import pytest
from fault_table import run
from real_faults import DEATH_BOUND_S, SCENARIOS, recipe_command
from watchdog_harness import free_port

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def row(tmp_path_factory) -> dict:
    from ling_tools.demo import serve_env

    context = int(serve_env("/m", 0, tmp_path_factory.getbasetemp())["CTX"])  # the demo recipe's --max-model-len
    kill = next(s for s in SCENARIOS if s.inflict == "kill_engine")
    sc = dataclasses.replace(kill, port=free_port(), over_context=context, wait_check=True)
    return {"context": context, **run(sc, tmp_path_factory.mktemp("real-recipe"), recipe_command, timeout=900)}


def test_a_prompt_over_the_context_gets_vllms_400_and_the_server_serves_on(row):
    over, after = row["asked"]["over"], row["asked"]["after"]
    assert over["status"] == 400 and str(row["context"]) in over["body"], over  # vLLM's message names the limit
    assert after["status"] == 200, after
    assert row["false_kills"] == 0, row  # no verdict before the engine core was killed


def test_a_sigkilled_engine_core_on_the_real_recipe_is_relaunched_and_serves_again(row):
    assert row["detected"] in ("yes: crash (engine_dead)", "yes: crash (exit_serving)"), row  # /health 503 or rc 0
    assert float(row["ttd"].split()[0]) <= DEATH_BOUND_S, row
    assert "relaunch x1, serving" in row["action"] and row["action"].endswith("exit 143 (stopped by SIGTERM)"), row
    assert (row["relaunches"], row["false_kills"], row["orphans"]) == (1, 0, 0), row
    checks = row["action"].split("self-check exit ")[1].split(",")[0].split("/")  # each launch's, in order
    assert checks[-1] == "0", row  # the relaunched server's self-check passed, and before the stop
