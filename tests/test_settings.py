"""Every environment variable of ours is declared once, in `vllm_ling/envs.py` (the plugin's) or
`ling_common/envs.py` (the tools'), and read through that registry; docs/configuration.md is generated from them.

A variable of ours is a name starting VLLM_LING_ or LING_. The code is read, not run: every such name spelled as a
string anywhere in an installed package, in the serve recipe or the install and CI scripts must be declared, and
no module but the two registries may read one from os.environ itself.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from ling_common import envs as tool_envs
from ling_tools import configuration
from vllm_ling import envs as plugin_envs

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
NAME = re.compile(r"(?:VLLM_LING|LING)_[A-Z0-9_]*[A-Z0-9]")
DECLARED = set(plugin_envs.VARIABLES) | set(tool_envs.VARIABLES)
REGISTRIES = {ROOT / "vllm_ling" / "envs.py", ROOT / "common" / "envs.py"}
SHELL = [ROOT / "install.sh", ROOT / ".ci" / "run", *sorted((ROOT / "serve").glob("*"))]
# Read by the test harness only (tests/), never by what is installed.
HARNESS = {
    "LING_GPU_RESULTS": "tests/gpu: the folder a device run writes its JSON results into",
    "LING_TP_FAULT": "tests/model/engine_runner.py: the tensor-parallel fault a negative control installs",
    "LING_TUNE_BUDGET_MIN": "tests/gpu/tuning_steps.py: ling-tune's budget in the device run",
    "LING_TUNE_MAX_CANDIDATES": "tests/gpu/tuning_steps.py: candidates per batch size in the device run",
    "LING_TUNE_ENGINE_BACKENDS": "tests/gpu/tuning_steps.py: which MoE backends the device run races",
    "LING_TEST_ENGINE_LOG": "tests/conftest.py: the file each vLLM engine a test starts is recorded in",
    "LING_TEST_NODEID": "tests/conftest.py: the test an engine start is recorded under (engine_probe/)",
    "LING_ENGINE_TIMEOUT": "tests/model/model_helpers.py: seconds an engine script may take (device steps set it)",
}


def python_sources() -> list[Path]:
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def names_spelled(source: str) -> Iterator[tuple[str, int]]:
    """Every string constant that is exactly a variable name of ours, with its line."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
            yield node.value, node.lineno


def _is_environ(node: ast.AST) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" or isinstance(node, ast.Name) and \
        node.id == "environ"


def direct_reads(source: str) -> Iterator[tuple[str, int]]:
    """os.environ.get(X), os.environ[X] (read), os.getenv(X) where X is a name of ours, spelled or through a
    module-level constant."""
    tree = ast.parse(source)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
                 for t in n.targets if isinstance(t, ast.Name)}

    def ours(arg: ast.AST) -> str | None:
        value = arg.value if isinstance(arg, ast.Constant) else constants.get(getattr(arg, "id", None))
        return value if isinstance(value, str) and NAME.fullmatch(value) else None

    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and (f.attr == "get" and _is_environ(f.value) or f.attr == "getenv"):
                key = ours(node.args[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            key = ours(node.slice)
        if key is not None:
            yield key, node.lineno


def _undeclared(paths: list[Path], allowed: set[str]) -> list[str]:
    found = []
    for path in paths:
        text = path.read_text(encoding="utf-8")
        spelled = names_spelled(text) if path.suffix == ".py" else (
            (m.group(0), text.count("\n", 0, m.start()) + 1) for m in NAME.finditer(text))
        found += [f"{path.relative_to(ROOT)}:{line} {name}" for name, line in spelled if name not in allowed]
    return found


def test_every_variable_the_code_names_is_declared():
    assert _undeclared(python_sources(), DECLARED) == []


def test_the_serve_recipe_and_scripts_name_only_declared_variables():
    assert _undeclared([p for p in SHELL if p.is_file()], DECLARED) == []


def test_the_tests_read_only_declared_or_harness_variables():
    tests = sorted(p for p in (ROOT / "tests").rglob("*") if p.suffix in (".py", ".sh"))
    reads = [f"{p.relative_to(ROOT)}:{line} {name}" for p in tests if p.suffix == ".py"
             for name, line in direct_reads(p.read_text(encoding="utf-8"))
             if name not in DECLARED | set(HARNESS)]
    assert reads == []


def test_only_the_registries_read_the_environment_for_our_variables():
    reads = [f"{p.relative_to(ROOT)}:{line} {name}" for p in python_sources() if p not in REGISTRIES
             for name, line in direct_reads(p.read_text(encoding="utf-8"))]
    assert reads == []


def test_each_variable_is_declared_once():
    assert set(plugin_envs.VARIABLES).isdisjoint(tool_envs.VARIABLES)
    assert set(HARNESS).isdisjoint(DECLARED)


def test_only_the_plugins_variables_start_with_vllm():
    """vLLM logs every VLLM_* variable it does not know as unknown (and with --fail-on-environ-validation refuses to
    start); the plugin declares its own to vLLM (compat.declare_env_vars), so the tools' and the test harness's
    variables, which reach vLLM's processes through the environment all the same, are LING_*."""
    theirs = (set(tool_envs.VARIABLES) | set(HARNESS)) - set(plugin_envs.VARIABLES)
    assert sorted(n for n in theirs if n.startswith("VLLM_")) == []


def test_the_registries_answer_by_attribute(monkeypatch):
    monkeypatch.setenv("VLLM_LING_DRAFT_VOCAB", " /tmp/ids.json ")
    monkeypatch.setenv("LING_SMEM_LIMIT", "101376")
    monkeypatch.setenv("LING_WATCHDOG_CONFIG", "/etc/ling.yaml")
    assert plugin_envs.VLLM_LING_DRAFT_VOCAB == "/tmp/ids.json"
    assert plugin_envs.LING_SMEM_LIMIT == 101376
    assert str(tool_envs.LING_WATCHDOG_CONFIG) == "/etc/ling.yaml"
    monkeypatch.setenv("LING_SMEM_LIMIT", "lots")
    with pytest.raises(ValueError, match="LING_SMEM_LIMIT='lots'"):
        plugin_envs.read("LING_SMEM_LIMIT")
    with pytest.raises(AttributeError):
        plugin_envs.VLLM_LING_NOT_A_SETTING  # noqa: B018


def test_the_scan_finds_a_variable_read_but_not_declared():
    """Negative control: spelled in a call, through a constant, and by subscript."""
    source = ('import os\nENV = "VLLM_LING_NEW"\nos.environ.get(ENV)\nos.getenv("LING_OTHER")\n'
              'x = os.environ["LING_THIRD"]\n')
    assert {n for n, _ in names_spelled(source)} == {"VLLM_LING_NEW", "LING_OTHER", "LING_THIRD"}
    assert [n for n, _ in direct_reads(source)] == ["VLLM_LING_NEW", "LING_OTHER", "LING_THIRD"]


def test_the_configuration_doc_is_the_generators_output():
    committed = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == configuration.document(), f"regenerate it: {configuration.COMMAND}"


def test_the_doc_lists_every_declared_variable():
    doc = configuration.document()
    assert all(f"`{name}`" in doc for name in DECLARED)
