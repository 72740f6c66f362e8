"""Shared memory per block by compute capability, for the tools that must not import the plugin (the watchdog).

The table has one home, the plugin's `vllm_ling/smem.py`: the served KDA guard reads it in `register()` and the
plugin imports nothing of ours. That file is standard-library only, so it is loaded here alone, by path, without
running the plugin package or anything it imports.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType


def _plugin_table() -> ModuleType:
    package = importlib.util.find_spec("vllm_ling")  # locates the package without importing it
    if package is None or not package.submodule_search_locations:
        raise ImportError("vllm_ling is not installed: its vllm_ling/smem.py holds the shared-memory table")
    path = Path(next(iter(package.submodule_search_locations))) / "smem.py"
    spec = importlib.util.spec_from_file_location("ling_common._plugin_smem", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_table = _plugin_table()
SMEM_PER_BLOCK: dict[tuple[int, int], int] = _table.SMEM_PER_BLOCK
GB10_SMEM_PER_BLOCK: int = _table.GB10_SMEM_PER_BLOCK
