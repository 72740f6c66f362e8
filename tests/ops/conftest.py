"""flash-linear-attention 0.6.0's torch references, loaded without its Triton ops.

The references live in the `fla-core` distribution (`pip install fla-core==0.6.0 --no-deps`); the
`flash-linear-attention` wheel itself only holds `fla/layers` and `fla/models`. Importing `fla.ops.kda.naive`
runs `fla/ops/__init__.py`, which imports ~40 Triton op modules (8 s, and warnings on a CPU-only host), so the
files are read directly: `naive.py` needs only torch and einops; `gate.py` mixes its torch references with
Triton kernels, so only its two `naive_*` functions are compiled.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F


def _fla_kda_dir() -> Path:
    spec = importlib.util.find_spec("fla")  # finds the top-level package without running it
    if spec is None or not (Path(spec.submodule_search_locations[0]) / "ops/kda/naive.py").exists():
        pytest.skip("flash-linear-attention's ops are missing: pip install fla-core==0.6.0 --no-deps")
    return Path(spec.submodule_search_locations[0]) / "ops/kda"


@pytest.fixture(scope="session")
def fla_naive() -> types.ModuleType:
    """`fla/ops/kda/naive.py`: `naive_recurrent_kda`, `naive_chunk_kda` (layouts [B, T, H, .], state [B, H, K, V])."""
    pytest.importorskip("einops")
    spec = importlib.util.spec_from_file_location("fla_kda_naive", _fla_kda_dir() / "naive.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def fla_gate() -> types.SimpleNamespace:
    """`naive_kda_gate` (softplus law) and `naive_kda_lowerbound_gate` (safe gate) from `fla/ops/kda/gate.py`."""
    names = ("naive_kda_gate", "naive_kda_lowerbound_gate")
    source = (_fla_kda_dir() / "gate.py").read_text()
    tree = ast.parse(source)
    tree.body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
    namespace = {"torch": torch, "F": F}
    exec(compile(tree, "fla/ops/kda/gate.py", "exec"), namespace)  # noqa: S102 (FLA's own reference code)
    return types.SimpleNamespace(**{name: namespace[name] for name in names})


# Our Triton kernels on a CPU: Triton's interpreter must be chosen before anything compiles, and vLLM's
# `triton_utils` hides Triton on a CPU host, so the child process hands the real module to it first.
_INTERPRETER_PRELUDE = """
import triton, triton.language as tl
import vllm.triton_utils as tu
tu.triton, tu.tl = triton, tl
"""


@pytest.fixture(scope="session")
def interpret() -> Callable[..., object]:
    """`interpret(code, *argv, timeout=300)`: run `code` (which prints one JSON line last) in a child process
    under Triton's interpreter (TRITON_INTERPRET=1), and return that JSON."""
    def run(code: str, *argv: str, timeout: float = 300) -> object:
        done = subprocess.run([sys.executable, "-c", _INTERPRETER_PRELUDE + code, *argv], capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "TRITON_INTERPRET": "1"})
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    return run


@pytest.fixture(autouse=True)
def _single_thread():
    """The test tensors are tiny: intra-op threads only add sync overhead (10x under a loaded 2-core host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
