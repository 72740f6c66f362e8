"""Prove vLLM itself finds and uses a tuned file: its own name, its own lookup, its own log.

A wrong suffix or folder is silently ignored by vLLM (it warns once and runs default tiles), so
the check runs vLLM's `get_config_file_name`, `get_moe_configs` and `try_get_optimal_moe_config`
with the serve environment (VLLM_TUNED_CONFIG_FOLDER) and records what it logged.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ling_tuning.configfile import TUNED_FOLDER_ENV
from ling_tuning.shapes import MoEShape
from ling_tuning.space import Config

DEFAULT_WARNING = "Using default MoE config"
FUSED_MOE_LOGGER = "vllm.model_executor.layers.fused_moe.fused_moe"


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def tuned_folder(folder: Path | None) -> Iterator[None]:
    """Point vLLM's MoE config lookup at `folder` (None: no override) and drop its lru_cache."""
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    old = os.environ.pop(TUNED_FOLDER_ENV, None)
    if folder is not None:
        os.environ[TUNED_FOLDER_ENV] = str(Path(folder).resolve())
    fm.get_moe_configs.cache_clear()
    try:
        yield
    finally:
        os.environ.pop(TUNED_FOLDER_ENV, None)
        if old is not None:
            os.environ[TUNED_FOLDER_ENV] = old
        fm.get_moe_configs.cache_clear()


def vllm_file_name(shape: MoEShape) -> str:
    """The name vLLM looks for on this machine (its device name, its H200 rule)."""
    from vllm.model_executor.layers.fused_moe.fused_moe import get_config_file_name

    return get_config_file_name(shape.num_experts, shape.intermediate, shape.dtype, [0, shape.group_size])


def prove_vllm_loads(folder: Path, shape: MoEShape, expected: dict[int, Config]) -> dict[str, Any]:
    """Run vLLM's lookup as a served model would; 'loaded' is True only if vLLM returned exactly
    `expected` and picked each tuned entry for its own M without the default-config warning."""
    from vllm.model_executor.layers.fused_moe import fused_moe as fm

    folder = Path(folder).resolve()
    name = vllm_file_name(shape)
    cap = _Capture()
    log = logging.getLogger(FUSED_MOE_LOGGER)
    log.addHandler(cap)
    level = log.level
    log.setLevel(logging.DEBUG)
    try:
        with tuned_folder(folder):
            got = fm.get_moe_configs(shape.num_experts, shape.intermediate, shape.dtype, 0, shape.group_size)
            # The served path: packed w1 [E, 2N, hidden/2], w2 [E, hidden, N/2] (int4: vLLM doubles w2's N).
            w1 = (shape.num_experts, 2 * shape.intermediate, shape.hidden // 2)
            w2 = (shape.num_experts, shape.hidden, shape.intermediate // 2)
            picked = {m: fm.try_get_optimal_moe_config(w1, w2, shape.top_k, shape.dtype, m, [0, shape.group_size])
                      for m in expected}
    finally:
        log.removeHandler(cap)
        log.setLevel(level)
    return {
        "file_name": name,
        "path": str(folder / name),
        "exists": (folder / name).is_file(),
        "env": {TUNED_FOLDER_ENV: str(folder)},
        "loaded": got == expected and all(picked[m] == expected[m] for m in expected),
        "entries": len(got or {}),
        "default_warning": any(DEFAULT_WARNING in msg for msg in cap.messages),
        "vllm_log": cap.messages[-5:],
    }
