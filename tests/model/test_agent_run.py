"""The agent device step's driver (tests/gpu/agent_run.py) on stand-in recipes, without an engine: a recipe that
refuses its settings fails the run with the recipe's own words, and a process the server's tree leaves behind is
named, killed by its pid and fails the run. The real recipe: test_agent_run_engine.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from ling_common import device
from ling_common.device import Device

REPO = Path(__file__).resolve().parents[2]


def _folder(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text("{}")
    return model


def _run(tmp_path: Path, recipe: str, deadline_s: float) -> tuple[subprocess.CompletedProcess, dict]:
    script = tmp_path / "recipe.sh"
    script.write_text(recipe)
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "tests/gpu/agent_run.py", str(out), "--model", str(_folder(tmp_path)),
                           "--device", "cpu", "--prefix-cache", "1", "--recipe", str(script), "--deadline-s",
                           str(deadline_s), "--log-root", str(tmp_path / "logs")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc, json.loads((out / "agent_pc1.json").read_text())


def test_a_recipe_that_refuses_fails_the_run_with_its_words(tmp_path):
    proc, run = _run(tmp_path, 'echo "serve-int4.sh: CTX=x is not a whole number" >&2; exit 2\n', 60)
    assert proc.returncode == 1 and not run["ok"] and run["bench"] is None
    assert "exited (2) before serving: serve-int4.sh: CTX=x is not a whole number" in run["problems"][0]
    assert "CTX=x" in (tmp_path / "out" / "agent_pc1-server.log").read_text()


def test_a_process_left_behind_is_named_killed_and_fails_the_run(tmp_path):
    """A stand-in that never serves and whose child outlives it (bash dies of SIGTERM, its `sleep` does not): the
    deadline passes, and the stop finds the child among the processes seen under the recipe and kills it."""
    proc, run = _run(tmp_path, "sleep 301 &\nwait\n", 50)
    assert proc.returncode == 1 and "not serving by the deadline" in run["problems"][0]
    assert run["stop"]["watchdog"] == "SIGTERM" and len(run["stop"]["left"]) == 1
    assert run["stop"]["left"][0].endswith("sleep 301") and "not stopped clean" in run["problems"][-1]
    pid = int(run["stop"]["left"][0].split()[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_card_too_small_for_the_recipe_is_refused_before_any_server(monkeypatch):
    """An 80 GB H100 cannot load the full-size recipe with MTP (tests/gpu/agent_run.py, card_gib): refused with the
    card's size and what to run on, at no engine start; an H200 passes."""
    spec = importlib.util.spec_from_file_location("agent_run", REPO / "tests" / "gpu" / "agent_run.py")
    agent_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(agent_run)
    monkeypatch.setattr(device, "detect", lambda: Device("discrete", "NVIDIA H100 80GB HBM3", 85_017_493_504, 232_448))
    with pytest.raises(SystemExit, match=r"79\.2 GiB.*>= 100 GiB.*H200"):
        agent_run.card_gib("cuda")
    monkeypatch.setattr(device, "detect", lambda: Device("discrete", "NVIDIA H200", 150_754_820_096, 232_448))
    assert agent_run.card_gib("cuda") > 100 and agent_run.card_gib("cpu") is None
