"""The agent device step's driver (tests/gpu/agent_run.py) on stand-in recipes, without an engine: a recipe that
refuses its settings fails the run with the recipe's own words, and a process the server's tree leaves behind is
named, killed by its pid and fails the run. The real recipe: test_agent_run_engine.py."""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from devices import H100, H200
from ling_common import device
from ling_watchdog.config import load_config
from ling_watchdog.memory import GiB
from ling_watchdog.preflight import Host, check
from ling_watchdog.serve_args import ServeArgs

REPO = Path(__file__).resolve().parents[2]


def _folder(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text("{}")
    return model


def _run(tmp_path: Path, recipe: str, deadline_s: float, *more: str,
         name: str = "agent_pc1") -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "recipe.sh"
    script.write_text(recipe)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "tests/gpu/agent_run.py", str(out), "--model", str(_folder(tmp_path)),
                           "--device", "cpu", "--prefix-cache", "1", "--recipe", str(script), "--deadline-s",
                           str(deadline_s), "--log-root", str(tmp_path / "logs"), *more],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc, json.loads((out / f"{name}.json").read_text())


def test_a_recipe_that_refuses_fails_the_run_with_its_words(tmp_path):
    proc, run = _run(tmp_path, 'echo "serve-int4.sh: CTX=x is not a whole number" >&2; exit 2\n', 60)
    assert proc.returncode == 1 and not run["ok"] and run["bench"] is None
    assert "exited (2) before serving: serve-int4.sh: CTX=x is not a whole number" in run["problems"][0]
    assert "CTX=x" in (tmp_path / "out" / "agent_pc1-server.log").read_text()


def test_the_in_tree_model_is_asked_of_the_recipe_and_named_in_the_files(tmp_path):
    """--impl vllm: the recipe's environment carries VLLM_LING_MODEL=vllm (the plugin then leaves the model to vLLM),
    the record says so and its files do not overwrite ours."""
    proc, run = _run(tmp_path, 'echo "recipe saw VLLM_LING_MODEL=$VLLM_LING_MODEL" >&2; exit 2\n', 60,
                     "--impl", "vllm", name="agent_pc1_vllm")
    assert proc.returncode == 1 and run["impl"] == "vllm" and run["settings"]["VLLM_LING_MODEL"] == "vllm"
    assert "recipe saw VLLM_LING_MODEL=vllm" in run["problems"][0]
    assert not (tmp_path / "out" / "agent_pc1.json").exists()
    (tmp_path / "ours").mkdir()
    _, ours = _run(tmp_path / "ours", 'echo "recipe saw VLLM_LING_MODEL=$VLLM_LING_MODEL" >&2; exit 2\n', 60)
    assert ours["impl"] == "ours" and "recipe saw VLLM_LING_MODEL=vllm-ling" in ours["problems"][0]


def test_a_process_left_behind_is_named_killed_and_fails_the_run(tmp_path):
    """A stand-in that never serves and whose child outlives it (bash dies of SIGTERM, its `sleep` does not): the
    deadline passes, and the stop finds the child among the processes seen under the recipe and kills it."""
    proc, run = _run(tmp_path, "sleep 301 &\nwait\n", 50)
    assert proc.returncode == 1 and "not serving by the deadline" in run["problems"][0]
    assert run["stop"]["watchdog"] == "SIGTERM" and len(run["stop"]["left"]) == 1
    assert run["stop"]["left"][0].endswith("sleep 301") and "not stopped clean" in run["problems"][-1]
    pid = int(run["stop"]["left"][0].split()[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _agent_run():
    spec = importlib.util.spec_from_file_location("agent_run", REPO / "tests" / "gpu" / "agent_run.py")
    agent_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent_run)
    return agent_run


def test_a_card_too_small_for_the_recipe_with_mtp_is_refused_before_any_server(monkeypatch):
    """An 80 GB H100 cannot load the full-size recipe with MTP (tests/gpu/agent_run.py, card_gib): refused with the
    card's size and what to run instead, at no engine start; an H200 passes, and so does the recipe without MTP."""
    agent_run = _agent_run()
    monkeypatch.setattr(device, "detect", lambda: H100)
    with pytest.raises(SystemExit, match=r"79\.2 GiB.*with MTP.*>= 100 GiB.*H200.*AGENT_RECIPE=serve/serve-int4\.sh"):
        agent_run.card_gib("cuda", "serve/serve-int4-mtp.sh")
    assert 79 < agent_run.card_gib("cuda", "serve/serve-int4.sh") < 80
    monkeypatch.setattr(device, "detect", lambda: H200)
    assert agent_run.card_gib("cuda", "serve/serve-int4-mtp.sh") > 100
    assert agent_run.card_gib("cpu", "serve/serve-int4.sh") is None


def _dry_run_fit(recipe: str, env: dict[str, str], dev) -> tuple[ServeArgs, object]:
    """The recipe's dry-run command under `env`, parsed, and the watchdog's memory_fit verdict on it for `dev`."""
    out = subprocess.run(["bash", str(REPO / recipe)], env={**env, "DRY_RUN": "1"}, capture_output=True, text=True,
                         cwd=REPO)
    assert out.returncode == 0, out.stderr
    args = ServeArgs.parse(shlex.split(out.stdout.strip().splitlines()[-1].split(" -- ", 1)[1]))
    host = Host(available=120 * GiB, total=128 * GiB)
    return args, next(v for v in check(args, load_config(), dev, host, {}, bind=lambda h, p: None)
                      if v.rule == "memory_fit")


def test_the_kv_cache_follows_the_card_and_passes_the_preflight_on_an_h100(monkeypatch, tmp_path):
    """10 GiB on a card of >= 100 GiB, 3 on an 80 GB one; the 3 GiB pool is one the watchdog's preflight accepts for
    the plain recipe's full-size command on an H100, and 4 is not (the pool is the most the card allows)."""
    agent_run = _agent_run()
    assert agent_run.kv_gib("cuda", 140.4) == 10 and agent_run.kv_gib("cpu", None) == 1
    assert agent_run.kv_gib("cuda", 79.2) == agent_run.SMALL_CARD_KV_GIB == 3
    model = tmp_path / "flash"
    subprocess.run([sys.executable, "-m", "ling_tools.tiny", str(model), "--full-config", "--tokenizer"], check=True,
                   capture_output=True)

    def memory_fit(kv: float):
        env = {"PATH": os.environ["PATH"], "DEVICE": "cuda", "MODEL": str(model), "PREFIX_CACHE": "1",
               "KV_CACHE_GIB": f"{kv:g}", "CTX": str(agent_run.GPU_CTX), "EXTRA_ARGS": "--load-format dummy",
               "PYTHON": sys.executable, "TUNED_DIR": str(tmp_path / "none")}
        return _dry_run_fit(agent_run.PLAIN_RECIPE, env, H100)[1]

    fits, too_big = memory_fit(agent_run.SMALL_CARD_KV_GIB), memory_fit(agent_run.SMALL_CARD_KV_GIB + 1)
    assert fits.verdict == "ok", fits.message
    assert too_big.verdict == "refuse" and "more than this GPU's" in too_big.message


def test_the_record_keeps_the_runs_memory_edges_to_read_slow_turns_against(tmp_path):
    """The watchdog's allocator-at-the-limit warnings of this server's run (not an earlier run's in the same log
    folder) go into the record with when and how much, as events.jsonl holds them."""
    from ling_watchdog.events import EventLog

    agent_run, log = _agent_run(), EventLog(tmp_path, max_bytes=1 << 20, backups=1, echo=False)
    for pid, phases in ((111, ["loading"]), (222, ["loading", "serving"])):
        log.emit("start", "watchdog starting", pid=pid)
        for phase in phases:
            log.emit("memory_edge", "out of memory", level="warning", asked=786_432_000, free=381_878_272,
                     total=85_017_493_504, phase=phase)
    log.close()
    edges = agent_run.memory_edges(tmp_path, 222)
    assert [e["phase"] for e in edges] == ["loading", "serving"] and edges[1]["asked"] == 786_432_000
    assert all(e["ts"] for e in edges) and agent_run.memory_edges(tmp_path, 333) == []


def test_dspark_is_refused_on_the_cpu_engine_and_beside_the_mtp_recipe(tmp_path):
    """vLLM's DSpark runtime is GPU-only, and the MTP recipe drafts with MTP: both refused with the rule and the safe
    alternative before anything starts; --dspark-k without --spec dspark too."""
    model = _folder(tmp_path)

    def run(*more: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "tests/gpu/agent_run.py", str(tmp_path / "out"), "--model", str(model),
                               "--log-root", str(tmp_path / "logs"), *more],
                              cwd=REPO, capture_output=True, text=True, timeout=120)

    cpu = run("--device", "cpu", "--spec", "dspark")
    assert cpu.returncode == 2 and "DSpark runtime is GPU-only" in cpu.stderr
    mtp = run("--spec", "dspark", "--recipe", "serve/serve-int4-mtp.sh")
    assert mtp.returncode == 2 and "Safe: --recipe serve/serve-int4.sh" in mtp.stderr
    k = run("--device", "cpu", "--dspark-k", "4")
    assert k.returncode == 2 and "needs --spec dspark" in k.stderr
    assert not (tmp_path / "logs").exists()


def test_dspark_needs_a_roomy_card_for_its_drafters_kv(monkeypatch, tmp_path):
    """The drafter's KV for two sequences of the workload's context: 80 KiB a token for the released shape, 10.2 GiB
    for two of 66,560 tokens: refused on an 80 GB H100 with the reason, served on an H200."""
    agent_run = _agent_run()
    monkeypatch.setattr(device, "detect", lambda: H100)
    with pytest.raises(SystemExit, match=r"79\.2 GiB.*with DSpark needs a card of >= 100 GiB.*drafter's KV"):
        agent_run.card_gib("cuda", agent_run.PLAIN_RECIPE, "dspark")
    monkeypatch.setattr(device, "detect", lambda: H200)
    assert agent_run.card_gib("cuda", agent_run.PLAIN_RECIPE, "dspark") > 100
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps(
        {"num_hidden_layers": 5, "num_key_value_heads": 32, "head_dim": 128}))
    assert agent_run.dspark_kv_gib(tmp_path / "d", 66_560) == pytest.approx(2 * 66_560 * 81_920 / GiB)


def test_dspark_settings_are_ones_the_real_recipe_serves_and_its_preflight_fits_on_an_h200(monkeypatch, tmp_path):
    """--spec dspark hands the recipe SPEC=dspark, the dummy drafter's folder and, when given, DSPARK_K, drops the
    caller's DSPARK_* and SPEC; the real recipe's dry run then asks vLLM for DSpark with that drafter and the prefix
    cache, and the watchdog's preflight fits the KV pool agent_run sizes (the roomy card's 10 GiB plus the drafter's
    KV) on an H200 (it reads the drafter's config from the folder)."""
    import argparse

    agent_run = _agent_run()
    model = tmp_path / "flash"
    subprocess.run([sys.executable, "-m", "ling_tools.tiny", str(model), "--full-config", "--tokenizer"], check=True,
                   capture_output=True)
    drafter = Path(agent_run.write_dummy_drafter(str(model)))
    try:
        kv = agent_run.kv_gib("cuda", 140.4) + agent_run.dspark_kv_gib(drafter, agent_run.GPU_CTX)
        a = argparse.Namespace(model=model, ctx=agent_run.GPU_CTX, kv_gib=kv, device="cuda", impl="ours",
                               spec="dspark", drafter=drafter, dspark_k=None)
        monkeypatch.setenv("DSPARK_FP8", "1")  # the caller's: not the run's
        env = agent_run.serve_env(a, 1, 8123, tmp_path / "logs")
        assert env["SPEC"] == "dspark" and env["DSPARK_MODEL"] == str(drafter) and "DSPARK_FP8" not in env
        assert "DSPARK_K" not in env and agent_run.run_tag(a, 1) == "agent_pc1_dspark"
        assert agent_run.serve_env(argparse.Namespace(**{**vars(a), "dspark_k": 4}), 1, 8123, tmp_path)["DSPARK_K"] \
            == "4"
        args, fit = _dry_run_fit(agent_run.PLAIN_RECIPE, env | {"TUNED_DIR": str(tmp_path / "none"),
                                                                 "VLLM_CMD": "vllm serve"}, H200)
        assert args.speculative == {"method": "dspark", "model": str(drafter)}
        assert args.values["enable_prefix_caching"] is True
        assert fit.verdict == "ok", fit.message
    finally:
        shutil.rmtree(drafter, ignore_errors=True)
