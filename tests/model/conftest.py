"""Fixtures for whole-model tests: the tiny checkpoint, a real vLLM CPU engine and the transformers oracle.

Engines and the oracle each run in their own subprocess (fresh vLLM, explicit environment, no state
shared with pytest); results come back as JSON.
"""

from __future__ import annotations

import pytest
import torch

from model_helpers import CPU_ENGINE_ENV, run_script
from shared_engines import SharedEngines


@pytest.fixture(scope="session")
def run_engine(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("engine")

    def run(spec: dict, name: str, env: dict | None = None) -> dict:
        return run_script("engine_runner.py", spec, tmp, name, {**CPU_ENGINE_ENV, **(env or {})})

    return run


@pytest.fixture(scope="session")
def shared_engine(tmp_path_factory):
    """`shared_engine(request)`: the result of a request declared with shared_engines.declare, its engine started
    once per session for every request declared on it."""
    return SharedEngines(tmp_path_factory.mktemp("shared-engines")).result


@pytest.fixture(scope="session")
def run_oracle(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("oracle")

    def run(spec: dict, name: str) -> dict:
        return run_script("oracle.py", spec, tmp, name)

    return run


@pytest.fixture(scope="session")
def tiny_bf16() -> str:
    from ling_tools.tiny import ensure_tiny

    return str(ensure_tiny(seed=0))


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors: intra-op threads only add sync overhead (10x on a loaded 2-core host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
