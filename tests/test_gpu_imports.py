"""The GPU tests import what our packages really define. Without CUDA they skip at `import gpu_helpers`, before
any later import runs, so a renamed or removed name (a refactor removed `router_gemm.BLOCK_E`, which
tests/gpu/test_router_gemm_gpu.py still imported) would surface only on the device, costing device time. This reads
every `from <our module> import NAME` in tests/gpu/*.py, module-level or in a function, and checks NAME exists."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

GPU_TESTS = Path(__file__).parent / "gpu"
OURS = ("vllm_ling", "ling_tuning", "ling_bench", "ling_watchdog", "criteria")  # criteria: tests/gpu's own, no CUDA


def our_imports(source: str) -> list[tuple[str, str, int]]:
    """(module, name, line) for every `from <our package> import name` in `source`."""
    return [(node.module, alias.name, node.lineno) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
            and node.module.split(".")[0] in OURS for alias in node.names]


def missing_names(folder: Path) -> list[str]:
    out = []
    for path in sorted(folder.glob("*.py")):
        for module, name, line in our_imports(path.read_text()):
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                out.append(f"{path.name}:{line}: {module} does not import ({e})")
                continue
            if not hasattr(mod, name):
                try:
                    importlib.import_module(f"{module}.{name}")  # a submodule
                except ImportError:
                    out.append(f"{path.name}:{line}: {module} has no {name}")
    return out


def test_every_name_the_gpu_tests_import_from_our_packages_exists(monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.syspath_prepend(str(GPU_TESTS))
    assert missing_names(GPU_TESTS) == []


def test_a_missing_name_is_found(tmp_path):
    """Negative control: the import that refactor broke, and a module that is not there."""
    pytest.importorskip("vllm")
    (tmp_path / "test_x_gpu.py").write_text("from vllm_ling.ops.router_gemm import BLOCK_E, MAX_TOKENS\n"
                                            "def f():\n    from vllm_ling.nowhere import thing\n")
    found = missing_names(tmp_path)
    assert len(found) == 2 and "router_gemm has no BLOCK_E" in found[0] and "vllm_ling.nowhere" in found[1]
