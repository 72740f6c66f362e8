"""The CPU rehearsal of the agent device step (tests/gpu/agent_run.py): the same driver, the recipe under the watchdog,
prefix caching on then off, on a tiny twin of the full-size dummy-weight folder (a config and the tiny tokenizer, no
weight files, eos/pad ids past the tokenizer as in the release's config), with a three-turn session and two at once.

What the GPU run rests on, shown here: the recipe starts on such a folder under the watchdog (its preflight counts the
weights from the config) and its self-check passes; ids past the tokenizer decode to nothing; the agent bench reports
a TTFT for every turn, prefix-cache hits with the cache on and none with it off; and each server is stopped by the
watchdog with nothing of it left running. ~2.5 minutes on 2 loaded cores (two engines).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.engine
pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
TURNS = 3
BENCH = (f"--max-tokens 8 --agent-turns {TURNS} --agent-max-history 4096 --agent-prefix-tokens 256 "
         "--agent-tool-tokens 64,128 --agent-sessions 2 --warmup 0")


def dummy_twin(out: Path) -> Path:
    """The tiny checkpoint's config and tokenizer without its weights: the shape of `ling-make-tiny DIR --full-config
    --tokenizer`, with the model's eos/pad ids past the tokenizer's 990 as the release's 156,895 / 156,892 are."""
    from ling_tools.tiny import ensure_tiny

    src = ensure_tiny()
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, out / name)
    config = json.loads((src / "config.json").read_text())
    ids = {"eos_token_id": config["vocab_size"] - 1, "pad_token_id": config["vocab_size"] - 4}
    (out / "config.json").write_text(json.dumps(config | ids, indent=2))
    (out / "generation_config.json").write_text(json.dumps(ids))
    return out


def test_agent_step_rehearsed_on_the_cpu_engine(tmp_path):
    model, out = dummy_twin(tmp_path / "model"), tmp_path / "out"
    before = {p.pid for p in psutil.process_iter()}
    proc = subprocess.run([sys.executable, "tests/gpu/agent_run.py", str(out), "--model", str(model), "--device", "cpu",
                           "--ctx", "4096", "--bench-args", BENCH, "--log-root", str(tmp_path / "logs"),
                           "--deadline-s", "900"], cwd=REPO, capture_output=True, text=True, timeout=1000)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert sorted(p.name for p in out.iterdir()) == ["agent_pc0-server.log", "agent_pc0.json", "agent_pc1-server.log",
                                                     "agent_pc1.json"]
    runs = {pc: json.loads((out / f"agent_pc{pc}.json").read_text()) for pc in (1, 0)}
    for pc, run in runs.items():
        assert run["ok"] and not run["problems"] and "--load-format" in run["serve_command"]
        assert ("--enable-prefix-caching" if pc else "--no-enable-prefix-caching") in run["serve_command"]
        assert run["selfcheck"]["code"] == 0 and run["beyond_tokenizer"]["ok"]
        assert run["stop"]["left"] == [] and run["stop"]["port_free"] and run["watchdog_final"].startswith("exit 143")
        bench = run["bench"]
        assert bench["complete"] and bench["error"] is None and [s["name"] for s in bench["scenarios"]] == [
            "sessions-1", "sessions-2"]
        turns = bench["scenarios"][0]["session_runs"][0]["turns"]
        assert len(turns) == TURNS and all(t["ttft_s"] > 0 and t["completion_tokens"] == 8 for t in turns)
    cached = runs[1]["bench"]["scenarios"][0]
    assert cached["prefix_cache"]["hit_rate"] > 0 and all(t["prefix_cache"]["hits"] > 0 for t in
                                                          cached["session_runs"][0]["turns"][1:])
    assert all(s["prefix_cache"]["hits"] == 0 for s in runs[0]["bench"]["scenarios"])
    leftovers = [p.pid for p in psutil.process_iter(["pid", "cmdline"])
                 if p.pid not in before and str(model) in " ".join(p.info["cmdline"] or [])]
    assert not leftovers, f"processes left running: {leftovers}"
