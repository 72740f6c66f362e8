"""The `engine` marker check (tests/conftest.py, tests/engine_probe/sitecustomize.py) on a stand-in for vLLM: a
package whose `vllm.v1.engine.core.EngineCore` does nothing, so the check is proven in seconds without an engine.

A test run in a subprocess of its own, with this suite's conftest and probe: a test that starts an "engine" in a
subprocess without the marker fails and says why; with the marker it passes; a process that only imports the
engine core module records nothing; a test under gpu/ (a GPU engine test, skipped without CUDA) is not held to it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent

FAKE_CORE = '''
class EngineCore:
    def __init__(self, *args, **kwargs):
        self.args = args


class EngineCoreProc(EngineCore):  # vLLM's engine core process calls EngineCore.__init__ through super()
    def __init__(self):
        super().__init__("proc")
'''

TESTS_FILE = '''
import os
import subprocess
import sys

import pytest


def python(code):
    subprocess.run([sys.executable, "-c", code], check=True,
                   env={**os.environ, "PYTHONPATH": os.pathsep.join(["FAKE", os.environ["PYTHONPATH"]])})


def test_unmarked_start():
    python("from vllm.v1.engine.core import EngineCoreProc; EngineCoreProc()")


@pytest.mark.engine
def test_marked_start():
    python("from vllm.v1.engine.core import EngineCore; EngineCore()")


def test_import_only():
    python("import vllm.v1.engine.core")
'''


def _stand_in(root: Path) -> Path:
    """A `vllm` package holding only v1/engine/core.py, under root/fake."""
    core = root / "fake" / "vllm" / "v1" / "engine"
    core.mkdir(parents=True)
    for folder in (core, core.parent, core.parent.parent):
        (folder / "__init__.py").write_text("")
    (core / "core.py").write_text(FAKE_CORE)
    return root / "fake"


def test_an_unmarked_test_that_starts_an_engine_fails_and_a_marked_one_passes(tmp_path):
    fake = _stand_in(tmp_path)
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(TESTS / "conftest.py", suite / "conftest.py")
    shutil.copytree(TESTS / "engine_probe", suite / "engine_probe")
    (suite / "pytest.ini").write_text("[pytest]\nmarkers =\n    engine: starts a real vLLM engine\n")
    (suite / "test_stand_in.py").write_text(TESTS_FILE.replace('"FAKE"', repr(str(fake))))
    (suite / "gpu").mkdir()
    (suite / "gpu" / "test_gpu_stand_in.py").write_text(TESTS_FILE.replace('"FAKE"', repr(str(fake)))
                                                         .replace("def test_", "def test_gpu_"))
    env = {k: v for k, v in os.environ.items() if k not in ("LING_TEST_ENGINE_LOG", "LING_TEST_NODEID")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)  # the copy's probe only
                                        if p and Path(p) != TESTS / "engine_probe")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert "1 failed, 5 passed" in out, out
    assert "FAILED test_stand_in.py::test_unmarked_start" in out, out
    assert "started 1 vLLM engine(s) without @pytest.mark.engine" in out, out
