"""The import graph of every package the project installs, read from the source (imports inside functions too):
no module imports itself back, however lazily, and each package stays on its side of the layout.

Layers, bottom up: `vllm_ling` (the served plugin: vLLM, torch and itself; tests/model/test_plugin_imports.py),
`ling_common` (torch-free helpers, importing none of ours), then the tools (`ling_tools`, `ling_watchdog`,
`ling_tuning`, `ling_bench`), which may import both. The watchdog never imports the plugin: it runs beside a
server, often without vLLM or torch installed in its interpreter.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "model"))  # its import reader, shared with the plugin's check
from import_scan import imported_names  # noqa: E402

Graph = dict[str, dict[str, int]]  # module -> {module of ours it imports: first line}


def package_dirs(root: Path = ROOT) -> dict[str, Path]:
    """Import name -> folder, as pyproject maps them."""
    mapping = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: root / folder for name, folder in mapping.items()}


def modules(dirs: Mapping[str, Path]) -> dict[str, Path]:
    """Every module of ours by dotted name (a package by its own name, for its __init__)."""
    found = {}
    for name, folder in dirs.items():
        for path in folder.rglob("*.py"):
            parts = [name, *path.relative_to(folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph(dirs: Mapping[str, Path]) -> Graph:
    """Edges between our modules. `from pkg import mod` is an edge to pkg.mod; an edge to a package that holds the
    importer is left out (Python has initialised it before the importer runs, so it closes no cycle)."""
    ours = modules(dirs)
    graph: Graph = {}
    for name, path in ours.items():
        edges = graph.setdefault(name, {})
        for target, line in imported_names(path.read_text(encoding="utf-8"), name, path.name == "__init__.py"):
            if target not in ours or target == name or name.startswith(target + "."):
                continue
            edges.setdefault(target, line)
    for name, edges in graph.items():  # `from a import b` also yielded a: keep a only when b is not a module
        for target in [t for t in edges if any(u.startswith(t + ".") for u in edges)]:
            del edges[target]
    return graph


def cycles(graph: Graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(graph[child])))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def _edges_into(graph: Graph, importers: str, imported: str) -> list[str]:
    return [f"{m}:{line} -> {t}" for m, edges in sorted(graph.items()) if m.split(".")[0] == importers
            for t, line in edges.items() if t.split(".")[0] == imported]


GRAPH = import_graph(package_dirs())


def test_every_installed_package_is_in_the_graph():
    assert set(package_dirs()) == {"vllm_ling", "ling_common", "ling_tools", "ling_watchdog", "ling_tuning",
                                   "ling_bench"}
    assert {"ling_tools.selfcheck", "ling_common.metrics", "ling_watchdog.cli", "ling_bench.bench"} <= set(GRAPH)


def test_no_module_imports_itself_back_however_lazily():
    assert cycles(GRAPH) == []


def test_the_watchdog_does_not_import_the_plugin():
    assert _edges_into(GRAPH, "ling_watchdog", "vllm_ling") == []


def test_the_shared_helpers_import_none_of_ours():
    ours = set(package_dirs()) - {"ling_common"}
    assert [e for p in ours for e in _edges_into(GRAPH, "ling_common", p)] == []


def test_the_plugin_imports_none_of_ours():
    ours = set(package_dirs()) - {"vllm_ling"}
    assert [e for p in ours for e in _edges_into(GRAPH, "vllm_ling", p)] == []


def test_a_lazy_cycle_is_found(tmp_path):
    """Negative control: two modules, one importing the other inside a function that never runs."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def later():\n    from pkg.a import thing\n")
    (pkg / "c.py").write_text("import pkg\nfrom pkg import a\n")  # its own package and a one-way edge: no cycle
    assert cycles(import_graph({"pkg": pkg})) == [["pkg.a", "pkg.b"]]

