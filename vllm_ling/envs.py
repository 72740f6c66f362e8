"""vllm-ling's settings that pick one of a fixed list from the environment (as vLLM's own `vllm/envs.py`).

A setting read while vLLM builds the model can change the graph torch.compile traces (VLLM_LING_KDA_GATE does),
but vLLM's compile-cache key hashes only vLLM's own settings (`vllm.envs.compile_factors`) and the config. So
every choice read under a current vLLM config is also written into that config's `additional_config`, which the
key hashes: an engine started with another value compiles afresh. Without it, an engine loaded a graph traced
for the other KDA gate from the cache and failed at its first step (H200, 2026-12-01).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

COMPILE_KEY = "vllm_ling"  # additional_config[COMPILE_KEY] = {setting: value read while the model was built}


def choice(name: str, choices: Sequence[str], default: str, safe: str | None = None) -> str:
    """$name, lower-cased; `default` when unset or blank. Any other value is refused with the setting, the
    value, the choices and the safe alternative (`safe`, or unsetting it)."""
    asked = os.environ.get(name, default).strip().lower() or default
    if asked not in choices:
        raise ValueError(f"vllm-ling: {name}={asked!r} is not one of {', '.join(choices)}; "
                         f"{safe or f'unset it for the default ({default})'}")
    into_compile_key(name, asked)
    return asked


def into_compile_key(name: str, value: str) -> None:
    """Record a setting read while the model is built in the current vLLM config's compile-cache key."""
    from vllm.config import get_current_vllm_config_or_none

    config = get_current_vllm_config_or_none()
    if config is not None and isinstance(config.additional_config, dict):
        config.additional_config.setdefault(COMPILE_KEY, {})[name] = value
