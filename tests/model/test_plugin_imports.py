"""The served plugin stands on its own: what vLLM imports to serve Ling V3 (the entry point's `register()`, the
model and draft classes it registers, the FP8 method and the parsers) reaches vLLM, torch and `vllm_ling` only
(and what vLLM itself depends on), never our other packages (`ling_common`, `ling_tools`, `ling_watchdog`,
`ling_tuning`, `ling_bench`). tests/test_import_graph.py checks the tools' graphs.

Two checks: a static one over the source (every import statement, inside functions too, and the lazy
"vllm_ling.x:Class" targets), which needs no vLLM and sees code that never runs; and a dynamic one, what a real
process has in `sys.modules` after `register()` and the imports, which sees what the source cannot show."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from import_scan import imported_names

SERVED = ["vllm_ling.plugin", "vllm_ling.model", "vllm_ling.draft.mtp", "vllm_ling.fp8", "vllm_ling.kda",
          "vllm_ling.kda_core", "vllm_ling.mla", "vllm_ling.moe", "vllm_ling.draft.check", "vllm_ling.smem_guard",
          "vllm_ling.parsers"]
TOOLS = ("ling_common", "ling_tools", "ling_watchdog", "ling_tuning", "ling_bench", "tests")  # ours, not the plugin
# What else the plugin may reach besides the standard library: vLLM, torch, and packages vLLM itself requires.
THIRD_PARTY = {"vllm", "torch", "triton", "transformers", "packaging", "jsonschema"}


def _is_tool(module: str) -> bool:
    return any(module == t or module.startswith(t + ".") for t in TOOLS)


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
    return [m for m in modules if _is_tool(m)]


ROOT = Path(__file__).resolve().parents[2]  # the folder holding the vllm_ling package
# What vLLM loads to serve: the entry point, what `register()` registers (model, draft, FP8 method) and the parser
# module it registers lazily as ("vllm_ling.parsers.ling3", Class), a name the source builds with an f-string.
STATIC_STARTS = ("vllm_ling", "vllm_ling.plugin", "vllm_ling.model", "vllm_ling.draft.mtp", "vllm_ling.fp8",
                 "vllm_ling.parsers.ling3")
# "vllm_ling.model:BailingMoeV3ForCausalLM"; another package of ours only as "module:name" (the registry of settings
# names its readers, "ling_bench.fullsize", as text)
LAZY_TARGET = re.compile(r"vllm_ling(?:\.\w+)+(?::\w+)?|ling_\w+(?:\.\w+)*:\w+")

Edge = tuple[str, int]  # (importing module, line)


def _module_file(root: Path, name: str) -> Path | None:
    """The source of module `name` under `root`, if it is one of ours."""
    base = root.joinpath(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _parents(name: str) -> list[str]:
    """Importing a.b.c runs a/__init__ and a/b/__init__ first."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def static_import_graph(root: Path, starts: tuple[str, ...]) -> dict[str, Edge | None]:
    """Every module name reachable from `starts` through our own sources under `root`, each with the first edge
    that reached it (None for a start). Names outside our package, and our tools, are recorded but not followed."""
    reached: dict[str, Edge | None] = dict.fromkeys(starts)
    todo = list(starts)
    while todo:
        name = todo.pop()
        path = _module_file(root, name)
        if path is None:
            continue
        found = imported_names(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", LAZY_TARGET)
        for target, line in found:
            for module in [*_parents(target), target]:
                ours = _module_file(root, module) is not None
                if module not in reached and (ours or module.split(".")[0] != "vllm_ling"):
                    reached[module] = (name, line)
                    todo += [module] if ours and not _is_tool(module) else []
    return reached


def _chain(graph: dict[str, Edge | None], module: str) -> str:
    """"tool <- importer:line <- ... <- start": how the walk reached `module`."""
    steps, edge = [module], graph[module]
    while edge is not None:
        steps.append(f"{edge[0]}:{edge[1]}")
        edge = graph[edge[0]]
    return " <- ".join(steps)


def tools_reached(root: Path, starts: tuple[str, ...] = STATIC_STARTS) -> list[str]:
    """The tools the served modules under `root` can import, each with its import chain."""
    graph = static_import_graph(root, starts)
    return [_chain(graph, m) for m in sorted(graph) if _is_tool(m)]


def test_no_served_module_imports_a_tool_anywhere_in_its_source():
    assert tools_reached(ROOT) == [], "the served plugin can import a tool"


def test_the_served_plugin_reaches_only_vllm_torch_and_itself():
    graph = static_import_graph(ROOT, STATIC_STARTS)
    outside = {m.split(".")[0] for m in graph} - set(sys.stdlib_module_names) - THIRD_PARTY - {"vllm_ling"}
    assert outside == set(), [_chain(graph, m) for m in sorted(graph) if m.split(".")[0] in outside]


def test_the_static_walk_follows_imports_in_functions_and_lazy_targets():
    """From the entry point alone: plugin is imported inside `register()`, fp8 inside `_register()`, model and
    mtp only as "module:Class" strings, kda by model; vLLM and torch are seen but not followed."""
    graph = static_import_graph(ROOT, ("vllm_ling",))
    assert {"vllm_ling.plugin", "vllm_ling.fp8", "vllm_ling.model", "vllm_ling.draft.mtp", "vllm_ling.kda",
            "vllm_ling.smem_guard", "vllm", "torch"} <= set(graph)
    assert graph["vllm_ling.model"][0] == "vllm_ling.plugin"


@pytest.fixture
def mutant_root(tmp_path) -> Path:
    """A copy of the package to plant imports in."""
    shutil.copytree(ROOT / "vllm_ling", tmp_path / "vllm_ling", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _plant(root: Path, module: str, code: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text(encoding="utf-8") + "\n\n" + code + "\n")


def test_the_static_walk_sees_a_tool_imported_in_a_function_that_never_runs(mutant_root):
    """Negative control: the mutant that passes the dynamic check (a tool imported inside a KDA function)."""
    _plant(mutant_root, "vllm_ling.kda", "def _never_called():\n    from ling_tuning.smem import smem_limit\n")
    found = tools_reached(mutant_root)
    assert any(c.startswith("ling_tuning <- vllm_ling.kda:") for c in found), found


def test_the_static_walk_sees_a_tool_named_as_a_lazy_target(mutant_root):
    """Negative control: a "module:Class" string naming a tool, and a `from package import module` of a helper."""
    _plant(mutant_root, "vllm_ling.plugin", 'LATER = "ling_tools.selfcheck:main"')
    _plant(mutant_root, "vllm_ling.draft.mtp", "def _never_called():\n    from ling_common import metrics\n")
    found = tools_reached(mutant_root)
    assert any(c.startswith("ling_tools.selfcheck <- vllm_ling.plugin:") for c in found), found
    assert any(c.startswith("ling_common <- vllm_ling.draft.mtp:") for c in found), found


def test_the_served_plugin_imports_none_of_our_tools():
    pytest.importorskip("vllm")
    modules = _imported(SERVED)
    assert set(SERVED) <= set(modules)  # the check saw the modules it is about
    assert _tools_among(modules) == [], "the served plugin imports a tool"


def test_the_check_sees_a_tool_when_one_is_imported():
    """Negative control: the same child, asked to import the self-check CLI too, reports it and what it pulls in."""
    pytest.importorskip("vllm")
    found = _tools_among(_imported([*SERVED, "ling_tools.selfcheck"]))
    assert "ling_tools.selfcheck" in found
