"""The served plugin stands on its own: what vLLM imports to serve Ling V3 (the entry point's `register()`, the
model and draft classes it registers, the FP8 method and the parsers) reaches vLLM, torch and `vllm_ling` only,
never our tools (`ling_watchdog`, `ling_tuning`, `ling_bench`) nor the tools that stand inside the package
(self-check CLI, demo, tiny-checkpoint writer)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SERVED = ["vllm_ling.plugin", "vllm_ling.model", "vllm_ling.mtp", "vllm_ling.fp8", "vllm_ling.kda",
          "vllm_ling.kda_core", "vllm_ling.mla", "vllm_ling.moe", "vllm_ling.draft_check", "vllm_ling.smem_guard",
          "vllm_ling.parsers"]
TOOLS = ("ling_watchdog", "ling_tuning", "ling_bench", "tests", "vllm_ling.selfcheck", "vllm_ling.demo",
         "vllm_ling.tiny")

CHILD = """
import importlib, json, sys
import vllm_ling.plugin
vllm_ling.plugin.register()
for name in sys.argv[1:]:
    importlib.import_module(name)
print(json.dumps(sorted(sys.modules)))
"""


def _imported(names: list[str]) -> list[str]:
    run = subprocess.run([sys.executable, "-c", CHILD, *names], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _tools_among(modules: list[str]) -> list[str]:
    return [m for m in modules if any(m == t or m.startswith(t + ".") for t in TOOLS)]


def test_the_served_plugin_imports_none_of_our_tools():
    pytest.importorskip("vllm")
    modules = _imported(SERVED)
    assert set(SERVED) <= set(modules)  # the check saw the modules it is about
    assert _tools_among(modules) == [], "the served plugin imports a tool"


def test_the_check_sees_a_tool_when_one_is_imported():
    """Negative control: the same child, asked to import the self-check CLI too, reports it and what it pulls in."""
    pytest.importorskip("vllm")
    found = _tools_among(_imported([*SERVED, "vllm_ling.selfcheck"]))
    assert "vllm_ling.selfcheck" in found
