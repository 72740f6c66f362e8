"""Suite-wide settings that every process the tests start inherits (engines, the oracle, the demo's server), and the
check that keeps the `engine` marker honest.

One OpenMP thread per process, unless the caller set OMP_NUM_THREADS or the host has an NVIDIA driver (a device
run of tests/gpu keeps the threads it had). The tiny checkpoints' ops are far too small for intra-op threads to
pay, and on a 2-core host a second thread spin-waits for the first whenever another process holds a core: vLLM's
CPU worker keeps torch's threads at the core count (it disables `torch.set_num_threads` after binding, so its own
"reducing to 1 thread" step is skipped), and `index_add_` in the torch MoE then takes ms instead of µs. Measured on the 2-core CI box with another process busy: one engine_runner.py run of
test_engine_vs_oracle.py's batch 281 s with two threads, 46 s with one (outputs equal, logprobs within 1e-5); the
oracle scoring that batch 24 s and 11 s. Set here, before any test module imports torch, so the pytest process
itself starts with one thread too (as tests/model/conftest.py's `single_thread` already asks of its modules).

`-m "not engine"` is the fast lane, so a test that starts a vLLM engine must say so: engine_probe/sitecustomize.py
records each engine core's start, in any process, under the node id of the test that started it, and a test
without the marker that started one fails. The GPU tests (tests/gpu, skipped without CUDA) start GPU engines by
design and are not held to it.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

if not Path("/proc/driver/nvidia/version").exists():
    os.environ.setdefault("OMP_NUM_THREADS", "1")

PROBE_DIR = Path(__file__).parent / "engine_probe"
GPU_DIR = Path(__file__).parent / "gpu"
LOG_KEY = pytest.StashKey[Path]()


def _load_probe():
    """engine_probe/sitecustomize.py under a name of its own (this process's `sitecustomize` is another)."""
    spec = importlib.util.spec_from_file_location("engine_probe", PROBE_DIR / "sitecustomize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


probe = _load_probe()


def pytest_configure(config: pytest.Config) -> None:
    """A fresh engine log for this run, named to every process the tests start, and the probe in this one."""
    fd, log = tempfile.mkstemp(prefix="ling-engines-", suffix=".log")
    os.close(fd)
    config.stash[LOG_KEY] = Path(log)
    os.environ[probe.ENGINE_LOG_ENV] = log
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(PROBE_DIR), os.environ.get("PYTHONPATH")) if p)
    probe.install()


def pytest_unconfigure(config: pytest.Config) -> None:
    config.stash[LOG_KEY].unlink(missing_ok=True)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    os.environ[probe.TEST_ENV] = item.nodeid


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Fail a passing test without the `engine` marker that started a vLLM engine (its fixtures' setup included)."""
    outcome = yield
    report = outcome.get_result()
    if report.when != "call" or not report.passed or item.get_closest_marker("engine") or GPU_DIR in item.path.parents:
        return
    starts = item.config.stash[LOG_KEY].read_text().splitlines().count(item.nodeid)
    if starts:
        report.outcome = "failed"
        report.longrepr = (f"{item.nodeid} started {starts} vLLM engine(s) without @pytest.mark.engine: mark it, so "
                           "that the fast lane (-m 'not engine') leaves it out")
