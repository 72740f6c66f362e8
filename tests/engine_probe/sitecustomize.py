"""Records every vLLM engine a test starts, in whichever process it starts, for the `engine` marker check.

tests/conftest.py puts this folder first on PYTHONPATH, so that every Python process the tests start (an
engine_runner.py, a `vllm serve` under the watchdog, the engine core it spawns) imports this file at start-up, as
Python imports any `sitecustomize`. Where ENGINE_LOG_ENV names a file, it wraps `EngineCore.__init__` once vLLM's
engine core module is imported (a finder on sys.meta_path, which imports nothing itself): each engine core's start
appends one line, the TEST_ENV of the process (the pytest node id it inherited), to that file. One short append per
line: lines from concurrent processes never interleave. Without ENGINE_LOG_ENV it does nothing. The next
`sitecustomize` on sys.path (a distribution's own) still runs after it.
"""

from __future__ import annotations

import functools
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

ENGINE_LOG_ENV = "LING_TEST_ENGINE_LOG"
TEST_ENV = "LING_TEST_NODEID"
TARGET = "vllm.v1.engine.core"


def record() -> None:
    """Append this process's test id to the engine log."""
    fd = os.open(os.environ[ENGINE_LOG_ENV], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (os.environ.get(TEST_ENV, "?") + "\n").encode())
    finally:
        os.close(fd)


def patch(module) -> None:
    """Make `module.EngineCore.__init__` record first (subclasses such as EngineCoreProc call it)."""
    cls = module.EngineCore
    if getattr(cls.__init__, "ling_records", False):
        return
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        record()
        init(self, *args, **kwargs)

    __init__.ling_records = True
    cls.__init__ = __init__


class _Finder:
    """Finds vLLM's engine core module as the path finder does, and patches it once it has run."""

    def find_spec(self, name, path=None, target=None):
        if name != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def install() -> None:
    """Patch vLLM's engine core now if it is imported, else when it is."""
    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def _chain() -> None:
    """Run the `sitecustomize` this file hides, if the path holds another."""
    here = str(Path(__file__).resolve().parent)
    rest = [p for p in sys.path if p and str(Path(p).resolve()) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


if __name__ == "sitecustomize":
    if os.environ.get(ENGINE_LOG_ENV):
        install()
    _chain()
