"""vllm-ling's settings that pick one of a fixed list from the environment (as vLLM's own `vllm/envs.py`)."""

from __future__ import annotations

import os
from collections.abc import Sequence


def choice(name: str, choices: Sequence[str], default: str, safe: str | None = None) -> str:
    """$name, lower-cased; `default` when unset or blank. Any other value is refused with the setting, the
    value, the choices and the safe alternative (`safe`, or unsetting it)."""
    asked = os.environ.get(name, default).strip().lower() or default
    if asked not in choices:
        raise ValueError(f"vllm-ling: {name}={asked!r} is not one of {', '.join(choices)}; "
                         f"{safe or f'unset it for the default ({default})'}")
    return asked
